"""The console's state of one run, built by folding events in; knows nothing about widgets."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from runners.cells import NO_CELL, SETUP_CELL, CellState, params_label
from runners.events import (
    ArtifactFetched,
    ArtifactHeld,
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
    TraceBatch,
)

LOG_LINES = 5000
# Log lines that are not a cell's output (errors, connection changes) carry this cell number.
RUN_CELL = NO_CELL

__all__ = ["SETUP_CELL", "RUN_CELL", "RunModel", "params_label", "varying_keys"]


def varying_keys(params: Iterable[dict[str, Any]]) -> set[str]:
    """Parameter names whose value differs between at least two cells."""
    seen: dict[str, set[str]] = {}
    for p in params:
        for key, value in p.items():
            seen.setdefault(key, set()).add(repr(value))
    return {key for key, values in seen.items() if len(values) > 1}


@dataclass(slots=True)
class CellRow:
    index: int
    params: dict[str, Any]
    command: str = ""
    state: str = CellState.PENDING
    exit_code: int | None = None
    duration_s: float | None = None
    started_t: float | None = None


@dataclass(slots=True)
class Header:
    run_id: str = ""
    preset: str = ""
    kind: str = ""
    target: str = ""
    local_dir: str = ""
    remote_dir: str = ""
    profile: str = ""
    env: dict[str, str] = field(default_factory=dict)
    attached: bool = False
    lock: str = ""
    holder: dict[str, Any] = field(default_factory=dict)
    lock_busy: bool = False
    started_t: float | None = None


@dataclass(slots=True)
class Changes:
    """What changed since the last take_changes(); widgets redraw only these parts."""

    header: bool = False
    # dicts used as ordered sets: rows appear in the order their events arrived
    cells: dict[int, None] = field(default_factory=dict)
    log_new: int = 0
    connection: bool = False
    errors: bool = False
    finished: bool = False
    progress: bool = False

    def __bool__(self) -> bool:
        return bool(
            self.header
            or self.cells
            or self.log_new
            or self.connection
            or self.errors
            or self.finished
            or self.progress
        )


class RunModel:
    """Folds what every run has: header, cells, log, errors, result (a kind's panel the rest)."""

    def __init__(self, log_lines: int = LOG_LINES) -> None:
        self.header = Header()
        self.cells: dict[int, CellRow] = {}
        self.log: deque[tuple[int, str, str]] = deque(maxlen=log_lines)
        self.log_total = 0
        self.connection: Connection | None = None
        self.errors: list[Error] = []
        self.held: set[tuple[int, str]] = set()  # artifacts left on the host, not fetched yet
        self.finished: RunFinished | None = None
        self.events = 0
        self.trace_records = 0
        self.artifacts = 0
        self.last_t: float | None = None
        # Long work under way (fetch, judge, follow), newest state of each; gone when done.
        self.progress: dict[tuple[str, str], Progress] = {}
        self._changes = Changes()

    # -- reading ------------------------------------------------------------------------------

    def take_changes(self) -> Changes:
        changes, self._changes = self._changes, Changes()
        return changes

    def log_tail(self, count: int, cell: int | None = None) -> list[tuple[int, str, str]]:
        """The last `count` kept log lines (of one cell when given), oldest first."""
        if cell is None:
            start = max(0, len(self.log) - count)
            return list(itertools.islice(self.log, start, None))
        picked = [entry for entry in reversed(self.log) if entry[0] == cell]
        return picked[:count][::-1]

    def cell_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for row in self.cells.values():
            if row.index >= 0:
                counts[row.state] = counts.get(row.state, 0) + 1
        return counts

    def elapsed(self, now: float | None) -> float | None:
        """Seconds since the run started: to its end when finished, else to `now`."""
        start = self.header.started_t
        if start is None:
            return None
        end = self.finished.t if self.finished is not None else now
        return None if end is None else max(0.0, end - start)

    # -- folding ------------------------------------------------------------------------------

    def apply_all(self, events: Iterable[Event]) -> None:
        for event in events:
            self.apply(event)

    def apply(self, event: Event) -> None:
        self.events += 1
        self.last_t = event.t
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)

    def _run_started(self, event: RunStarted) -> None:
        h = self.header
        h.run_id, h.preset, h.kind, h.target = event.run_id, event.preset, event.kind, event.target
        h.local_dir, h.remote_dir, h.profile = event.local_dir, event.remote_dir, event.profile
        h.env, h.attached = dict(event.env), event.attached
        if h.started_t is None or not event.attached:
            h.started_t = event.t
        self._changes.header = True
        for note in event.notes:
            self._log_run(f"note: {note}")
        for cell in event.cells:
            index = int(cell["index"])
            if index not in self.cells:
                self.cells[index] = CellRow(index, dict(cell["params"]), cell.get("command", ""))
                self._changes.cells[index] = None

    def _lock(self, event: LockAcquired | LockBusy) -> None:
        self.header.lock = event.lock
        self.header.holder = dict(event.holder)
        self.header.lock_busy = isinstance(event, LockBusy)
        self._changes.header = True

    def _cell_started(self, event: CellStarted) -> None:
        row = self.cells.get(event.cell)
        if row is None:
            row = self.cells[event.cell] = CellRow(event.cell, dict(event.params), event.command)
        row.state = CellState.RUNNING
        row.started_t = event.t
        self._changes.cells[event.cell] = None

    def _cell_finished(self, event: CellFinished) -> None:
        row = self.cells.get(event.cell)
        if row is None:
            row = self.cells[event.cell] = CellRow(event.cell, {})
        row.state = event.state
        row.exit_code = event.exit_code
        row.duration_s = event.duration_s
        self._changes.cells[event.cell] = None

    def _output(self, event: OutputLines) -> None:
        for line in event.lines:
            self.log.append((event.cell, event.stream, line))
        self.log_total += len(event.lines)
        self._changes.log_new += len(event.lines)

    def _trace(self, event: TraceBatch) -> None:
        self.trace_records += event.last_line - event.first_line + 1

    def _artifact(self, event: ArtifactFetched) -> None:
        self.artifacts += 1
        if (event.cell, event.path) in self.held:
            self.held.discard((event.cell, event.path))
            self._log_run(f"fetched {event.path} ({event.size} bytes)")

    def _held(self, event: ArtifactHeld) -> None:
        self.held.add((event.cell, event.path))

    def _connection(self, event: Connection) -> None:
        self.connection = event
        self._changes.connection = True
        attempt = f" (attempt {event.attempt})" if event.attempt else ""
        self._log_run(f"connection {event.state}{attempt}: {event.message}")

    def _error(self, event: Error) -> None:
        self.errors.append(event)
        self._changes.errors = True
        self._log_run(f"error: {event.message}")

    def _run_finished(self, event: RunFinished) -> None:
        self.finished = event
        self._changes.finished = True
        if self.progress:
            self.progress.clear()
            self._changes.progress = True

    def _progress(self, event: Progress) -> None:
        key = (event.what, event.label)
        if event.finished:
            self.progress.pop(key, None)
        else:
            self.progress[key] = event
        self._changes.progress = True

    def _log_run(self, line: str) -> None:
        self.log.append((RUN_CELL, "tracedeck", line))
        self.log_total += 1
        self._changes.log_new += 1


_HANDLERS: dict[type[Event], Any] = {
    RunStarted: RunModel._run_started,
    LockAcquired: RunModel._lock,
    LockBusy: RunModel._lock,
    CellStarted: RunModel._cell_started,
    CellFinished: RunModel._cell_finished,
    OutputLines: RunModel._output,
    TraceBatch: RunModel._trace,
    ArtifactFetched: RunModel._artifact,
    ArtifactHeld: RunModel._held,
    Connection: RunModel._connection,
    Error: RunModel._error,
    RunFinished: RunModel._run_finished,
    Progress: RunModel._progress,
}
