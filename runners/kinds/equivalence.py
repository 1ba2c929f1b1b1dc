"""B3.67 prefill-vs-decode equivalence (seed 000): pairs judged as both sides come home.

The run's local directory is the seed's artifact tree: the cells fetch
runs/kv_aligned_K/seed_N/MODE/{logits.jsonl.gz,metadata.json} into it, each pair is judged as
soon as both sides are home (metrics/kv_aligned_K/seed_N_metrics.json), and the end of the run
writes config.json, summary.json and B3_67_EQUIVALENCE_GUARDRAIL.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import orjson

from analysis.equivalence import (
    EXPECTED_DRIFT,
    FAIL_GUARDRAIL,
    PASS_EQUIV,
    PASS_GUARDRAIL,
    THRESHOLDS,
    PairResult,
    exit_code_for,
    metrics_document,
    resolve_thresholds,
    summarize,
)
from analysis.equivalence_tree import (
    judge_pair,
    judge_tree,
    load_pair_result,
    metrics_path,
    read_config,
)
from analysis.logits import InputError
from analysis.report import report_markdown
from runners.atomic import write_atomic
from runners.cells import CellState
from runners.events import Error, Event, RunFinished, event
from runners.exits import EXIT_FAIL, EXIT_PASS, EXIT_USAGE
from runners.kind import Ending, Judge, JudgeContext, Kind, KindPrinter
from runners.presets import PresetError

REPORT_NAME = "B3_67_EQUIVALENCE_GUARDRAIL.md"
PAIR_KEYS = ("mode", "kv_aligned", "seed")
METRICS_SHOWN = ("max_abs_diff", "p99_abs_diff", "top1_agreement", "cos_sim_mean")


@event
class PairVerdict(Event):
    """One prefill-vs-decode pair judged (B3.67 section 2.2 metrics.json content)."""

    type: ClassVar[str] = "pair_verdict"
    seed: int
    kv_aligned: int
    verdict: str
    metrics: dict[str, Any]
    thresholds: dict[str, float]
    first_fail: dict[str, Any] | None
    metrics_path: str


@event
class PairUnjudged(Event):
    """A pair whose sides came home but could not be judged (bad input, missing file)."""

    type: ClassVar[str] = "pair_unjudged"
    seed: int
    kv_aligned: int
    reason: str


# ---------------------------------------------------------------- writing the tree's documents


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, allow_nan=False, ensure_ascii=False) + "\n")


def write_pair(root: Path, result: PairResult) -> None:
    _write_json(
        metrics_path(root, result.kv_aligned, result.seed), metrics_document(result, _now())
    )


def write_summary(
    root: Path,
    results: list[PairResult],
    config_matrix: dict[str, Any],
    thresholds: dict[str, float],
    date: str,
) -> dict[str, Any]:
    """Writes config.json, summary.json and the report for judged pairs; returns the summary."""
    config = read_config(root) or {}
    config.update(
        {
            "benchmark": "B3.67",
            "date": date,
            "config_matrix": config_matrix,
            "thresholds": thresholds,
        }
    )
    summary = summarize(results, config_matrix, thresholds, date)
    _write_json(root / "config.json", config)
    _write_json(root / "summary.json", summary)
    write_atomic(root / REPORT_NAME, report_markdown(summary, results))
    return summary


def analyze_tree(
    root: str | Path, thresholds: dict[str, float] | None = None, date: str | None = None
) -> tuple[dict[str, Any], list[PairResult]]:
    """Judges every pair of a tree and writes all its documents; returns (summary, results)."""
    root = Path(root)
    judged = judge_tree(root, thresholds, date)
    for result in judged.results:
        write_pair(root, result)
    summary = write_summary(
        root, judged.results, judged.config_matrix, judged.thresholds, judged.date
    )
    return summary, judged.results


# ---------------------------------------------------------------- the judge


class EquivalenceJudge(Judge):
    """Judges each (kv_aligned, seed) pair as soon as both sides are home."""

    def __init__(self, kind: Kind, ctx: JudgeContext) -> None:
        super().__init__(kind, ctx)
        self.pairs: dict[tuple[int, int], dict[str, int]] = {}
        for cell in ctx.cells:
            p = cell.params
            if set(PAIR_KEYS) <= set(p):
                key = (int(p["kv_aligned"]), int(p["seed"]))
                self.pairs.setdefault(key, {})[p["mode"]] = cell.index
        self.judged: dict[tuple[int, int], PairVerdict | PairUnjudged] = {}

    @property
    def thresholds(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.ctx.preset.section("thresholds").items()}

    def on_event(self, event: Event) -> None:
        if isinstance(event, PairVerdict | PairUnjudged):
            self.judged[(event.kv_aligned, event.seed)] = event

    async def advance(self) -> None:
        for key, sides in self.pairs.items():
            if key in self.judged or not all(self._side_home(c) for c in sides.values()):
                continue
            kv, seed = key
            try:
                result = await asyncio.to_thread(self._judge, kv, seed)
            except ValueError as exc:
                self.ctx.emit(Error(message=str(exc), where=f"kv_aligned_{kv}/seed_{seed}"))
                self.ctx.emit(PairUnjudged(seed=seed, kv_aligned=kv, reason=str(exc)))
                continue
            self.ctx.emit(
                PairVerdict(
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
            )

    def _judge(self, kv: int, seed: int) -> PairResult:
        result = judge_pair(self.ctx.local_dir, kv, seed, self.thresholds)
        write_pair(self.ctx.local_dir, result)
        return result

    def _side_home(self, cell: int) -> bool:
        done = self.finished.get(cell)
        return done is not None and done.state == CellState.PASSED and cell in self.fetched

    def verdict(self, ending: Ending) -> RunFinished:
        results = [
            load_pair_result(self.ctx.local_dir, kv, seed)
            for (kv, seed), event in self.judged.items()
            if isinstance(event, PairVerdict)
        ]
        unjudged = [
            f"kv_aligned_{k}/seed_{s}"
            for k, s in self.pairs
            if not isinstance(self.judged.get((k, s)), PairVerdict)
        ]
        matrix = self.ctx.preset.matrix
        config_matrix = {
            "kv_aligned": matrix["kv_aligned"],
            "seeds": matrix["seed"],
            **{k: v for k, v in matrix.items() if k not in PAIR_KEYS},
        }
        summary: dict[str, Any] = {}
        if results:
            summary = write_summary(
                self.ctx.local_dir,
                results,
                config_matrix,
                resolve_thresholds(self.thresholds),
                self.ctx.date,
            )
        verdict = summary.get("global_verdict", FAIL_GUARDRAIL)
        if unjudged or not self.cells_ok():
            # A pair that could not be judged is not PASS_EQUIV, so the guardrail cannot pass.
            verdict = FAIL_GUARDRAIL
            summary = {**summary, "unjudged": unjudged, "errors": [e.message for e in self.errors]}
        code = EXIT_PASS if verdict in (PASS_GUARDRAIL, EXPECTED_DRIFT) else EXIT_FAIL
        return RunFinished(verdict=verdict, exit_code=code, summary=summary)


# ---------------------------------------------------------------- headless lines


def _num(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


class EquivalencePrinter(KindPrinter):
    def lines(self, event: Event) -> list[str]:
        if not isinstance(event, PairVerdict):
            return []
        m = event.metrics
        lines = [
            f"verdict kv_aligned={event.kv_aligned} seed={event.seed}: {event.verdict}  "
            + " ".join(f"{k}={_num(m[k])}" for k in METRICS_SHOWN if k in m)
        ]
        if m.get("diverged_at_token") is not None:
            lines.append(
                f"  greedy decoding parted ways at token {m['diverged_at_token']}: "
                f"compared {m.get('pair_count')} tokens, later ones follow other prefixes"
            )
        if event.first_fail:
            ff = event.first_fail
            lines.append(
                f"  first fail: token {ff.get('token_idx')} {ff.get('metric')}="
                f"{_num(ff.get('value'))} (threshold {_num(ff.get('threshold'))})"
            )
        return lines


# ---------------------------------------------------------------- the kind


class EquivalenceKind(Kind):
    name = "equivalence"
    description = "B3.67 prefill-vs-decode guardrail: per-seed pair verdicts (seed 000)"
    judge_class = EquivalenceJudge
    pass_word, fail_word = PASS_GUARDRAIL, FAIL_GUARDRAIL
    pass_words = frozenset({PASS_GUARDRAIL, PASS_EQUIV})
    smoke = ("b3_67_smoke", ("matrix.seed=[0]",))
    drift_words = frozenset({EXPECTED_DRIFT})
    sections: ClassVar[dict[str, dict[str, tuple[Any, bool, Any]]]] = {
        "thresholds": {key: ((int, float), False, value) for key, value in THRESHOLDS.items()},
    }

    def check(self, data: dict[str, Any], source: str) -> None:
        matrix = data["matrix"]
        for key in PAIR_KEYS:
            if key not in matrix:
                raise PresetError(source, f"matrix.{key}", "an equivalence preset needs this key")
        if sorted(matrix["mode"]) != ["decode", "prefill"]:
            raise PresetError(source, "matrix.mode", 'must be ["prefill", "decode"]')
        for value in matrix["kv_aligned"]:
            if value not in (0, 1) or isinstance(value, bool):
                raise PresetError(source, "matrix.kv_aligned", "values must be 0 or 1")
        for key, values in matrix.items():
            if key not in PAIR_KEYS and len(values) != 1:
                raise PresetError(
                    source,
                    f"matrix.{key}",
                    "the B3.67 layout (runs/kv_aligned_K/seed_N/MODE) has no place for a second "
                    "value here; run one preset per value",
                )

    def printer(self) -> KindPrinter:
        return EquivalencePrinter()

    def claims(self, path: Path) -> bool:
        return path.is_dir() and (path / "runs").exists()

    def analyze_help(self) -> str:
        return "a B3.67 artifacts directory (runs/kv_aligned_K/seed_N/{prefill,decode}/)"

    def analyze(self, path: Path, args: argparse.Namespace) -> int:
        try:
            summary, results = analyze_tree(path)
        except (InputError, ValueError, OSError) as exc:
            print(f"tracedeck: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if args.json:
            print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
            return exit_code_for(summary["global_verdict"])
        for r in results:
            m = r.metrics
            print(
                f"kv_aligned={r.kv_aligned} seed={r.seed}: {r.verdict}  "
                f"max_abs_diff={m['max_abs_diff']:.6g} p99_abs_diff={m['p99_abs_diff']:.6g} "
                f"top1_agreement={m['top1_agreement']:.6g} cos_sim_mean={m['cos_sim_mean']:.6g}"
            )
        ff = summary.get("first_fail")
        if ff:
            print(
                f"first fail: kv_aligned={ff['kv_aligned']} seed={ff['seed']} token "
                f"{ff['token_idx']} {ff['metric']}={ff['value']:.6g} (threshold {ff['threshold']})"
            )
        print(
            f"global verdict: {summary['global_verdict']}  "
            f"(wrote summary.json, metrics/, {REPORT_NAME} in {path})"
        )
        return exit_code_for(summary["global_verdict"])


KIND = EquivalenceKind()
