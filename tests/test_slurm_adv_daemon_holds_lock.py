"""A cell leaves a daemon that dropped its environment (env -i: no TRACEDECK_CELL marker) and
outlives its parent (reparented away from the task's script): job.sh's reap_cell finds leftovers
by marker and descent only (run_lock is empty in job.sh, so the lock-holder search is off), and
the daemon keeps the node's lock through the fd 9 it inherited. Slurm's linuxproc tracking does
not end it either. The run says PASS; the node's lock stays held."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from faults import lock_free, record_of, slurm_jobs
from runhelp import run_dirs, tracedeck, wait_for
from slurm import SlurmCluster
from slurm_adv import TARGET, env_for, preset

pytestmark = pytest.mark.slurm


def openers(lock: Path) -> list[int]:
    pids = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if os.path.realpath(fd) == str(lock):
                    pids.append(int(fd_dir.parent.name))
                    break
        except OSError:
            continue
    return pids


def test_a_daemon_left_by_a_cell_does_not_keep_the_node_lock(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env = env_for(slurm_cluster, tmp_path)
    lock = tmp_path / "node.lock"
    mark = tmp_path / "daemon.mark"
    command = f"env -i sh -c 'sleep 300 & echo $! > {mark}' ; echo cell {{n}} done"
    try:
        done = tracedeck(
            "run", str(preset(tmp_path, command)), "--target", TARGET,
            "--out", str(tmp_path / "out"), "--set", f'target.lock="{lock}"', env=env,
        )  # fmt: skip
        [local_dir] = run_dirs(tmp_path / "out")
        jobs = slurm_jobs(record_of(local_dir))
        wait_for(lambda: not set(jobs) & set(slurm_cluster.jobs()), what="job gone")
        held = not lock_free(str(lock))
        assert not held, (
            f"run exit {done.returncode} ({done.stdout.strip().splitlines()[-1]}); the node lock "
            f"is still held by pids {openers(lock)} (the daemon: {mark.read_text().strip()})"
        )
    finally:
        for pid in openers(lock):
            os.kill(pid, signal.SIGKILL)
