"""After a run ends, its host is asked whether anything of it is still alive or still holds its lock.

The check reads the host itself, never the run's record: its processes found as cancel finds them
(the run's marker in their environment, descent from its runner, the lock file held open while the
holder names the run) and the kernel's table of held locks (/proc/locks), read without taking the
lock, so the check never makes a run starting at that moment busy. What it finds is said as an
error that names each process (pid and command) and how to stop it; it is no verdict's error, so
it never changes a verdict, least of all into a pass.
"""

from __future__ import annotations

import asyncio
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from runners.events import Error, Event
from runners.launchers.base import Launcher
from runners.launchers.detached import RUN_PIDS, DetachedLauncher, holder_path
from runners.plan import RunPlan
from runners.targets.base import Target, TargetError

# A run's last processes exit a moment after its end is written: wait that long at most for
# them to go (no longer than its runner lives, and one look more).
GRACE_S = 10.0
STEP_S = 0.2

# P PID COMMAND: a live process of the run; S DEV INO: the lock file; K LINE: a flock the
# kernel holds; H TEXT: the holder record beside the lock.
LOOK = r"""
held=$(cat {run_dir}/lock_id 2>/dev/null)
printf 'I %s\n' "$held"
for p in $(run_pids {marker} "$(runner_pid {run_dir})" {lock} {run_id} "$held"); do
  printf 'P %s %s\n' "$p" "$(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-200)"
done
if [ -e {lock} ]; then
  printf 'S %s\n' "$(stat -L -c '%d %i' -- {lock})"
  grep ' FLOCK ' /proc/locks 2>/dev/null | grep -v -- '->' | sed 's/^/K /'
  printf 'H %s\n' "$(head -c 4096 {holder} 2>/dev/null | tr '\n' ' ')"
fi
"""

# O PID COMMAND: a process with the lock file open under any name (same device and inode).
OPENERS = r"""
for f in /proc/[0-9]*/fd/*; do
  if [ "$f" -ef {lock} ]; then
    p=${{f#/proc/}}; p=${{p%%/*}}
    printf 'O %s %s\n' "$p" "$(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-200)"
  fi
done 2>/dev/null | sort -u
"""


@dataclass(slots=True)
class Leftovers:
    """What of a run the host still shows after it ended."""

    processes: list[tuple[int, str]] = field(default_factory=list)
    lock_held: bool = False  # the run's flock still there, and the holder names this run
    openers: list[tuple[int, str]] = field(default_factory=list)  # when lock_held

    def __bool__(self) -> bool:
        return bool(self.processes) or self.lock_held


def _flocked(dev: int, ino: int, lines: list[str], held: str) -> bool:
    """Does /proc/locks hold the run's flock on this file? (Its lines say PID MAJ:MIN:INODE,
    hex:hex:dec; the run's hold is the one its launch took, `held`: its taker's pid.)"""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    for line in lines:
        words = line.split()
        if want in words and want != words[0]:
            at = words.index(want)
            if held in ("", "0") or words[at - 1] == held:
                return True
    return False


def _names_run(holder: str, run_id: str) -> bool:
    try:
        record = orjson.loads(holder)
    except orjson.JSONDecodeError:
        return False
    return isinstance(record, dict) and record.get("run_id") == run_id


def _pid_lines(text: str, tag: str) -> list[tuple[int, str]]:
    out = []
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        pid, _, command = rest.partition(" ")
        if head == tag and pid.isdigit():
            out.append((int(pid), command.strip()))
    return out


async def find_leftovers(target: Target, plan: RunPlan) -> Leftovers:
    """One look at the host: the run's live processes, and its lock if still held for it."""
    q = shlex.quote
    script = RUN_PIDS + LOOK.format(
        marker=q(f"TRACEDECK_RUN_ID={plan.run_id}"),
        run_dir=q(plan.run_dir),
        lock=q(plan.lock),
        run_id=q(plan.run_id),
        holder=q(holder_path(plan.lock)),
    )
    result = await target.run(script, timeout=60)
    found = Leftovers(processes=_pid_lines(result.stdout, "P"))
    stat = [line[2:].split() for line in result.stdout.splitlines() if line.startswith("S ")]
    flocks = [line[2:] for line in result.stdout.splitlines() if line.startswith("K ")]
    holder = next((line[2:] for line in result.stdout.splitlines() if line.startswith("H ")), "")
    held = next((line[2:] for line in result.stdout.splitlines() if line.startswith("I ")), "")
    if stat and len(stat[0]) == 2 and all(w.isdigit() for w in stat[0]):
        dev, ino = int(stat[0][0]), int(stat[0][1])
        found.lock_held = _flocked(dev, ino, flocks, held.strip()) and _names_run(
            holder, plan.run_id
        )
    if found.lock_held:
        openers = await target.run(OPENERS.format(lock=q(plan.lock)), timeout=60)
        found.openers = _pid_lines(openers.stdout, "O")
    return found


def _listed(processes: list[tuple[int, str]]) -> str:
    return ", ".join(f"pid {pid} ({command or 'command unreadable'})" for pid, command in processes)


async def report_leftovers(
    target: Target,
    launcher: Launcher,
    plan: RunPlan | None,
    local_dir: Path,
    emit: Callable[[Event], None],
) -> Leftovers | None:
    """After a run ended: wait a moment for its last processes to go, then say (as an error that
    is no verdict's) every process of it still alive and its lock if still held for it. A
    scheduler's run (Slurm) is left to the scheduler: its processes are on its nodes."""
    if plan is None or not isinstance(launcher, DetachedLauncher):
        return None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GRACE_S
    try:
        found = await find_leftovers(target, plan)
        while found and loop.time() < deadline:
            # Once the runner is gone, nothing of the run is on its way out any more (each
            # cell's leftovers were reaped at its end): one more look, and what is left stays.
            runner = await launcher.runner_alive(plan)
            await asyncio.sleep(STEP_S)
            found = await find_leftovers(target, plan)
            if not runner:
                break
    except TargetError as exc:
        emit(
            Error(
                message=f"{target.name}: could not check that run {plan.run_id} left nothing "
                f"running after it ended ({exc}); see `tracedeck status`, and stop what is left "
                f"with: tracedeck cancel {local_dir}",
                where=plan.run_dir,
                affects_verdict=False,
            )
        )
        return None
    stop = f"stop them with: tracedeck cancel {local_dir}"
    if found.processes:
        emit(
            Error(
                message=f"{target.name}: {len(found.processes)} process(es) of run "
                f"{plan.run_id} still alive after it ended: {_listed(found.processes)}; they "
                f"may hold the GPU and the lock {plan.lock}; {stop}",
                where=plan.run_dir,
                affects_verdict=False,
            )
        )
    if found.lock_held:
        holders = _listed(found.openers) or "no process found with it open"
        emit(
            Error(
                message=f"{target.name}: the lock {plan.lock} is still held for run "
                f"{plan.run_id} after it ended (its holder record names this run); it has it "
                f"open: {holders}; the next run there will be busy until it goes; {stop}",
                where=plan.lock,
                affects_verdict=False,
            )
        )
    return found


__all__ = ["Leftovers", "find_leftovers", "report_leftovers"]
