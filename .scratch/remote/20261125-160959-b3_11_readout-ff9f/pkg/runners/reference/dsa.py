"""DeepSeek DSA top-k traces (seed 004): a small DSA model writes dsa_topk JSONL shards.

The generation loop is the demo's (generate.py): one prefill of tokens[:, 0:min_prompt] for the
batch, then one decode forward per position; a row whose prompt is longer keeps its prompt
token at that position. Each decode forward is one step: every layer's top-k selection of every
active request is a record, written when the step ends with latency_us = the step's wall time.
BurstGPT replays arrivals on a virtual clock: requests queue FIFO, a batch of up to
--batch-size starts when the engine is free, and the clock advances by each batch's measured
compute time (no sleeping), so latency = end of the request's batch - its arrival.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from runners.reference.dsa_model import DSAConfig, DSAModel, sample
from runners.reference.dsa_trace import (
    INJECTIONS,
    PrefixCacheAnalyzer,
    TraceConfig,
    Tracer,
    kv_bytes_per_token,
    percentile,
)
from runners.reference.dsa_workloads import EOS, RULER_TASKS, Request, WorkloadError, load
from runners.reference.runtime import Progress, UsageError, setup_torch
from runners.reference.tracefile import dumps


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DSAConfig()
    m = p.add_argument_group("model (seeded weights; production DSA is 61 layers, top-2048)")
    for name in ("vocab", "dim", "layers", "heads", "head_dim", "q_lora_rank", "index_heads"):
        m.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("index_head_dim", "rope_head_dim", "index_topk", "inter_dim", "max_seq_len"):
        m.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    m.add_argument("--model-seed", type=int, default=0)
    m.add_argument("--device", default="cpu")
    w = p.add_argument_group("workload (seed section 6)")
    w.add_argument(
        "--workload", default="ruler", choices=("ruler", "sharegpt", "longbench", "burstgpt")
    )
    w.add_argument("--ruler-tasks", default=",".join(RULER_TASKS))
    w.add_argument("--ruler-length", type=int, default=4096, help="tokens per synthetic sample")
    w.add_argument("--ruler-jsonl", default="", help="a local RULER .jsonl instead")
    w.add_argument("--sharegpt-json", default="")
    w.add_argument("--sharegpt-turn-mode", default="full", choices=("full", "per_user_turn"))
    w.add_argument("--longbench-json", default="")
    w.add_argument("--burstgpt-csv", default="")
    w.add_argument("--time-scale", type=float, default=1.0, help="BurstGPT: arrival time factor")
    w.add_argument("--limit", type=int, default=64)
    w.add_argument("--max-new-tokens", type=int, default=64, help="0 = until EOS or max length")
    w.add_argument("--max-prompt-tokens", type=int, default=16384)
    w.add_argument("--batch-size", type=int, default=1)
    w.add_argument("--temperature", type=float, default=0.6, help="0 = greedy, reproducible")
    w.add_argument("--seed", type=int, default=0)
    t = p.add_argument_group("tracing (seed sections 3 and 5)")
    t.add_argument("--trace-enable", action="store_true")
    t.add_argument("--trace-out", default="")
    t.add_argument("--run-name", default="")
    t.add_argument("--trace-sample-rate", type=float, default=1.0)
    t.add_argument("--trace-store-scores", action="store_true")
    t.add_argument("--trace-prefix-key-tokens", type=int, default=256)
    t.add_argument("--kv-block-size", type=int, default=64)
    t.add_argument("--max-requests-per-file", type=int, default=10, help="0 = one file")
    t.add_argument("--trace-no-sync-cuda", action="store_true")
    t.add_argument("--inject", default="none", choices=INJECTIONS, help="a trace bug canary")


def _check(args: argparse.Namespace, cfg: DSAConfig) -> None:
    problems = cfg.problems()
    if not args.trace_enable or not args.trace_out:
        problems.append("give --trace-enable and --trace-out DIR (this command only traces)")
    if args.kv_block_size < 1:
        problems.append(f"--kv-block-size must be >= 1, got {args.kv_block_size}")
    if not 0.0 < args.trace_sample_rate <= 1.0:
        problems.append(f"--trace-sample-rate must be in (0, 1], got {args.trace_sample_rate}")
    for name in ("limit", "batch_size", "trace_prefix_key_tokens", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_new_tokens < 0 or args.max_requests_per_file < 0:
        problems.append("--max-new-tokens and --max-requests-per-file must be >= 0")
    if problems:
        raise UsageError("; ".join(problems))


def run(args: argparse.Namespace) -> None:
    cfg = DSAConfig(
        **{k: getattr(args, k) for k in DSAConfig.__dataclass_fields__ if k != "rope_theta"}
    )
    _check(args, cfg)
    say = Progress(f"dsa {args.workload}")
    try:
        workload = load(args, cfg.vocab)
        bytes_per_token = kv_bytes_per_token()
    except (WorkloadError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    for note in workload.notes:
        say(note)
    requests = workload.requests
    longest = max((len(r.prompt) for r in requests), default=1)
    if longest >= cfg.max_seq_len:
        raise UsageError(f"a prompt of {longest} tokens leaves no room under --max-seq-len")
    device = setup_torch(args.device)
    torch.manual_seed(args.seed)
    limits = [r.max_new_tokens or args.max_new_tokens for r in requests]
    capacity = 0 if min(limits, default=1) <= 0 else longest + max(limits, default=1)
    model = DSAModel(cfg, args.model_seed, args.device, args.batch_size, capacity)
    out = Path(args.trace_out)
    tcfg = TraceConfig(
        out=out,
        run_name=args.run_name or out.name,
        dataset=workload.dataset,
        block_size=args.kv_block_size,
        sample_rate=args.trace_sample_rate,
        store_scores=args.trace_store_scores,
        prefix_key_tokens=args.trace_prefix_key_tokens,
        max_requests_per_file=args.max_requests_per_file,
        n_requests=len(requests),
        topk=cfg.index_topk,
        layers=cfg.layers,
        inject=args.inject,
        bytes_per_token=bytes_per_token,
    )
    tracer = Tracer(tcfg, rng_seed=args.seed)
    say(f"{len(requests)} requests on {device}; model {cfg.layers} layers, top-{cfg.index_topk}")
    prefix = PrefixCacheAnalyzer(args.trace_prefix_key_tokens, args.kv_block_size)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    sync = args.device.startswith("cuda") and not args.trace_no_sync_cuda
    served: list[dict[str, Any]] = []
    serving = _ServingLog(tcfg.block_dir / "serving.jsonl") if args.workload == "burstgpt" else None
    clock = 0.0
    queue = list(enumerate(requests))
    scale = args.time_scale
    while queue:
        clock = max(clock, queue[0][1].arrival_s * scale)
        batch = [q for q in queue[: args.batch_size] if q[1].arrival_s * scale <= clock]
        queue = queue[len(batch) :]
        for rid, req in batch:
            tracer.open_request(rid, prefix.request(req.prompt))
        took = generate(model, batch, args, tracer, gen, sync)
        clock += took
        for rid, req in batch:
            tracer.close_request(rid)
            served.append(_served(rid, req, scale, clock))
            if serving is not None:
                serving.write(served[-1])
        say(f"requests {batch[0][0]}..{batch[-1][0]} done ({tracer.summary.records} records)")
    extra: dict[str, Any] = {"config": {"model": cfg.as_dict(), "workload": args.workload}}
    extra["skipped"] = workload.skipped
    if args.workload == "burstgpt":
        extra["serving"] = _serving(served, args)
    summary = tracer.close(extra)
    say(
        f"wrote {summary['records']} records in {len(summary['shards'])} shards to {tcfg.block_dir}"
    )


def generate(
    model: DSAModel,
    batch: list[tuple[int, Request]],
    args: argparse.Namespace,
    tracer: Tracer,
    gen: torch.Generator,
    sync: bool,
) -> float:
    """Generate for one batch as the demo's generate() does; returns its wall time in seconds."""
    t_start = time.perf_counter()
    prompts = [r.prompt for _, r in batch]
    limits = [r.max_new_tokens or args.max_new_tokens for _, r in batch]
    lens = [len(p) for p in prompts]
    max_len = model.cfg.max_seq_len
    total = max_len if min(limits) <= 0 else min(max_len, max(limits) + max(lens))
    tokens = torch.full((len(batch), total), -1, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, dtype=torch.long)
    done = [False] * len(batch)
    made = [0] * len(batch)
    ids = [rid for rid, _ in batch]
    prev = 0
    for cur in range(min(lens), total):
        decode = cur - prev == 1
        active = [b for b in range(len(batch)) if not done[b]]
        traced = decode and tracer.begin_step()
        t0 = time.perf_counter()

        hook = _StepHook(tracer, [ids[b] for b in active], active, prev, t0)
        logits = model.forward(tokens[:, prev:cur], prev, hook if traced else None)
        if sync:
            torch.cuda.synchronize()
        step_us = int((time.perf_counter() - t0) * 1e6)
        if traced:
            tracer.end_step(step_us, [ids[b] for b in active])
        nxt = sample(logits, args.temperature, gen).cpu()
        for b in range(len(batch)):
            if cur < lens[b]:
                continue  # still inside this row's prompt
            tokens[b, cur] = int(nxt[b])
            if not done[b]:
                made[b] += 1
                if int(nxt[b]) == EOS or (limits[b] > 0 and made[b] >= limits[b]):
                    done[b] = True
        prev = cur
        if all(done):
            break
    return time.perf_counter() - t_start


