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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from analysis.dsa_checks import Context, check_batch, explain
from analysis.dsa_live import LiveAgg
from analysis.dsa_record import MAX_SEQ, Batch, Fail, read_batch
from analysis.dsa_stats import SummaryAgg

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


@dataclass
class Request:
    file: str
    step: int
    next_layer: int
    latency: float | None  # None: not known yet (the step began with an unreadable record)
    key: str
    hit: bool
    pcb: int
    line: int

    def state(self) -> list[Any]:
        return [
            self.file,
            self.step,
            self.next_layer,
            self.latency,
            self.key,
            self.hit,
            self.pcb,
            self.line,
        ]


@dataclass
class TraceStream:
    """The judge of one trace (a directory's shards, live or at rest)."""

    topk: int | None = None
    layers: int | None = None
    block_size: int | None = None
    bytes_per_token: int | None = None
    exact: bool = False
    consts: dict[str, Any] = field(default_factory=dict)
    reqs: dict[int, Request] = field(default_factory=dict)
    keys: dict[str, list[tuple[int, bool, str, int]]] = field(default_factory=dict)
    pending: dict[int, tuple[str, int]] = field(default_factory=dict)  # unexplained hits
    files: dict[str, int] = field(default_factory=dict)  # file -> records read
    records: int = 0
    invalid: int = 0
    first: dict[str, Any] | None = None
    late: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.summary = SummaryAgg(exact=self.exact)
        self.live = LiveAgg()

    # -- one batch -------------------------------------------------------------------------------

    def feed(self, file: str, lines: list[bytes], first_line: int) -> dict[str, Any]:
        """Judge and fold a batch of one file's lines; returns its digest (JSON-ready)."""
        batch = read_batch(lines, first_line)
        self.files[file] = self.files.get(file, 0) + len(lines)
        n = len(batch)
        if self.block_size is None:
            self.block_size = dir_block_size(file) or (int(batch.col["bs"][0]) if n else None)
        bs = self.block_size or 1
        if n and self.bytes_per_token is None:
            self._learn_bytes(batch.col, bs)
        ctx = Context(self.topk or DEFAULT_TOPK, bs, self.bytes_per_token)
        chunks = _chunks(batch, bs)
        derived = [(r0, sub, check_batch(sub, ctx)) for r0, sub in chunks]
        valid = np.concatenate([d.code == 0 for _, _, d in derived]) if n else np.ones(0, bool)
        shard = shard_range(file)
        first: dict[str, Any] | None = None
        touched: dict[int, None] = {}
        c = batch.col
        requests, layers, steps = (
            (c["request"].tolist(), c["layer"].tolist(), c["step"].tolist()) if n else ([], [], [])
        )
        bad_rows = iter(batch.bad)  # in line order, interleaved with the rows (the cross checks
        unread = next(bad_rows, None)  # see every record in the order it was written)
        for r in range(n + 1):
            line = batch.lines[r] if r < n else None
            while unread is not None and (line is None or unread[0] < line):
                bad_line, fail, ident = unread
                if first is None or bad_line < first["line"]:
                    first = problem(file, bad_line, ident, fail)
                if ident is not None:
                    touched[ident[0]] = None
                    self._cross(file, shard, bad_line, ident, None)
                unread = next(bad_rows, None)
            if line is None:
                break
            ident = (requests[r], layers[r], steps[r])
            touched[ident[0]] = None
            fail = self._cross(file, shard, line, ident, (c, batch.names, r))
            if fail is not None:
                valid[r] = False
            elif not valid[r] and (first is None or line < first["line"]):
                fail = _explain(derived, r)
            if fail is not None and (first is None or line < first["line"]):
                first = problem(file, line, ident, fail)
        late, self.late = self.late, []
        if first is None and late:
            first = late[0]
        bad = len(batch.bad) + int((~valid).sum())
        self.records += len(lines)
        self.invalid += bad
        if self.first is None and first is not None:
            self.first = first
        digest: dict[str, Any] = {"records": len(lines), "invalid": bad}
        if first is not None:
            digest["first"] = first
        incs, live = [], []
        for r0, sub, d in derived:
            keep = valid[r0 : r0 + len(sub)]
            if keep.any():
                incs.append(self._aggregate(sub, d, keep))
                live.append(self.live.increment(sub.col, d, np.flatnonzero(keep), bs))
        if incs:
            digest["summary"] = incs[0] if len(incs) == 1 else _merge(incs)
            digest["live"] = live
        digest["state"] = self._delta(touched)
        return digest

    def _learn_bytes(self, c: dict[str, np.ndarray], bs: int) -> None:
        for ub, nbytes in zip(c["ublocks"], c["bytes"], strict=True):
            if ub > 0 and nbytes >= 0:
                per = int(ub) * bs
                if nbytes % per == 0:
                    self.bytes_per_token = int(nbytes // per)
                return

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
    ) -> Fail | None:
        req, layer, step = ident
        if cols is not None:
            c, names, r = cols
            latency = float(c["latency"][r])
            run_name, dataset, key = names[r]
            hit, pcb = bool(c["hit"][r]), int(c["pcb"][r])
            for name, value in (
                ("run_name", run_name),
                ("dataset", dataset),
                ("world_size", int(c["world"][r])),
            ):
                known = self.consts.setdefault(name, value)
                if known != value:
                    return Fail(name, f"{known!r} (as in the trace's first record)", repr(value))
        if shard is not None and not shard[0] <= req < shard[1]:
            return Fail("request_id", f"in [{shard[0]}, {shard[1]}) (this shard's name)", str(req))
        if self.layers is not None and layer >= self.layers:
            return Fail("layer_id", f"< {self.layers} (n_layers)", str(layer))
        st = self.reqs.get(req)
        if st is None:
            if cols is None:
                return None
            st = Request(file, step, 0, latency, key, hit, pcb, line)
            self.reqs[req] = st
            self._register(req, key, hit, file, line)
            if layer != 0:
                st.next_layer = layer + 1
                return Fail(
                    "layer_id", f"0 (the first layer of request {req}'s step {step})", str(layer)
                )
            st.next_layer = 1
            return self._hit_fail(req, key, hit)
        if st.file != file:
            return Fail(
                "request_id",
                f"all of request {req} in {st.file} (a request never splits across shards)",
                f"request {req} in {file}",
            )
        fail: Fail | None = None
        if step == st.step:
            if layer != st.next_layer:
                what = "repeated" if layer < st.next_layer else f"layer {st.next_layer} missing"
                fail = Fail(
                    "layer_id",
                    f"{st.next_layer} (each layer once per step, in order)",
                    f"{layer} ({what})",
                )
            elif cols is not None and st.latency is None:
                st.latency = latency  # the step's first record was unreadable
            elif cols is not None and latency != st.latency:
                fail = Fail(
                    "kv_fetch.hbm.latency_us",
                    f"{_num(st.latency)} (the step's wall time, equal on every layer)",
                    _num(latency),
                )
        elif step > st.step:
            fail = self._close_group(req, st)
            st.step = step
            st.latency = latency if cols is not None else None
            if fail is None and layer != 0:
                fail = Fail("layer_id", f"0 (the first layer of step {step})", str(layer))
        else:
            fail = Fail("step_idx", f"> {st.step} (steps of a request only grow)", str(step))
        st.next_layer = layer + 1
        if fail is None and cols is not None:
            for name, known, value in (
                ("prefix.prefix_key", st.key, key),
                ("prefix.prefix_cache_hit", st.hit, hit),
                ("prefix.prefix_cached_blocks", st.pcb, pcb),
            ):
                if known != value:
                    fail = Fail(name, f"{known!r} (the same for all of request {req})", repr(value))
                    break
        return fail

    def _close_group(self, req: int, st: Request) -> Fail | None:
        done = st.next_layer
        if self.layers is None:
            self.layers = done
            return None
        if done != self.layers:
            return Fail(
                "layer_id",
                f"{self.layers} layers in request {req}'s step {st.step}",
                f"{done} (the step ended at layer {done - 1})",
            )
        return None

    def _register(self, req: int, key: str, hit: bool, file: str, line: int) -> None:
        """A request's prefix key, against the requests numbered below and above it."""
        entries = self.keys.setdefault(key, [])
        for other, other_hit, ofile, oline in entries:
            if other > req:
                if other_hit:
                    self.pending.pop(other, None)
                else:  # read before this lower-numbered request with the same key
                    why = f"true (request {req} had this prefix_key)"
                    fail = Fail("prefix.prefix_cache_hit", why, "false")
                    self.late.append(problem(ofile, oline, (other, 0, self.reqs[other].step), fail))
        entries.append((req, hit, file, line))
        if hit and not any(o < req for o, *_ in entries):
            self.pending[req] = (file, line)

    def _hit_fail(self, req: int, key: str, hit: bool) -> Fail | None:
        lower = [o for o, *_ in self.keys.get(key, []) if o < req]
        if not hit and lower:
            return Fail(
                "prefix.prefix_cache_hit",
                f"true (request {min(lower)} had this prefix_key)",
                "false",
            )
        return None

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
        if digest.get("summary"):
            self.summary.apply(digest["summary"])
        for inc in digest.get("live") or []:
            self.live.apply(inc)
        state = digest.get("state") or {}
        consts = dict(state.get("consts") or {})
        for name in ("layers", "block_size", "bytes_per_token"):
            value = consts.pop(name, None)
            if value is not None and getattr(self, name) is None:
                setattr(self, name, value)
        self.consts.update(consts)
        for key, st in (state.get("reqs") or {}).items():
            req = int(key)
            known = req in self.reqs
            self.reqs[req] = Request(*st)
            if not known:
                self._register(req, st[4], st[5], st[0], st[7])
        self.late.clear()  # problems a replay re-finds were recorded when first found

    def finish(
        self, requests: int | None = None, shard_files: list[str] | None = None
    ) -> list[dict[str, Any]]:
        """The end-of-trace problems: open steps, unexplained hits, shards, an empty trace."""
        out: list[dict[str, Any]] = []
        for req, st in sorted(self.reqs.items()):
            fail = self._close_group(req, st)
            if fail is not None:
                out.append(problem(st.file, None, (req, st.next_layer - 1, st.step), fail))
        for req, (file, line) in sorted(self.pending.items()):
            fail = Fail(
                "prefix.prefix_cache_hit",
                "false (no request numbered lower had this prefix_key)",
                "true",
            )
            out.append(problem(file, line, (req, 0, self.reqs[req].step), fail))
        out += shard_problems(
            shard_files if shard_files is not None else list(self.files), requests
        )
        if self.records == 0:
            out.append(
                problem(
                    "trace", None, None, Fail("records", "at least one dsa_topk record", "none")
                )
            )
        return out


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


def _chunks(batch: Batch, bs: int) -> list[tuple[int, Batch]]:
    """Rows in runs whose occupancy (sum of their spans) stays under CHUNK_BINS."""
    n = len(batch)
    if not n:
        return []
    seq = np.clip(batch.col["seq"], 1, MAX_SEQ)
    span = (-(-seq // bs)) * bs
    if int(span.sum()) <= CHUNK_BINS:
        return [(0, batch)]
    out, r0, acc = [], 0, 0
    for r, s in enumerate(span.tolist()):
        if acc and acc + s > CHUNK_BINS:
            out.append((r0, batch.sub(r0, r)))
            r0, acc = r, 0
        acc += s
    out.append((r0, batch.sub(r0, n)))
    return out


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
