"""The Slurm launcher: the run's cells as one job array, submitted with `sbatch --parsable`.

sbatch, squeue, scontrol and scancel run on the cluster's login node: the target (over SSH, or
this machine for slurm://localhost/...). The run directory must be on a filesystem the login
node and the compute nodes share (the home directory, as on most clusters): each array task
runs one cell there through slurm/job.sh, which takes the node's lock (flock, waiting for any
other run on that GPU host), exports the cell's determinism environment (cells/NNN/cmd.sh) and
writes the cell's start and end to cells/NNN/progress.jsonl, so the same follower follows it as
it follows a detached run. A setup step is a job of its own the array depends on.

State comes from `squeue` (pending reason, node) and `scontrol show job` (the final state and
exit code of each task), and from `sacct` where the cluster has accounting, once the controller
forgot the job. A task Slurm killed (time limit, preemption, node failure) is reported per cell
with Slurm's word and ends the run as such (exit 3), never as a verdict. Cancel is scancel.
"""

from __future__ import annotations

import asyncio
import re
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from runners.cells import SETUP_CELL, CellState, cell_name
from runners.events import CellFinished, Event, JobSubmitted, SchedulerState
from runners.kind import SCHEDULER_KILLS, Ending
from runners.launchers.base import NotStartedError, Outcome, Started
from runners.launchers.detached import HOLD_ID, _shell_word, cell_helpers, holder_path
from runners.plan import SETUP, RunPlan
from runners.targets.base import Target, TargetError

if TYPE_CHECKING:
    from runners.follower import RunFollower
    from runners.presets import Preset

SCHEDULER = "slurm"
JOB_DIR = "slurm"
# Job states after which a task runs no more (squeue's long forms, scontrol's JobState).
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "REVOKED", "SPECIAL_EXIT", *SCHEDULER_KILLS})
QUERY_TIMEOUT_S = 30.0
SBATCH_PATH = re.compile(r"[^\s%\'\"\\\x00-\x1f\x7f]+")

JOB_SH = r"""#!/bin/bash
{directives}
# Written by tracedeck: one task of the run's job array runs one cell, under the node's lock.
cd {run_dir} || exit 70
export TRACEDECK_RUN_ID={run_id}
# The tasks of one array share the node's lock (one holds it, the others wait with it open): a
# task's leftovers are found by their marker, by descent, and by holding this task's own hold of
# the lock (never by having the file open: that would reap the next task waiting its turn).
run_lock={lock}
run_lock_id=
cell=${{1:-$(printf '%03d' "${{SLURM_ARRAY_TASK_ID:?not an array task}}")}}
now() {{ date +%s.%N; }}
ev() {{ printf '%s\n' "$1" >> "cells/$cell/progress.jsonl"; }}
{cell_helpers}# Slurm TERMs the job when it kills it (time limit, preemption, scancel): the cell then ends
# without an "end" line, and the scheduler's word says why.
stopping=
trap 'stopping=1' TERM
job="${{SLURM_ARRAY_JOB_ID:-${{SLURM_JOB_ID:-}}}}"
node="$(hostname)"
# The node's lock, as every tracedeck run on this host takes it: wait for whoever holds it.
exec 9>>{lock}
flock 9 || exit 75
[ -n "$stopping" ] && exit 143  # Slurm ended the task while it waited for the lock
[ -e cancel ] && exit 0  # tracedeck cancel came first (while the job was submitted, or pending)
run_lock_id=$({hold_id})
h=$(mktemp {holder}.XXXXXX) && {{ printf '{{"run_id":"%s","user":"%s","console_host":%s,"preset":%s,"slurm_job":"%s","node":"%s","pgid":null}}\n' \
  "$TRACEDECK_RUN_ID" "$(id -un)" {console_host} {preset} "$job" "$node" > "$h" &&
  chmod 644 "$h" && mv -f "$h" {holder} || rm -f "$h"; }}
ev "{{\"e\":\"start\",\"cell\":\"$cell\",\"t\":$(now),\"node\":\"$node\",\"job\":\"$job\"}}"
TRACEDECK_CELL="$TRACEDECK_RUN_ID/$cell" bash "cells/$cell/cmd.sh" > "cells/$cell/stdout.log" \
  2> "cells/$cell/stderr.log" < /dev/null
rc=$?
echo "$rc" > "cells/$cell/exit_code"
reap_cell "$cell"
sizes > "cells/$cell/trace_sizes"
if [ -z "$stopping" ] && [ "$rc" -gt 128 ] && [ -n "${{SLURM_JOB_ID:-}}" ]; then
  # Killed by a signal before this script had Slurm's TERM (Slurm signals a task's processes one
  # by one): the task's own job state says whether Slurm is ending it (scancel, time limit).
  state="$(scontrol show job "$SLURM_JOB_ID" 2>&1 | grep -o 'JobState=[A-Z_]*' | head -n 1)"
  case "$state" in JobState=RUNNING | JobState=CONFIGURING | "") ;; *) stopping=1 ;; esac
fi
if [ -n "$stopping" ]; then
  ev "{{\"e\":\"stopped\",\"cell\":\"$cell\",\"rc\":$rc,\"t\":$(now)}}"
  exit "$rc"
fi
ev "{{\"e\":\"end\",\"cell\":\"$cell\",\"rc\":$rc,\"t\":$(now)}}"
exit "$rc"
"""


