"""Writes tests/data/dsa_run/, the recorded dsa_trace run the DSA console tests replay
(run: python tests/data/make_dsa_run.py).

Three requests of a 6-layer model tracing top-64 of ~300 tokens in blocks of 16, two shards,
judged by the real DSA judge (TraceBook) as the engine writes them in batches of 9 lines;
request 2's third step has one record whose selected_block_ids is off by one, so the run is
TRACE_INVALID with a first invalid record. Times are fixed so the screens are the same on
every machine.
"""

from __future__ import annotations

import hashlib
import random
import sys
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))

from dsa_writer import record  # noqa: E402

from analysis.dsa_stream import TraceStream  # noqa: E402
from runners.events import (  # noqa: E402
    CellFinished,
    CellStarted,
    Event,
    LockAcquired,
    RunFinished,
    RunStarted,
    TraceBatch,
)
from runners.kinds.dsa_trace import TRACE_INVALID, TraceBook  # noqa: E402

T0 = 1_780_000_000.0 + 3000
RUN_ID = "20260528-215000-dsa_smoke-0003"
ARTIFACTS = f"/home/operator/.tracedeck/runs/{RUN_ID}/artifacts"
LAYERS, STEPS, TOPK, BS, PROMPT = 6, 4, 64, 16, 300


def shards() -> dict[str, list[bytes]]:
    rng = random.Random(7)
    out: dict[str, list[bytes]] = {}
    for start, end in ((0, 2), (2, 3)):
        lines = out.setdefault(f"{ARTIFACTS}/dsa/block{BS}/trace_steps_{start}_{end}.jsonl", [])
        for request in range(start, end):
            key = hashlib.sha1(f"prefix-{min(request, 1)}".encode()).hexdigest()
            for s in range(STEPS):
                latency = 41_000 + 1_000 * s + 17 * request
                for layer in range(LAYERS):
                    step = PROMPT + 5 * request + s
                    rec = record(
                        request, layer, step, TOPK, BS, 64, request == 2, rng, latency, key
                    )
                    if (request, s, layer) == (2, 2, 3):
                        rec["selected_block_ids"] = [b + 1 for b in rec["selected_block_ids"]]
                        rec["kv_fetch"]["hbm"]["hit_blocks"] = rec["selected_block_ids"]
                    lines.append(orjson.dumps(rec))
    return out


def main() -> None:
    t = T0
    holder = {
        "user": "operator",
        "console_host": "laptop",
        "preset": "dsa_smoke",
        "run_id": RUN_ID,
        "started_at": "2026-05-28T21:50:00+00:00",
        "pgid": 4343,
    }
    command = "python -m runners.reference dsa --trace-enable --trace-out {out}/dsa"
    events: list[Event] = [
        RunStarted(
            run_id=RUN_ID,
            preset="dsa_smoke",
            kind="dsa_trace",
            target="mi300x",
            local_dir="/home/operator/.local/share/tracedeck/runs/dsa_run",
            remote_dir=f"/home/operator/.tracedeck/runs/{RUN_ID}",
            cells=[{"index": 0, "params": {"workload": "ruler"}, "command": command}],
            profile="rocm",
            env={},
            t=t,
        ),
        LockAcquired(lock="/tmp/tracedeck.lock", holder=holder, t=t + 0.1),
        CellStarted(cell=0, params={"workload": "ruler"}, command=command, t=t + 0.2),
    ]
    book = TraceBook(TOPK, LAYERS)
    for path, lines in shards().items():
        offset = 0
        for i in range(0, len(lines), 9):
            batch = lines[i : i + 9]
            offset += sum(len(x) + 1 for x in batch)
            t += 0.1
            events.append(
                TraceBatch(
                    cell=0,
                    file=path,
                    first_line=i + 1,
                    last_line=i + len(batch),
                    end_offset=offset,
                    digest=book.feed(path, batch, i + 1),
                    t=t,
                )
            )
    t += 0.5
    events.append(CellFinished(cell=0, state="passed", exit_code=0, duration_s=t - T0, t=t))
    traces = [_trace(folder, stream) for folder, stream in sorted(book.streams.items())]
    summary: dict[str, Any] = {"cells": {"passed": 1}, "traces": traces, **book.totals()}
    events.append(RunFinished(verdict=TRACE_INVALID, exit_code=1, summary=summary, t=t + 0.1))
    folder = HERE / "dsa_run"
    folder.mkdir(exist_ok=True)
    run = {
        "run_id": RUN_ID,
        "preset": "dsa_smoke",
        "kind": "dsa_trace",
        "source": "presets/dsa_smoke.toml",
        "overrides": [],
        "preset_data": {},
        "target": "mi300x",
        "remote_dir": f"/home/operator/.tracedeck/runs/{RUN_ID}",
        "lock": "/tmp/tracedeck.lock",
        "local_dir": "/home/operator/.local/share/tracedeck/runs/dsa_run",
        "started_at": "2026-05-28T21:50:00+00:00",
        "user": "operator",
        "console_host": "laptop",
        "date": "2026-05-28",
        "extra": {"workdir": "/home/operator", "python": "python3"},
    }
    (folder / "run.json").write_bytes(orjson.dumps(run, option=orjson.OPT_INDENT_2) + b"\n")
    (folder / "events.jsonl").write_bytes(b"".join(e.to_json() + b"\n" for e in events))


def _trace(folder: str, stream: TraceStream) -> dict[str, Any]:
    problems = stream.finish(3, None)
    return {
        "dir": folder,
        "verdict": TRACE_INVALID,
        "records": stream.records,
        "invalid": stream.invalid,
        "requests": len(stream.reqs),
        "layers": stream.layers,
        "first_fail": stream.first or (problems[0] if problems else None),
        "problems": problems[:20],
        "warnings": [],
    }


if __name__ == "__main__":
    main()
