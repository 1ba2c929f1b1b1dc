"""B3.67 prefill-vs-decode equivalence (seed 000): pairs judged as both sides come home.

The run's local directory is the seed's artifact tree: the cells fetch
runs/kv_aligned_K/seed_N/MODE/{logits.jsonl.gz,metadata.json} into it, each pair is judged as
soon as both sides are home (metrics/kv_aligned_K/seed_N_metrics.json), and the end of the run
writes config.json, summary.json and B3_67_EQUIVALENCE_GUARDRAIL.md. Every one of those files
carries the verdict the run's exit code says; a pair without a verdict is named with why.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import orjson

from analysis.equivalence import (
    EXPECTED_DRIFT,
    FAIL_GUARDRAIL,
    INPUT_ERROR,
    PASS_EQUIV,
    PASS_GUARDRAIL,
    PASS_GUARDRAIL_LOOSENED,
    THRESHOLDS,
    VERDICT_EXIT,
    PairResult,
    Unjudged,
    describe_loosened,
    loosened,
    resolve_thresholds,
    summarize,
)
from analysis.equivalence_claims import ClaimError, checked_pair
from analysis.equivalence_tree import (
    expected_pairs,
    judge_pair,
    judge_tree,
    load_pair_result,
    metrics_path,
    read_config,
    read_pair_metadata,
)
from analysis.logits import InputError
from analysis.report import report_markdown
from analysis.run_compare import Item
from runners.atomic import write_atomic
from runners.cells import CellState, PlannedCell, cell_name
from runners.events import (
    ArtifactFailed,
    ArtifactFetched,
    ArtifactHeld,
    CellFinished,
    CellRequeued,
    Error,
    Event,
    RunFinished,
    RunStarted,
    event,
)
from runners.exits import EXIT_INFRA, EXIT_USAGE
from runners.fetch import changed_since_fetched
from runners.hosted.equivalence import write_pair_metrics
from runners.kind import (
    Asked,
    Ending,
    HostJudging,
    Judge,
    JudgeContext,
    Kind,
    KindPrinter,
    Option,
    failure_text,
)
from runners.kinds import event_types
from runners.presets import PresetError
from runners.progress import Meter
from runners.record import RUN_JSON, RunRecord, read_events
from runners.resources import judge_workers
from runners.targets.base import ConnectionLost, TargetError

# A pair is judged on its host in seconds (162 MiB of logits: about one): a judge silent this
# long is stuck (an engine's FIFO where a file was, a host out of memory) and is killed, the
# pair unjudged, never waited for forever.
HOST_JUDGE_S = 900.0

REPORT_NAME = "B3_67_EQUIVALENCE_GUARDRAIL.md"
LOGITS_NAME = "logits.jsonl.gz"
# What judging on the host needs there: the analyzer (numpy; simdjson, isal, orjson if present).
HOST_JUDGING = HostJudging(
    modules=(
        "analysis/__init__.py",
        "analysis/json_once.py",
        "analysis/high_percentile.py",
        "analysis/logits.py",
        "analysis/parallel.py",
        "analysis/equivalence.py",
        "analysis/equivalence_tree.py",
        "runners/hosted/equivalence.py",
    ),
    requires=("numpy",),
    held=lambda rel: rel.endswith("/" + LOGITS_NAME),
    entry="runners.hosted.equivalence",
)
PAIR_KEYS = ("mode", "kv_aligned", "seed")
METRICS_SHOWN = ("max_abs_diff", "p99_abs_diff", "top1_agreement", "cos_sim_mean")
LOOSE = "loose_thresholds"


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
    precision: dict[str, Any] | None = None
    # Which host ran each side (mode -> host) in a fleet run; {} on one host.
    hosts: dict[str, str] = field(default_factory=dict)


@event
class PairUnjudged(Event):
    """A pair of the matrix with no verdict; `kind` is an analysis.equivalence.Unjudged class."""

    type: ClassVar[str] = "pair_unjudged"
    seed: int
    kv_aligned: int
    reason: str
    kind: str = "output"


# ---------------------------------------------------------------- the tree's documents


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, allow_nan=False, ensure_ascii=False) + "\n")


def write_pair(root: Path, result: PairResult, hosts: dict[str, str] | None = None) -> None:
    write_pair_metrics(root, result, hosts)


def write_summary(
    root: Path,
    results: list[PairResult],
    unjudged: list[Unjudged],
    config_matrix: dict[str, Any],
    thresholds: dict[str, float],
    date: str,
    *,
    notes: list[str] | None = None,
    source: Path | None = None,
) -> dict[str, Any]:
    """Writes config.json, summary.json and the report into `root`; returns the summary.

    `source`: the tree judged, when the documents go elsewhere (analyze --output); its
    config.json is the one carried over.
    """
    summary = summarize(results, config_matrix, thresholds, date, unjudged)
    if notes:
        summary["notes"] = list(notes)
    write_documents(root, summary, results, config_matrix, thresholds, date, source=source)
    return summary


def write_documents(
    root: Path,
    summary: dict[str, Any],
    results: list[PairResult],
    config_matrix: dict[str, Any],
    thresholds: dict[str, float],
    date: str,
    *,
    source: Path | None = None,
) -> None:
    """config.json, summary.json and the report of a judged tree, in `root`."""
    config = read_config(source or root) or {}
    config.update(
        {
            "benchmark": "B3.67",
            "date": date,
            "config_matrix": config_matrix,
            "thresholds": thresholds,
        }
    )
    _write_json(root / "config.json", config)
    _write_json(root / "summary.json", summary)
    write_atomic(root / REPORT_NAME, report_markdown(summary, results))
    return summary


def write_not_judged(root: Path, why: str, date: str) -> dict[str, Any]:
    """Replace a tree's summary and report with ones that say it could not be judged, and why."""
    summary = {
        "benchmark": "B3.67",
        "date": date,
        "global_verdict": INPUT_ERROR,
        "reason": f"the tree could not be judged: {why}",
        "first_fail": None,
        "unjudged": [],
    }
    _write_json(root / "summary.json", summary)
    write_atomic(
        root / REPORT_NAME,
        f"# B3.67 Equivalence Guardrail — {date}\n\n**Global verdict: {INPUT_ERROR}** — the tree "
        f"could not be judged.\n\nWhy: {why}\n",
    )
    return summary


