"""Issue 21.3: a run owns every process it starts, by things a process cannot shed.

A process that scrubs its environment (env -i, sudo, a daemon), leaves the session (setsid) and
even closes the lock fd is still the run's: it is under the runner (a child subreaper), or it
holds the lock file open. Each scenario ends with the fault harness's host-side check.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Where
from faults import assert_run_gone, lock_free, record_of
from patience import patience
from runhelp import (
    cli_env,
    events,
    pid_alive,
    run_dirs,
    spawn,
    tracedeck,
    wait_for,
    write_lines_preset,
)

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)

# Scrubs its environment, leaves the session, double-forks, closes every inherited fd (the lock's
# too) and leaves the run's directories: only its descent from the runner tells it apart.
SHED_ALL = """
import os, sys, time
pidfile = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.closerange(3, 1024)
        os.chdir("/")
        with open(pidfile + ".part", "w") as fh:
            fh.write(str(os.getpid()))
        os.rename(pidfile + ".part", pidfile)
        os.execve("/bin/sleep", ["sleep", "300"], {})
    os._exit(0)
# The command must not end before the escapee has said its pid: the run stops what is left the
# moment its command ends, and a busy machine may not have run the grandchild yet.
while not os.path.exists(pidfile):
    time.sleep(0.01)
"""


def run_with(where: Where, tmp: Path, command: str, out: Path) -> tuple[int, str]:
    preset = write_lines_preset(tmp, lines=1, pause=0)
    done = tracedeck(
        "run",
        str(preset),
        "--target",
        where.spec,
        "--out",
        str(out),
        "--set",
        f"engine.command={command!r}",
        "--set",
        "matrix.n=[1]",
        env=cli_env(where.home),
    )
    return done.returncode, done.stdout + done.stderr


def test_a_process_that_scrubs_its_environment_does_not_keep_the_lock(
    where: Where, tmp_path: Path
) -> None:
    """`setsid env -i sleep 300 &` held fd 9 after a PASS: the next run was LOCK_BUSY."""
    pidfile = tmp_path / "scrubbed.pid"
    command = f"setsid env -i sh -c 'echo $$ > {pidfile}; exec sleep 300' & echo started"
    rc, said = run_with(where, tmp_path, command, tmp_path / "out")
    assert rc == 0, said
    escaped = int(wait_for(lambda: pidfile.read_text().strip() or None, what="pid"))
    assert re.search(
        rf"left processes running after its command ended \(pids [\d ]*{escaped}", said
    )
    assert not pid_alive(escaped)
    assert lock_free(str(tmp_path / "gpu.lock"))
    assert_run_gone(run_dirs(tmp_path / "out")[0])
    again, said = run_with(where, tmp_path, "echo second", tmp_path / "out2")
    assert again == 0 and "LOCK_BUSY" not in said, said


def test_a_process_that_sheds_everything_is_still_the_runs(where: Where, tmp_path: Path) -> None:
    script = tmp_path / "shed.py"
    script.write_text(SHED_ALL)
    pidfile = tmp_path / "shed.pid"
    command = f"{sys.executable} {script} {pidfile}; echo forked"
    rc, said = run_with(where, tmp_path, command, tmp_path / "out")
    assert rc == 0, said
    escaped = int(pidfile.read_text())
    assert re.search(
        rf"left processes running after its command ended \(pids [\d ]*{escaped}", said
    )
    assert not pid_alive(escaped)
    assert_run_gone(run_dirs(tmp_path / "out")[0])


def test_cancel_stops_a_process_that_scrubbed_its_environment(where: Where, tmp_path: Path) -> None:
    """`cancel` said nothing was running while an env -i process held the lock."""
    script = tmp_path / "shed.py"
    script.write_text(SHED_ALL)
    shed, scrubbed = tmp_path / "shed.pid", tmp_path / "scrubbed.pid"
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    env = cli_env(where.home)
    out = tmp_path / "out"
    command = (
        f"{sys.executable} {script} {shed}; "
        f"setsid env -i sh -c 'echo $$ > {scrubbed}; exec sleep 300' & sleep 300"
    )
    console = spawn(
        "run",
        str(preset),
        "--target",
        where.spec,
        "--out",
        str(out),
        "--set",
        f"engine.command={command!r}",
        "--set",
        "matrix.n=[1]",
        env=env,
    )
    try:
        local = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(lambda: scrubbed.exists() and scrubbed.read_text().strip(), what="escapee")
        wait_for(lambda: shed.exists(), what="double-forked escapee")
        pids = [int(shed.read_text()), int(scrubbed.read_text())]
        cancel = tracedeck("cancel", str(local), "--grace", "1", env=env)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert "already finished" not in cancel.stdout and "not running" not in cancel.stdout
        console.communicate(timeout=patience(60))
        assert console.returncode == 130
        alive = [(p, Path(f"/proc/{p}/stat").read_text()) for p in pids if pid_alive(p)]
        assert not alive, (alive, cancel.stdout)
        assert_run_gone(local)
    finally:
        if console.poll() is None:
            console.kill()
            console.communicate()


def test_cancel_finds_a_scrubbed_lock_holder_after_the_runner_died(tmp_path: Path) -> None:
    """The runner is gone (killed); only the lock file open says the process is the run's."""
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    scrubbed = tmp_path / "scrubbed.pid"
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    out = tmp_path / "out"
    command = f"setsid env -i sh -c 'echo $$ > {scrubbed}; exec sleep 300' & sleep 300"
    console = spawn(
        "run",
        str(preset),
        "--target",
        "local",
        "--out",
        str(out),
        "--set",
        f"engine.command={command!r}",
        "--set",
        "matrix.n=[1]",
        env=env,
    )
    try:
        local = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(lambda: any(e["type"] == "cell_started" for e in events(local)), what="cell")
        escaped = int(
            wait_for(lambda: scrubbed.exists() and scrubbed.read_text().strip(), what="pid")
        )
        runner = int((Path(record_of(local)["remote_dir"]) / "pgid").read_text())
        os.killpg(runner, signal.SIGKILL)  # the runner and its group die; the escapee does not
        wait_for(lambda: not pid_alive(runner), what="runner gone")
        assert pid_alive(escaped) and not lock_free(str(tmp_path / "gpu.lock"))
        cancel = tracedeck("cancel", str(local), "--grace", "1", env=env)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert "not running" not in cancel.stdout.lower(), cancel.stdout
        console.communicate(timeout=patience(60))
        assert not pid_alive(escaped)
        assert_run_gone(local)
    finally:
        if console.poll() is None:
            console.kill()
            console.communicate()


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root")
def test_a_lock_of_the_same_name_in_another_mount_namespace_is_not_the_runs(
    tmp_path: Path,
) -> None:
    """A container's (another mount namespace's) /tmp/tracedeck.lock has the run's lock's name
    but is another file: its holders are another run's, never found, let alone killed, as this
    run's (they were: every ssh test run's reap killed other test sessions' runs)."""
    from runners.launchers.detached import pids_command

    shared = tmp_path / "d"
    shared.mkdir()
    lock = shared / "lock"
    lock.touch()
    run_id, run_dir = "ns-check", tmp_path / "run"
    run_dir.mkdir()
    (shared / "lock.json").write_text(f'{{"run_id":"{run_id}"}}')
    take = "exec 9>>{lock} && flock -n 9 && "
    # The run's own hold: the flock its launch took, named by its taker's pid in lock_id.
    held = (
        "sed -n 's/^lock:.* FLOCK  *ADVISORY  *WRITE  *\\([0-9]*\\) .*/\\1/p' "
        f"/proc/$$/fdinfo/9 > {run_dir}/lock_id && "
    )
    other = subprocess.Popen(
        ["unshare", "-m", "sh", "-c",
         f"mount -t tmpfs other {shared} && {take.format(lock=lock)}echo held && exec sleep 3009"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert other.stdout is not None and other.stdout.readline().strip() == "held"
    ours = subprocess.Popen(
        ["sh", "-c", f"{take.format(lock=lock)}{held}echo held && exec sleep 3010"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert ours.stdout is not None and ours.stdout.readline().strip() == "held"
        assert (run_dir / "lock_id").read_text().strip().isdigit()
        assert os.readlink(f"/proc/{other.pid}/fd/9") == os.readlink(f"/proc/{ours.pid}/fd/9")
        listed = subprocess.run(
            ["sh", "-c", pids_command(run_id, str(run_dir), str(lock))],
            capture_output=True,
            text=True,
        )
        assert listed.stdout.split() == [str(ours.pid)], listed.stdout + listed.stderr
    finally:
        for proc in (other, ours):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
