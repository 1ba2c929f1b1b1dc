"""Judging on the target: ship what a kind's judging needs, check the host's python can run it,
run it there, and bring home only what it wrote (metrics, first-fail context, the report).

The session decides where a run is judged before it starts ([judge] on) and says so in the run's
header; the judge then uses `ctx.host` (a RemoteJudge, or None when it judges here).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from runners.fetch import download_into
from runners.kind import HostJudging
from runners.targets.base import Target, TargetError

SOURCE_ROOT = Path(__file__).resolve().parent.parent
# Shipped with every kind's modules: the packages and the one runners module they may use.
BASE_MODULES = ("runners/__init__.py", "runners/atomic.py", "runners/hosted/__init__.py")
CHECK_TIMEOUT_S = 60.0


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

    async def ship(self, spec: HostJudging) -> None:
        for rel in (*BASE_MODULES, *spec.modules):
            data = (SOURCE_ROOT / rel).read_bytes()
            await self.target.write_file(f"{self.judge_dir}/{rel}", data)

    async def unusable(self, spec: HostJudging, module: str) -> str | None:
        """Why the host cannot judge (its python lacks what is needed), or None when it can."""
        imports = ", ".join([*spec.requires, module])
        result = await self.target.run(
            f"cd && PYTHONPATH={shlex.quote(self.judge_dir)} {shlex.quote(self.python)} "
            f"-c {shlex.quote(f'import {imports}')}",
            timeout=CHECK_TIMEOUT_S,
        )
        if result.exit_status == 0:
            return None
        said = (result.stderr.strip().splitlines() or [f"exit {result.exit_status}"])[-1]
        return f"{self.python} on {self.target.name} cannot import {imports}: {said}"

    async def run(self, module: str, args: list[str], timeout: float | None = None) -> Any:
        """Run a hosted module in the artifacts directory; its one JSON line, parsed."""
        argv = " ".join(shlex.quote(a) for a in args)
        result = await self.target.run(
            f"cd {shlex.quote(self.artifacts)} && PYTHONPATH={shlex.quote(self.judge_dir)} "
            f"{shlex.quote(self.python)} -m {module} {argv}",
            timeout=timeout,
        )
        lines = result.stdout.strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, ValueError):
            tail = result.stderr.strip()[-600:] or "(no output)"
            raise TargetError(
                f"judging on {self.target.name} failed ({module} exited {result.exit_status}): "
                f"{tail}"
            ) from None

    async def fetch(self, rel: str) -> Path:
        """Bring artifacts/rel home to the run's directory (atomically)."""
        return await download_into(self.target, f"{self.artifacts}/{rel}", self.local_dir, rel)
