"""B3.11/B3.12 readout consistency (seeds 001, 003): the prefill_last vs decode0 table, live.

The trace is followed as the engine writes it; each batch of lines is recorded as its compact
facts (analysis.readout), from which the judge, the console and a replay build the same rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, ClassVar

import orjson

from analysis.readout import (
    VERDICT_NO_OK,
    VERDICT_OK,
    ReadoutAggregator,
    TraceError,
    analyze_trace,
    format_table,
    overall,
    to_json,
)
from runners.events import Event, RunFinished, TraceBatch, event
from runners.exits import EXIT_FAIL, EXIT_INFRA, EXIT_PASS, EXIT_USAGE
from runners.kind import ENGINE_ERROR, Digest, Ending, Judge, JudgeContext, Kind, KindPrinter
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
            self.legacy[key] = dict(event.row)
            return [key]
        if not isinstance(event, TraceBatch) or not event.digest:
            return []
        table = self.table(event.file)
        changed: dict[int, None] = {}
        for fact in event.digest.get("facts", []):
            changed[table.apply(fact, event.file)] = None
        return [row_key(table.row(i)) for i in changed]

    def rows(self) -> dict[str, dict[str, Any]]:
        out = dict(self.legacy)
        for table in self.tables.values():
            for row in table.rows():
                out[row_key(row)] = row
        return out


def row_key(row: dict[str, Any]) -> str:
    return f"{row.get('file', '')}:{row.get('line', '')}:{row.get('prompt', '')}"


class ReadoutJudge(Judge):
    """Fills the table as trace lines arrive; OK when every prompt is OK and every cell passed."""

    def __init__(self, kind: Kind, ctx: JudgeContext) -> None:
        super().__init__(kind, ctx)
        self.book = RowBook()

    def digest(self, cell: int, file: str, lines: list[bytes], first_line: int) -> Digest:
        table = self.book.table(file)
        facts: list[list[Any]] = []
        errors: list[tuple[str, str]] = []
        for n, raw in enumerate(lines, start=first_line):
            if not raw.strip():
                continue
            try:
                record = orjson.loads(raw)
                fact = table.fact(record, n, file)
            except orjson.JSONDecodeError as exc:
                why = f"{file}:{n}: not valid JSON ({exc}); the engine wrote a bad trace line"
                errors.append((why, f"{file}:{n}"))
                continue
            except TraceError as exc:
                errors.append((str(exc), f"{file}:{n}"))
                continue
            table.apply(fact, file)
            facts.append(fact)
        return Digest({"facts": facts} if facts else None, errors)

    def apply_digest(self, event: TraceBatch) -> None:
        self.book.fold(event)

    def verdict(self, ending: Ending) -> RunFinished:
        rows = list(self.book.rows().values())
        verdict = overall(rows)[0]
        ok = verdict == VERDICT_OK and self.cells_ok() and not self.errors
        summary = {**to_json(rows, verdict), "errors": [e.message for e in self.errors]}
        engine = self.engine_errors()
        if engine:
            summary["engine_errors"] = engine
            return RunFinished(verdict=ENGINE_ERROR, exit_code=EXIT_INFRA, summary=summary)
        return RunFinished(
            verdict=VERDICT_OK if ok else VERDICT_NO_OK,
            exit_code=EXIT_PASS if ok else EXIT_FAIL,
            summary=summary,
        )


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
        return ["", format_table(event.summary["prompts"], event.summary["verdict"]).rstrip()]


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
    pass_word, fail_word = VERDICT_OK, VERDICT_NO_OK
    pass_words = frozenset({VERDICT_OK})
    smoke = ("b3_11_readout", ('matrix.prompt=["p0_short", "p4_sys"]',))

    def check(self, data: dict[str, Any], source: str, options: frozenset[str]) -> None:
        if not data["traces"]["follow"]:
            raise PresetError(source, "traces.follow", "a readout preset must name its trace file")

    def printer(self) -> KindPrinter:
        return ReadoutPrinter()

    def claims(self, path: Path) -> bool:
        return path.is_file()

    def analyze_help(self) -> str:
        return "a readout trace .jsonl (B3.11/B3.12)"

    def analyze(self, path: Path, args: argparse.Namespace) -> int:
        try:
            agg = analyze_trace(path)
        except (TraceError, OSError) as exc:
            print(f"tracedeck: {exc}", file=sys.stderr)
            return EXIT_USAGE
        verdict = agg.verdict()
        if args.json:
            print(orjson.dumps(to_json(agg.rows(), verdict), option=orjson.OPT_INDENT_2).decode())
        else:
            print(format_table(agg.rows(), verdict))
        return EXIT_PASS if verdict == VERDICT_OK else EXIT_FAIL


KIND = ReadoutKind()
