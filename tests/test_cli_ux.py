"""The `tracedeck` command as an operator meets it (issue 24): help, version, logs, status."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
from runhelp import cli_env, tracedeck
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
