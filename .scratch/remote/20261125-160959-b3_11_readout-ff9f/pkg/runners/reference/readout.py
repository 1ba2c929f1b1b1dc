"""B3.11/B3.12: append the readout-consistency trace of one prompt, one JSON line per readout.

Each prompt is one request on buffers laid out like greta_infer's: a hidden arena
[capacity, d_model], the final-RMSNorm output arena of the same shape, and a logits arena
[capacity, vocab] float32 (prefill fills one row per token; decode's LM head writes at the logical
slot ``tokens_total - 1``, the B3.11 fix). Arenas are zeroed when allocated and have fake, stable
addresses, as a caching allocator hands back the same block.

1. prefill all P tokens and read row P-1: the ``prefill_last`` line (step 0, tokens_total P);
2. decode greedily, as in seed 003's MI300X lines: step 1 reads the token prefill picked at
   position P (tokens_total P + 1), and so on for ``gen_len`` steps, one ``decode`` line each.
   Decode's hidden buffer is single-token: the step's hidden goes to physical row 0.

The model's LM head is tied to a strong embedding (``copy_head``), so a correctly read-out
position predicts the token it read: decode0_top1 == prefill_last_top1 for a correct engine.

Injected bugs (decode lines only):
- ``b3_11``: the sampler reads logits at offset 0 (slot 0, a stale prefill row) instead of the
  logical slot: top-1 collapses to one id and stays there.
- ``b3_12``: the single-token hidden buffer is read at the logical index ``tokens_total - 1``
  (a row this request never wrote) instead of physical row 0: ``readout_mismatch`` is true and
  top-1 is misplaced.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runners.reference.config import KV_PAD, ModelConfig, add_model_flags, model_config, pad_to
from runners.reference.model import AttnPlan, KVCache, Model
from runners.reference.model import prompt_ids as make_prompt
from runners.reference.runtime import Progress, UsageError, build_model, checkpoints, setup_torch
from runners.reference.tracefile import TraceAppender

INJECTIONS = ("none", "b3_11", "b3_12")
_MIB2 = 2 << 20
LOGITS_BASE = 0x7F2E_0000_0000  # fake device addresses: stable, page aligned, non-overlapping


def _align(n: int) -> int:
    return -(-n // _MIB2) * _MIB2


@dataclass(frozen=True)
class ReadoutRun:
    prompt_name: str
    prompt_len: int
    gen_len: int
    seed: int
    dtype: str
    inject: str
    trace_out: Path
    model_seed: int
    cfg: ModelConfig
    kv_aligned: int = 1

    def check(self) -> None:
        if self.inject not in INJECTIONS:
            raise UsageError(f"--inject {self.inject!r}: use one of {', '.join(INJECTIONS)}")
        if self.prompt_len < 2:
            raise UsageError(
                f"--prompt-len must be >= 2 (decode step 0 re-reads token P-1 after a prefill "
                f"of P-1 tokens), got {self.prompt_len}"
            )
        if self.gen_len < 1:
            raise UsageError(f"--gen-len must be >= 1, got {self.gen_len}")
        if not self.prompt_name or any(c.isspace() for c in self.prompt_name):
            raise UsageError(f"--prompt-name {self.prompt_name!r}: give a name without spaces")


class Arenas:
    """The three readout buffers of one request, with their fake addresses."""

    def __init__(self, model: Model, capacity: int) -> None:
        d, vocab = model.cfg.d_model, model.cfg.vocab
        dev = model.device
        self.hidden = torch.zeros(capacity, d, dtype=model.dtype, device=dev)
        self.rms = torch.zeros(capacity, d, dtype=model.dtype, device=dev)
        self.logits = torch.zeros(capacity, vocab, dtype=torch.float32, device=dev)
        self.stride = d * self.hidden.element_size()
        self.alloc = capacity * self.stride
        self.logits_stride = vocab * 4
        self.logits_ptr = LOGITS_BASE
        self.rms_ptr = self.logits_ptr + _align(capacity * self.logits_stride) + _MIB2
        self.hidden_ptr = self.rms_ptr + _align(self.alloc) + _MIB2


def _hash(t: torch.Tensor) -> int:
    raw = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def _g(x: float) -> float:
    """Six significant digits, as the engine's %g prints."""
    return float(f"{x:.6g}")