@dataclass(frozen=True, slots=True)
class SlurmSettings:
    partition: str = ""
    account: str = ""
    gres: str = ""
    time_limit: str = ""
    extra: tuple[str, ...] = ()


def slurm_settings(spec: str, preset: Preset) -> SlurmSettings | None:
    """The Slurm settings of a run, or None when it does not go to Slurm: a slurm:// target
    (its partition wins over the preset's), or a preset with [target] scheduler = "slurm"."""
    from runners.targets.factory import slurm_spec

    tgt = preset.section("target")
    parsed = slurm_spec(spec)
    if parsed is None and tgt["scheduler"] != SCHEDULER:
        return None
    partition = (parsed[1] if parsed else "") or tgt["partition"]
    return SlurmSettings(
        partition=partition,
        account=tgt["account"],
        gres=tgt["gres"],
        time_limit=tgt["time_limit"],
        extra=tuple(tgt["sbatch"]),
    )


@dataclass(slots=True)
class TaskState:
    """What Slurm says of one array task (one cell)."""

    state: str
    reason: str = ""
    node: str = ""
    exit_code: int | None = None
    signal: int | None = None


def job_script(
    plan: RunPlan, settings: SlurmSettings, holder: dict[str, Any], setup: bool = False
) -> str:
    """The array's script (each task one cell), or the setup job's (setup=True)."""
    if not SBATCH_PATH.fullmatch(plan.run_dir):
        # sbatch reads a directive up to the first blank, expands % in --output, and a newline
        # would end the directives (what follows runs as bash before the script's own cd).
        raise TargetError(
            f"the run directory {plan.run_dir!r} cannot be written in an #SBATCH line (it holds "
            "a blank, %, a quote or a control character): set target.runs to a directory "
            "without them"
        )
    cells = [c.index for c in plan.cells]
    shared = [t for t in plan.traces if t.cell is None]
    if setup:
        lines = [
            f"#SBATCH --job-name={job_name(plan.run_id)}-setup",
            f"#SBATCH --output={plan.run_dir}/{JOB_DIR}/setup.out",
        ]
    else:
        # Shared trace files credit each line to the cell that ran when it was written: only
        # when the cells run one after another (%1).
        array = _ranges(cells) + ("%1" if shared else "")
        lines = [
            f"#SBATCH --job-name={job_name(plan.run_id)}",
            f"#SBATCH --array={array}",
            f"#SBATCH --output={plan.run_dir}/{JOB_DIR}/%a.out",
        ]
    # A task Slurm requeued (a node failure) would run its cell again over the files being
    # followed: never; the cell is reported with Slurm's word instead (NODE_FAIL...).
    lines += [
        f"#SBATCH --chdir={plan.run_dir}",
        "#SBATCH --open-mode=append",
        "#SBATCH --no-requeue",
    ]
    for key in ("partition", "account", "gres"):
        value = getattr(settings, key)
        if value:
            lines.append(f"#SBATCH --{key}={value}")
    if settings.time_limit:
        lines.append(f"#SBATCH --time={settings.time_limit}")
    lines += [f"#SBATCH {line}" for line in settings.extra]
    return JOB_SH.format(
        directives="\n".join(lines),
        run_dir=shlex.quote(plan.run_dir),
        run_id=shlex.quote(plan.run_id),
        cell_helpers=cell_helpers(" ".join(_shell_word(t) for t in shared)),
        lock=shlex.quote(plan.lock),
        holder=shlex.quote(holder_path(plan.lock)),
        console_host=shlex.quote(orjson.dumps(str(holder.get("console_host", ""))).decode()),
        preset=shlex.quote(orjson.dumps(str(holder.get("preset", ""))).decode()),
        hold_id=HOLD_ID,
    )


