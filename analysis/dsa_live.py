"""The live view's aggregates of a DSA trace: small fixed histograms, per layer and per request,
and the current request's layer x block heat map. UI-free and bounded: folded from a checked
batch (increment) and from a recorded increment (apply) alike, never a list of records.

Histogram bins (HIST): touched_block_ratio and prefix.intersection_ratio in 20 bins of 0.05;
unique_blocks and offsets in log2 bins (bin k holds [2^(k-1), 2^k), bin 0 the value 0);
tokens_per_touched_block in 16 bins over 1..block_size.
"""

from __future__ import annotations

import base64
import zlib
from collections import OrderedDict
from typing import Any

import numpy as np

HIST = {"touched": 20, "unique_blocks": 14, "offsets": 19, "tokens_per_block": 16, "prefix": 20}
SLICES: dict[str, slice] = {}
_at = 0
for _name, _n in HIST.items():
    SLICES[_name] = slice(_at, _at + _n)
    _at += _n
WIDTH = _at  # bins of one vector; then n and the sum of touched ratios
RECENT_REQUESTS = 16
HEAT_COLUMNS = 96
MAX_LAYERS = 512


_WIDE = {"1": np.uint8, "2": np.uint16, "4": np.uint32}


def pack(a: np.ndarray) -> str:
    """Non-negative integer counts as "<bytes per count>:" + base64(zlib(the counts)), in the
    narrowest unsigned type that holds them: kilobytes, not a JSON list."""
    a = np.asarray(a)
    top = int(a.max()) if a.size else 0
    size = "1" if top < 1 << 8 else "2" if top < 1 << 16 else "4"
    raw = np.ascontiguousarray(a, dtype=_WIDE[size]).tobytes()
    return size + ":" + base64.b64encode(zlib.compress(raw, 1)).decode()


def unpack(text: str) -> np.ndarray:
    size, sep, body = text.partition(":")
    if not sep:  # recorded before the narrow types: uint32
        size, body = "4", text
    return np.frombuffer(zlib.decompress(base64.b64decode(body)), dtype=_WIDE[size]).astype(
        np.int64
    )


def log2_bin(v: np.ndarray, top: int) -> np.ndarray:
    v = np.maximum(np.asarray(v, dtype=np.int64), 0)
    bits = np.where(v > 0, np.frexp(np.maximum(v, 1).astype(np.float64))[1], 0)
    return np.minimum(bits, top - 1)


# offsets < _OFF_TOP[k] for k = 0..18: bin 0 is offset 0, bin k holds [2^(k-1), 2^k)
_OFF_TOP = np.array([1] + [1 << k for k in range(1, HIST["offsets"])], dtype=np.int64)