def analyze_tree(
    root: str | Path,
    thresholds: dict[str, float] | None = None,
    date: str | None = None,
    seeds: list[int] | None = None,
    engine_unjudged: list[Unjudged] | None = None,
    workers: int = 1,
    *,
    output: str | Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, Any], list[PairResult]]:
    """Judges every pair of a tree and writes all its documents; returns (summary, results).

    engine_unjudged: pairs a run's record shows never had an engine result; they are named as
    such instead of as missing files. output: where the documents go (default: the tree
    itself); the tree is then only read. progress(pairs judged, pairs): after each pair.
    """
    root = Path(root)
    out = Path(output) if output is not None else root
    judged = judge_tree(root, thresholds, date, seeds, workers, progress=progress)
    known = {(u.kv_aligned, u.seed): u for u in engine_unjudged or []}
    unjudged = [known.get((u.kv_aligned, u.seed), u) for u in judged.unjudged]
    for result in judged.results:
        write_pair(out, result)
    summary = write_summary(
        out,
        judged.results,
        unjudged,
        judged.config_matrix,
        judged.thresholds,
        judged.date,
        notes=judged.notes,
        source=root,
    )
    return summary, judged.results


def written(out: Path, results: list[PairResult]) -> list[Path]:
    """The files analyze_tree wrote into `out`, in the order a reader wants them."""
    return [
        out / "summary.json",
        out / REPORT_NAME,
        out / "config.json",
        *(metrics_path(out, r.kv_aligned, r.seed) for r in results),
    ]


# ---------------------------------------------------------------- the judge


def threadsafe(call: Callable[[int, int], None]) -> Callable[[int, int], None]:
    """`call`, made safe to call from a worker thread: it runs on this event loop."""
    loop = asyncio.get_running_loop()

    def from_thread(done: int, total: int) -> None:
        loop.call_soon_threadsafe(call, done, total)

    return from_thread


