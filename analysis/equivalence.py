"""B3.67 judgement: prefill-vs-decode pair metrics, verdicts and summary (seed sections 2-3, 8).

Metrics follow seed section 8 on float32 logits: max_abs_diff and p99_abs_diff over every
|prefill - decode| element of the pair, top1_agreement as the fraction of tokens whose argmax
agree, cos_sim_mean as the mean of the per-token cosines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from analysis.high_percentile import TopValues, high_percentile
from analysis.logits import InputError, LogitsRow, LogitsTable, iter_logits
from analysis.parallel import SideRows, iter_logits_elsewhere

THRESHOLDS: dict[str, float] = {
    "p99_abs_diff_max": 1e-3,
    "max_abs_diff_max": 5e-3,
    "top1_agreement_min": 0.999,
}

PASS_EQUIV = "PASS_EQUIV"
FAIL_EQUIV = "FAIL_EQUIV"
EXPECTED_DRIFT = "EXPECTED_DRIFT"
PASS_GUARDRAIL = "PASS_GUARDRAIL"
FAIL_GUARDRAIL = "FAIL_GUARDRAIL"
# Beyond the seed's words: a pass under thresholds the operator loosened on purpose
# (--loose-thresholds), a tree `analyze` could not wholly judge, an engine that crashed or never
# ran, and artifacts that could not be brought home.
PASS_GUARDRAIL_LOOSENED = "PASS_GUARDRAIL_LOOSENED"
INPUT_ERROR = "INPUT_ERROR"
ENGINE_ERROR = "ENGINE_ERROR"
INFRA_ERROR = "INFRA_ERROR"
VERDICT_EXIT = {
    PASS_GUARDRAIL: 0,
    PASS_GUARDRAIL_LOOSENED: 0,
    FAIL_GUARDRAIL: 1,
    INPUT_ERROR: 2,
    ENGINE_ERROR: 3,
    INFRA_ERROR: 3,
}
# Rounding step of each dtype's significand (explicit bits), for the precision context.
SIGNIFICAND_BITS = {"bf16": 7, "fp16": 10, "fp32": 23, "f16": 10, "f32": 23, "bfloat16": 7}

METRIC_KEYS = ("max_abs_diff", "p99_abs_diff", "top1_agreement", "cos_sim_mean")
PAIR_HINT = "the two sides did not run the same tokens; re-run the pair with the same seed"


def resolve_thresholds(thresholds: dict[str, float] | None = None) -> dict[str, float]:
    """The seed's thresholds with any given ones laid over them."""
    resolved = dict(THRESHOLDS)
    for key, value in (thresholds or {}).items():
        if key not in THRESHOLDS:
            raise ValueError(f"unknown threshold '{key}' (known: {', '.join(THRESHOLDS)})")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"threshold '{key}' must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"threshold '{key}' must be a finite number >= 0, got {value!r}")
        if key == "top1_agreement_min" and value > 1:
            raise ValueError(f"threshold '{key}' is a fraction: at most 1, got {value!r}")
        resolved[key] = float(value)
    return resolved


