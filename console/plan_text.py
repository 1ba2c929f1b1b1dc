"""A run's plan and its checks as the CLI prints them (text or one JSON document) and the console
shows them."""

from __future__ import annotations

import shlex
from typing import Any

import orjson

from runners.config import chosen_lock
from runners.determinism import PROFILES
from runners.launchers.slurm import job_script
from runners.plan import PYTHON_RULE, cell_dir_name, home_relative
from runners.preflight import OK, PROBLEM, WARN, Checked
from runners.preview import HOME, MEMBER, Preview, judging


def _env_text(env: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) or "(none)"


def _lock_source(p: Preview) -> str:
    lock, who = chosen_lock(p.preset, p.target)
    if who == "--set":
        return "named with --set target.lock"
    if who == "the preset":
        return "the preset's lock"
    if p.preset.section("target")["lock"]:
        return (
            f"the host's lock; the preset's [target] lock is for its own host "
            f"{p.preset.section('target')['host']}, not this one"
        )
    return "the host's lock"


def _where(key: str, setting: str) -> str:
    if home_relative(setting).startswith("/"):
        return f"target.{key} = {setting!r}, absolute"
    return f"target.{key} = {setting!r}, under the target's home"


def plan_lines(p: Preview) -> list[str]:
    """The plan as the CLI prints it and the console shows it."""
    preset, plan = p.preset, p.plan
    tgt = preset.section("target")
    engine = preset.section("engine")
    n = len(plan.cells)
    det = preset.section("determinism")["profile"]
    where = f"over {len(p.hosts)} hosts" if p.hosts else f"on {p.target_name}"
    run_dir = f"(run id {p.run_id}; a new id each run)"
    lock = f"{p.lock}  ({_lock_source(p)})"
    if p.hosts:
        run_dir = f"(run id {p.run_id}; {MEMBER}: the host and its batch, named as it starts)"
        lock = "each host's own, for the time it runs cells (below)"
    elif p.slurm is not None:
        lock = f"{p.lock}  (each array task takes it on the node Slurm runs it on)"
    lines = [
        f"plan: preset {preset.name} ({preset.kind}), {n} cell{'s' if n != 1 else ''} "
        f"{where}; nothing is started",
        f"  preset file: {preset.source}",
        f"  python:      {p.python}  ({{python}}: {PYTHON_RULE})",
        f"  workdir:     {p.workdir}  ({_where('workdir', tgt['workdir'])}; each cell runs here)",
        f"  runs:        {p.runs}  ({_where('runs', tgt['runs'])}; independent of workdir)",
        f"  run dir:     {p.run_dir}  {run_dir}",
        f"  {{out}}:       {plan.artifacts}",
        f"  lock:        {lock}",
        f"  local dir:   {p.local_dir}  (also {p.by_id})",
        f"  determinism: {det}: {_env_text(PROFILES[det]) if PROFILES[det] else '(none)'}",
    ]
    if p.hosts:
        lines += _fleet_lines(p)
    if p.slurm is not None:
        lines += _slurm_lines(p)
    if not p.resolved:
        lines.append(
            f"  ({HOME} is the target's login home: `tracedeck plan --check` connects, reads "
            "the real paths and checks the target)"
        )
    if engine["ship_reference"]:
        lines.append(
            f"  shipped:     the reference engine (runners/reference) to {plan.pythonpath}, "
            "put first on PYTHONPATH"
        )
    judge = judging(p)
    if judge is not None:
        lines.append(f"  judged:      {judge['where']} ({judge['why']})")
        if judge["held"]:
            stays = (
                "fetched after judging ([judge] fetch_held)"
                if judge["fetch_held"]
                else ("stay there; `tracedeck fetch DIR` brings them home")
            )
            lines.append(f"               judged there, the files marked (held) {stays}")
    held = set(judge["held"]) if judge else set()
    for i, step in enumerate(plan.setup):
        lines.append(f"  setup[{i}]:    {step}")
    if plan.setup:
        lines.append(
            f"               script {plan.cell_path(-1, 'cmd.sh')}; a failure stops the run"
        )
    if engine["version_command"]:
        lines.append(
            f"  version:     {engine['version_command']} (in the workdir, before the run; its "
            "first line names the engine in the record)"
        )
    shared = [t for t in plan.traces if t.cell is None]
    for t in shared:
        lines.append(f"  follow:      {t.path}  (live, written by several cells)")
    lines.append(
        f"  each cell:   bash -c 'set -euo pipefail; cd {shlex.quote(plan.workdir)}; export "
        "ENV...; COMMAND' in cells/NNN/cmd.sh; stdout.log, stderr.log and exit_code beside it"
    )
    for c in plan.cells:
        label = " ".join(f"{k}={v}" for k, v in c.params.items())
        lines.append("")
        lines.append(f"cell {c.index + 1}/{n} ({label})")
        lines.append(f"  command: {c.command}")
        lines.append(f"  env:     {_env_text(c.env)}")
        lines.append(f"  script:  {plan.run_dir}/cells/{cell_dir_name(c.index)}/cmd.sh")
        for rel in c.artifacts:
            mark = "  (held)" if rel in held else ""
            lines.append(f"  fetch:   {plan.artifacts}/{rel}{mark}")
            lines.append(f"        -> {p.local_dir / rel}")
        for t in plan.traces:
            if t.cell == c.index:
                how = "every file matching it, " if t.is_pattern else ""
                lines.append(f"  follow:  {t.path}  ({how}live)")
    return lines


