"""`tracedeck plan`: every cell's command, environment, remote paths and files, without
starting anything, for every shipped preset; `--check` reads the target and says what would
fail (exit 3), locally and over a real sshd; target.workdir / target.runs mean what they say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from runhelp import cli_env, python_without_numpy, run_dirs, tracedeck, wait_until_held
from sshd import SshHome

from console.cli import main
from runners.kinds import load_preset
from runners.plan import build_plan, interpreter
from runners.presets import SHIPPED_DIR

SHIPPED = sorted(p.stem for p in SHIPPED_DIR.glob("*.toml"))

HELLO = """
[preset]
name = "where"
kind = "command"
description = "prints where its cells run"

[target]
workdir = "{workdir}"
runs = "{runs}"
lock = "{lock}"

[engine]
command = "pwd; echo out={{out}} run_dir={{run_dir}} workdir={{workdir}}"

[matrix]
n = [1]
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TRACEDECK_HOME", str(tmp_path / "td"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return home


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code = main(["plan", *argv, "--json"])
    said = capsys.readouterr()
    assert code == 0, said.err
    return json.loads(said.out)


@pytest.mark.parametrize("name", SHIPPED)
def test_plan_of_every_shipped_preset(
    name: str, home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    preset = load_preset(SHIPPED_DIR / f"{name}.toml")
    doc = plan_json(capsys, name, "--out", str(home / "out"))
    assert doc["preset"] == name and doc["kind"] == preset.kind
    assert len(doc["cells"]) == preset.cell_count()
    host = preset.section("target")["host"]
    assert doc["python"] == interpreter("local" if host == "local" else "ssh", "")
    run_dir = doc["run_dir"]
    assert doc["out"] == f"{run_dir}/artifacts" and run_dir.endswith("/" + doc["run_id"])
    # The same commands, environments and files the launch renders for this run id.
    plan = build_plan(
        preset,
        run_id=doc["run_id"],
        run_dir=run_dir,
        workdir=doc["workdir"],
        python=doc["python"],
        date=time.strftime("%Y-%m-%d"),
        lock=doc["lock"],
        pythonpath=f"{run_dir}/pkg" if preset.section("engine")["ship_reference"] else "",
    )
    for shown, planned in zip(doc["cells"], plan.cells, strict=True):
        assert shown["command"] == planned.command and shown["env"] == planned.env
        assert [f["remote"] for f in shown["fetch"]] == [
            f"{run_dir}/artifacts/{rel}" for rel in planned.artifacts
        ]
        assert [f["local"] for f in shown["fetch"]] == [
            str(Path(doc["local_dir"]) / rel) for rel in planned.artifacts
        ]
        assert shown["script"] == f"{run_dir}/cells/{shown['index']:03d}/cmd.sh"
    follows = [p for c in doc["cells"] for p in c["follow"]] + doc["follow_shared"]
    assert sorted(follows) == sorted(t.path for t in plan.traces)
    if host == "local":  # this machine's home is known without connecting
        assert doc["resolved"] and doc["runs"] == f"{home}/.tracedeck/runs"
    else:
        assert not doc["resolved"] and doc["runs"].startswith(("<home>/", "/"))
    # The text form names every cell's command, and starts nothing.
    assert main(["plan", name, "--out", str(home / "out")]) == 0
    text = capsys.readouterr().out
    assert "nothing is started" in text
    shown_id = text.split("(run id ", 1)[1].split(";", 1)[0]  # a new id each plan, as each run
    for cell in doc["cells"][:3]:
        assert cell["command"].replace(doc["run_id"], shown_id) in text
    assert not (home / "out").exists() and not (home / ".tracedeck").exists()


def test_check_reads_only_and_says_the_target_is_ready(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs, lock = tmp_path / "remote" / "runs", tmp_path / "locks" / "gpu.lock"
    (tmp_path / "locks").mkdir()
    argv = ["b3_67_smoke", "--set", f'target.runs="{runs}"', "--set", f'target.lock="{lock}"']
    assert main(["plan", *argv, "--check"]) == 0
    text = capsys.readouterr().out
    for word in ("reachable: this machine", "launcher", "free space", "lock:", "python:"):
        assert word in text
    assert "packages: torch and numpy are there" in text
    assert "check: the target is ready for this run" in text
    assert not runs.exists() and not (tmp_path / "remote").exists() and not lock.exists()


def test_check_names_what_would_fail_with_exit_3(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = tmp_path / "gpu.lock"
    holder = subprocess.Popen(["flock", str(lock), "sleep", "60"])
    (tmp_path / "gpu.lock.json").write_text(
        json.dumps({"run_id": "20260101-000000-other-beef", "user": "ann", "pgid": holder.pid})
    )
    try:
        wait_until_held(lock)
        argv = [
            "plan",
            "b3_67_smoke",
            "--check",
            "--set",
            f'target.runs="{tmp_path}/runs"',
            "--set",
            f'target.lock="{lock}"',
            "--set",
            'target.python="/nonexistent/python3"',
        ]
        assert main(argv) == 3
    finally:
        holder.kill()
        holder.wait()
    said = capsys.readouterr()
    assert "lock: " in said.err and "20260101-000000-other-beef" in said.err
    assert "LOCK_BUSY" in said.err
    assert "python: '/nonexistent/python3'" in said.err and "not found" in said.err
    assert "check: 2 problems: a run now would fail" in said.out


def test_absolute_home_relative_and_tilde_dirs_locally(home: Path, tmp_path: Path) -> None:
    preset = tmp_path / "where.toml"
    absolute = tmp_path / "abs work"
    for workdir, runs, want_work, want_runs in (
        (str(absolute), "~/td-runs", absolute, home / "td-runs"),
        ("~", "rel/runs", home, home / "rel" / "runs"),
        ("~/w", str(tmp_path / "r"), home / "w", tmp_path / "r"),
    ):
        preset.write_text(HELLO.format(workdir=workdir, runs=runs, lock=tmp_path / "lock"))
        out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
        done = tracedeck("run", str(preset), "--out", str(out), env=cli_env(home))
        assert done.returncode == 0, done.stdout + done.stderr
        [local] = run_dirs(out)
        run_id = json.loads((local / "run.json").read_text())["run_id"]
        assert f"[1/1] | {want_work}\n" in done.stdout
        assert f"run_dir={want_runs}/{run_id} workdir={want_work}" in done.stdout
        assert (want_runs / run_id / "cells").is_dir()
    assert not (home / "~").exists()  # ~ is never a directory named "~"


@pytest.mark.ssh
def test_dirs_over_ssh_absolute_and_under_the_remote_home(
    ssh_home: SshHome, tmp_path: Path
) -> None:
    env = cli_env(ssh_home.path)
    preset = tmp_path / "where.toml"
    work, runs = tmp_path / "remote work", tmp_path / "remote runs"
    preset.write_text(HELLO.format(workdir=work, runs=runs, lock=tmp_path / "lock"))
    out = tmp_path / "out"
    done = tracedeck(
        "run", str(preset), "--target", ssh_home.server.spec, "--out", str(out), env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"[1/1] | {work}\n" in done.stdout and str(runs) in done.stdout
    # Relative ones are under the SSH user's home, not this console's directory or $HOME:
    # read (never made) by plan --check.
    remote_home = Path("~" + ssh_home.server.user).expanduser()
    checked = tracedeck(
        "plan",
        str(preset),
        "--target",
        ssh_home.server.spec,
        "--check",
        "--json",
        "--set",
        'target.workdir="~"',
        "--set",
        'target.runs="td-test-never-made/runs"',
        env=env,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    doc = json.loads(checked.stdout)
    assert doc["resolved"] and doc["workdir"] == str(remote_home)
    assert doc["runs"] == f"{remote_home}/td-test-never-made/runs"
    assert not (remote_home / "td-test-never-made").exists()
    levels = {c["what"]: c["level"] for c in doc["checks"]}
    assert levels["reachable"] == "ok" and levels["lock"] == "ok"
    assert levels["target.runs"] == "ok"


@pytest.mark.ssh
def test_check_over_ssh_refuses_an_unknown_host_key(ssh_home: SshHome, tmp_path: Path) -> None:
    ssh_home.known_hosts.write_text("")
    done = tracedeck(
        "plan", "hello_command", "--target", ssh_home.server.spec, "--check",
        env=cli_env(ssh_home.path),
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert "host key" in done.stderr and "tracedeck trust" in done.stderr


def test_plan_python_rule_is_one_function() -> None:
    assert interpreter("local", "") == sys.executable
    assert interpreter("ssh://h", "") == "python3"
    assert interpreter("local", "/opt/py") == interpreter("ssh://h", "/opt/py") == "/opt/py"


@pytest.mark.ssh
def test_plan_says_where_b3_67_is_judged_and_what_stays_on_the_host(
    ssh_home: SshHome, tmp_path: Path
) -> None:
    env = cli_env(ssh_home.path)
    argv = ["plan", "b3_67_smoke", "--target", ssh_home.server.spec]
    argv += ["--set", "matrix.seed=[0]", "--set", f'target.runs="{tmp_path}/runs"']
    doc = json.loads(tracedeck(*argv, "--json", env=env).stdout)
    assert doc["judge"]["where"] == "host if it can" and doc["judge"]["requires"] == ["numpy"]
    held = [f["remote"] for c in doc["cells"] for f in c["fetch"] if f["held"]]
    assert len(held) == 4 and all(h.endswith("/logits.jsonl.gz") for h in held)
    # A python that cannot judge, where the preset says judge there or not at all: exit 3.
    no_numpy = python_without_numpy(tmp_path)
    done = tracedeck(
        *argv, "--check", "--set", 'judge.on="host"', "--set", f'judge.python="{no_numpy}"',
        env=env,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert "judging: [judge] on = host, but" in done.stderr and "numpy" in done.stderr
    # A python that can judge, whose numpy the login user (the engine's) can write: said.
    can = tracedeck(*argv, "--check", "--set", f'judge.python="{sys.executable}"', env=env)
    numpy_dir = Path(np.__file__).parent
    warned = f"WARNING judging: numpy in {numpy_dir} can be changed by the login user"
    assert (warned in can.stdout) == os.access(numpy_dir, os.W_OK), can.stdout + can.stderr
    assert f"ok      judging: on the host: {sys.executable} there has numpy" in can.stdout
    local = tracedeck("plan", "b3_67_smoke", "--json", env=env)  # the data is already here
    assert json.loads(local.stdout)["judge"]["where"] == "console"
