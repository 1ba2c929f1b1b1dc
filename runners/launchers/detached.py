"""The detached launcher: flock on an inherited fd, setsid, cells one after another.

launch.sh takes the host lock (`flock -n 9`), records the holder beside it, and starts run.sh
under setsid; run.sh inherits fd 9, so the kernel frees the lock when the run's last process
ends, whoever is connected. run.sh writes progress.jsonl (each cell's start and end) and, at
each cell's end, cells/NNN/trace_sizes: the sizes of the trace files several cells share, so
every trace line is credited to the cell that wrote it.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

import orjson

from runners.events import Event
from runners.launchers.base import LockBusyError, NotStartedError, Outcome, Started
from runners.plan import RunPlan, TraceFile, cell_dir_name
from runners.targets.base import Target, TargetError

if TYPE_CHECKING:
    from runners.follower import RunFollower

LOCK_BUSY = 75

# Every process of a run carries TRACEDECK_RUN_ID in its environment (run.sh exports it), and
# each cell's processes TRACEDECK_CELL too, so a process that leaves the group (setsid) or
# outlives its cell is still found, and a zombie (a host whose PID 1 does not reap) is never
# counted as alive. run_pids MARKER lists the live processes whose environment holds MARKER.
RUN_PIDS = r"""run_pids() {
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = "$$" ] && continue
    line=
    { read -r line < "$d/stat"; } 2>/dev/null || continue
    s=${line##*) }
    [ "${s%% *}" = Z ] && continue
    { grep -qzxF "$1" "$d/environ"; } 2>/dev/null && echo "$p"
  done
  return 0
}
"""


def cell_helpers(traces: str) -> str:
    """Shell functions every launcher's script runs cells with: sizes (of the shared trace
    files `traces`, shell words) and reap_cell (a cell's leftover processes, TERM then KILL)."""
    return CELL_HELPERS.replace("@TRACES@", traces)


# A process a cell leaves behind (a daemon, a child that left the group) would hold the GPU
# and the lock after its cell: reap_cell TERMs it, then KILLs, and says how many there were.
CELL_HELPERS = (
    r"""sizes() {
  for f in @TRACES@; do
    [ -f "$f" ] && printf '%s\t%s\n' "$(stat -c %s "$f" 2>/dev/null || echo 0)" "$f"
  done
  return 0
}
"""
    + RUN_PIDS
    + r"""reap_cell() {
  left=$(run_pids "TRACEDECK_CELL=$TRACEDECK_RUN_ID/$1")
  [ -z "$left" ] && return 0
  echo "$left" > "cells/$1/leftover"
  kill -TERM $left 2>/dev/null
  i=0
  while [ -n "$(run_pids "TRACEDECK_CELL=$TRACEDECK_RUN_ID/$1")" ] && [ $i -lt 20 ]; do
    sleep 0.1; i=$((i+1))
  done
  kill -KILL $(run_pids "TRACEDECK_CELL=$TRACEDECK_RUN_ID/$1") 2>/dev/null
  return 0
}
"""
)

RUN_SH = r"""#!/bin/sh
# Written by tracedeck: runs detached (setsid) and holds the host lock through fd 9.
cd {run_dir}
mkdir -p artifacts  # {{out}}: there when the first cell starts; below it is the engine's
export TRACEDECK_RUN_ID={run_id}
now() {{ date +%s.%N; }}
ev() {{ printf '%s\n' "$1" >> progress.jsonl; }}
{cell_helpers}run_cell() {{
  ev "{{\"e\":\"start\",\"cell\":\"$1\",\"t\":$(now)}}"
  TRACEDECK_CELL="$TRACEDECK_RUN_ID/$1" bash "cells/$1/cmd.sh" > "cells/$1/stdout.log" \
    2> "cells/$1/stderr.log" < /dev/null
  rc=$?
  echo "$rc" > "cells/$1/exit_code"
  reap_cell "$1"
  sizes > "cells/$1/trace_sizes"
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
sed "s/\"pgid\": *null/\"pgid\":$pid/" holder.json > {holder}.part && mv {holder}.part {holder}
echo "TRACEDECK_STARTED $pid"
"""


def holder_path(lock: str) -> str:
    return f"{lock}.json"


def run_script(plan: RunPlan) -> str:
    body = []
    if plan.setup:
        body.append(
            'run_cell setup || { ev "{\\"e\\":\\"done\\",\\"setup_failed\\":true}"; exit 1; }'
        )
    body += [f"run_cell {cell_dir_name(c.index)}" for c in plan.cells]
    return RUN_SH.format(
        cell_helpers=cell_helpers(" ".join(_shell_word(t) for t in plan.traces if t.cell is None)),
        run_dir=shlex.quote(plan.run_dir),
        run_id=shlex.quote(plan.run_id),
        body="\n".join(body),
    )


def _shell_word(trace: TraceFile) -> str:
    """The trace path as sh sees it: quoted, but a file-name pattern left to the shell's glob."""
    if not trace.is_pattern:
        return shlex.quote(trace.path)
    folder, name = trace.path.rsplit("/", 1)
    return f"{shlex.quote(folder)}/{name}"  # the name's characters were checked at load time


def launch_script(plan: RunPlan) -> str:
    return LAUNCH_SH.format(
        run_dir=shlex.quote(plan.run_dir),
        lock=shlex.quote(plan.lock),
        holder=shlex.quote(holder_path(plan.lock)),
    )


def _marker(run_id: str) -> str:
    return shlex.quote(f"TRACEDECK_RUN_ID={run_id}")


def pids_command(run_id: str) -> str:
    """Prints the pids of the run's live processes, one a line (none: the run is over)."""
    return RUN_PIDS + f"run_pids {_marker(run_id)}\n"


def cancel_script(run_dir: str, run_id: str, grace_s: float) -> str:
    """TERM every process of the run (its group and any that left it), KILL what outlives the
    grace, and record the cancel in progress.jsonl; prints the outcome word last."""
    d = shlex.quote(run_dir)
    m = _marker(run_id)
    steps = max(1, int(grace_s * 10))
    return (
        RUN_PIDS
        + f"""cd {d} || exit 70
touch cancel
pg=$(cat pgid 2>/dev/null)
pids=$(run_pids {m})
if [ -z "$pids" ]; then echo TRACEDECK_NOT_RUNNING; exit 0; fi
[ -n "$pg" ] && kill -TERM -"$pg" 2>/dev/null
kill -TERM $pids 2>/dev/null
i=0
while [ -n "$(run_pids {m})" ] && [ $i -lt {steps} ]; do sleep 0.1; i=$((i+1)); done
left=$(run_pids {m})
if [ -n "$left" ]; then
  [ -n "$pg" ] && kill -KILL -"$pg" 2>/dev/null
  kill -KILL $left 2>/dev/null
  sleep 0.2
  echo TRACEDECK_KILLED
fi
printf '{{"e":"cancelled","t":%s}}\\n' "$(date +%s.%N)" >> progress.jsonl
if [ -n "$(run_pids {m})" ]; then echo TRACEDECK_STILL_ALIVE; exit 72; fi
echo TRACEDECK_CANCELLED
"""
    )


def parse_holder(text: str) -> dict[str, Any]:
    try:
        holder = orjson.loads(text)
        return holder if isinstance(holder, dict) else {"raw": text}
    except orjson.JSONDecodeError:
        return {"raw": text.strip()}


class DetachedLauncher:
    """Runs the cells in order under setsid on any POSIX host with flock (util-linux)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.pgid: int | None = None

    def files(self, plan: RunPlan, holder: dict[str, Any]) -> dict[str, str]:
        return {
            "run.sh": run_script(plan),
            "launch.sh": launch_script(plan),
            "holder.json": orjson.dumps({**holder, "pgid": None}).decode(),
        }

    async def start(self, plan: RunPlan) -> Started:
        result = await self.target.run(f"sh {shlex.quote(plan.run_dir + '/launch.sh')}")
        out = result.stdout.strip().splitlines()
        if result.exit_status == LOCK_BUSY and out and out[0] == "TRACEDECK_LOCK_BUSY":
            raise LockBusyError(plan.lock, parse_holder("\n".join(out[1:])), self.target.name)
        if result.exit_status != 0 or not out or not out[-1].startswith("TRACEDECK_STARTED"):
            raise NotStartedError(
                f"{self.target.name}: could not start the run in {plan.run_dir} "
                f"(exit {result.exit_status}): {result.stderr.strip() or result.stdout.strip()}"
            )
        self.pgid = int(out[-1].split()[1])
        raw = await self.target.read_from(holder_path(plan.lock), 0, 1 << 16)
        holder = parse_holder(raw.decode("utf-8", "replace")) if raw else {}
        return Started(holder={**holder, "pgid": self.pgid})

    async def alive(self, plan: RunPlan) -> bool:
        """Does any process of the run live? The group leader over SFTP (cheap, every check),
        else a scan for the run's marker (a process that left the group or outlived run.sh)."""
        if self.pgid is None:
            raw = await self.target.read_from(f"{plan.run_dir}/pgid", 0, 64)
            if raw is not None and raw.strip().isdigit():
                self.pgid = int(raw)
        if self.pgid is not None:
            stat = await self.target.read_from(f"/proc/{self.pgid}/stat", 0, 4096)
            # Field 3, after the command name in parentheses, is the state; Z is a zombie.
            if stat is not None and stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z":
                return True
        return bool(await self.pids(plan))

    async def pids(self, plan: RunPlan) -> list[int]:
        """The run's live processes, zombies left out."""
        result = await self.target.run(pids_command(plan.run_id))
        return [int(w) for w in result.stdout.split() if w.isdigit()]

    def progress_files(self, plan: RunPlan) -> list[str]:
        return [f"{plan.run_dir}/progress.jsonl"]

    async def watch(self, plan: RunPlan) -> list[Event]:
        return []

    async def outcome(self, plan: RunPlan, follower: RunFollower) -> Outcome | None:
        return None

    async def cancel(self, plan: RunPlan, grace_s: float) -> str:
        result = await self.target.run(cancel_script(plan.run_dir, plan.run_id, grace_s))
        words = result.stdout.split()
        if result.exit_status != 0:
            raise TargetError(
                f"{self.target.name}: cancel of {plan.run_dir} failed "
                f"(exit {result.exit_status}): {result.stdout.strip()} {result.stderr.strip()}"
            )
        return words[-1] if words else ""
