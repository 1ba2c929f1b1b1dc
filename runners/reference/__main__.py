"""Command line: ``python -m runners.reference equivalence|readout ...``.

Exit status: 0 done, 1 engine failure (traceback), 2 bad flags or environment, 3 device missing.
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from pathlib import Path

from runners.reference.config import KV_PAD, ModelConfig, pad_to


def _size_flags(p: argparse.ArgumentParser) -> None:
    d = ModelConfig()
    g = p.add_argument_group("model")
    g.add_argument("--vocab", type=int, default=d.vocab)
    g.add_argument("--layers", type=int, default=d.layers)
    g.add_argument("--d-model", type=int, default=d.d_model)
    g.add_argument("--heads", type=int, default=d.heads)
    g.add_argument("--kv-heads", type=int, default=d.kv_heads)
    g.add_argument("--ffn-dim", type=int, default=0, help="0: 8/3 d_model rounded up to 64")
    g.add_argument("--model-seed", type=int, default=0, help="seed of the weights")
    g.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (ROCm torch reports cuda)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m runners.reference",
        description="Reference Llama-style engine for the tracedeck seed workflows.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("equivalence", help="B3.67: greedy logits of one mode into --out")
    e.add_argument("--mode", required=True, choices=("prefill", "decode"))
    e.add_argument("--kv-aligned", type=int, required=True, choices=(0, 1))
    e.add_argument("--seed", type=int, required=True, help="seed of the prompt token ids")
    e.add_argument("--prompt-len", type=int, default=512)
    e.add_argument("--gen-len", type=int, default=128)
    e.add_argument("--out", type=Path, required=True, help="directory for logits + metadata")
    e.add_argument("--inject", default="none", choices=("none", "readout_offset", "split_kv"))
    _size_flags(e)

    r = sub.add_parser("readout", help="B3.11/B3.12: append the readout trace for one prompt")
    r.add_argument("--prompt-name", default="prompt")
    r.add_argument("--prompt-len", type=int, default=64)
    r.add_argument("--gen-len", type=int, default=16)
    r.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the prompt token ids (default: derived from --prompt-name)",
    )
    r.add_argument("--kv-aligned", type=int, default=1, choices=(0, 1))
    r.add_argument("--inject", default="none", choices=("none", "b3_11", "b3_12"))
    r.add_argument(
        "--trace-out",
        type=Path,
        default=None,
        help="trace file (appended); default GRETA_TRACE_READOUT_OUT when GRETA_TRACE_READOUT=1",
    )
    _size_flags(r)
    return p


def _config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab=args.vocab,
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        kv_heads=args.kv_heads,
        ffn_dim=args.ffn_dim,
    )


def _trace_path(args: argparse.Namespace) -> Path:
    from runners.reference.runtime import UsageError

    if args.trace_out is not None:
        return args.trace_out
    enabled = os.environ.get("GRETA_TRACE_READOUT", "")
    out = os.environ.get("GRETA_TRACE_READOUT_OUT", "")
    if enabled == "1" and out:
        return Path(out)
    raise UsageError(
        "readout: no trace file; pass --trace-out FILE or set GRETA_TRACE_READOUT=1 and "
        f"GRETA_TRACE_READOUT_OUT=FILE (now GRETA_TRACE_READOUT={enabled!r}, "
        f"GRETA_TRACE_READOUT_OUT={out!r})"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.ffn_dim < 0:
        print("error: --ffn-dim must be >= 0", file=sys.stderr)
        return 2
    # torch is imported only after the flags parse, so --help and flag errors are instant
    from runners.reference.runtime import DeviceError, UsageError, build_model, setup_torch

    try:
        cfg = _config(args)
        max_pos = pad_to(args.prompt_len + args.gen_len, KV_PAD)
        if args.command == "equivalence":
            from runners.reference.equivalence import EquivalenceRun, run_equivalence

            run = EquivalenceRun(
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
            run.check()
            desc = setup_torch(args.device)
            run_equivalence(
                run, build_model(cfg, args.model_seed, args.dtype, args.device, max_pos), desc
            )
        else:
            from runners.reference.readout import ReadoutRun, run_readout

            rrun = ReadoutRun(
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
            rrun.check()
            desc = setup_torch(args.device)
            run_readout(
                rrun, build_model(cfg, args.model_seed, args.dtype, args.device, max_pos), desc
            )
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