def job_name(run_id: str) -> str:
    return f"td-{run_id}"


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8' (sbatch --array's form)."""
    out: list[str] = []
    start = prev = None
    for v in sorted(values):
        if prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(out)


def expand_tasks(text: str) -> list[int]:
    """scontrol's ArrayTaskId ('3', '2-4', '1,3-5%1') as task ids."""
    text = text.split("%", 1)[0].strip("[]")
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


_FIELD = re.compile(r"(\w+)=(\S*)")


def parse_scontrol(text: str) -> list[dict[str, str]]:
    """`scontrol -o show job` output: one record (key -> value) per line."""
    return [dict(_FIELD.findall(line)) for line in text.splitlines() if "JobId=" in line]


def _exit(text: str) -> tuple[int | None, int | None]:
    code, _, sig = text.partition(":")
    return (int(code) if code.isdigit() else None, int(sig) if sig.isdigit() else None)


class SlurmLauncher:
    """Submits the cells as one array, watches it through squeue/scontrol, cancels with scancel."""

    def __init__(self, target: Target, settings: SlurmSettings) -> None:
        self.target = target
        self.settings = settings
        self.job_id: str | None = None
        self.setup_job: str | None = None
        self.tasks: dict[int, TaskState] = {}  # cell (SETUP_CELL: the setup job) -> state
        self._shown: dict[int, tuple[str, str, str]] = {}
        self._cells: list[int] = []

    # -- files and start -----------------------------------------------------------------------

    def files(self, plan: RunPlan, holder: dict[str, Any]) -> dict[str, str]:
        files = {f"{JOB_DIR}/job.sh": job_script(plan, self.settings, holder)}
        if plan.setup:
            files[f"{JOB_DIR}/setup.sh"] = job_script(plan, self.settings, holder, setup=True)
        return files

    def progress_files(self, plan: RunPlan) -> list[str]:
        cells = ([SETUP_CELL] if plan.setup else []) + [c.index for c in plan.cells]
        return [plan.cell_path(cell, "progress.jsonl") for cell in cells]

    async def start(self, plan: RunPlan) -> Started:
        script = shlex.quote(f"{plan.run_dir}/{JOB_DIR}/job.sh")
        depends = ""
        if plan.setup:
            setup = shlex.quote(f"{plan.run_dir}/{JOB_DIR}/setup.sh")
            self.setup_job = await self._sbatch(plan, f"{setup} {SETUP}")
            depends = f"--dependency=afterok:{self.setup_job} --kill-on-invalid-dep=yes "
        self.job_id = await self._sbatch(plan, f"{depends}{script}")
        ids = self.job_id + (f" {self.setup_job}" if self.setup_job else "")
        await self.target.write_file(f"{plan.run_dir}/{JOB_DIR}/job_id", (ids + "\n").encode())
        if await self.target.read_from(f"{plan.run_dir}/cancel", 0, 0) is not None:
            await self.target.run(f"scancel {ids}", timeout=QUERY_TIMEOUT_S)  # asked meanwhile
        cells = [c.index for c in plan.cells]
        return Started(
            holder={"slurm_job": self.job_id},
            events=(
                JobSubmitted(
                    scheduler=SCHEDULER,
                    job_id=self.job_id,
                    cells=cells,
                    partition=self.settings.partition,
                ),
            ),
        )

    async def _sbatch(self, plan: RunPlan, args: str) -> str:
        result = await self.target.run(f"sbatch --parsable {args}", timeout=QUERY_TIMEOUT_S)
        out = result.stdout.strip().splitlines()
        job = out[-1].split(";")[0].strip() if out else ""
        if result.exit_status != 0 or not job.isdigit():
            why = result.stderr.strip() or result.stdout.strip() or f"exit {result.exit_status}"
            if result.exit_status == 127:
                why = f"sbatch is not there ({why}): is {self.target.name} a Slurm login node?"
            raise NotStartedError(
                f"{self.target.name}: Slurm refused the job for {plan.run_dir}: {why}"
            )
        return job

    # -- watching ------------------------------------------------------------------------------

    async def _job_ids(self, plan: RunPlan) -> list[str]:
        if self.job_id is None:
            raw = await self.target.read_from(f"{plan.run_dir}/{JOB_DIR}/job_id", 0, 256)
            words = (raw or b"").decode("ascii", "replace").split()
            if words and words[0].isdigit():
                self.job_id = words[0]
                self.setup_job = words[1] if len(words) > 1 and words[1].isdigit() else None
            else:
                # The console stopped between sbatch and writing the id: find it by its name.
                name = job_name(plan.run_id)
                found = await self.target.run(
                    f"squeue -h -o '%F %j' -n {shlex.quote(name)},{shlex.quote(name + '-setup')}",
                    timeout=QUERY_TIMEOUT_S,
                )
                jobs: dict[str, set[str]] = {}
                for line in found.stdout.splitlines():
                    job, _, named = line.strip().partition(" ")
                    if job.isdigit():
                        jobs.setdefault(named, set()).add(job)
                array, setup = jobs.get(name, set()), jobs.get(name + "-setup", set())
                if not array and not setup:
                    return []
                self.job_id = max(array, key=int) if array else None
                self.setup_job = max(setup, key=int) if setup else None
        return [j for j in (self.setup_job, self.job_id) if j]

    async def _query(self, plan: RunPlan) -> None:
        """One round trip: squeue for the live tasks, scontrol for the ended ones."""
        ids = await self._job_ids(plan)
        if not ids:
            return
        self._cells = [c.index for c in plan.cells]
        joined = ",".join(ids)
        command = (
            f"squeue -h -r -j {joined} -o '%F|%K|%T|%r|%N' 2>/dev/null; echo @@; "
            + "; ".join(f"scontrol -o show job {j} 2>/dev/null" for j in ids)
        )
        result = await self.target.run(command, timeout=QUERY_TIMEOUT_S)
        live_text, _, ended_text = result.stdout.partition("@@")
        if result.exit_status == 127 or "@@" not in result.stdout:
            raise TargetError(
                f"{self.target.name}: cannot ask Slurm about job {joined}: "
                f"{result.stderr.strip() or 'no answer'}"
            )
        seen: set[int] = set()
        for record in parse_scontrol(ended_text):
            for cell in self._cells_of(
                record.get("ArrayJobId") or record.get("JobId", ""), record.get("ArrayTaskId", "")
            ):
                code, sig = _exit(record.get("ExitCode", ""))
                self.tasks[cell] = TaskState(
                    state=record.get("JobState", "UNKNOWN"),
                    reason="" if record.get("Reason") == "None" else record.get("Reason", ""),
                    node="" if record.get("NodeList") == "(null)" else record.get("NodeList", ""),
                    exit_code=code,
                    signal=sig,
                )
                seen.add(cell)
        for line in live_text.splitlines():
            parts = line.strip().split("|")
            if len(parts) != 5:
                continue
            job, task, state, reason, node = parts
            for cell in self._cells_of(job, task):
                known = self.tasks.get(cell)
                self.tasks[cell] = TaskState(
                    state=state,
                    reason="" if reason == "None" else reason,
                    node=node,
                    exit_code=known.exit_code if known else None,
                )
                seen.add(cell)
        missing = [c for c in self._cells if c not in seen] + (
            [SETUP_CELL] if self.setup_job and SETUP_CELL not in seen else []
        )
        if missing:
            await self._from_accounting(ids, missing)

    def _cells_of(self, job: str, task: str) -> list[int]:
        if self.setup_job and job == self.setup_job:
            return [SETUP_CELL]
        if job != self.job_id:
            return []
        if task in ("", "N/A", "4294967294"):
            return list(self._cells)  # the array not yet split: every task shares its state
        return [t for t in expand_tasks(task) if t in self._cells]

    async def _from_accounting(self, ids: list[str], missing: list[int]) -> None:
        """Tasks the controller no longer lists: sacct where the cluster keeps accounting."""
        result = await self.target.run(
            f"sacct -n -P -X -j {','.join(ids)} -o JobID,State,ExitCode,NodeList 2>&1",
            timeout=QUERY_TIMEOUT_S,
        )
        if result.exit_status != 0:
            return  # no accounting (no slurmdbd): the cells' own files say how they ended
        for line in result.stdout.splitlines():
            parts = line.split("|")
            if len(parts) < 4:
                continue
            job, _, task = parts[0].partition("_")
            code, sig = _exit(parts[2])
            state = parts[1].split()[0] if parts[1] else "UNKNOWN"
            for cell in self._cells_of(job, task or ""):
                if cell in missing:
                    self.tasks[cell] = TaskState(state, "", parts[3], code, sig)

    async def watch(self, plan: RunPlan) -> list[Event]:
        await self._query(plan)
        events: list[Event] = []
        for cell, task in sorted(self.tasks.items()):
            key = (task.state, task.reason, task.node)
            if self._shown.get(cell) == key:
                continue
            self._shown[cell] = key
            events.append(
                SchedulerState(
                    cell=cell,
                    state=task.state,
                    reason=task.reason,
                    node=task.node,
                    job_id=self.setup_job if cell == SETUP_CELL else (self.job_id or ""),
                    exit_code=task.exit_code,
                )
            )
        return events

    async def alive(self, plan: RunPlan) -> bool:
        """Does Slurm still hold a task of the run (pending, running, completing)?"""
        ids = await self._job_ids(plan)
        if not ids:
            return False
        result = await self.target.run(
            f"squeue -h -j {','.join(ids)} -o %T", timeout=QUERY_TIMEOUT_S
        )
        if result.exit_status == 127:
            raise TargetError(f"{self.target.name}: squeue is not there: is it a login node?")
        if result.exit_status != 0 and "Invalid job id" not in result.stderr:
            # the controller did not answer: that says nothing of the tasks (never "ended")
            raise TargetError(
                f"{self.target.name}: cannot tell whether job {','.join(ids)} still runs: "
                f"squeue failed (exit {result.exit_status}): {result.stderr.strip()[-300:]}"
            )
        return any(state not in ENDED for state in result.stdout.split())

    async def runner_alive(self, plan: RunPlan) -> bool:
        return await self.alive(plan)

    async def outcome(self, plan: RunPlan, follower: RunFollower) -> Outcome:
        """Every task has ended: the cells that wrote no end of their own, as Slurm ended them."""
        await self._query(plan)
        cancelled = await self.target.read_from(f"{plan.run_dir}/cancel", 0, 0) is not None
        total = len(plan.cells)
        finished: list[CellFinished] = []
        kills: list[str] = []
        setup = follower.cells.get(SETUP_CELL)
        setup_failed = setup is not None and setup.finished and not setup.passed
        for index, track in follower.cells.items():
            if track.finished:
                continue
            task = self.tasks.get(index, TaskState("UNKNOWN"))
            word = task.state
            name = cell_name(index, track.plan.params, total)
            where = f" on {task.node}" if task.node else ""
            reason = f"{task.reason}{where}".strip()
            if setup_failed and index != SETUP_CELL:
                state = CellState.SKIPPED  # the array was cancelled: its setup job failed
            elif word == "CANCELLED" or (cancelled and word not in SCHEDULER_KILLS):
                state = CellState.CANCELLED
            elif word in SCHEDULER_KILLS:
                state = CellState.LOST
                kills.append(f"{name}: {word}{' (' + reason + ')' if reason else ''}")
            else:
                state = CellState.LOST  # ended without a word from its own script
                reason = f"Slurm says {word}{' (' + reason + ')' if reason else ''}"
            finished.append(
                CellFinished(
                    cell=index,
                    state=state,
                    exit_code=None,  # killed: the engine gave no exit code of its own
                    duration_s=None,
                    stderr_tail=reason,
                    scheduler=word if state != CellState.SKIPPED else "",
                )
            )
        first = next((w for w in SCHEDULER_KILLS for k in kills if f": {w}" in k), None)
        unknown = [
            cell_name(e.cell, follower.cells[e.cell].plan.params, total) + f": {e.stderr_tail}"
            for e in finished
            if e.state == CellState.LOST and e.scheduler not in SCHEDULER_KILLS
        ]
        if cancelled or (any(e.state == CellState.CANCELLED for e in finished) and first is None):
            ending = Ending("cancelled")
        elif first is not None:
            ending = Ending(
                first.lower(), "Slurm ended cells before they finished: " + "; ".join(kills)
            )
        elif unknown:
            ending = Ending(
                "crashed", "cells ended with no word of their own: " + "; ".join(unknown)
            )
        else:
            ending = Ending("done")
        return Outcome(ending=ending, cells=finished)

    # -- cancelling ----------------------------------------------------------------------------

    async def cancel(self, plan: RunPlan, grace_s: float) -> str:
        """scancel the array (and the setup job); wait for Slurm to end every task."""
        await self.target.run(f"touch {shlex.quote(plan.run_dir + '/cancel')}")
        ids = await self._job_ids(plan)
        if not ids or not await self.alive(plan):
            return "TRACEDECK_NOT_RUNNING"
        result = await self.target.run(f"scancel {' '.join(ids)}", timeout=QUERY_TIMEOUT_S)
        if result.exit_status != 0:
            raise TargetError(
                f"{self.target.name}: scancel {' '.join(ids)} failed (exit "
                f"{result.exit_status}): {result.stderr.strip() or result.stdout.strip()}"
            )
        # Slurm TERMs the tasks, then KILLs them after its KillWait: wait for that, a while.
        deadline = asyncio.get_running_loop().time() + max(grace_s, 1.0) + 60.0
        while asyncio.get_running_loop().time() < deadline:
            if not await self.alive(plan):
                return "TRACEDECK_CANCELLED"
            await asyncio.sleep(0.5)
        return "TRACEDECK_STILL_ALIVE"


__all__ = ["SlurmLauncher", "SlurmSettings", "slurm_settings"]
