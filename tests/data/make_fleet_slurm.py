"""Records the real fleet and Slurm runs the console tests replay (as root, with sshd, slurm-wlm
and munge installed: python tests/data/make_fleet_slurm.py).

fleet_run/: a "command" run of 4 cells over two sshd hosts, each in its own mount namespace
(own /tmp) sharing a home; gpu-a dies under its batch (link down for good, its processes
killed), its cells are requeued on gpu-b, the run passes.
slurm_run/: a "command" run of 2 cells as a Slurm job array on a one-node cluster; cell 1
completes, cell 2 outlives its time limit: TIMEOUT, exit 3.
Only run.json and events.jsonl are kept (what replay reads).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import slurm  # noqa: E402
from runhelp import cli_env, events, run_dirs, spawn, wait_for  # noqa: E402
from sshd import CuttableProxy, make_ssh_home, start_host, start_sshd  # noqa: E402
from test_fleet import kill_member, lines_preset, members  # noqa: E402
from test_slurm import TARGET, running, sleepy  # noqa: E402


def keep(local_dir: Path, name: str) -> None:
    dest = HERE / name
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    for file in ("run.json", "events.jsonl"):
        shutil.copy(local_dir / file, dest / file)
    print(f"wrote {dest}")


def fleet_run(base: Path) -> None:
    main = start_sshd(base / "sshd")
    hosts = {n: start_host(base / n, main, base) for n in ("gpu-a", "gpu-b")}
    proxies = {n: CuttableProxy(s.host, s.port).start() for n, s in hosts.items()}
    try:
        home = make_ssh_home(main, base / "home")
        for name, server in hosts.items():
            home.add_alias(name, proxies[name].port)
            with home.known_hosts.open("a") as f:
                f.write(server.known_hosts_line(proxies[name].port))
        work = base / "fleet"
        work.mkdir()
        preset = lines_preset(work, cells=4, lines=20, pause=0.05, attempts=1)
        out = work / "out"
        console = spawn(
            "run", str(preset), "--target", "gpu-a,gpu-b", "--out", str(out), env=cli_env(home.path)
        )
        local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(
            lambda: any(
                e.get("host") == "gpu-a" for e in events(local_dir) if e["type"] == "output"
            ),
            what="output from gpu-a",
        )
        batch = next(m["member"] for m in members(local_dir) if m["host"] == "gpu-a")
        proxies["gpu-a"].pause()
        proxies["gpu-a"].cut()
        kill_member(batch)
        console.communicate(timeout=120)
        assert console.returncode == 0, console.returncode
        keep(local_dir, "fleet_run")
    finally:
        for proxy in proxies.values():
            proxy.stop()
        for server in [*hosts.values(), main]:
            server.stop()


def slurm_run(base: Path) -> None:
    cluster = slurm.start_cluster(base / "slurm")
    try:
        work = base / "slurm-run"
        work.mkdir()
        preset = sleepy(work, cells=2, sleep=1, extra='time_limit = "1"')
        text = (
            preset.read_text().replace("s = [1]", "s = [1, 300]").replace("n = [1, 2]", "n = [1]")
        )
        preset.write_text(text)
        out = work / "out"
        home = work / "home"
        home.mkdir()
        console = spawn(
            "run",
            str(preset),
            "--target",
            TARGET,
            "--out",
            str(out),
            env=cli_env(home, **cluster.env),
        )
        local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(lambda: running(local_dir, {1}), timeout=60, what="cell 2 running")
        job = (Path(events(local_dir)[0]["remote_dir"]) / "slurm" / "job_id").read_text().split()[0]
        cluster.expire(f"{job}_1")
        console.communicate(timeout=90)
        assert console.returncode == 3, console.returncode
        keep(local_dir, "slurm_run")
    finally:
        cluster.stop()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="tracedeck-data-", dir="/tmp") as tmp:
        fleet_run(Path(tmp))
        slurm_run(Path(tmp))