class LiveAgg:
    """All / per-layer / recent-request histogram vectors and the current request's heat map.

    A vector is WIDTH bins (HIST, back to back), then the record count, then the sum of the
    records' touched_block_ratio. Layers are rows of one matrix."""

    def __init__(self) -> None:
        self.all = np.zeros(WIDTH + 2)
        self.layer_rows = np.zeros((0, WIDTH + 2))
        self.requests: OrderedDict[int, np.ndarray] = OrderedDict()
        self.heat_request: int | None = None
        self.heat_width = 1
        self.heat = np.zeros((0, 0), dtype=np.int64)  # layer x column touch counts
        self.heat_prefix = 0  # prefix_cached_blocks of the heat map's request
        self.block_size = 0

    @property
    def layers(self) -> dict[int, np.ndarray]:
        """The layers seen so far and their vectors."""
        seen = np.flatnonzero(self.layer_rows[:, WIDTH])
        return {int(k): self.layer_rows[k] for k in seen}

    # -- from a checked batch ------------------------------------------------------------------

    def increment(
        self, cols: dict[str, np.ndarray], d: Any, rows: np.ndarray, bs: int
    ) -> dict[str, Any]:
        """The increment for valid rows `rows` of a checked chunk (JSON-ready), applied here too."""
        n = len(rows)
        vec = np.zeros((n, WIDTH + 2))
        ub = cols["ublocks"][rows]
        tr = ub / np.maximum(d.total_blocks[rows], 1)
        pr = d.inter_lens[rows] / np.maximum(ub, 1)
        idx = np.arange(n)
        vec[idx, SLICES["touched"].start + np.minimum((tr * 20).astype(np.int64), 19)] = 1
        vec[idx, SLICES["unique_blocks"].start + log2_bin(ub, HIST["unique_blocks"])] = 1
        vec[idx, SLICES["prefix"].start + np.minimum((pr * 20).astype(np.int64), 19)] = 1
        # offsets per log2 bin, counted from each row's position occupancy (no per-position pass)
        seq = d.seq[rows]
        lens = d.lens[rows]
        tops = np.minimum(seq[:, None], _OFF_TOP[None, :])  # offset < top <=> pos >= seq - top
        upto = lens[:, None] - d.count_below(rows, seq[:, None] - tops)
        off = vec[:, SLICES["offsets"]]
        off[:, 0] = upto[:, 0]
        off[:, 1:] = np.diff(upto, axis=1)
        off[:, -1] += lens - upto[:, -1]
        # tokens per touched block, 16 bins over 1..bs
        mask = np.zeros(len(d.total_blocks), dtype=bool)
        mask[rows] = True
        counts = d.counts[np.repeat(mask, d.total_blocks)]
        owner = np.repeat(idx, d.total_blocks[rows])
        touched = counts > 0
        tb_bin = np.minimum((counts[touched] - 1) * 16 // max(bs, 1), 15)
        hist = np.bincount(owner[touched] * 16 + tb_bin, minlength=n * 16).reshape(n, 16)
        vec[:, SLICES["tokens_per_block"]] = hist
        vec[:, WIDTH] = 1
        vec[:, WIDTH + 1] = tr
        # groups: (request, layer) sums, as one dense matrix
        key = cols["request"][rows].astype(np.int64) * MAX_LAYERS + cols["layer"][rows]
        order = np.argsort(key, kind="stable")
        ukey, starts = np.unique(key[order], return_index=True)
        sums = np.add.reduceat(vec[order], starts, axis=0)
        sums[:, WIDTH + 1] = np.round(sums[:, WIDTH + 1], 9)  # as recorded: replays add the same
        bins = sums[:, : WIDTH + 1]
        used = np.flatnonzero(bins.any(axis=0))  # most bins of a batch are empty
        inc: dict[str, Any] = {
            "bs": bs,
            "keys": ukey.tolist(),
            "tr": sums[:, WIDTH + 1].tolist(),
            "cols": used.tolist(),
            "bins": pack(bins[:, used]),
        }
        # heat map of the newest request in the chunk: records touching each (layer, block column)
        req = int(cols["request"][rows].max())
        mine = rows[cols["request"][rows] == req]
        tb_max = int(d.total_blocks[mine].max())
        width = max(1, self.heat_width if self.heat_request == req else 1)
        while -(-tb_max // width) > HEAT_COLUMNS:
            width *= 2
        ncol = -(-tb_max // width)
        layers = cols["layer"][mine]
        nl = int(layers.max()) + 1
        mine_mask = np.zeros(len(d.total_blocks), dtype=bool)
        mine_mask[mine] = True
        seg = d.counts[np.repeat(mine_mask, d.total_blocks)] > 0
        tbm = d.total_blocks[mine]
        local = np.arange(int(tbm.sum())) - np.repeat(_starts(tbm), tbm)
        lay = np.repeat(layers, tbm)
        cells = np.bincount((lay * ncol + local // width)[seg], minlength=nl * ncol)
        inc["heat"] = [req, width, int(cols["pcb"][mine[0]]), nl, ncol, pack(cells)]
        self.apply(inc, sums, cells)
        return inc

    # -- folding -------------------------------------------------------------------------------

    def apply(
        self, inc: dict[str, Any], vectors: np.ndarray | None = None, cells: Any = None
    ) -> None:
        """Fold an increment (vectors, cells: its bins and heat cells unpacked already)."""
        self.block_size = inc.get("bs", self.block_size)
        keys = np.asarray(inc.get("keys", []), dtype=np.int64)
        if len(keys):
            if vectors is not None:
                v = vectors
            else:
                v = np.zeros((len(keys), WIDTH + 2))
                used = inc.get("cols", range(WIDTH + 1))  # recorded before "cols": every bin
                v[:, used] = unpack(inc["bins"]).reshape(len(keys), len(used))
                v[:, WIDTH + 1] = inc["tr"]
            self.all += v.sum(axis=0)
            req, layer = np.divmod(keys, MAX_LAYERS)
            top = int(layer.max()) + 1
            if top > len(self.layer_rows):
                self.layer_rows = np.pad(self.layer_rows, ((0, top - len(self.layer_rows)), (0, 0)))
            if len(np.unique(layer)) == len(layer):
                self.layer_rows[layer] += v
            else:  # two requests in one batch share layers
                np.add.at(self.layer_rows, layer, v)
            for r in np.unique(req).tolist():  # a batch holds a request or two
                if r not in self.requests:
                    self.requests[r] = np.zeros(WIDTH + 2)
                    while len(self.requests) > RECENT_REQUESTS:
                        self.requests.popitem(last=False)
                if r in self.requests:
                    self.requests[r] += v[req == r].sum(axis=0)
        heat = inc.get("heat")
        if heat:
            req, width, pcb, nl, ncol, packed = heat
            cells = (unpack(packed) if cells is None else cells).reshape(nl, ncol)
            if req != self.heat_request:
                self.heat_request, self.heat_width = req, width
                self.heat = np.zeros((0, 0), dtype=np.int64)
            while self.heat_width < width:  # merge column pairs
                h = self.heat
                if h.shape[1] % 2:
                    h = np.pad(h, ((0, 0), (0, 1)))
                self.heat = h.reshape(h.shape[0], -1, 2).sum(axis=2)
                self.heat_width *= 2
            self.heat_prefix = pcb
            if width < self.heat_width:  # this batch's columns are finer: merge them first
                factor = self.heat_width // width
                cells = np.pad(cells, ((0, 0), (0, (-ncol) % factor)))
                cells = cells.reshape(nl, -1, factor).sum(axis=2)
            rows_, cols_ = cells.shape
            grow = (max(0, rows_ - self.heat.shape[0]), max(0, cols_ - self.heat.shape[1]))
            if grow != (0, 0):
                self.heat = np.pad(self.heat, ((0, grow[0]), (0, grow[1])))
            self.heat[:rows_, :cols_] += cells

    def merge(self, other: LiveAgg) -> None:
        """Add another trace's aggregates (the panel shows several trace directories as one)."""
        self.all += other.all
        top = max(len(self.layer_rows), len(other.layer_rows))
        rows = np.zeros((top, WIDTH + 2))
        rows[: len(self.layer_rows)] += self.layer_rows
        rows[: len(other.layer_rows)] += other.layer_rows
        self.layer_rows = rows
        self.requests.update(other.requests)
        self.heat, self.heat_width, self.heat_prefix = (
            other.heat,
            other.heat_width,
            other.heat_prefix,
        )
        self.heat_request = other.heat_request

    # -- reading -------------------------------------------------------------------------------

    def vector(self, request: int | None = None, layer: int | None = None) -> np.ndarray:
        if request is not None:
            return self.requests.get(request, np.zeros(WIDTH + 2))
        if layer is not None:
            if 0 <= layer < len(self.layer_rows):
                return self.layer_rows[layer]
            return np.zeros(WIDTH + 2)
        return self.all

    @staticmethod
    def hist(vec: np.ndarray, name: str) -> np.ndarray:
        return vec[SLICES[name]]

    def layer_means(self) -> list[float]:
        rows = self.layer_rows
        n = rows[:, WIDTH]
        means = np.divide(rows[:, WIDTH + 1], n, out=np.zeros(len(rows)), where=n > 0)
        return means.tolist()

    def hot_blocks(self, limit: int = 10) -> list[tuple[int, int, int, bool]]:
        """(first block, last block, touches, in prefix) of the heat map's hottest columns."""
        if not self.heat.size:
            return []
        totals = self.heat.sum(axis=0)
        order = sorted(range(len(totals)), key=lambda c: (-int(totals[c]), c))[:limit]
        w = self.heat_width
        return [
            (c * w, c * w + w - 1, int(totals[c]), c * w < self.heat_prefix)
            for c in order
            if totals[c]
        ]


def _starts(lens: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lens), dtype=np.int64)
    if len(lens) > 1:
        np.cumsum(lens[:-1], out=out[1:])
    return out
