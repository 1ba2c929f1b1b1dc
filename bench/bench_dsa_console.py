"""DSA console under a sustained 20,000 records/s (2048-position records), two ways:

run   the real run screen (create_app, RunScreen, its 15 Hz drain, RunModel and the DSA panel)
      replaying a recorded dsa_trace run paced at --rate records/s: TraceBatch digests of 100
      records each, made once by the DSA judge from real records, i.e. what the console folds
      when it follows or reattaches to a run whose engine writes that fast.
watch `tracedeck watch`'s console: a writer process appends records to a shard at --rate
      records/s while the console follows, judges (worker thread) and draws them; this also
      shows how many records/s one core can judge while the screen keeps drawing.
backlog  the same over a shard written beforehand (no writer competing for the 2 cores): the
      judge runs flat out while the screen draws.
live  a run launched from the presets screen whose engine writes --rate records/s: the run's
      session follows and judges in the console's event loop (the lead's follower), so this
      shows what a live run at that rate does to the run screen.

Prints the gaps between drain ticks (responsive: none over 100 ms; the tick is 66.7 ms), the
drain cost, the worst event-loop stall and the longest callback in CPU time (bench/loopwatch.py),
the records folded, RSS after 1 s and at the end (flat: the aggregates are bounded), and the load
average. The live mode runs twice: judged in a thread beside the loop (the baseline), then in
the judge's helper process; for each it prints the CPU this console, the judge's helper, the
engine and the whole machine used over the stretch (bench/cpu_share.py, from /proc), and for the
helper the judge's CPU per record and the cores --rate would need at those costs, beside a
control of what two spinning processes get on the machine at that moment.

    python bench/bench_dsa_console.py [--mode run|watch|backlog|live|all] [--rate 20000]
                                      [--seconds 10]

Where the live run's time went (issue 23): judging a batch (TraceStream.feed: parsing the
2048-position records and the checks, about 7,000-10,000 records/s on one core here) ran in a
thread beside the screen's event loop, holding the interpreter the loop needs; folding the
digests (TraceBook.apply) is ~100x cheaper. The judge now feeds a helper process
(runners/dsa_worker.py) and folds its digests back. That helper waited while this process
emitted each batch, and this one while it judged the next (11,700-12,000 records/s kept up
with, against 17,700 in a thread); the follower now hands each batch over as soon as it is read
(Judge.submit_lines), so the two overlap (15,400-16,500, the helper ~95% of a core, this process
~40%). One core still judges one stream (TraceBook.feed: ~21,000 records/s on an idle core),
so a single shard faster than that is judged behind the writer (its rate is printed).
The screen's stalls (per-callback CPU, cProfile of each slow repaint): every panel update was a
layout (Static.update lays the screen out unless told the size stays), and the five histograms
and the layer bars were redrawn in one tick (the layer bars alone 13-18 ms: a span per
character); now text widgets lay out only when their text changes shape and the charts redraw
one per tick while records stream.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_dsa_analyze import cpu_scaling  # noqa: E402
from bench_dsa_ingest import loadavg, make_lines  # noqa: E402
from cpu_share import Stretch, processes  # noqa: E402
from loopwatch import LoopWatch  # noqa: E402

import runners.dsa_worker  # noqa: E402
from console.app import create_app  # noqa: E402
from console.panels.dsa_trace import DsaWatchApp, DsaWatchScreen  # noqa: E402
from console.screens.run import RunScreen  # noqa: E402
from runners.events import (  # noqa: E402
    CellFinished,
    CellStarted,
    Event,
    RunFinished,
    RunStarted,
    TraceBatch,
)
from runners.kinds.dsa_trace import TraceBook  # noqa: E402

BATCH = 100
SHARD = "dsa/block64/trace_steps_0_64.jsonl"


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def recorded_run(folder: Path, rate: float, seconds: float) -> int:
    """A dsa_trace run whose TraceBatch events carry `rate` records/s for `seconds`."""
    lines = make_lines(1220)
    book = TraceBook(2048, 61)
    path = f"/remote/artifacts/{SHARD}"
    digests = [book.feed(path, lines[i : i + BATCH], i + 1) for i in range(0, 1200, BATCH)]
    t0 = 1_780_000_000.0
    events: list[Event] = [
        RunStarted(
            run_id="bench-dsa",
            preset="bench",
            kind="dsa_trace",
            target="local",
            local_dir=str(folder),
            remote_dir="/remote",
            cells=[{"index": 0, "params": {}, "command": "engine"}],
            profile="none",
            env={},
            t=t0,
        ),
        CellStarted(cell=0, params={}, command="engine", t=t0),
    ]
    count = int(rate * seconds / BATCH)
    for i in range(count):
        events.append(
            TraceBatch(
                cell=0,
                file=path,
                first_line=i * BATCH + 1,
                last_line=(i + 1) * BATCH,
                end_offset=(i + 1) * BATCH * 11_000,
                digest=digests[i % len(digests)],
                t=t0 + (i + 1) * BATCH / rate,
            )
        )
    end = t0 + seconds + 0.1
    events.append(CellFinished(cell=0, state="passed", exit_code=0, duration_s=seconds, t=end))
    events.append(RunFinished(verdict="TRACE_OK", exit_code=0, summary={}, t=end + 0.05))
    run = {
        "run_id": "bench-dsa",
        "preset": "bench",
        "kind": "dsa_trace",
        "source": "bench",
        "overrides": [],
        "preset_data": {},
        "target": "local",
        "remote_dir": "/remote",
        "lock": "/tmp/bench.lock",
        "local_dir": str(folder),
        "started_at": "2026-01-01",
        "user": "bench",
        "console_host": "bench",
        "date": "2026-01-01",
        "extra": {},
    }
    (folder / "run.json").write_bytes(orjson.dumps(run))
    with open(folder / "events.jsonl", "wb") as fh:
        for event in events:
            fh.write(event.to_json() + b"\n")
    return count * BATCH


def report(
    label: str,
    ticks: list[tuple[float, float]],
    folded: int,
    rss: list[float],
    watch: LoopWatch | None = None,
) -> None:
    starts = [s for s, _ in ticks]
    gaps = sorted(b - a for a, b in zip(starts, starts[1:], strict=False))
    costs = sorted(e - s for s, e in ticks)
    if not gaps:
        print(f"{label}: no ticks")
        return
    print(
        f"{label}: {len(ticks)} ticks, gap worst {gaps[-1] * 1e3:.1f} ms, "
        f"p99 {gaps[int(len(gaps) * 0.99)] * 1e3:.1f} ms, median {gaps[len(gaps) // 2] * 1e3:.1f} ms"
        f" (target: none over 100 ms); drain median {costs[len(costs) // 2] * 1e3:.1f} ms, "
        f"worst {costs[-1] * 1e3:.1f} ms"
    )
    if watch is not None:
        print(f"  {watch.line()}")
    if rss:
        print(
            f"  RSS {rss[0]:.0f} MB after 1 s, {rss[-1]:.0f} MB at the end; folded {folded:,} records"
        )


async def run_screen(rate: float, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        total = recorded_run(folder, rate, seconds)
        app = create_app(out_dir=folder / "out", replay_dir=folder, speed=1.0)
        rss: list[float] = []
        async with app.run_test(size=(120, 40)) as pilot:
            while not isinstance(app.screen, RunScreen):
                await asyncio.sleep(0.01)
            screen = app.screen
            screen.record_ticks = True
            watch = LoopWatch()
            watch.start()
            start = time.perf_counter()
            while screen.model.finished is None or screen.buffer:
                await asyncio.sleep(0.05)
                if not rss or time.perf_counter() - start >= len(rss):
                    rss.append(rss_mb())
                if time.perf_counter() - start > seconds * 4 + 30:
                    break
            watch.stop()
            await pilot.pause()
            folded = screen.panel.book.totals()["records"]  # type: ignore[attr-defined]
            report(
                f"run screen, {rate:,.0f} records/s for {seconds:g} s",
                screen.ticks,
                folded,
                rss,
                watch,
            )
            if folded != total:
                print(f"  (folded {folded:,} of {total:,})")


WRITER = """
import sys, time
src, dst, rate, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
lines = open(src, "rb").read().splitlines(keepends=True)
t0 = time.monotonic(); n = 0
with open(dst, "ab", buffering=0) as fh:
    while time.monotonic() - t0 < seconds:
        due = int((time.monotonic() - t0) * rate)
        if due > n:
            fh.write(b"".join(lines[i % len(lines)] for i in range(n, due)))
            n = due
        time.sleep(0.005)
