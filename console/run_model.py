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
    CellRequeued,
    CellStarted,
    Connection,
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
    host: str = ""  # the fleet host that runs it (or the Slurm node)
    sched: str = ""  # the scheduler's state: "PENDING (Resources)", "RUNNING on n1", "TIMEOUT"


@dataclass(slots=True)
class HostRow:
    """One host of a fleet run, as its status line shows it."""

    spec: str
    state: str = "waiting to start"
    message: str = ""
    connection: str = "connected"
    lock: str = ""
    lock_held: bool = False
    cells: set[int] = field(default_factory=set)  # assigned to it (its batches)
    done: set[int] = field(default_factory=set)
    last_error: str = ""


@dataclass(slots=True)
class Job:
    """A run's job on a batch scheduler."""

    scheduler: str = ""
    job_id: str = ""
    partition: str = ""


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
    fleet: bool = False  # several hosts: each has its own lock (the hosts lines show them)


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
    hosts: bool = False
    progress: bool = False

    def __bool__(self) -> bool:
        return bool(
            self.header
            or self.cells
            or self.log_new
            or self.connection
            or self.errors
            or self.finished
            or self.hosts
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
        self.hosts: dict[str, HostRow] = {}
        self.job = Job()
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
        if event.host:
            self._host_event(event)
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)

    def host_row(self, spec: str) -> HostRow:
        row = self.hosts.get(spec)
        if row is None:
            row = self.hosts[spec] = HostRow(spec)
            self.header.fleet = True
            self._changes.header = True
        return row

    def _host_event(self, event: Event) -> None:
        """What a fleet host's events say of that host (its status line)."""
        row = self.host_row(event.host)
        self._changes.hosts = True
        if isinstance(event, HostAssigned):
            row.cells.update(event.cells)
            row.lock = event.lock
            for index in event.cells:
                cell = self.cells.get(index)
                if cell is not None:
                    cell.host = event.host
                    self._changes.cells[index] = None
        elif isinstance(event, HostState):
            row.state, row.message = event.state, event.message
            if event.state != "running":
                row.lock_held = False
            if event.state == "lost":
                row.connection = "unreachable"
        elif isinstance(event, LockAcquired):
            row.lock, row.lock_held = event.lock, True
        elif isinstance(event, LockBusy):
            row.lock, row.lock_held = event.lock, False
        elif isinstance(event, Connection):
            attempt = f" (attempt {event.attempt})" if event.attempt else ""
            row.connection = "connected" if event.state == "restored" else f"{event.state}{attempt}"
        elif isinstance(event, Error):
            row.last_error = event.message
        elif isinstance(event, CellFinished) and event.cell >= 0:
            row.done.add(event.cell)
        elif isinstance(event, CellRequeued):
            row.cells.discard(event.cell)
            row.done.discard(event.cell)

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
        if event.host:
            return  # a fleet host's lock: its status line shows it
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
        if event.host:
            row.host = event.host
        self._changes.cells[event.cell] = None

    def _cell_finished(self, event: CellFinished) -> None:
        row = self.cells.get(event.cell)
        if row is None:
            row = self.cells[event.cell] = CellRow(event.cell, {})
        row.state = event.state
        row.exit_code = event.exit_code
        row.duration_s = event.duration_s
        if event.host:
            row.host = event.host
        if event.scheduler:
            row.sched = event.scheduler
        self._changes.cells[event.cell] = None

    def _requeued(self, event: CellRequeued) -> None:
        row = self.cells.get(event.cell)
        if row is None:
            return
        row.state, row.exit_code, row.duration_s = CellState.PENDING, None, None
        row.host = f"({event.host} lost)" if event.host else ""
        self._changes.cells[event.cell] = None
        self._log_run(f"cell {event.cell + 1} requeued: {event.reason}")

    def _scheduler(self, event: SchedulerState) -> None:
        row = self.cells.get(event.cell)
        if row is None:
            return
        text = event.state
        if event.reason:
            text += f" ({event.reason})"
        if event.node and event.state == "RUNNING":
            text += f" on {event.node}"
        row.sched = text
        if event.node:
            row.host = event.node
        self._changes.cells[event.cell] = None
        self._changes.hosts = True  # the job's line counts its cells by state

    def _job(self, event: JobSubmitted) -> None:
        self.job = Job(event.scheduler, event.job_id, event.partition)
        self._changes.header = True
        self._changes.hosts = True
        self._log_run(
            f"{event.scheduler} job {event.job_id} submitted"
            + (f" to partition {event.partition}" if event.partition else "")
        )

    def sched_counts(self) -> dict[str, int]:
        """How many cells are in each scheduler state (its first word)."""
        counts: dict[str, int] = {}
        for row in self.cells.values():
            if row.index >= 0 and row.sched:
                word = row.sched.split()[0]
                counts[word] = counts.get(word, 0) + 1
        return counts

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
        if not event.host:  # a fleet host's link: its status line shows it
            self.connection = event
            self._changes.connection = True
        attempt = f" (attempt {event.attempt})" if event.attempt else ""
        where = f"{event.host}: " if event.host else ""
        self._log_run(f"{where}connection {event.state}{attempt}: {event.message}")

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
    CellRequeued: RunModel._requeued,
    SchedulerState: RunModel._scheduler,
    JobSubmitted: RunModel._job,
    Progress: RunModel._progress,
}
