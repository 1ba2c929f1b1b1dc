"""Console throughput: replay a synthetic 100k-event run through the app headless (App.run_test).

Prints events per second through the Run screen against a baseline (reading events.jsonl and
folding it into a RunModel with no UI), the mean and worst gap between the screen's drain ticks
(15 Hz target), the longest drain, the worst event-loop stall seen by a 10 ms heartbeat (what
bounds how late a frame can be) and the longest callback in CPU time, both from the screen's
first paint on (that paint's own cost is printed apart). A second, paced pass (about 5,000
events/s, like a chatty engine being followed) shows the same figures for live-like load.

    python bench/bench_console.py [--cells 100] [--events 100000] [--size 120x40]

Where the time went (issue 23, cProfile/pyinstrument and a per-callback CPU clock,
bench/loopwatch.py): the model fold was never the cost (~2M events/s); decoding was (an import
statement per event in event_from_dict; cyclic-GC passes over the events decoded so far, about
half of read_events). The stalls were not the drain either: they were the screen's repaint
(Screen._on_timer_update: 70-190 ms of CPU) re-rendering every visible DataTable cell after any
one changed (DataTable keys its caches by one update counter), full garbage collections walking
the run screen's widgets and DataTable's 1,000-line/10,000-cell caches of stale renders (50-100 ms
each), the footer rebuilt (tens of ms) on drain ticks where nothing it shows changed, and a
thread Textual's Log starts per write to measure line widths (holding the interpreter).

Then (a per-callback CPU clock and cProfile of each repaint over 15 ms, which widgets drew and
whether it was a layout): nearly every slow repaint was a full layout. A Log or DataTable that
grows sets its virtual size, which Textual treats as a layout change, and the verdict table
(height auto) grew by a row per judged pair, moving everything below it: each layout redrew
every widget whose map entry changed (the cells table, the log, the panel: 50-350 ms). Also
DataTable drew its header cells again and joined every visible line again after any update
(its caches are keyed by one update counter), Log worked out its widget style for each line
(a walk over every ancestor), and the footer rebuilt its keys (its styles re-applied: tens of
ms) several times while a run streamed, offering the same keys. In the fast pass, most of each
drain was the log: up to 5,000 lines formatted and written a tick, pushed out of the
scrollback by the next tick's (now written a few times a second while a backlog drains).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loopwatch import LoopWatch  # noqa: E402

from console.app import create_app  # noqa: E402
from console.run_model import RunModel  # noqa: E402
from console.screens.run import TICK_HZ, RunScreen  # noqa: E402
from console.widgets.banner import VerdictBanner  # noqa: E402
from runners.events import (  # noqa: E402
    CellFinished,
    CellStarted,
    Event,
    OutputLines,
    RunFinished,
    RunStarted,
)
from runners.kinds import event_types  # noqa: E402
from runners.kinds.equivalence import PairVerdict  # noqa: E402
from runners.record import read_events  # noqa: E402

THRESHOLDS = {"p99_abs_diff_max": 0.001, "max_abs_diff_max": 0.005, "top1_agreement_min": 0.999}


def synthetic_run(folder: Path, cells: int, total: int) -> int:
    """Write run.json and events.jsonl for a run of `cells` cells and about `total` events."""
    t = 1_780_000_000.0
    per_cell = max(1, (total - 2) // cells - 3)
    params = [
        {"kv_aligned": i % 2, "seed": i // 4, "mode": ("prefill", "decode")[(i // 2) % 2]}
        for i in range(cells)
    ]
    events: list[Event] = [
        RunStarted(
            run_id="bench",
            preset="bench",
            kind="equivalence",
            target="local",
            local_dir=str(folder),
            remote_dir="/tmp/bench",
            cells=[{"index": i, "params": p, "command": "engine"} for i, p in enumerate(params)],
            profile="none",
            env={},
            t=t,
        )
    ]
    for i, p in enumerate(params):
        events.append(CellStarted(cell=i, params=p, command="engine", t=t))
        for n in range(per_cell):
            t += 0.001
            lines = [f"cell {i} step {n} token={n * 7 % 32000} logit={n * 0.001:.3f}"]
            if n % 10 == 0:
                lines.append(f"cell {i} step {n} [checkpoint] kv={n % 4096}")
            events.append(
                OutputLines(
                    cell=i, stream="stdout", lines=lines, file="stdout.log", end_offset=n * 64, t=t
                )
            )
        events.append(CellFinished(cell=i, state="passed", exit_code=0, duration_s=1.0, t=t))
        if p["mode"] == "decode":
            word = "PASS_EQUIV" if p["kv_aligned"] else "EXPECTED_DRIFT"
            events.append(
                PairVerdict(
                    seed=p["seed"],
                    kv_aligned=p["kv_aligned"],
                    verdict=word,
                    metrics={
                        "max_abs_diff": 0.001,
                        "p99_abs_diff": 0.0005,
                        "top1_agreement": 1.0,
                        "cos_sim_mean": 0.99999,
                        "pair_count": 128,
                    },
                    thresholds=THRESHOLDS,
                    first_fail=None,
                    metrics_path="m.json",
                    t=t,
                )
            )
    events.append(RunFinished(verdict="PASS_GUARDRAIL", exit_code=0, summary={}, t=t + 0.1))
    record = {
        "run_id": "bench",
        "preset": "bench",
        "kind": "equivalence",
        "source": "bench",
        "overrides": [],
        "preset_data": {},
        "target": "local",
        "remote_dir": "/tmp/bench",
        "lock": "/tmp/bench.lock",
        "local_dir": str(folder),
        "started_at": "2026-01-01",
        "user": "bench",
        "console_host": "bench",
        "date": "2026-01-01",
        "extra": {},
    }
    (folder / "run.json").write_bytes(orjson.dumps(record))
    with open(folder / "events.jsonl", "wb") as fh:
        for event in events:
            fh.write(event.to_json() + b"\n")
    return len(events)


def model_only(folder: Path) -> tuple[int, float, float]:
    """The baseline: read and parse events.jsonl and fold it into a RunModel, no UI; returns the
    events, the seconds and the CPU seconds it took."""
    start, cpu = time.perf_counter(), time.process_time()
    events = read_events(folder / "events.jsonl", event_types()).events
    model = RunModel()
    for event in events:
        model.apply(event)
    return len(events), time.perf_counter() - start, time.process_time() - cpu


async def through_app(folder: Path, size: tuple[int, int], speed: float = 0) -> dict[str, float]:
    app = create_app(out_dir=folder / "out", replay_dir=folder, speed=speed)
    watch = LoopWatch()
    async with app.run_test(size=size) as pilot:
        start, cpu = time.perf_counter(), time.process_time()
        while not isinstance(app.screen, RunScreen):
            await asyncio.sleep(0.001)
        watch.start()
        screen = app.screen
        screen.record_ticks = True
        banner = screen.query_one("#banner", VerdictBanner)
        while banner.verdict is None or screen.buffer:
            await asyncio.sleep(0.01)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        watch.stop()
        await pilot.pause()
        ticks = screen.ticks
        gaps = [b[0] - a[0] for a, b in zip(ticks, ticks[1:], strict=False)]
        work = [end - begin for begin, end in ticks]
        return {
            "events": float(screen.model.events),
            "seconds": elapsed,
            "cpu_seconds": cpu,
            "ticks": float(len(ticks)),
            "worst_tick_gap": max(gaps) if gaps else float("nan"),
            "mean_tick_gap": sum(gaps) / len(gaps) if gaps else float("nan"),
            "worst_stall": watch.worst_stall,
            "worst_callback_cpu": watch.worst_callback_cpu,
            "worst_callback": watch.worst_callback,  # type: ignore[dict-item]
            "first_paint_cpu": watch.first_paint_cpu,
            "worst_drain": max(work) if work else float("nan"),
            "log_lines": float(screen.model.log_total),
        }


def report(label: str, result: dict[str, float]) -> None:
    print(
        f"{label}: drain ticks {int(result['ticks'])} (target every {1000 / TICK_HZ:.0f} ms), "
        f"mean gap {result['mean_tick_gap'] * 1000:.0f} ms, "
        f"worst gap {result['worst_tick_gap'] * 1000:.0f} ms; "
        f"longest drain {result['worst_drain'] * 1000:.0f} ms; "
        f"worst event-loop stall {result['worst_stall'] * 1000:.0f} ms, longest callback "
        f"{result['worst_callback_cpu'] * 1000:.0f} ms of CPU ({result['worst_callback']}); "
        f"the screen's first paint {result['first_paint_cpu'] * 1000:.0f} ms of CPU"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--size", default="120x40")
    parser.add_argument(
        "--paced-events", type=int, default=20_000, help="events of the paced (live-like) pass"
    )
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    size = (width, height)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        count = synthetic_run(folder, args.cells, args.events)
        n, model_s, model_cpu = model_only(folder)
        result = asyncio.run(through_app(folder, size))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paced_count = synthetic_run(folder, 20, args.paced_events)
        # Output events are 1 ms apart in the recording: speed 5 feeds 5,000 events/s.
        paced = asyncio.run(through_app(folder, size, speed=5.0))
    rate = result["events"] / result["seconds"]
    base = n / model_s
    # per CPU second of this process too: what a loaded machine changes least
    cpu_rate, cpu_base = result["events"] / result["cpu_seconds"], n / model_cpu
    print(
        f"synthetic run: {count} events ({args.cells} cells, "
        f"{int(result['log_lines'])} log lines), screen {width}x{height}; "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    )
    print(
        f"read + model, no UI (baseline): {base:10,.0f} events/s  ({cpu_base:,.0f} per CPU second)"
    )
    print(
        f"through the Run screen:          {rate:10,.0f} events/s  "
        f"({result['seconds']:.2f} s, {rate / base:.2f}x the baseline; "
        f"{cpu_rate:,.0f} per CPU second, {cpu_rate / cpu_base:.2f}x)"
    )
    report("as fast as possible", result)
    report(f"paced at ~5,000 events/s ({paced_count} events)", paced)
    for label, r, total in (("fast", result, count), ("paced", paced, paced_count)):
        if r["events"] != total:
            raise SystemExit(
                f"{label}: only {int(r['events'])} of {total} events reached the model"
            )


if __name__ == "__main__":
    main()
