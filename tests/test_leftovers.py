"""Issue 21: after a run ends the console itself checks its host (runners/leftovers.py): a
process of the run still alive, or its lock still held for it, is said by pid and command (an
error that is no verdict's), never passed over, and never turns a verdict into a pass."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Where
from faults import assert_run_gone, record_of
from runhelp import cli_env, events, pid_alive, run_dirs, tracedeck, wait_for, write_lines_preset
from sshd import Fleet

from runners.events import Error, Event
from runners.leftovers import report_leftovers
from runners.run import Run

pytestmark = pytest.mark.fault

# A daemon outside the run (as a container runtime or a job service is): for each run id written
# to its fifo it starts `sleep 3001` carrying that run's marker, then writes the pid. The run's
# per-cell reap cannot see it (not under the runner, no cell marker); the end check must.
SPAWNER = """
import os, subprocess, sys
fifo, pids, log = sys.argv[1:4]
os.mkfifo(fifo)
print("ready", flush=True)
while True:
    with open(fifo) as requests:
        for run_id in requests:
            env = {"PATH": os.environ["PATH"], "TRACEDECK_RUN_ID": run_id.strip()}
            with open(log, "ab") as out:
                p = subprocess.Popen(["sleep", "3001"], env=env, start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=out)
            with open(pids, "a") as done:
                done.write(f"{p.pid}\\n")
