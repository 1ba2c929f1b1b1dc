"""B3.67: greedy logits of one mode (prefill recompute, or decode through the KV cache) into --out.

Injected bugs (decode mode only; prefill records but ignores them) start at token
``inject_first_token(gen_len)``, i.e. once the cache holds ``prompt_len + that`` tokens:

- ``readout_offset`` (B3.11): the LM head writes logits at the logical slot, but the sampler
  reads the slot one behind, so the step emits the previous step's logits.
- ``split_kv``: attention reduces the cached keys and the current token separately and merges the
  two partial results, even on the aligned path (seed 002 forbids this split). With
  ``--kv-aligned 0`` decode already takes that path, so this injection changes nothing there.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runners.reference.config import KV_PAD, ModelConfig, add_model_flags, model_config, pad_to
from runners.reference.model import AttnPlan, KVCache, Model
from runners.reference.model import prompt_ids as make_prompt
from runners.reference.runtime import Progress, UsageError, build_model, checkpoints, setup_torch
from runners.reference.tracefile import (
    GzipJsonl,
    determinism_env,
    git_commit,
    utc_timestamp,
    write_json_atomic,
)

MODES = ("prefill", "decode")
INJECTIONS = ("none", "readout_offset", "split_kv")


def inject_first_token(gen_len: int) -> int:
    """The token_idx at which an injected decode bug first shows (never token 0)."""
    return max(1, gen_len // 2)


@dataclass(frozen=True)
class EquivalenceRun:
    mode: str
    kv_aligned: int
    seed: int
    dtype: str
    prompt_len: int
    gen_len: int
    out: Path
    inject: str
    model_seed: int
    cfg: ModelConfig
    device: str

    def check(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"--mode {self.mode!r}: use prefill or decode")
        if self.kv_aligned not in (0, 1):
            raise UsageError(f"--kv-aligned {self.kv_aligned}: use 0 or 1")
        if self.inject not in INJECTIONS:
            raise UsageError(f"--inject {self.inject!r}: use one of {', '.join(INJECTIONS)}")
        if self.prompt_len < 1:
            raise UsageError(f"--prompt-len must be >= 1, got {self.prompt_len}")
        if self.gen_len < 1:
            raise UsageError(f"--gen-len must be >= 1, got {self.gen_len}")
        if self.inject != "none" and self.gen_len < 2:
            raise UsageError(
                f"--inject {self.inject} needs --gen-len >= 2: the bug starts after token 0"
            )

    @property
    def label(self) -> str:
        return f"{self.mode} kv_aligned={self.kv_aligned} seed={self.seed}"

    @property
    def first_injected(self) -> int | None:
        if self.inject == "none" or self.mode != "decode":
            return None
        return inject_first_token(self.gen_len)


def _emit(writer: GzipJsonl, token_idx: int, logits: torch.Tensor) -> int:
    row = logits.detach().to("cpu", torch.float32).numpy()
    if not np.isfinite(row).all():
        bad = int(np.flatnonzero(~np.isfinite(row))[0])
        raise RuntimeError(f"token_idx {token_idx}: logit {bad} is {row[bad]} (not finite)")
    token_id = int(np.argmax(row))  # first index on ties, as numpy's argmax in the analyzer
    writer.write({"token_idx": token_idx, "token_id": token_id, "logits": row})
    return token_id


def _last_logits(model: Model, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_logits(model.final_norm_rows(hidden[-1:]))[0]


def _run_prefill(
    run: EquivalenceRun, model: Model, prompt: list[int], writer: GzipJsonl, log: Progress
) -> None:
    aligned = bool(run.kv_aligned)
    plan = AttnPlan(aligned=aligned)
    seq = list(prompt)
    marks = checkpoints(run.gen_len)
    for t in range(run.gen_len):
        n = len(seq)
        # no cache carried over: every position recomputes the whole sequence from scratch
        cache = KVCache(model.cfg, pad_to(n, KV_PAD) if aligned else n, model.dtype, model.device)
        hidden = model.forward(torch.tensor(seq, device=model.device), cache, plan, last_only=True)
        seq.append(_emit(writer, t, _last_logits(model, hidden)))
        if t + 1 in marks:
            log(f"token {t + 1}/{run.gen_len}")


def _run_decode(
    run: EquivalenceRun, model: Model, prompt: list[int], writer: GzipJsonl, log: Progress
) -> None:
    aligned = bool(run.kv_aligned)
    p_len = run.prompt_len
    first_bad = run.first_injected
    cache = KVCache(model.cfg, pad_to(p_len + run.gen_len, KV_PAD), model.dtype, model.device)
    ids = torch.tensor(prompt, device=model.device)
    hidden = model.forward(ids, cache, AttnPlan(aligned), last_only=True)
    # logits slots indexed by the logical position of the input token (the B3.11 layout)
    slots = {p_len - 1: _last_logits(model, hidden)}
    token = _emit(writer, 0, slots[p_len - 1])
    marks = checkpoints(run.gen_len)
    if 1 in marks:
        log(f"token 1/{run.gen_len}")
    for t in range(1, run.gen_len):
        pos = p_len + t - 1
        bugged = first_bad is not None and t >= first_bad
        plan = AttnPlan(
            aligned=aligned,
            split_current=not aligned or (bugged and run.inject == "split_kv"),
        )
        hidden = model.forward(torch.tensor([token], device=model.device), cache, plan)
        slots[pos] = _last_logits(model, hidden)
        read = pos - 1 if bugged and run.inject == "readout_offset" else pos
        token = _emit(writer, t, slots[read])
        slots.pop(pos - 2, None)
        if t + 1 in marks:
            log(f"token {t + 1}/{run.gen_len}")


def run_equivalence(run: EquivalenceRun, model: Model, device_desc: str) -> dict[str, Any]:
    """Writes logits.jsonl.gz then metadata.json (last, atomically) into run.out."""
    run.check()
    log = Progress(run.label)
    started = utc_timestamp()
    t0 = time.perf_counter()
    run.out.mkdir(parents=True, exist_ok=True)
    # a rerun into the same directory must not leave an old metadata.json claiming completeness
    (run.out / "metadata.json").unlink(missing_ok=True)
    log(
        f"start prompt_len={run.prompt_len} gen_len={run.gen_len} dtype={run.dtype} "
        f"vocab={run.cfg.vocab} inject={run.inject} device={device_desc}"
    )
    prompt = make_prompt(run.seed, run.prompt_len, run.cfg.vocab)
    writer = GzipJsonl(run.out / "logits.jsonl.gz")
    try:
        with torch.inference_mode():
            if run.mode == "prefill":
                _run_prefill(run, model, prompt, writer, log)
            else:
                _run_decode(run, model, prompt, writer, log)
    except BaseException:
        writer.abort()
        raise
    writer.commit()
    meta: dict[str, Any] = {
        "dtype": run.dtype,
        "prompt_len": run.prompt_len,
        "gen_len": run.gen_len,
        "seed": run.seed,
        "kv_aligned": run.kv_aligned,
        "mode": run.mode,
        "timestamp": started,
        "git_commit": git_commit(),
        "engine": "runners.reference",
        "model": run.cfg.as_dict(),
        "model_seed": run.model_seed,
        "torch_version": torch.__version__,
        "device": device_desc,
        "inject": run.inject,
        "inject_first_token": run.first_injected,
        "determinism_env": determinism_env(),
        "elapsed_s": round(time.perf_counter() - t0, 3),
    }
    write_json_atomic(run.out / "metadata.json", meta)
    log(f"done in {meta['elapsed_s']:.1f}s -> {run.out}")
    return meta


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", required=True, choices=MODES)
    p.add_argument("--kv-aligned", type=int, required=True, choices=(0, 1))
    p.add_argument("--seed", type=int, required=True, help="seed of the prompt token ids")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--out", type=Path, required=True, help="directory for logits + metadata")
    p.add_argument("--inject", default="none", choices=INJECTIONS)
    add_model_flags(p)


def run(args: argparse.Namespace) -> None:
    if args.ffn_dim < 0:
        raise UsageError("--ffn-dim must be >= 0")
    cfg = model_config(args)
    job = EquivalenceRun(
        mode=args.mode,
        kv_aligned=args.kv_aligned,
        seed=args.seed,
        dtype=args.dtype,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        out=args.out,
        inject=args.inject,
        model_seed=args.model_seed,
        cfg=cfg,
        device=args.device,
    )
    job.check()
    desc = setup_torch(args.device)
    max_pos = pad_to(args.prompt_len + args.gen_len, KV_PAD)
    run_equivalence(job, build_model(cfg, args.model_seed, args.dtype, args.device, max_pos), desc)
