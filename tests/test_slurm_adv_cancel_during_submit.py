"""`tracedeck cancel` while the console is still submitting the job (sbatch slow to answer, as a
busy controller is): the cancel finds no job (no slurm/job_id, nothing named td-RUN in squeue),
says 'not running' and touches `cancel`; the console then submits the array, and job.sh never
looks at `cancel`: every cell runs, in full, after the cancel was answered."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from patience import patience
from runhelp import events, run_dirs, spawn, tracedeck, wait_for
from slurm import SlurmCluster
from slurm_adv import TARGET, env_for, preset

pytestmark = pytest.mark.slurm


def test_cancel_while_sbatch_is_in_flight_stops_the_cells(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    real = shutil.which("sbatch")
    assert real
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gate, entered = tmp_path / "gate", tmp_path / "entered"
    wrapper = bin_dir / "sbatch"
    # a slow controller: sbatch answers once the test opens the gate
    wrapper.write_text(
        f'#!/bin/sh\ntouch {entered}\nwhile [ ! -e {gate} ]; do sleep 0.1; done\nexec {real} "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    env = env_for(slurm_cluster, tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}")
    out = tmp_path / "out"
    p = preset(tmp_path, "echo cell {n} ran; sleep 2; echo cell {n} done", cells=2)
    console = spawn("run", str(p), "--target", TARGET, "--out", str(out), env=env)
    try:
        local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(entered.exists, what="sbatch called")
        cancel = tracedeck("cancel", str(local_dir), "--grace", "1", env=env)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        gate.touch()
        stdout, stderr = console.communicate(timeout=patience(120))
    finally:
        gate.touch()
        if console.poll() is None:
            console.kill()
            console.communicate(timeout=30)
    began = sorted({e["cell"] for e in events(local_dir) if e["type"] == "cell_started"})
    lines = [line for e in events(local_dir) if e["type"] == "output" for line in e["lines"]]
    assert not began, (
        f"cancel said: {cancel.stdout.strip()!r}; afterwards cells {began} ran: {lines}; "
        f"console exit {console.returncode}\n{stdout}\n{stderr}"
    )
