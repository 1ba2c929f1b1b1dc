"""The interface of a run kind and its judge; the core knows kinds only through this.

A kind module (runners/kinds/<kind>.py) defines `KIND = SomeKind()`. The session folds every
event of a run into the kind's Judge, live or replayed on attach, through one path (`fold`);
`advance` does whatever judging has become possible; `finish` gives the verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from runners.cells import CellState, PlannedCell, cell_name
from runners.events import (
    CORE_EVENTS,
    ArtifactFetched,
    ArtifactHeld,
    CellFinished,
    CellRequeued,
    Error,
    Event,
    RunFinished,
    TraceBatch,
    type_table,
)
from runners.exits import EXIT_FAIL, EXIT_INFRA, EXIT_INTERRUPT, EXIT_PASS
from runners.presets import Preset

if TYPE_CHECKING:
    from analysis.run_compare import Item

# section -> key -> (expected type(s), required, default); the same form as runners.presets
SectionSchema = dict[str, tuple[Any, bool, Any]]

# Words every kind shares: how a run ends when it did not end by itself, and an engine that
# crashed or never ran (infrastructure, not a verdict on the engine's results).
CANCELLED, CRASHED, ENGINE_ERROR = "CANCELLED", "CRASHED", "ENGINE_ERROR"
NOT_STARTED = "NOT_STARTED"
ENDINGS = {
    "cancelled": (CANCELLED, EXIT_INTERRUPT),
    "crashed": (CRASHED, EXIT_INFRA),
    "not_started": (NOT_STARTED, EXIT_INFRA),
    # A fleet host was lost and its cells could not run elsewhere; no host could take cells.
    "host_lost": ("HOST_LOST", EXIT_INFRA),
    "lock_busy": ("LOCK_BUSY", EXIT_INFRA),
}
# A batch scheduler killed cells (Slurm's job state words): infrastructure, never a verdict.
SCHEDULER_KILLS = ("TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
for _word in SCHEDULER_KILLS:
    ENDINGS[_word.lower()] = (_word, EXIT_INFRA)
NEVER_STARTED = (126, 127)  # the shell could not run the command: no engine ran at all

TONES = ("pass", "drift", "fail")
NUMPY = orjson.OPT_SERIALIZE_NUMPY


@dataclass(slots=True)
class JudgeContext:
    preset: Preset
    local_dir: Path
    date: str
    emit: Callable[[Event], None]
    cells: list[PlannedCell] = field(default_factory=list)
    # The target, for a kind that judges there (runners.remote_judge.RemoteJudge); None: here.
    host: Any = None
    # Per cell, the host that judges it (a fleet's batches each judge their own cells).
    hosts: dict[int, Any] = field(default_factory=dict)
    # Progress events of long judging (runners.progress.Meter): shown live, never recorded.
    progress: Callable[[Event], None] | None = None

    def host_of(self, cell: int) -> Any:
        """Where a cell's results are judged: its host's RemoteJudge, or None for here."""
        return self.hosts.get(cell, self.host)


@dataclass(frozen=True, slots=True)
class Ending:
    """How the run ended, as the follower saw it."""

    how: str  # "done" | "cancelled" | "crashed" | "not_started"
    message: str = ""


@dataclass(slots=True)
class Digest:
    """A kind's account of a batch of trace lines: what is recorded, and what was wrong."""

    data: dict[str, Any] | None = None
    errors: list[tuple[str, str]] = field(default_factory=list)  # (message, where)


def failure_text(e: CellFinished) -> str:
    """How a cell ended without a result: never started, crashed, skipped, cut short."""
    tail = f"; stderr ends: {e.stderr_tail}" if e.stderr_tail else ""
    if e.scheduler:
        why = f" ({e.stderr_tail})" if e.stderr_tail else ""
        return f"the scheduler ended it: {e.scheduler}{why}"
    if e.state == CellState.FAILED and e.exit_code in NEVER_STARTED:
        return f"the engine never started (exit {e.exit_code}){tail}"
    if e.state == CellState.FAILED:
        return f"the engine crashed (exit {e.exit_code}){tail}"
    if e.state == CellState.SKIPPED:
        return "skipped: it never ran (the setup step failed, or the run never started)"
    return f"{e.state} before it finished"


