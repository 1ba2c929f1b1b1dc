"""The run plan: every cell's exact command, environment, artifacts and trace files on the target.

Rendered once, with every value quoted, and kept with the run's record (plan.json); the
launcher turns it into the scripts it leaves on the target.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from typing import Any

from runners.cells import SETUP_CELL, PlannedCell
from runners.determinism import cell_env
from runners.presets import Cell, Preset
from runners.templates import render, render_plain

SETUP = "setup"

# {python}, in one rule (docs/ENGINES.md says the same): target.python when the preset sets it;
# otherwise, on the local target, the interpreter running tracedeck (it has what tracedeck has,
# torch included when installed), and on any other target `python3` as its login PATH finds it.
PYTHON_RULE = (
    "target.python when set; else on the local target the Python running tracedeck, "
    "on any other target `python3` from its login PATH"
)


def interpreter(target_name: str, configured: str) -> str:
    """What {python} stands for on a target (PYTHON_RULE)."""
    if configured:
        return configured
    return sys.executable if target_name == "local" else "python3"


def home_relative(path: str) -> str:
    """target.workdir / target.runs as a path relative to the login home, or an absolute one:
    `~` and `~/x` are the home and x under it; any other relative path is under the home too."""
    if path == "~":
        return "."
    if path.startswith("~/"):
        return path[2:] or "."
    return path


def dir_command(path: str, create: bool) -> str:
    """sh that prints the absolute directory `path` names on a target (home_relative); with
    `create`, makes it first. Without it, the command only reads (the dry run's check)."""
    q = shlex.quote(home_relative(path))
    make = f"mkdir -p -- {q} && " if create else ""
    return f"cd && {make}cd -- {q} && pwd"


def cell_dir_name(cell: int) -> str:
    return SETUP if cell == SETUP_CELL else f"{cell:03d}"


GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True, slots=True)
class TraceFile:
    """A trace file to follow: written by one cell, or by several (cell None) one after another.

    The file name may be a glob pattern (e.g. trace_steps_*.jsonl): every file that comes to
    match it in that directory is followed from when it appears.
    """

    path: str  # absolute on the target
    cell: int | None

    @property
    def is_pattern(self) -> bool:
        return bool(GLOB_CHARS & set(self.path.rsplit("/", 1)[-1]))


@dataclass(frozen=True, slots=True)
class RunPlan:
    """Everything a run needs on the target; paths are absolute on the target."""

    run_id: str
    run_dir: str
    workdir: str
    lock: str
    python: str
    setup: list[str]
    cells: list[PlannedCell]
    pythonpath: str = ""
    traces: tuple[TraceFile, ...] = ()

    @property
    def artifacts(self) -> str:
        return f"{self.run_dir}/artifacts"

    def cell_path(self, cell: int, name: str) -> str:
        return f"{self.run_dir}/cells/{cell_dir_name(cell)}/{name}"


def placeholder_values(
    plan_run_dir: str, workdir: str, python: str, run_id: str, date: str, name: str
) -> dict[str, Any]:
    return {
        "name": name,
        "python": python,
        "out": f"{plan_run_dir}/artifacts",
        "run_dir": plan_run_dir,
        "workdir": workdir,
        "run_id": run_id,
        "date": date,
    }


def build_plan(
    preset: Preset,
    *,
    run_id: str,
    run_dir: str,
    workdir: str,
    python: str,
    date: str,
    lock: str,
    pythonpath: str = "",
) -> RunPlan:
    base = {
        **preset.vars,
        **placeholder_values(run_dir, workdir, python, run_id, date, preset.name),
    }
    cells = []
    owners: dict[str, list[int]] = {}
    for cell in preset.cells():
        values = {**base, **cell.params, "cell": cell.index}
        cells.append(_planned(preset, cell, values))
        for template in preset.section("traces")["follow"]:
            path = f"{run_dir}/artifacts/{render_plain(template, values)}"
            owners.setdefault(path, []).append(cell.index)
    setup_values = {**base, "cell": SETUP_CELL}
    for key, options in preset.matrix.items():
        setup_values[key] = options[0]
    setup = [render(step, setup_values) for step in preset.section("engine")["setup"]]
    traces = tuple(
        TraceFile(path, written[0] if len(written) == 1 else None)
        for path, written in owners.items()
    )
    return RunPlan(
        run_id=run_id,
        run_dir=run_dir,
        workdir=workdir,
        lock=lock,
        python=python,
        setup=setup,
        cells=cells,
        pythonpath=pythonpath,
        traces=traces,
    )


def _planned(preset: Preset, cell: Cell, values: dict[str, Any]) -> PlannedCell:
    return PlannedCell(
        index=cell.index,
        params=cell.params,
        command=render(preset.section("engine")["command"], values),
        env=cell_env(preset.data, values),
        artifacts=tuple(render_plain(t, values) for t in preset.section("artifacts")["fetch"]),
    )


def cell_script(plan: RunPlan, env: dict[str, str], commands: list[str]) -> str:
    """One cell, run by bash: cd, export its environment (never via SSH env requests), run.

    `set -euo pipefail` (seed 000 section 4): a failing step, an unset variable, a failing
    stage of a pipe or of a command substitution in an assignment fails the cell.
    """
    lines = ["set -euo pipefail", f"cd {shlex.quote(plan.workdir)}"]
    if plan.pythonpath:
        lines.append(
            f"export PYTHONPATH={shlex.quote(plan.pythonpath)}${{PYTHONPATH:+:$PYTHONPATH}}"
        )
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    lines += commands
    return "\n".join(lines) + "\n"


def cell_scripts(plan: RunPlan) -> dict[str, str]:
    """Relative path in the run dir -> content of each cell's cmd.sh (and the setup step's)."""
    files: dict[str, str] = {}
    if plan.setup:
        setup_env = plan.cells[0].env if plan.cells else {}
        files[f"cells/{SETUP}/cmd.sh"] = cell_script(plan, setup_env, plan.setup)
    for c in plan.cells:
        files[f"cells/{cell_dir_name(c.index)}/cmd.sh"] = cell_script(plan, c.env, [c.command])
    return files


def plan_document(plan: RunPlan, preset: Preset) -> dict[str, Any]:
    """plan.json: each cell's exact command and environment, kept on the target and at home."""
    return {
        "run_id": plan.run_id,
        "preset": preset.name,
        "kind": preset.kind,
        "cells": [
            {"index": c.index, "params": c.params, "command": c.command, "env": c.env}
            for c in plan.cells
        ],
        "setup": plan.setup,
        "traces": [{"path": t.path, "cell": t.cell} for t in plan.traces],
    }