def loosened(thresholds: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each threshold looser than the seed's: {key: {seed, used, factor}} (empty: none is)."""
    out: dict[str, dict[str, float]] = {}
    for key, seed in THRESHOLDS.items():
        used = thresholds.get(key, seed)
        looser = used < seed if key.endswith("_min") else used > seed
        if looser:
            # how many times more the loosened threshold lets through
            allowed = (1 - used) / (1 - seed) if key.endswith("_min") else used / seed
            out[key] = {"seed": seed, "used": used, "factor": allowed}
    return out


def describe_loosened(loose: dict[str, dict[str, float]]) -> str:
    """`p99_abs_diff_max 0.001 -> 0.01 (10x)`, for banners, reports and the history list."""
    return ", ".join(
        f"{key} {v['seed']:g} -> {v['used']:g} ({v['factor']:.3g}x)" for key, v in loose.items()
    )


@dataclass
class PairResult:
    seed: int
    kv_aligned: int
    dtype: str
    prompt_len: int
    gen_len: int
    pair_count: int
    metrics: dict[str, float]
    verdict: str
    thresholds: dict[str, float]
    first_fail: dict[str, Any] | None
    prefill_path: str = ""
    decode_path: str = ""
    # Greedy decoding parted ways at this token: it and the ones before were compared.
    diverged_at_token: int | None = None
    # Lines in each side's file (every line is read and checked, compared or not).
    tokens: dict[str, int] = field(default_factory=dict)
    # Where max |Δ| is, in the dtype's rounding steps at that logit's magnitude, and the
    # largest relative difference: context for reading the absolute metrics, not a verdict.
    precision: dict[str, Any] | None = None


def pair_verdict(metrics: dict[str, float], kv_aligned: int, thresholds: dict[str, float]) -> str:
    """Seed section 3.2."""
    if kv_aligned == 0:
        return EXPECTED_DRIFT
    if kv_aligned != 1:
        raise ValueError(f"kv_aligned must be 0 or 1, got {kv_aligned!r}")
    ok = (
        metrics["p99_abs_diff"] <= thresholds["p99_abs_diff_max"]
        and metrics["max_abs_diff"] <= thresholds["max_abs_diff_max"]
        and metrics["top1_agreement"] >= thresholds["top1_agreement_min"]
    )
    return PASS_EQUIV if ok else FAIL_EQUIV


def failing_metrics(
    metrics: dict[str, float], thresholds: dict[str, float]
) -> list[tuple[str, float, float]]:
    """(metric, value, threshold) for each pair metric that breaks its threshold."""
    t = thresholds
    checks = (
        ("p99_abs_diff", t["p99_abs_diff_max"], metrics["p99_abs_diff"] > t["p99_abs_diff_max"]),
        ("max_abs_diff", t["max_abs_diff_max"], metrics["max_abs_diff"] > t["max_abs_diff_max"]),
        (
            "top1_agreement",
            t["top1_agreement_min"],
            metrics["top1_agreement"] < t["top1_agreement_min"],
        ),
    )
    return [(name, metrics[name], limit) for name, limit, bad in checks if bad]


def exit_code_for(verdict: str) -> int:
    """The exit code a global verdict carries (VERDICT_EXIT)."""
    if verdict not in VERDICT_EXIT:
        raise ValueError(f"not a global verdict: {verdict!r}")
    return VERDICT_EXIT[verdict]


# ---------------------------------------------------------------- the pair judge


def _top5(row: np.ndarray) -> list[list[Any]]:
    """The five highest logits as [[token_id, logit], ...], ties broken by the lower id."""
    n = min(5, row.shape[0])
    fifth = np.partition(row, row.shape[0] - n)[row.shape[0] - n]
    above = np.flatnonzero(row > fifth)
    level = np.flatnonzero(row == fifth)[: n - above.shape[0]]
    ids = np.concatenate([above, level])
    ids = ids[np.lexsort((ids, -row[ids]))]
    return [[int(i), float(row[i])] for i in ids]


@dataclass
class _Candidate:
    token_idx: int
    token_id: int
    ids: tuple[int, int]  # the token id each side wrote here
    tripped: list[tuple[str, float, float | None]]
    top5: dict[str, list[list[Any]]]
    where: dict[str, str]


@dataclass
class _PairJudge:
    """Takes a pair's rows one token at a time; keeps |Δ| for the exact p99 (every one, or with
    keep_all False the top few per cent: TopValues) and O(1) per token."""

    prefill_path: str
    decode_path: str
    kv_aligned: int
    thresholds: dict[str, float]
    capacity: int = 128
    keep_all: bool = True
    count: int = 0
    vocab: int = 0
    max_value: float = -1.0
    agree: int = 0
    cosines: list[float] = field(default_factory=list)
    first: _Candidate | None = None
    largest: _Candidate | None = None
    largest_value: float = -1.0
    diverged_at: int | None = None
    skipped: int = 0
    max_at: tuple[int, int, float, float] | None = None  # token_idx, vocab index, a, b
    max_rel: float = 0.0
    max_rel_at: tuple[int, int] | None = None
    _diffs: np.ndarray | None = None  # every |Δ| (keep_all), else the current row's
    _tops: TopValues | None = None
    _scratch: np.ndarray = field(default_factory=lambda: np.empty((2, 0), np.float32))
    _products: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))

    def add(
        self,
        token_idx: int,
        prefill_id: int,
        decode_id: int,
        a: np.ndarray,
        b: np.ndarray,
        prefill_line: int,
        decode_line: int,
    ) -> None:
        split = prefill_id != decode_id
        if split and self.kv_aligned != 1 and not _greedy_divergence(a, b, prefill_id, decode_id):
            raise InputError(
                self.prefill_path,
                prefill_line,
                f"token_idx {token_idx} has token_id {prefill_id} here but {decode_id} in "
                f"{self.decode_path}:{decode_line}: the pair is not comparable",
                PAIR_HINT,
            )
        if self._diffs is None:
            self.vocab = a.shape[0]
            if self.keep_all:
                self._diffs = np.empty(max(self.capacity, 1) * self.vocab, dtype=np.float32)
            else:
                self._diffs = np.empty(self.vocab, dtype=np.float32)
                self._tops = TopValues(99, first=_TOP_FIRST)
            self._scratch = np.empty((2, self.vocab), dtype=np.float32)
            self._products = np.empty(self.vocab, dtype=np.float64)
        if a.shape != b.shape:
            raise InputError(
                self.prefill_path,
                prefill_line,
                f"vocab size {a.shape[0]} here but {b.shape[0]} in "
                f"{self.decode_path}:{decode_line}: the pair is not comparable",
                "both sides must log the full logits of the same model",
            )
        v = self.vocab
        start = self.count * v if self.keep_all else 0
        if start + v > self._diffs.shape[0]:
            grown = np.empty(2 * self._diffs.shape[0], dtype=np.float32)
            grown[:start] = self._diffs[:start]
            self._diffs = grown
        diff = self._diffs[start : start + v]
        with np.errstate(over="ignore"):
            np.subtract(a, b, out=diff)
        np.abs(diff, out=diff)
        at = int(np.argmax(diff))
        row_max = float(diff[at])
        if not np.isfinite(row_max):
            raise InputError(
                self.prefill_path,
                prefill_line,
                f"the difference with {self.decode_path}:{decode_line} overflows float32",
                "the logits are out of any sane range; check the engine's output",
            )
        argmax_a = int(np.argmax(a))
        argmax_b = int(np.argmax(b))
        if split:
            # The sides wrote different tokens here: this token's logits share a prefix and
            # compare; every later token follows a different prefix and cannot.
            self.diverged_at = token_idx
        self.agree += argmax_a == argmax_b
        self.cosines.append(_cosine(a, b, self._products))
        if row_max > self.max_value:
            self.max_value = row_max
            self.max_at = (token_idx, at, float(a[at]), float(b[at]))
        self._relative(a, b, diff, token_idx)
        if self._tops is not None:
            self._tops.add(diff)
        self.count += 1
        if self.kv_aligned == 1 and self.first is None:
            self._track_failure(
                token_idx,
                (prefill_id, decode_id),
                a,
                b,
                diff,
                row_max,
                argmax_a == argmax_b,
                prefill_line,
                decode_line,
            )

    def _relative(self, a: np.ndarray, b: np.ndarray, diff: np.ndarray, token_idx: int) -> None:
        """Track the largest |Δ| / max(|a|, |b|) (two zeros compare as equal)."""
        scale, rel = self._scratch[0], self._scratch[1]
        np.abs(a, out=scale)
        np.abs(b, out=rel)
        np.maximum(scale, rel, out=scale)
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(diff, scale, out=rel)
            at = int(np.argmax(rel))
            if np.isnan(rel[at]):  # 0 / 0 where both sides are 0 (argmax stops at a NaN)
                rel = np.where(scale > 0, rel, np.float32(0.0))
                at = int(np.argmax(rel))
        if float(rel[at]) > self.max_rel:
            self.max_rel = float(rel[at])
            self.max_rel_at = (token_idx, at)

    def _track_failure(
        self,
        token_idx: int,
        ids: tuple[int, int],
        a: np.ndarray,
        b: np.ndarray,
        diff: np.ndarray,
        row_max: float,
        agree: bool,
        prefill_line: int,
        decode_line: int,
    ) -> None:
        t = self.thresholds
        tripped: list[tuple[str, float, float | None]] = []
        if ids[0] != ids[1]:
            # kv_aligned=1: both modes must produce the same tokens, whatever the logits say.
            tripped.append(("token_id", float(ids[1]), None))
        if not agree:
            tripped.append(("top1_agreement", 0.0, t["top1_agreement_min"]))
        if row_max > t["max_abs_diff_max"]:
            tripped.append(("max_abs_diff", row_max, t["max_abs_diff_max"]))
        # The row's p99 lies at or below its (k+1)-th smallest value, so it can only exceed the
        # threshold when at least v-k-1 values are near or above it; skip the sort otherwise.
        v = diff.shape[0]
        k = int(np.floor(0.99 * (v - 1)))
        near = int(np.count_nonzero(diff > t["p99_abs_diff_max"] * 0.999))
        if near >= v - k - 1:
            p99 = float(np.percentile(diff, 99))
            if p99 > t["p99_abs_diff_max"]:
                tripped.append(("p99_abs_diff", p99, t["p99_abs_diff_max"]))
        if tripped:
            self.first = self._candidate(token_idx, ids, a, b, tripped, prefill_line, decode_line)
        elif row_max > self.largest_value:
            self.largest_value = row_max
            self.largest = self._candidate(token_idx, ids, a, b, [], prefill_line, decode_line)

    def _candidate(
        self,
        token_idx: int,
        ids: tuple[int, int],
        a: np.ndarray,
        b: np.ndarray,
        tripped: list[tuple[str, float, float | None]],
        prefill_line: int,
        decode_line: int,
    ) -> _Candidate:
        return _Candidate(
            token_idx=token_idx,
            token_id=ids[0],
            ids=ids,
            tripped=tripped,
            top5={"prefill": _top5(a), "decode": _top5(b)},
            where={
                "prefill": f"{self.prefill_path}:{prefill_line}",
                "decode": f"{self.decode_path}:{decode_line}",
            },
        )

    def metrics(self) -> dict[str, float]:
        if self.count == 0 or self._diffs is None:
            raise InputError(self.prefill_path, None, "no tokens to compare", PAIR_HINT)
        if self._tops is not None:
            p99 = self._tops.percentile()
            if p99 is None:
                raise _EveryDiffNeeded
        else:
            # np.percentile's own value (linear interpolation) over every |Δ|, reordering the
            # buffer in place: it is not needed afterwards.
            p99 = high_percentile(self._diffs[: self.count * self.vocab], 99)
        self._diffs = self._tops = None
        return {
            "max_abs_diff": self.max_value,
            "p99_abs_diff": p99,
            "top1_agreement": self.agree / self.count,
            "cos_sim_mean": float(np.mean(np.asarray(self.cosines, dtype=np.float64))),
        }

    def first_fail(self, seed: int, metrics: dict[str, float]) -> dict[str, Any]:
        t = self.thresholds
        note = None
        candidate = self.first
        if candidate is None:
            # The pair fails on an aggregate that no single token trips on its own.
            candidate = self.largest
            assert candidate is not None
            failing = failing_metrics(metrics, t)
            candidate.tripped = list(failing)
            note = (
                f"no single token trips a threshold; the pair fails on its aggregate "
                f"{failing[0][0]} ({failing[0][1]:.6g} vs {failing[0][2]:.6g}), so this is "
                f"the token with the largest |Δ| ({self.largest_value:.6g})"
            )
        metric, value, threshold = candidate.tripped[0]
        if metric == "token_id":
            note = (
                f"the modes wrote different tokens here (prefill {candidate.ids[0]}, decode "
                f"{candidate.ids[1]}); with kv_aligned=1 they must be the same, and later "
                f"tokens follow different prefixes, so the pair is compared up to here"
            )
        return {
            "seed": seed,
            "kv_aligned": self.kv_aligned,
            "token_idx": candidate.token_idx,
            "token_id": candidate.token_id,
            "metric": metric,
            "value": int(value) if metric == "token_id" else value,
            "threshold": threshold,
            "tripped": [name for name, _, _ in candidate.tripped],
            "token_ids": {"prefill": candidate.ids[0], "decode": candidate.ids[1]},
            "top5": candidate.top5,
            "where": candidate.where,
            "note": note,
        }

    def precision(self, dtype: str) -> dict[str, Any] | None:
        """max |Δ| in rounding steps of the dtype at that logit's magnitude; max relative Δ."""
        if self.max_at is None:
            return None
        token_idx, index, va, vb = self.max_at
        magnitude = max(abs(va), abs(vb))
        bits = SIGNIFICAND_BITS.get(dtype.lower())
        ulp = None
        if bits is not None and magnitude > 0:
            ulp = 2.0 ** (math.floor(math.log2(magnitude)) - bits)
        rel_at = self.max_rel_at or (token_idx, index)
        return {
            "dtype": dtype,
            "max_abs_diff_at": {"token_idx": token_idx, "vocab_index": index},
            "logit_magnitude": magnitude,
            "ulp": ulp,
            "max_abs_diff_ulps": (self.max_value / ulp) if ulp else None,
            "max_rel_diff": self.max_rel,
            "max_rel_diff_at": {"token_idx": rel_at[0], "vocab_index": rel_at[1]},
        }


