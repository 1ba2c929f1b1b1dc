"""A DSA trace judged as it streams in, batch by batch, in any file order and split anywhere.

Per record: the contract (analysis.dsa_checks). Across records:
- a request's records stay in one shard, whose name (trace_steps_<start>_<end>.jsonl) holds it;
- a request's records come in (step, layer) order: each traced step has layers 0..L-1 once each,
  steps only grow, and latency_us is the same on every layer of a step;
- prefix_key/prefix_cache_hit/prefix_cached_blocks do not change within a request, and a hit
  means a request numbered lower had the same key (a miss: none had);
- run_name, dataset, world_size, block size and KV bytes per token are the trace's constants.
At the end (finish): every open step complete, every hit explained, the shards contiguous.

The stream's state is small (per request, never per record); `feed` returns a digest of the
batch (counts, aggregates, the state it changed) and `apply` rebuilds the same state from it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from analysis.dsa_checks import Context, check_batch, explain
from analysis.dsa_live import LiveAgg
from analysis.dsa_record import MAX_SEQ, TORN_EXPECTED, Batch, Fail, read_batch
from analysis.dsa_stats import SummaryAgg, _show

SHARD = re.compile(r"trace_steps_(\d+)_(\d+)\.jsonl")
BLOCK_DIR = re.compile(r"block(\d+)")
DEFAULT_TOPK = 2048  # the seed's production top-k (DSA top-2048)


def shard_range(file: str) -> tuple[int, int] | None:
    """(start, end) from a shard's name; None for a name that is no shard."""
    m = SHARD.fullmatch(file.rsplit("/", 1)[-1])
    return (int(m.group(1)), int(m.group(2))) if m else None


def dir_block_size(file: str) -> int | None:
    parts = file.split("/")
    m = BLOCK_DIR.fullmatch(parts[-2]) if len(parts) > 1 else None
    return int(m.group(1)) if m else None


def problem(
    file: str, line: int | None, ident: tuple[int, int, int] | None, fail: Fail
) -> dict[str, Any]:
    where = f"{file}:{line}" if line else file
    who = f"request {ident[0]}, layer {ident[1]}, step {ident[2]}: " if ident is not None else ""
    return {
        "file": file,
        "line": line,
        "request": ident[0] if ident else None,
        "layer": ident[1] if ident else None,
        "step": ident[2] if ident else None,
        "field": fail.field,
        "expected": fail.expected,
        "found": fail.found,
        "message": f"{where}: {who}{fail.field}: expected {fail.expected}, found {fail.found}",
    }


VOTE_KEYS = 64  # distinct values kept per tally; more fold into the largest kept


def fingerprints(pos: Any) -> np.ndarray:
    """An order-free fingerprint of each row's selected positions (a Ragged): their count, sum
    and sum of squares mixed into 63 bits (two sets alike in all three, in every layer of two
    steps running, do not happen by chance)."""
    n = len(pos.lens)
    if not n or not len(pos.flat):
        return np.zeros(n, np.int64)
    flat = pos.flat
    with np.errstate(over="ignore"):
        if pos.lens[0] > 0 and (pos.lens == pos.lens[0]).all():  # the usual batch: a matrix
            rows = flat.reshape(n, -1)
            s1 = rows.sum(axis=1)
            s2 = np.einsum("ij,ij->i", rows, rows)  # the same sums, wrapping alike
        else:
            starts = np.minimum(pos.starts, len(flat) - 1)
            s1 = np.add.reduceat(flat, starts)
            s2 = np.add.reduceat(flat * flat, starts)
        fp = (s1 * np.int64(1000003) + s2) * np.int64(31) + pos.lens
    return np.where(pos.lens > 0, fp & np.int64((1 << 62) - 1), 0)


def tally(into: dict[str, list[Any]], key: str, count: int, where: list[Any]) -> None:
    """Add count records claiming `key` (where: file, line, request, layer, step of the first)."""
    got = into.get(key)
    if got is None and len(into) >= VOTE_KEYS:
        key = max(into, key=_vote_order)  # bounded: the extra values join the largest kept
        got = into[key]
    if got is None:
        into[key] = [count, *where]
        return
    got[0] += count
    w, g = where[0], got[1]
    if w < g or (w == g and where[1] < got[2]):  # (where[0], where[1]) comes first
        got[1:] = where


def tally_rows(
    into: dict[str, list[Any]], values: list[str], where: Callable[[int], list[Any]]
) -> None:
    """tally(into, values[r], 1, where(r)) for every r in order, a value at a time (the same
    counts, first places and kept values: a value's first row is its earliest)."""
    for value, count in Counter(values).items():  # in the order each value first comes
        tally(into, value, count, where(values.index(value)))