def _stats(prefix: str, t: torch.Tensor) -> dict[str, Any]:
    f = t.detach().double().cpu()
    return {
        f"{prefix}_hash": _hash(t),
        f"{prefix}_min": _g(f.min().item()),
        f"{prefix}_max": _g(f.max().item()),
        f"{prefix}_mean": _g(f.mean().item()),
    }


def top2(row: np.ndarray) -> tuple[int, float, int, float]:
    """Top-1 and top-2 by (-score, index)."""
    first = int(np.argmax(row))
    rest = row.copy()
    rest[first] = -np.inf
    second = int(np.argmax(rest))
    return first, float(row[first]), second, float(row[second])


def _line(
    run: ReadoutRun,
    a: Arenas,
    *,
    phase: str,
    step: int,
    tokens_total: int,
    seq_len: int,
    hidden_index: int,
    logits_slot: int,
) -> dict[str, Any]:
    decode = phase == "decode"
    logical = tokens_total - 1
    hidden = a.hidden[hidden_index]
    rms = a.rms[hidden_index]
    logits = a.logits[logits_slot]
    row = logits.detach().cpu().numpy()
    t1, l1, t2, l2 = top2(row)
    # B3.12 semantics: a single-token buffer's only valid physical index is 0
    mismatch = hidden_index != 0 if decode else hidden_index != logical
    line: dict[str, Any] = {
        "phase": phase,
        "readout_buffer_kind": "single_token" if decode else "seq",
        "hidden_source_tag": "decode_hidden_single_token" if decode else "prefill_hidden_seq",
        "step": step,
        "tokens_total": tokens_total,
        "seq_len": seq_len,
        "pos_id": logical,
        "token_index": logical,
        "used_index": hidden_index,
        "logical_last_index": logical,
        "expected_last_index": logical,
        "hidden_token_index_used": hidden_index,
        "readout_mismatch": mismatch,
        "hidden_src_ptr": a.hidden_ptr,
        "hidden_alloc_bytes": a.alloc,
        "hidden_stride_bytes": a.stride,
        "hidden_offset_bytes": hidden_index * a.stride,
        **_stats("hidden", hidden),
        "rms_in_ptr": a.hidden_ptr,
        "rms_out_ptr": a.rms_ptr,
        "lm_in_ptr": a.rms_ptr,
        "rms_offset_bytes": hidden_index * a.stride,
        **_stats("rms", rms),
        "logits_offset_bytes": logits_slot * a.logits_stride,
        "logits_ptr": a.logits_ptr,
        "logits_hash": _hash(logits),
        "logits_min": _g(float(row.min())),
        "logits_max": _g(float(row.max())),
        "logits_mean": _g(float(row.astype(np.float64).mean())),
        "top1_id": t1,
        "top1_logit": _g(l1),
        "top2_id": t2,
        "top2_logit": _g(l2),
        "gap": _g(l1 - l2),
        "vocab": run.cfg.vocab,
        "prompt": run.prompt_name,
    }
    return line


def _prefill_into(model: Model, a: Arenas, cache: KVCache, ids: list[int], plan: AttnPlan) -> None:
    n = len(ids)
    hidden = model.forward(torch.tensor(ids, device=model.device), cache, plan)
    a.hidden[:n] = hidden
    a.rms[:n] = model.final_norm_rows(hidden)
    a.logits[:n] = model.lm_logits(a.rms[:n])