# The first |Δ| values a streamed pair keeps whole (4 MiB), setting the threshold above which
# the rest are kept (TopValues).
_TOP_FIRST = 1 << 20


class _EveryDiffNeeded(Exception):
    """The pair's p99 |Δ| lies under the threshold its first tokens set (its later tokens
    differ far less): only a pass that keeps every |Δ| can tell it."""


def _greedy_divergence(a: np.ndarray, b: np.ndarray, id_a: int, id_b: int) -> bool:
    """Did each side pick a top logit of its own row (greedy decoding parting ways)?"""
    v = a.shape[0]
    if not (0 <= id_a < v and 0 <= id_b < v and b.shape[0] == v):
        return False
    return bool(a[id_a] == a.max() and b[id_b] == b.max())


def _cosine(a: np.ndarray, b: np.ndarray, scratch: np.ndarray | None = None) -> float:
    """Seed section 8's cos_sim of one token, in float64 as the seed computes it; two zero rows
    count as identical. The sums are numpy's own pairwise ones, not np.dot's: BLAS picks its
    kernel by CPU (and OPENBLAS_CORETYPE), each summing in its own order, so the same rows gave
    different last digits on the host that judged and on the console. `scratch`: a float64 row
    to reuse for the products."""
    work = np.empty(a.shape[0], np.float64) if scratch is None else scratch

    def dot(x: np.ndarray, y: np.ndarray) -> float:
        np.multiply(x, y, out=work, dtype=np.float64)  # float32 products are exact in float64
        return float(np.add.reduce(work))

    norms = math.sqrt(dot(a, a)) * math.sqrt(dot(b, b))
    if norms == 0:
        return 1.0 if np.array_equal(a, b) else 0.0
    return dot(a, b) / norms


