"""The console died between its sbatch calls and writing slurm/job_id (the window
test_attach_finds_the_job_by_name_when_its_id_was_never_written simulates the same way): the
job is then found by its name td-RUN, which the setup job (td-RUN-setup) does not have.
`tracedeck cancel` scancels the array alone and says cancelled; the setup job runs on,
holding the node's lock."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from faults import lock_free, record_of, slurm_jobs
from patience import patience
from runhelp import events, run_dirs, spawn, tracedeck, wait_for
from slurm import SlurmCluster
from slurm_adv import TARGET, env_for, preset

pytestmark = pytest.mark.slurm


def test_cancel_without_job_id_also_ends_the_setup_job(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env = env_for(slurm_cluster, tmp_path)
    out = tmp_path / "out"
    p = preset(tmp_path, "echo cell {n}", setup='setup = ["sleep 300"]')
    lock = tmp_path / "node.lock"
    console = spawn(
        "run", str(p), "--target", TARGET, "--out", str(out),
        "--set", f'target.lock="{lock}"', env=env,
    )  # fmt: skip
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    wait_for(lambda: any(e["type"] == "job_submitted" for e in events(local_dir)), what="job")
    console.send_signal(signal.SIGKILL)
    console.communicate(timeout=patience(30))
    array, setup = slurm_jobs(record_of(local_dir))
    (Path(record_of(local_dir)["remote_dir"]) / "slurm" / "job_id").unlink()
    try:
        wait_for(
            lambda: (
                "RUNNING"
                in slurm_cluster.run("squeue", "-h", "-j", setup, "-o", "%T", check=False).stdout
            ),
            what="the setup job running",
        )
        cancel = tracedeck("cancel", str(local_dir), "--grace", "1", env=env)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        gone = False
        try:
            wait_for(lambda: setup not in slurm_cluster.jobs(), timeout=20, what="setup job gone")
            gone = True
        except AssertionError:
            pass
        held = not lock_free(str(lock))
        assert gone and not held, (
            f"cancel said {cancel.stdout.strip()!r}; Slurm still holds the setup job {setup} "
            f"({slurm_cluster.run('squeue', '-h', '-o', '%i %j %T', check=False).stdout.strip()}); "
            f"node lock {lock} held: {held}"
        )
    finally:
        slurm_cluster.run("scancel", setup, array, check=False)
        wait_for(lambda: not {setup, array} & set(slurm_cluster.jobs()), what="cleanup")
