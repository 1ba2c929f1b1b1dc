"""Runs on a real one-node Slurm cluster (slurm-wlm 22.05: slurmctld, slurmd, munge) on this
machine: a job array watched to its verdict, scancel, a time limit, a node failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from faults import assert_run_gone, record_of, slurm_jobs
from patience import patience
from runhelp import cli_env, events, run_dirs, spawn, tracedeck, wait_for
from slurm import PARTITION, SlurmCluster

pytestmark = pytest.mark.slurm

SLEEPY = """
[preset]
name = "sleepy"
kind = "command"
description = "cells that print, then sleep"

[target]
runs = "{tmp}/remote"
lock = "{tmp}/node.lock"
{extra}

[engine]
command = "echo cell {{n}} up; sleep {{s}}; echo cell {{n}} done"
{setup}

[matrix]
n = {cells}
s = [{sleep}]
"""


def sleepy(
    tmp: Path, *, cells: int = 2, sleep: float = 300, extra: str = "", setup: str = ""
) -> Path:
    path = tmp / "sleepy.toml"
    path.write_text(
        SLEEPY.format(
            tmp=tmp, cells=list(range(1, cells + 1)), sleep=sleep, extra=extra, setup=setup
        )
    )
    return path


def env_for(cluster: SlurmCluster, tmp: Path) -> dict[str, str]:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    return cli_env(home, **cluster.env)


TARGET = f"slurm://localhost/{PARTITION}"


def sched(local_dir: Path) -> list[tuple[int, str]]:
    return [(e["cell"], e["state"]) for e in events(local_dir) if e["type"] == "scheduler_state"]


def running(local_dir: Path, cells: set[int]) -> bool:
    """Slurm runs these cells' tasks, and one of them has begun its cell (the others wait for
    the node's lock, in whatever order Slurm started them)."""
    began = {e["cell"] for e in events(local_dir) if e["type"] == "cell_started"}
    live = {c for c, s in sched(local_dir) if s == "RUNNING"}
    return cells <= live and bool(began & cells)


def until(cluster: SlurmCluster, local_dir: Path, predicate, what: str) -> None:  # noqa: ANN001
    """wait_for, saying what Slurm and the run showed when it times out."""
    try:
        wait_for(predicate, timeout=60, what=what)
    except AssertionError as exc:
        queue = cluster.run("squeue", "-o", "%i %T %r %N", check=False).stdout
        nodes = cluster.run("sinfo", "-N", "-o", "%N %T %E", check=False).stdout
        tail = [(e["type"], e.get("cell"), e.get("state")) for e in events(local_dir)][-15:]
        raise AssertionError(f"{exc}\nsqueue:\n{queue}\nsinfo:\n{nodes}\nevents: {tail}") from None


