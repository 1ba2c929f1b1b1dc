"""The per-record contract of seed 004 (3.1-3.4, 5.2), checked on a Batch's columns at once.

Each check is a vector of "this record breaks it"; a record's verdict is its first broken
check, explained (field, expected, found) only for the records that are reported.

Percentiles: the seed does not name the demo's method, so a reported percentile passes when
it lies between the order statistics either side of rank q*n (x[floor(qn)-1] .. x[ceil(qn)],
0-based, clamped), which holds for numpy's linear/lower/higher/nearest/midpoint, nearest-rank
and the Weibull and Hazen definitions. A float passes at the precision it was written with
(14.3 for 43/3, as the seed's 5.2 example does).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from analysis.dsa_record import MAX_SEQ, SHA1, Batch, Fail

Q50, Q95 = 0.5, 0.95


def tolerance(v: np.ndarray) -> np.ndarray:
    """Half a unit in the last decimal a value was written with (1e-9 relative at full)."""
    v = np.asarray(v, dtype=np.float64)
    tol = np.full(v.shape, np.nan)
    finite = np.isfinite(v)
    for d in range(7):
        hit = np.isnan(tol) & finite & (np.round(v, d) == v)
        tol[hit] = 0.5 * 10.0**-d
    tol[np.isnan(tol)] = 0.0
    return tol + 1e-9 * np.maximum(1.0, np.abs(np.where(finite, v, 0.0)))


def rank_bounds(n: np.ndarray, q: float) -> tuple[np.ndarray, np.ndarray]:
    """0-based order-statistic indices that bracket the q-quantile of n values."""
    qn = q * n.astype(np.float64)
    lo = np.maximum(0, np.floor(qn).astype(np.int64) - 1)
    hi = np.minimum(np.maximum(n - 1, 0), np.ceil(qn).astype(np.int64))
    return lo, hi


def _segsum(mask: np.ndarray, starts: np.ndarray) -> np.ndarray:
    if len(mask) == 0:
        return np.zeros(len(starts), dtype=np.int64)
    padded = np.append(mask, False)
    return np.add.reduceat(padded, np.minimum(starts, len(mask)), dtype=np.int64)[: len(starts)] * (
        np.diff(np.append(starts, len(mask))) > 0
    )


@dataclass
class Derived:
    """What the checks computed that the aggregators reuse (valid rows only are aggregated)."""

    occ: np.ndarray  # position occupancy: rows' spans (total_blocks x block_size) concatenated
    base: np.ndarray  # where each row's span starts in occ
    lens: np.ndarray
    counts: np.ndarray  # tokens per (row, block), rows' total_blocks concatenated
    total_blocks: np.ndarray
    inter_lens: np.ndarray
    seq: np.ndarray
    code: np.ndarray  # 0 valid, else 1 + index of the first broken check
    explain: list[Callable[[int], Fail]] = field(default_factory=list)
    cum: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # cumsum of occ
    before: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    span: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    block_base: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def count_below(self, rows: np.ndarray, t: np.ndarray) -> np.ndarray:
        """How many positions of each row in `rows` are < t."""
        t = np.clip(t, 0, self.span[rows])
        before = self.before[rows]
        idx = np.minimum(self.base[rows] + t - 1, len(self.cum) - 1)
        return np.where(t > 0, self.cum[np.maximum(idx, 0)], before) - before


@dataclass
class Context:
    """Trace-wide facts a record is judged against (the stream learns the unknown ones)."""

    topk: int
    block_size: int
    bytes_per_token: int | None = None


def _flat(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lens.sum()))
    return flat, lens


def check_batch(b: Batch, ctx: Context) -> Derived:
    c = b.col
    n = len(b)
    bs = ctx.block_size
    seq = c["seq"]
    seq_ok = (seq >= 1) & (seq <= MAX_SEQ)
    seq_c = np.where(seq_ok, seq, 1)
    lens = np.fromiter(map(len, b.pos), dtype=np.int64, count=n)
    starts = _starts(lens)
    pos = np.concatenate(b.pos) if n else np.zeros(0, np.int64)
    has = lens > 0
    maxpos = _segmax(pos, starts, lens)
    in_range = ~has | (maxpos < seq_c)
    if len(pos) and pos.min() < 0:
        in_range &= ~has | (_segmin(pos, starts, lens) >= 0)
    if not in_range.all():
        pos = np.where(np.repeat(in_range, lens), pos, 0)
        maxpos = np.where(in_range, maxpos, 0)
    # Occupancy of every row's positions over its span (total_blocks x block_size), at once.
    tb = -(-seq_c // bs)
    span = tb * bs
    base = _starts(span)
    occ = np.bincount(np.repeat(base, lens) + pos, minlength=int(span.sum()))
    distinct = (
        np.ones(n, dtype=bool) if not len(occ) or occ.max() <= 1 else _segsum(occ > 1, base) == 0
    )
    cum = np.cumsum(occ)
    before = np.where(base > 0, cum[np.maximum(base - 1, 0)], 0)

    def below(t: np.ndarray) -> np.ndarray:
        """How many of each row's positions are < t (t per row)."""
        t = np.clip(t, 0, span)
        return np.where(t > 0, cum[np.minimum(base + t - 1, len(cum) - 1)], before) - before

    minpos = np.where(has, np.searchsorted(cum, before + 1) - base, 0) if len(cum) else lens * 0
    p50 = c["off_p50"]
    tol = tolerance(p50)
    with np.errstate(invalid="ignore"):
        le = lens - below(np.ceil(np.nan_to_num(seq_c - 1 - (p50 + tol), nan=0.0)).astype(np.int64))
        lt = lens - below(
            np.floor(np.nan_to_num(seq_c - 1 - (p50 - tol), nan=0.0)).astype(np.int64) + 1
        )
    lo, hi = rank_bounds(lens, Q50)
    off_p50_ok = np.isfinite(p50) & has & (le >= lo + 1) & (lt <= hi)

    counts = occ.reshape(-1, bs).sum(axis=1) if len(occ) else np.zeros(0, np.int64)
    block_base = base // bs
    touched = counts > 0
    n_touched = _segsum(touched, block_base)
    blocks, blens = _flat(b.blocks)
    listed_ok = _same_set(blocks, blens, tb, block_base, touched)
    inter, ilens = _flat(b.inter)
    local = np.arange(len(counts)) - np.repeat(block_base, tb)
    inter_ok = _same_set(inter, ilens, tb, block_base, touched & (local < np.repeat(c["pcb"], tb)))
    ub = c["ublocks"]
    safe_ub = np.maximum(ub, 1)
    tpb_p50_ok = _rank_ok(counts, block_base, tb, c["tpb_p50"], Q50)
    tpb_p95_ok = _rank_ok(counts, block_base, tb, c["tpb_p95"], Q95)
    total = c["total_blocks"]
    tbr = c["tbr"]
    ratio_exp = ub / np.maximum(tb, 1)
    bpt = ctx.bytes_per_token
    bytes_ok = c["bytes"] == ub * bs * (bpt if bpt is not None else 0)
    s_min, s_mean, s_max = c["s_min"], c["s_mean"], c["s_max"]
    scores_ok = np.ones(n, dtype=bool)
    for row, sc in b.scores.items():
        ok = len(sc) == c["count"][row] and bool(np.isfinite(sc).all())
        if ok and len(sc):
            ok = _near(sc.min(), s_min[row]) and _near(sc.max(), s_max[row])
            ok = ok and abs(sc.mean() - s_mean[row]) <= 1e-6 * max(1.0, abs(sc.mean()))
        scores_ok[row] = ok
    key_ok = np.array([len(k) == 40 and bool(SHA1.fullmatch(k)) for _, _, k in b.names], dtype=bool)
    lat = c["latency"]
    stats_ok = np.isfinite(s_min) & np.isfinite(s_mean) & np.isfinite(s_max)
    stats_ok &= (s_min <= s_mean + _eps(s_mean)) & (s_mean <= s_max + _eps(s_max))

    def offsets(r: int) -> np.ndarray:
        return np.sort(seq_c[r] - 1 - b.pos[r])

    topk = ctx.topk
    want = np.minimum(topk, seq_c)
    checks: list[tuple[np.ndarray, Callable[[int], Fail]]] = [
        (c["event_ok"], lambda r: Fail("event", "'dsa_topk'", "another event")),
        (c["rank"] == 0, lambda r: Fail("rank", "0 (only rank 0 writes)", str(c["rank"][r]))),
        (c["world"] >= 1, lambda r: Fail("world_size", ">= 1", str(c["world"][r]))),
        ((c["request"] >= 0) & (c["layer"] >= 0) & (c["step"] >= 0), lambda r: Fail("request_id/layer_id/step_idx", ">= 0", f"{c['request'][r]}/{c['layer'][r]}/{c['step'][r]}")),
        (seq_ok, lambda r: Fail("seq_len_current", f"1..{MAX_SEQ}", str(seq[r]))),
        (seq == c["step"] + 1, lambda r: Fail("seq_len_current", f"step_idx + 1 = {c['step'][r] + 1}", str(seq[r]))),
        (c["bs"] == bs, lambda r: Fail("block_size_tokens", f"{bs} (the trace's block size)", str(c["bs"][r]))),
        (c["count"] == lens, lambda r: Fail("unique_token_pos_count", f"{lens[r]} (positions listed)", str(c["count"][r]))),
        (lens == want, lambda r: Fail("selected_token_pos", f"min(topk {topk}, seq_len_current {seq[r]}) = {want[r]} positions", str(lens[r]))),
        (in_range, lambda r: Fail("selected_token_pos", f"positions in [0, {seq[r]})", _first_out(b.pos[r], seq[r]))),
        (distinct, lambda r: Fail("selected_token_pos", "distinct positions", f"{len(b.pos[r]) - len(np.unique(b.pos[r]))} repeated")),
        (c["off_min"] == seq_c - 1 - maxpos, lambda r: Fail("offset_min", f"(seq_len_current - 1) - max(pos) = {seq_c[r] - 1 - maxpos[r]}", str(c["off_min"][r]))),
        (c["off_max"] == seq_c - 1 - minpos, lambda r: Fail("offset_max", f"(seq_len_current - 1) - min(pos) = {seq_c[r] - 1 - minpos[r]}", str(c["off_max"][r]))),
        (off_p50_ok, lambda r: Fail("offset_p50", _between(offsets(r), Q50), _fmt(p50[r]))),
        ((total < 0) | (total == tb), lambda r: Fail("total_blocks_in_use", f"ceil({seq[r]} / {bs}) = {tb[r]}", str(total[r]))),
        (listed_ok, lambda r: Fail("selected_block_ids", f"the blocks pos // {bs}: {_blocks_of(b.pos[r], bs)}", _short(b.blocks[r]))),
        (ub == blens, lambda r: Fail("unique_blocks", f"{blens[r]} (block ids listed)", str(ub[r]))),
        (ub == n_touched, lambda r: Fail("unique_blocks", f"{n_touched[r]} touched blocks", str(ub[r]))),
        (np.isnan(tbr) | _close(tbr, ratio_exp), lambda r: Fail("touched_block_ratio", f"unique_blocks / total_blocks_in_use = {ratio_exp[r]!r}", _fmt(tbr[r]))),
        (_close(c["tpb_mean"], lens / safe_ub), lambda r: Fail("tokens_per_touched_block.mean", f"{lens[r]} / {ub[r]} = {lens[r] / max(ub[r], 1)!r}", _fmt(c["tpb_mean"][r]))),
        (tpb_p50_ok, lambda r: Fail("tokens_per_touched_block.p50", _between(_row_counts(counts, block_base, tb, r), Q50), _fmt(c["tpb_p50"][r]))),
        (tpb_p95_ok, lambda r: Fail("tokens_per_touched_block.p95", _between(_row_counts(counts, block_base, tb, r), Q95), _fmt(c["tpb_p95"][r]))),
        (c["hits_eq"], lambda r: Fail("kv_fetch.hbm.hit_blocks", "equal to selected_block_ids (HBM-only)", "a different list")),
        (c["hbm_batch"] == ub, lambda r: Fail("kv_fetch.hbm.batch_size", f"unique_blocks = {ub[r]}", str(c["hbm_batch"][r]))),
        (bytes_ok, lambda r: Fail("kv_fetch.hbm.bytes_read", f"unique_blocks x block_size x {bpt} bytes/token = {ub[r] * bs * (bpt or 0)}", str(c["bytes"][r]))),
        (np.isfinite(lat) & (lat >= 0), lambda r: Fail("kv_fetch.hbm.latency_us", "a wall time >= 0 in microseconds", _fmt(lat[r]))),
        (c["pools_ok"], lambda r: Fail("kv_fetch.local_pool/remote_pool", "batch_size = len(hit_blocks)", "a different count")),
        (c["pcb"] >= 0, lambda r: Fail("prefix.prefix_cached_blocks", ">= 0", str(c["pcb"][r]))),
        (key_ok, lambda r: Fail("prefix.prefix_key", "a SHA1 (40 lowercase hex digits)", repr(b.names[r][2][:48]))),
        (inter_ok, lambda r: Fail("prefix.intersection_blocks", f"selected blocks < prefix_cached_blocks {c['pcb'][r]}: {_short(np.array(sorted(x for x in b.blocks[r] if x < c['pcb'][r])))}", _short(np.array(b.inter[r])))),
        (_close(c["ratio"], ilens / safe_ub), lambda r: Fail("prefix.intersection_ratio", f"{ilens[r]} / {ub[r]} = {ilens[r] / max(ub[r], 1)!r}", _fmt(c["ratio"][r]))),
        (stats_ok, lambda r: Fail("scores_stats", "finite, min <= mean <= max", f"{s_min[r]!r} / {s_mean[r]!r} / {s_max[r]!r}")),
        (scores_ok, lambda r: Fail("scores_topk", "one finite score per position, matching scores_stats", f"{len(b.scores.get(r, []))} scores")),
    ]  # fmt: skip
    code = np.zeros(n, dtype=np.int64)
    for i, (ok, _) in enumerate(checks, start=1):
        code[(code == 0) & ~np.asarray(ok, dtype=bool)] = i
    return Derived(
        occ=occ,
        base=base,
        lens=lens,
        counts=counts,
        total_blocks=tb,
        inter_lens=ilens,
        seq=seq_c,
        code=code,
        explain=[e for _, e in checks],
        cum=cum,
        before=before,
        span=span,
        block_base=block_base,
    )


