"""squeue fails (exit 1, 'Unable to contact slurm controller', nothing on stdout) when the
controller cannot be reached: SlurmLauncher.alive() ignores its exit status and reads the empty
stdout as 'no task of the run is left'. `tracedeck cancel` then answers 'not running' (exit 0)
and never scancels; `tracedeck prune` deletes a live run's directories. The outage is the login
node's view of the controller: the commands run with a slurm.conf whose SlurmctldPort nobody
listens on (squeue fails as it fails in a controller restart: connect failure)."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from faults import record_of, slurm_jobs
from patience import patience
from runhelp import events, run_dirs, spawn, tracedeck, wait_for
from slurm import SlurmCluster
from slurm_adv import TARGET, env_for, preset

pytestmark = pytest.mark.slurm


def unreachable(cluster: SlurmCluster, tmp: Path) -> dict[str, str]:
    conf = tmp / "down" / "slurm.conf"
    conf.parent.mkdir()
    text = re.sub(r"(?m)^SlurmctldPort=.*$", "SlurmctldPort=1", cluster.conf.read_text())
    # squeue gives up on a dead controller after 1 s, not 9: the same failure, sooner
    conf.write_text(text + "MessageTimeout=2\n")
    return {"SLURM_CONF": str(conf)}


def start(cluster: SlurmCluster, tmp: Path):  # noqa: ANN201
    env = env_for(cluster, tmp)
    out = tmp / "out"
    console = spawn(
        "run", str(preset(tmp, "echo cell {n} up; sleep 300")), "--target", TARGET,
        "--out", str(out), "--set", f'target.lock="{tmp / "node.lock"}"', env=env,
    )  # fmt: skip
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    wait_for(lambda: any(e["type"] == "cell_started" for e in events(local_dir)), what="cell")
    [job] = slurm_jobs(record_of(local_dir))
    return env, out, console, local_dir, job


def stop(cluster: SlurmCluster, console, job: str) -> None:  # noqa: ANN001
    if console.poll() is None:
        console.kill()
        console.communicate(timeout=30)
    cluster.run("scancel", job, check=False)
    wait_for(lambda: job not in cluster.jobs(), what="cleanup")


def test_cancel_when_squeue_fails_never_says_not_running(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env, _, console, local_dir, job = start(slurm_cluster, tmp_path)
    try:
        cancel = tracedeck(
            "cancel",
            str(local_dir),
            "--grace",
            "1",
            env={**env, **unreachable(slurm_cluster, tmp_path)},
        )
        alive = job in slurm_cluster.jobs()
        assert cancel.returncode != 0 or not alive, (
            f"cancel exit {cancel.returncode}: {cancel.stdout.strip()!r} {cancel.stderr.strip()!r}; "
            f"Slurm still runs job {job}"
        )
    finally:
        stop(slurm_cluster, console, job)


def test_prune_when_squeue_fails_keeps_a_live_run(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env, out, console, local_dir, job = start(slurm_cluster, tmp_path)
    try:
        console.send_signal(signal.SIGKILL)
        console.communicate(timeout=patience(30))
        remote = Path(record_of(local_dir)["remote_dir"])
        pruned = tracedeck(
            "prune", "--out", str(out), "--keep", "0", "--yes",
            env={**env, **unreachable(slurm_cluster, tmp_path)},
        )  # fmt: skip
        alive = job in slurm_cluster.jobs()
        assert remote.exists() or not alive, (
            f"prune exit {pruned.returncode}: {pruned.stdout.strip()!r} {pruned.stderr.strip()!r}; "
            f"{remote} deleted while Slurm still runs job {job}"
        )
    finally:
        stop(slurm_cluster, console, job)