def test_b3_67_smoke_as_a_job_array_ends_pass_guardrail(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env = env_for(slurm_cluster, tmp_path)
    done = tracedeck(
        "run", "b3_67_smoke", "--target", TARGET, "--out", str(tmp_path / "out"),
        "--set", "matrix.seed=[0]",
        "--set", f'target.runs="{tmp_path}/remote"',
        "--set", f'target.lock="{tmp_path}/node.lock"',
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: PASS_GUARDRAIL (exit 0)" in done.stdout
    [local_dir] = run_dirs(tmp_path / "out")
    evts = events(local_dir)
    [job] = [e for e in evts if e["type"] == "job_submitted"]
    assert job["cells"] == [0, 1, 2, 3] and job["partition"] == PARTITION
    states = sched(local_dir)
    began = {e["cell"] for e in evts if e["type"] == "cell_started"}
    order = ["PENDING", "RUNNING", "COMPLETED"]
    for cell in range(4):
        # What the launcher saw, in order. A task that ran between two looks at the queue (a
        # cell of 2 s on an idle node) is never seen RUNNING: that is not asserted (`running`
        # above waits for RUNNING where a test holds its cells); that it began, is.
        words = [s for c, s in states if c == cell]
        assert words and words[-1] == "COMPLETED" and cell in began, (cell, words)
        steps = [order.index(w) for w in words if w in order]  # also COMPLETING, CONFIGURING...
        assert steps == sorted(steps), words
    assert all(
        e["node"] == slurm_cluster.node
        for e in evts
        if e["type"] == "scheduler_state" and e["state"] == "RUNNING"
    )
    # the array, its directives, and each cell's determinism environment inside the job
    remote = Path(record_of(local_dir)["remote_dir"])
    script = (remote / "slurm" / "job.sh").read_text()
    for line in ("#SBATCH --array=0-3", f"#SBATCH --partition={PARTITION}", "--no-requeue"):
        assert line in script
    assert "flock 9" in script
    cmd = (remote / "cells" / "000" / "cmd.sh").read_text()
    assert "export GRETA_DETERMINISTIC=1" in cmd and "export OMP_NUM_THREADS=1" in cmd
    assert f"slurm:       job {job['job_id']} to partition {PARTITION}" in done.stdout
    replay = tracedeck("replay", str(local_dir), "--headless", env=env)
    assert replay.stdout == done.stdout
    assert_run_gone(local_dir, slurm_env=slurm_cluster.env)


def test_cancel_is_scancel_and_records_the_cells(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env = env_for(slurm_cluster, tmp_path)
    out = tmp_path / "out"
    console = spawn("run", str(sleepy(tmp_path)), "--target", TARGET, "--out", str(out), env=env)
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    until(slurm_cluster, local_dir, lambda: running(local_dir, {0, 1}), "both tasks running")
    cancel = tracedeck("cancel", str(local_dir), "--grace", "1", env=env)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    stdout, stderr = console.communicate(timeout=patience(90))
    assert console.returncode == 130, stdout + stderr
    assert "RESULT: CANCELLED (exit 130)" in stdout
    ends = {e["cell"]: e for e in events(local_dir) if e["type"] == "cell_finished"}
    assert {c: e["state"] for c, e in ends.items()} == {0: "cancelled", 1: "cancelled"}
    assert {e["scheduler"] for e in ends.values()} == {"CANCELLED"}
    jobs = slurm_jobs(record_of(local_dir))
    assert jobs and not set(jobs) & set(slurm_cluster.jobs())
    assert_run_gone(local_dir, slurm_env=slurm_cluster.env)


def test_a_time_limit_is_reported_per_cell_as_timeout_exit_3(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env = env_for(slurm_cluster, tmp_path)
    out = tmp_path / "out"
    preset = sleepy(tmp_path, cells=1, extra='time_limit = "1"')
    console = spawn("run", str(preset), "--target", TARGET, "--out", str(out), env=env)
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    until(slurm_cluster, local_dir, lambda: running(local_dir, {0}), "the cell running")
    # The job's time limit (1 minute) ends now: slurmctld's own time-limit check (every 30 s)
    # kills it, as it kills any job that outlived its limit.
    [job] = slurm_jobs(record_of(local_dir))
    slurm_cluster.expire(f"{job}_0")
    stdout, stderr = console.communicate(timeout=patience(90))
    assert console.returncode == 3, stdout + stderr
    assert "RESULT: TIMEOUT (exit 3)" in stdout
    [end] = [e for e in events(local_dir) if e["type"] == "cell_finished"]
    assert (end["state"], end["scheduler"], end["exit_code"]) == ("lost", "TIMEOUT", None)
    assert "[1/1] lost (TIMEOUT: TimeLimit on" in stdout
    assert "cell 1 up" in stdout  # what the cell wrote before it was killed is kept
    assert_run_gone(local_dir, slurm_env=slurm_cluster.env)


def test_a_node_failure_is_reported_per_cell_exit_3(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env = env_for(slurm_cluster, tmp_path)
    out = tmp_path / "out"
    console = spawn("run", str(sleepy(tmp_path)), "--target", TARGET, "--out", str(out), env=env)
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    try:
        until(slurm_cluster, local_dir, lambda: running(local_dir, {0, 1}), "both tasks running")
        slurm_cluster.run(
            "scontrol", "update", f"NodeName={slurm_cluster.node}", "State=DOWN",
            "Reason=tracedeck-test",
        )  # fmt: skip
        stdout, stderr = console.communicate(timeout=patience(90))
    finally:
        if console.poll() is None:
            console.kill()
            console.communicate(timeout=patience(30))
        slurm_cluster.resume_node()
    assert console.returncode == 3, stdout + stderr
    assert "RESULT: NODE_FAIL (exit 3)" in stdout
    ends = {e["cell"]: e["scheduler"] for e in events(local_dir) if e["type"] == "cell_finished"}
    assert ends == {0: "NODE_FAIL", 1: "NODE_FAIL"}
    assert_run_gone(local_dir, slurm_env=slurm_cluster.env)


def test_a_partition_slurm_refuses_is_not_started_exit_3(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    done = tracedeck(
        "run", str(sleepy(tmp_path, sleep=0)), "--target", "slurm://localhost/nosuchpart",
        "--out", str(tmp_path / "out"), env=env_for(slurm_cluster, tmp_path),
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert "Slurm refused the job" in done.stderr + done.stdout
    assert "invalid partition" in (done.stderr + done.stdout).lower()


def test_setup_is_a_job_the_array_waits_for(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    env = env_for(slurm_cluster, tmp_path)
    ok = tracedeck(
        "run", str(sleepy(tmp_path, sleep=0, setup='setup = ["echo built > built.txt"]')),
        "--target", TARGET, "--out", str(tmp_path / "ok"), env=env,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    [local_dir] = run_dirs(tmp_path / "ok")
    evts = events(local_dir)
    order = [(e["type"], e["cell"]) for e in evts if e["type"] in ("cell_started",)]
    assert order[0] == ("cell_started", -1)
    assert len(slurm_jobs(record_of(local_dir))) == 2  # the array and its setup job
    bad = tracedeck(
        "run", str(sleepy(tmp_path, sleep=0, setup='setup = ["exit 4"]')),
        "--target", TARGET, "--out", str(tmp_path / "bad"), env=env,
    )  # fmt: skip
    # as on one host: a "command" run whose setup failed fails (its cells never ran)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "[1/2] skipped (DependencyNeverSatisfied)" in bad.stdout
    [bad_dir] = run_dirs(tmp_path / "bad")
    ends = {e["cell"]: e["state"] for e in events(bad_dir) if e["type"] == "cell_finished"}
    assert ends == {-1: "failed", 0: "skipped", 1: "skipped"}
    assert_run_gone(bad_dir, slurm_env=slurm_cluster.env)


def test_console_killed_then_attach_follows_the_job_to_its_end(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env = env_for(slurm_cluster, tmp_path)
    out = tmp_path / "out"
    console = spawn(
        "run", str(sleepy(tmp_path, sleep=2)), "--target", TARGET, "--out", str(out), env=env
    )
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    wait_for(lambda: any(e["type"] == "job_submitted" for e in events(local_dir)), what="the job")
    console.send_signal(signal.SIGKILL)
    console.communicate(timeout=patience(30))
    attach = tracedeck("attach", str(local_dir), env=env)
    assert attach.returncode == 0, attach.stdout + attach.stderr
    lines = [line for e in events(local_dir) if e["type"] == "output" for line in e["lines"]]
    assert sorted(lines) == ["cell 1 done", "cell 1 up", "cell 2 done", "cell 2 up"]
    assert_run_gone(local_dir, slurm_env=slurm_cluster.env)


def test_sbatch_settings_reach_the_job_script(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    extra = 'time_limit = "10"\nsbatch = ["--comment=tracedeck-test"]\nscheduler = "slurm"\n'
    extra += f'partition = "{PARTITION}"'
    done = tracedeck(
        "run", str(sleepy(tmp_path, sleep=0, extra=extra)), "--target", "local",
        "--out", str(tmp_path / "out"), env=env_for(slurm_cluster, tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    [local_dir] = run_dirs(tmp_path / "out")
    script = (Path(record_of(local_dir)["remote_dir"]) / "slurm" / "job.sh").read_text()
    assert "#SBATCH --time=10" in script and "#SBATCH --comment=tracedeck-test" in script
    assert any(e["type"] == "job_submitted" for e in events(local_dir))
    assert sys.executable  # the local login node runs the cells with this interpreter


def test_plan_shows_the_job_array_and_check_reads_the_cluster(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env = env_for(slurm_cluster, tmp_path)
    argv = ["plan", "b3_67_smoke", "--target", TARGET, "--set", "matrix.seed=[0]"]
    argv += ["--set", f'target.runs="{tmp_path}/remote"', "--set", 'target.gres="gpu:1"']
    doc = json.loads(tracedeck(*argv, "--json", env=env).stdout)
    directives = doc["slurm"]["directives"]
    for line in ("--array=0-3", f"--partition={PARTITION}", "--gres=gpu:1", "--no-requeue"):
        assert f"#SBATCH {line}" in directives
    assert doc["fleet"] is None
    text = tracedeck(*argv, env=env).stdout
    assert "scheduler:   Slurm" in text and "#SBATCH --array=0-3" in text
    argv[argv.index('target.gres="gpu:1"')] = 'target.time_limit="5"'
    checked = tracedeck(*argv, "--check", "--json", env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    levels = {c["what"]: c["level"] for c in json.loads(checked.stdout)["checks"]}
    assert levels["slurm"] == levels["partition"] == levels["lock"] == "ok"
    wrong = [a.replace(f"/{PARTITION}", "/nosuch") for a in argv]
    refused = tracedeck(*wrong, "--check", env=env)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "partition: Slurm knows no partition 'nosuch'" in refused.stderr
    assert not slurm_cluster.jobs() and not (tmp_path / "remote").exists()


def test_prune_keeps_a_run_slurm_still_holds(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """No process group of its own: only squeue can say a Slurm run is over."""
    env = env_for(slurm_cluster, tmp_path)
    out, runs = tmp_path / "out", tmp_path / "remote"
    console = spawn("run", str(sleepy(tmp_path)), "--target", TARGET, "--out", str(out), env=env)
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    until(slurm_cluster, local_dir, lambda: running(local_dir, {0, 1}), "both tasks running")
    console.send_signal(signal.SIGKILL)  # no console follows it now: only Slurm says live
    console.communicate(timeout=patience(30))
    remote = Path(record_of(local_dir)["remote_dir"])
    for argv in (["--out", str(out)], ["--target", TARGET, "--runs", str(runs)]):
        kept = tracedeck("prune", *argv, "--keep", "0", "--yes", env=env)
        assert kept.returncode == 0, kept.stdout + kept.stderr
        assert "live: processes of the run still run" in kept.stdout, kept.stdout
        assert local_dir.exists() and remote.exists()
    cancel = tracedeck("cancel", str(local_dir), "--grace", "1", env=env)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    wait_for(lambda: not set(slurm_jobs(record_of(local_dir))) & set(slurm_cluster.jobs()))
    gone = tracedeck("prune", "--out", str(out), "--keep", "0", "--yes", env=env)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert not local_dir.exists() and not remote.exists()


# -- a hostile operator, a broken world ------------------------------------------------------------


def test_scancel_from_outside_tracedeck_is_cancelled_per_cell_never_a_pass(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env = env_for(slurm_cluster, tmp_path)
    out = tmp_path / "out"
    console = spawn("run", str(sleepy(tmp_path)), "--target", TARGET, "--out", str(out), env=env)
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    until(slurm_cluster, local_dir, lambda: running(local_dir, {0, 1}), "both tasks running")
    [job] = slurm_jobs(record_of(local_dir))
    slurm_cluster.run("scancel", job)  # the operator's own scancel, not `tracedeck cancel`
    stdout, stderr = console.communicate(timeout=patience(90))
    assert console.returncode == 130, stdout + stderr
    assert "RESULT: CANCELLED (exit 130)" in stdout
    ends = {e["cell"]: e for e in events(local_dir) if e["type"] == "cell_finished"}
    assert {c: e["state"] for c, e in ends.items()} == {0: "cancelled", 1: "cancelled"}
    assert_run_gone(local_dir, slurm_env=slurm_cluster.env)


def test_a_task_whose_command_died_first_asks_slurm_before_writing_its_end(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Slurm signals a task's processes one by one: a cell's command can die of scancel's TERM
    (rc 143) before the task's script gets its own, which then wrote 'end' and the cell was
    recorded failed (seen once in CI). The order cannot be forced inside a job, so the run's
    own job script is run again by hand, its command now `exit 143` and no TERM for it, with
    the id of its task, which the real Slurm holds CANCELLED: it writes 'stopped', not 'end'."""
    env = env_for(slurm_cluster, tmp_path)
    out = tmp_path / "out"
    console = spawn("run", str(sleepy(tmp_path, cells=1)), "--target", TARGET, "--out", str(out), env=env)  # fmt: skip
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    until(slurm_cluster, local_dir, lambda: running(local_dir, {0}), "the cell running")
    [job] = slurm_jobs(record_of(local_dir))
    slurm_cluster.run("scancel", job)
    console.communicate(timeout=patience(90))
    assert console.returncode == 130
    assert_run_gone(local_dir, slurm_env=slurm_cluster.env)
    state = slurm_cluster.run("scontrol", "show", "job", f"{job}_0").stdout
    assert "JobState=CANCELLED" in state, state
    remote = Path(record_of(local_dir)["remote_dir"])
    cell = remote / "cells" / "000"
    (cell / "cmd.sh").write_text("exit 143\n")
    progress = cell / "progress.jsonl"
    progress.write_text("")
    again = subprocess.run(
        ["bash", str(remote / "slurm" / "job.sh"), "000"],
        env={**os.environ, **slurm_cluster.env, "SLURM_JOB_ID": f"{job}_0"},
        capture_output=True, text=True, timeout=patience(60),
    )  # fmt: skip
    assert again.returncode == 143, again.stdout + again.stderr
    words = [json.loads(line)["e"] for line in progress.read_text().splitlines()]
    assert words == ["start", "stopped"], words


def test_a_cell_that_exits_non_zero_in_its_task_fails_the_run_exit_1(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    preset = sleepy(tmp_path, sleep=0)
    preset.write_text(preset.read_text().replace("echo cell {n} done", "exit $(( {n} + 4 ))"))
    done = tracedeck(
        "run", str(preset), "--target", TARGET, "--out", str(tmp_path / "out"),
        env=env_for(slurm_cluster, tmp_path),
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: FAIL (exit 1)" in done.stdout
    [local_dir] = run_dirs(tmp_path / "out")
    ends = {e["cell"]: e for e in events(local_dir) if e["type"] == "cell_finished"}
    assert {c: (e["state"], e["exit_code"]) for c, e in ends.items()} == {
        0: ("failed", 5),
        1: ("failed", 6),
    }
    assert_run_gone(local_dir, slurm_env=slurm_cluster.env)


def test_attach_finds_the_job_by_name_when_its_id_was_never_written(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """The console died between sbatch and writing slurm/job_id: attach finds the job by its
    name, follows it to its end, and leaves nothing in the queue."""
    env = env_for(slurm_cluster, tmp_path)
    out = tmp_path / "out"
    console = spawn(
        "run", str(sleepy(tmp_path, sleep=3)), "--target", TARGET, "--out", str(out), env=env
    )
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    wait_for(lambda: any(e["type"] == "job_submitted" for e in events(local_dir)), what="the job")
    console.send_signal(signal.SIGKILL)
    console.communicate(timeout=patience(30))
    [job] = slurm_jobs(record_of(local_dir))
    (Path(record_of(local_dir)["remote_dir"]) / "slurm" / "job_id").unlink()
    attach = tracedeck("attach", str(local_dir), env=env)
    assert attach.returncode == 0, attach.stdout + attach.stderr
    assert "RESULT: PASS (exit 0)" in attach.stdout
    lines = [line for e in events(local_dir) if e["type"] == "output" for line in e["lines"]]
    assert sorted(lines) == ["cell 1 done", "cell 1 up", "cell 2 done", "cell 2 up"]
    assert job not in slurm_cluster.jobs()