def explain(d: Derived, row: int) -> Fail:
    return d.explain[int(d.code[row]) - 1](row)


# -- helpers -----------------------------------------------------------------------------------


def _popcount(x: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x).astype(np.int64)
    table = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)  # numpy < 2
    return table[x.view(np.uint8)].reshape(-1, 8).sum(axis=1)


def _segmax(v: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    if len(v) == 0:
        return np.zeros(len(starts), dtype=np.int64)
    out = np.maximum.reduceat(v, np.minimum(starts, len(v) - 1))
    return np.where(lens > 0, out, 0)


def _segmin(v: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    if len(v) == 0:
        return np.zeros(len(starts), dtype=np.int64)
    out = np.minimum.reduceat(v, np.minimum(starts, len(v) - 1))
    return np.where(lens > 0, out, 0)


def _rank_ok(
    values: np.ndarray,
    starts: np.ndarray,
    lens: np.ndarray,
    reported: np.ndarray,
    q: float,
) -> np.ndarray:
    """Does each row's reported q-quantile lie between its bracketing order statistics?"""
    tol = tolerance(reported)
    hi_v = np.repeat(reported + tol, lens)
    lo_v = np.repeat(reported - tol, lens)
    member = values > 0
    n = _segsum(member, starts)
    le = _segsum(member & (values <= hi_v), starts)
    lt = _segsum(member & (values < lo_v), starts)
    lo, hi = rank_bounds(n, q)
    return np.isfinite(reported) & (n > 0) & (le >= lo + 1) & (lt <= hi)


def _same_set(
    listed: np.ndarray, lens: np.ndarray, tb: np.ndarray, base: np.ndarray, expect: np.ndarray
) -> np.ndarray:
    """Rows whose listed ids are exactly the expected bins (no repeats, none out of range)."""
    inside = (listed >= 0) & (listed < np.repeat(tb, lens))
    key = np.repeat(base, lens) + np.where(inside, listed, 0)
    got = np.bincount(key[inside], minlength=len(expect))
    return (_segsum(got != expect, base) == 0) & (_segsum(~inside, _starts(lens)) == 0)


def _starts(lens: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lens), dtype=np.int64)
    if len(lens) > 1:
        np.cumsum(lens[:-1], out=out[1:])
    return out


def _close(found: np.ndarray, exact: np.ndarray) -> np.ndarray:
    diff = np.abs(found - exact)
    ok = diff <= 1e-9 * np.maximum(1.0, np.abs(exact))
    if not ok.all():  # the precision it was written with, only where it matters
        loose = ~ok & np.isfinite(found)
        ok[loose] = diff[loose] <= tolerance(found[loose])
    return ok & np.isfinite(found)


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(a))


