"""Headless output: the same events the console shows, printed as text lines or JSONL."""

from __future__ import annotations

import shutil
import sys
from typing import Any, TextIO

from runners import kinds
from runners.cells import SETUP_CELL, CellState, params_label
from runners.events import (
    ArtifactFetched,
    CellFinished,
    CellStarted,
    Connection,
    Error,
    Event,
    LockAcquired,
    LockBusy,
    OutputLines,
    Progress,
    RunFinished,
    RunStarted,
)
from runners.kind import KindPrinter
from runners.progress import ProgressLines, progress_text

CLEAR = "\r\x1b[2K"


class ProgressShow:
    """Progress of long work on a stream: on a terminal one line redrawn in place (cleared
    before any other output), otherwise a plain line now and then (CI logs)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.plain = ProgressLines()
        self.transient = False

    def show(self, p: Progress) -> None:
        if self.tty:
            width = max(20, shutil.get_terminal_size().columns - 1)
            self.out.write(CLEAR + ("" if p.finished else progress_text(p)[:width]))
            self.transient = not p.finished
        elif self.plain.wants(p):
            self.out.write(f"progress: {progress_text(p)}\n")
        self.out.flush()

    def clear(self) -> None:
        """Before a line of other output: take the redrawn line away."""
        if self.transient:
            self.out.write(CLEAR)
            self.transient = False


class Printer:
    """Turns events into the lines a headless run prints; replay feeds it the recorded events."""

    def __init__(self, out: TextIO | None = None, json_lines: bool = False) -> None:
        self.out = out or sys.stdout
        self.json_lines = json_lines
        self.total = 0
        self.cells: dict[int, dict[str, Any]] = {}
        self.kind: KindPrinter = KindPrinter()
        self.progress = ProgressShow(self.out)

    def __call__(self, event: Event) -> None:
        if isinstance(event, Progress):
            if not self.json_lines:  # --json prints the record's events; progress is not one
                self.progress.show(event)
            return
        if self.json_lines:
            self.out.write(event.to_json().decode() + "\n")
        else:
            lines = self.lines(event)
            if lines:
                self.progress.clear()
            for line in lines:
                self.out.write(line + "\n")
        self.out.flush()

    def track(self, event: Event) -> None:
        """Take an event into the printer's state without printing it (a record replayed
        silently, so later lines are numbered as the run's cells are)."""
        self.lines(event)

    def _tag(self, cell: int) -> str:
        if cell == SETUP_CELL:
            return "[setup]"
        width = len(str(self.total))
        return f"[{cell + 1:>{width}}/{self.total}]"

    def lines(self, event: Event) -> list[str]:
        if isinstance(event, RunStarted):
            self.total = len(event.cells)
            self.cells = {
                c["index"]: {"params": c["params"], "state": CellState.PENDING} for c in event.cells
            }
            kind = kinds.all_kinds().get(event.kind)
            self.kind = kind.printer() if kind is not None else KindPrinter()
            env = params_label(event.env) or "(none)"
            verb = "attached to" if event.attached else "run"
            return [
                f"tracedeck {verb} {event.run_id}: preset {event.preset} ({event.kind}), "
                f"{self.total} cells on {event.target}",
                f"  local dir:   {event.local_dir}",
                f"  remote dir:  {event.remote_dir}",
                f"  determinism: profile {event.profile}; {env}",
                *(f"  note:        {note}" for note in event.notes),
            ]
        if isinstance(event, LockAcquired):
            h = event.holder
            return [
                f"  lock:        {event.lock} held by {h.get('user')}@{h.get('console_host')} "
                f"(run {h.get('run_id')}, pgid {h.get('pgid')})"
            ]
        if isinstance(event, LockBusy):
            h = event.holder
            return [
                f"lock busy: {event.lock} is held by run {h.get('run_id')} of "
                f"{h.get('user')}@{h.get('console_host')} (preset {h.get('preset')}, "
                f"started {h.get('started_at')}, pgid {h.get('pgid')})"
            ]
        if isinstance(event, CellStarted):
            self.cells.setdefault(event.cell, {"params": event.params})["state"] = CellState.RUNNING
            return [f"{self._tag(event.cell)} start  {params_label(event.params)}"]
        if isinstance(event, OutputLines):
            mark = "|" if event.stream == "stdout" else "!"
            return [f"{self._tag(event.cell)} {mark} {line}" for line in event.lines]
        if isinstance(event, CellFinished):
            info = self.cells.setdefault(event.cell, {"params": {}})
            info.update(state=event.state, exit_code=event.exit_code, duration=event.duration_s)
            took = f" in {event.duration_s:.1f}s" if event.duration_s is not None else ""
            code = f" exit {event.exit_code}" if event.exit_code is not None else ""
            return [f"{self._tag(event.cell)} {event.state}{code}{took}"]
        if isinstance(event, ArtifactFetched):
            return [
                f"{self._tag(event.cell)} fetched {event.path} ({event.size} bytes, "
                f"sha256 {event.sha256[:16]})"
            ]
        if isinstance(event, Connection):
            extra = f" (attempt {event.attempt})" if event.attempt else ""
            return [f"connection {event.state}{extra}: {event.message}"]
        if isinstance(event, Error):
            return [f"error: {event.message}"]
        if isinstance(event, RunFinished):
            return self._final(event)
        return self.kind.lines(event)

    def _final(self, event: RunFinished) -> list[str]:
        lines = []
        if self.cells:
            lines.append("")
            lines.append(f"{'cell':>5}  {'state':<10} {'exit':>4} {'time':>7}  params")
            for index in sorted(self.cells):
                c = self.cells[index]
                dur = c.get("duration")
                lines.append(
                    f"{'setup' if index < 0 else index + 1:>5}  {c.get('state', 'pending'):<10} "
                    f"{'' if c.get('exit_code') is None else c['exit_code']:>4} "
                    f"{'' if dur is None else f'{dur:.1f}s':>7}  "
                    f"{params_label(c.get('params', {}))}"
                )
        lines += self.kind.final(event)
        for problem in event.summary.get("engine_errors") or []:
            lines.append(f"engine error: {problem}")
        if event.summary.get("error"):
            lines.append(str(event.summary["error"]))
        lines.append(f"RESULT: {event.verdict} (exit {event.exit_code})")
        return lines
