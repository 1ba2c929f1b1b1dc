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

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from analysis.dsa_record import MAX_SEQ, SHA1, Batch, Fail

Q50, Q95 = 0.5, 0.95


_P10 = 10.0 ** np.arange(7)


def tolerance(v: np.ndarray) -> np.ndarray:
    """Half a unit in the last decimal a value was written with (1e-9 relative at full)."""
    v = np.asarray(v, dtype=np.float64)
    finite = np.isfinite(v)
    w = np.where(finite, v, 0.0)
    m = w[:, None] * _P10  # np.round(v, d) is rint(v * 10**d) / 10**d: all d at once
    hit = (np.rint(m) / _P10 == w[:, None]) & finite[:, None]
    tol = np.where(hit.any(axis=1), 0.5 * 10.0 ** -hit.argmax(axis=1).astype(np.float64), 0.0)
    return tol + 1e-9 * np.maximum(1.0, np.abs(w))


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


# Block sizes whose occupancy packs into one machine word per block (numpy >= 2 counts bits).
_WORD = (
    {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
    if hasattr(np, "bitwise_count")
    else {}
)


@dataclass
class Derived:
    """What the checks computed that the aggregators reuse (valid rows only are aggregated).

    occ is every row's position occupancy over its span (total_blocks x block_size bins, rows
    back to back, one bool per position); counts[b] is the number of positions in block b
    (rows' blocks back to back, row r's from block_base[r]); ccum their running sum, so that
    count_below() answers "how many positions of row r are < t" without a pass over positions.
    """

    occ: np.ndarray
    base: np.ndarray  # where each row's span starts in occ
    span: np.ndarray
    lens: np.ndarray
    counts: np.ndarray
    ccum: np.ndarray  # ccum[b] = counts[:b].sum()
    words: np.ndarray | None  # occ packed, one word per block (block sizes 8, 16, 32, 64)
    block_size: int
    total_blocks: np.ndarray
    block_base: np.ndarray
    inter_lens: np.ndarray
    seq: np.ndarray
    code: np.ndarray  # 0 valid, else 1 + index of the first broken check
    explain: list[Callable[[int], Fail]] = field(default_factory=list)

    def count_below(self, rows: np.ndarray, t: np.ndarray) -> np.ndarray:
        """How many positions of each row in `rows` are < t (t: one value per row, or a
        rows x k matrix of them)."""
        t = np.asarray(t)
        span = self.span[rows]
        bb = self.block_base[rows]
        if t.ndim == 2:
            span, bb = span[:, None], bb[:, None]
        t = np.clip(t, 0, span)
        bs = self.block_size
        q, r = np.divmod(t, bs)
        blk = bb + q
        full = self.ccum[blk] - self.ccum[bb]
        part = np.minimum(blk, len(self.counts) - 1)
        if self.words is not None:
            word = self.words.dtype.type
            mask = ((np.ones_like(r, dtype=np.uint64) << r.astype(np.uint64)) - 1).astype(word)
            partial = np.bitwise_count(self.words[part] & mask)
        else:
            grid = self.occ.reshape(-1, bs)[part.ravel()]
            cut = np.arange(bs) < r.reshape(-1, 1)
            partial = (grid & cut).sum(axis=1).reshape(r.shape)
        return full + np.where(r > 0, partial, 0)


@dataclass
class Context:
    """Trace-wide facts a record is judged against (the stream learns the unknown ones)."""

    topk: int | None  # None: not known yet (the stream tallies the counts instead)
    block_size: int
    bytes_per_token: int | None = None


def occupancy(
    pos: np.ndarray, lens: np.ndarray, base: np.ndarray, size: int, bs: int
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """One bool per position bin of every row's span, the bins packed one word per block
    (when the block size is a word), and the number of positions in each block."""
    occ = np.zeros(size, dtype=bool)
    if len(lens) and (lens == lens[0]).all():  # the usual batch: no repeat of row bases
        occ[(pos.reshape(len(lens), -1) + base[:, None]).ravel()] = True
    else:
        occ[pos + np.repeat(base, lens)] = True
    word = _WORD.get(bs)
    if word is not None:
        words = np.packbits(occ, bitorder="little").view(word)
        return occ, words, np.bitwise_count(words).astype(np.int64)
    return occ, None, occ.reshape(-1, bs).sum(axis=1, dtype=np.int64)


def check_batch(b: Batch, ctx: Context) -> Derived:
    c = b.col
    n = len(b)
    bs = ctx.block_size
    seq = c["seq"]
    seq_ok = (seq >= 1) & (seq <= MAX_SEQ)
    seq_c = np.where(seq_ok, seq, 1)
    lens, starts, pos = b.pos.lens, b.pos.starts, b.pos.flat
    has = lens > 0
    maxpos = _segmax(pos, starts, lens)
    minpos = _segmin(pos, starts, lens)
    in_range = ~has | ((minpos >= 0) & (maxpos < seq_c))
    if not in_range.all():
        pos = np.where(np.repeat(in_range, lens), pos, 0)
        maxpos = np.where(in_range, maxpos, 0)
        minpos = np.where(in_range, minpos, 0)
    # Occupancy of every row's positions over its span (total_blocks x block_size), at once.
    tb = -(-seq_c // bs)
    span = tb * bs
    base = _starts(span)
    block_base = base // bs
    occ, words, counts = occupancy(pos, lens, base, int(span.sum()), bs)
    ccum = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=ccum[1:])
    distinct = ccum[block_base + tb] - ccum[block_base] == lens  # repeats share a bin
    d = Derived(
        occ=occ,
        base=base,
        span=span,
        lens=lens,
        counts=counts,
        ccum=ccum,
        words=words,
        block_size=bs,
        total_blocks=tb,
        block_base=block_base,
        inter_lens=np.zeros(n, np.int64),
        seq=seq_c,
        code=np.zeros(n, np.int64),
    )
    rows = np.arange(n)
    p50 = c["off_p50"]
    tol = tolerance(p50)
    with np.errstate(invalid="ignore"):
        hi_t = np.clip(np.nan_to_num(seq_c - 1 - (p50 + tol), nan=0.0), 0, span)
        lo_t = np.clip(np.nan_to_num(seq_c - 1 - (p50 - tol), nan=0.0), -1, span)
    below = d.count_below(
        rows,
        np.stack([np.ceil(hi_t).astype(np.int64), np.floor(lo_t).astype(np.int64) + 1], axis=1),
    )
    le, lt = lens - below[:, 0], lens - below[:, 1]
    lo, hi = rank_bounds(lens, Q50)
    off_p50_ok = np.isfinite(p50) & has & (le >= lo + 1) & (lt <= hi)

    touched = counts > 0
    n_touched = np.add.reduceat(touched, block_base, dtype=np.int64)
    blocks, blens = b.blocks.flat, b.blocks.lens
    listed_ok = _same_set(blocks, blens, tb, block_base, touched)
    inter, ilens = b.inter.flat, b.inter.lens
    d.inter_lens = ilens
    local = np.arange(len(counts)) - np.repeat(block_base, tb)
    inter_ok = _same_set(inter, ilens, tb, block_base, touched & (local < np.repeat(c["pcb"], tb)))
    ub = c["ublocks"]
    safe_ub = np.maximum(ub, 1)
    tpb_p50_ok = _rank_ok(counts, touched, n_touched, block_base, tb, c["tpb_p50"], Q50)
    tpb_p95_ok = _rank_ok(counts, touched, n_touched, block_base, tb, c["tpb_p95"], Q95)
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
    key_list = [k for _, _, k in b.names]
    keys = {k: SHA1.fullmatch(k) is not None for k in dict.fromkeys(key_list)}
    key_ok = np.array([keys[k] for k in key_list], dtype=bool)
    lat = c["latency"]
    stats_ok = np.isfinite(s_min) & np.isfinite(s_mean) & np.isfinite(s_max)
    stats_ok &= (s_min <= s_mean + _eps(s_mean)) & (s_mean <= s_max + _eps(s_max))

    def offsets(r: int) -> np.ndarray:
        return np.sort(seq_c[r] - 1 - b.positions(r))

    def counts_of(r: int) -> np.ndarray:
        return _row_counts(counts, block_base, tb, r)

    topk = ctx.topk
    want = lens if topk is None else np.minimum(topk, seq_c)
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
        (in_range, lambda r: Fail("selected_token_pos", f"positions in [0, {seq[r]})", _first_out(b.positions(r), seq[r]))),
        (distinct, lambda r: Fail("selected_token_pos", "distinct positions", f"{lens[r] - len(np.unique(b.positions(r)))} repeated")),
        (c["off_min"] == seq_c - 1 - maxpos, lambda r: Fail("offset_min", f"(seq_len_current - 1) - max(pos) = {seq_c[r] - 1 - maxpos[r]}", str(c["off_min"][r]))),
        (c["off_max"] == seq_c - 1 - minpos, lambda r: Fail("offset_max", f"(seq_len_current - 1) - min(pos) = {seq_c[r] - 1 - minpos[r]}", str(c["off_max"][r]))),
        (off_p50_ok, lambda r: Fail("offset_p50", _between(offsets(r), Q50), _fmt(p50[r]))),
        (~c["has_total"] | (total == tb), lambda r: Fail("total_blocks_in_use", f"ceil({seq[r]} / {bs}) = {tb[r]}", str(total[r]))),
        (listed_ok, lambda r: Fail("selected_block_ids", f"the blocks pos // {bs}: {_blocks_of(b.positions(r), bs)}", _short(b.blocks[r]))),
        (ub == blens, lambda r: Fail("unique_blocks", f"{blens[r]} (block ids listed)", str(ub[r]))),
        (ub == n_touched, lambda r: Fail("unique_blocks", f"{n_touched[r]} touched blocks", str(ub[r]))),
        (np.isnan(tbr) | as_written(tbr, ratio_exp), lambda r: Fail("touched_block_ratio", f"unique_blocks / total_blocks_in_use = {_fmt(ratio_exp[r])}", _fmt(tbr[r]))),
        (as_written(c["tpb_mean"], lens / safe_ub), lambda r: Fail("tokens_per_touched_block.mean", f"{lens[r]} / {ub[r]} = {_fmt(lens[r] / max(ub[r], 1))}", _fmt(c["tpb_mean"][r]))),
        (tpb_p50_ok, lambda r: Fail("tokens_per_touched_block.p50", _between(counts_of(r), Q50), _fmt(c["tpb_p50"][r]))),
        (tpb_p95_ok, lambda r: Fail("tokens_per_touched_block.p95", _between(counts_of(r), Q95), _fmt(c["tpb_p95"][r]))),
        (c["hits_eq"], lambda r: Fail("kv_fetch.hbm.hit_blocks", "equal to selected_block_ids (HBM-only)", "a different list")),
        (c["hbm_batch"] == ub, lambda r: Fail("kv_fetch.hbm.batch_size", f"unique_blocks = {ub[r]}", str(c["hbm_batch"][r]))),
        (bytes_ok, lambda r: Fail("kv_fetch.hbm.bytes_read", f"unique_blocks x block_size x {bpt} bytes/token = {ub[r] * bs * (bpt or 0)}", str(c["bytes"][r]))),
        (np.isfinite(lat) & (lat >= 0), lambda r: Fail("kv_fetch.hbm.latency_us", "a wall time >= 0 in microseconds", _fmt(lat[r]))),
        (c["pools_ok"], lambda r: Fail("kv_fetch.local_pool/remote_pool", "unused tiers (HBM-only, seed 3.3): hit_blocks [], bytes_read 0, read_ops 0, batch_size 0, latency_us null", "a tier that claims a fetch")),
        (c["pcb"] >= 0, lambda r: Fail("prefix.prefix_cached_blocks", ">= 0", str(c["pcb"][r]))),
        (key_ok, lambda r: Fail("prefix.prefix_key", "a SHA1 (40 lowercase hex digits)", repr(b.names[r][2][:48]))),
        (inter_ok, lambda r: Fail("prefix.intersection_blocks", f"selected blocks < prefix_cached_blocks {c['pcb'][r]}: {_short(np.array(sorted(x for x in b.blocks[r] if x < c['pcb'][r])))}", _short(np.array(b.inter[r])))),
        (as_written(c["ratio"], ilens / safe_ub), lambda r: Fail("prefix.intersection_ratio", f"{ilens[r]} / {ub[r]} = {_fmt(ilens[r] / max(ub[r], 1))}", _fmt(c["ratio"][r]))),
        (stats_ok, lambda r: Fail("scores_stats", "finite, min <= mean <= max", f"{_fmt(s_min[r])} / {_fmt(s_mean[r])} / {_fmt(s_max[r])}")),
        (scores_ok, lambda r: Fail("scores_topk", "one finite score per position, matching scores_stats", f"{len(b.scores.get(r, []))} scores")),
    ]  # fmt: skip
    if n:
        broken = ~np.vstack([np.asarray(ok, dtype=bool) for ok, _ in checks])
        d.code = np.where(broken.any(axis=0), broken.argmax(axis=0) + 1, 0)
    d.explain = [e for _, e in checks]
    return d


def explain(d: Derived, row: int) -> Fail:
    return d.explain[int(d.code[row]) - 1](row)


# -- helpers -----------------------------------------------------------------------------------


def _segmax(v: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    return _segreduce(np.maximum, v, starts, lens)


def _segmin(v: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    return _segreduce(np.minimum, v, starts, lens)


def _segreduce(op: np.ufunc, v: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """op over each row's values (0 for a row with none)."""
    if len(v) == 0:
        return np.zeros(len(starts), dtype=np.int64)
    if lens[0] > 0 and (lens == lens[0]).all():
        return op.reduce(v.reshape(len(lens), -1), axis=1)
    out = op.reduceat(v, np.minimum(starts, len(v) - 1))
    return np.where(lens > 0, out, 0)


def _rank_ok(
    counts: np.ndarray,
    touched: np.ndarray,
    n: np.ndarray,
    block_base: np.ndarray,
    tb: np.ndarray,
    reported: np.ndarray,
    q: float,
) -> np.ndarray:
    """Does each row's reported q-quantile of its touched blocks' counts lie between the order
    statistics that bracket it (n: each row's touched blocks)?"""
    tol = tolerance(reported)
    hi_v = np.repeat(reported + tol, tb)
    lo_v = np.repeat(reported - tol, tb)
    le = np.add.reduceat(touched & (counts <= hi_v), block_base, dtype=np.int64)
    lt = np.add.reduceat(touched & (counts < lo_v), block_base, dtype=np.int64)
    lo, hi = rank_bounds(n, q)
    return np.isfinite(reported) & (n > 0) & (le >= lo + 1) & (lt <= hi)


def _same_set(
    listed: np.ndarray, lens: np.ndarray, tb: np.ndarray, base: np.ndarray, expect: np.ndarray
) -> np.ndarray:
    """Rows whose listed ids are exactly the expected bins (no repeats, none out of range).

    base: each row's first bin (every row has at least one: total_blocks >= 1)."""
    inside = (listed >= 0) & (listed < np.repeat(tb, lens))
    everywhere = bool(inside.all())
    key = np.repeat(base, lens) + (listed if everywhere else np.where(inside, listed, 0))
    got = np.bincount(key if everywhere else key[inside], minlength=len(expect))
    ok = np.add.reduceat(got != expect, base, dtype=np.int64) == 0
    if not everywhere:
        outside = np.repeat(np.arange(len(lens)), lens)[~inside]
        ok[outside] = False
    return ok


def _starts(lens: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lens), dtype=np.int64)
    if len(lens) > 1:
        np.cumsum(lens[:-1], out=out[1:])
    return out


def as_written(found: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Does each value found equal the exact one, to the precision it was written with?"""
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