def _result(
    judge: _PairJudge,
    *,
    seed: int,
    kv_aligned: int,
    dtype: str,
    prompt_len: int,
    gen_len: int,
    tokens: int,
) -> PairResult:
    metrics = judge.metrics()
    verdict = pair_verdict(metrics, kv_aligned, judge.thresholds)
    if kv_aligned == 1 and judge.diverged_at is not None:
        verdict = FAIL_EQUIV  # the modes wrote different tokens: never equivalent
    first_fail = judge.first_fail(seed, metrics) if verdict == FAIL_EQUIV else None
    return PairResult(
        seed=seed,
        kv_aligned=kv_aligned,
        dtype=dtype,
        prompt_len=prompt_len,
        gen_len=gen_len,
        pair_count=judge.count,
        metrics=metrics,
        verdict=verdict,
        thresholds=dict(judge.thresholds),
        first_fail=first_fail,
        prefill_path=judge.prefill_path,
        decode_path=judge.decode_path,
        diverged_at_token=judge.diverged_at,
        tokens={"prefill": tokens, "decode": tokens},
        precision=judge.precision(dtype),
    )


def compare_pair(
    prefill: LogitsTable,
    decode: LogitsTable,
    *,
    seed: int,
    kv_aligned: int,
    dtype: str,
    prompt_len: int,
    gen_len: int,
    thresholds: dict[str, float] | None = None,
) -> PairResult:
    """Judges two loaded tables (row i is line i + 1 of its file)."""
    if kv_aligned not in (0, 1):
        raise ValueError(f"kv_aligned must be 0 or 1, got {kv_aligned!r}")
    for table in (prefill, decode):
        t = table.logits.shape[0]
        if table.logits.ndim != 2 or table.token_idx.shape != (t,) or table.token_id.shape != (t,):
            raise ValueError(f"{table.path}: a LogitsTable needs (T,) ids and (T, V) logits")
        bad = np.flatnonzero(table.token_idx != np.arange(t))
        if bad.size:
            i = int(bad[0])
            raise InputError(
                table.path,
                i + 1,
                f"token_idx {int(table.token_idx[i])} where {i} was expected",
                "token_idx must run 0, 1, 2, ... one line each; re-run this side",
            )
    _check_lengths(prefill.path, prefill.logits.shape[0], decode.path, decode.logits.shape[0])
    judge = _PairJudge(
        prefill.path,
        decode.path,
        kv_aligned,
        resolve_thresholds(thresholds),
        capacity=prefill.logits.shape[0],
    )
    a32 = np.asarray(prefill.logits, dtype=np.float32)
    b32 = np.asarray(decode.logits, dtype=np.float32)
    for i in range(a32.shape[0]):
        judge.add(
            i, int(prefill.token_id[i]), int(decode.token_id[i]), a32[i], b32[i], i + 1, i + 1
        )
        if judge.diverged_at is not None:
            break
    return _result(
        judge,
        seed=seed,
        kv_aligned=kv_aligned,
        dtype=dtype,
        prompt_len=prompt_len,
        gen_len=gen_len,
        tokens=a32.shape[0],
    )


