"""`tracedeck prune`: old run directories removed, here and on targets, never a live one.

Two places hold runs: this machine's run records (OUT/<date>/<dir>, linked as OUT/by-id/ID),
and each target's runs directory (target.runs/RUN_ID). A run is chosen by age (--older-than)
and/or by count (--keep N newest); a chosen run is deleted only when it is over: its record
says how it ended, or the launcher that started it finds none of it alive (the detached
one's alive(), checked against a reused process id; Slurm's squeue; each host batch of a fleet
run), and no console follows it (its
record's writer lock, runners.record.writer_present). Whatever cannot be checked is kept and
said why. Nothing is deleted without `apply=True` (the CLI's --yes).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import posixpath
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from runners.events import Event, HostState, RunFinished
from runners.exits import NOT_ENDINGS
from runners.kinds import event_types
from runners.launchers.detached import DetachedLauncher
from runners.launchers.slurm import JOB_DIR, SlurmLauncher, SlurmSettings
from runners.plan import RunPlan, dir_command
from runners.record import (
    BY_ID,
    EVENTS,
    FLEET,
    RunRecord,
    find_local_run,
    iter_events,
    local_runs,
    writer_present,
)
from runners.scheduler import LOST, RUNNING
from runners.targets.base import Target, TargetError
from runners.targets.factory import parse_target

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
# The ids runners.local_run.new_run_id makes: DATE-TIME-PRESET-HEX4.
RUN_ID = re.compile(r"(\d{8}-\d{6})-[A-Za-z0-9][A-Za-z0-9._-]*-[0-9a-f]{4}")
# A fleet host's batch directory in RUNS/RUN_ID (runners.run: the host's slug, a number).
FLEET_BATCH = re.compile(r"[A-Za-z0-9._-]+-\d+")
# A run directory with no process group yet, younger than this, may be a launch under way.
LAUNCH_GRACE_S = 600.0


def parse_duration(text: str) -> float:
    """'7d', '12h', '1d12h', '90m', '30s', '2w' in seconds; ValueError saying the form."""
    spec = text.strip()
    parts = _DURATION.findall(spec)
    if not spec or "".join(n + u for n, u in parts) != spec:
        raise ValueError(
            f"--older-than {text!r}: give a duration like 7d, 12h, 1d12h, 90m, 30s or 2w"
        )
    return sum(float(n) * UNITS[u] for n, u in parts)


@dataclass(slots=True)
class Item:
    """One run directory: where it is, whether it goes, and why."""

    where: str  # "local", or the target it lies on
    path: str  # the local directory, or the run directory on the target
    run_id: str
    started: float | None  # epoch seconds, when known
    # a local record's (target, remote run dir) pairs: one, or a fleet's one per host
    remote: list[tuple[str, str]] = field(default_factory=list)
    delete: bool = False
    why: str = ""
    done: bool = False  # --yes deleted it
    note: str = ""  # what became of a local record's remote directory
    unreadable: bool = False  # a run.json this tracedeck cannot read: never deleted

    def keep(self, why: str) -> None:
        self.delete = False
        self.why = why


def choose(items: list[Item], older_than: float | None, keep: int | None, now: float) -> None:
    """Mark the items old enough and beyond the newest `keep` for deletion (newest first). A
    directory that is no record this tracedeck reads, or that holds another run's record, is
    never deleted: what is in it is not known to be that run's."""
    items.sort(key=lambda i: (i.started or 0.0, i.run_id), reverse=True)
    readable = [i for i in items if not i.unreadable]
    for item in items:
        if item.unreadable:
            item.keep(f"{item.why}: not a run record this tracedeck reads; delete it by hand")
    for n, item in enumerate(readable):
        inner = next(  # a run.json this tracedeck cannot read, inside a run, is its content
            (o for o in readable if o.where == item.where and _under(o.path, item.path)), None
        )
        if inner is not None:
            item.keep(f"holds another run's record ({inner.path}); delete it by hand")
        elif keep is not None and n < keep:
            item.keep(f"one of the {keep} newest")
        elif older_than is not None and (item.started is None or now - item.started < older_than):
            item.keep("age unknown" if item.started is None else "newer than --older-than")
        else:
            item.delete, item.why = True, ""


def _under(path: str, folder: str) -> bool:
    return path != folder and path.startswith(folder.rstrip("/") + "/")


def _epoch(text: str) -> float | None:
    try:
        when = dt.datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _id_time(run_id: str) -> float | None:
    match = RUN_ID.fullmatch(run_id)
    if match is None:
        return None
    return dt.datetime.strptime(match.group(1), "%Y%m%d-%H%M%S").timestamp()  # local time


# -- this machine's records ---------------------------------------------------------------------


