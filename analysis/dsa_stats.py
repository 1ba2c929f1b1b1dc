"""Bounded aggregates of dsa_topk records: summary.json's statistics, recomputed and compared.

Everything here is a histogram or a counter (never a list of records), folded from batches
and from recorded batch increments alike, so a replay rebuilds the same numbers.

Offsets are kept in log-linear buckets (exact below 64, then 32 buckets per power of two:
a bucket is at most 1/32 of its value wide); `tracedeck analyze` also keeps them exact.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

SUB = 32  # buckets per power of two above EXACT
EXACT = 64
STATS = ("unique_blocks", "tokens_per_touched_block", "offsets", "prefix_intersection_ratio")
HOT_BLOCKS = 16


def hdr_bucket(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.int64)
    big = v >= EXACT
    e = np.frexp(np.where(big, v, 1).astype(np.float64))[1].astype(np.int64) - 1
    sub = (np.where(big, v, 0) >> np.maximum(e - 5, 0)) - SUB
    return np.where(big, EXACT + (e - 6) * SUB + sub, v)


def hdr_range(bucket: int) -> tuple[int, int]:
    """The values [lo, hi] a bucket holds."""
    if bucket < EXACT:
        return bucket, bucket
    e, sub = 6 + (bucket - EXACT) // SUB, (bucket - EXACT) % SUB
    lo = (SUB + sub) << (e - 5)
    return lo, lo + (1 << (e - 5)) - 1


def percentile(items: list[tuple[float, int]], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of sorted (value, count) pairs."""
    n = sum(c for _, c in items)
    rank = q * (n - 1)
    lo_r, hi_r = math.floor(rank), math.ceil(rank)
    lo = hi = None
    seen = 0
    for value, count in items:
        if lo is None and lo_r < seen + count:
            lo = value
        if hi_r < seen + count:
            hi = value
            break
        seen += count
    assert lo is not None and hi is not None
    return float(lo + (hi - lo) * (rank - lo_r))


def stats_of(items: list[tuple[float, int]], total: float) -> dict[str, Any]:
    n = sum(c for _, c in items)
    if n == 0:
        return {"count": 0, "min": None, "p50": None, "p95": None, "max": None, "mean": None}
    return {
        "count": n,
        "min": items[0][0],
        "p50": percentile(items, 0.5),
        "p95": percentile(items, 0.95),
        "max": items[-1][0],
        "mean": total / n,
    }


class SummaryAgg:
    """The four statistics of summary.json 5.3 and prefix_hot_blocks, from valid records."""

    def __init__(self, exact: bool = False) -> None:
        self.records = 0
        self.ub: Counter[int] = Counter()
        self.tpb: Counter[int] = Counter()
        self.off_hdr: Counter[int] = Counter()
        self.off_n = 0
        self.off_sum = 0
        self.off_min: int | None = None
        self.off_max: int | None = None
        self.off_exact: np.ndarray | None = np.zeros(0, dtype=np.int64) if exact else None
        self.ratios: Counter[tuple[int, int]] = Counter()
        self.hot: dict[int, Counter[int]] = {}

    # -- from a checked batch ----------------------------------------------------------------

    def batch_increment(
        self,
        ub: np.ndarray,
        counts: np.ndarray,
        off_hist: np.ndarray,
        inter_lens: np.ndarray,
        layers: np.ndarray,
        inter_blocks: np.ndarray,
        inter_layers: np.ndarray,
    ) -> dict[str, Any]:
        """The increment of valid rows' values (JSON-ready), applied to self too.

        off_hist[o] is how many selected positions had offset o in these rows.
        """
        inc: dict[str, Any] = {"records": len(ub)}
        inc["ub"] = _pairs(*np.unique(ub, return_counts=True))
        tpb = np.bincount(counts[counts > 0]) if len(counts) else np.zeros(0, np.int64)
        nz = np.flatnonzero(tpb)
        inc["tpb"] = _pairs(nz, tpb[nz])
        nz = np.flatnonzero(off_hist)
        if len(nz):
            per = np.bincount(hdr_bucket(nz), weights=off_hist[nz]).astype(np.int64)
            keep = np.flatnonzero(per)
            inc["off"] = _pairs(keep, per[keep])
            total = int(off_hist.sum())
            inc["off_stats"] = [total, int((nz * off_hist[nz]).sum()), int(nz[0]), int(nz[-1])]
            if self.off_exact is not None:
                if len(off_hist) > len(self.off_exact):
                    self.off_exact = np.pad(
                        self.off_exact, (0, len(off_hist) - len(self.off_exact))
                    )
                self.off_exact[: len(off_hist)] += off_hist
        pair_key = inter_lens.astype(np.int64) * (1 << 32) + ub.astype(np.int64)
        keys, n = np.unique(pair_key, return_counts=True)
        inc["ratio"] = [
            [int(k >> 32), int(k & 0xFFFFFFFF), int(c)] for k, c in zip(keys, n, strict=True)
        ]
        hot_key = inter_layers.astype(np.int64) * (1 << 32) + inter_blocks.astype(np.int64)
        keys, n = np.unique(hot_key, return_counts=True)
        inc["hot"] = [
            [int(k >> 32), int(k & 0xFFFFFFFF), int(c)] for k, c in zip(keys, n, strict=True)
        ]
        self.apply(inc)
        return inc

    def apply(self, inc: dict[str, Any]) -> None:
        """Fold a recorded increment (the one batch_increment returned)."""
        self.records += inc.get("records", 0)
        for v, c in inc.get("ub", []):
            self.ub[v] += c
        for v, c in inc.get("tpb", []):
            self.tpb[v] += c
        for v, c in inc.get("off", []):
            self.off_hdr[v] += c
        if "off_stats" in inc:
            n, total, lo, hi = inc["off_stats"]
            self.off_n += n
            self.off_sum += total
            self.off_min = lo if self.off_min is None else min(self.off_min, lo)
            self.off_max = hi if self.off_max is None else max(self.off_max, hi)
        for a, b, c in inc.get("ratio", []):
            self.ratios[(a, b)] += c
        for layer, block, c in inc.get("hot", []):
            self.hot.setdefault(layer, Counter())[block] += c

    # -- summary.json, recomputed ---------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        ub = sorted(self.ub.items())
        tpb = sorted(self.tpb.items())
        ratios: Counter[float] = Counter()
        ratio_sum = 0.0
        for (a, b), n in sorted(self.ratios.items()):
            ratios[a / b] += n
            ratio_sum += n * (a / b)
        out: dict[str, Any] = {
            "unique_blocks": stats_of(ub, sum(v * c for v, c in ub)),
            "tokens_per_touched_block": stats_of(tpb, sum(v * c for v, c in tpb)),
            "offsets": self.offset_stats(),
            "prefix_intersection_ratio": stats_of(sorted(ratios.items()), ratio_sum),
            "prefix_hot_blocks": {
                str(layer): [
                    {"block_id": b, "touch_count": n}
                    for b, n in sorted(c.items(), key=lambda t: (-t[1], t[0]))[:HOT_BLOCKS]
                ]
                for layer, c in sorted(self.hot.items())
            },
        }
        return out

    def offset_stats(self) -> dict[str, Any]:
        if self.off_exact is not None:
            nz = np.flatnonzero(self.off_exact)
            return stats_of(
                list(zip(nz.tolist(), self.off_exact[nz].tolist(), strict=True)), self.off_sum
            )
        if not self.off_n:
            return stats_of([], 0)
        items = sorted(self.off_hdr.items())
        lo50, hi50 = _hdr_percentile(items, 0.5)
        lo95, hi95 = _hdr_percentile(items, 0.95)
        return {
            "count": self.off_n,
            "min": self.off_min,
            "p50": [lo50, hi50],  # a bucket's range: the exact value lies within
            "p95": [lo95, hi95],
            "max": self.off_max,
            "mean": self.off_sum / self.off_n,
        }