def _check_lengths(prefill_path: str, t_prefill: int, decode_path: str, t_decode: int) -> None:
    if t_prefill != t_decode:
        raise InputError(
            prefill_path,
            None,
            f"{t_prefill} tokens here but {t_decode} in {decode_path}: the pair is not comparable",
            PAIR_HINT,
        )


def compare_files(
    prefill_path: str | Path,
    decode_path: str | Path,
    *,
    seed: int,
    kv_aligned: int,
    dtype: str,
    prompt_len: int,
    gen_len: int,
    thresholds: dict[str, float] | None = None,
    workers: int = 1,
    on_token: Callable[[int, int], None] | None = None,
) -> PairResult:
    """Judges a pair straight from its two logits.jsonl.gz files, streaming both in lockstep.

    Memory is O(V) per side plus the top few per cent of the pair's |Δ| (what its exact p99
    needs: TopValues). A pair whose later tokens differ far less than its first is read a
    second time, keeping every |Δ| (float32, T x V). With workers >= 2 the decode side is read
    by a second process at the same time. on_token(tokens read, gen_len) is called after each
    token (progress of a large pair; it starts again on a second reading).
    """
    if kv_aligned not in (0, 1):
        raise ValueError(f"kv_aligned must be 0 or 1, got {kv_aligned!r}")
    prefill_path, decode_path = str(prefill_path), str(decode_path)
    limits = resolve_thresholds(thresholds)
    judge = _PairJudge(prefill_path, decode_path, kv_aligned, limits, keep_all=False)

    def result(judge: _PairJudge) -> PairResult:
        _judge_rows(judge, workers, gen_len, on_token)
        tokens = judge.count + judge.skipped
        return _result(
            judge,
            seed=seed,
            kv_aligned=kv_aligned,
            dtype=dtype,
            prompt_len=prompt_len,
            gen_len=gen_len,
            tokens=tokens,
        )

    try:
        return result(judge)
    except _EveryDiffNeeded:
        every = _PairJudge(
            prefill_path, decode_path, kv_aligned, limits, capacity=max(judge.count, 1)
        )
        return result(every)


