"""The `tracedeck` command as an operator meets it (issue 24): help, version, logs, status."""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from patience import patience
from runhelp import (
    ROOT,
    cli_env,
    events,
    output_lines,
    run_dirs,
    spawn,
    tracedeck,
    wait_for,
    write_lines_preset,
)
from slurm import slurm_conf
from sshd import free_port

from console.cli import build_parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_help_entry_says_something() -> None:
    blank = []
    for name, sub in subcommands(build_parser()).items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not (action.help or "").strip():
                blank.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert blank == [], f"--help entries with no text: {blank}"


def test_slurm_check_with_no_controller_blames_the_controller_not_the_partition(
    tmp_path: Path,
) -> None:
    """A real slurm.conf whose slurmctld does not run (Debian's Slurm clients, no daemons)."""
    if shutil.which("scontrol") is None:
        pytest.skip("no Slurm clients here (apt-get install slurm-wlm)")
    conf_dir = tmp_path / "slurm"
    conf_dir.mkdir()
    conf = conf_dir / "slurm.conf"
    conf.write_text(slurm_conf(conf_dir, "nodex", 1, free_port(), free_port()))
    home = tmp_path / "home"
    home.mkdir()
    done = tracedeck(
        "plan",
        "b3_67_smoke",
        "--target",
        "slurm://localhost/debug",
        "--set",
        "matrix.seed=[0]",
        "--set",
        f'target.runs="{tmp_path}/remote"',
        "--check",
        env=cli_env(home, SLURM_CONF=str(conf)),
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "controller: no Slurm controller answers" in done.stderr, done.stderr
    assert "is DOWN" in done.stderr and "slurmctld" in done.stderr
    assert "partition" not in done.stderr, done.stderr


def test_version_says_the_version_and_where_it_runs_from(tmp_path: Path) -> None:
    done = tracedeck("--version", env=cli_env(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("tracedeck 0.1.0 (from ") and "Python 3." in done.stdout
    assert done.stdout.count("\n") == 1


SHIM = """#!/bin/sh
# python3 as install.sh uses it: `-m venv DIR` makes DIR/bin with this shim as its python and a
# tracedeck that says it ran; `-m pip ...` does nothing (the real install is test_install's).
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"; cp "$0" "$3/bin/python"
  printf '#!/bin/sh\\necho "tracedeck ran $*"\\n' > "$3/bin/tracedeck"; chmod +x "$3/bin/tracedeck"
fi
exit 0
"""


def test_first_start_says_what_it_installs_and_how_to_put_tracedeck_on_path(
    tmp_path: Path,
) -> None:
    """scripts/run.sh's install step with python3 stood in for (pip would fetch for minutes):
    what the script says, not what pip does, is under test."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    for name in ("scripts/run.sh", "scripts/install.sh", "pyproject.toml"):
        shutil.copy2(ROOT / name, checkout / name)
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "python3").write_text(SHIM)
    (shims / "python3").chmod(0o755)
    env = {**cli_env(tmp_path), "PATH": f"{shims}:/usr/bin:/bin"}
    run = [
        "bash",
        str(checkout / "scripts" / "run.sh"),
        "presets",
    ]
    first = subprocess.run(run, env=env, capture_output=True, text=True, timeout=patience(60))
    assert first.returncode == 0, first.stderr
    assert first.stdout == "tracedeck ran presets\n"
    said = first.stderr
    assert "first start: creating" in said and "torch 2.13.0" in said and "a few minutes" in said
    assert f'export PATH="{checkout}/.venv/bin:$PATH"' in said, said
    again = subprocess.run(run, env=env, capture_output=True, text=True, timeout=patience(60))
    assert again.returncode == 0 and again.stderr == "" and again.stdout == first.stdout


def test_readme_says_how_to_get_tracedeck_on_path() -> None:
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set-up on a fresh machine") :]
    assert 'export PATH="$PWD/.venv/bin:$PATH"' in setup[: setup.index("\n## ", 5)]


# -- tracedeck logs ----------------------------------------------------------------------------------


def test_logs_follows_a_live_run_to_its_end_and_exits_with_its_code(tmp_path: Path) -> None:
    preset = write_lines_preset(tmp_path, lines=4, pause=0.3)
    env = cli_env(tmp_path)
    out = tmp_path / "out"
    running = spawn(
        "run", str(preset), "--out", str(out), "--set", "matrix.rc=[2]", env=env
    )  # every cell exits 2: the run's verdict is FAIL, exit 1
    try:
        local = wait_for(lambda: run_dirs(out), what="the run's directory")[0]
        wait_for(lambda: output_lines(events(local)), what="the first output line")
        assert running.poll() is None, "the run ended before logs -f started"
        followed = tracedeck("logs", "-f", str(local), env=env, timeout=120)
        run_code = running.wait(timeout=patience(60))
    finally:
        if running.poll() is None:
            running.kill()
            running.wait()
    assert run_code == 1
    assert followed.returncode == run_code, followed.stdout + followed.stderr
    expected = [f"[{n}/3] cell {n} line {i}" for n in (1, 2, 3) for i in range(1, 5)]
    assert followed.stdout.splitlines() == expected
    assert "the run ended: FAIL (exit 1)" in followed.stderr
    one = tracedeck("logs", str(local), "--cell", "2", env=env)
    assert one.returncode == 0 and one.stdout.splitlines() == [
        f"cell 2 line {i}" for i in (1, 2, 3, 4)
    ]
    wrong = tracedeck("logs", str(local), "--cell", "7", env=env)
    assert wrong.returncode == 2 and "run has cells 1..3" in wrong.stderr


def test_logs_of_no_such_run_names_it(tmp_path: Path) -> None:
    done = tracedeck("logs", "nosuch-run", "--out", str(tmp_path), env=cli_env(tmp_path))
    assert done.returncode == 2 and "no run 'nosuch-run'" in done.stderr


# -- tracedeck doctor ----------------------------------------------------------------------------------


def test_doctor_checks_this_machine_and_the_local_target(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    done = tracedeck("doctor", "--out", str(tmp_path / "runs"), env=cli_env(home))
    assert done.returncode == 0, done.stdout + done.stderr
    for what in ("python", "packages", "config", "ssh config", "records"):
        assert f"  ok      {what}: " in done.stdout.split("\ntarget local")[0], done.stdout
    for what in ("reachable", "launcher", "free space", "lock"):
        assert f"  ok      {what}: " in done.stdout.split("\ntarget local")[1], done.stdout
    assert done.stdout.rstrip().endswith("doctor: all good")


def test_doctor_names_a_held_lock_and_an_unreachable_host(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    lock = "/tmp/tracedeck.lock"  # the default lock (tests run with a private /tmp)
    with open(lock, "a") as held_open:  # held by this process, let go when the file closes
        fcntl.flock(held_open, fcntl.LOCK_EX)
        held = tracedeck("doctor", "--out", str(tmp_path / "runs"), env=env)
    assert held.returncode == 3, held.stdout + held.stderr
    assert f"PROBLEM lock: {lock} is held" in held.stdout
    assert "doctor: 1 thing to fix" in held.stdout
    unreachable = tracedeck(
        "doctor", "--target", f"ssh://127.0.0.1:{free_port()}", "--json", env=env
    )
    assert unreachable.returncode == 3, unreachable.stdout + unreachable.stderr
    doc = json.loads(unreachable.stdout)
    assert doc["problems"] == 1
    assert [c["what"] for c in doc["target_checks"] if c["level"] == "problem"] == ["reachable"]


OPENBLAS_PROBE = """
import os, sys
sys.argv[0] = "tracedeck"  # the program, as its entry point starts it
import console.cli  # noqa: F401
import numpy  # noqa: F401
print(len(os.listdir("/proc/self/task")), os.environ.get("OPENBLAS_NUM_THREADS", "unset"))
"""


@pytest.mark.e2e  # starts a process: out of the fast tier
@pytest.mark.parametrize(("given", "said"), [(None, "1 unset"), ("1", "1 1")])
def test_the_program_loads_numpy_without_openblas_threads_and_leaves_the_environment(
    given: str | None, said: str
) -> None:
    """OpenBLAS's pool would spin ~0.1 s of CPU at start; the variable that keeps it away is
    not left for the engines and commands tracedeck starts (a variable given is kept)."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", OPENBLAS_PROBE], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == said.split()
