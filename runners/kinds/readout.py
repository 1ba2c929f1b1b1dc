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

    def name_for(self, cell: int, file: str) -> str | None:
        """The preset's name for the next prompt of a file: [readout] prompts in order, else
        the cell's matrix value of prompt_key; None leaves the record's own or "prompt N"."""
        n = self.named.get(file, 0)
        self.named[file] = n + 1
        if n < len(self.prompt_names):
            return self.prompt_names[n]
        value = self.params.get(cell, {}).get(self.prompt_key)
        return None if value is None else str(value)

    def digest(self, cell: int, file: str, lines: list[bytes], first_line: int) -> Digest:
        table = self.book.table(file)
        facts: list[list[Any]] = []
        errors: list[tuple[str, str]] = []
        for n, raw in enumerate(lines, start=first_line):
            if not raw.strip():
                continue
            try:
                record = orjson.loads(raw)
                name = None
                if isinstance(record, dict) and _is_prefill(record):
                    name = self.name_for(cell, file)
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
        return Digest({"facts": facts} if facts else None, errors)

    def apply_digest(self, event: TraceBatch) -> None:
        self.book.fold(event)
        prefills = sum(1 for fact in (event.digest or {}).get("facts", []) if fact[0] == "p")
        self.named[event.file] = self.named.get(event.file, 0) + prefills

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
        return "a readout trace .jsonl (B3.11/B3.12)"

    def analyze(self, path: Path, args: argparse.Namespace) -> int:
        if getattr(args, "output", None) is not None:
            print(
                f"tracedeck: {self.name} analyze writes no file; --output is not used",
                file=sys.stderr,
            )
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
