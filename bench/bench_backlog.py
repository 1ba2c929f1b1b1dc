"""Peak memory following a 2-million-line burst, and attaching after it, against a baseline.

    python bench/bench_backlog.py [--lines 2000000]

A cell writes the burst to stdout as fast as it can; `tracedeck run` follows and records it,
then the record is cut back to before the burst and `tracedeck attach` reads it all again from
the host. Each prints its peak RSS (the process and what it waited for). The baseline, in the
same run, is what reading the backlog in one go costs (the follower before bounded reads):
the file read whole and split into lines. The ratio is baseline / tracedeck.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BURST = """
import sys
line = "x" * 120
for i in range(int(sys.argv[1]) // 1000):
    sys.stdout.write("".join(f"{i * 1000 + j:09d} {line}\\n" for j in range(1000)))
"""

PRESET = """
[preset]
name = "burst"
kind = "command"
[target]
runs = "{tmp}/remote"
lock = "{tmp}/lock"
[engine]
command = "{python} {burst} {lines}"
[matrix]
n = [1]
"""

MEASURE = """
import resource, subprocess, sys
with open(sys.argv[1], "wb") as sink:
    done = subprocess.run(sys.argv[2:], stdout=sink, stderr=subprocess.STDOUT)
print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""

ONE_GO = """
import sys
data = open(sys.argv[1], "rb").read()
lines = [line.decode() for line in data.split(b"\\n")]
print(len(lines))
"""


def measured(tmp: Path, name: str, *argv: str) -> tuple[float, float]:
    """(peak RSS MiB, seconds) of a command run in a fresh parent."""
    measure = tmp / "measure.py"
    measure.write_text(MEASURE)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(measure), str(tmp / f"{name}.log"), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = time.perf_counter() - start
    code, kib = done.stdout.split()
    if int(code) != 0:
        raise SystemExit(f"{name} failed: {(tmp / f'{name}.log').read_text()[-2000:]}")
    return int(kib) / 1024, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="td-backlog-") as name:
        tmp = Path(name)
        burst = tmp / "burst.py"
        burst.write_text(BURST)
        preset = tmp / "burst.toml"
        preset.write_text(
            PRESET.format(tmp=tmp, python=sys.executable, burst=burst, lines=args.lines)
        )
        out = tmp / "out"
        tracedeck = [sys.executable, "-m", "console.cli"]
        run_rss, run_s = measured(tmp, "run", *tracedeck, "run", str(preset), "--out", str(out))
        local = next(out.glob("**/run.json")).parent
        stdout_log = next((tmp / "remote").glob("*/cells/000/stdout.log"))
        size_mib = stdout_log.stat().st_size / (1 << 20)
        events = local / "events.jsonl"
        events.write_bytes(b"".join(line + b"\n" for line in events.read_bytes().splitlines()[:2]))
        attach_rss, attach_s = measured(tmp, "attach", *tracedeck, "attach", str(local))
        one_go = tmp / "one_go.py"
        one_go.write_text(ONE_GO)
        base_rss, base_s = measured(tmp, "one_go", sys.executable, str(one_go), str(stdout_log))
    print(f"backlog: {args.lines} lines, {size_mib:.0f} MiB of output")
    print(f"baseline, the backlog read in one go:   peak {base_rss:7.0f} MiB  {base_s:6.1f} s")
    print(f"tracedeck run following the burst:      peak {run_rss:7.0f} MiB  {run_s:6.1f} s")
    print(f"tracedeck attach after the burst:       peak {attach_rss:7.0f} MiB  {attach_s:6.1f} s")
    print(
        f"ratio baseline/run {base_rss / run_rss:.2f}x, baseline/attach "
        f"{base_rss / attach_rss:.2f}x (goal: run and attach under 200 MiB)"
    )
    return 0 if max(run_rss, attach_rss) < 200 else 1


if __name__ == "__main__":
    sys.exit(main())