"""

# The cell asks the daemon for a process and waits until the daemon says it started it.
LEAK = """echo "$TRACEDECK_RUN_ID" > {fifo}
while [ ! -s {pids} ]; do sleep 0.05; done
exit {rc}
"""


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("rc", [0, 1])
def test_a_process_a_daemon_started_for_the_run_is_named_after_it_ends(
    where: Where, tmp_path: Path, rc: int
) -> None:
    if rc and where.spec != "local":
        pytest.skip("the verdict side is the same over ssh; one transport is enough")
    fifo, pids = tmp_path / "spawn.fifo", tmp_path / "spawned.pids"
    spawner = subprocess.Popen(
        [sys.executable, "-c", SPAWNER, str(fifo), str(pids), str(tmp_path / "spawner.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    leak = tmp_path / "leak.sh"
    leak.write_text(LEAK.format(fifo=fifo, pids=pids, rc=rc))
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    out = tmp_path / "out"
    env = cli_env(where.home)
    try:
        assert spawner.stdout is not None and spawner.stdout.readline().strip() == "ready"
        done = tracedeck(
            "run",
            str(preset),
            "--target",
            where.spec,
            "--out",
            str(out),
            "--set",
            f"engine.command='sh {leak}'",
            "--set",
            "matrix.n=[1]",
            env=env,
        )
        leaked = int(pids.read_text().split()[0])
        local = run_dirs(out)[0]
        run_id = record_of(local)["run_id"]
        # The verdict is the engine's, unchanged: a leftover never makes it a pass, nor a fail.
        assert done.returncode == rc, done.stdout + done.stderr
        assert ("RESULT: PASS (exit 0)" in done.stdout) == (rc == 0)
        errors = [
            e for e in events(local) if e["type"] == "error" and "after it ended" in e["message"]
        ]
        assert len(errors) == 1, errors  # the processes; the lock went with the runner
        said = errors[0]["message"]
        assert f"of run {run_id} still alive after it ended: pid {leaked} (sleep 3001" in said
        assert f"tracedeck cancel {local}" in said
        assert errors[0]["affects_verdict"] is False
        assert f"error: {said}" in done.stdout
        assert pid_alive(leaked)  # only said: stopping it is the operator's cancel
        cancel = tracedeck("cancel", str(local), "--grace", "1", env=env)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert "left over after run" in cancel.stdout, cancel.stdout
        wait_for(lambda: not pid_alive(leaked), what=f"the leftover {leaked} to be stopped")
        assert_run_gone(local)
    finally:
        spawner.kill()
        spawner.wait()
        for pid in pids.read_text().split() if pids.exists() else []:
            _kill(int(pid))


def test_a_clean_run_says_nothing_is_left(where: Where, tmp_path: Path) -> None:
    preset = write_lines_preset(tmp_path, lines=2, pause=0)
    done = tracedeck(
        "run", str(preset), "--target", where.spec, "--out", str(tmp_path / "o"),
        env=cli_env(where.home),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    local = run_dirs(tmp_path / "o")[0]
    assert [e["message"] for e in events(local) if e["type"] == "error"] == []
    assert "error:" not in done.stdout
    assert_run_gone(local)


@pytest.mark.parametrize("the_runs", [True, False], ids=["the-runs-hold", "a-later-hold"])
def test_a_lock_still_held_for_the_run_is_named_with_who_has_it_open(
    where: Where, tmp_path: Path, the_runs: bool
) -> None:
    """A process holding the lock through another name of the file (a hard link): not found as
    one of the run's processes, yet the kernel's lock table says the lock is held, by the run's
    own hold (its taker's pid is the one the launch recorded). Taken anew after the run ended
    (the holder record still naming the run), it is someone else's: never reported."""
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    done = tracedeck(
        "run", str(preset), "--target", where.spec, "--out", str(tmp_path / "o"),
        env=cli_env(where.home),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    local = run_dirs(tmp_path / "o")[0]
    lock = Path(record_of(local)["lock"])
    # Beside the lock: a hard link cannot cross file systems (a test worker's /tmp is its own).
    other_name = lock.with_name(f"{lock.name}.other-name-{os.getpid()}")
    os.link(lock, other_name)
    holder = subprocess.Popen(
        ["flock", str(other_name), "sh", "-c", "echo held; exec sleep 3002"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    said: list[Event] = []

    async def check() -> None:
        run = Run.from_record(local, said.append)
        member = run.only.members[-1]
        try:
            await member.target.connect()
            await report_leftovers(member.target, member.launcher, member.plan, local, said.append)
        finally:
            await run.close()

    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        if the_runs:  # flock(1) took it: its pid is the taker's, as launch.sh's flock was
            (Path(record_of(local)["remote_dir"]) / "lock_id").write_text(f"{holder.pid}\n")
        asyncio.run(check())
        errors = [e for e in said if isinstance(e, Error)]
        if not the_runs:
            assert errors == []
            return
        assert len(errors) == 1, errors
        message = errors[0].message
        assert f"the lock {lock} is still held for run {record_of(local)['run_id']}" in message
        assert f"pid {holder.pid} (flock {other_name}" in message
        assert "(sleep 3002" in message and errors[0].affects_verdict is False
        assert f"tracedeck cancel {local}" in message
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
        other_name.unlink()
    said.clear()
    asyncio.run(check())
    assert said == []  # the lock free again: nothing to say
    assert_run_gone(local)


@pytest.mark.ssh
def test_a_fleet_hosts_leftover_is_named_with_its_host(fleet: Fleet, tmp_path: Path) -> None:
    """The same check ends each host's batch of a fleet run: said for that host, by pid."""
    from test_fleet import lines_preset

    fifo, pids = tmp_path / "spawn.fifo", tmp_path / "spawned.pids"
    spawner = subprocess.Popen(
        [sys.executable, "-c", SPAWNER, str(fifo), str(pids), str(tmp_path / "spawner.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    leak = tmp_path / "leak.sh"
    leak.write_text('[ "$1" = 1 ] || exit 0\n' + LEAK.format(fifo=fifo, pids=pids, rc=0))
    preset = lines_preset(tmp_path, cells=2, lines=1, pause=0)
    env = cli_env(fleet.home.path)
    out = tmp_path / "out"
    try:
        assert spawner.stdout is not None and spawner.stdout.readline().strip() == "ready"
        done = tracedeck(
            "run", str(preset), "--target", "gpu-a,gpu-b", "--out", str(out),
            "--set", f"engine.command='sh {leak} {{n}}'", env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        leaked = int(pids.read_text().split()[0])
        [local] = run_dirs(out)
        evts = events(local)
        host = next(e["host"] for e in evts if e["type"] == "cell_finished" and e["cell"] == 0)
        errors = [e for e in evts if e["type"] == "error" and "after it ended" in e["message"]]
        assert [e["host"] for e in errors] == [host], errors
        assert f"still alive after it ended: pid {leaked} (sleep 3001" in errors[0]["message"]
        assert errors[0]["affects_verdict"] is False
        cancel = tracedeck("cancel", str(local), "--grace", "1", env=env)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        wait_for(lambda: not pid_alive(leaked), what=f"the leftover {leaked} to be stopped")
        assert_run_gone(local)
    finally:
        spawner.kill()
        spawner.wait()
        for pid in pids.read_text().split() if pids.exists() else []:
            _kill(int(pid))
