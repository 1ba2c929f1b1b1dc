"""An engine writes a well-formed `end rc 0` of its own cell, then hangs until Slurm kills its
task at the time limit: the task's script writes `stopped` (which the follower ignores) and the
outcome skips the cell (it 'finished'): the run is reported PASS exit 0."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
from faults import record_of, slurm_jobs
from patience import patience
from runhelp import events, run_dirs, spawn, wait_for
from slurm import SlurmCluster
from slurm_adv import TARGET, env_for, preset

pytestmark = pytest.mark.slurm


def test_forged_end_then_time_limit_is_never_a_pass(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    forged = tmp_path / "forged.jsonl"
    forged.write_bytes(
        orjson.dumps({"e": "end", "cell": "000", "rc": 0, "t": time.time() + 5}) + b"\n"
    )
    # the engine appends the forged end to its own progress file, then hangs
    command = (
        f'cat {forged} >> {tmp_path}/remote/"$TRACEDECK_RUN_ID"/cells/000/progress.jsonl; '
        "echo forged; sleep 300"
    )
    env = env_for(slurm_cluster, tmp_path)
    out = tmp_path / "out"
    p = preset(tmp_path, command, extra='time_limit = "1"')
    console = spawn("run", str(p), "--target", TARGET, "--out", str(out), env=env)
    try:
        local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(
            lambda: any(e["type"] == "cell_finished" for e in events(local_dir)),
            timeout=90,
            what="the forged end believed",
        )
        [job] = slurm_jobs(record_of(local_dir))
        slurm_cluster.expire(f"{job}_0")  # Slurm kills the task: TIMEOUT
        stdout, stderr = console.communicate(timeout=patience(120))
    finally:
        if console.poll() is None:
            console.kill()
            console.communicate(timeout=30)
    state = slurm_cluster.run("scontrol", "show", "job", f"{job}_0", check=False).stdout
    assert "JobState=TIMEOUT" in state, state
    ends = [(e["cell"], e["state"]) for e in events(local_dir) if e["type"] == "cell_finished"]
    assert console.returncode != 0 and "PASS" not in stdout, (
        f"exit {console.returncode}; cell ends {ends}; Slurm: TIMEOUT\n{stdout}\n{stderr}"
    )