# Keys of the run's summary (the run_finished event) that are not the tree's summary.json.
RUN_ONLY = ("errors", "error", "engine_errors")


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
        self.failed_artifacts: dict[int, list[ArtifactFailed]] = {}
        self.hosts: dict[int, str] = {}  # cell -> the fleet host that ran it
        self.judged_pairs: tuple[list[PairResult], dict[str, Any]] = ([], {})

    @property
    def thresholds(self) -> dict[str, float]:
        return resolve_thresholds(
            {k: float(v) for k, v in self.ctx.preset.section("thresholds").items()}
        )

    def on_event(self, event: Event) -> None:
        if isinstance(event, PairVerdict | PairUnjudged):
            self.judged[(event.kv_aligned, event.seed)] = event
        elif isinstance(event, CellFinished) and event.host:
            self.hosts[event.cell] = event.host
        elif isinstance(event, CellRequeued):
            self.failed_artifacts.pop(event.cell, None)
            self.hosts.pop(event.cell, None)
        elif isinstance(event, ArtifactFailed):
            self.failed_artifacts.setdefault(event.cell, []).append(event)

    async def advance(self) -> None:
        for key, sides in self.pairs.items():
            if key in self.judged:
                continue
            kv, seed = key
            why = self._no_result(sides)
            if why is not None:
                self.ctx.emit(PairUnjudged(seed=seed, kv_aligned=kv, reason=why[1], kind=why[0]))
                continue
            if not all(self._side_home(c) for c in sides.values()):
                continue
            hosts = {m: self.hosts[c] for m, c in sides.items() if c in self.hosts}
            meter = Meter("judge", f"kv_aligned={kv} seed={seed}", "tokens", self.ctx.progress)
            on_token = threadsafe(meter.update)

            try:
                host = self.ctx.host_of(next(iter(sides.values())))
                if host is not None:
                    result = await self._judge_on_host(host, kv, seed, hosts)
                else:
                    result = await asyncio.to_thread(self._judge, kv, seed, hosts, on_token)
            except ConnectionLost:
                raise  # judged once the link is back
            except (ValueError, TargetError) as exc:
                # A host judge whose code changed or whose word contradicts its own metrics is
                # not the engine's output to fail: the pair has no verdict (never a pass).
                kind = "infra" if isinstance(exc, TargetError | ClaimError) else "output"
                self.ctx.emit(Error(message=str(exc), where=f"kv_aligned_{kv}/seed_{seed}"))
                self.ctx.emit(PairUnjudged(seed=seed, kv_aligned=kv, reason=str(exc), kind=kind))
                continue
            finally:
                await asyncio.sleep(0)  # the last token's progress, queued from the thread
                meter.finish()
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
                    precision=result.precision,
                    hosts=hosts,
                )
            )

    def _no_result(self, sides: dict[str, int]) -> tuple[str, str] | None:
        """(class, why) when a side of the pair has ended without a result to judge."""
        for mode, cell in sides.items():
            done = self.finished.get(cell)
            if done is None:
                continue
            if done.state != CellState.PASSED:
                params = next(c.params for c in self.ctx.cells if c.index == cell)
                name = cell_name(cell, params, len(self.ctx.cells))
                return "engine", f"{mode} side ({name}): {failure_text(done)}"
            failed = self.failed_artifacts.get(cell)
            if failed:
                f = failed[0]
                return ("engine" if f.missing else "infra"), f"{mode} side: {f.path}: {f.reason}"
        return None

    def _judge(
        self,
        kv: int,
        seed: int,
        hosts: dict[str, str] | None = None,
        on_token: Callable[[int, int], None] | None = None,
    ) -> PairResult:
        # A pair comes home at a time: its two sides are read at once where there are cores.
        workers = min(2, judge_workers())
        result = judge_pair(self.ctx.local_dir, kv, seed, self.thresholds, workers, on_token)
        write_pair(self.ctx.local_dir, result, hosts)
        return result

    async def _judge_on_host(
        self, host: Any, kv: int, seed: int, hosts: dict[str, str]
    ) -> PairResult:
        """The pair judged where its logits are. Its metrics come back on the judge's stdout;
        they are checked against this run's thresholds and the metadata fetched here, and
        every verdict word is recomputed (ClaimError, naming the pair, where they disagree)."""
        said = await host.run(
            HOST_JUDGING,
            ["--kv", str(kv), "--seed", str(seed), "--thresholds", json.dumps(self.thresholds)],
            timeout=HOST_JUDGE_S,
        )
        if said.get("ok") is not True:
            raise ValueError(f"judged on {host.target.name}: {said.get('error')}")
        result = checked_pair(
            said.get("document"),
            kv_aligned=kv,
            seed=seed,
            thresholds=self.thresholds,
            metadata=read_pair_metadata(self.ctx.local_dir, kv, seed),
            where=host.target.name,
        )
        write_pair(self.ctx.local_dir, result, hosts)
        return result

    def _side_home(self, cell: int) -> bool:
        """The side passed and every artifact it must bring home is here (or held there)."""
        done = self.finished.get(cell)
        wanted = next(set(c.artifacts) for c in self.ctx.cells if c.index == cell)
        return done is not None and done.state == CellState.PASSED and self.home(cell, wanted)

    def verdict(self, ending: Ending) -> RunFinished:
        results: list[PairResult] = []
        unjudged: list[Unjudged] = []
        for key in self.pairs:
            kv, seed = key
            got = self.judged.get(key)
            if isinstance(got, PairVerdict):
                results.append(load_pair_result(self.ctx.local_dir, kv, seed))
            elif isinstance(got, PairUnjudged):
                unjudged.append(Unjudged(kv, seed, got.kind, got.reason))
            else:
                why = self._no_result(self.pairs[key]) or ("engine", "no side produced a result")
                unjudged.append(Unjudged(kv, seed, why[0], why[1]))
        matrix = self.ctx.preset.matrix
        config_matrix = {
            "kv_aligned": matrix["kv_aligned"],
            "seeds": matrix["seed"],
            **{k: v for k, v in matrix.items() if k not in PAIR_KEYS},
        }
        summary = summarize(results, config_matrix, self.thresholds, self.ctx.date, unjudged)
        self.judged_pairs = (results, config_matrix)
        word = summary["global_verdict"]
        summary["errors"] = [e.message for e in self.errors]
        return RunFinished(verdict=word, exit_code=VERDICT_EXIT[word], summary=summary)

    def keep(self, result: RunFinished) -> None:
        results, config_matrix = self.judged_pairs
        # the seed's summary.json: what the run's own summary adds (its errors) stays out
        document = {k: v for k, v in result.summary.items() if k not in RUN_ONLY}
        write_documents(
            self.ctx.local_dir, document, results, config_matrix, self.thresholds, self.ctx.date
        )


