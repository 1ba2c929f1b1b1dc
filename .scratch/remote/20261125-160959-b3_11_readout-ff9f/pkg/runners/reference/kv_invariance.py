"""03C KV-cache invariance: one grid point's last-token attention output from every flow, as bytes.

One cell of the seed 002 grid (D, KV, B, GQA, mask, ALiBi, sinks) on synthetic Q/K/V seeded per
request (request r has the same tensors alone or inside a batch). Flows, each writing the one
KV cache its own way and calling the attention op (runners/reference/kv_attention.py) per step:

- ``single``: single-shot prefill of all P tokens;
- ``incremental``: one token per step;
- ``chunk8`` and ``chunk33``: chunked prefill, only when RUN_KVCACHE_CHUNK_TESTS=1 (the seed's gate);
- ``alone`` (B > 1): each request of the batch computed by itself (single-shot, B = 1).

P, the number of tokens, is KV - 19 with the mask on (the last token sees 19 -inf padded cells)
and KV with it off (without a mask a padded tail would be attended). The view is padded to a
multiple of 256 only in deterministic mode (GGML_DETERMINISTIC=1); otherwise it is the written
length, as legacy flows present it, and the op's precondition check refuses it.

Writes into --out: ``flows.bin`` (the last token's output [B, H, D] of each flow, raw
little-endian bytes, flow after flow) then ``result.json`` (shapes, dtype, flow order, sha256).
A precondition abort writes ``result.json`` with status PRECONDITION, the rule and the fix, prints
``KV_INVARIANCE_PRECONDITION {json}`` on stdout and the guidance on stderr, and exits 4.

Canaries (``--inject``): ``split_reduction`` (cached and current tokens reduced apart in every
step after the first), ``unpadded_kv`` (the view is the written length), ``mask_unpadded`` (the
mask has N rows, not PAD(N, 64)).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runners.atomic import write_atomic
from runners.reference.kv_attention import (
    FATTN_KQ_STRIDE,
    GGML_KQ_MASK_PAD,
    Q_TILE,
    PreconditionError,
    alibi_slopes,
    attend,
    build_mask,
    pad,
)
from runners.reference.runtime import UsageError, setup_torch

FORMAT = "tracedeck.kv_invariance/1"
EXIT_PRECONDITION = 4  # distinct from 1 (crash), 2 (usage) and 3 (device)
PRECONDITION_MARK = "KV_INVARIANCE_PRECONDITION"
MASK_TAIL = 19  # with the mask on, the last token sees this many -inf padded cells
CHUNKS = (8, 33)  # the seed's chunk sizes
CHUNK_GATE = "RUN_KVCACHE_CHUNK_TESTS"
DETERMINISTIC = "GGML_DETERMINISTIC"
INJECTIONS = ("none", "split_reduction", "unpadded_kv", "mask_unpadded")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass(frozen=True)
class Cell:
    d: int
    kv: int
    b: int
    gqa: int
    mask: int
    alibi: int
    sinks: int
    heads: int
    dtype: str
    seed: int
    inject: str
    device: str = "cpu"

    @property
    def kv_heads(self) -> int:
        return self.heads // self.gqa

    @property
    def positions(self) -> int:
        return self.kv - MASK_TAIL if self.mask else self.kv

    def point(self) -> dict[str, int]:
        return {
            "d": self.d,
            "kv": self.kv,
            "b": self.b,
            "gqa": self.gqa,
            "mask": self.mask,
            "alibi": self.alibi,
            "sinks": self.sinks,
        }

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.point().items())

    def check(self) -> None:
        for name in ("d", "kv", "b", "gqa", "heads"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("mask", "alibi", "sinks"):
            if getattr(self, name) not in (0, 1):
                raise UsageError(f"--{name} must be 0 or 1, got {getattr(self, name)}")
        if self.heads % self.gqa:
            raise UsageError(f"--heads {self.heads} is not a multiple of --gqa {self.gqa}")
        if self.mask and self.kv <= MASK_TAIL:
            raise UsageError(f"--kv {self.kv}: with the mask on it must exceed {MASK_TAIL}")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.inject not in INJECTIONS:
            raise UsageError(f"--inject {self.inject!r}: use one of {', '.join(INJECTIONS)}")


@dataclass(frozen=True)
class Data:
    q: torch.Tensor  # [B, H, P, D]
    k: torch.Tensor  # [B, Hkv, P, D]
    v: torch.Tensor
    sinks: torch.Tensor | None  # [H] float32
    slopes: torch.Tensor | None  # [H] float32

    def request(self, r: int) -> Data:
        return Data(
            self.q[r : r + 1], self.k[r : r + 1], self.v[r : r + 1], self.sinks, self.slopes
        )


def make_data(cell: Cell) -> Data:
    """Seeded per request (on the CPU, then moved), so request r is the same tensors whatever
    the batch around it and whatever the device."""
    dtype, device = DTYPES[cell.dtype], torch.device(cell.device)
    qs, ks, vs = [], [], []
    for r in range(cell.b):
        gen = torch.Generator().manual_seed(cell.seed * 10_007 + r)
        qs.append(torch.randn(cell.heads, cell.positions, cell.d, generator=gen))
        ks.append(torch.randn(cell.kv_heads, cell.positions, cell.d, generator=gen))
        vs.append(torch.randn(cell.kv_heads, cell.positions, cell.d, generator=gen))
    sinks = None
    if cell.sinks:
        gen = torch.Generator().manual_seed(cell.seed * 10_007 + 10_006)
        sinks = torch.randn(cell.heads, generator=gen).to(device)
    return Data(
        torch.stack(qs).to(device=device, dtype=dtype),
        torch.stack(ks).to(device=device, dtype=dtype),
        torch.stack(vs).to(device=device, dtype=dtype),
        sinks,
        alibi_slopes(cell.heads).to(device) if cell.alibi else None,
    )


@dataclass(frozen=True)
class Policy:
    pad_kv: bool  # present pad(written, 256) (deterministic mode), else the written length
    pad_mask: bool  # mask rows PAD(N, 64), else N
    split: bool  # reduce cached and current tokens apart (the canary)
    tile: int = Q_TILE  # query rows per GEMM (0: every step's rows in one GEMM)


def run_flow(cell: Cell, data: Data, chunk: int, policy: Policy, name: str) -> torch.Tensor:
    """Write the cache `chunk` tokens per step, attend each step; the last token's [B, H, D]."""
    batch = data.q.shape[0]
    positions = cell.positions
    shape = (batch, cell.kv_heads, cell.kv, cell.d)
    cache_k = torch.zeros(shape, dtype=data.k.dtype, device=data.k.device)
    cache_v = torch.zeros(shape, dtype=data.v.dtype, device=data.v.device)
    start, last = 0, None
    while start < positions:
        end = min(positions, start + chunk)
        cache_k[:, :, start:end] = data.k[:, :, start:end]
        cache_v[:, :, start:end] = data.v[:, :, start:end]
        # never more than the cache holds: a cache that is no multiple of 256 cannot be padded
        view = min(pad(end, FATTN_KQ_STRIDE), cell.kv) if policy.pad_kv else end
        n_rows = end - start
        mask = None
        if cell.mask:
            rows = pad(n_rows, GGML_KQ_MASK_PAD) if policy.pad_mask else n_rows
            mask = build_mask(n_rows, view, start, end, rows, data.q.device)
        try:
            last = attend(
                data.q[:, :, start:end],
                cache_k[:, :, :view],
                cache_v[:, :, :view],
                start=start,
                mask=mask,
                slopes=data.slopes,
                sinks=data.sinks,
                split_at=start if policy.split else 0,
                tile=policy.tile,
            )
        except PreconditionError as exc:
            exc.where = f"flow {name}, step at positions {start}..{end - 1} (view {view})"
            raise
        start = end
    assert last is not None
    return last[:, :, -1].contiguous()


