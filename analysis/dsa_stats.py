"""Bounded aggregates of dsa_topk records: summary.json's statistics, recomputed and compared.

Everything here is a histogram or a counter (never a list of records), folded from batches
and from recorded batch increments alike, so a replay rebuilds the same numbers. An increment's
lists are flat ([value, count, value, count, ...]; hot and ratio in threes); increments recorded
as lists of pairs apply the same.

Offsets are kept in log-linear buckets (exact below 64, then 32 buckets per power of two:
a bucket is at most 1/32 of its value wide); `tracedeck analyze` also keeps them exact.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from analysis.dsa_live import pack, unpack
from analysis.dsa_record import Fail

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


_HDR_STARTS = np.zeros(0, dtype=np.int64)


def hdr_starts(n: int) -> np.ndarray:
    """The first value of every bucket that starts below n (buckets are consecutive ranges from
    0, so np.add.reduceat(hist, hdr_starts(len(hist))) sums a histogram into its buckets)."""
    global _HDR_STARTS
    top = int(hdr_bucket(np.array([max(n - 1, 0)]))[0]) + 1
    if len(_HDR_STARTS) < top:
        _HDR_STARTS = np.array([hdr_range(b)[0] for b in range(max(top, 2 * len(_HDR_STARTS)))])
    return _HDR_STARTS[:top]


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
    """The four statistics of summary.json 5.3 and prefix_hot_blocks, from valid records.

    The counts live in dense arrays indexed by value (unique_blocks, tokens per block, offset
    bucket, layer x prefix block), so folding an increment is a few vector adds."""

    def __init__(self, exact: bool = True) -> None:
        self.records = 0
        self.ub = np.zeros(0, dtype=np.int64)  # ub[v]: records with unique_blocks v
        self.tpb = np.zeros(0, dtype=np.int64)  # tpb[v]: touched blocks holding v positions
        self.off_hdr = np.zeros(0, dtype=np.int64)  # per hdr_bucket of the offsets
        self.off_n = 0
        self.off_sum = 0
        self.off_min: int | None = None
        self.off_max: int | None = None
        self.off_exact: np.ndarray | None = np.zeros(0, dtype=np.int64) if exact else None
        self.ratios: Counter[tuple[int, int]] = Counter()  # (|selected ∩ prefix|, |selected|)
        self.hot = np.zeros((0, 0), dtype=np.int64)  # hot[layer, block]: intersection touches

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
        parts: dict[str, np.ndarray] = {}
        parts["ub"] = np.column_stack(np.unique(ub, return_counts=True))
        tpb = np.bincount(counts[counts > 0]) if len(counts) else np.zeros(0, np.int64)
        nz = np.flatnonzero(tpb)
        parts["tpb"] = np.column_stack((nz, tpb[nz]))
        inc: dict[str, Any] = {"records": len(ub)}
        nz = np.flatnonzero(off_hist)
        if len(nz):
            per = np.add.reduceat(off_hist, hdr_starts(len(off_hist)))  # buckets are ranges
            keep = np.flatnonzero(per)
            parts["off"] = np.column_stack((keep, per[keep]))
            total = int(off_hist.sum())
            weighted = int(np.dot(nz, off_hist[nz]))
            inc["off_stats"] = [total, weighted, int(nz[0]), int(nz[-1])]
            # the exact offsets too (summary.json's p50/p95 are checked exactly, live and on
            # replay): from the smallest offset on, packed (a few KB per batch)
            inc["offx"] = [int(nz[0]), pack(off_hist[nz[0] : nz[-1] + 1])]
        pair_key = inter_lens.astype(np.int64) * (1 << 32) + ub.astype(np.int64)
        keys, n = np.unique(pair_key, return_counts=True)
        parts["ratio"] = np.column_stack((keys >> 32, keys & 0xFFFFFFFF, n))
        hot_key = inter_layers.astype(np.int64) * (1 << 32) + inter_blocks.astype(np.int64)
        keys, n = np.unique(hot_key, return_counts=True)
        parts["hot"] = np.column_stack((keys >> 32, keys & 0xFFFFFFFF, n))
        for name, rows in parts.items():  # flat lists: a digest holds a few containers, not
            inc[name] = rows.astype(np.int64).ravel().tolist()  # hundreds (the GC walks them)
        self.apply(inc, parts)
        return inc

    def apply(self, inc: dict[str, Any], parts: dict[str, np.ndarray] | None = None) -> None:
        """Fold a recorded increment (the one batch_increment returned; parts: its lists of
        numbers as arrays already)."""

        def rows(name: str, width: int) -> np.ndarray | None:
            if parts is not None and name in parts:
                return parts[name].reshape(-1, width)
            got = inc.get(name)
            return np.asarray(got, dtype=np.int64).reshape(-1, width) if got else None

        self.records += inc.get("records", 0)
        self.ub = _add(self.ub, rows("ub", 2))
        self.tpb = _add(self.tpb, rows("tpb", 2))
        self.off_hdr = _add(self.off_hdr, rows("off", 2))
        if "offx" in inc and self.off_exact is not None:
            lo, packed = inc["offx"]
            self._add_exact(int(lo), unpack(packed))
        elif "off_stats" in inc:
            self.off_exact = None  # recorded before exact offsets: bucket ranges only
        if "off_stats" in inc:
            n, total, lo, hi = inc["off_stats"]
            self.off_n += n
            self.off_sum += total
            self.off_min = lo if self.off_min is None else min(self.off_min, lo)
            self.off_max = hi if self.off_max is None else max(self.off_max, hi)
        ratio = rows("ratio", 3)
        for a, b, c in ratio.tolist() if ratio is not None else []:
            self.ratios[(a, b)] += c
        t = rows("hot", 3)
        if t is not None and len(t):
            shape = (
                max(self.hot.shape[0], int(t[:, 0].max()) + 1),
                max(self.hot.shape[1], int(t[:, 1].max()) + 1),
            )
            if shape != self.hot.shape:
                grown = np.zeros(shape, dtype=np.int64)
                grown[: self.hot.shape[0], : self.hot.shape[1]] = self.hot
                self.hot = grown
            np.add.at(self.hot, (t[:, 0], t[:, 1]), t[:, 2])

    def _add_exact(self, lo: int, hist: np.ndarray) -> None:
        assert self.off_exact is not None
        top = lo + len(hist)
        if top > len(self.off_exact):
            self.off_exact = np.pad(self.off_exact, (0, top - len(self.off_exact)))
        self.off_exact[lo:top] += hist

    def increment(self) -> dict[str, Any]:
        """Everything folded so far as one increment (several batches' digests merged)."""
        out: dict[str, Any] = {"records": self.records}
        for name, hist in (("ub", self.ub), ("tpb", self.tpb), ("off", self.off_hdr)):
            nz = np.flatnonzero(hist)
            out[name] = np.column_stack((nz, hist[nz])).ravel().tolist()
        if self.off_n:
            out["off_stats"] = [self.off_n, self.off_sum, self.off_min, self.off_max]
            if self.off_exact is not None:
                lo = int(self.off_min or 0)
                out["offx"] = [lo, pack(self.off_exact[lo : int(self.off_max or 0) + 1])]
        out["ratio"] = [x for (a, b), c in sorted(self.ratios.items()) for x in (a, b, c)]
        layers, blocks = np.nonzero(self.hot)
        out["hot"] = np.column_stack((layers, blocks, self.hot[layers, blocks])).ravel().tolist()
        return out

    # -- summary.json, recomputed ---------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        ub = _items(self.ub)
        tpb = _items(self.tpb)
        ratios: Counter[float] = Counter()
        ratio_sum = 0.0
        for (a, b), n in sorted(self.ratios.items()):
            ratios[a / b] += n
            ratio_sum += n * (a / b)
        hot: dict[str, Any] = {}
        for layer in np.flatnonzero(self.hot.any(axis=1)).tolist() if self.hot.size else []:
            row = self.hot[layer]
            order = np.lexsort((np.arange(len(row)), -row))[:HOT_BLOCKS]
            hot[str(layer)] = [
                {"block_id": b, "touch_count": n}
                for b, n in zip(order.tolist(), row[order].tolist(), strict=True)
                if n
            ]
        out: dict[str, Any] = {
            "unique_blocks": stats_of(ub, sum(v * c for v, c in ub)),
            "tokens_per_touched_block": stats_of(tpb, sum(v * c for v, c in tpb)),
            "offsets": self.offset_stats(),
            "prefix_intersection_ratio": stats_of(sorted(ratios.items()), ratio_sum),
            "prefix_hot_blocks": hot,
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
        items = _items(self.off_hdr)
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


def _add(hist: np.ndarray, t: np.ndarray | None) -> np.ndarray:
    """hist with [value, count] rows added (grown to the largest value)."""
    if t is None or not len(t):
        return hist
    top = int(t[:, 0].max()) + 1
    if top > len(hist):
        hist = np.pad(hist, (0, top - len(hist)))
    np.add.at(hist, t[:, 0], t[:, 1])
    return hist


def _items(hist: np.ndarray) -> list[tuple[int, int]]:
    nz = np.flatnonzero(hist)
    return list(zip(nz.tolist(), hist[nz].tolist(), strict=True))


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


def compare_summary(engine: dict[str, Any], agg: SummaryAgg) -> list[Fail]:
    """Every statistic of the engine's summary.json (seed 5.3) that differs from the
    recomputation from the valid records: the field, what the records give, what it says."""
    recomputed = {"records": agg.records, **agg.summary()}
    out: list[Fail] = []
    for name in STATS:
        theirs, ours = engine.get(name), recomputed.get(name) or {}
        if not isinstance(theirs, dict):
            found = _found(theirs) if name in engine else "missing"
            out.append(Fail(name, f"an object {_show_stats(ours)}", found))
            continue
        for key in ("count", "min", "p50", "p95", "max", "mean"):
            if key not in theirs:
                out.append(Fail(f"{name}.{key}", _show(ours.get(key)), "missing"))
            elif not _same(theirs[key], ours.get(key), integer=key == "count"):
                out.append(Fail(f"{name}.{key}", _show(ours.get(key)), _found(theirs[key])))
    if "records" in engine and not _same(engine["records"], recomputed.get("records"), True):
        out.append(Fail("records", _show(recomputed.get("records")), _found(engine["records"])))
    out += compare_hot(engine.get("prefix_hot_blocks"), recomputed["prefix_hot_blocks"], agg.hot)
    return out


def compare_hot(theirs: Any, ours: dict[str, Any], hot: np.ndarray) -> list[Fail]:
    """prefix_hot_blocks: per layer_id (a string key), the HOT_BLOCKS hottest prefix blocks by
    touch_count (records of that layer whose intersection_blocks hold the block), hottest
    first; a tie at the cut may keep either block; a layer with no touch is absent or []."""
    if not isinstance(theirs, dict):
        return [Fail("prefix_hot_blocks", "an object keyed by layer_id", _found(theirs))]
    out: list[Fail] = []
    for layer in sorted(set(theirs) | set(ours), key=lambda k: (len(k), k)):
        field = f"prefix_hot_blocks[{layer!r}]"
        mine = ours.get(layer, [])
        row = hot[int(layer)] if layer.isdigit() and int(layer) < len(hot) else np.zeros(0)
        full = {b: int(row[b]) for b in np.flatnonzero(row).tolist()}
        want = [(e["block_id"], e["touch_count"]) for e in mine]
        got = _hot_pairs(theirs.get(layer, []))
        if got is None:
            out.append(Fail(field, "a list of {block_id, touch_count}", _found(theirs[layer])))
            continue
        counts = [n for _, n in got]
        cut = want[-1][1] if len(want) == HOT_BLOCKS else 1
        ok = (
            len(got) == len(want)
            and len({b for b, _ in got}) == len(got)
            and all(full.get(b) == n for b, n in got)
            and counts == sorted(counts, reverse=True)
            and all(n >= cut for n in counts)
        )
        if not ok:
            out.append(Fail(field, f"{_pairs(want)} (the hottest, hottest first)", _pairs(got)))
    return out


def _hot_pairs(entries: Any) -> list[tuple[int, int]] | None:
    if not isinstance(entries, list):
        return None
    out = []
    for e in entries:
        if not isinstance(e, dict):
            return None
        b, n = e.get("block_id"), e.get("touch_count")
        if type(b) is not int or type(n) is not int:
            return None
        out.append((b, n))
    return out


def _pairs(pairs: list[tuple[int, int]], limit: int = 6) -> str:
    shown = ", ".join(f"{b}:{n}" for b, n in pairs[:limit])
    more = f", ... ({len(pairs)} in all)" if len(pairs) > limit else ""
    return f"[{shown}{more}] (block:touches)"


def _same(a: Any, b: Any, integer: bool = False) -> bool:
    if isinstance(b, list):  # a bucket range (digests recorded before exact offsets)
        return type(a) in (int, float) and b[0] - 1e-9 <= a <= b[1] + 1e-9
    if a is None or b is None:
        return a is b
    if isinstance(a, bool) or not isinstance(a, int | float):
        return False
    if integer:
        return type(a) is int and a == b
    return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))


def plain(v: Any) -> Any:
    """numpy scalars as the Python numbers they hold (messages never say np.float64(1.0))."""
    return v.item() if isinstance(v, np.generic) else v


def _show(v: Any) -> str:
    if isinstance(v, list):
        return f"a value in [{v[0]}, {v[1]}]"
    v = plain(v)
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return repr(v)


def _show_stats(stats: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in stats.items()) + "}"


def _found(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, dict | list):
        text = str(v)
        return text if len(text) <= 60 else text[:57] + "..."
    return _show(v)
