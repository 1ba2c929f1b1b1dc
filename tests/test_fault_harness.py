"""The check every fault scenario ends with (faults.after_scenario, run by conftest.py after each
test marked `fault`) finds what is left, here and on a fleet host in its own mount namespace:
a check that could not fail would prove nothing."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from faults import DEFAULT_LOCK, left_after, scan_left
from patience import patience
from runhelp import pid_alive, wait_for
from sshd import Fleet


def _stop(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_process_working_in_the_scenarios_directory_is_found(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "3005"], cwd=tmp_path, start_new_session=True, text=True)
    try:
        # Its cwd is set before its exec, and mid-exec its cmdline reads empty: wait for both.
        wait_for(
            lambda: (
                os.readlink(f"/proc/{proc.pid}/cwd") == str(tmp_path)
                and Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"sleep")
            ),
            what="sleep running in the directory",
        )
        procs, held = scan_left(tmp_path)
        assert any(p.startswith(f"{proc.pid}: ") and "sleep" in p for p in procs), procs
        assert held == []
    finally:
        _stop(proc)
    assert left_after(tmp_path) == ([], [])


def test_the_default_lock_held_is_found(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        ["flock", DEFAULT_LOCK, "sh", "-c", "echo held; exec sleep 3006"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        procs, held = scan_left(tmp_path)
        assert held == [DEFAULT_LOCK]
        assert any(p.startswith(f"{proc.pid}: ") for p in procs), procs  # it has the lock open
    finally:
        _stop(proc)
    assert left_after(tmp_path) == ([], [])


@pytest.mark.ssh
def test_a_process_left_on_a_fleet_host_is_found_in_that_hosts_namespace(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Left on gpu-a, holding its default lock: a lock of gpu-a's own /tmp, which this test's
    /tmp does not show, and a process only that host's mount namespace tells apart."""
    home = fleet.home
    log = tmp_path / "left.log"
    left = (
        f"setsid sh -c 'exec 9>>{DEFAULT_LOCK}; flock 9; exec sleep 3007' "
        f"< /dev/null > {log} 2>&1 & echo started"
    )
    ssh = subprocess.run(
        ["ssh", "-F", str(home.config), "-o", "BatchMode=yes",
         "-o", f"UserKnownHostsFile={home.known_hosts}", "gpu-a-direct", left],
        capture_output=True, text=True, timeout=patience(60),
    )  # fmt: skip
    assert ssh.stdout.strip() == "started", ssh.stdout + ssh.stderr
    pid = 0
    try:

        def held_there() -> tuple[list[str], list[str]] | None:
            found = scan_left(tmp_path)
            # until it is `sleep 3007`, its sh may be seen twice: forked for flock, not yet it
            asleep = any(p.endswith("b'sleep\\x003007\\x00'") for p in found[0])
            return found if found[1] and asleep else None

        procs, held = wait_for(held_there, what="the lock on gpu-a to be held by `sleep 3007`")
        mine = [p for p in procs if p.startswith("on gpu-a: ") and "sleep" in p]
        if len(mine) == 1:
            pid = int(re.match(r"on gpu-a: (\d+)", mine[0]).group(1))  # type: ignore[union-attr]
        assert held == [f"gpu-a:{DEFAULT_LOCK}"], held
        assert len(mine) == 1, procs
        assert not any(p.startswith(("on gpu-b", "on gpu-c")) for p in procs), procs
    finally:
        # By its pid: it may be found holding the lock before it has become `sleep 3007`
        # (its sh between flock and exec), which a look by command line then missed.
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for entry in Path("/proc").iterdir():  # found or not, it goes
            with contextlib.suppress(OSError, ValueError):
                if (entry / "cmdline").read_bytes() == b"sleep\x003007\x00":
                    os.kill(int(entry.name), signal.SIGKILL)
    if pid:
        wait_for(lambda: not pid_alive(pid), what=f"{pid} to end")
    assert left_after(tmp_path) == ([], [])
