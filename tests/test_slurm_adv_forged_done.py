"""job.sh never writes a run-level "done" or "cancelled" line (only start/end/stopped per cell),
yet the follower believed one read from any cell's progress file: the engine wrote
{"e":"done"} (after its own forged end rc 0) and hung; tracedeck ended the run at once, PASS
exit 0, while Slurm still ran the task under the node's lock. Now the line is said, never
believed, and the run is followed to its real end."""

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


def test_a_forged_done_line_never_ends_a_live_slurm_run(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    forged = tmp_path / "forged.jsonl"
    lines = [{"e": "end", "cell": "000", "rc": 0, "t": time.time() + 5}, {"e": "done", "t": 1.0}]
    forged.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    gate = tmp_path / "gate"
    command = (
        f'cat {forged} >> {tmp_path}/remote/"$TRACEDECK_RUN_ID"/cells/000/progress.jsonl; '
        f"while [ ! -e {gate} ]; do sleep 0.1; done"
    )
    env = env_for(slurm_cluster, tmp_path)
    out = tmp_path / "out"
    console = spawn(
        "run", str(preset(tmp_path, command)), "--target", TARGET, "--out", str(out),
        "--set", f'target.lock="{tmp_path / "node.lock"}"', env=env,
    )  # fmt: skip
    job = ""
    try:
        local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(lambda: slurm_jobs(record_of(local_dir)), what="job id")
        [job] = slurm_jobs(record_of(local_dir))
        wait_for(
            lambda: any("where no script of tracedeck writes one" in e.get("message", "")
                        for e in events(local_dir) if e["type"] == "error"),
            what="the forged 'done' to be said",
        )  # fmt: skip
        assert console.poll() is None and job in slurm_cluster.jobs()  # still followed
        gate.touch()
        stdout, stderr = console.communicate(timeout=patience(120))
        assert console.returncode != 0 and "RESULT: PASS" not in stdout, stdout + stderr
        assert job not in slurm_cluster.jobs()
    finally:
        gate.touch()
        if console.poll() is None:
            console.kill()
            console.communicate(timeout=30)
        if job:
            slurm_cluster.run("scancel", job, check=False)
            wait_for(lambda: job not in slurm_cluster.jobs(), what="cleanup")