def flow_plan(cell: Cell, chunk_tests: bool) -> list[tuple[str, int]]:
    plan = [("single", cell.positions), ("incremental", 1)]
    if chunk_tests:
        plan += [(f"chunk{c}", c) for c in CHUNKS]
    return plan


def as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().view(INT_VIEW[t.dtype]).numpy().tobytes()


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, allow_nan=False) + "\n"


def run_cell(cell: Cell, out: Path, device_desc: str) -> dict[str, Any]:
    cell.check()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("result.json", "flows.bin"):
        (out / stale).unlink(missing_ok=True)
    deterministic = os.environ.get(DETERMINISTIC, "") == "1"
    chunk_tests = os.environ.get(CHUNK_GATE, "") == "1"
    policy = Policy(
        pad_kv=deterministic and cell.inject != "unpadded_kv",
        pad_mask=cell.inject != "mask_unpadded",
        split=cell.inject == "split_reduction",
    )
    base: dict[str, Any] = {
        "format": FORMAT,
        "point": cell.point(),
        "positions": cell.positions,
        "heads": cell.heads,
        "kv_heads": cell.kv_heads,
        "dtype": DTYPE_NAMES[cell.dtype],
        "seed": cell.seed,
        "inject": cell.inject,
        "deterministic": deterministic,
        "chunk_tests": chunk_tests,
        "policy": {
            "kv_stride": FATTN_KQ_STRIDE,
            "mask_pad": GGML_KQ_MASK_PAD,
            "q_tile": Q_TILE,
            "pad_kv": policy.pad_kv,
            "pad_mask": policy.pad_mask,
            "split_reduction": policy.split,
        },
        "engine": "runners.reference kv_invariance",
        "torch_version": torch.__version__,
        "device": device_desc,
    }
    print(
        f"kv_invariance {cell.label()}: P={cell.positions} H={cell.heads} Hkv={cell.kv_heads} "
        f"dtype={cell.dtype} deterministic={int(deterministic)} chunks={int(chunk_tests)} "
        f"inject={cell.inject} on {device_desc}",
        flush=True,
    )
    t0 = time.perf_counter()
    data = make_data(cell)
    flows: dict[str, torch.Tensor] = {}
    timings: dict[str, float] = {}
    try:
        with torch.inference_mode():
            for name, chunk in flow_plan(cell, chunk_tests):
                t = time.perf_counter()
                flows[name] = run_flow(cell, data, chunk, policy, name)
                timings[name] = round(time.perf_counter() - t, 3)
                print(f"  {name}: {timings[name]:.2f}s", flush=True)
            if cell.b > 1:
                t = time.perf_counter()
                alone = [
                    run_flow(cell, data.request(r), cell.positions, policy, "alone")
                    for r in range(cell.b)
                ]
                flows["alone"] = torch.cat(alone, dim=0)
                timings["alone"] = round(time.perf_counter() - t, 3)
                print(f"  alone: {timings['alone']:.2f}s", flush=True)
    except PreconditionError as exc:
        return precondition(out, base, exc)
    payload = b"".join(as_bytes(flows[name]) for name in flows)
    write_atomic(out / "flows.bin", payload)
    result = {
        **base,
        "status": "DONE",
        "shape": [cell.b, cell.heads, cell.d],
        "byte_order": sys.byteorder,
        "flows": list(flows),
        "reference": "single",
        "flow_bytes": len(payload) // len(flows),
        "flows_sha256": hashlib.sha256(payload).hexdigest(),
        "timings_s": timings,
        "elapsed_s": round(time.perf_counter() - t0, 3),
    }
    write_atomic(out / "result.json", _json(result))
    print(f"  wrote {len(flows)} flows ({len(payload)} bytes) -> {out}", flush=True)
    return result