def _judge_rows(
    judge: _PairJudge,
    workers: int,
    gen_len: int,
    on_token: Callable[[int, int], None] | None,
) -> None:
    """Read both sides of judge's pair in lockstep into it, to the end of both files."""
    prefill_path, decode_path = judge.prefill_path, judge.decode_path
    rows_a = iter_logits(prefill_path)
    rows_b: SideRows | Generator[LogitsRow, None, None]
    rows_b = iter_logits_elsewhere(decode_path) if workers >= 2 else iter_logits(decode_path)
    try:
        while True:
            ra = next(rows_a, None)
            rb = next(rows_b, None)
            if ra is None or rb is None:
                if ra is not rb:
                    # One side ended; count the other's tokens so the message is exact.
                    rest = rows_b if ra is None else rows_a
                    extra = 1 + sum(1 for _ in rest)
                    both = judge.count + judge.skipped  # the rows read on both sides
                    t_a = both + (0 if ra is None else extra)
                    t_b = both + (0 if rb is None else extra)
                    _check_lengths(prefill_path, t_a, decode_path, t_b)
                break
            if on_token is not None:
                on_token(judge.count + judge.skipped + 1, gen_len)
            if judge.diverged_at is None:
                judge.add(
                    ra.token_idx, ra.token_id, rb.token_id, ra.logits, rb.logits, ra.line, rb.line
                )
            else:
                judge.skipped += 1  # still read to the end: every line and the gzip are checked
    finally:
        rows_a.close()
        rows_b.close()


