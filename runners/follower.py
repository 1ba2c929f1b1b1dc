"""Following a launched run: progress, each cell's output, trace files and artifacts, as events.

The follower reads what the launcher's scripts leave in the run directory (progress.jsonl,
cells/NNN/{stdout,stderr}.log, the trace files of the plan) by byte offset, and turns it into
events. It knows no kind: trace lines go to the judge for their digest, artifacts come home
once a cell passed, and the judge is asked to advance after each cell.
"""

from __future__ import annotations

import asyncio
import fnmatch
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from runners.cells import NO_CELL, SETUP_CELL, CellState, cell_name
from runners.events import (
    ArtifactFetched,
    ArtifactHeld,
    CellFinished,
    CellStarted,
    Error,
    Event,
    OutputLines,
    TraceBatch,
)
from runners.fetch import download_into, fetch_cell, sha256_file
from runners.follow import FileFollower, Lines
from runners.kind import Judge
from runners.plan import SETUP, PlannedCell, RunPlan
from runners.progress import Meter, Sink
from runners.targets.base import Target

# Batches of one trace read in one pass when it is behind (POLL_BYTES each); the rest next pass.
BATCHES_A_PASS = 8


@dataclass(slots=True)
class CellTrack:
    plan: PlannedCell
    started: float | None = None
    finished: bool = False
    passed: bool = False
    fetched: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)  # left on the target, judged there
    fetched_all: bool = False  # every artifact tried once the cell passed
    outputs: dict[str, FileFollower] = field(default_factory=dict)
    # sizes of the shared trace files when the cell ended (cells/NNN/trace_sizes)
    end_sizes: dict[str, int] | None = None
    # the start and end progress.jsonl said (t; rc and t), as read by this follower: reading
    # the file again (an attach) meets the same lines; a different one was forged
    said_start: Any = None
    said_end: Any = None


def _cell_number(name: Any) -> int | None:
    """A progress line's cell ("000", "001", ...) as an index, else None."""
    return int(name) if isinstance(name, str) and name.isdigit() else None