def run_readout(run: ReadoutRun, model: Model, device_desc: str) -> dict[str, int]:
    """Appends 1 + gen_len lines to run.trace_out; returns the two top-1 ids of the table."""
    run.check()
    log = Progress(f"readout {run.prompt_name}")
    p_len, cfg = run.prompt_len, run.cfg
    capacity = pad_to(p_len + run.gen_len + 1, KV_PAD)
    plan = AttnPlan(aligned=bool(run.kv_aligned))
    prompt = make_prompt(run.seed, p_len, cfg.vocab)
    log(
        f"start seed={run.seed} prompt_len={p_len} gen_len={run.gen_len} dtype={run.dtype} "
        f"vocab={cfg.vocab} "
        f"inject={run.inject} device={device_desc} -> {run.trace_out}"
    )
    trace = TraceAppender(run.trace_out)
    try:
        with torch.inference_mode():
            # request 1: the whole prompt, read at its last row
            a = Arenas(model, capacity)
            cache = KVCache(cfg, capacity, model.dtype, model.device)
            _prefill_into(model, a, cache, prompt, plan)
            first = _line(
                run,
                a,
                phase="prefill_last",
                step=0,
                tokens_total=p_len,
                seq_len=p_len,
                hidden_index=p_len - 1,
                logits_slot=p_len - 1,
            )
            trace.write(first)
            log(f"prefill_last top1={first['top1_id']}")

            # decode, as greta_infer does it (seed 003's lines): step 1 reads the token the
            # prefill picked at position P (tokens_total P + 1), each step the next one; the
            # hidden buffer is single-token, so the step's hidden is physical row 0.
            token = first["top1_id"]
            marks = checkpoints(run.gen_len)
            decode0 = -1
            for step in range(1, run.gen_len + 1):
                tokens_total = p_len + step
                logical = tokens_total - 1
                hidden = model.forward(torch.tensor([token], device=model.device), cache, plan)
                a.hidden[0] = hidden[0]
                idx = logical if run.inject == "b3_12" else 0
                a.rms[idx] = model.final_norm_rows(a.hidden[idx : idx + 1])[0]
                a.logits[logical] = model.lm_logits(a.rms[idx : idx + 1])[0]
                slot = 0 if run.inject == "b3_11" else logical
                line = _line(
                    run,
                    a,
                    phase="decode",
                    step=step,
                    tokens_total=tokens_total,
                    seq_len=1,
                    hidden_index=idx,
                    logits_slot=slot,
                )
                trace.write(line)
                token = line["top1_id"]
                if step == 1:
                    decode0 = token
                if step in marks:
                    log(f"decode steps done {step}/{run.gen_len}, last top1={token}")
    finally:
        trace.close()
    log(
        f"done in {log.elapsed():.1f}s: prefill_last_top1={first['top1_id']} "
        f"decode0_top1={decode0} lines={1 + run.gen_len}"
    )
    return {"prefill_last_top1": first["top1_id"], "decode0_top1": decode0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-name", default="prompt")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the prompt token ids (default: derived from --prompt-name)",
    )
    p.add_argument("--kv-aligned", type=int, default=1, choices=(0, 1))
    p.add_argument("--inject", default="none", choices=INJECTIONS)
    p.add_argument(
        "--trace-out",
        type=Path,
        default=None,
        help="trace file (appended); default GRETA_TRACE_READOUT_OUT when GRETA_TRACE_READOUT=1",
    )
    add_model_flags(p)


def _trace_path(args: argparse.Namespace) -> Path:
    if args.trace_out is not None:
        return Path(args.trace_out)
    enabled = os.environ.get("GRETA_TRACE_READOUT", "")
    out = os.environ.get("GRETA_TRACE_READOUT_OUT", "")
    if enabled == "1" and out:
        return Path(out)
    raise UsageError(
        "readout: no trace file; pass --trace-out FILE or set GRETA_TRACE_READOUT=1 and "
        f"GRETA_TRACE_READOUT_OUT=FILE (now GRETA_TRACE_READOUT={enabled!r}, "
        f"GRETA_TRACE_READOUT_OUT={out!r})"
    )


def run(args: argparse.Namespace) -> None:
    if args.ffn_dim < 0:
        raise UsageError("--ffn-dim must be >= 0")
    cfg = model_config(args)
    job = ReadoutRun(
        prompt_name=args.prompt_name,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        seed=zlib.crc32(args.prompt_name.encode()) if args.seed is None else args.seed,
        dtype=args.dtype,
        inject=args.inject,
        trace_out=_trace_path(args),
        model_seed=args.model_seed,
        cfg=cfg,
        kv_aligned=args.kv_aligned,
    )
    job.check()
    desc = setup_torch(args.device)
    max_pos = pad_to(args.prompt_len + args.gen_len + 1, KV_PAD)
    model = build_model(cfg, args.model_seed, args.dtype, args.device, max_pos, copy_head=True)
    run_readout(job, model, desc)
