"""KV-tier simulator: a DSA trace's block accesses replayed through an HBM tier over a remote pool.

Seed 004's kv_fetch keeps three tiers (hbm / local_pool / remote_pool) and the demo fills only
hbm. Here every record's touched blocks (selected_block_ids, or the blocks at another size
recomputed from selected_token_pos) are looked up in an HBM tier of N blocks: a hit is an
hbm hit block, a miss is fetched from the remote pool (one batch_get per record, the seed's
read_ops / batch_size) and then held in HBM, evicting by the policy:
- lru: the least recently used block;
- lfu: the least often used (ties: the least recently used);
- prefix-pinned: lru among blocks outside a shared prefix; prefix blocks go only when nothing
  else is left.
A block is one layer's KV of block_id: a request's own, or, below its prefix_cached_blocks,
the prefix's (every request with the same prefix_key shares those).

Order: shards in request order and lines in file order (the engine's write order), or, when
serving.jsonl says when each request's batch ended (BurstGPT), the engine's own interleaving:
(batch end, step, layer, request) merged across shards as they stream.
Estimated fetch time of a record = remote latency (when it misses) + bytes / bandwidth; a
step's is the sum over its records (the layers run one after another).
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from analysis.dsa_parallel import map_chunks
from analysis.dsa_scan import Scanned, TraceInfo, known, scan_file, scan_span
from analysis.dsa_tree import shard_files
from analysis.dsa_whatif import at_block_size, prefix_range, sorted_positions

POLICIES = ("lru", "lfu", "prefix-pinned")


@dataclass(frozen=True, slots=True)
class Access:
    """One record's block accesses, in replay order."""

    key: tuple[float, int, int, int]  # (batch end or request, step, layer, request)
    request: int
    step: int
    layer: int
    blocks: tuple[Any, ...]  # block identities (hashable)
    prefix: tuple[bool, ...]  # per block: inside a shared prefix
    latency_us: float  # the step's recorded wall time


@dataclass
class Skipped:
    records: int = 0
    invalid: int = 0
    first_invalid: str | None = None