class RunFollower:
    """Turns the files of one run on one target into events, resuming from recorded offsets."""

    def __init__(
        self,
        target: Target,
        plan: RunPlan,
        judge: Judge,
        local_dir: Path,
        emit: Callable[[Event], None],
        progress: Sink | None = None,
        *,
        progress_files: list[str] | None = None,
        advance: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """progress: where Progress events go; progress_files: the files the launcher's scripts
        write each cell's start and end to (the run's progress.jsonl unless the launcher says
        otherwise); advance: how the judge is
        asked to judge (a fleet shares one judge among its hosts' followers)."""
        self.target = target
        self.plan = plan
        self.judge = judge
        self.local_dir = local_dir
        self.emit = emit
        self.on_progress = progress  # Progress events: for live eyes only, never recorded
        self.meters: dict[str, Meter] = {}
        self.cells: dict[int, CellTrack] = {c.index: CellTrack(c) for c in plan.cells}
        if plan.setup:
            setup = PlannedCell(SETUP_CELL, {"step": SETUP}, " && ".join(plan.setup), {})
            self.cells[SETUP_CELL] = CellTrack(setup)
        self.run_level = f"{plan.run_dir}/progress.jsonl"  # run.sh's; said the run's end
        paths = progress_files or [self.run_level]
        self.progress_files = [FileFollower(target, path) for path in paths]
        self._advance = advance or judge.advance
        self.traces: dict[str, FileFollower] = {}
        self.trace_owner: dict[str, int | None] = {}  # None: several cells write it
        self.patterns = [t for t in plan.traces if t.is_pattern]
        for t in plan.traces:
            if not t.is_pattern:
                self._add_trace(t.path, t.cell)
        self.ended = False
        self.cancelled = False
        self.setup_failed = False

    # -- restoring from the record (attach) ------------------------------------------------

    def fold(self, event: Event) -> None:
        """Keep the follower's place from an event, live or recorded."""
        if isinstance(event, CellStarted) and event.cell in self.cells:
            self.cells[event.cell].started = event.t
        elif isinstance(event, CellFinished) and event.cell in self.cells:
            track = self.cells[event.cell]
            track.finished = True
            track.passed = event.state == CellState.PASSED
        elif isinstance(event, OutputLines) and event.cell in self.cells:
            self._output(self.cells[event.cell], event.stream).offset = event.end_offset
        elif isinstance(event, TraceBatch) and self._known_trace(event.file):
            follower = self.traces[event.file]
            if event.end_offset > follower.offset:
                follower.offset = event.end_offset
                follower.lines_read = event.last_line
        elif isinstance(event, ArtifactFetched) and event.cell in self.cells:
            self.cells[event.cell].fetched.add(event.path)
        elif isinstance(event, ArtifactHeld) and event.cell in self.cells:
            self.cells[event.cell].held.add(event.path)

    # -- trace files -------------------------------------------------------------------------

    def _add_trace(self, path: str, owner: int | None) -> None:
        self.traces[path] = FileFollower(self.target, path)
        self.trace_owner[path] = owner

    @property
    def shared(self) -> list[str]:
        return [p for p, owner in self.trace_owner.items() if owner is None]

    def _known_trace(self, path: str) -> bool:
        """Is path followed (a named trace, or a file a pattern matched)? Adds a matched one."""
        if path in self.traces:
            return True
        folder, _, name = path.rpartition("/")
        for t in self.patterns:
            pattern_dir, _, pattern = t.path.rpartition("/")
            if folder == pattern_dir and fnmatch.fnmatchcase(name, pattern):
                self._add_trace(path, t.cell)
                return True
        return False

    async def _discover(self) -> None:
        """Follow every file that has come to match a trace pattern, in name order."""
        listed: dict[str, list[str] | None] = {}
        for t in self.patterns:
            folder = t.path.rpartition("/")[0]
            if folder not in listed:
                listed[folder] = await self.target.list_dir(folder)
            for name in listed[folder] or []:
                self._known_trace(f"{folder}/{name}")

    # -- one pass --------------------------------------------------------------------------

    async def poll(self) -> bool:
        """One pass over artifacts owed, traces, progress and outputs; True once the run ended."""
        await self.catch_up()
        if self.patterns:
            await self._discover()
        # Traces are read before progress: a line read now was written before any progress
        # entry read next, so the sizes recorded at those cells' ends credit it to its cell.
        pending: dict[str, list[Lines]] = {}
        for path in self.shared:
            got = await self.traces[path].poll()
            if got is not None:
                pending.setdefault(path, []).append(got)
        for progress in self.progress_files:
            got = await progress.poll()
            if got is None:
                continue
            at = got.offsets()
            for k, raw in enumerate(got.lines):
                try:
                    entry = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    entry = None
                try:
                    await self._on_progress(entry, pending, f"{progress.path}:{got.first_line + k}")
                except BaseException:
                    # the link went while this line was acted on: it and the ones after it are
                    # read again (acting on a line again is a no-op where it got that far)
                    progress.offset, progress.lines_read = at[k], got.first_line + k - 1
                    raise
        await self._emit_shared(pending, ended=None)
        for track in self.cells.values():
            if track.started is not None and not track.finished:
                await self._drain_cell(track)
        return self.ended

    def watched(self) -> list[str]:
        """The paths whose changes mean there is something to read now: the progress file, the
        shared traces, the outputs and own traces of running cells, the folders of patterns."""
        paths = [f.path for f in self.progress_files] + self.shared
        paths += sorted({t.path.rpartition("/")[0] for t in self.patterns})
        running = {i for i, t in self.cells.items() if t.started is not None and not t.finished}
        for index in sorted(running):
            paths += [self.plan.cell_path(index, f"{s}.log") for s in ("stdout", "stderr")]
        paths += [p for p, owner in self.trace_owner.items() if owner in running]
        return paths

    @property
    def behind(self) -> bool:
        """Did the last pass leave lines unread (a backlog read a bounded step at a time)?"""
        followers = [*self.traces.values(), *self.progress_files]
        followers += [f for t in self.cells.values() for f in t.outputs.values()]
        return not all(f.caught_up for f in followers)

    async def drain_rest(self) -> None:
        """At the end of the run: every line left, the last one even without its newline.

        A last line that is complete JSON is judged like any other; one that is not is a
        located error (a truncated line at its offset), never dropped; unless the judge reads
        such a line otherwise (Judge.torn_last_line: DSA, whose analyze counts it as a torn
        record). A trace that no longer holds what was read is a located error.
        """
        for track in self.cells.values():
            if track.started is None:
                continue
            while True:
                await self._drain_cell(track)
                if all(f.caught_up for f in track.outputs.values()):
                    break
            for stream in ("stdout", "stderr"):
                follower = self._output(track, stream)
                got = await follower.rest()
                if got is not None:
                    self.emit(
                        OutputLines(
                            cell=track.plan.index,
                            stream=stream,
                            lines=[got.lines[0].decode("utf-8", "replace")],
                            file=follower.path,
                            end_offset=got.end_offset,
                        )
                    )
        for path, follower in self.traces.items():
            owner = self.trace_owner[path]
            cell = owner if owner is not None else NO_CELL
            while (got := await follower.poll()) is not None:
                await self._emit_trace(cell, path, got)
            changed = await follower.changed()
            if changed is not None:  # what was judged is not what the file holds now
                self.emit(
                    Error(
                        message=f"{path}: {changed} while it was followed (truncated or "
                        f"rewritten): the {follower.lines_read} lines judged may not be the "
                        "trace; judge the file as it is now with `tracedeck analyze` once it "
                        "is complete",
                        where=path,
                    )
                )
                continue
            last = await follower.rest()
            if last is None:
                if follower.seen and follower.lines_read == 0:  # an empty file is a file too
                    await self._emit_trace(cell, path, Lines([], 1, 0, 0))
                continue
            marker = self.judge.torn_last_line(path, last.lines[0])
            if marker is not None:  # the kind's offline judge reads it so too
                last.lines[0] = marker
                await self._emit_trace(cell, path, last)
                continue
            if not last.lines[0].strip():
                continue
            try:
                orjson.loads(last.lines[0])
            except orjson.JSONDecodeError:
                where = f"{path}:{last.first_line}"
                self.emit(
                    Error(
                        message=f"{where}: truncated last line at byte {last.start_offset} "
                        f"({len(last.lines[0])} bytes, no newline, not valid JSON): the writer "
                        "was cut off; this line cannot be judged",
                        where=where,
                    )
                )
                continue
            await self._emit_trace(cell, path, last)
        for meter in self.meters.values():
            meter.finish()
        self.meters.clear()

    def never_appeared(self) -> list[str]:
        """Trace files (or patterns) the run was to write and never did."""
        missing = [p for p, f in self.traces.items() if not f.seen]
        for t in self.patterns:
            folder, _, pattern = t.path.rpartition("/")
            if not any(
                p.rpartition("/")[0] == folder
                and fnmatch.fnmatchcase(p.rpartition("/")[2], pattern)
                for p in self.traces
            ):
                missing.append(t.path)
        return missing

    def forged_end(self) -> None:
        """The run's end was read while its runner still runs: not tracedeck's line."""
        self._forged(self.run_level, "the run's end while its runner still runs")

    def _forged(self, where: str, why: str) -> None:
        """A progress line tracedeck's scripts did not write (the engine shares the run's
        directory): said, never believed; the run cannot pass."""
        self.emit(
            Error(
                message=f"{where}: {why}: a line tracedeck's scripts did not write (the engine "
                "can write there); it is not believed, and the run cannot pass",
                where=where,
            )
        )

    def _track_of(self, entry: dict[str, Any]) -> tuple[Any, CellTrack | None]:
        """A progress line's cell as it names it ("000", "setup"), and its track if it has one."""
        name = entry.get("cell")
        index = SETUP_CELL if name == SETUP else _cell_number(name)
        return name, self.cells.get(index) if index is not None else None

    async def _on_progress(
        self, entry: Any, pending: dict[str, list[Lines]], where: str = "progress.jsonl"
    ) -> None:
        if not isinstance(entry, dict):
            self._forged(where, "not a JSON object")
            return
        word = entry.get("e")
        if word in ("start", "end"):
            name, track = self._track_of(entry)
            if track is None:
                self._forged(where, f"{word} of a cell this run does not have ({name!r})")
                return
            t, rc = entry.get("t"), entry.get("rc")
            if type(t) not in (int, float) or (word == "end" and type(rc) is not int):
                self._forged(where, f"a {word} of {name} without its number t (and rc)")
                return
            if word == "start":
                said = t
                if track.said_start is not None and said != track.said_start:
                    self._forged(where, f"a second start of {name}")
                    return
                track.said_start = said
            else:
                said = (rc, t)
                if track.said_start is None and track.started is None:
                    self._forged(where, f"an end of {name} before its start (rc {said[0]!r})")
                    return
                if track.said_end is not None and said != track.said_end:
                    self._forged(where, f"a second end of {name} (rc {said[0]!r})")
                    return
                track.said_end = said
            if word == "start":
                if track.started is None:
                    track.started = float(entry["t"])
                    plan = track.plan
                    self.emit(
                        CellStarted(
                            cell=plan.index,
                            params=plan.params,
                            command=plan.command,
                            t=track.started,
                        )
                    )
            elif not track.finished:
                track.end_sizes = await self._sizes_at_end(track)
                await self._cell_ended(track, int(entry["rc"]), float(entry["t"]), pending)
        elif word == "stopped":  # a Slurm task's script, TERMed by Slurm while its cell ran
            name, track = self._track_of(entry)
            if track is None:
                self._forged(where, f"a stop of a cell this run does not have ({name!r})")
            elif track.said_end is not None:
                self._forged(where, f"an end of {name} its own script then says was stopped")
        elif word in ("done", "cancelled"):
            if where.rpartition(":")[0] != self.run_level:
                # per-cell files (a Slurm task's) never say the run's end: only run.sh does
                self._forged(where, f"a {word!r} line where no script of tracedeck writes one")
                return
            if word == "cancelled":
                self.cancelled = True
            self.setup_failed = bool(entry.get("setup_failed"))
            self.ended = True

    async def _cell_ended(
        self, track: CellTrack, rc: int, t: float, pending: dict[str, list[Lines]]
    ) -> None:
        # Every shared-trace line before the cell's end size is written; bring them in first.
        for path, size in (track.end_sizes or {}).items():
            if self._known_trace(path) and self.trace_owner[path] is None:
                follower = self.traces[path]
                while follower.offset < size:
                    got = await follower.poll(until=size)
                    if got is None:
                        break
                    pending.setdefault(path, []).append(got)
        await self._emit_shared(pending, ended=track)
        await self._drain_cell(track)
        tail = ""
        if rc != 0:
            tail = await self.tail(self.plan.cell_path(track.plan.index, "stderr.log"))
        # finished only with its end emitted (no await between): a link cut before it makes
        # the end line be acted on again, never lost
        track.finished = True
        track.passed = rc == 0
        duration = t - track.started if track.started is not None else None
        state = CellState.PASSED if rc == 0 else CellState.FAILED
        self.emit(
            CellFinished(
                cell=track.plan.index,
                state=state,
                exit_code=rc,
                duration_s=duration,
                stderr_tail=tail,
                t=t,
            )
        )
        label = cell_name(track.plan.index, track.plan.params, len(self.plan.cells))
        if rc != 0:
            self.emit(Error(message=f"{label} exited {rc}; stderr ends: {tail}", where=label))
        left = await self.target.read_from(
            self.plan.cell_path(track.plan.index, "leftover"), 0, 4096
        )
        if left:
            pids = " ".join(left.decode("ascii", "replace").split())
            self.emit(
                Error(
                    message=f"{label} left processes running after its command ended (pids "
                    f"{pids}); they were killed, so they hold neither the GPU nor the lock",
                    where=label,
                    affects_verdict=False,
                )
            )
        await self.catch_up()
        await self._advance()

    # -- outputs and traces ----------------------------------------------------------------

    def _output(self, track: CellTrack, stream: str) -> FileFollower:
        if stream not in track.outputs:
            path = self.plan.cell_path(track.plan.index, f"{stream}.log")
            track.outputs[stream] = FileFollower(self.target, path)
        return track.outputs[stream]

    async def _drain_cell(self, track: CellTrack) -> None:
        """New output lines of a started cell, and the lines of the traces it alone writes."""
        for stream in ("stdout", "stderr"):
            follower = self._output(track, stream)
            got = await follower.poll()
            if got is not None:
                self.emit(
                    OutputLines(
                        cell=track.plan.index,
                        stream=stream,
                        lines=[line.decode("utf-8", "replace") for line in got.lines],
                        file=follower.path,
                        end_offset=got.end_offset,
                    )
                )
        for path, owner in self.trace_owner.items():
            if owner == track.plan.index:
                await self._drain_own_trace(owner, path)

    async def _drain_own_trace(self, cell: int, path: str) -> None:
        """New lines of a trace one cell writes, up to BATCHES_A_PASS batches: each is handed to
        the judge as soon as it is read (Judge.submit_lines: a judge digesting in another
        process starts on it), so the next is judged while the one before is emitted."""
        follower = self.traces[path]
        ready: Lines | None = None
        try:
            for _ in range(BATCHES_A_PASS):
                got = await follower.poll()
                if got is not None:
                    await asyncio.to_thread(
                        self.judge.submit_lines, cell, path, got.lines, got.first_line
                    )
                if ready is not None:
                    done, ready = ready, None
                    await self._emit_trace(cell, path, done)
                ready = got
                if got is None or follower.caught_up:
                    break
        finally:
            # the last batch read; or, when the link went, the one read whole and handed over
            if ready is not None:
                await self._emit_trace(cell, path, ready)

    async def drain_started(self) -> None:
        for track in self.cells.values():
            if track.started is not None:
                await self._drain_cell(track)

    async def _emit_shared(self, pending: dict[str, list[Lines]], ended: CellTrack | None) -> None:
        """Emit pending shared-trace lines, each credited to the cell that wrote them.

        Cells run one after another and the lines were read before the progress entries, so
        a line before an ended cell's end size is that cell's, and any other line belongs to
        the cell still running (or to none, after the last one ended).
        """
        for path in self.shared:
            keep: list[Lines] = []
            for got in pending.get(path, []):
                if ended is None:
                    await self._emit_trace(self._running(), path, got)
                    continue
                # A file that did not exist when the cell ended was written after it.
                head, rest = got.split((ended.end_sizes or {}).get(path, 0))
                if head is not None:
                    await self._emit_trace(ended.plan.index, path, head)
                if rest is not None:
                    keep.append(rest)
            pending[path] = keep

    async def _sizes_at_end(self, track: CellTrack) -> dict[str, int]:
        """The shared traces' sizes when the cell ended, as run.sh recorded them."""
        path = self.plan.cell_path(track.plan.index, "trace_sizes")
        raw = await self.target.read_from(path, 0, 1 << 20)
        sizes: dict[str, int] = {}
        for line in (raw or b"").decode("utf-8", "replace").splitlines():
            size, _, name = line.partition("\t")
            if size.isdigit() and name:
                sizes[name] = int(size)
        return sizes

    def _running(self) -> int:
        running = [i for i, t in self.cells.items() if t.started is not None and not t.finished]
        return running[0] if running else NO_CELL

    async def _emit_trace(self, cell: int, path: str, got: Lines) -> None:
        # A kind's digest of a batch can take tens of ms (DSA: ~400 records of 2048 positions):
        # off the event loop, so a console drawing this run keeps its ticks. The follower awaits
        # it, so the judge is never used from two places at once.
        digest = await asyncio.to_thread(
            self.judge.take_lines, cell, path, got.lines, got.first_line, got.end_offset
        )
        self.emit(
            TraceBatch(
                cell=cell,
                file=path,
                first_line=got.first_line,
                last_line=got.first_line + len(got.lines) - 1,
                end_offset=got.end_offset,
                digest=digest.data,
            )
        )
        for message, where in digest.errors:
            self.emit(Error(message=message, where=where))
        if self.on_progress is not None:
            meter = self.meters.get(path)
            if meter is None:
                label = path.removeprefix(self.plan.artifacts + "/")
                meter = self.meters[path] = Meter("follow", label, "records", self.on_progress)
            meter.update(got.first_line + len(got.lines) - 1)

    # -- artifacts -------------------------------------------------------------------------

    async def catch_up(self) -> None:
        """Bring home the artifacts of every passed cell not yet fetched, then judge."""
        owed = [
            t for t in self.cells.values() if t.passed and t.plan.index >= 0 and not t.fetched_all
        ]
        for track in owed:
            done = track.fetched | track.held
            for event in await fetch_cell(
                self.target,
                self.plan,
                track.plan,
                self.local_dir,
                done,
                lambda rel, cell=track.plan.index: self.judge.holds(rel, cell),
                self.on_progress,
            ):
                self.emit(event)
            track.fetched_all = True
        if owed:
            await self._advance()

    def held_artifacts(self) -> list[tuple[int, str]]:
        """(cell, path) of every artifact left on the target and not fetched since."""
        return [
            (index, rel)
            for index, track in sorted(self.cells.items())
            for rel in sorted(track.held - track.fetched)
        ]

    async def fetch_held(self) -> None:
        """Bring home what was judged on the target (the operator asked, or the preset does)."""
        for index, rel in self.held_artifacts():
            local = await download_into(
                self.target, f"{self.plan.artifacts}/{rel}", self.local_dir, rel
            )
            digest = await asyncio.to_thread(sha256_file, local)
            self.emit(
                ArtifactFetched(cell=index, path=rel, size=local.stat().st_size, sha256=digest)
            )

    async def tail(self, path: str, limit: int = 600) -> str:
        data = await self.target.read_from(path, 0, 1 << 20)
        text = (data or b"").decode("utf-8", "replace").strip()
        return ("..." + text[-limit:]) if len(text) > limit else (text or "(empty)")