def local_items(out_dir: Path) -> list[Item]:
    items = []
    for local in local_runs(out_dir):
        try:
            record = RunRecord.load(local)
        except (OSError, ValueError, TypeError) as exc:
            why = f"unreadable: {exc}"
            items.append(Item("local", str(local), local.name, None, why=why, unreadable=True))
            continue
        remote = [(record.target, record.remote_dir)] if record.remote_dir else []
        members = record.extra.get(FLEET, {}).get("members", [])
        for m in members:  # a fleet: each host's batches lie in RUNS/RUN_ID/HOST-N
            pair = (str(m["host"]), posixpath.dirname(str(m["run_dir"])))
            if pair not in remote:
                remote.append(pair)
        started = _epoch(record.started_at)
        items.append(Item("local", str(local), record.run_id, started, remote=remote))
    runs = [i.path for i in items if not i.unreadable]
    # A run.json this tracedeck cannot read inside a run's directory is that run's content.
    return [i for i in items if not (i.unreadable and any(_under(i.path, r) for r in runs))]


def recorded_end(local: Path) -> RunFinished | None:
    """How the record says the run ended (None: it says no end, only that following did, or
    a fleet host was lost: its batch may still run there, whatever the run's end says)."""
    path = local / EVENTS
    end, hosts = None, LostHosts()
    with contextlib.suppress(OSError, ValueError):
        for event in iter_events(path, event_types()):
            hosts.fold(event)
            if isinstance(event, RunFinished):
                end = event if event.verdict not in NOT_ENDINGS else None
    return None if hosts.batch_left else end