def _hdr_percentile(items: list[tuple[int, int]], q: float) -> tuple[int, int]:
    n = sum(c for _, c in items)
    rank = q * (n - 1)
    lo_r, hi_r = math.floor(rank), math.ceil(rank)
    lo = hi = None
    seen = 0
    for bucket, count in items:
        if lo is None and lo_r < seen + count:
            lo = hdr_range(bucket)[0]
        if hi_r < seen + count:
            hi = hdr_range(bucket)[1]
            break
        seen += count
    assert lo is not None and hi is not None
    return lo, hi


def _pairs(values: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    return [[int(v), int(c)] for v, c in zip(values, counts, strict=True)]


def compare_summary(engine: dict[str, Any], recomputed: dict[str, Any]) -> list[str]:
    """Every statistic of the engine's summary.json that differs from the recomputation."""
    out: list[str] = []
    for name in STATS:
        theirs, ours = engine.get(name), recomputed.get(name)
        if not isinstance(theirs, dict):
            out.append(f"{name}: missing from summary.json (recomputed {ours})")
            continue
        for key in ("count", "min", "p50", "p95", "max", "mean"):
            a, b = theirs.get(key), ours.get(key)
            if not _same(a, b):
                out.append(f"{name}.{key}: summary.json says {a!r}, the shards give {_show(b)}")
    hot_theirs = engine.get("prefix_hot_blocks")
    if isinstance(hot_theirs, dict):
        hot_ours = recomputed.get("prefix_hot_blocks", {})
        for layer in sorted(set(hot_theirs) | set(hot_ours), key=lambda k: (len(k), k)):
            a = _hot_counts(hot_theirs.get(layer, []))
            b = _hot_counts(hot_ours.get(layer, []))
            if a is None or any(b.get(block) != n for block, n in a.items()):
                out.append(f"prefix_hot_blocks[{layer}]: summary.json {a} vs the shards' {b}")
    else:
        out.append("prefix_hot_blocks: missing from summary.json")
    return out


def _hot_counts(entries: Any) -> dict[int, int] | None:
    try:
        return {int(e["block_id"]): int(e["touch_count"]) for e in entries}
    except (TypeError, KeyError, ValueError):
        return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, list):  # a bucket range from the live (bucketed) recomputation
        return isinstance(a, int | float) and b[0] - 1e-9 <= a <= b[1] + 1e-9
    if a is None or b is None:
        return a is b
    if isinstance(a, bool) or not isinstance(a, int | float):
        return False
    return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))


def _show(v: Any) -> str:
    return f"a value in [{v[0]}, {v[1]}]" if isinstance(v, list) else repr(v)