def _vote_order(key: str) -> tuple[int, str]:
    return (0, key) if not key.lstrip("-").isdigit() else (1, f"{int(key):020d}")


def majority(votes: dict[str, list[Any]]) -> str:
    """The value most records claim (a tie: the one claimed first)."""
    return min(votes, key=lambda k: (-votes[k][0], tuple(votes[k][1:3])))


def _before(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Problem a is at an earlier place than b (the same file: an earlier line)."""
    return a["file"] == b["file"] and (a["line"] or 0) < (b["line"] or 0)


# The columns the cross-record checks read (a checked chunk carries only these).
_CROSS_COLS = ("request", "layer", "step", "latency", "hit", "pcb", "world", "seq")


@dataclass
class Checked:
    """One chunk after TraceStream.check(): what absorb() needs, a few columns per record (no
    positions), small enough to come from another process."""

    lines: int  # lines in the chunk
    first_line: int
    view: Batch  # lines, names, bad and the _CROSS_COLS columns
    lens: np.ndarray  # positions selected per row (the top-k claims)
    valid: np.ndarray  # per row: passes every per-record check
    fps: np.ndarray  # per row: fingerprints (-1: invalid)
    why: dict[int, Fail]  # row -> its per-record failure (every row not valid)
    summary: list[dict[str, Any]]  # the valid rows' aggregate increments, per row run


@dataclass
class Request:
    """What the cross-record checks keep per request (never its records)."""

    file: str
    step: int
    next_layer: int
    line: int  # the request's first record
    step_line: int  # the current step's first record
    lat: dict[str, list[Any]]  # the current step's latency_us claims (a vote)
    pfx: dict[str, list[Any]]  # [prefix_key, prefix_cache_hit, prefix_cached_blocks] claims
    prev_fp: list[int]  # the last closed step's selection fingerprints, by layer
    cur_fp: list[int]
    n: int = 0  # records

    def state(self) -> list[Any]:
        return [
            self.file,
            self.step,
            self.next_layer,
            self.line,
            self.step_line,
            self.lat,
            self.pfx,
            self.prev_fp,
            self.cur_fp,
            self.n,
        ]

    @classmethod
    def of(cls, st: list[Any]) -> Request:
        if len(st) == 8:  # recorded before votes: file, step, next, latency, key, hit, pcb, line
            pfx = {orjson.dumps([st[4], st[5], st[6]]).decode(): [1, st[0], st[7], 0, 0, st[1]]}
            return cls(st[0], st[1], st[2], st[7], st[7], {}, pfx, [], [], 0)
        return cls(*st)


@dataclass
class TraceStream:
    """The judge of one trace (a directory's shards, live or at rest).

    topk None: not known yet (no flag, preset or summary.json so far). The records' count
    check then waits: each valid record's claim is tallied (a record that selected fewer
    than seq_len_current positions says top-k = its count; one that selected all says top-k
    >= seq_len_current) and judged when set_topk() is told the top-k, or at finish() by the
    records' majority. Nothing is judged against a guess."""

    topk: int | None = None
    layers: int | None = None
    block_size: int | None = None
    bytes_per_token: int | None = None
    exact: bool = True
    topk_source: str = ""
    prefix_tokens: int | None = None  # config.trace_prefix_key_tokens, when summary.json says
    consts: dict[str, Any] = field(default_factory=dict)
    reqs: dict[int, Request] = field(default_factory=dict)
    votes: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)  # file -> records read
    records: int = 0
    invalid: int = 0
    end_invalid: int = 0  # records found invalid by finish()
    first: dict[str, Any] | None = None
    torn: list[dict[str, Any]] = field(default_factory=list)  # last lines with no newline
    late: list[dict[str, Any]] = field(default_factory=list)
    late_invalid: int = 0
    live_view: bool = True  # False: no LiveAgg (the console's view; `analyze` shows none)
    marks: list[tuple[str, int]] | None = None  # a list: each record found invalid, in order

    def __post_init__(self) -> None:
        # layers not given: each step's layer count is tallied and judged by the majority at
        # the end (a short first step must not blame every step after it)
        self.layers_given = self.layers is not None
        self.summary = SummaryAgg(exact=self.exact)
        self.live = LiveAgg()
        if self.topk is not None and not self.topk_source:
            self.topk_source = "given"

    # -- one batch -------------------------------------------------------------------------------

    def feed(self, file: str, lines: list[bytes], first_line: int) -> dict[str, Any]:
        """Judge and fold a batch of one file's lines; returns its digest (JSON-ready)."""
        batch = read_batch(lines, first_line)
        n = len(batch)
        if self.block_size is None:
            self.block_size = dir_block_size(file) or (int(batch.col["bs"][0]) if n else None)
        bs = self.block_size or 1
        if n and self.bytes_per_token is None:
            self._learn_bytes(batch.col, bs)
        ctx = Context(self.topk, bs, self.bytes_per_token)
        derived = [(r0, sub, check_batch(sub, ctx)) for r0, sub in _chunks(batch, bs)]
        valid = np.concatenate([d.code == 0 for _, _, d in derived]) if n else np.ones(0, bool)
        fps = np.where(valid, fingerprints(batch.pos), -1) if n else np.zeros(0, np.int64)
        digest, touched = self._fold(
            file, len(lines), batch, batch.pos.lens, valid, fps, lambda r: _explain(derived, r)
        )
        incs, live = [], []
        for r0, sub, d in derived:
            keep = valid[r0 : r0 + len(sub)]
            if keep.any():
                incs.append(self._aggregate(sub, d, keep))
                if self.live_view:
                    live.append(self.live.increment(sub.col, d, np.flatnonzero(keep), bs))
        if incs:
            digest["summary"] = incs[0] if len(incs) == 1 else _merge(incs)
            if self.live_view:
                digest["live"] = live
        digest["state"] = self._delta(touched)
        return digest

    def check(self, lines: list[bytes], first_line: int) -> Checked:
        """feed()'s per-record half, for a trace whose block size and KV bytes per token are
        known: parse, every per-record check, the fingerprints, the valid records' aggregate
        increments. It needs nothing from the batches before, so another process can run it;
        absorb() then does the rest, in the trace's order."""
        assert self.block_size is not None and self.bytes_per_token is not None
        batch = read_batch(lines, first_line)
        n = len(batch)
        bs = self.block_size or 1
        ctx = Context(self.topk, bs, self.bytes_per_token)
        derived = [(r0, sub, check_batch(sub, ctx)) for r0, sub in _chunks(batch, bs)]
        valid = np.concatenate([d.code == 0 for _, _, d in derived]) if n else np.ones(0, bool)
        fps = np.where(valid, fingerprints(batch.pos), -1) if n else np.zeros(0, np.int64)
        why = {r: _explain(derived, r) for r in np.flatnonzero(~valid).tolist()}
        incs = []
        for r0, sub, d in derived:
            keep = valid[r0 : r0 + len(sub)]
            if keep.any():
                incs.append(self._aggregate(sub, d, keep))
        view = Batch(
            lines=batch.lines,
            names=batch.names,
            bad=batch.bad,
            col={k: batch.col[k] for k in _CROSS_COLS if k in batch.col},
        )
        return Checked(len(lines), first_line, view, batch.pos.lens, valid, fps, why, incs)

    def absorb(self, file: str, got: Checked, reread: Callable[[], list[bytes]]) -> dict[str, Any]:
        """feed()'s cross-record half of a chunk check() did (the same digest, less the live
        view's increments). A record valid on its own that a cross-record check fails leaves
        the aggregates: the chunk's increments are then made again without it, from its lines
        (reread)."""
        valid = got.valid.copy()
        digest, touched = self._fold(
            file, got.lines, got.view, got.lens, valid, got.fps, got.why.__getitem__
        )
        incs = got.summary
        if (valid != got.valid).any():
            batch = read_batch(reread(), got.first_line)
            bs = self.block_size or 1
            ctx = Context(self.topk, bs, self.bytes_per_token)
            incs = []
            for r0, sub in _chunks(batch, bs):
                keep = valid[r0 : r0 + len(sub)]
                if keep.any():
                    incs.append(self._aggregate(sub, check_batch(sub, ctx), keep))
        else:
            for inc in incs:
                self.summary.apply(inc)
        if incs:
            digest["summary"] = incs[0] if len(incs) == 1 else _merge(incs)
        digest["state"] = self._delta(touched)
        return digest

    def _fold(
        self,
        file: str,
        nlines: int,
        batch: Batch,
        lens: np.ndarray,
        valid: np.ndarray,
        fps: np.ndarray,
        explain_row: Callable[[int], Fail],
    ) -> tuple[dict[str, Any], dict[int, None]]:
        """The cross-record checks of a checked batch, in line order (valid: per row, made
        False where they fail); the digest so far and the requests touched."""
        self.files[file] = self.files.get(file, 0) + nlines
        n = len(batch)
        shard = shard_range(file)
        first: dict[str, Any] | None = None
        touched: dict[int, None] = {}
        votes: dict[str, dict[str, list[Any]]] = {}
        c = batch.col
        requests, layers, steps = (
            (c["request"].tolist(), c["layer"].tolist(), c["step"].tolist()) if n else ([], [], [])
        )
        fp_list = fps.tolist()
        if n:  # the trace's constants, which every parsed record claims (_cross tallies no more)
            lines = batch.lines

            def at(r: int) -> list[Any]:
                return [file, lines[r], requests[r], layers[r], steps[r]]

            names = batch.names
            tally_rows(votes.setdefault("run_name", {}), [v[0] for v in names], at)
            tally_rows(votes.setdefault("dataset", {}), [v[1] for v in names], at)
            tally_rows(votes.setdefault("world_size", {}), _strs(c["world"]), at)
            lat_s = _strs(c["latency"], _num)
            claims = _claims(names, c["hit"], c["pcb"])
        torn: list[dict[str, Any]] = []
        bad_rows = iter(batch.bad)  # in line order, interleaved with the rows (the cross checks
        unread = next(bad_rows, None)  # see every record in the order it was written)
        for r in range(n + 1):
            line = batch.lines[r] if r < n else None
            while unread is not None and (line is None or unread[0] < line):
                bad_line, fail, ident = unread
                if first is None or bad_line < first["line"]:
                    first = problem(file, bad_line, ident, fail)
                if fail.expected == TORN_EXPECTED:  # a problem of its own, as analyze lists it
                    torn.append(problem(file, bad_line, ident, fail))
                if ident is not None:
                    touched[ident[0]] = None
                    self._cross(file, shard, bad_line, ident, None, votes)
                unread = next(bad_rows, None)
            if line is None:
                break
            ident = (requests[r], layers[r], steps[r])
            touched[ident[0]] = None
            fail = self._cross(file, shard, line, ident, (lat_s[r], claims[r], fp_list[r]), votes)
            if fail is not None:
                valid[r] = False
            elif not valid[r] and (first is None or line < first["line"]):
                fail = explain_row(r)
            if fail is not None and (first is None or line < first["line"]):
                first = problem(file, line, ident, fail)
        if self.topk is None and n:
            self._witness(file, batch, lens, valid, votes)
        for name, got in votes.items():
            mine = self.votes.setdefault(name, {})
            for key, (count, *where) in got.items():
                tally(mine, key, count, where)
        late, self.late = self.late, []
        late_bad, self.late_invalid = self.late_invalid, 0
        if late and (first is None or _before(late[0], first)):
            first = late[0]
        bad = len(batch.bad) + int((~valid).sum()) + late_bad
        self.records += nlines
        self.invalid += bad
        if self.first is None and first is not None:
            self.first = first
        if self.marks is not None:
            rows = np.flatnonzero(~valid).tolist()
            marked = sorted([b[0] for b in batch.bad] + [batch.lines[r] for r in rows])
            self.marks += [(file, line) for line in marked]
        self.torn += torn
        digest: dict[str, Any] = {"records": nlines, "invalid": bad}
        if first is not None:
            digest["first"] = first
        if torn:
            digest["torn"] = torn
        if votes:
            digest["votes"] = votes
        return digest, touched

    def _witness(
        self,
        file: str,
        batch: Batch,
        lens: np.ndarray,
        valid: np.ndarray,
        votes: dict[str, dict[str, list[Any]]],
    ) -> None:
        """Tally what each valid record says of the top-k (the top-k is not known yet)."""
        c = batch.col
        seq = c["seq"]
        for r in np.flatnonzero(valid).tolist():
            where = [file, batch.lines[r], int(c["request"][r]), int(c["layer"][r]), int(c["step"][r])]  # fmt: skip
            if lens[r] < seq[r]:
                tally(votes.setdefault("topk", {}), str(int(lens[r])), 1, where)
            else:
                tally(votes.setdefault("topk>=", {}), str(int(seq[r])), 1, where)

    def set_topk(self, topk: int, source: str) -> list[dict[str, Any]]:
        """The top-k is known now (from summary.json, say): judge the records that waited for
        it. Returns their problems (also counted invalid); a known top-k is kept."""
        if self.topk is not None:
            return []
        self.topk, self.topk_source = topk, source
        out, bad = self._topk_problems()
        self.invalid += bad
        if out and (self.first is None or _before(out[0], self.first)):
            self.first = out[0]
        self.late += out
        return out

    def _topk_problems(self) -> tuple[list[dict[str, Any]], int]:
        topk = self.topk or 0
        out, bad = [], 0
        for key, (count, file, line, req, layer, step) in sorted(
            self.votes.get("topk", {}).items(), key=lambda kv: kv[1][1:3]
        ):
            if int(key) != topk:
                bad += count
                want = f"min(top-k {topk} ({self.topk_source}), seq_len_current) = {topk} positions"
                fail = Fail("selected_token_pos", want, f"{key} ({count} records so)")
                out.append(problem(file, line, (req, layer, step), fail))
        for key, (count, file, line, req, layer, step) in sorted(
            self.votes.get("topk>=", {}).items(), key=lambda kv: kv[1][1:3]
        ):
            if int(key) > topk:
                bad += count
                want = f"min(top-k {topk} ({self.topk_source}), seq_len_current {key}) = {topk} positions"  # fmt: skip
                fail = Fail("selected_token_pos", want, f"all {key} positions ({count} records)")
                out.append(problem(file, line, (req, layer, step), fail))
        out.sort(key=lambda p: (p["file"], p["line"] or 0))
        return out, bad

    def topk_claim(self) -> str:
        """Where the top-k came from, for the report."""
        if self.topk is not None:
            return f"top-{self.topk} ({self.topk_source})"
        full = self.votes.get("topk>=", {})
        if full:
            return f"top-k >= {max(int(k) for k in full)} (every record selected all positions)"
        return "top-k unknown (no record)"

    def _learn_bytes(self, c: dict[str, np.ndarray], bs: int) -> None:
        """KV bytes per token, as most records of the first batch give it (not the first one's
        alone: an odd first record would blame all the others)."""
        ub, nbytes = c["ublocks"], c["bytes"]
        ok = (ub > 0) & (nbytes >= 0)
        per = np.where(ok, ub * bs, 1)
        whole = ok & (nbytes % per == 0)
        if whole.any():
            values, counts = np.unique((nbytes // per)[whole], return_counts=True)
            self.bytes_per_token = int(values[np.argmax(counts)])

    def _aggregate(self, batch: Any, d: Any, valid: np.ndarray) -> dict[str, Any]:
        c = batch.col
        rows = np.flatnonzero(valid)
        bs = self.block_size or 1
        hist = np.zeros(int(d.seq[rows].max()), dtype=np.int64)
        cuts = np.concatenate(([0], np.flatnonzero(np.diff(d.seq)) + 1, [len(valid)]))
        for i, j in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
            keep = valid[i:j]
            if not keep.any():
                continue
            seq, span = int(d.seq[i]), int(d.total_blocks[i]) * bs
            block = d.occ[d.base[i] : d.base[i] + (j - i) * span].reshape(j - i, span)
            if not keep.all():
                block = block[keep]
            wide = np.uint16 if len(block) < 1 << 16 else np.int64  # bools summed as bytes
            summed = block.view(np.uint8).sum(axis=0, dtype=wide)
            hist[:seq] += summed[:seq][::-1]  # position p is offset seq - 1 - p
        inter = batch.inter
        return self.summary.batch_increment(
            c["ublocks"][rows],
            d.counts[np.repeat(valid, d.total_blocks)],
            hist,
            d.inter_lens[rows],
            c["layer"][rows],
            inter.flat[np.repeat(valid, inter.lens)],
            np.repeat(c["layer"][rows], inter.lens[rows]),
        )

    # -- across records --------------------------------------------------------------------------

    def _cross(
        self,
        file: str,
        shard: tuple[int, int] | None,
        line: int,
        ident: tuple[int, int, int],
        cols: Any,
        votes: dict[str, dict[str, list[Any]]],
    ) -> Fail | None:
        """The record against the ones before it. Claims that must be equal across a group of
        records (a step's latency_us, a request's prefix fields, the trace's constants) are
        tallied and judged by their majority when the group ends: a group's odd record is
        blamed, never the others."""
        req, layer, step = ident
        fp = -1
        if cols is not None:  # (the trace's constants are tallied by _fold, for all rows)
            latency, claim, fp = cols
        if shard is not None and not shard[0] <= req < shard[1]:
            return Fail("request_id", f"in [{shard[0]}, {shard[1]}) (this shard's name)", str(req))
        if self.layers_given and self.layers is not None and layer >= self.layers:
            return Fail("layer_id", f"< {self.layers} (n_layers)", str(layer))
        st = self.reqs.get(req)
        if st is None:
            if cols is None:
                return None
            st = Request(file, step, 0, line, line, {}, {}, [], [])
            self.reqs[req] = st
        elif st.file != file:
            return Fail(
                "request_id",
                f"all of request {req} in {st.file} (a request never splits across shards)",
                f"request {req} in {file}",
            )
        st.n += 1
        fail: Fail | None = None
        if st.n == 1:
            if layer != 0:
                fail = Fail(
                    "layer_id", f"0 (the first layer of request {req}'s step {step})", str(layer)
                )
        elif step == st.step:
            if layer != st.next_layer:
                what = "repeated" if layer < st.next_layer else f"layer {st.next_layer} missing"
                fail = Fail(
                    "layer_id",
                    f"{st.next_layer} (each layer once per step, in order)",
                    f"{layer} ({what})",
                )
        elif step > st.step:
            fail = self._close_step(req, st, votes)
            st.step, st.step_line = step, line
            if fail is None and layer != 0:
                fail = Fail("layer_id", f"0 (the first layer of step {step})", str(layer))
        else:
            fail = Fail("step_idx", f"> {st.step} (steps of a request only grow)", str(step))
        st.next_layer = layer + 1
        if cols is not None:
            tally(st.lat, latency, 1, [line, layer])
            tally(st.pfx, claim, 1, [file, line, req, layer, step])
            if layer < 4096:
                st.cur_fp += [-1] * (layer + 1 - len(st.cur_fp))
                st.cur_fp[layer] = fp
        return fail

    def _close_step(
        self, req: int, st: Request, votes: dict[str, dict[str, list[Any]]]
    ) -> Fail | None:
        """The step of request `req` ended: its layer count (returned as the next record's
        fail when the layer count is given, else tallied), its latency_us vote and a stale
        selection (added to late)."""
        done = st.next_layer
        fail = None
        if not self.layers_given:
            tally(votes.setdefault("layers", {}), str(done), 1, [st.file, st.step_line, req, 0, st.step])  # fmt: skip
            if self.layers is None:
                self.layers = done  # shown while the trace streams; judged at the end
        elif done != self.layers:
            fail = Fail(
                "layer_id",
                f"{self.layers} layers in request {req}'s step {st.step}",
                f"{done} (the step ended at layer {done - 1})",
            )
        if len(st.lat) > 1:
            want = majority(st.lat)
            total = sum(v[0] for v in st.lat.values())
            for value, (count, line, layer) in sorted(st.lat.items(), key=lambda kv: kv[1][1]):
                if value != want:
                    expected = f"{want} (the step's wall time: {st.lat[want][0]} of its {total} records say so)"  # fmt: skip
                    found = Fail("kv_fetch.hbm.latency_us", expected, value)
                    self._late(problem(st.file, line, (req, layer, st.step), found), count)
        cur, prev = st.cur_fp, st.prev_fp
        if (
            len(cur) == done
            and len(prev) == done
            and done
            and -1 not in cur
            and -1 not in prev
            and cur == prev
        ):
            why = Fail(
                "selected_token_pos",
                f"a selection that changes from the previous traced step in at least one of "
                f"the {done} layers (every step has a new query)",
                f"step {st.step} selected exactly the previous step's positions in all {done} "
                "layers (a stale top-k)",
            )
            self._late(problem(st.file, st.step_line, (req, 0, st.step), why), done)
        st.prev_fp, st.cur_fp, st.lat = cur, [], {}
        return fail

    def _late(self, found: dict[str, Any], count: int) -> None:
        self.late.append(found)
        self.late_invalid += count

    # -- state, digests, the end ----------------------------------------------------------------

    def _delta(self, touched: dict[int, None]) -> dict[str, Any]:
        return {
            "consts": {
                **self.consts,
                "layers": self.layers,
                "block_size": self.block_size,
                "bytes_per_token": self.bytes_per_token,
            },
            "reqs": {str(r): self.reqs[r].state() for r in touched if r in self.reqs},
        }

    def apply(self, file: str, digest: dict[str, Any]) -> None:
        """Rebuild from a recorded digest what feed() left (attach, replay)."""
        self.files[file] = self.files.get(file, 0) + int(digest.get("records", 0))
        self.records += int(digest.get("records", 0))
        self.invalid += int(digest.get("invalid", 0))
        if self.first is None and digest.get("first"):
            self.first = digest["first"]
        self.torn += digest.get("torn") or []
        if digest.get("summary"):
            self.summary.apply(digest["summary"])
        for inc in digest.get("live") or []:
            self.live.apply(inc)
        for name, got in (digest.get("votes") or {}).items():
            if name.startswith("topk") and self.topk is not None:
                continue
            mine = self.votes.setdefault(name, {})
            for key, (count, *where) in got.items():
                tally(mine, key, count, where)
        state = digest.get("state") or {}
        consts = dict(state.get("consts") or {})
        for name in ("layers", "block_size", "bytes_per_token"):
            value = consts.pop(name, None)
            if value is not None and getattr(self, name) is None:
                setattr(self, name, value)
        self.consts.update(consts)
        for key, st in (state.get("reqs") or {}).items():
            self.reqs[int(key)] = Request.of(st)
        self.late.clear()  # problems a replay re-finds were recorded when first found
        self.late_invalid = 0

    def finish(
        self, requests: int | None = None, shard_files: list[str] | None = None
    ) -> list[dict[str, Any]]:
        """The end-of-trace problems: open steps, the groups' votes (the trace's constants, each
        request's prefix fields), the prefix cache claims, the top-k claims, the shards, an
        empty trace. Records found invalid here are end_invalid (finish may run again)."""
        out: list[dict[str, Any]] = []
        bad = 0
        saved = (self.late, self.late_invalid)
        self.late, self.late_invalid = [], 0
        steps = {k: [*v] for k, v in self.votes.get("layers", {}).items()}
        open_steps: dict[str, dict[str, list[Any]]] = {"layers": steps}
        for req, st in sorted(self.reqs.items()):
            copy = Request.of(orjson.loads(orjson.dumps(st.state())))
            fail = self._close_step(req, copy, open_steps)
            if fail is not None:
                out.append(problem(st.file, None, (req, st.next_layer - 1, st.step), fail))
        out += self.late
        bad += self.late_invalid
        self.late, self.late_invalid = saved
        if steps:
            self.layers = int(majority(steps))
            total = sum(v[0] for v in steps.values())
            for value, (count, file, line, req, _, step) in sorted(steps.items()):
                if int(value) != self.layers:
                    expected = f"{self.layers} layers per step ({steps[str(self.layers)][0]} of the {total} steps)"  # fmt: skip
                    fail = Fail("layer_id", expected, f"{value} ({count} steps so)")
                    out.append(problem(file, line, (req, 0, step), fail))
                    bad += int(value) * count
        for name in ("run_name", "dataset", "world_size"):
            votes = self.votes.get(name, {})
            if len(votes) > 1:
                want = majority(votes)
                total = sum(v[0] for v in votes.values())
                for value, (count, file, line, req, layer, step) in votes.items():
                    if value != want:
                        expected = f"{want!r} (the trace's: {votes[want][0]} of {total} records)"
                        fail = Fail(name, expected, f"{value!r} ({count} records)")
                        out.append(problem(file, line, (req, layer, step), fail))
                        bad += count
        got, n = self._prefix_problems()
        out += got
        bad += n
        if self.topk is None:
            claims = self.votes.get("topk", {})
            if claims:
                self.topk = int(majority(claims))
                self.topk_source = (
                    f"the records: {claims[str(self.topk)][0]} of the records that selected "
                    "fewer positions than seq_len_current"
                )
                got, n = self._topk_problems()
                out += got
                bad += n
        out += shard_problems(
            shard_files if shard_files is not None else list(self.files), requests
        )
        if self.records == 0:
            out.append(
                problem(
                    "trace", None, None, Fail("records", "at least one dsa_topk record", "none")
                )
            )
        self.end_invalid = bad
        return out

    def _prefix_problems(self) -> tuple[list[dict[str, Any]], int]:
        """Seed 3.4 per request: its records agree on the prefix fields (the majority is the
        request's claim); a hit iff a lower-numbered request had the same prefix_key; requests
        with one prefix_key (the same first tokens) have the same prefix_cached_blocks; the
        prefix covers no block past the request's last KV block, nor past the prefix key's
        tokens (config.trace_prefix_key_tokens) when summary.json says how many."""
        out: list[dict[str, Any]] = []
        bad = 0
        owners: dict[str, tuple[int, int]] = {}  # prefix_key -> (first request, its blocks)
        bs = self.block_size or 1
        for req, st in sorted(self.reqs.items()):
            if not st.pfx:
                continue
            want = majority(st.pfx)
            key, hit, pcb = orjson.loads(want)
            total = sum(v[0] for v in st.pfx.values())
            for claim, (count, file, line, _, layer, step) in st.pfx.items():
                if claim != want:
                    k2, h2, p2 = orjson.loads(claim)
                    name, mine, theirs = next(
                        (f"prefix.{n}", a, b)
                        for n, a, b in (
                            ("prefix_key", key, k2),
                            ("prefix_cache_hit", hit, h2),
                            ("prefix_cached_blocks", pcb, p2),
                        )
                        if a != b
                    )
                    expected = f"{_show(mine)} (request {req}'s: {st.pfx[want][0]} of its {total} records)"  # fmt: skip
                    out.append(problem(file, line, (req, layer, step), Fail(name, expected, _show(theirs))))  # fmt: skip
                    bad += count
            count, file, line, _, layer, step = st.pfx[want]
            at = (req, layer, step)
            owner = owners.get(key)
            fail = None
            if owner is None and hit:
                fail = Fail("prefix.prefix_cache_hit", "false (no request numbered lower had this prefix_key)", "true")  # fmt: skip
            elif owner is not None and not hit:
                fail = Fail("prefix.prefix_cache_hit", f"true (request {owner[0]} had this prefix_key)", "false")  # fmt: skip
            elif owner is not None and pcb != owner[1]:
                fail = Fail("prefix.prefix_cached_blocks", f"{owner[1]} (request {owner[0]}, the first with this prefix_key: the same first tokens)", str(pcb))  # fmt: skip
            elif pcb > -(-(st.step + 1) // bs):
                fail = Fail("prefix.prefix_cached_blocks", f"<= ceil(seq_len_current {st.step + 1} / {bs}) = {-(-(st.step + 1) // bs)} (the request's KV blocks at its last step)", str(pcb))  # fmt: skip
            elif self.prefix_tokens is not None and pcb > -(-self.prefix_tokens // bs):
                fail = Fail("prefix.prefix_cached_blocks", f"<= ceil(trace_prefix_key_tokens {self.prefix_tokens} / {bs}) = {-(-self.prefix_tokens // bs)}", str(pcb))  # fmt: skip
            if fail is not None:
                out.append(problem(file, line, at, fail))
                bad += count
            owners.setdefault(key, (req, pcb))
        return out, bad


def shard_problems(files: list[str], requests: int | None) -> list[dict[str, Any]]:
    """Shards must cover requests 0..N-1 without a gap (N from summary.json when known)."""
    ranges = sorted((r, f) for f in files if (r := shard_range(f)) is not None)
    out = []
    at = 0
    for (start, end), f in ranges:
        if start > at:
            out.append(
                problem(
                    f,
                    None,
                    None,
                    Fail(
                        "shards",
                        f"a shard starting at request {at}",
                        f"requests {at}..{start - 1} in no shard file (missing shard) before {f.rsplit('/', 1)[-1]}",
                    ),
                )
            )
        elif start < at:
            out.append(
                problem(
                    f,
                    None,
                    None,
                    Fail(
                        "shards",
                        f"a shard starting at request {at}",
                        f"{f.rsplit('/', 1)[-1]} overlaps the shard before it",
                    ),
                )
            )
        if end <= start:
            out.append(
                problem(
                    f,
                    None,
                    None,
                    Fail("shards", "end > start in trace_steps_<start>_<end>", f"{start}_{end}"),
                )
            )
        at = max(at, end)
    if requests is not None and ranges and at < requests:
        out.append(
            problem(
                ranges[-1][1],
                None,
                None,
                Fail(
                    "shards",
                    f"shards up to request {requests} (summary.json config.requests)",
                    f"the last shard ends at {at} (missing shard)",
                ),
            )
        )
    return out


CHUNK_BINS = 1 << 22  # positions' occupancy bins per check_batch call (32 MB)


def row_runs(batch: Batch, bs: int) -> list[tuple[int, int]]:
    """Rows in runs [r0, r1) whose occupancy (sum of their spans) stays under CHUNK_BINS."""
    n = len(batch)
    if not n:
        return []
    seq = np.clip(batch.col["seq"], 1, MAX_SEQ)
    span = (-(-seq // bs)) * bs
    if int(span.sum()) <= CHUNK_BINS:
        return [(0, n)]
    out, r0, acc = [], 0, 0
    for r, s in enumerate(span.tolist()):
        if acc and acc + s > CHUNK_BINS:
            out.append((r0, r))
            r0, acc = r, 0
        acc += s
    out.append((r0, n))
    return out


def _chunks(batch: Batch, bs: int) -> list[tuple[int, Batch]]:
    """The row runs of row_runs as sub-batches (the batch itself when it is one run)."""
    runs = row_runs(batch, bs)
    if runs == [(0, len(batch))]:
        return [(0, batch)]
    return [(r0, batch.sub(r0, r1)) for r0, r1 in runs]


def _explain(derived: list[tuple[int, Batch, Any]], row: int) -> Fail:
    for r0, sub, d in derived:
        if r0 <= row < r0 + len(sub):
            return explain(d, row - r0)
    raise IndexError(row)


def _merge(incs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several increments as one (their applications commute)."""
    agg = SummaryAgg()
    for inc in incs:
        agg.apply(inc)
    return agg.increment()


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _strs(col: np.ndarray, show: Callable[[Any], str] = str) -> list[str]:
    """show() of each value of a column, computed once per distinct value."""
    seen: dict[Any, str] = {}
    out = []
    for v in col.tolist():
        got = seen.get(v)
        if got is None:
            got = seen[v] = show(v)
        out.append(got)
    return out


def _claims(names: list[tuple[str, str, str]], hit: np.ndarray, pcb: np.ndarray) -> list[str]:
    """Each row's [prefix_key, prefix_cache_hit, prefix_cached_blocks] claim, as JSON."""
    seen: dict[tuple[str, bool, int], str] = {}
    out = []
    for (_, _, key), h, p in zip(names, hit.tolist(), pcb.tolist(), strict=True):
        claim = (key, bool(h), p)
        got = seen.get(claim)
        if got is None:
            got = seen[claim] = orjson.dumps(list(claim)).decode()
        out.append(got)
    return out
