"""A torch-free engine for the orchestration tests: `python tests/engines/toy.py equivalence ...`
takes the reference engine's flags and writes the files it writes (B3.67: logits.jsonl.gz, then
metadata.json last), in a fraction of a second, so launch/follow/attach/fleet tests do not
import torch in every cell. The reference engine's own tests and the verdict tests keep torch.

Its logits are a deterministic function of (model seed, prompt seed, step, previous token),
rounded to bf16: prefill and aligned decode agree bit for bit (PASS_EQUIV), unaligned decode
drifts (EXPECTED_DRIFT), and the canaries fail as the reference engine's do: readout_offset
emits the previous step's logits, split_kv perturbs the aligned decode past the thresholds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import sys
from pathlib import Path

import numpy as np

try:
    import orjson
except ImportError:  # pragma: no cover - the suite's venv has it
    orjson = None

MODES = ("prefill", "decode")
INJECTIONS = ("none", "readout_offset", "split_kv")


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values cut to bf16 precision (the low 16 bits cleared)."""
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def logits(model_seed: int, seed: int, step: int, prev: int, vocab: int) -> np.ndarray:
    rng = np.random.default_rng([model_seed, seed, step, prev + 1])  # prev -1: the prompt
    return bf16(rng.standard_normal(vocab, dtype=np.float32) * 4)


def drift(seed: int, step: int, vocab: int, scale: float) -> np.ndarray:
    return np.random.default_rng([7919, seed, step]).standard_normal(vocab).astype(np.float32) * (
        scale
    )


def dumps(obj: dict) -> bytes:
    if orjson is not None:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(
        {k: v.tolist() if hasattr(v, "tolist") else v for k, v in obj.items()}
    ).encode()


def equivalence(args: argparse.Namespace) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "metadata.json").unlink(missing_ok=True)
    first_bad = (
        max(1, args.gen_len // 2) if args.inject != "none" and args.mode == "decode" else None
    )
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"[{args.mode} kv_aligned={args.kv_aligned} seed={args.seed}] start", file=sys.stderr)
    part = out / "logits.jsonl.gz.part"
    prev, previous_row = -1, None
    with gzip.open(part, "wb", compresslevel=1) as fh:
        for t in range(args.gen_len):
            row = logits(args.model_seed, args.seed, t, prev, args.vocab)
            if args.mode == "decode" and t > 0:
                bugged = first_bad is not None and t >= first_bad
                if not args.kv_aligned or (bugged and args.inject == "split_kv"):
                    row = bf16(row + drift(args.seed, t, args.vocab, 0.05))
                if bugged and args.inject == "readout_offset" and previous_row is not None:
                    row = previous_row
            token = int(np.argmax(row))
            fh.write(dumps({"token_idx": t, "token_id": token, "logits": row}) + b"\n")
            prev, previous_row = token, row
    os.replace(part, out / "logits.jsonl.gz")
    meta = {
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "seed": args.seed,
        "kv_aligned": args.kv_aligned,
        "mode": args.mode,
        "timestamp": started,
        "git_commit": os.environ.get("GIT_COMMIT", "unknown"),
        "engine": "tests/engines/toy.py",
        "model": {"vocab": args.vocab},
        "model_seed": args.model_seed,
        "device": "cpu (toy)",
        "inject": args.inject,
        "inject_first_token": first_bad,
        "determinism_env": {k: v for k, v in os.environ.items() if k.startswith("GRETA_")},
    }
    tmp = out / "metadata.json.part"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / "metadata.json")
    print(f"[{args.mode} kv_aligned={args.kv_aligned} seed={args.seed}] done", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="toy.py")
    sub = parser.add_subparsers(dest="command", required=True)
    eq = sub.add_parser("equivalence")
    eq.add_argument("--mode", required=True, choices=MODES)
    eq.add_argument("--kv-aligned", type=int, required=True, choices=(0, 1))
    eq.add_argument("--seed", type=int, required=True)
    eq.add_argument("--prompt-len", type=int, default=512)
    eq.add_argument("--gen-len", type=int, default=128)
    eq.add_argument("--out", type=Path, required=True)
    eq.add_argument("--inject", default="none", choices=INJECTIONS)
    eq.add_argument("--vocab", type=int, default=32000)
    eq.add_argument("--model-seed", type=int, default=0)
    eq.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    eq.add_argument("--device", default="cpu")
    args, _ = parser.parse_known_args(argv)  # the model's shape flags mean nothing here
    equivalence(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