def _eps(v: np.ndarray) -> np.ndarray:
    return 1e-9 * np.maximum(1.0, np.abs(v))


def _fmt(v: float) -> str:
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


def _short(ids: np.ndarray, limit: int = 12) -> str:
    vals = [int(x) for x in ids[:limit]]
    more = f" ... ({len(ids)} in all)" if len(ids) > limit else ""
    return f"{vals}{more}"


def _blocks_of(pos: np.ndarray, bs: int) -> str:
    return _short(np.unique(pos // bs))


def _first_out(pos: np.ndarray, seq: int) -> str:
    bad = pos[(pos < 0) | (pos >= seq)]
    return f"position {int(bad[0])}" if len(bad) else "?"


def _row_counts(counts: np.ndarray, base: np.ndarray, tb: np.ndarray, r: int) -> np.ndarray:
    seg = counts[base[r] : base[r] + tb[r]]
    return np.sort(seg[seg > 0])


def _between(sorted_values: np.ndarray, q: float) -> str:
    n = len(sorted_values)
    if n == 0:
        return "a value over no data"
    lo, hi = rank_bounds(np.array([n]), q)
    a, z = sorted_values[int(lo[0])], sorted_values[int(hi[0])]
    return f"p{round(q * 100)} of {n} values: between {_fmt(a)} and {_fmt(z)}"
