"""DSA console: the DSA panel under a sustained 20,000 records/s, drained on the run screen's tick.

Digests of 100-record batches (made once by the DSA judge from 2048-position records) are
offered at --rate records/s into a buffer; a 15 Hz tick folds them into the panel and redraws,
as the run screen does. Prints the worst and p99 gap between ticks (responsive: under 100 ms),
the redraw cost, and RSS at the start and end (flat: the aggregates are bounded).

    python bench/bench_dsa_console.py [--rate 20000] [--seconds 10]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections import deque
from pathlib import Path

from textual.app import App, ComposeResult

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dsa_ingest import make_lines  # noqa: E402

from analysis.dsa_stream import TraceStream  # noqa: E402
from console.panels.dsa_trace import DsaPanel  # noqa: E402
from runners.events import TraceBatch  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Bench(App[None]):
    def __init__(self, digests: list[dict], rate: float, seconds: float) -> None:
        super().__init__()
        self.digests, self.rate, self.seconds = digests, rate, seconds
        self.buffer: deque[TraceBatch] = deque()
        self.ticks: list[tuple[float, float]] = []
        self.offered = 0
        self.rss: list[float] = []

    def compose(self) -> ComposeResult:
        yield DsaPanel(id="kind-panel")

    def on_mount(self) -> None:
        self.t0 = time.perf_counter()
        self.set_interval(1 / 100, self.offer)
        self.set_interval(1 / 15, self.drain)

    def offer(self) -> None:
        due = int((time.perf_counter() - self.t0) * self.rate / 100)
        while self.offered < due:
            d = self.digests[self.offered % len(self.digests)]
            self.buffer.append(
                TraceBatch(
                    cell=0,
                    file="/t/block64/trace_steps_0_64.jsonl",
                    first_line=1,
                    last_line=100,
                    end_offset=self.offered + 1,
                    digest=d,
                )
            )
            self.offered += 1

    def drain(self) -> None:
        start = time.perf_counter()
        panel = self.query_one(DsaPanel)
        while self.buffer:
            panel.fold(self.buffer.popleft())
        panel.show_changes()
        end = time.perf_counter()
        self.ticks.append((start, end))
        if len(self.ticks) % 15 == 0:
            self.rss.append(rss_mb())
        if end - self.t0 > self.seconds:
            self.exit()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=20000)
    p.add_argument("--seconds", type=float, default=10)
    args = p.parse_args()
    lines = make_lines(1220)
    stream = TraceStream(topk=2048, layers=61)
    digests = [
        stream.feed("/t/block64/trace_steps_0_64.jsonl", lines[i : i + 100], i + 1)
        for i in range(0, 1200, 100)
    ]
    app = Bench(digests, args.rate, args.seconds)
    app.run(headless=True, size=(120, 40))
    starts = [s for s, _ in app.ticks]
    gaps = sorted(b - a for a, b in zip(starts, starts[1:], strict=False))
    costs = sorted(e - s for s, e in app.ticks)
    folded = app.offered - len(app.buffer)
    print(
        f"offered {app.offered * 100:,} records in {args.seconds:.0f}s ({args.rate:,.0f}/s), folded {folded * 100:,}"
    )
    print(
        f"tick gap: worst {gaps[-1] * 1e3:.1f} ms, p99 {gaps[int(len(gaps) * 0.99)] * 1e3:.1f} ms (target < 100 ms; tick 66.7 ms)"
    )
    print(
        f"fold+redraw per tick: median {costs[len(costs) // 2] * 1e3:.1f} ms, worst {costs[-1] * 1e3:.1f} ms"
    )
    print(
        f"RSS: {app.rss[0]:.0f} MB after 1 s, {app.rss[-1]:.0f} MB at the end (ratio x{app.rss[-1] / app.rss[0]:.2f})"
    )


if __name__ == "__main__":
    main()
