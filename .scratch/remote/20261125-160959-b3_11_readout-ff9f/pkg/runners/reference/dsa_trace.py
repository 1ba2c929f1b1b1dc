"""Seed 004 sections 3 and 5: dsa_topk records, shards by request count, summary.json.

Tracer.record() builds the record of one (request, layer) selection of a decode step; the
step's records wait until the step ends (latency_us is the wall time of the whole step, the
same on every layer) and then go out, one write per shard file, whole lines only.
Layout: <trace-out>/block<N>/trace_steps_<start>_<end>.jsonl (requests start..end-1; a
request's records never split across files) and <trace-out>/block<N>/summary.json.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from runners.reference.tracefile import dumps, write_json_atomic

HOT_BLOCKS = 16  # prefix_hot_blocks entries kept per layer
INJECTIONS = (
    "none",
    "block_off_by_one",
    "stale_topk",
    "drop_layer",
    "split_request",
    "latency_per_layer",
)


@dataclass
class TraceConfig:
    out: Path
    run_name: str
    dataset: str
    block_size: int = 64
    sample_rate: float = 1.0
    store_scores: bool = False
    prefix_key_tokens: int = 256
    max_requests_per_file: int = 10
    n_requests: int = 0
    topk: int = 2048
    layers: int = 61
    world_size: int = 1
    rank: int = 0
    inject: str = "none"
    bytes_per_token: int = 0

    @property
    def block_dir(self) -> Path:
        return self.out / f"block{self.block_size}"


def percentile(values: dict[int | float, int], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of a multiset given as value -> count."""
    items = sorted(values.items())
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


def stats(values: dict[int | float, int], total: float) -> dict[str, Any]:
    """{count, min, p50, p95, max, mean} of a multiset (value -> count); `total` its exact sum."""
    n = sum(values.values())
    if n == 0:
        return {"count": 0, "min": None, "p50": None, "p95": None, "max": None, "mean": None}
    return {
        "count": n,
        "min": min(values),
        "p50": percentile(values, 0.5),
        "p95": percentile(values, 0.95),
        "max": max(values),
        "mean": total / n,
    }


@dataclass
class PrefixInfo:
    key: str
    hit: bool
    cached_blocks: int