def _accesses(
    chunks: Iterable[Scanned], info: TraceInfo, block_size: int | None, skipped: Skipped
) -> Iterator[Access]:
    b0 = info.block_size or 1
    for s in chunks:
        batch = s.batch
        skipped.records += len(batch) + len(s.bad)
        rows = np.flatnonzero(s.valid)
        bad = len(batch) - len(rows) + len(s.bad)
        if bad:
            skipped.invalid += bad
            if skipped.first_invalid is None:
                if s.bad:
                    line, fail, _ = s.bad[0]
                else:
                    r = int(np.flatnonzero(~s.valid)[0])
                    line, fail = batch.lines[r], s.fail(r)
                skipped.first_invalid = (
                    f"{s.file}:{line}: {fail.field}: expected {fail.expected}, found {fail.found}"
                )
        if not len(rows):
            continue
        c = batch.col
        if block_size is None or block_size == b0:
            blocks, pcb = batch.blocks, c["pcb"]
            starts = blocks.starts
            sel = rows
        else:
            spos = sorted_positions(batch, rows)
            plo, phi = prefix_range(c["pcb"][rows], b0, info.prefix_key_tokens, None)
            got = at_block_size(spos, c["seq"][rows], block_size, 0, plo, phi)
            # an undetermined prefix at this size: its shared region is the blocks surely in it
            pcb_known = np.where(got.pcb >= 0, got.pcb, plo // block_size)
            blocks, pcb, starts = got.blocks, pcb_known, got.blocks.starts
            sel = np.arange(len(rows))
        for i, r in zip(sel.tolist(), rows.tolist(), strict=True):
            req, layer, step = int(c["request"][r]), int(c["layer"][r]), int(c["step"][r])
            key_str = batch.names[r][2]
            n_pre = int(pcb[i])
            ids = blocks.flat[int(starts[i]) : int(starts[i]) + int(blocks.lens[i])].tolist()
            ident = tuple(
                (layer, key_str, bid) if bid < n_pre else (layer, req, bid) for bid in ids
            )
            end = info.end_ms.get(req)
            order = (end if end is not None else float(req), step, layer, req)
            yield Access(
                order, req, step, layer, ident, tuple(b < n_pre for b in ids), c["latency"][r]
            )


class AccessChunk:
    """The replay's reading of one chunk (any process): its records' accesses, and what it
    skipped."""

    def __init__(self, info: TraceInfo, block_size: int | None) -> None:
        self.info = info
        self.block_size = block_size

    def __call__(
        self, path: str, lines: list[bytes], first_line: int, torn: bool
    ) -> tuple[list[Access], Skipped]:
        skipped = Skipped()
        chunks = scan_span(self.info, Path(path), lines, first_line, torn)
        return list(_accesses(chunks, self.info, self.block_size, skipped)), skipped


def replay_order(
    info: TraceInfo,
    block_size: int | None,
    skipped: Skipped,
    workers: int = 1,
    chunk: int = 4 << 20,
) -> Iterator[Access]:
    """The trace's accesses in replay order (see the module's doc), streamed. In trace order
    the shards are read by `workers` processes (BurstGPT's order merges the shards as they
    stream: read here)."""
    files = shard_files(info.folder)
    if workers >= 2 and not info.end_ms:
        job = AccessChunk(info, block_size)
        return _unpacked(map_chunks(files, job, workers, lambda: known(info), chunk), skipped)
    streams = [_accesses(scan_file(info, p), info, block_size, skipped) for p in files]
    if info.end_ms:
        return heapq.merge(*streams, key=lambda a: a.key)
    return (a for stream in streams for a in stream)


def _unpacked(chunks: Iterator[tuple[list[Access], Skipped]], skipped: Skipped) -> Iterator[Access]:
    for accesses, part in chunks:
        skipped.records += part.records
        skipped.invalid += part.invalid
        skipped.first_invalid = skipped.first_invalid or part.first_invalid
        yield from accesses


# -- the HBM tier ---------------------------------------------------------------------------------


class Tier:
    """N blocks of HBM under one policy; access() says whether a block was there."""

    def __init__(self, capacity: int, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}: one of {', '.join(POLICIES)}")
        self.capacity = capacity
        self.policy = policy
        self.lru: OrderedDict[Any, None] = OrderedDict()  # lru, and prefix-pinned's others
        self.pinned: OrderedDict[Any, None] = OrderedDict()  # prefix-pinned's prefix blocks
        self.freq: dict[Any, int] = {}  # lfu
        self.by_freq: dict[int, OrderedDict[Any, None]] = {}
        self.min_freq = 0

    def __len__(self) -> int:
        return len(self.freq) if self.policy == "lfu" else len(self.lru) + len(self.pinned)

    def access(self, block: Any, prefix: bool = False) -> bool:
        if self.capacity <= 0:
            return False
        if self.policy == "lfu":
            return self._lfu(block)
        home = self.pinned if (self.policy == "prefix-pinned" and prefix) else self.lru
        if block in home:
            home.move_to_end(block)
            return True
        if len(self) >= self.capacity:
            victim = self.lru if self.lru else self.pinned
            victim.popitem(last=False)
        home[block] = None
        return False

    def _lfu(self, block: Any) -> bool:
        f = self.freq.get(block)
        if f is not None:
            bucket = self.by_freq[f]
            del bucket[block]
            if not bucket:
                del self.by_freq[f]
                if self.min_freq == f:
                    self.min_freq = f + 1
            self.freq[block] = f + 1
            self.by_freq.setdefault(f + 1, OrderedDict())[block] = None
            return True
        if len(self.freq) >= self.capacity:
            bucket = self.by_freq[self.min_freq]
            old, _ = bucket.popitem(last=False)
            if not bucket:
                del self.by_freq[self.min_freq]
            del self.freq[old]
        self.freq[block] = 1
        self.by_freq.setdefault(1, OrderedDict())[block] = None
        self.min_freq = 1
        return False


@dataclass
class TierResult:
    capacity: int
    accesses: int = 0
    hits: int = 0
    fetched_blocks: int = 0
    read_ops: int = 0
    step_us: Counter[float] = field(default_factory=Counter)  # per step: estimated fetch time

    def as_dict(self, bytes_per_block: int) -> dict[str, Any]:
        from analysis.dsa_whatif import stats

        return {
            "hbm_blocks": self.capacity,
            "accesses": self.accesses,
            "hit_ratio": self.hits / self.accesses if self.accesses else None,
            "hbm": {"hit_blocks": self.hits, "bytes_read": self.hits * bytes_per_block},
            "remote_pool": {
                "hit_blocks": self.fetched_blocks,
                "bytes_read": self.fetched_blocks * bytes_per_block,
                "read_ops": self.read_ops,
                "batch_size_mean": self.fetched_blocks / self.read_ops if self.read_ops else 0,
            },
            "fetch_us_per_step": stats(self.step_us),
        }


def simulate(
    accesses: Iterable[Access],
    capacities: list[int],
    policy: str,
    bytes_per_block: int,
    remote_latency_us: float,
    bandwidth_gbs: float,
) -> tuple[list[TierResult], dict[str, Any]]:
    """Replay through one tier per capacity at once; also the trace's own step wall times."""
    tiers = [Tier(n, policy) for n in capacities]
    results = [TierResult(n) for n in capacities]
    us_per_byte = 1e6 / (bandwidth_gbs * 1e9) if bandwidth_gbs > 0 else 0.0
    current: tuple[float, int] | None = None
    step_fetch = [0.0] * len(tiers)
    walls: Counter[float] = Counter()
    records = 0

    def close_step() -> None:
        for res, t in zip(results, step_fetch, strict=True):
            res.step_us[round(t, 3)] += 1

    for a in accesses:
        records += 1
        step = (a.key[0], a.step)
        if step != current:
            if current is not None:
                close_step()
            current = step
            step_fetch = [0.0] * len(tiers)
            walls[float(a.latency_us)] += 1
        for k, (tier, res) in enumerate(zip(tiers, results, strict=True)):
            misses = 0
            for block, pre in zip(a.blocks, a.prefix, strict=True):
                if not tier.access(block, pre):
                    misses += 1
            res.accesses += len(a.blocks)
            res.hits += len(a.blocks) - misses
            if misses:
                res.fetched_blocks += misses
                res.read_ops += 1
                step_fetch[k] += remote_latency_us + misses * bytes_per_block * us_per_byte
    if current is not None:
        close_step()
    return results, {"records": records, "step_wall_us": walls}


def tiers_dir(
    info: TraceInfo | str,
    capacities: list[int],
    policy: str,
    *,
    block_size: int | None = None,
    bytes_per_token: int | None = None,
    remote_latency_us: float = 50.0,
    bandwidth_gbs: float = 25.0,
    topk: int | None = None,
    workers: int = 1,
    chunk: int = 4 << 20,
) -> dict[str, Any]:
    """The simulation of one block directory at every capacity, JSON-ready (a top-level
    function: a worker process can run it, given the folder's path); `workers` processes
    read the trace (replay_order)."""
    from analysis.dsa_scan import trace_info
    from analysis.dsa_whatif import stats

    if isinstance(info, str):
        info = trace_info(Path(info), topk)
    skipped = Skipped()
    accesses = replay_order(info, block_size, skipped, workers, chunk)
    # the stream learns the block size and bytes per token from the first records it reads:
    # the bytes of a block are fixed once the first access is out
    first = next(accesses, None)
    size = block_size or info.block_size or 1
    bpt = bytes_per_token if bytes_per_token is not None else info.bytes_per_token
    per_block = size * (bpt or 0)
    stream = accesses if first is None else _chain(first, accesses)
    tiers, extra = simulate(stream, capacities, policy, per_block, remote_latency_us, bandwidth_gbs)
    return {
        "dir": str(info.folder),
        "policy": policy,
        "block_size": size,
        "bytes_per_block": per_block,
        "remote_latency_us": remote_latency_us,
        "bandwidth_gbs": bandwidth_gbs,
        "order": (
            "BurstGPT batch order (serving.jsonl: batch end, step, layer, request)"
            if info.end_ms
            else "trace order (shards by request, lines as written)"
        ),
        "records": skipped.records,
        "used": extra["records"],
        "invalid": skipped.invalid,
        "first_invalid": skipped.first_invalid,
        "step_wall_us": stats(extra["step_wall_us"]),
        "tiers": [t.as_dict(per_block) for t in tiers],
    }


def _chain(first: Access, rest: Iterator[Access]) -> Iterator[Access]:
    yield first
    yield from rest


def format_tiers(result: dict[str, Any]) -> str:
    lines = [
        f"KV-tier simulation {result['dir']}: policy {result['policy']}, block size "
        f"{result['block_size']} ({result['bytes_per_block']} bytes a block), remote latency "
        f"{result['remote_latency_us']} us, bandwidth {result['bandwidth_gbs']} GB/s",
        f"  replayed {result['used']} of {result['records']} records in {result['order']}",
    ]
    if result["invalid"]:
        lines.append(
            f"  {result['invalid']} invalid records left out (first: {result['first_invalid']})"
        )
    if not result["bytes_per_block"]:
        lines.append(
            "  the trace shows no KV bytes per token: bytes and transfer time are 0 "
            "(give --kv-bytes-per-token)"
        )
    wall = result["step_wall_us"]
    if wall["count"]:
        lines.append(
            f"  recorded step wall time (kv_fetch.hbm.latency_us): p50 {wall['p50']:.0f} us, "
            f"max {wall['max']:.0f} us over {wall['count']} steps"
        )
    lines.append("")
    head = f"{'HBM blocks':>10}  {'hit ratio':>9}  {'remote blocks':>13}  {'remote bytes':>13}  {'read ops':>8}  {'fetch us/step p50':>17}  {'p95':>10}  {'max':>10}"
    lines.append(head)
    for r in result["tiers"]:
        f = r["fetch_us_per_step"]
        hr = "-" if r["hit_ratio"] is None else f"{r['hit_ratio']:.4f}"
        rp = r["remote_pool"]
        lines.append(
            f"{r['hbm_blocks']:>10}  {hr:>9}  {rp['hit_blocks']:>13}  {rp['bytes_read']:>13}  "
            f"{rp['read_ops']:>8}  {_us(f['p50']):>17}  {_us(f['p95']):>10}  {_us(f['max']):>10}"
        )
    if len(result["tiers"]) > 1:
        lines.append("")
        lines.append("hit ratio by HBM capacity:")
        for r in result["tiers"]:
            h = r["hit_ratio"] or 0.0
            lines.append(f"  {r['hbm_blocks']:>8}  {'#' * round(40 * h):<40}  {h:.3f}")
    return "\n".join(lines)


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"
