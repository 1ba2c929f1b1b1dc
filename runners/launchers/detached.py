"""The detached launcher: flock on an inherited fd, setsid, cells one after another.

launch.sh takes the host lock (`flock -n 9`), records the holder beside it, and starts run.sh
under setsid; run.sh inherits fd 9, so the kernel frees the lock when the run's last process
ends, whoever is connected. run.sh writes progress.jsonl (each cell's start and end) and, at
each cell's end, cells/NNN/trace_sizes: the sizes of the trace files several cells share, so
every trace line is credited to the cell that wrote it.
"""

from __future__ import annotations

import re
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
# This hold of the lock on fd 9, as the kernel shows it on every fd that shares it: its taker's
# pid (0 where that pid is not visible, a pid namespace: then no identity).
HOLD_ID = (
    "sed -n 's/^lock:.* FLOCK  *ADVISORY  *WRITE  *\\([0-9][0-9]*\\) .*/\\1/p' "
    "/proc/$$/fdinfo/9 2>/dev/null | head -n 1"
)
LOCK_RETRY_S = 2.0  # a launch's tries for the lock before it says LOCK_BUSY

# A run owns its processes by three things, so that one a process sheds (its environment under
# `env -i`, sudo or a daemon; its group and session under setsid; the lock fd it may close) still
# leaves it found: TRACEDECK_RUN_ID (TRACEDECK_CELL for a cell) in its environment; descent from
# the runner, which is a child subreaper (PR_SET_CHILD_SUBREAPER, set before run.sh is exec'd), so
# a double-forked orphan reparents to it rather than to PID 1; and the lock file held open while
# the holder sidecar names the run (once another run holds the lock, its holders are its own);
# the file itself, by device and inode, not its name: a container's or another mount namespace's
# /tmp/tracedeck.lock has the same name and is another host's lock, whose processes are not ours;
# and by the run's own hold on it: an fd whose fdinfo shows the flock the launch took (its taker's
# pid, kept in RUN_DIR/lock_id), so a process waiting for the lock, or one that took it after the
# run ended while the sidecar still names the run, is never the run's.
# Zombies (a host whose PID 1 does not reap) are never counted. When the scan runs inside the
# runner's tree (reap_cell), the scan's own processes and the runner itself are left out.
#   run_pids MARKER [ROOT] [LOCK] [RUN_ID] [LOCK_ID]
# runner_pid RUN_DIR: the runner's pid, while that pid is still the run's runner (not reused).
RUN_PIDS = r"""runner_pid() {
  _p=$(cat "$1/pgid" 2>/dev/null)
  [ -n "$_p" ] && grep -qzxF -- "$1/run.sh" "/proc/$_p/cmdline" 2>/dev/null && echo "$_p"
  return 0
}
run_pids() {
  _lk=
  # 0: the taker's pid is not visible (a pid namespace), so the hold cannot be told apart
  case "${5:-}" in *[!0-9]* | 0) set -- "$1" "${2:-}" "${3:-}" "${4:-}" "" ;; esac
  if [ -n "${3:-}" ] && [ -n "${5:-}" ] && grep -qF "\"run_id\":\"$4\"" "$3.json" 2>/dev/null; then
    _lk=$(readlink -f -- "$3" 2>/dev/null | sed 's/[][*?\\]/\\&/g')
  fi
  {
    grep -lszxF -- "$1" /proc/[0-9]*/environ | sed -n 's#^/proc/\([0-9]*\)/environ$#M \1#p'
    if [ -n "$_lk" ]; then
      find /proc/[0-9]*/fd -mindepth 1 -maxdepth 1 -lname "$_lk" 2>/dev/null |
        while read -r _f; do
          [ "$_f" -ef "$3" ] &&
            grep -qE "^lock:.* FLOCK +ADVISORY +WRITE +$5 " "${_f%/fd/*}/fdinfo/${_f##*/}" 2>/dev/null &&
            echo "$_f"
        done |
        sed -n 's#^/proc/\([0-9]*\)/fd/.*#M \1#p'
    fi
    cat /proc/[0-9]*/stat 2>/dev/null
  } | awk -v root="${2:-}" '
    function fields(line, f) { sub(/^.*\) /, "", line); return split(line, f, " ") }
    BEGIN {
      getline me < "/proc/self/stat"; split(me, w, " "); self = w[1] + 0
      fields(me, f); up = f[2] + 0
    }
    $1 == "M" { mark[$2 + 0] = 1; next }
    { p = $1 + 0; fields($0, f); state[p] = f[1]; ppid[p] = f[2] + 0 }
    END {
      ppid[self] = up; inside = 0
      q = self
      for (i = 0; i < 4096 && q > 1; i++) {
        if (root != "" && q == root + 0) { inside = 1; break }
        chain[q] = 1; q = ppid[q] + 0
      }
      for (k in state) {
        p = k + 0
        if (state[k] == "Z" || (inside && p == root + 0)) continue
        under = 0; mine = 0; q = p
        for (i = 0; i < 4096 && q > 1; i++) {
          if (inside && (q in chain)) { mine = 1; break }
          if (root != "" && q == root + 0) { under = 1; break }
          q = ppid[q] + 0
        }
        if (!mine && (under || (p in mark))) print p
      }
    }'
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
    + r"""cell_pids() {
  run_pids "TRACEDECK_CELL=$TRACEDECK_RUN_ID/$1" $$ "$run_lock" "$TRACEDECK_RUN_ID" "$run_lock_id"
}
reap_cell() {
  left=$(cell_pids "$1")
  [ -z "$left" ] && return 0
  echo "$left" > "cells/$1/leftover"
  kill -TERM $left 2>/dev/null
  i=0
  while [ -n "$(cell_pids "$1")" ] && [ $i -lt 20 ]; do
    sleep 0.1; i=$((i+1))
  done
  left=$(cell_pids "$1")
  [ -n "$left" ] && kill -KILL $left 2>/dev/null
  return 0
}
"""
)

RUN_SH = r"""#!/bin/sh
# Written by tracedeck: runs detached (setsid) and holds the host lock through fd 9.
cd {run_dir}
mkdir -p artifacts  # {{out}}: there when the first cell starts; below it is the engine's
export TRACEDECK_RUN_ID={run_id}
run_lock={lock}
run_lock_id=$(cat lock_id 2>/dev/null)
# A caught TERM, not a fatal one: cancel stops the runner and TERMs its group; stopped, it must
# outlive that TERM (a fatal one kills even a stopped process), to keep the orphans under it.
trap 'exit 143' TERM
now() {{ date +%s.%N; }}
ev() {{ printf '%s\n' "$1" >> progress.jsonl; }}
{cell_helpers}run_cell() {{
  # A cancel asked before this cell (while the run was being launched, or between cells)
  if [ -e cancel ]; then ev "{{\"e\":\"cancelled\",\"t\":$(now)}}"; exit 130; fi
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
SUBREAPER={subreaper}
exec 9>>{lock}
# Tried for a while before it is busy: a look at the lock (status, plan --check) holds it for
# an instant.
i=0
until flock -n 9; do
  i=$((i + 1))
  if [ "$i" -ge {tries} ]; then
    echo TRACEDECK_LOCK_BUSY
    cat {holder} 2>/dev/null
    exit 75
  fi
  sleep 0.1
done
# Beside the lock (a shared /tmp): a fresh file of its own, renamed over the holder (never
# written through a name someone else could have put there first). Written as soon as the lock
# is held, so a launch refused now names this run, not the one before it.
holder() {{
  h=$(mktemp {holder}.XXXXXX) && {{ sed "s/\"pgid\": *null/\"pgid\":$1/" holder.json > "$h" &&
    chmod 644 "$h" && mv -f "$h" {holder} || rm -f "$h"; }}
}}
holder null
{hold_id} > lock_id
# The runner becomes a child subreaper (kept across exec) where a python can set it: orphans of
# the run then stay under it. Without one, the environment marker and the lock still find them.
# A system python first: it starts fast (a version manager's shim can take seconds).
py=
for p in /usr/bin/python3 /usr/local/bin/python3 {python}; do
  if command -v "$p" > /dev/null 2>&1; then py=$p; break; fi
done
if [ -n "$py" ]; then
  setsid "$py" -I -S -c "$SUBREAPER" {run_dir}/run.sh < /dev/null > runner.out 2> runner.err &
else
  setsid sh {run_dir}/run.sh < /dev/null > runner.out 2> runner.err &
fi
pid=$!
# Not a group leader (no job control here), so setsid did not fork: $! is the new group's id.
echo "$pid" > pgid.part && mv pgid.part pgid
holder "$pid"
echo "TRACEDECK_STARTED $pid"
"""


# Run with run.sh as its argument: become a child subreaper (PR_SET_CHILD_SUBREAPER, 36) where
# the host allows, then exec sh on run.sh whatever happened (the run never depends on it).
SUBREAPER = (
    "import os, sys\n"
    "try:\n"
    "    import ctypes\n"
    "    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
    "os.execvp('sh', ['sh', sys.argv[1]])\n"
)


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
        lock=shlex.quote(plan.lock),
        body="\n".join(body),
    )


def _shell_word(trace: TraceFile) -> str:
    """The trace path as sh sees it: quoted, but a file-name pattern's * ? [ ] ! left to the
    shell's glob (the load refuses other characters in a pattern; quoted anyway)."""
    if not trace.is_pattern:
        return shlex.quote(trace.path)
    folder, name = trace.path.rsplit("/", 1)
    parts = re.split(r"([*?\[\]!])", name)
    return f"{shlex.quote(folder)}/" + "".join(
        p if p in GLOB or not p else shlex.quote(p) for p in parts
    )


GLOB = frozenset("*?[]!")


def launch_script(plan: RunPlan) -> str:
    return LAUNCH_SH.format(
        run_dir=shlex.quote(plan.run_dir),
        lock=shlex.quote(plan.lock),
        holder=shlex.quote(holder_path(plan.lock)),
        tries=int(LOCK_RETRY_S / 0.1),
        hold_id=HOLD_ID,
        python=shlex.quote(plan.python),
        subreaper=shlex.quote(SUBREAPER),
    )


def _marker(run_id: str) -> str:
    return shlex.quote(f"TRACEDECK_RUN_ID={run_id}")


def pids_command(run_id: str, run_dir: str = "", lock: str = "") -> str:
    """Prints the pids of the run's live processes, one a line (none: the run is over): marked,
    under its runner (the pid in run_dir/pgid), or holding `lock` while the holder names the run."""
    root = f"$(runner_pid {shlex.quote(run_dir)})" if run_dir else ""
    return RUN_PIDS + f'run_pids {_marker(run_id)} "{root}" {_lock_args(lock, run_id, run_dir)}\n'


def _lock_args(lock: str, run_id: str, run_dir: str) -> str:
    """run_pids' LOCK RUN_ID LOCK_ID: the lock, and the run's hold on it (RUN_DIR/lock_id)."""
    held = f'"$(cat {shlex.quote(run_dir + "/lock_id")} 2>/dev/null)"' if run_dir else '""'
    return f"{shlex.quote(lock)} {shlex.quote(run_id)} {held}"


def cancel_script(run_dir: str, run_id: str, grace_s: float, lock: str = "") -> str:
    """TERM every process of the run (its group, any that left it, any holding its lock), KILL
    what outlives the grace, and record the cancel in progress.jsonl; prints the outcome word
    last. The runner is stopped first, not killed: as the subreaper it keeps the orphans of the
    processes it loses meanwhile under it, so they are found; it is killed last."""
    d = shlex.quote(run_dir)
    find = f'run_pids {_marker(run_id)} "$rp" {_lock_args(lock, run_id, run_dir)}'
    steps = max(1, int(grace_s * 10))
    return (
        RUN_PIDS
        + f"""cd {d} || exit 70
touch cancel
pg=$(cat pgid 2>/dev/null)
rp=$(runner_pid {d})
others() {{ {find} | grep -vx "${{rp:-none}}"; }}
pids=$({find})
if [ -z "$pids" ]; then echo TRACEDECK_NOT_RUNNING; exit 0; fi
# The recorded group is signalled only while it is the run's: its runner's, or that of one of
# the run's own processes (a reused number, or one written over, is someone else's).
case "$pg" in "" | *[!0-9]* | 0 | 1) pg= ;; esac
if [ -n "$pg" ] && [ "$pg" != "${{rp:-}}" ]; then
  ours=
  for p in $pids; do
    [ "$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null | cut -d' ' -f3)" = "$pg" ] && ours=1
  done
  [ -n "$ours" ] || pg=
fi
[ -n "$rp" ] && kill -STOP "$rp" 2>/dev/null
[ -n "$pg" ] && kill -TERM -"$pg" 2>/dev/null
kill -TERM $(echo "$pids" | grep -vx "${{rp:-none}}") $(others) 2>/dev/null
i=0
while [ -n "$(others)" ] && [ $i -lt {steps} ]; do sleep 0.1; i=$((i+1)); done
left=$(others)
if [ -n "$left" ]; then
  [ -n "$pg" ] && kill -KILL -"$pg" 2>/dev/null
  kill -KILL $left 2>/dev/null
  echo TRACEDECK_KILLED
fi
[ -n "$rp" ] && kill -KILL "$rp" 2>/dev/null
i=0
while [ -n "$({find})" ] && [ $i -lt 20 ]; do sleep 0.1; i=$((i+1)); done
printf '{{"e":"cancelled","t":%s}}\\n' "$(date +%s.%N)" >> progress.jsonl
if [ -n "$({find})" ]; then echo TRACEDECK_STILL_ALIVE; exit 72; fi
echo TRACEDECK_CANCELLED
"""
    )


def lock_probe(lock: str) -> str:
    """sh that says whether `lock` is held (held, free, absent, unwritable): a shared flock,
    let go at once. (The kernel's table of locks cannot say: in a container it leaves out a
    lock whose taker has exited, and on an overlay it names another device.) A launch that
    meets the probe's instant retries for LOCK_RETRY_S before it says LOCK_BUSY."""
    return f"""l={shlex.quote(lock)}
if [ ! -e "$l" ]; then
  if [ -w "$(dirname -- "$l")" ]; then echo absent; else echo unwritable; fi
  exit 0
fi
[ -w "$l" ] || {{ echo unwritable; exit 0; }}
if flock -n -s "$l" true 2>/dev/null; then echo free; else echo held; fi
"""


async def lock_state(target: Target, lock: str) -> tuple[str, dict[str, Any], str]:
    """Who holds the lock, as lock_probe finds it. (state: held, free, absent, unwritable, or
    '' when the answer could not be read; the last holder's record; what the shell said.)"""
    result = await target.run(lock_probe(lock), timeout=60)
    stdout, err = result.stdout.strip(), result.stderr.strip()
    state = stdout.splitlines()[-1] if stdout else ""
    raw = await target.read_from(holder_path(lock), 0, 1 << 16)
    holder = parse_holder(raw.decode("utf-8", "replace")) if raw else {}
    return state, holder, err or stdout


def apart(script: str, run_dir: str) -> str:
    """Run `script` in a session of its own and wait for it: a console interrupted meanwhile
    (its command killed, its link gone) leaves it to finish (a cancel stops the runner first:
    killed half way, it left the runner stopped, holding the lock, for good). Its output file
    is removed by the script's own session once it ends; the waiting side reads it through a
    descriptor opened first, so an interrupted console leaves no file behind."""
    q = shlex.quote(script)
    then_rm = shlex.quote('sh -c "$1"; rc=$?; rm -f -- "$2"; exit $rc')
    return (
        f"o=$(mktemp {shlex.quote(run_dir + '/.cancel')}.XXXXXX 2>/dev/null) || exec sh -c {q}\n"
        'exec 3< "$o"\n'
        f'setsid sh -c {then_rm} sh {q} "$o" > "$o" 2>&1 < /dev/null &\n'
        "wait $!; rc=$?; cat <&3; exit $rc\n"
    )


def parse_holder(text: str) -> dict[str, Any]:
    try:
        holder = orjson.loads(text)
        return holder if isinstance(holder, dict) else {"raw": text}
    except orjson.JSONDecodeError:
        return {"raw": text.strip()}


def holder_text(holder: dict[str, Any]) -> str:
    """Who holds a lock, as its holder record says."""
    if holder.get("raw"):
        return str(holder["raw"])
    return (
        f"run {holder.get('run_id')} of {holder.get('user')}@{holder.get('console_host')} "
        f"(preset {holder.get('preset')}, pgid {holder.get('pgid')})"
    )


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
        return await self.runner_alive(plan) or bool(await self.pids(plan))

    async def runner_alive(self, plan: RunPlan) -> bool:
        """Does the run's runner (its group leader, run.sh) live? A reused pid is not it."""
        if self.pgid is None:
            raw = await self.target.read_from(f"{plan.run_dir}/pgid", 0, 64)
            if raw is not None and raw.strip().isdigit():
                self.pgid = int(raw)
        if self.pgid is None:
            return False
        stat = await self.target.read_from(f"/proc/{self.pgid}/stat", 0, 4096)
        # Field 3, after the command name in parentheses, is the state; Z is a zombie.
        if stat is None or stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"Z":
            return False
        cmdline = await self.target.read_from(f"/proc/{self.pgid}/cmdline", 0, 4096)
        return cmdline is not None and f"{plan.run_dir}/run.sh".encode() in cmdline.split(b"\0")

    async def pids(self, plan: RunPlan) -> list[int]:
        """The run's live processes, zombies left out."""
        result = await self.target.run(pids_command(plan.run_id, plan.run_dir, plan.lock))
        return [int(w) for w in result.stdout.split() if w.isdigit()]

    def progress_files(self, plan: RunPlan) -> list[str]:
        return [f"{plan.run_dir}/progress.jsonl"]

    async def watch(self, plan: RunPlan) -> list[Event]:
        return []

    async def outcome(self, plan: RunPlan, follower: RunFollower) -> Outcome | None:
        return None

    async def cancel(self, plan: RunPlan, grace_s: float) -> str:
        script = cancel_script(plan.run_dir, plan.run_id, grace_s, plan.lock)
        result = await self.target.run(apart(script, plan.run_dir))
        words = result.stdout.split()
        if result.exit_status != 0:
            raise TargetError(
                f"{self.target.name}: cancel of {plan.run_dir} failed "
                f"(exit {result.exit_status}): {result.stdout.strip()} {result.stderr.strip()}"
            )
        return words[-1] if words else ""
