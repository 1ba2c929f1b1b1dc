"""Trace latency: a JSONL line appended on the target -> its event in the consumer.

Runs real sessions in one process, over SSH to a real OpenSSH sshd on loopback and on the local
target, each twice: woken by the target's change notifier (runners/changes.py, the default), and
polling only (the baseline: how the follower worked before). The engine appends lines stamped
with the time they were written; the consumer stamps the time each TraceBatch event reaches it.
Prints p50/p95/max for each and the ratios. Run: python bench/bench_trace_latency.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import orjson  # noqa: E402

from runners import changes  # noqa: E402
from runners.events import Event, TraceBatch  # noqa: E402
from runners.kinds import load_preset  # noqa: E402
from runners.run import Run  # noqa: E402

WRITER = """
import json, sys, time
path, count, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
with open(path, "a") as fh:
    for seq in range(count):
        fh.write(json.dumps({"seq": seq, "t_written": time.time()}) + "\\n")
        fh.flush()
        time.sleep(interval)
"""

PRESET = """
[preset]
name = "latency"
kind = "command"

[target]
runs = "{runs}"
lock = "{lock}"
python = "{python}"

[engine]
command = "mkdir -p {{out}} && {{python}} {{writer}} {{out}}/trace.jsonl {{count}} {{interval}}"

[vars]
writer = "{writer}"

[matrix]
count = [{count}]
interval = [{interval}]

[traces]
follow = ["trace.jsonl"]
"""


async def measure(preset_path: Path, spec: str, out: Path) -> list[float]:
    latencies: list[float] = []
    offsets: dict[str, int] = {}

    def consume(event: Event) -> None:
        if isinstance(event, TraceBatch):
            now = time.time()
            # The record keeps offsets, not lines: read the batch's bytes from the file itself
            # (the "remote" is this machine), after stamping the arrival time.
            start = offsets.get(event.file, 0)
            with open(event.file, "rb") as fh:
                fh.seek(start)
                data = fh.read(event.end_offset - start)
            offsets[event.file] = event.end_offset
            latencies.extend(now - orjson.loads(line)["t_written"] for line in data.splitlines())

    session = Run.create(load_preset(preset_path), spec, out, consume)
    try:
        await session.launch()
        result = await session.follow()
    finally:
        await session.close()
    if result.exit_code != 0:
        raise SystemExit(f"{spec}: run ended {result.verdict}: {result.summary}")
    return latencies


def describe(name: str, values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    p50 = statistics.median(ordered) * 1000
    p95 = ordered[max(0, int(len(ordered) * 0.95) - 1)] * 1000
    worst = ordered[-1] * 1000
    print(
        f"{name:<13} lines={len(values):>4}  p50={p50:7.1f} ms  p95={p95:7.1f} ms  max={worst:7.1f} ms"
    )
    return p50, p95, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300, help="lines per target")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between lines")
    args = parser.parse_args()

    from sshd import make_ssh_home, start_sshd

    with tempfile.TemporaryDirectory(prefix="td-latency-") as tmp_name:
        tmp = Path(tmp_name)
        writer = tmp / "writer.py"
        writer.write_text(WRITER)
        preset = tmp / "latency.toml"
        preset.write_text(
            PRESET.format(
                runs=tmp / "runs",
                lock=tmp / "lock",
                python=sys.executable,
                writer=writer,
                count=args.count,
                interval=args.interval,
            )
        )
        server = start_sshd(tmp / "sshd")
        try:
            home = make_ssh_home(server, tmp / "home")
            os.environ["HOME"] = str(home.path)
            os.environ.pop("SSH_AUTH_SOCK", None)
            got = {}
            for woken in (False, True):
                changes.ENABLED = woken
                for name, spec in (("local", "local"), ("ssh", server.spec)):
                    out = tmp / f"out-{name}-{woken}"
                    got[name, woken] = asyncio.run(measure(preset, spec, out))
        finally:
            server.stop()
    print(f"trace latency, {args.count} lines every {args.interval * 1000:.0f} ms")
    p95 = {}
    for (name, woken), values in got.items():
        label = f"{name} {'woken' if woken else 'polled'}"
        p95[name, woken] = describe(label, values)[1]
    for name in ("local", "ssh"):
        ratio = p95[name, False] / p95[name, True]
        print(f"{name}: p95 polled / woken: {ratio:.1f}x")
    ok = p95["ssh", True] < 100
    print(f"ssh woken p95 {p95['ssh', True]:.1f} ms (goal < 100 ms): {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
