"""B3.11/B3.12 readout consistency (seeds 001, 003): the prefill_last vs decode0 table, live.

The trace is followed as the engine writes it; each batch of lines is recorded as its compact
facts (analysis.readout), from which the judge, the console and a replay build the same rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import orjson

from analysis.readout import (
    VERDICT_NO_OK,
    VERDICT_OK,
    ReadoutAggregator,
    TraceError,
    analyze_trace,
    compare_kept,
    format_table,
    kept_facts,
    load_record,
    overall,
    rechecked_row,
    to_json,
)
from analysis.run_compare import Item
from runners.cells import CellState
from runners.events import ArtifactFetched, Error, Event, RunFinished, TraceBatch, event
from runners.exits import EXIT_FAIL, EXIT_PASS, EXIT_USAGE
from runners.kind import Asked, Digest, Ending, Judge, JudgeContext, Kind, KindPrinter
from runners.presets import PresetError


@event
class ReadoutRow(Event):
    """A whole readout row, as runs recorded before trace digests did; replay still reads it."""

    type: ClassVar[str] = "readout_row"
    cell: int
    row: dict[str, Any]


class RowBook:
    """Readout rows folded from trace digests (and legacy row events), per file, in order."""

    def __init__(self) -> None:
        self.tables: dict[str, ReadoutAggregator] = {}
        self.legacy: dict[str, dict[str, Any]] = {}

    def table(self, file: str) -> ReadoutAggregator:
        return self.tables.setdefault(file, ReadoutAggregator())

    def fold(self, event: Event) -> list[str]:
        """Apply a digest or a legacy row; returns the keys of the rows that changed."""
        if isinstance(event, ReadoutRow):
            key = row_key(event.row)
            # rows recorded before index problems were counted had none counted
            self.legacy[key] = rechecked_row({"index_problem_lines": 0, **event.row})
            return [key]
        if not isinstance(event, TraceBatch) or not event.digest:
            return []
        return self.apply_facts(event.file, event.digest.get("facts", []))

    def apply_facts(self, file: str, facts: list[list[Any]]) -> list[str]:
        """Fold a digest's facts into a file's table; returns the keys of the rows changed."""
        table = self.table(file)
        changed: dict[int, None] = {}
        for fact in facts:
            changed[table.apply(fact, file)] = None
        return [row_key(table.row(i)) for i in changed]

    def rows(self) -> dict[str, dict[str, Any]]:
        out = dict(self.legacy)
        for table in self.tables.values():
            for row in table.rows():
                out[row_key(row)] = row
        return out


def _is_prefill(record: dict[str, Any]) -> bool:
    """A prefill_last line, by its phase or (seed 001's lines) its seq_len."""
    if "phase" in record:
        return record["phase"] == "prefill_last"
    return record.get("seq_len") != 1


def row_key(row: dict[str, Any]) -> str:
    return f"{row.get('file', '')}:{row.get('line', '')}:{row.get('prompt', '')}"


class ReadoutJudge(Judge):
    """Fills the table as trace lines arrive; OK when every prompt is OK and every cell passed."""

    def __init__(self, kind: Kind, ctx: JudgeContext) -> None:
        super().__init__(kind, ctx)
        self.book = RowBook()
        section = ctx.preset.section("readout")
        self.prompt_key: str = section["prompt_key"]
        self.prompt_names: list[str] = list(section["prompts"])
        self.params = {c.index: c.params for c in ctx.cells}
        self.named: dict[str, int] = {}  # file -> prefill_last lines named so far
        self.blank_at: dict[str, int | None] = {}  # file -> a blank line with no record after
        self.opened: dict[int, int] = {}  # cell -> prefill_last lines it wrote (judged)

    def name_for(self, cell: int, n: int) -> str | None:
        """The preset's name for a file's prompt n (from 0): [readout] prompts in order, else
        the cell's matrix value of prompt_key; None leaves the record's own or "prompt N"."""
        if n < len(self.prompt_names):
            return self.prompt_names[n]
        value = self.params.get(cell, {}).get(self.prompt_key)
        return None if value is None else str(value)

    def digest(self, cell: int, file: str, lines: list[bytes], first_line: int) -> Digest:
        known = self.book.tables.get(file)
        table = known.scratch() if known is not None else ReadoutAggregator()
        named = self.named.get(file, 0)
        facts: list[list[Any]] = []
        errors: list[tuple[str, str]] = []
        blank = self.blank_at.get(file)  # a blank line read, no record after it yet
        for n, raw in enumerate(lines, start=first_line):
            if not raw.strip():
                blank = n if blank is None else blank
                continue
            if blank is not None:  # as analyze reads a trace: blank lines end it
                why = (
                    f"{file}:{blank}: blank line inside the trace (a record follows it at line {n})"
                )
                errors.append((why, f"{file}:{blank}"))
                blank = None
            try:
                record = load_record(raw, n, file)
                name = None
                if isinstance(record, dict) and _is_prefill(record):
                    name = self.name_for(cell, named)
                fact = table.fact(record, n, file, name)
            except orjson.JSONDecodeError as exc:
                why = f"{file}:{n}: not valid JSON ({exc}); the engine wrote a bad trace line"
                errors.append((why, f"{file}:{n}"))
                continue
            except TraceError as exc:
                errors.append((str(exc), f"{file}:{n}"))
                continue
            table.apply(fact, file)
            facts.append(fact)
            named += fact[0] == "p"
        if blank != self.blank_at.get(file):
            return Digest({"facts": facts, "blank": blank}, errors)
        return Digest({"facts": facts} if facts else None, errors)

    def apply_digest(self, cell: int, file: str, data: dict[str, Any]) -> None:
        if "blank" in data:
            self.blank_at[file] = data["blank"]
        self.book.apply_facts(file, data.get("facts", []))
        prefills = sum(1 for fact in data.get("facts", []) if fact[0] == "p")
        self.named[file] = self.named.get(file, 0) + prefills
        self.opened[cell] = self.opened.get(cell, 0) + prefills

    def silent_cells(self) -> list[str]:
        """Cells that passed without one prefill_last line judged: their prompts never were."""
        return [
            f"cell {c.index + 1} ({' '.join(f'{k}={v}' for k, v in c.params.items())}) passed "
            "but wrote no prefill_last line that was judged: its prompt has no row, so the run "
            "cannot be OK"
            for c in self.ctx.cells
            if (done := self.finished.get(c.index)) is not None
            and done.state == CellState.PASSED
            and not self.opened.get(c.index)
        ]

    def kept_problems(self) -> list[str]:
        """Followed traces whose kept copy (the fetched artifact) says something else than the
        lines judged live: an engine that rewrote or truncated its trace after writing it."""
        out: list[str] = []
        fetched = {rel for paths in self.fetched.values() for rel in paths}
        for file, table in self.book.tables.items():
            rel = kept_name(file, fetched)
            if rel is None:
                continue
            path = self.ctx.local_dir / rel
            try:
                with open(path, "rb") as fh:
                    kept = kept_facts(fh, file)
            except OSError as exc:
                out.append(f"{path}: the kept trace cannot be read ({exc.strerror})")
                continue
            differs = compare_kept(table.facts, kept)
            if differs:
                out.append(
                    f"{path}: the kept trace is not what the engine wrote while it ran ({differs}): "
                    "the engine rewrote or truncated its trace; its verdict cannot stand"
                )
        return out

    def verdict(self, ending: Ending) -> RunFinished:
        rows = list(self.book.rows().values())
        verdict, reason = overall(rows)
        # A crashed cell's trace may never have been fetched again, so its kept copy is not
        # compared (the run is ENGINE_ERROR anyway: Judge.finish).
        crashed = bool(self.engine_errors())
        errors = [e.message for e in self.errors] + (
            [] if crashed else self.kept_problems() + self.silent_cells()
        )
        ok = verdict == VERDICT_OK and self.cells_ok() and not errors
        if errors:
            reason = f"{len(errors)} problem(s) with the trace: {errors[0]}; rows: {reason}"
        elif verdict == VERDICT_OK and not ok:
            reason = f"not every cell passed ({self.cell_states()}); rows: {reason}"
        word = VERDICT_OK if ok else VERDICT_NO_OK
        summary = {**to_json(rows, word, reason), "errors": errors}
        return RunFinished(verdict=word, exit_code=EXIT_PASS if ok else EXIT_FAIL, summary=summary)


def kept_name(file: str, fetched: set[str]) -> str | None:
    """The fetched artifact (relative to the run's directory) that is a followed file's copy."""
    names = [rel for rel in fetched if file == rel or file.endswith("/" + rel)]
    return max(names, key=len) if names else None


class ReadoutPrinter(KindPrinter):
    def __init__(self) -> None:
        self.book = RowBook()

    def lines(self, event: Event) -> list[str]:
        changed = self.book.fold(event)
        rows = self.book.rows()
        return [_row_line(rows[key]) for key in changed]

    def final(self, event: RunFinished) -> list[str]:
        if "prompts" not in event.summary:
            return []
        summary = event.summary
        # The rows as the record's own lines build them, not the end's copy of them: a replay
        # shows what the events say (its verdict is checked by run_view.believed_end).
        rows = list(self.book.rows().values())
        table = format_table(rows, event.verdict, summary.get("reason"))
        return ["", table.rstrip()]


def _row_line(r: dict[str, Any]) -> str:
    return (
        f"readout {r.get('prompt')}: prefill_last_top1={r.get('prefill_last_top1')} "
        f"decode0_top1={r.get('decode0_top1')} readout_mismatch="
        f"{r.get('readout_mismatch_count')} -> {r.get('verdict') or r.get('note')}"
    )


class ReadoutKind(Kind):
    name = "readout"
    description = "B3.11/B3.12 readout trace: prefill_last vs decode0 top-1 per prompt"
    judge_class = ReadoutJudge
    verdict_key = "verdict"
    events = (ReadoutRow,)
    pass_word, fail_word = VERDICT_OK, VERDICT_NO_OK
    pass_words = frozenset({VERDICT_OK})
    smoke = ("b3_11_readout", ('matrix.prompt=["p0_short", "p4_sys"]',))

    sections: ClassVar[dict[str, dict[str, tuple[Any, bool, Any]]]] = {
        # Names for rows whose prefill_last line names no prompt: `prompts`, in the order the
        # prompts appear in each trace file, else the cell's value of the matrix key
        # `prompt_key` (the cell that wrote the line), else "prompt N".
        "readout": {"prompt_key": (str, False, "prompt"), "prompts": (list, False, [])},
    }

    def matrix_keys_read(self, data: dict[str, Any]) -> set[str]:
        return {data["readout"]["prompt_key"]}  # names each cell's prompts

    def check(self, data: dict[str, Any], source: str, options: frozenset[str]) -> None:
        if not data["traces"]["follow"]:
            raise PresetError(source, "traces.follow", "a readout preset must name its trace file")
        for i, name in enumerate(data["readout"]["prompts"]):
            if not isinstance(name, str) or not name:
                raise PresetError(source, f"readout.prompts[{i}]", "must be a non-empty string")

    def printer(self) -> KindPrinter:
        return ReadoutPrinter()

    def claims(self, path: Path) -> bool:
        return path.is_file()

    def analyze_help(self) -> str:
        return "a readout trace .jsonl (B3.11/B3.12) or a readout run's directory"

    def analyze(self, path: Path, asked: Asked) -> int:
        if path.is_dir():
            return analyze_run_dir(path, asked)
        if asked.output is not None:
            asked.err(f"tracedeck: {self.name} analyze writes no file; --output is not used")
        try:
            agg = analyze_trace(path)
        except (TraceError, OSError) as exc:
            asked.err(f"tracedeck: {exc}")
            return EXIT_USAGE
        verdict = agg.verdict()
        if asked.json:
            asked.out(
                orjson.dumps(to_json(agg.rows(), verdict), option=orjson.OPT_INDENT_2).decode()
            )
        else:
            asked.out(format_table(agg.rows(), verdict))
        return EXIT_PASS if verdict == VERDICT_OK else EXIT_FAIL

    def compare_items(
        self, events: list[dict[str, Any]], summary: dict[str, Any] | None
    ) -> list[Item]:
        from analysis.compare_items import readout_items

        return readout_items(events)


KIND = ReadoutKind()


# ---------------------------------------------------------------- a run's directory, again


def _feed_kept(run_dir: Path, problems: list[str]) -> Callable[[Judge, list[Event]], None]:
    """Feed a rebuilt judge every kept trace's lines, each as from the cell that wrote it."""

    def feed(judge: Judge, events: list[Event]) -> None:
        batches = [e for e in events if isinstance(e, TraceBatch)]
        fetched = {e.path for e in events if isinstance(e, ArtifactFetched)}
        for file in dict.fromkeys(e.file for e in batches):
            rel = kept_name(file, fetched)
            if rel is None:
                problems.append(
                    f"{file}: followed live but never fetched home ([artifacts] fetch does not "
                    "name it), so its lines cannot be judged again"
                )
                continue
            spans = sorted((e.first_line, e.last_line, e.cell) for e in batches if e.file == file)
            try:
                # lines end at a newline only, as they were followed (not at a bare \r)
                lines = (run_dir / rel).read_bytes().split(b"\n")
                lines = [ln + b"\n" for ln in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
            except OSError as exc:
                problems.append(f"{run_dir / rel}: the kept trace cannot be read ({exc.strerror})")
                continue
            cell = spans[0][2] if spans else -2
            for n, raw in enumerate(lines, start=1):
                cell = next((c for a, b, c in spans if a <= n <= b), cell)
                digest = judge.take_lines(cell, file, [raw], n, 0)
                for message, where in digest.errors:
                    judge.fold(Error(message=message, where=where))
            assert isinstance(judge, ReadoutJudge)
            recorded = [
                f for e in batches if e.file == file for f in (e.digest or {}).get("facts", [])
            ]
            differs = compare_kept(recorded, judge.book.table(file).facts)
            if differs and recorded:
                judge.fold(
                    Error(
                        message=f"{run_dir / rel}: the kept trace is not what was judged while "
                        f"the run ran ({differs}): the trace was rewritten after it was written",
                        where=rel,
                    )
                )

    return feed


def analyze_run_dir(path: Path, asked: Asked) -> int:
    """Judge a finished readout run again from the trace it kept; say both verdicts."""
    from runners.rejudge import is_run_dir, rejudge

    if not is_run_dir(path):
        asked.err(
            f"tracedeck: {path}: a directory; pass a readout trace .jsonl or a readout run's "
            "directory (it holds run.json)"
        )
        return EXIT_USAGE
    problems: list[str] = []
    try:
        again = rejudge(path, _feed_kept(path, problems))
    except (OSError, ValueError) as exc:
        asked.err(f"tracedeck: {exc}")
        return EXIT_USAGE
    if problems:
        for p in problems:
            asked.err(f"tracedeck: {p}")
        asked.err(f"tracedeck: {path}: not re-judged (nothing was written)")
        return EXIT_USAGE
    result, recorded = again.result, again.recorded
    said = recorded.verdict if recorded is not None else "(none: the run never finished)"
    if asked.json:
        doc = {**result.summary, "verdict": result.verdict, "recorded_verdict": said}
        asked.out(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    else:
        asked.out(format_table(result.summary["prompts"], result.verdict, result.summary["reason"]))
        for err in result.summary.get("errors") or []:
            asked.out(f"error: {err}")
        asked.out(f"recorded verdict: {said}")
        asked.out(f"re-judged from the kept trace: {result.verdict}")
    if recorded is not None and recorded.verdict != result.verdict:
        asked.err(
            f"tracedeck: {path}: the run recorded {recorded.verdict}, its kept trace judges "
            f"{result.verdict}; the record is left as it is"
        )
    return result.exit_code
