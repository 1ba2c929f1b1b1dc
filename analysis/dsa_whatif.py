"""Block-size what-if: seed 004's B/C/D fields recomputed from selected_token_pos at other sizes.

A record keeps the exact positions DSA selected, so every block-level field at block size b
follows from them (seed 3.2-3.4): block_id = pos // b, the touched blocks and their token
counts, total_blocks_in_use = ceil(seq_len_current / b), bytes_read = blocks x b x the
trace's KV bytes per token, and the prefix intersection with the first prefix_cached_blocks
blocks. Percentiles are numpy's default (linear), as the reference engine writes them.

The prefix region is the request's first P tokens, P = min(prompt tokens, prefix key tokens);
a record only says prefix_cached_blocks = ceil(P / b0) at its own block size b0, so P is known
to lie in ((pcb - 1) b0, pcb b0] (and <= summary.json's trace_prefix_key_tokens); serving.jsonl's
prompt_tokens pins it exactly. At a size where that range gives more than one
ceil(P / b), the prefix fields are undetermined: counted and said, never guessed.

Everything is folded into bounded histograms (never a list of records).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from analysis.dsa_checks import as_written
from analysis.dsa_record import Batch, Ragged, _starts
from analysis.dsa_scan import Scanned, TraceInfo
from analysis.dsa_stats import percentile

Q50, Q95 = 0.5, 0.95
RATIO_DIGITS = 4  # ratios are kept to 4 decimals in the distributions


@dataclass
class Rows:
    """Per-record results at one block size (rows of a batch, in order)."""

    block_size: int
    blocks: Ragged  # selected_block_ids (sorted)
    unique_blocks: np.ndarray
    total_blocks: np.ndarray
    ratio: np.ndarray
    tpb_mean: np.ndarray
    tpb_p50: np.ndarray
    tpb_p95: np.ndarray
    counts: Ragged  # tokens in each touched block, in block order
    bytes_read: np.ndarray
    pcb: np.ndarray  # prefix_cached_blocks; -1 where undetermined
    inter: Ragged  # intersection_blocks (empty where undetermined)
    inter_ratio: np.ndarray  # NaN where undetermined


def sorted_positions(batch: Batch, rows: np.ndarray, derived: Any = None) -> Ragged:
    """The rows' positions, each row sorted: read off the validator's occupancy bins when
    given (analysis.dsa_checks.Derived: one bool per position of every row's span, so the set
    bins in order are the positions in order, no sort), else one sort for the whole batch.
    The rows must be valid (distinct positions, in range)."""
    pos = batch.pos
    if derived is not None:
        d = derived
        nz = np.flatnonzero(d.occ)
        per_row = d.ccum[d.block_base + d.total_blocks] - d.ccum[d.block_base]
        owner = np.repeat(np.arange(len(d.base)), per_row)
        keep = np.zeros(len(d.base), dtype=bool)
        keep[rows] = True
        mine = keep[owner]
        return Ragged(nz[mine] - d.base[owner[mine]], pos.lens[rows])
    lens = pos.lens[rows]
    if len(rows) == len(pos) and len(rows) and (lens == lens[0]).all():
        flat = np.sort(pos.flat.reshape(len(rows), -1), axis=1).ravel()
        return Ragged(flat, lens)
    parts = [pos[int(r)] for r in rows]
    if not parts:
        return Ragged(np.zeros(0, np.int64), lens)
    flat = np.concatenate(parts)
    rowid = np.repeat(np.arange(len(rows), dtype=np.int64), lens)
    span = int(flat.max()) + 1 if len(flat) else 1
    keyed = np.sort(rowid * span + flat)
    return Ragged(keyed - rowid * span, lens)


def prefix_range(
    pcb: np.ndarray, b0: int, key_tokens: int | None, prompt: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi] of each record's prefix length in tokens (see the module's doc)."""
    lo = np.where(pcb > 0, (pcb - 1) * b0 + 1, 0)
    hi = pcb * b0
    if key_tokens is not None:
        hi = np.minimum(hi, key_tokens)
    if prompt is not None:  # -1: not known
        p = prompt if key_tokens is None else np.minimum(prompt, key_tokens)
        exact = (prompt >= 0) & (p >= lo) & (p <= hi)
        lo = np.where(exact, p, lo)
        hi = np.where(exact, p, hi)
    return lo, hi


def at_block_size(
    spos: Ragged, seq: np.ndarray, b: int, bpt: int, plo: np.ndarray, phi: np.ndarray
) -> Rows:
    """The B/C/D fields of every row at block size b, from its sorted positions."""
    flat, lens, starts = spos.flat, spos.lens, spos.starts
    q = flat >> (b.bit_length() - 1) if b & (b - 1) == 0 else flat // b
    new = np.ones(len(q), dtype=bool)
    if len(q) > 1:
        new[1:] = q[1:] != q[:-1]
    new[starts[lens > 0]] = True
    ub = _segsum(new, starts, lens)
    run_starts = np.flatnonzero(new)
    counts = np.diff(np.append(run_starts, len(q)))
    return _rows(Ragged(q[run_starts], ub), counts, lens, seq, b, bpt, plo, phi)


