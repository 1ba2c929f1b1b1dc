"""Link cuts and console kills against a real sshd: lines lost, lines duplicated, processes left.

    python bench/bench_link_cuts.py [--runs 4] [--cuts 10] [--kills 4]

Each run follows 3 cells of numbered lines over a cuttable proxy to a real OpenSSH sshd on
loopback. While it runs, the link is cut every second (`--cuts` times); on every other run the
console is also killed (`--kills` times) and resumed with `tracedeck attach`. At the end the
record must hold every line once and in order, the run's processes must be gone and its lock
free. The baseline, in the same run, is the same runs with no fault: the ratio is the time a
faulted run took over an unfaulted one (what resuming costs).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from faults import lock_free, record_of  # noqa: E402
from runhelp import cli_env, events, run_alive, run_dirs, spawn, tracedeck, wait_for  # noqa: E402
from sshd import CuttableProxy, make_ssh_home, start_sshd  # noqa: E402

PRESET = """
[preset]
name = "soak"
kind = "command"
[target]
runs = "{tmp}/remote"
lock = "{tmp}/lock"
reconnect_attempts = 20
connect_timeout_s = 5
keepalive_s = 1
[engine]
command = "sh -c 'i=1; while [ $i -le {lines} ]; do echo \\"cell {{n}} line $i\\"; i=$((i+1)); sleep 0.01; done'"
[matrix]
n = [1, 2, 3]
"""


def one_run(tmp: Path, spec: str, env: dict[str, str], cuts: int, kills: int, proxy) -> dict:  # type: ignore[no-untyped-def]
    lines = 600
    preset = tmp / "soak.toml"
    preset.write_text(PRESET.format(tmp=tmp, lines=lines))
    out = tmp / "out"
    started = time.monotonic()
    console = spawn("run", str(preset), "--target", spec, "--out", str(out), env=env)
    local = wait_for(lambda: run_dirs(out), what="run dir")[0]
    done_cuts = done_kills = tick = 0
    while console.poll() is None and (done_cuts < cuts or done_kills < kills):
        time.sleep(1.0)
        tick += 1
        if done_cuts < cuts:
            proxy.cut()
            done_cuts += 1
        if done_kills < kills and tick % 2 == 0:
            console.send_signal(signal.SIGKILL)
            console.wait()
            done_kills += 1
            console = spawn("attach", str(local), env=env)
    console.communicate(timeout=300)
    if console.returncode != 0:  # the last console may have died between cuts: resume once more
        again = tracedeck("attach", str(local), env=env, timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
    took = time.monotonic() - started
    record = record_of(local)
    wait_for(lambda: not run_alive(record["run_id"]), what="the run's processes to end")
    seen = [line for e in events(local) if e["type"] == "output" for line in e["lines"]]
    want = [f"cell {n} line {i}" for n in (1, 2, 3) for i in range(1, lines + 1)]
    counts = Counter(seen)
    return {
        "seconds": took,
        "cuts": done_cuts,
        "kills": done_kills,
        "lost": sum(1 for line in want if line not in counts),
        "duplicated": sum(c - 1 for c in counts.values() if c > 1),
        "in_order": seen == want,
        "leaked": int(run_alive(record["run_id"])),
        "lock_free": lock_free(record["lock"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--cuts", type=int, default=10)
    parser.add_argument("--kills", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tracedeck-soak-") as name:
        tmp = Path(name)
        server = start_sshd(tmp / "sshd")
        home = make_ssh_home(server, tmp / "home")
        proxy = CuttableProxy(server.host, server.port).start()
        with (home.known_hosts).open("a") as f:
            f.write(server.known_hosts_line(proxy.port))
        env = cli_env(home.path)
        env.pop("SSH_AUTH_SOCK", None)
        try:
            plain, faulted = [], []
            for i in range(args.runs):
                base = tmp / f"base{i}"
                base.mkdir()
                plain.append(one_run(base, proxy.spec, env, 0, 0, proxy))
                run = tmp / f"run{i}"
                run.mkdir()
                kills = args.kills if i % 2 else 0
                faulted.append(one_run(run, proxy.spec, env, args.cuts, kills, proxy))
                r = faulted[-1]
                print(
                    f"run {i + 1}: {r['cuts']} cuts, {r['kills']} console kills: lost {r['lost']}, "
                    f"duplicated {r['duplicated']}, in order {r['in_order']}, processes left "
                    f"{r['leaked']}, lock free {r['lock_free']}, {r['seconds']:.1f}s "
                    f"(unfaulted {plain[-1]['seconds']:.1f}s)"
                )
        finally:
            proxy.stop()
            server.stop()
    total = {
        k: sum(r[k] for r in faulted) for k in ("cuts", "kills", "lost", "duplicated", "leaked")
    }
    ratio = sum(r["seconds"] for r in faulted) / sum(r["seconds"] for r in plain)
    print(
        f"total: {total['cuts']} link cuts, {total['kills']} console kills over {args.runs} runs: "
        f"{total['lost']} lines lost, {total['duplicated']} duplicated, {total['leaked']} runs with "
        f"processes left, every lock free: {all(r['lock_free'] for r in faulted)}"
    )
    print(f"time faulted / unfaulted: {ratio:.2f}x")
    if total["lost"] or total["duplicated"] or total["leaked"]:
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
