"""Issue 22: one run lifecycle. A fleet is followed and judged as one host is (the change
notifier wakes it, a B3.67 pair is judged on the host that holds both sides), and `plan`
refuses, with the reason, a fleet the launch could not run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from faults import assert_run_gone, record_of
from patience import patience
from runhelp import (
    cli_env,
    events,
    held_engine,
    notifier_alive,
    run_dirs,
    spawn,
    toy_engine,
    tracedeck,
    wait_for,
)
from sshd import Fleet
from test_fleet import lines_preset, lock_free_on


@pytest.mark.ssh
def test_a_fleet_follows_each_host_with_the_change_notifier(fleet: Fleet, tmp_path: Path) -> None:
    # The cells wait for a release file made once both notifiers were seen: with timed cells a
    # batch could end (and its notifier with it) before the test looked, on a loaded machine.
    held, release = held_engine(tmp_path)
    preset = lines_preset(tmp_path, cells=2)
    out = tmp_path / "out"
    env = cli_env(fleet.home.path)
    argv = ["run", str(preset), "--target", "gpu-a,gpu-b", "--out", str(out), *held]
    console = spawn(*argv, env=env)
    local = wait_for(lambda: run_dirs(out), what="run dir")[0]
    run_id = record_of(local)["run_id"]
    for host in ("gpu-a", "gpu-b"):  # each batch's own notifier, named by the batch's marker
        wait_for(lambda h=host: notifier_alive(f"{run_id}@{h}-1"), what=f"{host}'s notifier")
    release.touch()
    stdout, stderr = console.communicate(timeout=patience(120))
    assert console.returncode == 0, stdout + stderr
    assert "RESULT: PASS (exit 0)" in stdout
    assert_run_gone(local, lock_free_on=lock_free_on(fleet))  # no notifier left either


@pytest.mark.ssh
def test_a_two_host_fleet_judges_b3_67_on_its_hosts_and_moves_no_logits(
    fleet: Fleet, tmp_path: Path
) -> None:
    env = cli_env(fleet.home.path)
    done = tracedeck(  # the toy engine's cells (no torch): where judging happens is tested
        "run", "b3_67_smoke", "--target", "gpu-a,gpu-b", "--out", str(tmp_path / "out"),
        "--set", "matrix.seed=[0]", "--set", f'target.runs="{tmp_path}/remote"',
        "--set", f'target.python="{sys.executable}"', *toy_engine("b3_67_smoke"),
        env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: PASS_GUARDRAIL (exit 0)" in done.stdout
    assert "judged on each host whose python can" in done.stdout
    [local] = run_dirs(tmp_path / "out")
    evts = events(local)
    assigned = {e["host"]: e for e in evts if e["type"] == "host_assigned"}
    assert set(assigned) == {"gpu-a", "gpu-b"}
    assert all(a["judge_python"] == sys.executable for a in assigned.values())
    pairs = [e for e in evts if e["type"] == "pair_verdict"]
    assert len(pairs) == 2 and all(len(set(p["hosts"].values())) == 1 for p in pairs)
    held = [e for e in evts if e["type"] == "artifact_held"]
    assert sorted(e["path"].rsplit("/", 1)[-1] for e in held) == ["logits.jsonl.gz"] * 4
    assert {e["host"] for e in held} == {"gpu-a", "gpu-b"}  # each held where it was judged
    assert not list(local.rglob("logits.jsonl.gz"))  # never crossed the link
    # The bytes that crossed the link against the logits left where they were judged.
    fetched = sum(e["size"] for e in evts if e["type"] == "artifact")
    logits = 0
    for e in held:
        run_dir = Path(assigned[e["host"]]["run_dir"])
        logits += (run_dir / "artifacts" / e["path"]).stat().st_size
    print(f"fleet judged on its hosts: {fetched} bytes fetched, {logits} bytes of logits held "
          f"({100 * fetched / logits:.2f}%)")  # fmt: skip
    assert fetched < 0.05 * logits  # metadata only, as on one host (test_host_judging)
    got = tracedeck("fetch", str(local), env=env)  # brought home from each host when asked
    assert got.returncode == 0, got.stdout + got.stderr
    assert "fetched 4 file(s)" in got.stdout
    assert len(list(local.rglob("logits.jsonl.gz"))) == 4
    assert_run_gone(local, lock_free_on=lock_free_on(fleet))


def test_plan_refuses_a_fleet_with_a_slurm_target_saying_why(tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    mixed = tracedeck("plan", "b3_67_smoke", "--target", "gpu-a,slurm://login/gpu", env=env)
    assert mixed.returncode == 2, mixed.stdout + mixed.stderr
    assert "a Slurm cluster places its own work" in mixed.stderr
    scheduled = tracedeck(
        "plan", "b3_67_smoke", "--target", "gpu-a,gpu-b", "--set", 'target.scheduler="slurm"',
        env=env,
    )  # fmt: skip
    assert scheduled.returncode == 2, scheduled.stdout + scheduled.stderr
    assert "a cluster's scheduler places the cells itself" in scheduled.stderr
    assert not scheduled.stdout  # no plan shown for a run that would be refused