class Judge:
    """The generic part of every judge: cell ends, fetched artifacts and verdict-affecting errors.

    The base judges like the "command" kind: a run passes when every cell exits 0.
    """

    def __init__(self, kind: Kind, ctx: JudgeContext) -> None:
        self.kind = kind
        self.ctx = ctx
        self.finished: dict[int, CellFinished] = {}
        self.fetched: dict[int, set[str]] = {}
        self.held: dict[int, set[str]] = {}  # artifacts left on the target, judged there
        self.errors: list[Error] = []
        self.trace_applied: dict[str, int] = {}  # file -> end offset of the lines folded in

    # -- folding: the one path for live events and recorded ones -------------------------------

    def fold(self, event: Event) -> None:
        if isinstance(event, CellFinished):
            self.finished[event.cell] = event
        elif isinstance(event, ArtifactFetched):
            self.fetched.setdefault(event.cell, set()).add(event.path)
        elif isinstance(event, ArtifactHeld):
            self.held.setdefault(event.cell, set()).add(event.path)
        elif isinstance(event, CellRequeued):
            # A fleet host was lost: the cell runs again elsewhere, from the start.
            self.finished.pop(event.cell, None)
            self.fetched.pop(event.cell, None)
            self.held.pop(event.cell, None)
        elif isinstance(event, Error) and event.affects_verdict:
            self.errors.append(event)
        elif isinstance(event, TraceBatch) and (
            event.end_offset > self.trace_applied.get(event.file, 0)
            or event.file not in self.trace_applied  # an empty file, said once
        ):
            # A recorded batch (attach, replay): applied as its lines were when followed live.
            self.apply_trace(event.cell, event.file, event.digest, event.end_offset)
        self.on_event(event)

    def on_event(self, event: Event) -> None:
        """A kind's own reaction to an event (its verdict events)."""

    def holds(self, rel: str, cell: int | None = None) -> bool:
        """Does this artifact (of that cell) stay on the target (judged there, fetched only
        when asked)?"""
        spec = self.kind.host_judging
        host = self.ctx.host if cell is None else self.ctx.host_of(cell)
        return host is not None and spec is not None and spec.held(rel)

    def home(self, cell: int, wanted: set[str]) -> bool:
        """Is every artifact of the cell either fetched or held on the target for judging?"""
        return wanted <= self.fetched.get(cell, set()) | self.held.get(cell, set())

    # -- trace lines -------------------------------------------------------------------------

    def submit_lines(self, cell: int, file: str, lines: list[bytes], first_line: int) -> None:
        """Trace lines read ahead: a judge that digests elsewhere (DSA: a helper process) may
        start on them now, while the batch before is emitted. take_lines of the same lines, in
        the same order, is still what digests and applies them; the default does nothing."""

    def torn_last_line(self, file: str, data: bytes) -> bytes | None:
        """What to judge in place of a trace's last line that has no newline, once the run has
        ended (as the kind's offline judge reads such a line); None: the line itself when it
        is JSON, a located error when it is not."""
        return None

    def take_lines(
        self, cell: int, file: str, lines: list[bytes], first_line: int, end_offset: int
    ) -> Digest:
        """Freshly followed trace lines: their digest (recorded with them), applied here."""
        digest = self.digest(cell, file, lines, first_line)
        # Applied as recorded (JSON), so what it leaves is what an attach rebuilds from it.
        data = (
            None if digest.data is None else orjson.loads(orjson.dumps(digest.data, option=NUMPY))
        )
        self.apply_trace(cell, file, data, end_offset)
        return digest

    def apply_trace(
        self, cell: int, file: str, data: dict[str, Any] | None, end_offset: int
    ) -> None:
        """The one way a trace batch changes the judge, live (take_lines) and recorded (fold):
        its digest's data through apply_digest, and the file's offset moved past it."""
        self.trace_applied[file] = max(end_offset, self.trace_applied.get(file, 0))
        if data is not None:
            self.apply_digest(cell, file, data)

    def digest(self, cell: int, file: str, lines: list[bytes], first_line: int) -> Digest:
        """The compact account of trace lines, computed from the judge's state as it is; it
        must change nothing (apply_digest folds it in, live and on attach alike)."""
        return Digest()

    def apply_digest(self, cell: int, file: str, data: dict[str, Any]) -> None:
        """Fold a digest's data into the judge's state: the only way trace lines change it."""

    # -- work --------------------------------------------------------------------------------

    async def advance(self) -> None:
        """Judge whatever has become judgeable; emit the kind's verdict events via ctx.emit."""

    # -- the end -------------------------------------------------------------------------------

    def cell_states(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for e in self.finished.values():
            if e.cell >= 0:
                counts[e.state] = counts.get(e.state, 0) + 1
        return counts

    def cells_ok(self) -> bool:
        ran = [e for e in self.finished.values() if e.cell >= 0]
        return len(ran) == len(self.ctx.cells) and all(e.state == CellState.PASSED for e in ran)

    def engine_errors(self) -> list[str]:
        """Cells whose engine crashed or never ran, each as a sentence saying how.

        For a kind whose cells' exit codes are its verdict ("command"), only a command that
        could not start (126, 127) counts; for every other kind any failed cell does, and a
        cell skipped after a failed setup step does too.
        """
        out: list[str] = []
        total = len(self.ctx.cells)
        for e in sorted(self.finished.values(), key=lambda e: e.cell):
            params = next((c.params for c in self.ctx.cells if c.index == e.cell), {})
            verdict_code = e.exit_code not in NEVER_STARTED and self.kind.cell_exit_is_verdict
            if e.state in (CellState.FAILED, CellState.SKIPPED) and not verdict_code:
                out.append(f"{cell_name(e.cell, params, total)}: {failure_text(e)}")
        return out

    def finish(self, ending: Ending) -> RunFinished:
        """The run's result: the kind's verdict under the one rule every kind shares, then kept.

        A run cut short (cancelled, crashed, host lost, killed by a scheduler) ends with the
        ending's word, never with a verdict on what it left. An engine that crashed or never
        ran is never a verdict either: the run is ENGINE_ERROR, except that a kind judging items
        apart (Kind.judges_items_apart) keeps a failure it found in another item; a crash never
        lets a run pass. The word goes into the summary's own verdict key (Kind.verdict_key)
        and its reason says why; then the kind keeps its documents (keep).
        """
        result = self.verdict(ending)
        word, code, why = result.verdict, result.exit_code, ""
        summary = dict(result.summary)
        engine = self.engine_errors()
        apart = self.kind.judges_items_apart
        if engine and not apart:
            summary["engine_errors"] = engine
        cut = ENDINGS.get(ending.how)
        if cut is not None:
            word, code = cut
            why = f"the run ended {word} before it was judged whole"
            if ending.message:
                summary["error"] = ending.message
        elif engine and (not apart or self.kind.tone(word) != "fail"):
            word, code, why = ENGINE_ERROR, EXIT_INFRA, engine[0]
            summary["engine_errors"] = engine
        if word != result.verdict:
            key = self.kind.verdict_key
            if key:
                summary[key] = word
            if isinstance(summary.get("reason"), str):
                summary["reason"] = f"{why}; {summary['reason']}"
        final = RunFinished(verdict=word, exit_code=code, summary=summary)
        self.keep(final)
        return final

    def verdict(self, ending: Ending) -> RunFinished:
        """The kind's verdict on what the run left (finish() applies the shared rule to it)."""
        summary: dict[str, Any] = {
            "cells": len(self.ctx.cells),
            "states": self.cell_states(),
            "errors": [e.message for e in self.errors],
        }
        ok = self.cells_ok() and not self.errors
        word = self.kind.pass_word if ok else self.kind.fail_word
        return RunFinished(verdict=word, exit_code=EXIT_PASS if ok else EXIT_FAIL, summary=summary)

    def keep(self, result: RunFinished) -> None:
        """Write the kind's documents (summary.json, a report) with the run's final result."""


@dataclass(frozen=True, slots=True)
class Option:
    """An option of a kind's analyze, declared: the CLI makes it --NAME (dashes for _)."""

    name: str
    help: str
    parse: Callable[[str], Any] | None = None  # raises ValueError saying what to give
    many: bool = False  # may be given again: the value is the list of what was given
    metavar: str | None = None


@dataclass(slots=True)
class Asked:
    """What an analyze was asked (every option by name: the kind's, and json, output, kind
    flags) and where it says things: out for the result (stdout), err beside it (stderr).
    A kind prints nothing itself: the caller decides where its words go."""

    values: dict[str, Any]
    out: Callable[[str], None]
    err: Callable[[str], None]
    progress: Callable[..., None] | None = None  # long judging, as done/total

    def __getitem__(self, name: str) -> Any:
        return self.values.get(name)

    @property
    def json(self) -> bool:
        return bool(self.values.get("json"))

    @property
    def output(self) -> Path | None:
        out = self.values.get("output")
        return None if out is None else Path(out)


class KindPrinter:
    """Headless lines for a kind's own events, and its part of the final summary."""

    def lines(self, event: Event) -> list[str]:
        return []

    def final(self, event: RunFinished) -> list[str]:
        return []


@dataclass(frozen=True)
class HostJudging:
    """What a kind needs to judge on the target instead of fetching everything home.

    modules: files shipped there, relative to the source tree (analysis/..., runners/hosted/...;
    runners/atomic.py and the package files come with them); requires: what its python must
    import besides them; held: which artifacts stay there (fetched only when asked); entry:
    the shipped module the judge runs.
    """

    modules: tuple[str, ...]
    requires: tuple[str, ...]
    held: Callable[[str], bool]
    entry: str  # the shipped module the judge runs there (python -m ENTRY ...)


class Kind:
    """One run kind. Subclasses set the class attributes and override what they need."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    judge_class: ClassVar[type[Judge] | None] = None
    pass_word: ClassVar[str] = "PASS"
    fail_word: ClassVar[str] = "FAIL"
    # Verdict words (run and per item) that mean pass, and expected drift; others are failures.
    pass_words: ClassVar[frozenset[str]] = frozenset({"PASS"})
    drift_words: ClassVar[frozenset[str]] = frozenset()
    # The kind's own preset sections (validated only for presets of this kind).
    sections: ClassVar[dict[str, SectionSchema]] = {}
    # A shipped preset (and --set overrides) that shows the kind end to end in seconds.
    smoke: ClassVar[tuple[str, tuple[str, ...]] | None] = None
    # Options an operator may give `tracedeck run` explicitly (name -> help), e.g.
    # "loose_thresholds" becomes --loose-thresholds; the kind's check() sees them.
    options: ClassVar[dict[str, str]] = {}
    # True when a cell's exit code is the kind's verdict; otherwise a failed cell means the
    # engine crashed, an infrastructure failure (ENGINE_ERROR, exit 3), never a verdict.
    cell_exit_is_verdict: ClassVar[bool] = False
    # True when the judge judges items apart (pairs, grid cells) and names a crashed item's
    # result unjudged itself, so a failure it found in another item stands; otherwise any
    # crashed cell makes the run ENGINE_ERROR (Judge.finish applies the rule).
    judges_items_apart: ClassVar[bool] = False
    # The summary key that states the run's word (kept equal to the final one), if any.
    verdict_key: ClassVar[str] = ""
    # Set when the kind can judge on the target ([judge] on = "auto" | "host" | "console").
    host_judging: ClassVar[HostJudging | None] = None
    # The kind's own event types (defined with runners.events.event), for decoding its records.
    events: ClassVar[tuple[type[Event], ...]] = ()

    def validate_definition(self) -> None:
        """Refuse a kind that cannot be used: no name, no judge, or words that contradict."""
        if not self.name or not self.name.isidentifier():
            raise TypeError(f"{type(self).__name__}: name must be an identifier, got {self.name!r}")
        if self.judge_class is None or not issubclass(self.judge_class, Judge):
            raise TypeError(f"kind {self.name!r} has no judge (judge_class is not a Judge)")
        if self.pass_word not in self.pass_words:
            raise TypeError(f"kind {self.name!r}: pass_word {self.pass_word!r} not in pass_words")
        if self.fail_word in self.pass_words | self.drift_words:
            raise TypeError(f"kind {self.name!r}: fail_word {self.fail_word!r} reads as a pass")
        for cls in self.events:
            if not (isinstance(cls, type) and issubclass(cls, Event)):
                raise TypeError(f"kind {self.name!r}: {cls!r} in events is not an Event class")
            if cls.type in CORE_EVENTS:
                raise TypeError(
                    f"kind {self.name!r}: event {cls.__qualname__} takes the type word "
                    f"{cls.type!r} of a core event"
                )
        type_table(self.events)

    # -- presets ---------------------------------------------------------------------------------

    def matrix_keys_read(self, data: dict[str, Any]) -> set[str]:
        """Matrix keys this kind reads from the cells' parameters itself (not via a template)."""
        return set()

    def check(self, data: dict[str, Any], source: str, options: frozenset[str]) -> None:
        """Checks on a validated preset of this kind; raise runners.presets.PresetError.

        options: what the operator asked for explicitly on the command line (e.g.
        "loose_thresholds"), never something a preset file can say.
        """

    # -- judging ---------------------------------------------------------------------------------

    def together(self, cells: list[PlannedCell]) -> list[list[int]]:
        """Cells that must run on the same host of a fleet (their results are compared with
        each other), as groups of cell indices in run order; by default every cell alone."""
        return [[c.index] for c in cells]

    def judge(self, ctx: JudgeContext) -> Judge:
        assert self.judge_class is not None
        return self.judge_class(self, ctx)

    def exit_code(self, word: str) -> int:
        """The exit code a run of this kind that ended with `word` carries."""
        for cut in ENDINGS.values():
            if word == cut[0]:
                return cut[1]
        if word == ENGINE_ERROR:
            return EXIT_INFRA
        if word in self.pass_words or word in self.drift_words:
            return EXIT_PASS
        return EXIT_FAIL

    def tone(self, word: str | None) -> str:
        """'pass', 'drift' or 'fail': a word this kind does not know to pass is a failure."""
        if word in self.pass_words:
            return "pass"
        if word in self.drift_words:
            return "drift"
        return "fail"

    def printer(self) -> KindPrinter:
        return KindPrinter()

    # -- tracedeck analyze ---------------------------------------------------------------------

    @property
    def analyzes(self) -> bool:
        """Does the kind have an analyze entry (`tracedeck analyze` on its runs and files)?"""
        return type(self).analyze is not Kind.analyze

    def claims(self, path: Path) -> bool:
        """Is path something this kind's analyze judges (a tree, a trace file)?"""
        return False

    def analyze_help(self) -> str:
        """What `analyze` expects for this kind, for the error when no kind claims a path."""
        return ""

    # Options of this kind's analyze (their names must not clash with another kind's).
    analyze_options: ClassVar[tuple[Option, ...]] = ()
    # `tracedeck watch DIR` follows a directory of this kind's traces (with these options).
    watch_dirs: ClassVar[bool] = False
    watch_options: ClassVar[tuple[Option, ...]] = ()

    def analyze(self, path: Path, asked: Asked) -> int:
        """Judge path; say the result with asked.out, the rest with asked.err; the exit code."""
        raise NotImplementedError(f"kind {self.name!r} has no analyze")

    def watch(self, asked: Asked) -> int:
        """Follow asked["dir"] (headless); say what comes with asked.out; the exit code."""
        raise NotImplementedError(f"kind {self.name!r} watches no directory")

    # -- tracedeck diff, --junit ---------------------------------------------------------------

    # The recorded events that state an item's verdict word (a B3.67 pair verdict, a 03C cell
    # verdict): a replay checks each as it shows it (item_of). None for the others.
    item_events: ClassVar[tuple[type[Event], ...]] = ()

    def item_of(self, event: Event) -> Item:
        """The compare_items item an event of item_events states the verdict word of,
        recomputed from the event's own data."""
        raise NotImplementedError

    def compare_items(
        self, events: list[dict[str, Any]], summary: dict[str, Any] | None
    ) -> list[Item]:
        """The run's judged items (pairs, cells, prompts, shards) rebuilt from its recorded
        events, for a diff and a JUnit report; by default its cells and their exit states."""
        from analysis.compare_items import cell_items

        return cell_items(events)
