"""Shared bits of the Slurm tests an adversarial tester wrote (tests/test_slurm_adv_*.py)."""

from __future__ import annotations

from pathlib import Path

from runhelp import cli_env
from slurm import PARTITION, SlurmCluster

TARGET = f"slurm://localhost/{PARTITION}"


def env_for(cluster: SlurmCluster, tmp: Path, **extra: str) -> dict[str, str]:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    return cli_env(home, **cluster.env, **extra)


def preset(tmp: Path, command: str, *, cells: int = 1, extra: str = "", setup: str = "") -> Path:
    path = tmp / "adv.toml"
    path.write_text(
        f"""
[preset]
name = "adv"
kind = "command"
description = "adversarial"

[target]
runs = "{tmp}/remote"
lock = "{tmp}/node.lock"
{extra}

[engine]
command = '''{command}'''
{setup}

[matrix]
n = {list(range(1, cells + 1))}
"""
    )
    return path