def _fleet_lines(p: Preview) -> list[str]:
    fleet = p.preset.section("fleet")
    lines = [f"  host:        {h.spec}  (lock {h.lock})" for h in p.placement.hosts]
    busy = {
        "skip": "skipped for this run (fleet.busy = skip)",
        "wait": "waited for (fleet.busy = wait)",
    }[fleet["busy"]]
    lost = "re-queued on the others" if fleet["requeue"] else "reported lost (fleet.requeue)"
    lines.append(f"  busy host:   {busy}; a lost host's cells are {lost}")
    groups = [g for g in p.groups if len(g) > 1]
    if groups:
        kept = ", ".join("+".join(str(c + 1) for c in g) for g in groups)
        lines.append(f"  together:    cells {kept} each run on one host (fleet.together)")
    return lines


def _slurm_lines(p: Preview) -> list[str]:
    n = len(p.plan.cells)
    lines = [
        f"  scheduler:   Slurm, through {p.target_name}: `sbatch --parsable` of one job array "
        f"({n} task{'s' if n != 1 else ''}, one cell each); squeue/scontrol watch it, scancel "
        "cancels it"
    ]
    lines += [f"    {line}" for line in sbatch_directives(p)]
    return lines


def check_lines(checked: Checked) -> list[str]:
    marks = {OK: "ok     ", WARN: "WARNING", PROBLEM: "PROBLEM"}
    lines = [f"  {marks[f.level]} {f.what}: {f.text}" for f in checked.findings]
    n = len(checked.problems)
    lines.append(
        "check: the target is ready for this run"
        if n == 0
        else f"check: {n} problem{'s' if n != 1 else ''}: a run now would fail"
    )
    return lines


def to_json(doc: Any) -> str:
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()


def plan_document(p: Preview) -> dict[str, Any]:
    """The plan as one JSON document (`tracedeck plan --json`)."""
    preset, plan = p.preset, p.plan
    tgt = preset.section("target")
    shared = [t.path for t in plan.traces if t.cell is None]
    judge = judging(p)
    held = set(judge["held"]) if judge else set()
    cells = []
    for c in plan.cells:
        cells.append(
            {
                "index": c.index,
                "params": c.params,
                "command": c.command,
                "env": c.env,
                "script": plan.cell_path(c.index, "cmd.sh"),
                "stdout": plan.cell_path(c.index, "stdout.log"),
                "stderr": plan.cell_path(c.index, "stderr.log"),
                "exit_code": plan.cell_path(c.index, "exit_code"),
                "fetch": [
                    {
                        "remote": f"{plan.artifacts}/{rel}",
                        "local": str(p.local_dir / rel),
                        "held": rel in held,  # judged on the host, it stays there
                    }
                    for rel in c.artifacts
                ],
                "follow": [t.path for t in plan.traces if t.cell == c.index],
            }
        )
    return {
        "preset": preset.name,
        "kind": preset.kind,
        "source": preset.source,
        "judge": judge,
        "target": p.target_name,
        "resolved": p.resolved,
        "python": p.python,
        "python_rule": PYTHON_RULE,
        "workdir": p.workdir,
        "workdir_setting": tgt["workdir"],
        "runs": p.runs,
        "runs_setting": tgt["runs"],
        "run_id": p.run_id,
        "run_dir": p.run_dir,
        "out": plan.artifacts,
        "lock": p.lock,
        "local_dir": str(p.local_dir),
        "by_id": str(p.by_id),
        "profile": preset.section("determinism")["profile"],
        "ship_reference": preset.section("engine")["ship_reference"],
        "pythonpath": plan.pythonpath,
        "setup": plan.setup,
        "follow_shared": shared,
        "fleet": _fleet_document(p),
        "slurm": {"directives": sbatch_directives(p)} if p.slurm is not None else None,
        "cells": cells,
    }


def _fleet_document(p: Preview) -> dict[str, Any] | None:
    if not p.hosts:
        return None
    fleet = p.preset.section("fleet")
    return {
        "hosts": [{"host": h.spec, "lock": h.lock} for h in p.placement.hosts],
        "busy": fleet["busy"],
        "requeue": fleet["requeue"],
        "groups": p.groups,
    }


def sbatch_directives(p: Preview) -> list[str]:
    """The #SBATCH lines of the run's job array, as the launch writes them."""
    assert p.slurm is not None
    script = job_script(p.plan, p.slurm, {"preset": p.preset.name})
    return [line for line in script.splitlines() if line.startswith("#SBATCH ")]