# ---------------------------------------------------------------- documents


def metrics_document(result: PairResult, timestamp: str) -> dict[str, Any]:
    """The seed section 2.2 metrics.json object for one pair."""
    doc = {
        "seed": result.seed,
        "dtype": result.dtype,
        "prompt_len": result.prompt_len,
        "gen_len": result.gen_len,
        "kv_aligned": result.kv_aligned,
        "pair_count": result.pair_count,
        "metrics": {key: result.metrics[key] for key in METRIC_KEYS},
        "verdict": result.verdict,
        "thresholds": dict(result.thresholds),
        "first_fail": result.first_fail,
        "timestamp": timestamp,
    }
    # Beyond section 2.2: each side's line count, the precision context of max |Δ|, and (only
    # when the sides wrote different tokens) where the comparison had to stop.
    doc["tokens"] = dict(result.tokens)
    doc["precision"] = result.precision
    if result.diverged_at_token is not None:
        doc["diverged_at_token"] = result.diverged_at_token
    return doc


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _metrics_summary(results: list[PairResult]) -> dict[str, float | None]:
    return {
        "max_abs_diff_mean": _mean([r.metrics["max_abs_diff"] for r in results]),
        "p99_abs_diff_mean": _mean([r.metrics["p99_abs_diff"] for r in results]),
        "top1_agreement_mean": _mean([r.metrics["top1_agreement"] for r in results]),
    }


@dataclass(frozen=True)
class Unjudged:
    """A pair of the matrix that has no verdict, and why.

    kind: "engine" (a side crashed, never ran, or wrote nothing), "infra" (an artifact could
    not be brought home), "output" (a run's engine wrote something that breaks the contract),
    "input" (a tree handed to `analyze` is missing or malformed there).
    """

    kv_aligned: int
    seed: int
    kind: str
    why: str

    def to_json(self) -> dict[str, Any]:
        return {
            "pair": f"kv_aligned_{self.kv_aligned}/seed_{self.seed}",
            "kv_aligned": self.kv_aligned,
            "seed": self.seed,
            "class": self.kind,
            "why": self.why,
        }


