"""DSA traces as data: records/s of export and block-size what-if against the validator's own rate.

A production-size trace (61 layers, top-2048, sequences of ~3.7K tokens, ~11 KB a record, made
as bench_dsa_ingest.py makes it) is written to a temporary block64/ directory; then, in the
same run and on the same files: the validator (`tracedeck analyze`'s analyze_block, the
baseline), the per-record scan the data tools share (parse + per-record checks), the what-if
at 4,8,16,64,128, the parquet and csv exports, and an LRU tier replay at one capacity, on one
process and then on --workers processes (analysis.dsa_parallel; the validator too). Each
figure is the best of --repeat runs, by the wall clock and by CPU time (this process and its
workers), with its ratio to the one-process validator's, and this process's peak RSS at the
end (every stage reads 4 MiB chunks; export holds at most one 1024-row group and one write in
flight, and a few chunks wait per worker).

    python bench/bench_dsa_data.py [--records 6100] [--repeat 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIZES = [4, 8, 16, 64, 128]


def write_trace(root: Path, records: int) -> Path:
    from bench_dsa_ingest import make_lines  # the reference engine's record builder (torch)

    folder = root / "block64"
    folder.mkdir(parents=True)
    lines = make_lines(records)
    requests = len(lines) // (61 * 64) + 1
    (folder / f"trace_steps_0_{requests}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    summary = {"config": {"kv_block_size_tokens": 64, "index_topk": 2048, "n_layers": 61}}
    summary["config"]["kv_bytes_per_token"] = 1152
    summary["config"]["trace_prefix_key_tokens"] = 256
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def stage(name: str, folder: Path, out: Path, workers: int = 1) -> int:
    """Run one stage on `workers` processes; returns the records it saw."""
    from analysis.dsa_scan import scan_block, trace_info
    from analysis.dsa_tiers import tiers_dir
    from analysis.dsa_tree import analyze_block
    from analysis.dsa_whatif import whatif_dir
    from console.dsa_data_cli import export_block

    if name == "validator":
        return int(analyze_block(folder, 2048, 61, workers)["records"])
    if name == "scan":
        n = 0
        for chunk in scan_block(trace_info(folder)):
            n += len(chunk.batch) + len(chunk.bad)
        return n
    if name == "whatif":
        return int(whatif_dir(str(folder), SIZES, workers=workers)["records"])
    if name in ("parquet", "csv"):
        return export_block(trace_info(folder), out / f"x.{name}", name, workers)[0]
    if name == "tiers-lru":
        return int(tiers_dir(str(folder), [4096], "lru", workers=workers)["records"])
    raise ValueError(name)


def best(
    name: str, folder: Path, out: Path, repeat: int, workers: int = 1
) -> tuple[float, float, int]:
    """Records/s by the wall clock and by CPU time (this process and its worker processes)."""
    wall = cpu = float("inf")
    n = 0
    for _ in range(repeat):
        # the last repeat's export is removed first: replacing it would time its deletion too
        (out / f"x.{name}").unlink(missing_ok=True)
        t, c = time.perf_counter(), os.times()
        n = stage(name, folder, out, workers)
        wall = min(wall, time.perf_counter() - t)
        c1 = os.times()
        cpu = min(cpu, sum(c1[:4]) - sum(c[:4]))
    return n / wall, n / max(cpu, 1e-9), n


def main() -> None:
    from bench_dsa_ingest import loadavg

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=6100)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="processes for the second pass")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = write_trace(root / "trace", args.records)
        size = sum(f.stat().st_size for f in folder.glob("trace_steps_*"))
        print(f"loadavg before: {loadavg()} ({os.cpu_count()} cores)")
        base_wall, base_cpu, n = best("validator", folder, root, args.repeat)
        print(
            f"{n} records, {size / n / 1024:.1f} KB each, 61 layers, top-2048, block 64 "
            f"({size / 2**20:.0f} MiB)"
        )
        print(
            f"{'stage':<34} {'rec/s wall':>11} {'x validator':>11} {'rec/s cpu':>10} {'x':>6} {'same':>6}"
        )
        print(f"{'validator (analyze, baseline)':<34} {base_wall:>11.0f} {1:>11.2f} {base_cpu:>10.0f} {1:>6.2f} {1:>6.2f}")  # fmt: skip
        labels = {
            "scan": "scan (parse + per-record checks)",
            "whatif": f"what-if at {','.join(map(str, SIZES))}",
            "parquet": "export parquet",
            "csv": "export csv",
            "tiers-lru": "tiers lru, 4096 blocks",
        }
        same = base_wall  # the validator on as many workers as the stage
        for workers in sorted({1, max(1, args.workers)}):
            print(
                f"-- {workers} worker{'s' if workers > 1 else ''} (x: the 1-worker validator; "
                "same: the validator on as many workers)"
            )
            stages = {"validator": "validator (analyze)", **labels} if workers > 1 else labels
            for name, label in stages.items():
                wall, cpu, _ = best(name, folder, root, args.repeat, workers)
                if name == "validator":
                    same = wall
                print(f"{label:<34} {wall:>11.0f} {wall / base_wall:>11.2f} {cpu:>10.0f} {cpu / base_cpu:>6.2f} {wall / same:>6.2f}")  # fmt: skip
        if args.workers > 1:
            from bench_dsa_analyze import cpu_scaling

            print(
                f"control: {args.workers} processes spinning get x{cpu_scaling(args.workers):.2f} "
                "one's speed on this machine now (the most N workers can gain)"
            )
        print(f"loadavg after: {loadavg()}")
        print(f"this process's peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