def _served(rid: int, req: Request, scale: float, end: float) -> dict[str, Any]:
    arrival = req.arrival_s * scale
    return {
        "request_id": rid,
        "arrival_ms": round(arrival * 1e3, 3),
        "end_ms": round(end * 1e3, 3),
        "latency_ms": round((end - arrival) * 1e3, 3),
        "prompt_tokens": len(req.prompt),
    }


def _serving(served: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    lat: dict[float, int] = {}
    for s in served:
        lat[s["latency_ms"]] = lat.get(s["latency_ms"], 0) + 1
    pcts = {k: percentile(lat, q) for k, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}
    return {
        "requests": len(served),
        "latency_ms": {**pcts, "max": max(lat) if lat else None} if lat else {},
        "batch_size": args.batch_size,
        "max_new_tokens_cap": args.max_new_tokens,
        "time_scale": args.time_scale,
    }


class _StepHook:
    """Hands each layer's selection of the active rows to the tracer."""

    def __init__(
        self, tracer: Tracer, ids: list[int], rows: list[int], start: int, t0: float
    ) -> None:
        self.tracer, self.ids, self.rows, self.start, self.t0 = tracer, ids, rows, start, t0

    def __call__(self, layer: int, indices: torch.Tensor, values: torch.Tensor) -> None:
        layer_us = int((time.perf_counter() - self.t0) * 1e6)  # the latency_per_layer canary
        idx, val = indices.cpu().numpy(), values.cpu().numpy()
        for rid, b in zip(self.ids, self.rows, strict=True):
            self.tracer.record(rid, layer, self.start, idx[b], val[b], layer_us)


class _ServingLog:
    """serving.jsonl: one line per finished request, as it finishes (a reference-engine extra
    beside the seed's summary.serving, so the live view can show latency as it accumulates)."""

    def __init__(self, path: Path) -> None:
        self.fh = open(path, "ab", buffering=0)  # noqa: SIM115 - closed with the process

    def write(self, entry: dict[str, Any]) -> None:
        self.fh.write(dumps(entry) + b"\n")
