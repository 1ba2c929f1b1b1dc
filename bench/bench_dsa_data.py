"""DSA traces as data: records/s of export and block-size what-if against the validator's own rate.

A production-size trace (61 layers, top-2048, sequences of ~3.7K tokens, ~11 KB a record, made
as bench_dsa_ingest.py makes it) is written to a temporary block64/ directory; then, on the same
files: the per-record scan the data tools share (parse + per-record checks), the what-if at
4,8,16,64,128, the parquet and csv exports, and an LRU tier replay at one capacity, on one
process and then on --workers processes (analysis.dsa_parallel). Each stage runs --repeat times,
each time right after the validator (`tracedeck analyze`'s analyze_block, the baseline) on as
many workers: a stage's records/s are its best run's, by the wall clock and by CPU time (this
process and its workers), and its ratio to the validator is the median of the ratios of those
back-to-back pairs (this machine's speed drifts by tens of percent between seconds: two
best-ofs taken apart gave ratios that moved by 0.15 between runs of the bench). The 2-worker
pass also pairs the validator on 2 workers with it on 1. This process's peak RSS is printed at
the end (every stage reads 4 MiB chunks; export holds at most one 1024-row group and one write
in flight, and a few chunks wait per worker).

    python bench/bench_dsa_data.py [--records 6100] [--repeat 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
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


def timed(name: str, folder: Path, out: Path, workers: int = 1) -> tuple[float, float, int]:
    """One run of a stage: (wall seconds, CPU seconds of this process and its workers, records)."""
    # the last run's export is removed first: replacing it would time its deletion too
    (out / f"x.{name}").unlink(missing_ok=True)
    t, c = time.perf_counter(), os.times()
    n = stage(name, folder, out, workers)
    wall = time.perf_counter() - t
    c1 = os.times()
    return wall, sum(c1[:4]) - sum(c[:4]), n


def paired(
    name: str, folder: Path, out: Path, repeat: int, workers: int, base_workers: int
) -> dict[str, float]:
    """The stage and the validator (on base_workers) run back to back, --repeat times, in
    turn: its best records/s (wall, CPU) and the median over the pairs of its ratio to the
    validator run beside it. On a shared machine whose speed drifts between seconds, a
    ratio of two runs a second apart is steadier than a ratio of two best-ofs taken apart."""
    wall = cpu = float("inf")
    walls, cpus = [], []
    n = 0
    for _ in range(repeat):
        vw, vc, _ = timed("validator", folder, out, base_workers)
        sw, sc, n = timed(name, folder, out, workers)
        wall, cpu = min(wall, sw), min(cpu, sc)
        walls.append(vw / sw)
        cpus.append(vc / max(sc, 1e-9))
    return {
        "wall": n / wall,
        "cpu": n / max(cpu, 1e-9),
        "x_wall": statistics.median(walls),
        "x_cpu": statistics.median(cpus),
        "n": n,
    }


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
        base = paired("validator", folder, root, 1, 1, 1)  # a warm-up, and the record count
        n = int(base["n"])
        print(
            f"{n} records, {size / n / 1024:.1f} KB each, 61 layers, top-2048, block 64 "
            f"({size / 2**20:.0f} MiB)"
        )
        labels = {
            "scan": "scan (parse + per-record checks)",
            "whatif": f"what-if at {','.join(map(str, SIZES))}",
            "parquet": "export parquet",
            "csv": "export csv",
            "tiers-lru": "tiers lru, 4096 blocks",
        }
        head = f"{'stage':<34} {'rec/s wall':>11} {'x validator':>11} {'rec/s cpu':>10} {'x':>6}"
        for workers in sorted({1, max(1, args.workers)}):
            print(
                f"-- {workers} worker{'s' if workers > 1 else ''}: each stage run in turn with "
                f"the validator on {workers}, {args.repeat} times (x: the median ratio of the pairs)"
            )
            print(head)
            stages = labels
            if workers > 1:  # (the scan alone is one process's)
                rest = {k: v for k, v in labels.items() if k != "scan"}
                stages = {"validator": "validator (against it on 1 worker)", **rest}
            for name, label in stages.items():
                base_workers = 1 if name == "validator" else workers
                got = paired(name, folder, root, args.repeat, workers, base_workers)
                print(f"{label:<34} {got['wall']:>11.0f} {got['x_wall']:>11.2f} {got['cpu']:>10.0f} {got['x_cpu']:>6.2f}")  # fmt: skip
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