def precondition(out: Path, base: dict[str, Any], exc: PreconditionError) -> dict[str, Any]:
    record = {"rule": exc.rule, "message": exc.message, "fix": exc.fix, "where": exc.where}
    result = {**base, "status": "PRECONDITION", **record}
    write_atomic(out / "result.json", _json(result))
    print(f"{PRECONDITION_MARK} {json.dumps(record, allow_nan=False)}", flush=True)
    print(
        f"PRECONDITION VIOLATED ({exc.rule}) in {exc.where}: {exc.message}\n  fix: {exc.fix}",
        file=sys.stderr,
        flush=True,
    )
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d", type=int, required=True, help="head dimension D")
    p.add_argument(
        "--kv", type=int, required=True, help="KV length (cache cells) at the last token"
    )
    p.add_argument("--b", type=int, default=1, help="batch: requests computed together")
    p.add_argument("--gqa", type=int, default=1, help="query heads per KV head")
    p.add_argument("--mask", type=int, default=1, choices=(0, 1))
    p.add_argument("--alibi", type=int, default=0, choices=(0, 1))
    p.add_argument("--sinks", type=int, default=0, choices=(0, 1))
    p.add_argument("--heads", type=int, default=4, help="query heads H")
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic Q/K/V")
    p.add_argument("--inject", default="none", choices=INJECTIONS)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (ROCm torch reports cuda)")
    p.add_argument("--out", type=Path, required=True, help="directory for result.json, flows.bin")


def run(args: argparse.Namespace) -> None:
    cell = Cell(
        d=args.d,
        kv=args.kv,
        b=args.b,
        gqa=args.gqa,
        mask=args.mask,
        alibi=args.alibi,
        sinks=args.sinks,
        heads=args.heads,
        dtype=args.dtype,
        seed=args.seed,
        inject=args.inject,
        device=args.device,
    )
    cell.check()
    result = run_cell(cell, args.out, setup_torch(args.device))
    if result["status"] == "PRECONDITION":
        raise SystemExit(EXIT_PRECONDITION)