# ---------------------------------------------------------------- headless lines


def _num(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def precision_text(p: dict[str, Any] | None) -> str:
    """`max |Δ| = 2 ULP of bf16 at |logit| 3.1; max relative Δ 0.004`, or ''."""
    if not p:
        return ""
    parts = []
    if p.get("max_abs_diff_ulps") is not None:
        parts.append(
            f"max |Δ| = {p['max_abs_diff_ulps']:.3g} ULP of {p['dtype']} at |logit| "
            f"{p['logit_magnitude']:.3g}"
        )
    parts.append(f"max relative Δ {p.get('max_rel_diff', 0):.3g}")
    return "; ".join(parts)


def _comparison(metric: str) -> str:
    return "must be >=" if metric.endswith("_min") or metric == "top1_agreement" else "must be <="


def first_fail_box(ff: dict[str, Any]) -> list[str]:
    """The run's first failure as the console's first-fail panel shows it: the pair and token,
    the metric against its threshold, both sides' top-5, where in the files."""
    head = (
        f"first fail: kv_aligned={ff.get('kv_aligned', '?')} seed={ff.get('seed', '?')} "
        f"token_idx={ff.get('token_idx', '?')} token_id={ff.get('token_id', '?')} FAIL_EQUIV"
    )
    metric = str(ff.get("metric", "?"))
    if metric == "token_id":
        ids = ff.get("token_ids") or {}
        what = (
            f"  token_id: the modes wrote different tokens: prefill {ids.get('prefill')}, "
            f"decode {ids.get('decode')} (kv_aligned=1 must produce the same tokens)"
        )
    else:
        what = (
            f"  {metric} = {_num(ff.get('value'))}  threshold {_num(ff.get('threshold'))} "
            f"({_comparison(metric)})"
        )
    lines = ["", head, what]
    lines += [line[2:] for line in first_fail_lines(ff)[1:]]
    return lines


def first_fail_lines(ff: dict[str, Any]) -> list[str]:
    """The first failure as the console shows it: token, metric, both sides' top-5, where."""
    if ff.get("metric") == "token_id":
        ids = ff.get("token_ids") or {}
        head = (
            f"  first fail: token {ff.get('token_idx')}: the modes wrote different tokens "
            f"(prefill {ids.get('prefill')}, decode {ids.get('decode')})"
        )
    else:
        head = (
            f"  first fail: token {ff.get('token_idx')} {ff.get('metric')}="
            f"{_num(ff.get('value'))} (threshold {_num(ff.get('threshold'))})"
        )
    lines = [
        head,
        f"    {'rank':>4}  {'prefill id':>10} {'logit':>10}  {'decode id':>10} {'logit':>10}",
    ]
    top5 = ff.get("top5") or {}
    pre, dec = top5.get("prefill") or [], top5.get("decode") or []
    for rank in range(max(len(pre), len(dec))):
        p = pre[rank] if rank < len(pre) else ["", ""]
        d = dec[rank] if rank < len(dec) else ["", ""]
        lines.append(
            f"    {rank + 1:>4}  {p[0]!s:>10} {_num(p[1]):>10}  {d[0]!s:>10} {_num(d[1]):>10}"
        )
    for side, where in (ff.get("where") or {}).items():
        lines.append(f"    {side}: {where}")
    if ff.get("note"):
        lines.append(f"    note: {ff['note']}")
    return lines


class EquivalencePrinter(KindPrinter):
    def lines(self, event: Event) -> list[str]:
        if isinstance(event, PairUnjudged):
            return [
                f"not judged kv_aligned={event.kv_aligned} seed={event.seed} ({event.kind}): "
                f"{event.reason}"
            ]
        if not isinstance(event, PairVerdict):
            return []
        m = event.metrics
        lines = [
            f"verdict kv_aligned={event.kv_aligned} seed={event.seed}: {event.verdict}  "
            + " ".join(f"{k}={_num(m[k])}" for k in METRICS_SHOWN if k in m)
        ]
        if event.hosts:
            lines.append(
                "  hosts: " + ", ".join(f"{mode} on {h}" for mode, h in sorted(event.hosts.items()))
            )
        if event.precision:
            lines.append(f"  precision: {precision_text(event.precision)}")
        if m.get("diverged_at_token") is not None:
            lines.append(
                f"  the modes wrote different tokens at token {m['diverged_at_token']}: "
                f"compared {m.get('pair_count')} tokens, later ones follow other prefixes"
            )
        if event.first_fail:
            lines += first_fail_lines(event.first_fail)
        return lines

    def final(self, event: RunFinished) -> list[str]:
        s = event.summary
        lines = []
        ff = s.get("first_fail")
        if isinstance(ff, dict):
            lines += first_fail_box(ff)
        if s.get("reason"):
            lines.append(f"why: {s['reason']}")
        for u in s.get("unjudged") or []:
            lines.append(f"not judged: {u['pair']} ({u['class']}): {u['why']}")
        if s.get("thresholds_loosened"):
            lines.append(f"THRESHOLDS LOOSENED: {describe_loosened(s['thresholds_loosened'])}")
        return lines


# ---------------------------------------------------------------- the kind


def check_thresholds(values: dict[str, Any], source: str, allow_loose: bool, how: str) -> None:
    """Finite, non-negative, and no looser than the seed's unless the operator asked."""
    try:
        resolved = resolve_thresholds(values)
    except ValueError as exc:
        key = str(exc).split("'")[1] if "'" in str(exc) else ""
        raise PresetError(source, f"thresholds.{key}" if key else "thresholds", str(exc)) from None
    loose = loosened(resolved)
    if loose and not allow_loose:
        key = next(iter(loose))
        raise PresetError(
            source,
            f"thresholds.{key}",
            f"looser than the seed's guardrail ({describe_loosened(loose)}); stricter thresholds "
            f"may be set, looser ones only with {how}",
        )


class EquivalenceKind(Kind):
    name = "equivalence"
    description = "B3.67 prefill-vs-decode guardrail: per-seed pair verdicts (seed 000)"
    judge_class = EquivalenceJudge
    judges_items_apart = True
    verdict_key = "global_verdict"
    events = (PairVerdict, PairUnjudged)
    pass_word, fail_word = PASS_GUARDRAIL, FAIL_GUARDRAIL
    pass_words = frozenset({PASS_GUARDRAIL, PASS_EQUIV})
    # A loosened pass is the operator's choice, not the seed's guardrail: shown like drift.
    drift_words = frozenset({EXPECTED_DRIFT, PASS_GUARDRAIL_LOOSENED})
    host_judging = HOST_JUDGING

    item_events = (PairVerdict,)

    def item_of(self, event: Event) -> Item:
        from analysis.compare_items import pair_item

        return pair_item(event.to_dict())

    def compare_items(
        self, events: list[dict[str, Any]], summary: dict[str, Any] | None
    ) -> list[Item]:
        from analysis.compare_items import equivalence_items

        return equivalence_items(events)

    smoke = ("b3_67_smoke", ("matrix.seed=[0]",))
    options: ClassVar[dict[str, str]] = {
        LOOSE: "B3.67: allow [thresholds] looser than the seed's; every verdict then says so",
    }
    sections: ClassVar[dict[str, dict[str, tuple[Any, bool, Any]]]] = {
        "thresholds": {key: ((int, float), False, value) for key, value in THRESHOLDS.items()},
    }

    def exit_code(self, word: str) -> int:
        return VERDICT_EXIT.get(word, super().exit_code(word))

    def together(self, cells: list[PlannedCell]) -> list[list[int]]:
        """Both sides of a pair (one kv_aligned, one seed: prefill and decode) on one host: a
        pair compared across two machines would judge the machines, not the modes."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for c in cells:
            key = (
                tuple(c.params.get(k) for k in ("kv_aligned", "seed"))
                if set(PAIR_KEYS) <= set(c.params)
                else ("cell", c.index)
            )
            groups.setdefault(key, []).append(c.index)
        return list(groups.values())

    def matrix_keys_read(self, data: dict[str, Any]) -> set[str]:
        return set(PAIR_KEYS)  # a pair is the same (kv_aligned, seed) in both modes

    def check(self, data: dict[str, Any], source: str, options: frozenset[str]) -> None:
        matrix = data["matrix"]
        for key in PAIR_KEYS:
            if key not in matrix:
                raise PresetError(source, f"matrix.{key}", "an equivalence preset needs this key")
        if sorted(matrix["mode"]) != ["decode", "prefill"]:
            raise PresetError(source, "matrix.mode", 'must be ["prefill", "decode"]')
        for value in matrix["kv_aligned"]:
            if value not in (0, 1) or isinstance(value, bool):
                raise PresetError(source, "matrix.kv_aligned", "values must be 0 or 1")
        if 1 not in matrix["kv_aligned"]:
            raise PresetError(
                source,
                "matrix.kv_aligned",
                "needs 1: a guardrail with no kv_aligned=1 pair guards nothing and never passes",
            )
        for key in ("kv_aligned", "seed"):
            twice = sorted({repr(v) for v in matrix[key] if matrix[key].count(v) > 1})
            if twice:
                raise PresetError(
                    source,
                    f"matrix.{key}",
                    f"{', '.join(twice)} given more than once: the B3.67 layout has one place per "
                    "pair, so only the last run of it would be judged and the others never seen",
                )
        for key, values in matrix.items():
            if key not in PAIR_KEYS and len(values) != 1:
                raise PresetError(
                    source,
                    f"matrix.{key}",
                    "the B3.67 layout (runs/kv_aligned_K/seed_N/MODE) has no place for a second "
                    "value here; run one preset per value",
                )
        check_thresholds(data["thresholds"], source, LOOSE in options, "--loose-thresholds")

    def printer(self) -> KindPrinter:
        return EquivalencePrinter()

    def claims(self, path: Path) -> bool:
        return path.is_dir() and (path / "runs").exists()

    def analyze_help(self) -> str:
        return "a B3.67 artifacts directory (runs/kv_aligned_K/seed_N/{prefill,decode}/)"

    analyze_options = (
        Option(
            "seeds",
            "B3.67: the seeds the tree must hold, e.g. 0,1 (default: config.json's, else the "
            "seed's 0,1,2)",
            parse=lambda text: _int_list(text),
        ),
        Option(
            "threshold",
            "B3.67: a threshold (stricter than the seed's; looser needs --loose-thresholds)",
            many=True,
            metavar="KEY=VALUE",
        ),
        Option(
            "workers",
            "processes judging at once (B3.67 default: as many as cores and memory allow; DSA "
            "default 1: more were slower in bench/bench_dsa_analyze.py)",
            parse=lambda text: _positive_int(text),
        ),
    )

    def analyze(self, path: Path, asked: Asked) -> int:
        """Judge a tree; write metrics/, config.json, summary.json and the report into it, or
        into --output (the tree is then only read); say every file written."""
        try:
            thresholds = _threshold_args(asked["threshold"] or [])
            if thresholds is not None:
                check_thresholds(
                    thresholds, "--threshold", bool(asked["loose_thresholds"]), "--loose-thresholds"
                )
        except (PresetError, ValueError) as exc:
            asked.err(f"tracedeck: {exc}")
            return EXIT_USAGE
        out = asked.output or path
        linked = _linked_out(out)
        if linked is not None:
            asked.err(
                f"tracedeck: {linked}: a link out of {out} (to {linked.resolve()}); analyze "
                "writes its documents into the tree only, never through a link into another "
                "place (nothing was written): remove the link or name another --output"
            )
            return EXIT_USAGE
        held = _held_on_host(path)
        if held:
            asked.err(
                f"tracedeck: {path}: this run was judged on {held[0]}, where {len(held) - 1} "
                f"file(s) it needs stayed (e.g. {held[1]}); `tracedeck fetch {path}` brings "
                "them home, then analyze again (nothing was written)"
            )
            return EXIT_USAGE
        changed, unchecked = _changed_since_fetched(path)
        if unchecked:
            asked.err(f"tracedeck: warning: {unchecked}")
        if changed:
            asked.err(
                f"tracedeck: {path}: {len(changed)} file(s) the run judged changed since it "
                f"fetched them, e.g. {changed[0]}; judging them now would not judge the run "
                "(nothing was written): `tracedeck fetch` or a rerun brings the real ones"
            )
            return EXIT_USAGE
        engine = _engine_failures(path, asked["seeds"])
        meter = Meter("judge", str(path), "pairs", asked.progress)
        try:
            summary, results = analyze_tree(
                path,
                thresholds,
                seeds=asked["seeds"],
                engine_unjudged=engine,
                workers=judge_workers(asked["workers"]),
                output=out,
                progress=meter.update,
            )
        except (InputError, ValueError, OSError) as exc:
            asked.err(f"tracedeck: {exc}")
            if (path / "runs").is_dir() or (path / "summary.json").exists() or out != path:
                write_not_judged(out, str(exc), datetime.now(UTC).strftime("%Y-%m-%d"))
                for wrote in (out / "summary.json", out / REPORT_NAME):
                    asked.err(f"tracedeck: wrote {wrote} (it says the tree was not judged)")
            if engine:
                for u in engine:
                    asked.err(f"not judged: {u.to_json()['pair']} ({u.kind}): {u.why}")
                return EXIT_INFRA
            return EXIT_USAGE
        finally:
            meter.finish()
        files = written(out, results)
        code = VERDICT_EXIT[summary["global_verdict"]]
        for u in summary["unjudged"]:
            asked.err(f"tracedeck: not judged {u['pair']} ({u['class']}): {u['why']}")
        if asked.json:
            # One document for CI: the summary, every pair's metrics (first fail included) as
            # written to metrics/, and the files written.
            pairs = [json.loads(f.read_text(encoding="utf-8")) for f in files[3:]]
            doc = {**summary, "pairs": pairs, "wrote": [str(f) for f in files]}
            asked.out(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
            asked.err(f"tracedeck: wrote {len(files)} files in {out}")
            return code
        printer = EquivalencePrinter()
        for r in results:
            m = r.metrics
            asked.out(
                f"kv_aligned={r.kv_aligned} seed={r.seed}: {r.verdict}  "
                f"max_abs_diff={m['max_abs_diff']:.6g} p99_abs_diff={m['p99_abs_diff']:.6g} "
                f"top1_agreement={m['top1_agreement']:.6g} cos_sim_mean={m['cos_sim_mean']:.6g}"
            )
            if r.precision:
                asked.out(f"  precision: {precision_text(r.precision)}")
            if r.diverged_at_token is not None:
                asked.out(
                    f"  the modes wrote different tokens at token {r.diverged_at_token}: "
                    f"compared {r.pair_count} of {max(r.tokens.values())} tokens"
                )
        for line in printer.final(RunFinished(summary["global_verdict"], code, summary)):
            asked.out(line)
        for note in summary.get("notes", []):
            asked.out(f"note: {note}")
        for f in files:
            asked.out(f"wrote {f}")
        asked.out(f"global verdict: {summary['global_verdict']}")
        return code


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{text!r}: give seeds as 0,1,2") from None
    if not values or any(v < 0 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{text!r}: give distinct non-negative seeds as 0,1,2")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{text!r}: give a whole number of processes, 1 or more")
    return value


def _threshold_args(items: list[str]) -> dict[str, float] | None:
    if not items:
        return None
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in THRESHOLDS:
            raise ValueError(
                f"--threshold {item!r}: give KEY=VALUE with KEY one of {', '.join(THRESHOLDS)}"
            )
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--threshold {item!r}: {value!r} is not a number") from None
    return out


def _linked_out(out: Path) -> Path | None:
    """A directory analyze writes into under `out` that is a link, or leads out of `out`."""
    metrics = out / "metrics"
    inside = out.resolve()
    for p in [metrics, *(sorted(metrics.iterdir()) if metrics.is_dir() else [])]:
        if p.is_symlink() or (p.exists() and not p.resolve().is_relative_to(inside)):
            return p
    return None


def _held_on_host(root: Path) -> list[str]:
    """[host, path...] of what a run judged on its host left there; [] when all is here."""
    if not (root / RUN_JSON).is_file() or not (root / "events.jsonl").is_file():
        return []
    try:
        target = RunRecord.load(root).target
        events = read_events(root / "events.jsonl", event_types()).events
    except (OSError, ValueError, TypeError):
        return []
    held = {(e.cell, e.path) for e in events if isinstance(e, ArtifactHeld)}
    held -= {(e.cell, e.path) for e in events if isinstance(e, ArtifactFetched)}
    missing = sorted(path for _, path in held if not (root / path).is_file())
    return [target, *missing] if missing else []


def _changed_since_fetched(root: Path) -> tuple[list[str], str]:
    """runners.fetch.changed_since_fetched for a run's directory ([] for another tree), and
    why the files could not be checked ("" when they were, or there is nothing to check)."""
    events_path = root / "events.jsonl"
    if not (root / RUN_JSON).is_file() or not events_path.is_file():
        return [], ""
    try:
        events = read_events(events_path, event_types()).events
    except (OSError, ValueError, TypeError) as exc:
        return [], (
            f"{events_path} cannot be read ({exc}): the files are judged as they are now, "
            "not checked against what the run fetched"
        )
    return changed_since_fetched(root, events), ""


def _engine_failures(root: Path, seeds: list[int] | None) -> list[Unjudged]:
    """Pairs a run's record shows had no engine result (for a run directory; else none)."""
    if not (root / RUN_JSON).is_file() or not (root / "events.jsonl").is_file():
        return []
    try:
        run_id = RunRecord.load(root).run_id
        events = read_events(root / "events.jsonl", event_types()).events
    except (OSError, ValueError, TypeError):
        return []
    params = {c["index"]: c["params"] for e in events if isinstance(e, RunStarted) for c in e.cells}
    out: dict[tuple[int, int], Unjudged] = {}
    for e in events:
        if not isinstance(e, CellFinished) or e.state == CellState.PASSED:
            continue
        p = params.get(e.cell, {})
        if not set(PAIR_KEYS) <= set(p):
            continue
        key = (int(p["kv_aligned"]), int(p["seed"]))
        why = f"{p['mode']} side of run {run_id}: {failure_text(e)}"
        out.setdefault(key, Unjudged(key[0], key[1], "engine", why))
    if (root / "runs").is_dir():
        wanted = set(expected_pairs(root, seeds)[0])
        return [u for k, u in out.items() if k in wanted]
    return list(out.values())


KIND = EquivalenceKind()