class PrefixCacheAnalyzer:
    """Seed 3.4: SHA1 of the first N prompt tokens; a hit when an earlier request had it."""

    def __init__(self, n_tokens: int, block_size: int) -> None:
        self.n_tokens = n_tokens
        self.block_size = block_size
        self.seen: set[str] = set()

    def request(self, prompt: list[int]) -> PrefixInfo:
        head = prompt[: self.n_tokens]
        key = hashlib.sha1(",".join(map(str, head)).encode()).hexdigest()
        hit = key in self.seen
        self.seen.add(key)
        return PrefixInfo(key, hit, -(-len(head) // self.block_size))


@dataclass
class Shard:
    name: str
    start: int
    end: int
    fh: IO[bytes]
    records: int = 0
    size: int = 0


@dataclass
class Summary:
    records: int = 0
    unique_blocks: Counter[int] = field(default_factory=Counter)
    tpb: Counter[int] = field(default_factory=Counter)
    offsets: Counter[int] = field(default_factory=Counter)
    offsets_sum: int = 0
    ratios: Counter[tuple[int, int]] = field(default_factory=Counter)
    hot: dict[int, Counter[int]] = field(default_factory=dict)


class Tracer:
    """Collects a step's records, writes them at the step's end, keeps the summary's counts."""

    def __init__(self, cfg: TraceConfig, rng_seed: int = 0) -> None:
        self.cfg = cfg
        cfg.block_dir.mkdir(parents=True, exist_ok=True)
        self.shards: dict[int, Shard] = {}
        self.done_shards: list[Shard] = []
        self.pending: list[tuple[int, dict[str, Any]]] = []
        self.summary = Summary()
        self.prefix: dict[int, PrefixInfo] = {}
        self.previous: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.sample_rng = np.random.default_rng(rng_seed)
        self.step_on = False
        self.step_requests: dict[int, int] = {}  # request -> decode steps traced so far
        self.layer_t0 = 0.0

    # -- requests and shards ------------------------------------------------------------------

    def shard_of(self, request: int) -> int:
        per = self.cfg.max_requests_per_file
        return 0 if per <= 0 else request // per

    def open_request(self, request: int, info: PrefixInfo) -> None:
        self.prefix[request] = info
        self._shard(self.shard_of(request))

    def _shard(self, index: int) -> Shard:
        if index not in self.shards:
            per, n = self.cfg.max_requests_per_file, self.cfg.n_requests
            start, end = (0, n) if per <= 0 else (index * per, min(n, (index + 1) * per))
            name = f"trace_steps_{start}_{end}.jsonl"
            fh = open(self.cfg.block_dir / name, "ab", buffering=0)  # noqa: SIM115
            self.shards[index] = Shard(name, start, end, fh)
        return self.shards[index]

    def close_request(self, request: int) -> None:
        """A request is done; its shard closes when every request of it is done."""
        index = self.shard_of(request)
        shard = self.shards.get(index)
        self.step_requests.pop(request, None)
        if shard is not None and request == shard.end - 1:
            shard.fh.close()
            self.done_shards.append(self.shards.pop(index))

    # -- steps ---------------------------------------------------------------------------------

    def begin_step(self) -> bool:
        """Whether this decode step is traced (--trace-sample-rate); all layers or none."""
        rate = self.cfg.sample_rate
        self.step_on = rate >= 1.0 or bool(self.sample_rng.random() < rate)
        return self.step_on

    def record(
        self,
        request: int,
        layer: int,
        start_pos: int,
        positions: np.ndarray,
        scores: np.ndarray,
        layer_us: int,
    ) -> None:
        cfg = self.cfg
        if cfg.inject == "stale_topk" and self.step_requests.get(request, 0) >= 1:
            positions, scores = self.previous.get((request, layer), (positions, scores))
        self.previous[(request, layer)] = (positions, scores)
        second_step = self.step_requests.get(request, 0) == 1
        if cfg.inject == "drop_layer" and request == 0 and layer == 1 and second_step:
            return
        rec = build_record(cfg, request, layer, start_pos, positions, scores, self.prefix[request])
        if cfg.inject == "latency_per_layer":
            rec["kv_fetch"]["hbm"]["latency_us"] = layer_us
        self.pending.append((request, rec))

    def end_step(self, latency_us: int, requests: list[int]) -> None:
        out: dict[int, list[bytes]] = {}
        for request, rec in self.pending:
            if self.cfg.inject != "latency_per_layer":
                rec["kv_fetch"]["hbm"]["latency_us"] = latency_us
            index = self.shard_of(request)
            later = self.step_requests.get(request, 0) >= 1
            if self.cfg.inject == "split_request" and request == 0 and later:
                index += 1  # the writer rotated by record count, mid-request
            self._count(rec)
            out.setdefault(index, []).append(dumps(rec) + b"\n")
        for index, lines in out.items():
            shard = self._shard(index)
            data = b"".join(lines)
            shard.fh.write(data)
            shard.records += len(lines)
            shard.size += len(data)
        self.pending.clear()
        for request in requests:
            self.step_requests[request] = self.step_requests.get(request, 0) + 1

    def _count(self, rec: dict[str, Any]) -> None:
        s = self.summary
        s.records += 1
        s.unique_blocks[rec["unique_blocks"]] += 1
        pos = np.asarray(rec["selected_token_pos"], dtype=np.int64)
        counts = np.bincount(pos // self.cfg.block_size)
        for value, n in zip(*np.unique(counts[counts > 0], return_counts=True), strict=True):
            s.tpb[int(value)] += int(n)
        offsets = (rec["seq_len_current"] - 1) - pos
        for value, n in zip(*np.unique(offsets, return_counts=True), strict=True):
            s.offsets[int(value)] += int(n)
        s.offsets_sum += int(offsets.sum())
        inter = rec["prefix"]["intersection_blocks"]
        s.ratios[(len(inter), rec["unique_blocks"])] += 1
        hot = s.hot.setdefault(rec["layer_id"], Counter())
        hot.update(inter)

    # -- the end ---------------------------------------------------------------------------------

    def close(self, extra: dict[str, Any]) -> dict[str, Any]:
        for shard in list(self.shards.values()):
            shard.fh.close()
            self.done_shards.append(shard)
        self.shards.clear()
        summary = self.build_summary(extra)
        write_json_atomic(self.cfg.block_dir / "summary.json", summary)
        return summary

    def build_summary(self, extra: dict[str, Any]) -> dict[str, Any]:
        cfg, s = self.cfg, self.summary
        ratios: Counter[float] = Counter()
        ratio_sum = 0.0
        for (a, b), n in sorted(s.ratios.items()):
            ratios[a / b] += n
            ratio_sum += n * (a / b)
        shards = sorted(self.done_shards, key=lambda x: x.start)
        return {
            "run_name": cfg.run_name,
            "dataset": cfg.dataset,
            "config": {
                "kv_block_size_tokens": cfg.block_size,
                "index_topk": cfg.topk,
                "n_layers": cfg.layers,
                "requests": cfg.n_requests,
                "max_requests_per_file": cfg.max_requests_per_file,
                "trace_sample_rate": cfg.sample_rate,
                "trace_store_scores": cfg.store_scores,
                "trace_prefix_key_tokens": cfg.prefix_key_tokens,
                "kv_bytes_per_token": cfg.bytes_per_token,
                "world_size": cfg.world_size,
                "inject": cfg.inject,
                **extra.pop("config", {}),
            },
            "records": s.records,
            "unique_blocks": stats(
                dict(s.unique_blocks), sum(k * v for k, v in s.unique_blocks.items())
            ),
            "tokens_per_touched_block": stats(dict(s.tpb), sum(k * v for k, v in s.tpb.items())),
            "offsets": stats(dict(s.offsets), s.offsets_sum),
            "prefix_intersection_ratio": stats(dict(ratios), ratio_sum),
            "prefix_hot_blocks": {
                str(layer): [
                    {"block_id": b, "touch_count": n}
                    for b, n in sorted(c.items(), key=lambda t: (-t[1], t[0]))[:HOT_BLOCKS]
                ]
                for layer, c in sorted(s.hot.items())
            },
            "shards": [
                {
                    "file": x.name,
                    "requests": [x.start, x.end],
                    "records": x.records,
                    "bytes": x.size,
                }
                for x in shards
            ],
            **extra,
        }


def build_record(
    cfg: TraceConfig,
    request: int,
    layer: int,
    start_pos: int,
    positions: np.ndarray,
    scores: np.ndarray,
    prefix: PrefixInfo,
) -> dict[str, Any]:
    """One dsa_topk record (seed 5.2, plus 3.2's total_blocks_in_use and touched_block_ratio)."""
    bs = cfg.block_size
    end = start_pos + 1
    pos = positions.astype(np.int64)
    offsets = (end - 1) - pos
    blocks, counts = np.unique(pos // bs, return_counts=True)
    if cfg.inject == "block_off_by_one":
        blocks = blocks + 1
    block_list = blocks.tolist()
    total_blocks = -(-end // bs)
    inter = [b for b in block_list if b < prefix.cached_blocks]
    n_blocks = len(block_list)
    pool = {"hit_blocks": [], "bytes_read": 0, "read_ops": 0, "latency_us": None, "batch_size": 0}
    sc = scores.astype(np.float64)
    rec: dict[str, Any] = {
        "event": "dsa_topk",
        "run_name": cfg.run_name,
        "dataset": cfg.dataset,
        "rank": cfg.rank,
        "world_size": cfg.world_size,
        "request_id": request,
        "layer_id": layer,
        "step_idx": start_pos,
        "seq_len_current": end,
        "unique_token_pos_count": int(len(np.unique(pos))),
        "offset_min": int(offsets.min()),
        "offset_p50": float(np.percentile(offsets, 50)),
        "offset_max": int(offsets.max()),
        "block_size_tokens": bs,
        "selected_block_ids": block_list,
        "unique_blocks": n_blocks,
        "total_blocks_in_use": total_blocks,
        "touched_block_ratio": n_blocks / total_blocks,
        "tokens_per_touched_block": {
            "mean": len(pos) / n_blocks,
            "p50": float(np.percentile(counts, 50)),
            "p95": float(np.percentile(counts, 95)),
        },
        "kv_fetch": {
            "hbm": {
                "hit_blocks": block_list,
                "bytes_read": n_blocks * bs * cfg.bytes_per_token,
                "read_ops": 1,
                "latency_us": 0,
                "batch_size": n_blocks,
            },
            "local_pool": dict(pool),
            "remote_pool": dict(pool),
        },
        "prefix": {
            "prefix_cache_hit": prefix.hit,
            "prefix_cached_blocks": prefix.cached_blocks,
            "prefix_key": prefix.key,
            "intersection_ratio": len(inter) / n_blocks,
            "intersection_blocks": inter,
        },
        "selected_token_pos": pos.tolist(),
        "scores_stats": {"min": float(sc.min()), "mean": float(sc.mean()), "max": float(sc.max())},
    }
    if cfg.store_scores:
        rec["scores_topk"] = sc.tolist()
    return rec


def kv_bytes_per_token() -> int:
    """DS_TRACE_KV_BYTES_PER_TOKEN (0 when unset), for kv_fetch.hbm.bytes_read."""
    raw = os.environ.get("DS_TRACE_KV_BYTES_PER_TOKEN", "").strip()
    if not raw:
        return 0
    value = int(raw)
    if value < 0:
        raise ValueError("DS_TRACE_KV_BYTES_PER_TOKEN must be >= 0")
    return value
