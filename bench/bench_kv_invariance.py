"""Benchmark: what 03C invariance by construction costs, and what it buys.

For one grid point, each flow (single-shot, incremental, chunked 8 and 33) runs twice in one
process on the same tensors: with the engine's fixed query tile (Q_TILE rows per GEMM, zero rows
padding a short step, so every GEMM of the cell has one shape) and with the natural shape (a
step's rows in one GEMM: P rows for single-shot, 1 for incremental). Prints per flow the
seconds of each, the ratio fixed/natural (the baseline is the natural shape, measured in the same
run), and whether the last token's bytes equal the single-shot flow's of the same construction.

Run: python bench/bench_kv_invariance.py [--d 128] [--kv 1024] [--b 1] [--gqa 1] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from runners.reference.kv_attention import Q_TILE  # noqa: E402
from runners.reference.kv_invariance import Cell, Policy, make_data, run_flow  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--kv", type=int, default=1024)
    p.add_argument("--b", type=int, default=1)
    p.add_argument("--gqa", type=int, default=1)
    p.add_argument("--mask", type=int, default=1)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    args = p.parse_args()
    cell = Cell(
        d=args.d,
        kv=args.kv,
        b=args.b,
        gqa=args.gqa,
        mask=args.mask,
        alibi=0,
        sinks=0,
        heads=4,
        dtype=args.dtype,
        seed=0,
        inject="none",
    )
    cell.check()
    data = make_data(cell)
    flows = [("single", cell.positions), ("incremental", 1), ("chunk8", 8), ("chunk33", 33)]
    print(
        f"cell {cell.label()} P={cell.positions} dtype={args.dtype} threads="
        f"{torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')})"
    )
    print(
        f"{'flow':<12} {'fixed tile s':>12} {'natural s':>10} {'ratio':>6}  bitwise equal to single"
    )
    outs: dict[str, dict[str, torch.Tensor]] = {"fixed": {}, "natural": {}}
    times: dict[str, dict[str, float]] = {"fixed": {}, "natural": {}}
    with torch.inference_mode():
        for name, chunk in flows:
            for how, tile in (("natural", 0), ("fixed", Q_TILE)):
                policy = Policy(pad_kv=True, pad_mask=True, split=False, tile=tile)
                t0 = time.perf_counter()
                outs[how][name] = run_flow(cell, data, chunk, policy, name)
                times[how][name] = time.perf_counter() - t0
    for name, _ in flows:
        fixed, natural = times["fixed"][name], times["natural"][name]
        same = {
            how: torch.equal(outs[how][name], outs[how]["single"]) for how in ("fixed", "natural")
        }
        print(
            f"{name:<12} {fixed:>12.2f} {natural:>10.2f} {fixed / natural:>6.2f}  "
            f"fixed tile: {'yes' if same['fixed'] else 'NO'}   natural: "
            f"{'yes' if same['natural'] else 'NO'}"
        )
    total_fixed = sum(times["fixed"].values())
    total_natural = sum(times["natural"].values())
    print(
        f"total: fixed tile {total_fixed:.2f}s, natural {total_natural:.2f}s, "
        f"ratio {total_fixed / total_natural:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
