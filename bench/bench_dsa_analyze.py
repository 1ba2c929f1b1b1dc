"""`tracedeck analyze` of a production-size DSA trace on 1 and on N worker processes.

The trace: 10,248 records (61 layers x 168 steps, top-2047 of sequences of ~3.8K tokens,
~11 KB a line) in three shards of one request each, made with the reference engine's record
builder (bench_dsa_ingest.make_lines, no torch) and written to a temporary block64/ with its
summary.json config. In the same run and on the same files it measures, each the best of
--repeat runs: a bare `json.loads` loop over every line (the baseline), a bare `orjson.loads`
loop, the positions-parse floor (pysimdjson parsing the cut-out selected_token_pos arrays
alone, batch by batch: what no judge of these records can go under on one core), the same
parse one record at a time (the floor as issue 23 measured it, ~12,000 records/s a core), and
the same with the arrays cut out of each line first (split_positions), and analyze_block
with 1 worker (the single-process path) and with 2..--workers workers. Each
analyze line gives records/s, its ratio to json.loads, the rate per core it used (records/s
divided by min(workers, cores)) and that per-core rate's ratio to the floor, and whether its
result equals the single-process one. A control line says how much CPU the machine gives
--workers processes at once against one, in the same run (on a loaded machine with autogroup
scheduling a session's processes share one slot: no worker count can gain there). The load
average is printed before and after: on a shared machine the ratios (same run) are the
figures to read.

    python bench/bench_dsa_analyze.py [--repeat 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RECORDS, LAYERS, TOPK, STEPS_PER_REQUEST = 10_248, 61, 2047, 64


def write_trace(root: Path) -> tuple[Path, list[bytes]]:
    from bench_dsa_ingest import make_lines

    folder = root / "block64"
    folder.mkdir(parents=True)
    lines = make_lines(RECORDS, layers=LAYERS, topk=TOPK)
    per = LAYERS * STEPS_PER_REQUEST  # one request per shard, as max_requests_per_file = 1
    shards = -(-len(lines) // per)
    for k in range(shards):
        part = lines[k * per : (k + 1) * per]
        (folder / f"trace_steps_{k}_{k + 1}.jsonl").write_bytes(b"\n".join(part) + b"\n")
    config = {
        "kv_block_size_tokens": 64,
        "index_topk": TOPK,
        "n_layers": LAYERS,
        "kv_bytes_per_token": 1152,
        "trace_prefix_key_tokens": 256,
        "requests": shards,
        "max_requests_per_file": 1,
    }
    (folder / "summary.json").write_text(json.dumps({"config": config}))
    # the statistics section as the validator recomputes it (a bench, not a test: the verdict
    # is then TRACE_OK and the whole path, summary comparison included, is timed)
    from analysis.dsa_tree import analyze_block

    stats = analyze_block(folder, None, None)["recomputed"]
    stats.pop("records")
    (folder / "summary.json").write_text(json.dumps({"config": config, **stats}))
    return folder, lines


def best(fn: Callable[[], object], repeat: int) -> tuple[float, float, object]:
    """(best wall seconds, its CPU seconds of this process and its waited-for children, result)."""
    wall, cpu, out = float("inf"), float("inf"), None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), os.times()
        out = fn()
        t1, c1 = time.perf_counter(), os.times()
        used = sum(c1[:4]) - sum(c0[:4])
        if t1 - t0 < wall:
            wall, cpu = t1 - t0, used
    return wall, cpu, out


def _spin(n: int) -> None:
    x = 0
    for i in range(n):
        x += i


def cpu_scaling(procs: int, n: int = 5_000_000) -> float:
    """How many times one process's speed `procs` forked processes spinning at once get (a
    pure-Python loop): on an idle machine about min(procs, cores); on a loaded one with
    autogroup scheduling, where a session shares one slot, about 1."""
    rates = []
    for count in (1, procs):
        t = time.perf_counter()
        pids = []
        for _ in range(count):
            pid = os.fork()
            if pid == 0:
                _spin(n)
                os._exit(0)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)
        rates.append(count * n / (time.perf_counter() - t))
    return rates[1] / rates[0]


def main() -> None:
    import orjson
    from bench_dsa_ingest import loadavg

    from analysis.dsa_record import _parse_arrays, split_positions
    from analysis.dsa_tree import analyze_block
    from runners.resources import cores

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="the most workers measured")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder, lines = write_trace(Path(tmp))
        n = len(lines)
        size = sum(f.stat().st_size for f in folder.glob("trace_steps_*"))
        shards = len(list(folder.glob("trace_steps_*")))
        print(
            f"{n} records, {size / n / 1024:.1f} KB each, {LAYERS} layers, top-{TOPK}, "
            f"{shards} shards ({size / 2**20:.0f} MiB); {cores()} cores"
        )
        print(f"loadavg before: {loadavg()}")
        arrays = [a for a, _ in map(split_positions, lines)]  # type: ignore[misc]
        batches = [arrays[i : i + 400] for i in range(0, n, 400)]
        base, _, _ = best(lambda: [json.loads(x) for x in lines], args.repeat)
        orj, _, _ = best(lambda: [orjson.loads(x) for x in lines], args.repeat)
        floor, _, _ = best(lambda: [_parse_arrays(b, flat=True) for b in batches], args.repeat)
        one, _, _ = best(lambda: [_parse_arrays([a], flat=True) for a in arrays], args.repeat)
        lined = [lines[i : i + 400] for i in range(0, n, 400)]
        cut, _, _ = best(
            lambda: [_parse_arrays([split_positions(x)[0] for x in b], flat=True) for b in lined],  # type: ignore[index]
            args.repeat,
        )
        print(f"{'':44s} {'rec/s':>8s} {'x json':>7s} {'per core':>9s} {'floor/core':>10s}")
        print(f"{'json.loads loop (baseline)':44s} {n / base:8.0f} {1:7.2f}")
        print(f"{'orjson.loads loop':44s} {n / orj:8.0f} {base / orj:7.2f}")
        print(
            f"{'positions-parse floor (pysimdjson, 1 core)':44s} {n / floor:8.0f} "
            f"{base / floor:7.2f} {n / floor:9.0f} {1:10.2f}"
        )
        print(
            f"{'the same, one record at a time (issue 23)':44s} {n / one:8.0f} "
            f"{base / one:7.2f} {n / one:9.0f} {one / floor:10.2f}"
        )
        print(
            f"{'the same, cutting the arrays out of the lines':44s} {n / cut:8.0f} "
            f"{base / cut:7.2f} {n / cut:9.0f} {cut / floor:10.2f}"
        )
        single, split = None, ""
        for workers in range(1, max(1, args.workers) + 1):
            wall, cpu, result = best(
                lambda w=workers: analyze_block(folder, None, None, w), args.repeat
            )
            assert isinstance(result, dict) and result["verdict"] == "TRACE_OK", result
            if single is None:
                single = result
                # where a record's time goes on one core, against what the goal allows
                parse_us, rest_us = floor / n * 1e6, (wall - floor) / n * 1e6
                split = (
                    f"one worker, a record: the positions parse {parse_us:.1f} us (the floor), "
                    f"the rest of analyze {rest_us:.1f} us (within 1.5x of the floor the rest "
                    f"takes at most {parse_us / 2:.1f} us)"
                )
            used = min(workers, cores())
            per_core = n / wall / used
            same = "same result" if result == single else "RESULT DIFFERS"
            label = f"analyze, {workers} worker{'s' if workers > 1 else ''}"
            print(
                f"{label:44s} {n / wall:8.0f} {base / wall:7.2f} {per_core:9.0f} "
                f"{(n / floor) / per_core:10.2f}   cpu {cpu:.2f} s, {same}"
            )
        print(split)
        print(
            f"control: {args.workers} processes spinning get x{cpu_scaling(args.workers):.2f} "
            "one's speed on this machine now (the most N workers can gain)"
        )
        print(f"loadavg after: {loadavg()}")


if __name__ == "__main__":
    main()
