"""The run plan: the shell scripts a run leaves on its target, rendered with every value quoted."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

from runners.determinism import cell_env
from runners.presets import Cell, Preset, render, render_plain

SETUP = "setup"


def cell_dir_name(cell: int) -> str:
    return SETUP if cell < 0 else f"{cell:03d}"


@dataclass(frozen=True, slots=True)
class PlannedCell:
    index: int
    params: dict[str, Any]
    command: str
    env: dict[str, str]
    artifacts: tuple[str, ...] = ()  # paths under the run's artifacts dir to bring home


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

    @property
    def artifacts(self) -> str:
        return f"{self.run_dir}/artifacts"

    def cell_path(self, cell: int, name: str) -> str:
        return f"{self.run_dir}/cells/{cell_dir_name(cell)}/{name}"


def placeholder_values(
    plan_run_dir: str, workdir: str, python: str, run_id: str, date: str
) -> dict[str, Any]:
    return {
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
    pythonpath: str = "",
) -> RunPlan:
    base = {**preset.vars, **placeholder_values(run_dir, workdir, python, run_id, date)}
    cells = []
    for cell in preset.cells():
        values = {**base, **cell.params, "cell": cell.index}
        cells.append(_planned(preset, cell, values))
    setup_values = {**base, "cell": -1}
    for key, options in preset.matrix.items():
        setup_values[key] = options[0]
    setup = [render(step, setup_values) for step in preset.section("engine")["setup"]]
    return RunPlan(
        run_id=run_id,
        run_dir=run_dir,
        workdir=workdir,
        lock=preset.section("target")["lock"],
        python=python,
        setup=setup,
        cells=cells,
        pythonpath=pythonpath,
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
    """One cell: cd, export its environment (never via SSH env requests), run its command(s)."""
    lines = ["set -e", f"cd {shlex.quote(plan.workdir)}"]
    if plan.pythonpath:
        lines.append(
            f"export PYTHONPATH={shlex.quote(plan.pythonpath)}${{PYTHONPATH:+:$PYTHONPATH}}"
        )
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    lines += commands
    return "\n".join(lines) + "\n"


RUN_SH = r"""#!/bin/sh
# Written by tracedeck: runs detached (setsid) and holds the host lock through fd 9.
cd {run_dir}
now() {{ date +%s.%N; }}
ev() {{ printf '%s\n' "$1" >> progress.jsonl; }}
run_cell() {{
  ev "{{\"e\":\"start\",\"cell\":\"$1\",\"t\":$(now)}}"
  sh "cells/$1/cmd.sh" > "cells/$1/stdout.log" 2> "cells/$1/stderr.log" < /dev/null
  rc=$?
  echo "$rc" > "cells/$1/exit_code"
  ev "{{\"e\":\"end\",\"cell\":\"$1\",\"rc\":$rc,\"t\":$(now)}}"
  return "$rc"
}}
{body}
ev "{{\"e\":\"done\",\"t\":$(now)}}"
"""

LAUNCH_SH = r"""#!/bin/sh
# Written by tracedeck: take the host lock, record the holder, start run.sh detached.
cd {run_dir} || exit 70
exec 9>>{lock}
if ! flock -n 9; then
  echo TRACEDECK_LOCK_BUSY
  cat {holder} 2>/dev/null
  exit 75
fi
setsid sh {run_dir}/run.sh < /dev/null > runner.out 2> runner.err &
pid=$!
# Not a group leader (no job control here), so setsid did not fork: $! is the new group's id.
echo "$pid" > pgid.part && mv pgid.part pgid
sed "s/\"pgid\": null/\"pgid\": $pid/" holder.json > {holder}.part && mv {holder}.part {holder}
echo "TRACEDECK_STARTED $pid"
"""

LOCK_BUSY = 75


def run_script(plan: RunPlan) -> str:
    body = []
    if plan.setup:
        body.append(
            'run_cell setup || { ev "{\\"e\\":\\"done\\",\\"setup_failed\\":true}"; exit 1; }'
        )
    body += [f"run_cell {cell_dir_name(c.index)}" for c in plan.cells]
    return RUN_SH.format(run_dir=shlex.quote(plan.run_dir), body="\n".join(body))


def launch_script(plan: RunPlan) -> str:
    return LAUNCH_SH.format(
        run_dir=shlex.quote(plan.run_dir),
        lock=shlex.quote(plan.lock),
        holder=shlex.quote(holder_path(plan.lock)),
    )


def holder_path(lock: str) -> str:
    return f"{lock}.json"


def plan_files(plan: RunPlan, setup_env: dict[str, str]) -> dict[str, str]:
    """Relative path in the run dir -> content, for every script the run needs."""
    files = {"run.sh": run_script(plan), "launch.sh": launch_script(plan)}
    if plan.setup:
        files[f"cells/{SETUP}/cmd.sh"] = cell_script(plan, setup_env, plan.setup)
    for c in plan.cells:
        files[f"cells/{cell_dir_name(c.index)}/cmd.sh"] = cell_script(plan, c.env, [c.command])
    return files


def cancel_script(run_dir: str, grace_s: float) -> str:
    """TERM the run's process group, wait, then KILL; record the cancel in progress.jsonl."""
    d = shlex.quote(run_dir)
    steps = max(1, int(grace_s * 10))
    return f"""cd {d} || exit 70
[ -f pgid ] || {{ echo TRACEDECK_NO_PGID; exit 71; }}
pg=$(cat pgid)
touch cancel
if kill -0 -"$pg" 2>/dev/null; then
  kill -TERM -"$pg" 2>/dev/null
  i=0
  while kill -0 -"$pg" 2>/dev/null && [ $i -lt {steps} ]; do sleep 0.1; i=$((i+1)); done
  if kill -0 -"$pg" 2>/dev/null; then kill -KILL -"$pg" 2>/dev/null; sleep 0.2; echo TRACEDECK_KILLED; fi
  printf '{{"e":"cancelled","t":%s}}\\n' "$(date +%s.%N)" >> progress.jsonl
  echo TRACEDECK_CANCELLED
else
  echo TRACEDECK_NOT_RUNNING
fi
if kill -0 -"$pg" 2>/dev/null; then echo TRACEDECK_STILL_ALIVE; exit 72; fi
"""


def alive_command(run_dir: str) -> str:
    d = shlex.quote(run_dir)
    return (
        f'pg=$(cat {d}/pgid 2>/dev/null) && kill -0 -"$pg" 2>/dev/null && echo alive || echo gone'
    )
