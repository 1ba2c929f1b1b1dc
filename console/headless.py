"""Headless output: the same events the console shows, printed as text lines or JSONL."""

from __future__ import annotations

import shutil
import sys
from typing import Any, TextIO

from console.safe_text import clean
from runners import kinds
from runners.cells import SETUP_CELL, CellState, params_label
from runners.events import (
    ArtifactFetched,
    CellFinished,
    CellRequeued,
    CellStarted,
    Connection,
    EngineVersion,
    Error,
    Event,
    HostAssigned,
    HostState,
    JobSubmitted,
    LockAcquired,
    LockBusy,
    OutputLines,
    Progress,
    RunFinished,
    RunStarted,
    SchedulerState,
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
            for line in lines:  # engine text among them: no escape reaches the terminal
                self.out.write(clean(line) + "\n")
        self.out.flush()

    def track(self, event: Event) -> None:
        """Take an event into the printer's state without printing it (a record replayed
        silently, so later lines are numbered as the run's cells are)."""
        self.lines(event)

    def _tag(self, cell: int, host: str = "") -> str:
        at = f" @{host}" if host else ""  # the fleet host the cell runs on
        if cell == SETUP_CELL:
            return f"[setup{at}]"
        width = len(str(self.total))
        return f"[{cell + 1:>{width}}/{self.total}{at}]"

    def lines(self, event: Event) -> list[str]:
        lines = self._lines(event)
        if (
            event.host
            and lines
            and not isinstance(event, CellStarted | OutputLines | CellFinished | ArtifactFetched)
        ):
            lines = [f"{event.host}: {line}" for line in lines]
        return lines

    def _lines(self, event: Event) -> list[str]:
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
        if isinstance(event, EngineVersion):
            got = event.version or "unknown"
            return [f"  engine:      {got}" + (f" ({event.error})" if event.error else "")]
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
            info = self.cells.setdefault(event.cell, {"params": event.params})
            info["state"] = CellState.RUNNING
            if event.host:
                info["host"] = event.host
            return [f"{self._tag(event.cell, event.host)} start  {params_label(event.params)}"]
        if isinstance(event, OutputLines):
            mark = "|" if event.stream == "stdout" else "!"
            tag = self._tag(event.cell, event.host)
            return [f"{tag} {mark} {line}" for line in event.lines]
        if isinstance(event, CellFinished):
            info = self.cells.setdefault(event.cell, {"params": {}})
            info.update(state=event.state, exit_code=event.exit_code, duration=event.duration_s)
            if event.host:
                info["host"] = event.host
            if event.scheduler:
                info["scheduler"] = event.scheduler
            took = f" in {event.duration_s:.1f}s" if event.duration_s is not None else ""
            code = f" exit {event.exit_code}" if event.exit_code is not None else ""
            why = ""
            if event.scheduler:
                why = f" ({event.scheduler}" + (
                    f": {event.stderr_tail})" if event.stderr_tail else ")"
                )
            elif event.stderr_tail and event.exit_code is None:
                why = f" ({event.stderr_tail})"
            return [f"{self._tag(event.cell, event.host)} {event.state}{code}{took}{why}"]
        if isinstance(event, ArtifactFetched):
            return [
                f"{self._tag(event.cell, event.host)} fetched {event.path} ({event.size} bytes, "
                f"sha256 {event.sha256[:16]})"
            ]
        if isinstance(event, HostAssigned):
            cells = ", ".join(str(c + 1) for c in event.cells)
            return [f"cells {cells} start in {event.run_dir} (lock {event.lock})"]
        if isinstance(event, HostState):
            return [f"host {event.state}" + (f": {event.message}" if event.message else "")]
        if isinstance(event, CellRequeued):
            info = self.cells.setdefault(event.cell, {"params": {}})
            info["state"] = CellState.PENDING
            return [f"{self._tag(event.cell)} requeued: {event.reason}"]
        if isinstance(event, JobSubmitted):
            cells = ", ".join(str(c + 1) for c in event.cells)
            part = f" to partition {event.partition}" if event.partition else ""
            return [f"  {event.scheduler}:       job {event.job_id}{part} (cells {cells})"]
        if isinstance(event, SchedulerState):
            info = self.cells.setdefault(event.cell, {"params": {}})
            info["scheduler"] = event.state
            if event.node:
                info["host"] = event.node
            reason = f" ({event.reason})" if event.reason else ""
            node = f" on {event.node}" if event.node else ""
            return [f"{self._tag(event.cell)} slurm {event.state}{reason}{node}"]
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
            hosts = any(c.get("host") for c in self.cells.values())
            sched = any(c.get("scheduler") for c in self.cells.values())
            head = f"{'cell':>5}  {'state':<10} {'exit':>4} {'time':>7}  "
            head += f"{'host':<16} " if hosts else ""
            head += f"{'slurm':<13} " if sched else ""
            lines.append("")
            lines.append(head + "params")
            for index in sorted(self.cells):
                c = self.cells[index]
                dur = c.get("duration")
                row = (
                    f"{'setup' if index < 0 else index + 1:>5}  {c.get('state', 'pending'):<10} "
                    f"{'' if c.get('exit_code') is None else c['exit_code']:>4} "
                    f"{'' if dur is None else f'{dur:.1f}s':>7}  "
                )
                row += f"{c.get('host', ''):<16} " if hosts else ""
                row += f"{c.get('scheduler', ''):<13} " if sched else ""
                lines.append(row + params_label(c.get("params", {})))
        lines += self.kind.final(event)
        for host, info in (event.summary.get("hosts") or {}).items():
            ran = ", ".join(str(c + 1) for c in info.get("cells", [])) or "none"
            extra = f" ({info['message']})" if info.get("message") else ""
            lines.append(f"host {host}: {info.get('state')}{extra}; cells {ran}")
        for problem in event.summary.get("engine_errors") or []:
            lines.append(f"engine error: {problem}")
        if event.summary.get("error"):
            lines.append(str(event.summary["error"]))
        lines.append(f"RESULT: {event.verdict} (exit {event.exit_code})")
        return lines