class LostHosts:
    """Folds a fleet run's host states: was a host lost while its batch ran (that batch may go
    on there after the run's end)? A host lost with nothing running left nothing behind."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.batch_left = False

    def fold(self, event: Event) -> None:
        if isinstance(event, HostState):
            if event.state == RUNNING:
                self.running.add(event.host)
            elif event.state == LOST and event.host in self.running:
                self.batch_left = True
            else:
                self.running.discard(event.host)


# -- liveness, on the launcher's word -----------------------------------------------------------


async def run_alive(target: Target, run_dir: str, run_id: str) -> bool:
    """Does any process of the run live, whichever launcher started it? A Slurm run: a task
    of its job still held by Slurm; a fleet's: any host batch in it (RUN_DIR/HOST-N); else
    the detached launcher's alive(), where a process-group id that now names another program
    (a reused pid on a long-lived host) is not the run."""
    plan = RunPlan(
        run_id=run_id, run_dir=run_dir, workdir="", lock="", python="", setup=[], cells=[]
    )
    if await target.read_from(f"{run_dir}/{JOB_DIR}/job.sh", 0, 0) is not None:
        return await SlurmLauncher(target, SlurmSettings()).alive(plan)
    if await target.read_from(f"{run_dir}/run.sh", 0, 0) is None:  # a fleet's: its batches
        for name in await target.list_dir(run_dir) or []:
            if not FLEET_BATCH.fullmatch(name):
                continue
            batch = f"{run_dir}/{name}"
            if await target.read_from(f"{batch}/run.sh", 0, 0) is None:
                continue  # its launch never wrote its script: nothing of it can run
            if await run_alive(target, batch, f"{run_id}@{name}"):
                return True
    launcher = DetachedLauncher(target)
    if not await launcher.alive(plan):
        return False
    if await launcher.pids(plan):
        return True
    pgid = launcher.pgid
    cmdline = await target.read_from(f"/proc/{pgid}/cmdline", 0, 4096) if pgid else None
    return cmdline is not None and f"{run_dir}/run.sh".encode() in cmdline


class Targets:
    """One connection per target, opened when first needed; a target that cannot be reached
    is remembered with why."""

    def __init__(self) -> None:
        self.open: dict[str, Target] = {}
        self.failed: dict[str, str] = {}

    async def get(self, spec: str) -> Target | None:
        if spec in self.failed:
            return None
        if spec not in self.open:
            try:
                target = parse_target(spec, connect_timeout=10.0)
                await target.connect()
            except (TargetError, ValueError, OSError) as exc:
                self.failed[spec] = str(exc)
                return None
            self.open[spec] = target
        return self.open[spec]

    async def close(self) -> None:
        for target in self.open.values():
            with contextlib.suppress(Exception):
                await target.close()


async def check_local(items: list[Item], targets: Targets) -> None:
    """Keep every chosen local run that is followed, or not known to be over."""
    for item in items:
        if not item.delete:
            continue
        local = Path(item.path)
        if writer_present(local):
            item.keep("another console follows it (it holds the record's lock)")
            continue
        if recorded_end(local) is not None:
            continue  # the record says how it ended: its processes are gone
        for spec, run_dir in item.remote:  # none: never launched, no process to look for
            why = await _live_on(spec, run_dir, item.run_id, targets)
            if why:
                item.keep(why)
                break


async def _live_on(spec: str, run_dir: str, run_id: str, targets: Targets) -> str:
    """Why a run whose end is not recorded must be kept for its directory on `spec` ("": it
    is over there)."""
    target = await targets.get(spec)
    if target is None:
        return (
            f"not known to be over (no end recorded, or a host lost while its batch ran) and "
            f"{spec} cannot be reached to check it"
        )
    try:
        if await run_alive(target, run_dir, run_id):
            return f"live: processes of the run still run on {spec}"
    except TargetError as exc:
        return f"cannot check it on {spec}: {exc}"
    return ""


# -- a target's runs directory ------------------------------------------------------------------


async def remote_items(spec: str, runs: str, targets: Targets) -> tuple[list[Item], str]:
    """The run directories in a target's runs directory, and that directory's absolute path."""
    target = await targets.get(spec)
    if target is None:
        raise TargetError(targets.failed.get(spec, f"{spec}: cannot connect"))
    found = await target.run(dir_command(runs, create=False))
    if found.exit_status != 0:
        raise TargetError(
            f"{spec}: runs directory {runs!r} is not there ({found.stderr.strip() or 'no such'})"
        )
    root = found.stdout.strip()
    names = await target.list_dir(root) or []
    items = [
        Item(spec, f"{root}/{name}", name, _id_time(name))
        for name in names
        if RUN_ID.fullmatch(name)
    ]
    return items, root


async def check_remote(
    items: list[Item], spec: str, out_dir: Path, targets: Targets, now: float
) -> None:
    target = await targets.get(spec)
    assert target is not None
    for item in items:
        if not item.delete:
            continue
        try:
            local = find_local_run(item.run_id, out_dir)
        except ValueError as exc:  # two records of one id: which console follows it is unknown
            item.keep(str(exc))
            continue
        if local is not None and writer_present(local):
            item.keep(f"a console here follows it ({local})")
            continue
        try:
            if await run_alive(target, item.path, item.run_id):
                item.keep("live: processes of the run still run")
                continue
            pgid = await target.read_from(f"{item.path}/pgid", 0, 64)
        except TargetError as exc:
            item.keep(f"cannot check it: {exc}")
            continue
        if pgid is None and item.started is not None and now - item.started < LAUNCH_GRACE_S:
            item.keep("no process group yet and minutes old: a launch may be under way")


# -- deleting -----------------------------------------------------------------------------------


async def delete(items: list[Item], out_dir: Path, targets: Targets) -> list[str]:
    """Delete the chosen items; returns the failures (each naming what was not deleted)."""
    failures: list[str] = []
    for item in items:
        if not item.delete:
            continue
        if item.where == "local":
            local = Path(item.path)
            shutil.rmtree(local, ignore_errors=True)
            if local.exists():
                failures.append(f"{local}: could not be deleted")
                continue
            link = out_dir / BY_ID / item.run_id
            if link.is_symlink():
                link.unlink()
            with contextlib.suppress(OSError):
                local.parent.rmdir()  # the date directory, once empty
            item.done = True
            notes = [await _delete_remote(spec, rdir, item, targets) for spec, rdir in item.remote]
            item.note = "; ".join(n for n in notes if n)
            continue
        problem = await _rm(item.where, item.path, item.run_id, targets)
        if problem:
            failures.append(problem)
        else:
            item.done = True
    return failures


async def _delete_remote(spec: str, run_dir: str, item: Item, targets: Targets) -> str:
    problem = await _rm(spec, run_dir, item.run_id, targets)
    if problem:
        return f"its directory on {spec} stays ({problem}); later: tracedeck prune --target {spec}"
    return ""


async def _rm(spec: str, run_dir: str, run_id: str, targets: Targets) -> str:
    """rm -rf of one run directory, only ever a path that ends in its run id, and only an id
    tracedeck makes (a record edited to say run_id "home", remote_dir "/home" names no run)."""
    if (
        not RUN_ID.fullmatch(run_id)
        or not run_dir.startswith("/")
        or not run_dir.endswith("/" + run_id)
        or "/../" in run_dir
    ):
        return f"{run_dir}: not a run directory of this run id; left alone"
    target = await targets.get(spec)
    if target is None:
        return targets.failed.get(spec, "cannot connect")
    try:
        done = await target.run(f"rm -rf -- {shlex.quote(run_dir)}")
    except TargetError as exc:
        return str(exc)
    if done.exit_status != 0:
        return f"{spec}:{run_dir}: rm failed: {done.stderr.strip()}"
    return ""
