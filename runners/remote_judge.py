"""Judging on the target: ship what a kind's judging needs, check the host's python can run it,
run it there, and take its answer from the command's own stdout (never a file in a directory
the engine writes).

The engine runs there as the same user, so the shipped files are not trusted to stay as they
were shipped: every judging command is `python -I -S -c BOOT` (runners/hosted/boot.py, sent on the
command line), which checks each file against the sha256 of the console's own copy and runs the
modules from those checked bytes, with the engine's directory and PYTHON* variables off the path
and nothing in the interpreter's site-packages run on its own (no sitecustomize, no .pth).

The session decides where a run is judged before it starts ([judge] on) and says so in the run's
header; the judge then uses `ctx.host` (a RemoteJudge, or None when it judges here).
"""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path
from typing import Any

from runners.hosted.boot import ISOLATED
from runners.kind import HostJudging
from runners.targets.base import Target, TargetError

SOURCE_ROOT = Path(__file__).resolve().parent.parent
# Shipped with every kind's modules: the packages and the one runners module they may use.
BASE_MODULES = (
    "runners/__init__.py",
    "runners/atomic.py",
    "runners/hosted/__init__.py",
    "runners/hosted/check.py",
)
CHECK_TIMEOUT_S = 60.0
BOOT = (SOURCE_ROOT / "runners/hosted/boot.py").read_text(encoding="utf-8")


def shipped(spec: HostJudging) -> tuple[str, ...]:
    """Every file shipped for a kind's judging, relative to the source tree."""
    return (*BASE_MODULES, *spec.modules)


def manifest(spec: HostJudging) -> dict[str, str]:
    """{file: sha256} of the console's own copy of each shipped file: what the target must hold."""
    return {
        rel: hashlib.sha256((SOURCE_ROOT / rel).read_bytes()).hexdigest() for rel in shipped(spec)
    }


def judge_argv(python: str, judge_dir: str, hashes: dict[str, str], entry: str) -> list[str]:
    """The command that runs `entry` of a shipped judge from its checked bytes, isolated."""
    return [python, *ISOLATED, "-c", BOOT, judge_dir, json.dumps(hashes), entry]


def imports_argv(python: str, modules: list[str]) -> list[str]:
    """The command that says whether `python`, started as a judge is, imports `modules`."""
    return [python, *ISOLATED, "-c", BOOT, "--imports", *modules]


class RemoteJudge:
    """The console's hands on the target for a kind that judges there."""

    def __init__(
        self, target: Target, python: str, judge_dir: str, artifacts: str, local_dir: Path
    ) -> None:
        self.target = target
        self.python = python
        self.judge_dir = judge_dir  # where the modules are shipped (its PYTHONPATH)
        self.artifacts = artifacts  # the run's artifacts directory on the target
        self.local_dir = local_dir
        self.hashes: dict[str, str] | None = None  # {shipped file: sha256}, held here

    async def ship(self, spec: HostJudging) -> None:
        """Write the judge's files there; their hashes are held here from the bytes sent."""
        hashes = {}
        for rel in shipped(spec):
            data = (SOURCE_ROOT / rel).read_bytes()
            await self.target.write_file(f"{self.judge_dir}/{rel}", data)
            hashes[rel] = hashlib.sha256(data).hexdigest()
        self.hashes = hashes

    def command(self, spec: HostJudging, entry: str, args: list[str]) -> str:
        """The shell command that runs `entry` of the shipped judge, checked and isolated.

        The hashes are those of the bytes this console shipped (or, for a run it reattached
        to, of its own copy of the same files)."""
        if self.hashes is None:
            self.hashes = manifest(spec)
        argv = judge_argv(self.python, self.judge_dir, self.hashes, entry)
        return " ".join(shlex.quote(a) for a in [*argv, *args])

    async def unusable(self, spec: HostJudging, module: str) -> str | None:
        """Why the host cannot judge (its python lacks what is needed), or None when it can."""
        imports = ", ".join([*spec.requires, module])
        result = await self.target.run(
            f"cd && {self.command(spec, 'runners.hosted.check', [*spec.requires, module])}",
            timeout=CHECK_TIMEOUT_S,
        )
        if result.exit_status == 0:
            return None
        said = (result.stderr.strip().splitlines() or [f"exit {result.exit_status}"])[-1]
        if result.stdout.strip():
            said = result.stdout.strip().splitlines()[-1]
        return f"{self.python} -I -S on {self.target.name} cannot import {imports}: {said}"

    async def run(self, spec: HostJudging, args: list[str], timeout: float | None = None) -> Any:
        """Run the kind's judge entry in the artifacts directory; its one JSON line, parsed.

        A shipped file that no longer matches the console's copy is a TargetError naming it."""
        result = await self.target.run(
            f"cd {shlex.quote(self.artifacts)} && {self.command(spec, spec.entry, args)}",
            timeout=timeout,
        )
        lines = result.stdout.strip().splitlines()
        try:
            said = json.loads(lines[-1])
        except (IndexError, ValueError):
            said = None
        if not isinstance(said, dict):
            tail = result.stderr.strip()[-600:] or "(no output)"
            raise TargetError(
                f"judging on {self.target.name} failed ({spec.entry} exited "
                f"{result.exit_status}): {tail}"
            )
        if said.get("tampered"):
            raise TargetError(f"judging on {self.target.name} refused: {said['tampered']}")
        return said