print(n)
"""


async def watch_screen(rate: float, seconds: float, backlog: bool = False) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "trace" / "block64"
        folder.mkdir(parents=True)
        src = Path(tmp) / "records.jsonl"
        # one request of 61 layers, its steps repeated: the judge sees a valid stream only for
        # the first pass; later passes are judged too (steps that no longer grow), the same work
        src.write_bytes(b"\n".join(make_lines(610 * 4)) + b"\n")
        shard = folder / "trace_steps_0_64.jsonl"
        shard.touch()
        if backlog:  # all written before the watch starts: it judges flat out, no writer runs
            body = src.read_bytes()
            with open(shard, "wb") as fh:
                for _ in range(int(rate * seconds * 1.5 / (610 * 4)) + 1):
                    fh.write(body)
        pace = ["0", "0"] if backlog else [str(rate), str(seconds)]
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(src), str(shard), *pace],
            stdout=subprocess.PIPE,
            text=True,
        )
        screen = DsaWatchScreen(str(folder.parent), topk=2048, layers=61)
        app = DsaWatchApp(screen)
        rss: list[float] = []
        async with app.run_test(size=(120, 40)) as pilot:
            screen.record_ticks = True
            watch = LoopWatch()
            watch.start()
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                await asyncio.sleep(0.05)
                if time.perf_counter() - start >= len(rss):
                    rss.append(rss_mb())
            watch.stop()
            folded = screen.panel.book.totals()["records"]
            ticks = list(screen.ticks)
            await pilot.press("q")
        written = int(writer.communicate(timeout=60)[0] or 0)
        what = "a backlog written before" if backlog else f"writer at {rate:,.0f} records/s"
        report(f"watch console, {what}, {seconds:g} s", ticks, folded, rss, watch)
        print(
            f"  written {written:,}, judged and folded {folded:,} in {seconds:g} s "
            f"({folded / seconds:,.0f} records/s kept up with while drawing)"
        )


LIVE_PRESET = """
[preset]
name = "bench_dsa_live"
kind = "dsa_trace"
description = "a writer of 2048-position records at a fixed rate"
[target]
host = "local"
python = "{python}"
runs = "{tmp}/runs"
lock = "{tmp}/lock"
[engine]
command = "mkdir -p {{out}}/dsa/block64 && {{python}} {tmp}/writer.py {tmp}/records.jsonl {{out}}/dsa/block64/trace_steps_0_64.jsonl {rate} {seconds}"
[matrix]
n = [1]
[dsa]
topk = 2048
layers = 61
[artifacts]
fetch = ["dsa/block64/summary.json"]
[traces]
follow = ["dsa/block64/trace_steps_*.jsonl"]
"""


async def live_run(rate: float, seconds: float, helper: bool = True) -> float:
    """A run launched from the presets screen whose engine writes `rate` records/s: the session
    follows it (runners/follower.py) and its judge judges each batch in a helper process
    (runners/dsa_worker.py), or, helper False, in a thread beside the screen's loop (the way
    before: the baseline). Returns the records/s kept up with."""
    runners.dsa_worker.USE_HELPER = helper
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "records.jsonl").write_bytes(b"\n".join(make_lines(610 * 4)) + b"\n")
        (folder / "writer.py").write_text(WRITER)
        preset = folder / "bench_dsa_live.toml"
        preset.write_text(
            # the engine writes past the measured stretch, so that its CPU is read while it lives
            LIVE_PRESET.format(python=sys.executable, tmp=tmp, rate=rate, seconds=seconds + 2)
        )
        app = create_app(out_dir=folder / "out", preset_paths=[preset])
        rss: list[float] = []
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.5)
            await pilot.press("ctrl+r")
            while not isinstance(app.screen, RunScreen):
                await asyncio.sleep(0.01)
            screen = app.screen
            screen.record_ticks = True
            watch = LoopWatch()
            watch.start()
            cpu = Stretch()
            cpu.start()
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                await asyncio.sleep(0.05)
                if time.perf_counter() - start >= len(rss):
                    rss.append(rss_mb())
            cpu.stop()
            watch.stop()
            folded = screen.panel.book.totals()["records"]  # type: ignore[attr-defined]
            ticks = list(screen.ticks)
            await screen.stop_following()
        writer = f"{tmp}/writer.py"
        deadline = time.monotonic() + 30
        while any(writer in p.cmd for p in processes().values()):  # it writes into tmp
            if time.monotonic() > deadline:
                raise SystemExit(f"the bench's engine ({writer}) did not end")
            await asyncio.sleep(0.1)
        where = "a helper process" if helper else "a thread beside the screen's loop (baseline)"
        report(
            f"live run screen, engine at {rate:,.0f} records/s for {seconds:g} s, judged in "
            f"{where}",
            ticks,
            folded,
            rss,
            watch,
        )
        print(
            f"  judged and folded {folded:,} in {seconds:g} s ({folded / seconds:,.0f} of "
            f"{rate:,.0f} records/s kept up with)"
        )
        console = cpu.used(os.getpid())
        judge = cpu.used_by("runners.dsa_worker", under=os.getpid()) if helper else 0.0
        engine = cpu.used_by(writer)
        print(
            f"  CPU in cores over the {seconds:g} s: this console {console / seconds:.2f}"
            + (f", its judge helper {judge / seconds:.2f}" if helper else " (judge included)")
            + f", the engine {engine / seconds:.2f}; the machine {cpu.busy / seconds:.2f} of "
            f"{os.cpu_count()}"
        )
        if helper and folded:
            # at the full rate: the judge and this console (which reads at the judge's pace)
            # do rate / kept times their work; the engine already writes at that rate
            judge_at, console_at = judge / folded * rate, console / folded * rate
            print(
                f"  the judge used {judge / folded * 1e6:.0f} us of CPU a record: at "
                f"{rate:,.0f} records/s it needs {judge_at:.2f} cores, this console "
                f"{console_at:.2f} and the engine {engine / seconds:.2f}: "
                f"{judge_at + console_at + engine / seconds:.2f} cores in all"
            )
        return folded / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["run", "watch", "backlog", "live", "all"], default="all")
    p.add_argument("--rate", type=float, default=20000)
    p.add_argument("--seconds", type=float, default=10)
    args = p.parse_args()
    print(f"loadavg before: {loadavg()} ({os.cpu_count()} cores)")
    if args.mode in ("run", "all"):
        asyncio.run(run_screen(args.rate, args.seconds))
    if args.mode in ("watch", "all"):
        asyncio.run(watch_screen(args.rate, args.seconds))
    if args.mode in ("backlog", "all"):
        asyncio.run(watch_screen(args.rate, args.seconds, backlog=True))
    if args.mode in ("live", "all"):
        base = asyncio.run(live_run(args.rate, args.seconds, helper=False))
        kept = asyncio.run(live_run(args.rate, args.seconds))
        print(f"live: judged in a helper process {kept / max(base, 1):.2f}x the baseline's rate")
        print(
            f"control: 2 processes spinning get x{cpu_scaling(2):.2f} one's speed on this "
            "machine now (the cores there are to share)"
        )
    print(f"loadavg after: {loadavg()}")


if __name__ == "__main__":
    main()
