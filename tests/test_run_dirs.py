"""Run directories: linked by run id (attach and cancel find them so), none left behind by a
run the lock refused, and `tracedeck prune` that never touches a live or followed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from faults import record_of
from patience import patience
from runhelp import (
    cli_env,
    events,
    kill_group,
    run_alive,
    run_dirs,
    spawn,
    tracedeck,
    wait_for,
    wait_until_held,
)
from runhelp import write_lines_preset as lines_preset
from sshd import SshHome

from runners.record import try_lock


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home


def quick_run(tmp: Path, home: Path, out: Path) -> Path:
    done = tracedeck(
        "run", str(lines_preset(tmp, lines=1, pause=0)), "--out", str(out), env=cli_env(home)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return max(run_dirs(out), key=lambda p: record_of(p)["started_at"] + p.name)


def test_a_run_is_linked_by_its_id_and_found_by_it(home: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    local = quick_run(tmp_path, home, out)
    run_id = record_of(local)["run_id"]
    link = out / "by-id" / run_id
    assert link.is_symlink() and not os.readlink(link).startswith("/")  # relative: out can move
    assert link.resolve() == local.resolve()
    assert run_dirs(out) == [local]  # listed once, where it lies
    for command in ("attach", "cancel"):
        done = tracedeck(command, run_id, "--out", str(out), env=cli_env(home))
        assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "RESULT: PASS (exit 0)"
        in tracedeck("attach", run_id, "--out", str(out), env=cli_env(home)).stdout
    )


def test_a_run_refused_by_the_lock_leaves_no_directory(home: Path, tmp_path: Path) -> None:
    lock = tmp_path / "gpu.lock"
    holder = subprocess.Popen(["flock", str(lock), "sleep", "60"])
    try:
        wait_until_held(lock)
        preset = lines_preset(tmp_path, lines=1, pause=0, lock=lock)
        out = tmp_path / "out"
        done = tracedeck("run", str(preset), "--out", str(out), env=cli_env(home))
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 3, done.stdout + done.stderr
    assert "RESULT: LOCK_BUSY (exit 3)" in done.stdout
    assert run_dirs(out) == []
    assert [p for p in out.rglob("*") if p.name != "by-id"] == []  # no run dir, no link
    remote = tmp_path / "remote-runs"
    assert not remote.exists() or list(remote.iterdir()) == []


def age(local: Path, days: float) -> None:
    """Make a recorded run look `days` old."""
    record = record_of(local)
    record["started_at"] = time.strftime(
        "%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() - days * 86400)
    )
    (local / "run.json").write_text(json.dumps(record))


def prune(out: Path, home: Path, *args: str) -> subprocess.CompletedProcess:
    done = tracedeck("prune", "--out", str(out), *args, env=cli_env(home))
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_prune_local_runs_keeps_live_and_followed_ones(home: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    old = quick_run(tmp_path, home, out)
    followed = quick_run(tmp_path, home, out)
    recent = quick_run(tmp_path, home, out)
    age(old, 30)
    age(followed, 20)
    # A live run nobody follows: its console killed, the run goes on detached.
    (tmp_path / "slow").mkdir()
    slow = lines_preset(tmp_path / "slow", lines=120, pause=0.05)
    console = spawn("run", str(slow), "--out", str(out), env=cli_env(home))
    known = (old, followed, recent)
    live = wait_for(lambda: [d for d in run_dirs(out) if d not in known], what="run")[0]
    wait_for(lambda: any(e["type"] == "cell_started" for e in events(live)), what="the cell")
    console.send_signal(signal.SIGKILL)
    console.wait()
    age(live, 40)
    live_id, old_remote = record_of(live)["run_id"], Path(record_of(old)["remote_dir"])
    lock = try_lock(followed)  # another console follows this one
    try:
        dry = prune(out, home, "--older-than", "7d")
        assert "dry run: nothing deleted; 1 run(s) would go" in dry.stdout
        assert "delete   " in dry.stdout and f"{old}  (and local:{old_remote})" in dry.stdout
        assert "another console follows it" in dry.stdout and "live: processes" in dry.stdout
        assert "newer than --older-than" in dry.stdout
        assert old.exists() and old_remote.exists()
        done = prune(out, home, "--older-than", "7d", "--yes")
        assert "deleted 1 of 1 run(s)" in done.stdout
        assert not old.exists() and not old_remote.exists()
        assert (
            not (out / "by-id" / record_of(followed)["run_id"]).parent.joinpath(old.name).exists()
        )
        assert followed.exists() and live.exists() and run_alive(live_id)
    finally:
        os.close(lock)
        kill_group(int((Path(record_of(live)["remote_dir"]) / "pgid").read_text()))
    wait_for(lambda: not run_alive(live_id), what="the live run to be gone")
    done = prune(out, home, "--keep", "1", "--yes")  # the newest stays; the dead run goes now
    assert run_dirs(out) == [recent]
    assert "deleted 2 of 2 run(s)" in done.stdout
    assert sorted(p.name for p in (out / "by-id").iterdir()) == [record_of(recent)["run_id"]]


def test_prune_a_targets_runs_dir_keeps_a_live_run_and_a_launch(home: Path, tmp_path: Path) -> None:
    runs = tmp_path / "remote-runs"
    old = runs / "20200101-000000-gone-abcd"
    launching = runs / (time.strftime("%Y%m%d-%H%M%S") + "-new-beef")  # no pgid yet
    other = runs / "notes"  # not a run directory: never listed, never touched
    for d in (old, launching, other):
        d.mkdir(parents=True)
    out = tmp_path / "out"
    console = spawn(
        "run",
        str(lines_preset(tmp_path, lines=200, pause=0.05)),
        "--out",
        str(out),
        env=cli_env(home),
    )
    try:
        live = wait_for(lambda: run_dirs(out), what="run")[0]
        wait_for(lambda: any(e["type"] == "cell_started" for e in events(live)), what="the cell")
        live_remote = Path(record_of(live)["remote_dir"])
        done = tracedeck(
            "prune",
            "--target",
            "local",
            "--runs",
            str(runs),
            "--keep",
            "0",
            "--yes",
            env=cli_env(home),
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert not old.exists() and launching.exists() and other.exists() and live_remote.exists()
        assert "a launch may be under way" in done.stdout
        assert f"{live_remote}: live: processes of the run still run" in done.stdout
        # With this machine's records: the console that follows it is seen first.
        argv = ["prune", "--target", "local", "--runs", str(runs), "--out", str(out), "--keep", "0"]
        seen = tracedeck(*argv, env=cli_env(home))
        assert f"a console here follows it ({live})" in seen.stdout, seen.stdout + seen.stderr
    finally:
        console.send_signal(signal.SIGINT)
        console.communicate(timeout=patience(60))


@pytest.mark.ssh
def test_prune_over_ssh(ssh_home: SshHome, tmp_path: Path) -> None:
    runs = tmp_path / "remote-runs"
    old, young = runs / "20200101-000000-gone-abcd", runs / "20990101-000000-future-abcd"
    old.mkdir(parents=True)
    young.mkdir()
    (old / "pgid").write_text("999999999\n")
    argv = ["prune", "--target", ssh_home.server.spec, "--runs", str(runs), "--older-than", "30d"]
    dry = tracedeck(*argv, env=cli_env(ssh_home.path))
    assert dry.returncode == 0 and "1 run(s) would go" in dry.stdout, dry.stdout + dry.stderr
    assert old.exists()
    done = tracedeck(*argv, "--yes", env=cli_env(ssh_home.path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert not old.exists() and young.exists()
