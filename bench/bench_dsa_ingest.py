"""DSA ingest: parse + validate + aggregate of 2048-position dsa_topk records, against json.loads.

Records as seed 004 describes them (61 layers, top-2048, sequences of ~3.7K tokens, ~11 KB per
line), made with the reference engine's record builder from random selections (no torch).
Prints records/s for: json.loads only (baseline), orjson.loads only, a typed msgspec decode
only, and the DSA judge's feed() (parse, every check, live and summary aggregates, digest), and
the ratios against json.loads measured in the same run.

    python bench/bench_dsa_ingest.py [--records 3000] [--batch 100]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import orjson

from analysis.dsa_record import _REST  # the typed part of the record
from analysis.dsa_stream import TraceStream
from runners.reference.dsa_trace import PrefixCacheAnalyzer, TraceConfig, build_record


def make_lines(records: int, layers: int = 61, topk: int = 2048, prompt: int = 3743) -> list[bytes]:
    rng = np.random.default_rng(0)
    cfg = TraceConfig(
        out=Path("/nonexistent"),
        run_name="bench",
        dataset="ruler",
        topk=topk,
        layers=layers,
        bytes_per_token=1152,
    )
    prefix = PrefixCacheAnalyzer(256, 64)
    lines: list[bytes] = []
    request, step = 0, 0
    info = prefix.request(list(range(300)))
    while len(lines) < records:
        seq = prompt + step + 1
        for layer in range(layers):
            pos = rng.choice(seq, size=min(topk, seq), replace=False)
            rec = build_record(
                cfg, request, layer, seq - 1, pos, rng.standard_normal(len(pos)), info
            )
            rec["kv_fetch"]["hbm"]["latency_us"] = 400000 + step
            lines.append(orjson.dumps(rec))
        step += 1
        if step == 64:
            request, step = request + 1, 0
            info = prefix.request(list(range(300 + request)))
    return lines[: records - records % layers]


def rate(fn, n: int, repeat: int = 3) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return n / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=3050)
    p.add_argument("--batch", type=int, default=100)
    args = p.parse_args()
    lines = make_lines(args.records)
    n = len(lines)
    size = sum(map(len, lines)) / n
    print(f"{n} records, {size / 1024:.1f} KB each, 2048 positions, 61 layers")

    def feed() -> None:
        stream = TraceStream(topk=2048, layers=61)
        for i in range(0, n, args.batch):
            stream.feed("/t/block64/trace_steps_0_64.jsonl", lines[i : i + args.batch], i + 1)
        assert stream.invalid == 0, stream.first

    results = {
        "json.loads (baseline)": rate(lambda: [json.loads(x) for x in lines], n),
        "orjson.loads": rate(lambda: [orjson.loads(x) for x in lines], n),
        "typed decode, no positions": rate(lambda: [_REST.decode(x) for x in lines], n),
        "dsa feed: parse+validate+aggregate": rate(feed, n),
    }
    base = results["json.loads (baseline)"]
    for name, value in results.items():
        print(f"{name:38s} {value:10,.0f} records/s   x{value / base:5.2f} json.loads")


if __name__ == "__main__":
    main()