_UNJUDGED_VERDICT = {
    "engine": ENGINE_ERROR,
    "infra": INFRA_ERROR,
    "output": FAIL_GUARDRAIL,
    "input": INPUT_ERROR,
}


def guardrail_verdict(
    results: list[PairResult], unjudged: list[Unjudged], thresholds: dict[str, float]
) -> tuple[str, str]:
    """The global verdict of section 3.3, and why, for pairs judged and pairs that could not be.

    A judged kv_aligned=1 FAIL_EQUIV fails the guardrail whatever else happened; a pair with no
    verdict keeps it from passing (its class says what kind of failure that is); a guardrail
    with no kv_aligned=1 pair guards nothing and never passes.
    """
    aligned = [r for r in results if r.kv_aligned == 1]
    failed = [r for r in aligned if r.verdict == FAIL_EQUIV]
    if failed:
        pairs = ", ".join(f"seed {r.seed}" for r in failed)
        return FAIL_GUARDRAIL, f"kv_aligned=1 FAIL_EQUIV: {pairs}"
    if unjudged:
        order = ("engine", "infra", "output", "input")
        worst = min(unjudged, key=lambda u: order.index(u.kind))
        names = ", ".join(f"kv_aligned_{u.kv_aligned}/seed_{u.seed}" for u in unjudged)
        return _UNJUDGED_VERDICT[worst.kind], f"not judged: {names} ({worst.why})"
    if not aligned:
        return FAIL_GUARDRAIL, "no kv_aligned=1 pair was judged: nothing guards equivalence"
    loose = loosened(thresholds)
    if loose:
        return PASS_GUARDRAIL_LOOSENED, f"thresholds loosened: {describe_loosened(loose)}"
    return PASS_GUARDRAIL, f"all {len(aligned)} kv_aligned=1 pair(s) PASS_EQUIV"


def summarize(
    results: list[PairResult],
    config_matrix: dict[str, Any],
    thresholds: dict[str, float] | None,
    date: str,
    unjudged: list[Unjudged] | None = None,
) -> dict[str, Any]:
    """The seed section 2.3 summary.json object, plus section 1's flat counts.

    After the seed's keys: the pairs that could not be judged (named, with why), where greedy
    decoding parted ways, how the thresholds were loosened (if they were), and the verdict's
    reason. global_verdict is the one the run's exit code carries (VERDICT_EXIT).
    """
    resolved = resolve_thresholds(thresholds)
    missing = list(unjudged or [])
    verdict, reason = guardrail_verdict(results, missing, resolved)
    aligned = [r for r in results if r.kv_aligned == 1]
    drift = [r for r in results if r.kv_aligned == 0]
    pass_equiv = sum(r.verdict == PASS_EQUIV for r in aligned)
    fail_equiv = sum(r.verdict == FAIL_EQUIV for r in aligned)
    expected_drift = sum(r.verdict == EXPECTED_DRIFT for r in drift)
    first_fail = next((r.first_fail for r in results if r.verdict == FAIL_EQUIV), None)
    return {
        "benchmark": "B3.67",
        "date": date,
        "config_matrix": config_matrix,
        "total_runs": len(results),
        "pass_equiv": pass_equiv,
        "fail_equiv": fail_equiv,
        "expected_drift": expected_drift,
        "results": {
            "kv_aligned_1": {
                "total_runs": len(aligned),
                "pass_equiv": pass_equiv,
                "fail_equiv": fail_equiv,
                "metrics_summary": _metrics_summary(aligned),
            },
            "kv_aligned_0": {
                "total_runs": len(drift),
                "expected_drift": expected_drift,
                "metrics_summary": _metrics_summary(drift),
            },
        },
        "first_fail": first_fail,
        "global_verdict": verdict,
        "threshold_config": resolved,
        "unjudged": [u.to_json() for u in missing],
        "diverged": [
            {"kv_aligned": r.kv_aligned, "seed": r.seed, "diverged_at_token": r.diverged_at_token}
            for r in results
            if r.diverged_at_token is not None
        ],
        "thresholds_loosened": loosened(resolved),
        "reason": reason,
    }