_NIBBLE = np.array([bin(i & 15).count("1") for i in range(256)], dtype=np.int64)
_HIGH = np.array([bin(i >> 4).count("1") for i in range(256)], dtype=np.int64)


def block_counts(d: Any, b: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Positions per block of size b for every row of a checked batch, read off the
    validator's occupancy (analysis.dsa_checks.Derived) without touching the positions: for a
    b that divides the recorded size, from the packed bins (bit counts); for a multiple of
    it, from the recorded size's counts. (counts, blocks per row), rows back to back; None
    for a b that is neither."""
    b0 = d.block_size
    if b == b0:  # the validator's own counts
        return d.counts, d.total_blocks
    if b0 % b == 0:
        nb = d.total_blocks * (b0 // b)
        if d.words is not None and b >= 8:
            word = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}.get(b)
            if word is not None:
                return np.bitwise_count(d.words.view(word)).astype(np.int64), nb
            per_byte = np.bitwise_count(d.words.view(np.uint8)).astype(np.int64)
            return per_byte.reshape(-1, b // 8).sum(axis=1), nb
        if d.words is not None and b == 4:
            bytes_ = d.words.view(np.uint8)
            return np.stack([_NIBBLE[bytes_], _HIGH[bytes_]], axis=1).ravel(), nb
        return d.occ.view(np.uint8).reshape(-1, b).sum(axis=1, dtype=np.int64), nb
    if b % b0 == 0:
        m = b // b0
        nb = -(-d.total_blocks // m)
        base = np.zeros(len(nb), dtype=np.int64)
        if len(nb) > 1:
            np.cumsum(nb[:-1], out=base[1:])
        local = np.arange(len(d.counts)) - np.repeat(d.block_base, d.total_blocks)
        index = np.repeat(base, d.total_blocks) + local // m
        counts = np.bincount(index, weights=d.counts, minlength=int(nb.sum()))
        return counts.astype(np.int64), nb
    return None


def at_block_size_counted(
    counts_all: np.ndarray,
    nb: np.ndarray,
    lens: np.ndarray,
    seq: np.ndarray,
    b: int,
    bpt: int,
    plo: np.ndarray,
    phi: np.ndarray,
) -> Rows:
    """The B/C/D fields of every row from its positions per block (block_counts)."""
    base = np.zeros(len(nb), dtype=np.int64)
    if len(nb) > 1:
        np.cumsum(nb[:-1], out=base[1:])
    touched = counts_all > 0
    idx = np.flatnonzero(touched)
    ub = _segsum(touched, base, nb)
    local = idx - np.repeat(base, ub)
    return _rows(Ragged(local, ub), counts_all[idx], lens, seq, b, bpt, plo, phi)


def _rows(
    blocks: Ragged,
    counts: np.ndarray,
    lens: np.ndarray,
    seq: np.ndarray,
    b: int,
    bpt: int,
    plo: np.ndarray,
    phi: np.ndarray,
) -> Rows:
    ub = blocks.lens
    tb = -(-seq // b)
    safe = np.maximum(ub, 1)
    # prefix_cached_blocks at b: one value when ceil(lo / b) == ceil(hi / b)
    pc_lo, pc_hi = -(-plo // b), -(-phi // b)
    known = pc_lo == pc_hi
    pcb = np.where(known, pc_lo, -1)
    in_prefix = blocks.flat < np.repeat(np.where(known, pcb, 0), ub)
    ilens = _segsum(in_prefix, blocks.starts, ub)
    inter = Ragged(blocks.flat[in_prefix], ilens)
    with np.errstate(invalid="ignore", divide="ignore"):
        inter_ratio = np.where(known, ilens / safe, np.nan)
    p50, p95 = _row_percentiles(counts, ub, b)
    return Rows(
        block_size=b,
        blocks=blocks,
        unique_blocks=ub,
        total_blocks=tb,
        ratio=ub / np.maximum(tb, 1),
        tpb_mean=lens / safe,
        tpb_p50=p50,
        tpb_p95=p95,
        counts=Ragged(counts, ub),
        bytes_read=ub * b * bpt,
        pcb=pcb,
        inter=inter,
        inter_ratio=inter_ratio,
    )


def _segsum(mask: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    if len(mask) == 0:
        return np.zeros(len(lens), dtype=np.int64)
    sums = np.add.reduceat(mask, np.minimum(starts, len(mask) - 1), dtype=np.int64)
    return np.where(lens > 0, sums, 0)


def _row_percentiles(counts: np.ndarray, n: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy's linear percentile (bit for bit: its index, weight and lerp) of each row's counts
    (each count is 1..b: the k-th smallest is read off the row's histogram of counts, no sort)."""
    hist = row_bincount(counts, n, b + 1)
    p50, p95 = _percentiles(kth_of(hist[:, 1:], n), n, (Q50, Q95))
    return p50, p95


def kth_of(hist: np.ndarray, n: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """For rows' histograms of counts 1..b (rows x b: [r, v - 1] is how many of row r's
    values are v; n[r] the row's total), kth(k): each row's k-th smallest value (0-based,
    k < n[r]; any value where n[r] is 0). The rows' running counts, back to back, are one
    sorted array: one cumsum and a search, where a running count per row is a pass per row."""
    rows, b = hist.shape
    run = np.cumsum(hist, axis=None)
    before = np.zeros(rows, dtype=np.int64)  # the values in the rows before each
    if rows > 1:
        np.cumsum(n[:-1], out=before[1:])
    first = np.arange(rows, dtype=np.int64) * b - 1  # row r's value v sits at r x b + v - 1

    def kth(k: np.ndarray) -> np.ndarray:
        return np.searchsorted(run, before + k, side="right") - first

    return kth


def _percentiles(
    kth: Callable[[np.ndarray], np.ndarray], n: np.ndarray, qs: tuple[float, ...]
) -> list[np.ndarray]:
    """numpy's linear percentiles of each row's n values, kth(k) being each row's k-th
    smallest (0-based; NaN where a row has none)."""
    out = []
    for q in qs:
        v = (n - 1) * q  # numpy: (n - 1) * quantiles
        prev = np.floor(v)
        above = v >= n - 1
        i0 = np.where(above, n - 1, prev.astype(np.int64))
        i1 = np.where(above, n - 1, i0 + 1)
        a, z = kth(np.maximum(i0, 0)), kth(np.maximum(i1, 0))
        t = v - np.where(above, -1.0, prev)
        d = z - a
        res = np.where(t >= 0.5, z - d * (1 - t), a + d * t)
        out.append(np.where(n > 0, res, np.nan))
    return out


def _median(kth: Callable[[np.ndarray], np.ndarray], n: np.ndarray) -> np.ndarray:
    """_percentiles(kth, n, (Q50,)), its arithmetic for q = 1/2 written out: the middle value
    of an odd n (t = 0), z - (z - a) x 0.5 of an even one (t = 0.5), in fewer passes."""
    a, z = kth(np.maximum(n - 1, 0) // 2), kth(n // 2)
    even = z - (z - a) * 0.5
    return np.where(n > 0, np.where(n % 2 == 1, a, even), np.nan)


@dataclass
class Summary:
    """What SizeAgg keeps of one block size's rows: per row unique_blocks, touched_block_ratio,
    the tokens_per_touched_block p50 and the prefix intersection ratio (NaN: undetermined);
    over the rows the histogram of tokens per touched block (tpb[v]: the blocks holding v
    positions) and the sum of bytes_read."""

    unique_blocks: np.ndarray
    ratio: np.ndarray
    tpb: np.ndarray
    tpb_p50: np.ndarray
    inter_ratio: np.ndarray
    bytes_read: int

    @classmethod
    def of(cls, rows: Rows) -> Summary:
        flat = rows.counts.flat
        return cls(
            unique_blocks=rows.unique_blocks,
            ratio=rows.ratio,
            tpb=np.bincount(flat) if len(flat) else np.zeros(0, np.int64),
            tpb_p50=rows.tpb_p50,
            inter_ratio=rows.inter_ratio,
            bytes_read=int(rows.bytes_read.sum()),
        )


_POPCOUNT8 = np.bitwise_count(np.arange(256, dtype=np.uint8)).astype(np.int64)
_WORD_OF = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}


@functools.cache
def _per_code(f: int, b: int) -> np.ndarray:
    """For f dividing b dividing 8: per byte code at f (_byte_codes: the popcounts of the
    byte's 8 / f blocks of f bits, as the digits of a number base f + 1, its first block the
    lowest), how many of the byte's blocks of b bits (b / f digits each, added) hold each
    count (codes x b + 1)."""
    k, radix, g = 8 // f, f + 1, b // f
    digits = (np.arange(radix**k)[:, None] // radix ** np.arange(k)) % radix
    counts = digits.reshape(len(digits), k // g, g).sum(axis=2)
    per = np.stack([(counts == v).sum(axis=1) for v in range(b + 1)], axis=1)
    return per.astype(np.int64)


def _byte_codes(data: np.ndarray, b: int) -> np.ndarray:
    """Each byte's code (see _per_code; < 256), in a few passes of uint8 arithmetic."""
    if b == 8:
        return np.bitwise_count(data)
    if b == 1:
        return data
    radix, mask = b + 1, (1 << b) - 1
    code = np.bitwise_count(data & mask)
    for i in range(1, 8 // b):
        code += np.bitwise_count((data >> (i * b)) & mask) * np.uint8(radix**i)
    return code


def row_hist(
    d: Any, b: int, fine: int | None = None, cache: dict[int, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Callable[[np.ndarray], np.ndarray]] | None:
    """Every row's histogram of positions per block at size b (rows x b + 1: [r, v] is how
    many of row r's blocks hold v positions), read off the validator's occupancy
    (analysis.dsa_checks.Derived), with each row's blocks at b, where they start (rows back to
    back) and which of the blocks so numbered are touched; None for a b that neither divides
    nor is a multiple of the recorded size. fine: the smallest size dividing 8 that the batch
    is asked for (its rows' histograms of byte codes, kept in cache, give every b it divides)."""
    b0 = d.block_size
    if d.words is not None and 8 % b == 0:  # one code a byte (_byte_codes): one bincount
        data = d.words.view(np.uint8)
        f = fine if fine is not None and b % fine == 0 else b
        codes = None if cache is None else cache.get(f)
        if codes is None:
            n_codes = (f + 1) ** (8 // f)
            codes = row_bincount(_byte_codes(data, f), d.total_blocks * (b0 // 8), n_codes)
            if cache is not None:
                cache[f] = codes
        hist = codes if f == b == 8 else codes @ _per_code(f, b)  # (8: a code is its count)
        mask = (1 << b) - 1

        def touched(at: np.ndarray) -> np.ndarray:
            bit = at * b
            return ((data[bit >> 3] >> (bit & 7).astype(np.uint8)) & mask) != 0

        nb = d.total_blocks * (b0 // b)
        return hist, nb, _starts(nb), touched
    if d.words is not None and b in _WORD_OF and b0 % b == 0:  # a count a word of b bits
        counts: np.ndarray = np.bitwise_count(d.words.view(_WORD_OF[b]))
        nb = d.total_blocks * (b0 // b)
    else:
        counted = block_counts(d, b)
        if counted is None:
            return None
        counts, nb = counted
    hist = row_bincount(counts, nb, b + 1)
    return hist, nb, _starts(nb), lambda at: counts[at] > 0


def row_bincount(values: np.ndarray, lens: np.ndarray, width: int) -> np.ndarray:
    """Each row's histogram of its values (rows x width; values 0 .. width - 1, rows back to
    back, lens[r] of row r's), in one bincount. The keys are as narrow as they can be: a
    bincount reads them whatever their width, and the pass that makes them writes less."""
    rows = len(lens)
    size = rows * width
    kind = np.uint16 if size <= 1 << 16 else np.int32 if size <= 1 << 31 else np.int64
    owner = np.repeat(np.arange(0, size, width, dtype=kind), lens)
    owner += values.astype(kind, copy=False)
    return np.bincount(owner, minlength=size).reshape(rows, width)


def summary_counted(
    d: Any,
    b: int,
    seq: np.ndarray,
    bpt: int,
    plo: np.ndarray,
    phi: np.ndarray,
    fine: int | None = None,
    cache: dict[int, np.ndarray] | None = None,
) -> Summary | None:
    """The Summary at block size b of every row of a checked batch, from the rows' histograms
    of positions per block (row_hist): no list of blocks is made, and the same values as
    Summary.of(_rows(...)). None: see row_hist."""
    got = row_hist(d, b, fine, cache)
    if got is None:
        return None
    hist, nb, base, touched_at = got
    ub = nb - hist[:, 0]
    tb = -(-seq // b)
    safe = np.maximum(ub, 1)
    pc_lo, pc_hi = -(-plo // b), -(-phi // b)
    known = pc_lo == pc_hi
    # the touched blocks among each row's first prefix_cached_blocks blocks (where known)
    take = np.minimum(np.where(known, pc_lo, 0), nb)
    start = np.zeros(len(take), dtype=np.int64)
    if len(take) > 1:
        np.cumsum(take[:-1], out=start[1:])
    total = int(take.sum())
    touched = touched_at(np.repeat(base - start, take) + np.arange(total))
    run = np.zeros(total + 1, dtype=np.int64)
    np.cumsum(touched, out=run[1:])
    ilens = run[start + take] - run[start]
    with np.errstate(invalid="ignore", divide="ignore"):
        inter_ratio = np.where(known, ilens / safe, np.nan)
    p50 = _median(kth_of(hist[:, 1:], ub), ub)
    tpb = hist.sum(axis=0)
    tpb[0] = 0  # the untouched blocks are no touched block's count
    return Summary(
        unique_blocks=ub,
        ratio=ub / np.maximum(tb, 1),
        tpb=tpb,
        tpb_p50=p50,
        inter_ratio=inter_ratio,
        bytes_read=int((ub * b * bpt).sum()),
    )


# -- the distributions -------------------------------------------------------------------------


@dataclass
class SizeAgg:
    """Bounded histograms of one block size's fields over the records used."""

    block_size: int
    records: int = 0
    # integer histograms as arrays (hist[v]: how many), grown as needed: no Python loop a chunk;
    # the ratios (0..1, kept to RATIO_DIGITS decimals) so too, indexed by ratio x 10**digits
    unique_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ratio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ratio_sum: float = 0.0
    tpb: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # over touched blocks
    tpb_p50: Counter[float] = field(default_factory=Counter)
    inter_ratio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    inter_sum: float = 0.0
    prefix_undetermined: int = 0
    bytes_total: int = 0

    def add(self, rows: Rows | Summary) -> None:
        if isinstance(rows, Rows):
            rows = Summary.of(rows)
        self.records += len(rows.unique_blocks)
        self.unique_blocks = _bump_ints(self.unique_blocks, rows.unique_blocks)
        self.ratio = _bump_ints(self.ratio, _grid(rows.ratio))
        self.ratio_sum += float(rows.ratio.sum())
        self.tpb = _add_hist(self.tpb, rows.tpb)
        _bump(self.tpb_p50, rows.tpb_p50)
        known = np.isfinite(rows.inter_ratio)
        self.prefix_undetermined += int((~known).sum())
        ir = rows.inter_ratio[known]
        self.inter_ratio = _bump_ints(self.inter_ratio, _grid(ir))
        self.inter_sum += float(ir.sum())
        self.bytes_total += rows.bytes_read

    def merge(self, o: SizeAgg) -> None:
        """Fold in another part's histograms (its float sums added as add() would have)."""
        self.records += o.records
        self.unique_blocks = _add_hist(self.unique_blocks, o.unique_blocks)
        self.ratio = _add_hist(self.ratio, o.ratio)
        self.ratio_sum += o.ratio_sum
        self.tpb = _add_hist(self.tpb, o.tpb)
        self.tpb_p50.update(o.tpb_p50)
        self.prefix_undetermined += o.prefix_undetermined
        self.inter_ratio = _add_hist(self.inter_ratio, o.inter_ratio)
        self.inter_sum += o.inter_sum
        self.bytes_total += o.bytes_total

    def result(self, bpt: int | None) -> dict[str, Any]:
        unique_blocks = _counter(self.unique_blocks)
        ub = stats(unique_blocks)
        nbytes = None
        if bpt is not None and ub["count"]:
            per = self.block_size * bpt
            nbytes = {k: (v * per if k != "count" and v is not None else v) for k, v in ub.items()}
            nbytes["total"] = self.bytes_total
        return {
            "block_size": self.block_size,
            "records": self.records,
            "unique_blocks": ub,
            "touched_block_ratio": stats(_ratios(self.ratio), self.ratio_sum),
            "tokens_per_touched_block": stats(_counter(self.tpb)),
            "tokens_per_touched_block_p50": stats(self.tpb_p50),
            "bytes_read": nbytes,
            "prefix_intersection_ratio": stats(_ratios(self.inter_ratio), self.inter_sum),
            "prefix_undetermined": self.prefix_undetermined,
            "hist": {
                "touched_block_ratio": histogram(_ratios(self.ratio), 0.0, 1.0),
                "unique_blocks": histogram(unique_blocks),
            },
        }


def _bump(counter: Counter[Any], values: np.ndarray) -> None:
    if len(values) == 0:
        return
    vals, cnt = np.unique(values, return_counts=True)
    for v, c in zip(vals.tolist(), cnt.tolist(), strict=True):
        counter[v] += c


_SCALE = 10**RATIO_DIGITS


def _grid(ratios: np.ndarray) -> np.ndarray:
    """Ratios (>= 0) as their index on the RATIO_DIGITS grid: np.round(r, RATIO_DIGITS) is
    index / 10**RATIO_DIGITS exactly (numpy rounds so: rint(r x 10**d) / 10**d)."""
    return np.rint(ratios * _SCALE).astype(np.int64)


def _ratios(hist: np.ndarray) -> Counter[float]:
    """A ratio histogram on the grid as {ratio: how many} (the ratios as np.round gives them)."""
    nz = np.flatnonzero(hist)
    return Counter({i / _SCALE: c for i, c in zip(nz.tolist(), hist[nz].tolist(), strict=True)})


def _bump_ints(hist: np.ndarray, values: np.ndarray) -> np.ndarray:
    """hist with values (non-negative integers) counted in (in place where it is long
    enough: a few values into a long histogram, a ratio grid's, touch only their bins)."""
    if len(values) == 0:
        return hist
    if len(values) < len(hist) and values.min() >= 0 and values.max() < len(hist):
        np.add.at(hist, values, 1)
        return hist
    more = np.bincount(values, minlength=len(hist))
    more[: len(hist)] += hist
    return more


def _add_hist(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if len(a) < len(b):
        a, b = b, a
    out = a.copy()
    out[: len(b)] += b
    return out


def _counter(hist: np.ndarray) -> Counter[int]:
    nz = np.flatnonzero(hist)
    return Counter(dict(zip(nz.tolist(), hist[nz].tolist(), strict=True)))


def stats(counter: Counter[Any], total: float | None = None) -> dict[str, Any]:
    """{count, min, p50, p95, max, mean} of a histogram (linear percentiles)."""
    items = sorted(counter.items())
    n = sum(c for _, c in items)
    if n == 0:
        return {"count": 0, "min": None, "p50": None, "p95": None, "max": None, "mean": None}
    s = total if total is not None else sum(v * c for v, c in items)
    return {
        "count": n,
        "min": items[0][0],
        "p50": percentile(items, Q50),
        "p95": percentile(items, Q95),
        "max": items[-1][0],
        "mean": s / n,
    }


def histogram(
    counter: Counter[Any], lo: float | None = None, hi: float | None = None, bins: int = 10
) -> list[list[float]]:
    """[[bin start, bin end, count], ...] over [lo, hi] (the data's range when not given)."""
    if not counter:
        return []
    lo = min(counter) if lo is None else lo
    hi = max(counter) if hi is None else hi
    width = (hi - lo) / bins if hi > lo else 1.0
    out = [[lo + i * width, lo + (i + 1) * width, 0] for i in range(bins)]
    for v, c in counter.items():
        i = min(int((v - lo) / width), bins - 1) if hi > lo else 0
        out[max(i, 0)][2] += c
    return out


# -- a whole trace -----------------------------------------------------------------------------


@dataclass
class WhatIf:
    """Folds judged chunks into one SizeAgg per block size (the recorded size is checked too)."""

    info: TraceInfo
    sizes: list[int]
    aggs: dict[int, SizeAgg] = field(default_factory=dict)
    records: int = 0
    used: int = 0
    invalid: int = 0
    first_invalid: str | None = None
    recorded_equal: int = 0  # records whose recorded B/C/D fields equal the recomputation
    recorded_differ: int = 0
    first_differ: str | None = None
    percentile_method: int = 0  # records whose tpb p50/p95 are another method's (see _compare)

    def __post_init__(self) -> None:
        self.aggs = {b: SizeAgg(b) for b in self.sizes}

    def feed(self, s: Scanned) -> None:
        b = s.batch
        self.records += len(b) + len(s.bad)
        rows = np.flatnonzero(s.valid)
        bad = len(b) - len(rows) + len(s.bad)
        self.invalid += bad
        if bad and self.first_invalid is None:
            if s.bad:
                line, fail, _ = s.bad[0]
            else:
                r = int(np.flatnonzero(~s.valid)[0])
                line, fail = b.lines[r], s.fail(r)
            self.first_invalid = (
                f"{s.file}:{line}: {fail.field}: expected {fail.expected}, found {fail.found}"
            )
        if not len(rows):
            return
        self.used += len(rows)
        got, own = summarize(self.info, b, rows, self.sizes, s.derived)
        for b_size in self.sizes:
            self.aggs[b_size].add(got[b_size])
        if own is not None:
            self._compare(s, rows, own)

    def _compare(self, s: Scanned, rows: np.ndarray, own: Rows) -> None:
        """The recorded B/C/D fields against the recomputation at the recorded size, per row
        (all rows at once; names only for the first row that differs); a ratio or mean equals
        it to the precision it was written with, as the validator reads it."""
        every = len(rows) == len(s.batch)  # (rows is then every row, in order)
        c = s.batch.col if every else {k: v[rows] for k, v in s.batch.col.items()}
        recorded = s.batch.blocks
        inter = s.batch.inter
        checks = {
            "selected_block_ids": _same_rows(_take(recorded, rows), own.blocks),
            "unique_blocks": c["ublocks"] == own.unique_blocks,
            "tokens_per_touched_block.mean": as_written(c["tpb_mean"], own.tpb_mean),
            "kv_fetch.hbm.bytes_read": c["bytes"] == own.bytes_read,
            "prefix.prefix_cached_blocks": c["pcb"] == own.pcb,
            "prefix.intersection_ratio": as_written(c["ratio"], own.inter_ratio),
            "total_blocks_in_use": ~c["has_total"] | (c["total_blocks"] == own.total_blocks),
            "touched_block_ratio": np.isnan(c["tbr"]) | as_written(c["tbr"], own.ratio),
            "prefix.intersection_blocks": _same_rows(_take(inter, rows), own.inter),
        }
        ok = np.logical_and.reduce(list(checks.values()))
        # the seed names no percentile method (the validator accepts any between the
        # bracketing order statistics): another method's p50/p95 is counted, not a difference
        method = ~(as_written(c["tpb_p50"], own.tpb_p50) & as_written(c["tpb_p95"], own.tpb_p95))
        self.percentile_method += int(method.sum())
        self.recorded_equal += int(ok.sum())
        bad = np.flatnonzero(~ok)
        if len(bad):
            self.recorded_differ += len(bad)
            if self.first_differ is None:
                i = int(bad[0])
                names = [name for name, v in checks.items() if not v[i]]
                line = s.batch.lines[int(rows[i])]
                self.first_differ = f"{s.file}:{line}: {', '.join(names)}"

    def merge(self, o: WhatIf) -> None:
        """Fold in the part that follows this one in the trace (one scanned chunk's, say: its
        float sums are then the very addends feed() would have added)."""
        self.records += o.records
        self.used += o.used
        self.invalid += o.invalid
        self.first_invalid = self.first_invalid or o.first_invalid
        self.recorded_equal += o.recorded_equal
        self.recorded_differ += o.recorded_differ
        self.first_differ = self.first_differ or o.first_differ
        self.percentile_method += o.percentile_method
        for b in self.sizes:
            self.aggs[b].merge(o.aggs[b])

    def result(self) -> dict[str, Any]:
        bpt = self.info.bytes_per_token
        return {
            "dir": str(self.info.folder),
            "block_size": self.info.block_size,
            "bytes_per_token": bpt,
            "prefix_key_tokens": self.info.prefix_key_tokens,
            "prompt_tokens_from": "serving.jsonl" if self.info.prompt_tokens else None,
            "records": self.records,
            "used": self.used,
            "invalid": self.invalid,
            "first_invalid": self.first_invalid,
            "recorded_equal": self.recorded_equal,
            "recorded_differ": self.recorded_differ,
            "first_differ": self.first_differ,
            "percentile_method": self.percentile_method,
            "sizes": [self.aggs[b].result(bpt) for b in self.sizes],
        }


class WhatIfChunk:
    """The what-if's work on one chunk (any process): a part per scanned run of its rows, for
    WhatIf.merge in order."""

    def __init__(self, info: TraceInfo, sizes: list[int]) -> None:
        self.info = info
        self.sizes = sizes

    def __call__(self, path: str, lines: list[bytes], first_line: int, torn: bool) -> list[WhatIf]:
        from pathlib import Path

        from analysis.dsa_scan import scan_span

        parts = []
        for s in scan_span(self.info, Path(path), lines, first_line, torn):
            part = WhatIf(self.info, self.sizes)
            part.feed(s)
            part.info = None  # type: ignore[assignment]  # not sent back: the caller has it
            parts.append(part)
        return parts


def whatif_dir(
    folder: str,
    sizes: list[int],
    topk: int | None = None,
    workers: int = 1,
    chunk: int = 4 << 20,
) -> dict[str, Any]:
    """The what-if of one block directory, streamed, its chunks read by `workers` processes
    (the same result; a top-level function: a worker process can run it)."""
    from pathlib import Path

    from analysis.dsa_parallel import map_chunks
    from analysis.dsa_scan import known, trace_info
    from analysis.dsa_tree import shard_files

    info = trace_info(Path(folder), topk)
    w = WhatIf(info, sizes)
    job = WhatIfChunk(info, sizes)
    for parts in map_chunks(shard_files(info.folder), job, workers, lambda: known(info), chunk):
        for part in parts:
            w.merge(part)
    return w.result()


def _take(r: Ragged, rows: np.ndarray) -> Ragged:
    if len(rows) == len(r) and (rows == np.arange(len(r))).all():
        return r
    return Ragged.of([r[int(i)] for i in rows])


def _same_rows(a: Ragged, b: Ragged) -> np.ndarray:
    """Per row: the same integers in the same order."""
    same_len = a.lens == b.lens
    if same_len.all() and len(a.flat) == len(b.flat):
        diff = a.flat != b.flat
        return same_len & (_segsum(diff, a.starts, a.lens) == 0)
    return np.array([np.array_equal(a[i], b[i]) for i in range(len(a))], dtype=bool)


def compute(
    info: TraceInfo, batch: Batch, rows: np.ndarray, sizes: list[int], derived: Any = None
) -> dict[int, Rows]:
    """The fields at each block size for the given (valid) rows of a batch (derived: the
    validator's Derived for the batch, whose occupancy gives the sorted positions)."""
    seq, bpt, plo, phi = _inputs(info, batch, rows)
    out: dict[int, Rows] = {}
    spos: Ragged | None = None
    every = derived is not None and len(rows) == len(batch)
    for b in sizes:
        counted = block_counts(derived, b) if every else None
        if counted is not None:
            out[b] = at_block_size_counted(*counted, batch.pos.lens, seq, b, bpt, plo, phi)
            continue
        if spos is None:
            spos = sorted_positions(batch, rows, derived)
        out[b] = at_block_size(spos, seq, b, bpt, plo, phi)
    return out


def summarize(
    info: TraceInfo, batch: Batch, rows: np.ndarray, sizes: list[int], derived: Any = None
) -> tuple[dict[int, Summary], Rows | None]:
    """What SizeAgg keeps of the given (valid) rows at each size, and every field at the
    recorded size (None where it is not known) for the comparison with the recorded ones.
    With every row of the batch and its Derived, a size other than the recorded one is read
    off the rows' histograms of positions per block (summary_counted); the others come from
    compute()."""
    b0 = info.block_size
    fast: dict[int, Summary] = {}
    if derived is not None and len(rows) == len(batch):
        seq, bpt, plo, phi = _inputs(info, batch, rows)
        fine = min((b for b in sizes if 8 % b == 0 and b != b0), default=None)
        cache: dict[int, np.ndarray] = {}
        for b in sizes:
            got = summary_counted(derived, b, seq, bpt, plo, phi, fine, cache) if b != b0 else None
            if got is not None:
                fast[b] = got
    rest = [b for b in sizes if b not in fast]
    if b0 is not None and b0 not in rest:
        rest.append(b0)
    full = compute(info, batch, rows, rest, derived) if rest else {}
    out = {b: fast[b] if b in fast else Summary.of(full[b]) for b in sizes}
    return out, full.get(b0) if b0 is not None else None


def _inputs(
    info: TraceInfo, batch: Batch, rows: np.ndarray
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """The rows' seq_len_current, the KV bytes per token (0: unknown) and each row's prefix
    range in tokens (prefix_range)."""
    c = batch.col
    seq = c["seq"][rows]
    prompt = None
    if info.prompt_tokens:
        get = info.prompt_tokens.get
        prompt = np.array([get(int(q), -1) for q in c["request"][rows]], dtype=np.int64)
    b0 = info.block_size or int(c["bs"][rows[0]])
    plo, phi = prefix_range(c["pcb"][rows], b0, info.prefix_key_tokens, prompt)
    return seq, info.bytes_per_token or 0, plo, phi


# -- text ----------------------------------------------------------------------------------------


def format_whatif(result: dict[str, Any]) -> str:
    sizes = result["sizes"]
    head = [
        f"DSA block-size what-if {result['dir']}: recorded at block size {result['block_size']}, "
        f"{result['used']} of {result['records']} records used",
    ]
    if result["invalid"]:
        head.append(
            f"  {result['invalid']} invalid records left out (first: {result['first_invalid']}); "
            "`tracedeck analyze` judges the whole trace"
        )
    if result["recorded_differ"]:
        head.append(
            f"  at the recorded size, {result['recorded_differ']} records' B/C/D fields differ from "
            f"the recomputation from selected_token_pos (first: {result['first_differ']})"
        )
    else:
        head.append(
            f"  at the recorded size, every B/C/D field of the {result['recorded_equal']} records "
            "used equals the recomputation from selected_token_pos"
        )
    if result["percentile_method"]:
        head.append(
            f"  {result['percentile_method']} records write tokens_per_touched_block p50/p95 "
            "by another percentile method than numpy's linear (used here at every size)"
        )
    bpt = result["bytes_per_token"]
    head.append(
        f"  bytes_read at {bpt} KV bytes per token"
        if bpt
        else "  bytes_read: the trace shows no KV bytes per token (DS_TRACE_KV_BYTES_PER_TOKEN unset)"
    )
    rows: list[tuple[str, list[str]]] = []
    metrics = [
        ("unique_blocks", "unique_blocks"),
        ("touched_block_ratio", "touched_block_ratio"),
        ("tokens/touched block", "tokens_per_touched_block"),
        ("bytes_read", "bytes_read"),
        ("prefix ∩ ratio", "prefix_intersection_ratio"),
    ]
    for label, key in metrics:
        for stat in ("p50", "p95", "mean", "max"):
            cells = []
            for s in sizes:
                st = s[key]
                v = None if st is None else st.get(stat)
                cells.append(_cell(v))
            rows.append((f"{label} {stat}", cells))
    undet = [str(s["prefix_undetermined"]) for s in sizes]
    if any(u != "0" for u in undet):
        rows.append(("prefix undetermined", undet))
    width = max(len(r[0]) for r in rows)
    col = max(10, *(len(c) for _, cells in rows for c in cells))
    lines = [*head, ""]
    lines.append(
        " " * width + "  " + "".join(f"{'block ' + str(s['block_size']):>{col + 2}}" for s in sizes)
    )
    for label, cells in rows:
        lines.append(f"{label:<{width}}  " + "".join(f"{c:>{col + 2}}" for c in cells))
    lines.append("")
    lines.append("touched_block_ratio histogram (records per tenth):")
    lines += side_by_side_hist(sizes, "touched_block_ratio")
    return "\n".join(lines)


def side_by_side_hist(sizes: list[dict[str, Any]], key: str, bar: int = 14) -> list[str]:
    hists = [s["hist"][key] for s in sizes]
    if not any(hists):
        return ["  (no records)"]
    peak = max((h[2] for hist in hists for h in hist), default=1) or 1
    out = ["        " + "".join(f"{'block ' + str(s['block_size']):<{bar + 2}}" for s in sizes)]
    for i in range(max(len(h) for h in hists)):
        lo = next(h[i][0] for h in hists if len(h) > i)
        cells = []
        for h in hists:
            n = h[i][2] if len(h) > i else 0
            cells.append(f"{'#' * round(bar * n / peak):<{bar}}  ")
        out.append(f"  {lo:4.1f}  " + "".join(cells))
    return out


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.4g}" if abs(v) < 1e6 else f"{v:.4e}"
    return f"{int(v)}"


def record_fields(rows: Rows, i: int) -> dict[str, Any]:
    """Row i's recomputed fields under the seed's names (5.2; None where undetermined)."""
    ub = int(rows.unique_blocks[i])
    blocks = rows.blocks[i].tolist()
    known = rows.pcb[i] >= 0
    return {
        "block_size_tokens": rows.block_size,
        "selected_block_ids": blocks,
        "unique_blocks": ub,
        "total_blocks_in_use": int(rows.total_blocks[i]),
        "touched_block_ratio": float(rows.ratio[i]),
        "tokens_per_touched_block": {
            "mean": float(rows.tpb_mean[i]),
            "p50": float(rows.tpb_p50[i]),
            "p95": float(rows.tpb_p95[i]),
        },
        "kv_fetch.hbm": {
            "hit_blocks": blocks,
            "bytes_read": int(rows.bytes_read[i]),
            "batch_size": ub,
        },
        "prefix": {
            "prefix_cached_blocks": int(rows.pcb[i]) if known else None,
            "intersection_ratio": float(rows.inter_ratio[i]) if known else None,
            "intersection_blocks": rows.inter[i].tolist() if known else None,
        },
    }
