"""Per-kind judgement of a run as its cells finish: turns finished cells and traces into verdicts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runners.events import (
    ArtifactFetched,
    CellFinished,
    Error,
    Event,
    PairVerdict,
    ReadoutRow,
    RunFinished,
    TraceRecords,
)
from runners.presets import Preset, PresetError

EXIT_PASS, EXIT_FAIL, EXIT_INFRA = 0, 1, 3


@dataclass(slots=True)
class JudgeContext:
    preset: Preset
    local_dir: Path
    date: str
    emit: Callable[[Event], None]


class Judge:
    """The generic judge (kind "command"): a run passes when every cell exits 0."""

    pass_word, fail_word = "PASS", "FAIL"

    def __init__(self, ctx: JudgeContext) -> None:
        self.ctx = ctx
        self.finished: dict[int, CellFinished] = {}
        self.fetched: dict[int, list[str]] = {}
        self.errors: list[str] = []

    def check_preset(self) -> None:
        """Raise PresetError when the preset cannot be judged by this kind."""

    def restore(self, event: Event) -> None:
        """Rebuild state from a recorded event (attach)."""
        if isinstance(event, CellFinished):
            self.finished[event.cell] = event
        elif isinstance(event, ArtifactFetched):
            self.fetched.setdefault(event.cell, []).append(event.path)
        elif isinstance(event, Error) and event.affects_verdict:
            self.errors.append(event.message)

    def cell_finished(self, event: CellFinished) -> None:
        self.finished[event.cell] = event

    def artifact_fetched(self, event: ArtifactFetched) -> None:
        self.fetched.setdefault(event.cell, []).append(event.path)

    def error(self, event: Error) -> None:
        if event.affects_verdict:
            self.errors.append(event.message)

    async def advance(self) -> None:
        """Judge whatever has become judgeable; emits verdict events."""

    def trace(self, event: TraceRecords) -> None:
        """Records followed from a trace file."""

    def cells_ok(self) -> bool:
        return all(e.state == "passed" for e in self.finished.values() if e.cell >= 0)

    def finish(self, expected_cells: int) -> RunFinished:
        done = [e for e in self.finished.values() if e.cell >= 0]
        ok = self.cells_ok() and len(done) == expected_cells and not self.errors
        counts: dict[str, int] = {}
        for e in done:
            counts[e.state] = counts.get(e.state, 0) + 1
        summary = {"cells": expected_cells, "states": counts, "errors": self.errors}
        word = self.pass_word if ok else self.fail_word
        return RunFinished(verdict=word, exit_code=EXIT_PASS if ok else EXIT_FAIL, summary=summary)


class EquivalenceJudge(Judge):
    """B3.67: judge each (kv_aligned, seed) pair as soon as both sides are home."""

    pass_word, fail_word = "PASS_GUARDRAIL", "FAIL_GUARDRAIL"

    def __init__(self, ctx: JudgeContext) -> None:
        super().__init__(ctx)
        self.judged: dict[tuple[int, int], Any] = {}
        self.results: list[Any] = []
        self.pairs: dict[tuple[int, int], dict[str, int]] = {}
        for cell in ctx.preset.cells():
            p = cell.params
            if {"mode", "kv_aligned", "seed"} <= set(p):
                self.pairs.setdefault((int(p["kv_aligned"]), int(p["seed"])), {})[p["mode"]] = (
                    cell.index
                )

    @property
    def thresholds(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.ctx.preset.section("thresholds").items()}

    def check_preset(self) -> None:
        matrix, source = self.ctx.preset.matrix, self.ctx.preset.source
        for key in ("mode", "kv_aligned", "seed"):
            if key not in matrix:
                raise PresetError(source, f"matrix.{key}", "an equivalence preset needs this key")
        if sorted(matrix["mode"]) != ["decode", "prefill"]:
            raise PresetError(source, "matrix.mode", 'must be ["prefill", "decode"]')
        for value in matrix["kv_aligned"]:
            if value not in (0, 1) or isinstance(value, bool):
                raise PresetError(source, "matrix.kv_aligned", "values must be 0 or 1")
        for key, values in matrix.items():
            if key not in ("mode", "kv_aligned", "seed") and len(values) != 1:
                raise PresetError(
                    source,
                    f"matrix.{key}",
                    "the B3.67 layout (runs/kv_aligned_K/seed_N/MODE) has no place for a second "
                    "value here; run one preset per value",
                )

    def restore(self, event: Event) -> None:
        super().restore(event)
        if isinstance(event, PairVerdict):
            self.judged[(event.kv_aligned, event.seed)] = event

    async def advance(self) -> None:
        from runners import equivalence_tree

        for key in self._matrix_order():
            if key in self.judged:
                continue
            sides = self.pairs[key]
            if not all(self._side_home(c) for c in sides.values()):
                continue
            kv, seed = key
            try:
                result = await asyncio.to_thread(
                    equivalence_tree.judge_pair, self.ctx.local_dir, kv, seed, self.thresholds
                )
            except ValueError as exc:
                self.judged[key] = None
                self.ctx.emit(Error(message=str(exc), where=f"kv_aligned_{kv}/seed_{seed}"))
                continue
            event = PairVerdict(
                seed=seed,
                kv_aligned=kv,
                verdict=result.verdict,
                metrics={
                    **result.metrics,
                    "pair_count": result.pair_count,
                    "diverged_at_token": result.diverged_at_token,
                },
                thresholds=result.thresholds,
                first_fail=result.first_fail,
                metrics_path=f"metrics/kv_aligned_{kv}/seed_{seed}_metrics.json",
            )
            self.judged[key] = event
            self.ctx.emit(event)

    def _side_home(self, cell: int) -> bool:
        done = self.finished.get(cell)
        return done is not None and done.state == "passed" and cell in self.fetched

    def _matrix_order(self) -> list[tuple[int, int]]:
        return list(self.pairs)

    def finish(self, expected_cells: int) -> RunFinished:
        from runners import equivalence_tree

        results = []
        for key in self._matrix_order():
            if self.judged.get(key) is None:
                continue
            kv, seed = key
            results.append(equivalence_tree.load_pair_result(self.ctx.local_dir, kv, seed))
        unjudged = [
            f"kv_aligned_{k}/seed_{s}"
            for k, s in self._matrix_order()
            if self.judged.get((k, s)) is None
        ]
        matrix = self.ctx.preset.matrix
        config_matrix = {
            "kv_aligned": matrix["kv_aligned"],
            "seeds": matrix["seed"],
            **{k: v for k, v in matrix.items() if k not in ("kv_aligned", "seed", "mode")},
        }
        summary: dict[str, Any] = {}
        if results:
            summary = equivalence_tree.finish(
                self.ctx.local_dir, results, config_matrix, self.thresholds, self.ctx.date
            )
        verdict = summary.get("global_verdict", self.fail_word)
        if unjudged or not self.cells_ok():
            # A pair that could not be judged is not PASS_EQUIV, so the guardrail cannot pass.
            verdict = "FAIL_GUARDRAIL"
            summary = {**summary, "unjudged": unjudged, "errors": self.errors}
        code = EXIT_PASS if verdict in ("PASS_GUARDRAIL", "EXPECTED_DRIFT") else EXIT_FAIL
        return RunFinished(verdict=verdict, exit_code=code, summary=summary)


class ReadoutJudge(Judge):
    """B3.11/B3.12: fill the prefill_last vs decode0 table as trace lines arrive."""

    pass_word, fail_word = "OK", "NO OK"

    def __init__(self, ctx: JudgeContext) -> None:
        super().__init__(ctx)
        from analysis.readout import ReadoutAggregator

        self.aggregator = ReadoutAggregator()

    def check_preset(self) -> None:
        if not self.ctx.preset.section("traces")["follow"]:
            raise PresetError(
                self.ctx.preset.source, "traces.follow", "a readout preset must name its trace file"
            )

    def restore(self, event: Event) -> None:
        super().restore(event)
        if isinstance(event, TraceRecords):
            self._feed(event, emit=False)

    def trace(self, event: TraceRecords) -> None:
        self._feed(event, emit=True)

    def _feed(self, event: TraceRecords, emit: bool) -> None:
        from analysis.readout import TraceError

        changed: dict[str, dict[str, Any]] = {}
        for i, record in enumerate(event.records):
            line = int(record.get("__line__", event.first_line + i))
            clean = {k: v for k, v in record.items() if k != "__line__"}
            try:
                rows = self.aggregator.feed(clean, line, event.file)
            except TraceError as exc:
                self.errors.append(str(exc))
                if emit:
                    self.ctx.emit(Error(message=str(exc), where=f"{event.file}:{line}"))
                continue
            for row in rows:
                changed[str(row["prompt"])] = row
        if emit:
            for row in changed.values():
                self.ctx.emit(ReadoutRow(cell=event.cell, row=row))

    def finish(self, expected_cells: int) -> RunFinished:
        from analysis.readout import to_json

        verdict = self.aggregator.verdict()
        ok = verdict == "OK" and self.cells_ok() and not self.errors
        summary = {**to_json(self.aggregator.rows(), verdict), "errors": self.errors}
        return RunFinished(
            verdict="OK" if ok else "NO OK",
            exit_code=EXIT_PASS if ok else EXIT_FAIL,
            summary=summary,
        )


JUDGES: dict[str, type[Judge]] = {
    "command": Judge,
    "equivalence": EquivalenceJudge,
    "readout": ReadoutJudge,
}


def judge_for(ctx: JudgeContext) -> Judge:
    kind = ctx.preset.kind
    if kind not in JUDGES:
        raise PresetError(
            ctx.preset.source,
            "preset.kind",
            f"kind {kind!r} has no judge in this version yet; use one of {', '.join(JUDGES)}",
        )
    judge = JUDGES[kind](ctx)
    judge.check_preset()
    return judge
