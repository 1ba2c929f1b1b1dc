"""A plain-Python writer of seed 004 section 5 trace directories (no torch, no numpy): test data.

It writes what the demo's trace.py would: dsa_topk records (5.2) sharded by request count
(5.1), and summary.json (5.3), computing every statistic its own way (nearest-rank
percentiles, values rounded like the seed's examples), so `tracedeck analyze` is checked
against an independent writer, not against the reference engine.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def record(
    request: int,
    layer: int,
    step: int,
    topk: int,
    bs: int,
    prefix_tokens: int,
    hit: bool,
    rng: random.Random,
    latency: int,
    key: str,
    compact: bool = False,
    pcb: int | None = None,
) -> dict[str, Any]:
    seq = step + 1
    pos = rng.sample(range(seq), min(topk, seq))
    offsets = [(seq - 1) - p for p in pos]
    per_block: dict[int, int] = {}
    for p in pos:
        per_block[p // bs] = per_block.get(p // bs, 0) + 1
    blocks = sorted(per_block)
    counts = list(per_block.values())
    pcb = -(-prefix_tokens // bs) if pcb is None else pcb
    inter = [b for b in blocks if b < pcb]
    total = -(-seq // bs)
    scores = [rng.uniform(-5, 2) for _ in pos]
    rec: dict[str, Any] = {
        "event": "dsa_topk",
        "run_name": "ruler_1771772829",
        "dataset": "ruler",
        "rank": 0,
        "world_size": 8,
        "request_id": request,
        "layer_id": layer,
        "step_idx": step,
        "seq_len_current": seq,
        "unique_token_pos_count": len(pos),
        "offset_min": min(offsets),
        "offset_p50": nearest_rank(offsets, 0.5),
        "offset_max": max(offsets),
        "block_size_tokens": bs,
        "selected_block_ids": blocks,
        "unique_blocks": len(blocks),
        "total_blocks_in_use": total,
        "touched_block_ratio": round(len(blocks) / total, 3),
        "tokens_per_touched_block": {
            "mean": round(len(pos) / len(blocks), 2),
            "p50": nearest_rank(counts, 0.5),
            "p95": nearest_rank(counts, 0.95),
        },
        "kv_fetch": {
            "hbm": {
                "hit_blocks": blocks,
                "bytes_read": len(blocks) * bs * 1152,
                "read_ops": 1,
                "latency_us": latency,
                "batch_size": len(blocks),
            },
            "local_pool": {
                "hit_blocks": [],
                "bytes_read": 0,
                "read_ops": 0,
                "latency_us": None,
                "batch_size": 0,
            },
            "remote_pool": {
                "hit_blocks": [],
                "bytes_read": 0,
                "read_ops": 0,
                "latency_us": None,
                "batch_size": 0,
            },
        },
        "prefix": {
            "prefix_cache_hit": hit,
            "prefix_cached_blocks": pcb,
            "prefix_key": key,
            "intersection_ratio": round(len(inter) / len(blocks), 3),
            "intersection_blocks": inter,
        },
        "selected_token_pos": pos,
        "scores_stats": {
            "min": min(scores),
            "mean": sum(scores) / len(scores),
            "max": max(scores),
        },
    }
    if compact:  # the 5.2 example's key set: no total_blocks_in_use, no touched_block_ratio
        del rec["total_blocks_in_use"], rec["touched_block_ratio"]
    return rec


_MADE: dict[str, Path] = {}  # what write_trace wrote, by its arguments: made once a process


def write_trace(root: Path, **kw: Any) -> Path:
    """Write <root>/block<bs>/ with shards and summary.json (see _write_trace); returns the block
    directory. The same arguments make the same files (the records come from a seeded random),
    so a second call copies the first's, which a big trace's tests made again and again."""
    key = json.dumps(kw, sort_keys=True)
    made = _MADE.get(key)
    if made is None or not made.is_dir():
        made = _write_trace(Path(tempfile.mkdtemp(prefix="dsa-writer-")), **kw)
        _MADE[key] = made
    folder = root / made.name
    shutil.copytree(made, folder, dirs_exist_ok=True, copy_function=shutil.copyfile)  # (new mtimes)
    return folder


def _write_trace(
    root: Path,
    *,
    requests: int = 5,
    per_file: int = 2,
    layers: int = 3,
    steps: int = 3,
    prompt: int = 40,
    topk: int = 32,
    bs: int = 16,
    prefix_tokens: int = 24,
    seed: int = 0,
    compact: bool = False,
    pcb: dict[int, int] | None = None,
    names: dict[str, str] | None = None,
) -> Path:
    """Write <root>/block<bs>/ with shards and summary.json; returns the block directory.

    pcb: prefix_cached_blocks claimed by some requests (everything else made to agree with
    it); names: shards written under another name (a lying writer, for mutations)."""
    rng = random.Random(seed)
    folder = root / f"block{bs}"
    folder.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    all_recs: list[dict[str, Any]] = []
    for start in range(0, requests, per_file):
        end = min(requests, start + per_file)
        lines = []
        for request in range(start, end):
            # requests 0 and 1 share a prefix: request 1 is a hit
            key = hashlib.sha1(f"prefix-{0 if request < 2 else request}".encode()).hexdigest()
            hit = key in seen
            seen.add(key)
            for s in range(steps):
                step = prompt + request + s
                latency = rng.randrange(1000, 9000)
                for layer in range(layers):
                    rec = record(
                        request,
                        layer,
                        step,
                        topk,
                        bs,
                        prefix_tokens,
                        hit,
                        rng,
                        latency,
                        key,
                        compact,
                        (pcb or {}).get(request),
                    )
                    all_recs.append(rec)
                    lines.append(json.dumps(rec))  # the demo's json.dumps: ", " and ": "
        name = f"trace_steps_{start}_{end}.jsonl"
        (folder / (names or {}).get(name, name)).write_text("\n".join(lines) + "\n")
    (folder / "summary.json").write_text(
        json.dumps(summary(all_recs, bs, requests, topk, layers), indent=2)
    )
    return folder


def summary(
    recs: list[dict[str, Any]], bs: int, requests: int, topk: int, layers: int
) -> dict[str, Any]:
    """summary.json 5.3, computed the plain way (numpy-style linear percentiles)."""

    def stats(values: list[float]) -> dict[str, Any]:
        v = sorted(values)
        n = len(v)

        def pct(q: float) -> float:
            r = q * (n - 1)
            lo, hi = math.floor(r), math.ceil(r)
            return float(v[lo] + (v[hi] - v[lo]) * (r - lo))

        return {
            "count": n,
            "min": v[0],
            "p50": pct(0.5),
            "p95": pct(0.95),
            "max": v[-1],
            "mean": sum(v) / n,
        }

    ub = [r["unique_blocks"] for r in recs]
    tpb: list[int] = []
    offs: list[int] = []
    ratios = []
    hot: dict[str, dict[int, int]] = {}
    for r in recs:
        per: dict[int, int] = {}
        for p in r["selected_token_pos"]:
            per[p // bs] = per.get(p // bs, 0) + 1
            offs.append(r["seq_len_current"] - 1 - p)
        tpb += per.values()
        ratios.append(len(r["prefix"]["intersection_blocks"]) / r["unique_blocks"])
        layer = hot.setdefault(str(r["layer_id"]), {})
        for b in r["prefix"]["intersection_blocks"]:
            layer[b] = layer.get(b, 0) + 1
    return {
        "run_name": "ruler_1771772829",
        "dataset": "ruler",
        "config": {
            "kv_block_size_tokens": bs,
            "index_topk": topk,
            "n_layers": layers,
            "requests": requests,
        },
        "unique_blocks": stats(ub),
        "tokens_per_touched_block": stats(tpb),
        "offsets": stats(offs),
        "prefix_intersection_ratio": stats(ratios),
        "prefix_hot_blocks": {
            layer: [
                {"block_id": b, "touch_count": n}
                for b, n in sorted(c.items(), key=lambda t: (-t[1], t[0]))[:16]
            ]
            for layer, c in sorted(hot.items())
        },
    }
