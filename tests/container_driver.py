"""For tests/test_container_host.py, run inside `unshare -pf --mount-proc` (a host that is a container: a pid namespace of its
own, as docker/k8s give an sshd). Prints one JSON line with what it saw."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults import lock_free  # noqa: E402
from runhelp import cli_env, run_dirs, spawn, tracedeck, wait_for, write_lines_preset  # noqa: E402

from runners.preflight import lock_state  # noqa: E402
from runners.targets.local import LocalTarget  # noqa: E402


def probe(tmp: Path) -> dict:
    home = tmp / "home"
    home.mkdir()
    env = cli_env(home)
    lock = tmp / "gpu.lock"
    gate = tmp / "gate"
    preset = write_lines_preset(tmp, lines=1, pause=0, lock=lock)
    cmd = f"while [ ! -e {gate} ]; do sleep 0.05; done"
    console = spawn(
        "run",
        str(preset),
        "--target",
        "local",
        "--out",
        str(tmp / "o"),
        "--set",
        f"engine.command={cmd!r}",
        "--set",
        "matrix.n=[1]",
        env=env,
    )
    try:
        wait_for(lambda: not lock_free(str(lock)), what="the run to hold the lock")
        state = asyncio.run(lock_state(LocalTarget(), str(lock)))
        held_really = not lock_free(str(lock))
        st = tracedeck("status", env=env)
        return {
            "lock_state": list(state),
            "held_really": held_really,
            "lock_id": (Path(tmp / "remote-runs").glob("*/lock_id").__next__()).read_text(),
            "status": st.stdout + st.stderr,
        }
    finally:
        gate.touch()
        console.communicate(timeout=120)


def cancel_next(tmp: Path) -> dict:
    home = tmp / "home"
    home.mkdir()
    env = cli_env(home)
    lock = tmp / "gpu.lock"
    preset = write_lines_preset(tmp, lines=1, pause=0, lock=lock)
    done = tracedeck(
        "run",
        str(preset),
        "--target",
        "local",
        "--out",
        str(tmp / "o"),
        "--set",
        "matrix.n=[1]",
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # the next user of the GPU, by flock(1)'s own manual idiom
    nxt = subprocess.Popen(
        ["sh", "-c", f"( flock -n 9 || exit 1; exec sleep 300 ) 9>>{lock}"], start_new_session=True
    )
    wait_for(lambda: not lock_free(str(lock)), what="the next user to hold the lock")
    local = run_dirs(tmp / "o")[0]
    c = tracedeck("cancel", str(local), "--grace", "1", env=env)
    alive = nxt.poll() is None
    lock_id = next(Path(tmp / "remote-runs").glob("*/lock_id")).read_text()
    if alive:
        os.killpg(nxt.pid, signal.SIGKILL)
    return {
        "next_user_alive": alive,
        "cancel": c.stdout + c.stderr,
        "rc": c.returncode,
        "lock_id": lock_id,
    }


if __name__ == "__main__":
    which, tmp = sys.argv[1], Path(sys.argv[2])
    print("RESULT " + json.dumps({"probe": probe, "cancel_next": cancel_next}[which](tmp)))
