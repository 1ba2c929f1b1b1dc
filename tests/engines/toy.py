"""A torch-free engine for the orchestration tests: `python tests/engines/toy.py equivalence ...`
takes the reference engine's flags and writes the files it writes (B3.67: logits.jsonl.gz, then
metadata.json last), in a fraction of a second, so launch/follow/attach/fleet tests do not
import torch in every cell. The reference engine's own tests and the verdict tests keep torch.

Its logits are a deterministic function of (model seed, prompt seed, step, previous token),
rounded to bf16: prefill and aligned decode agree bit for bit (PASS_EQUIV), unaligned decode
drifts (EXPECTED_DRIFT), and the canaries fail as the reference engine's do: readout_offset
emits the previous step's logits, split_kv perturbs the aligned decode past the thresholds.

`toy.py kv_invariance ...` takes the reference engine's 03C flags and writes a DONE cell as it
does (flows.bin: every flow's [B, H, D] bytes; then result.json): request r's output is a
function of (seed, r), so every flow, and each request computed alone, is bitwise equal
(BITWISE_EQUAL); the split_reduction canary changes every element of each multi-step flow
(incremental, chunk8, chunk33) by one ulp (DIFFERS). It models no precondition abort: a cell that
would abort (unpadded_kv, mask_unpadded, GGML_DETERMINISTIC unset, kv not a multiple of 256) is
refused with exit 2, saying so; such tests keep the reference engine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import hashlib
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


KV_FORMAT = "tracedeck.kv_invariance/1"  # analysis.kv_invariance's contract
KV_INJECTIONS = ("none", "split_reduction", "unpadded_kv", "mask_unpadded")
KV_DTYPES = {"fp32": ("float32", "<f4"), "fp16": ("float16", "<f2"), "bf16": ("bfloat16", "<f4")}
KV_STRIDE, MASK_PAD, MASK_TAIL, CHUNKS = 256, 64, 19, (8, 33)


def kv_output(args: argparse.Namespace, request: int) -> np.ndarray:
    """Request r's last-token output [H, D] as raw little-endian bits (uint of the dtype)."""
    name, code = KV_DTYPES[args.dtype]
    rng = np.random.default_rng([args.seed, request])
    values = rng.standard_normal((args.heads, args.d), dtype=np.float32).astype(code)
    if name == "bfloat16":  # the top 16 bits of the float32
        return (values.view("<u4") >> np.uint32(16)).astype("<u2")
    return values.view(f"<u{values.itemsize}")


def kv_invariance(args: argparse.Namespace) -> int:
    deterministic = os.environ.get("GGML_DETERMINISTIC", "") == "1"
    aborts = args.inject in ("unpadded_kv", "mask_unpadded") or not deterministic
    if aborts or args.kv % KV_STRIDE or args.heads % args.gqa:
        print(
            f"toy engine: kv={args.kv} heads={args.heads} gqa={args.gqa} inject={args.inject} "
            f"GGML_DETERMINISTIC={int(deterministic)}: a precondition abort, which this toy does "
            "not model; run the reference engine (python -m runners.reference kv_invariance)",
            file=sys.stderr,
        )
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("result.json", "flows.bin"):
        (out / stale).unlink(missing_ok=True)
    chunk_tests = os.environ.get("RUN_KVCACHE_CHUNK_TESTS", "") == "1"
    flows = ["single", "incremental", *([f"chunk{c}" for c in CHUNKS] if chunk_tests else [])]
    flows += ["alone"] if args.b > 1 else []
    single = np.stack([kv_output(args, r) for r in range(args.b)])  # [B, H, D]
    split = args.inject == "split_reduction"
    bumped = single ^ single.dtype.type(1)  # the lowest bit of each element: one ulp
    steps = {"incremental", *(f"chunk{c}" for c in CHUNKS)}  # the flows of more than one step
    payload = b"".join((bumped if split and f in steps else single).tobytes() for f in flows)
    point = {k: getattr(args, k) for k in ("d", "kv", "b", "gqa", "mask", "alibi", "sinks")}
    print(f"kv_invariance {' '.join(f'{k}={v}' for k, v in point.items())} (toy)", flush=True)
    (out / "flows.bin.part").write_bytes(payload)
    os.replace(out / "flows.bin.part", out / "flows.bin")
    result = {
        "format": KV_FORMAT,
        "point": point,
        "positions": args.kv - MASK_TAIL if args.mask else args.kv,
        "heads": args.heads,
        "kv_heads": args.heads // args.gqa,
        "dtype": KV_DTYPES[args.dtype][0],
        "seed": args.seed,
        "inject": args.inject,
        "deterministic": deterministic,
        "chunk_tests": chunk_tests,
        "policy": {
            "kv_stride": KV_STRIDE,
            "mask_pad": MASK_PAD,
            "pad_kv": True,
            "pad_mask": True,
            "split_reduction": split,
        },
        "engine": "tests/engines/toy.py kv_invariance",
        "device": "cpu (toy)",
        "status": "DONE",
        "shape": [args.b, args.heads, args.d],
        "byte_order": "little",
        "flows": flows,
        "reference": "single",
        "flow_bytes": len(payload) // len(flows),
        "flows_sha256": hashlib.sha256(payload).hexdigest(),
    }
    (out / "result.json.part").write_text(json.dumps(result, indent=2) + "\n")
    os.replace(out / "result.json.part", out / "result.json")
    return 0


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
    kv = sub.add_parser("kv_invariance")
    for flag in ("--d", "--kv"):
        kv.add_argument(flag, type=int, required=True)
    for flag, default in (("--b", 1), ("--gqa", 1), ("--heads", 4), ("--seed", 0)):
        kv.add_argument(flag, type=int, default=default)
    for flag, default in (("--mask", 1), ("--alibi", 0), ("--sinks", 0)):
        kv.add_argument(flag, type=int, default=default, choices=(0, 1))
    kv.add_argument("--dtype", default="fp32", choices=tuple(KV_DTYPES))
    kv.add_argument("--inject", default="none", choices=KV_INJECTIONS)
    kv.add_argument("--device", default="cpu")
    kv.add_argument("--out", type=Path, required=True)
    args, _ = parser.parse_known_args(argv)  # the model's shape flags mean nothing here
    if args.command == "kv_invariance":
        return kv_invariance(args)
    equivalence(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
