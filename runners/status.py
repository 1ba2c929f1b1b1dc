"""Every run at a glance: this machine's run records (live first, then the recent ones) and who
holds the lock of each host a run uses or the configuration names.

A run whose end is not recorded is asked for on its host(s) (as prune asks: the launcher's
word, never a guess from the record); a host that cannot be reached says so.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runners.config import fleet_names, host_lock, load_config
from runners.events import RunFinished, RunStarted
from runners.exits import NOT_ENDINGS
from runners.kinds import event_types
from runners.prune import LostHosts, Targets, run_alive
from runners.record import EVENTS, FLEET, RunRecord, iter_events, local_runs, writer_present
from runners.targets.base import TargetError

RECENT = 20
LIVE, ENDING, ENDED, STOPPED, UNKNOWN = "live", "ending", "ended", "stopped", "unknown"


@dataclass(slots=True)
class RunStatus:
    run_id: str
    preset: str
    kind: str
    target: str
    hosts: list[str]
    local_dir: str
    # live | ending (no process, its console records the end) | ended (its end recorded) |
    # stopped (no end recorded, no process, no console) | unknown (its host cannot be asked)
    state: str
    verdict: str | None = None
    exit_code: int | None = None
    started: float | None = None
    elapsed_s: float | None = None
    followed: bool = False  # a console follows it now (it holds the record's lock)
    lock: str = ""
    note: str = ""


@dataclass(slots=True)
class LockStatus:
    host: str
    lock: str
    state: str  # held | free | absent | unwritable | unreachable | unknown
    holder: dict[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass(slots=True)
class Status:
    runs: list[RunStatus]
    locks: list[LockStatus]

    def document(self) -> dict[str, Any]:
        return {"runs": [asdict(r) for r in self.runs], "locks": [asdict(lk) for lk in self.locks]}


def _epoch(text: str) -> float | None:
    with contextlib.suppress(ValueError):
        when = dt.datetime.fromisoformat(text)
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        return when.timestamp()
    return None


def read_run(local: Path) -> tuple[RunStatus, list[tuple[str, str]]]:
    """A run as its record says (state ENDED when it records its end, else UNKNOWN until its
    hosts are asked), and the (host, run directory) pairs where its processes would be."""
    record = RunRecord.load(local)
    members = record.extra.get(FLEET, {}).get("members", [])
    remote = [(str(m["host"]), str(m["run_dir"])) for m in members]
    if not remote and record.remote_dir:
        remote = [(record.target, record.remote_dir)]
    hosts = sorted({h for h, _ in remote}) or [record.target]
    run = RunStatus(
        run_id=record.run_id,
        preset=record.preset,
        kind=record.kind,
        target=record.target,
        hosts=hosts,
        local_dir=str(local),
        state=UNKNOWN,
        started=_epoch(record.started_at),
        lock="" if members else record.lock,
    )
    end: RunFinished | None = None
    hosts = LostHosts()  # a fleet host lost while its batch ran: it may run on after the end
    with contextlib.suppress(OSError, ValueError):
        for event in iter_events(local / EVENTS, event_types()):
            hosts.fold(event)
            if isinstance(event, RunStarted) and run.started is None:
                run.started = event.t
            elif isinstance(event, RunFinished):
                end = event
    if end is not None and end.verdict not in NOT_ENDINGS:
        run.state, run.verdict, run.exit_code = ENDED, end.verdict, end.exit_code
        if run.started is not None:
            run.elapsed_s = max(0.0, end.t - run.started)
        if hosts.batch_left:
            run.state = UNKNOWN  # asked on its hosts; ended again when nothing of it runs
    run.followed = writer_present(local)
    return run, remote


async def _ask_hosts(run: RunStatus, remote: list[tuple[str, str]], targets: Targets) -> None:
    if not remote:
        run.state, run.note = STOPPED, "never launched: no run directory on a host"
        return
    unreachable = []
    for spec, run_dir in remote:
        target = await targets.get(spec)
        if target is None:
            unreachable.append(f"{spec}: {targets.failed.get(spec, 'unreachable')}")
            continue
        try:
            if await run_alive(target, run_dir, run.run_id):
                run.state = LIVE
                if run.verdict is not None:
                    run.note = f"ended {run.verdict}, but a lost host's batch still runs: cancel it"
                return
        except TargetError as exc:
            unreachable.append(f"{spec}: {exc}")
    if unreachable:
        run.state, run.note = UNKNOWN, "cannot ask " + "; ".join(unreachable)
    elif run.verdict is not None:
        run.state = ENDED  # its end recorded, and nothing of it runs on any host
    elif run.followed:
        run.state, run.note = (
            ENDING,
            "no process of it runs; the console following it records its end",
        )
    else:
        run.state, run.note = STOPPED, "its end is not recorded and no process of it runs"


def configured_hosts() -> list[str]:
    """Hosts the configuration names: [hosts.*] and every fleet's members."""
    with contextlib.suppress(ValueError, OSError):
        hosts = list(load_config().get("hosts", {}))
        for members in fleet_names().values():
            hosts += [h for h in members if h not in hosts]
        return hosts
    return []


async def _lock_of(spec: str, lock: str, targets: Targets) -> LockStatus:
    from runners.launchers.detached import lock_state

    target = await targets.get(spec)
    if target is None:
        return LockStatus(spec, lock, "unreachable", note=targets.failed.get(spec, ""))
    try:
        state, holder, said = await lock_state(target, lock)
    except TargetError as exc:
        return LockStatus(spec, lock, "unreachable", note=str(exc))
    return LockStatus(spec, lock, state or UNKNOWN, holder, "" if state else said)


async def collect(
    out_dir: Path, recent: int = RECENT, now: float | None = None, hosts: list[str] | None = None
) -> Status:
    """The runs of `out_dir` (every one whose end is not recorded, and the `recent` newest
    others) with their state asked on their hosts, and the locks of their hosts, of `hosts`
    (default: the configured ones) and of this machine."""
    now = time.time() if now is None else now
    runs: list[RunStatus] = []
    remotes: dict[str, list[tuple[str, str]]] = {}
    for local in local_runs(out_dir):
        try:
            run, remote = read_run(local)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            runs.append(
                RunStatus(local.name, "?", "?", "?", [], str(local), UNKNOWN, note=str(exc))
            )
            continue
        runs.append(run)
        remotes[run.local_dir] = remote
    runs.sort(key=lambda r: r.started or 0.0, reverse=True)
    ended = [r for r in runs if r.state == ENDED]
    runs = [r for r in runs if r.state != ENDED] + ended[:recent]
    targets = Targets()
    try:
        for run in runs:
            if run.state == UNKNOWN and run.local_dir in remotes:
                await _ask_hosts(run, remotes[run.local_dir], targets)
            if run.state != ENDED and run.started is not None:
                run.elapsed_s = max(0.0, now - run.started)
        pairs: list[tuple[str, str]] = [("local", host_lock("local"))]
        for spec in hosts if hosts is not None else configured_hosts():
            pairs.append((spec, host_lock(spec)))
        for run in runs:
            if run.state == LIVE and not run.target.startswith("slurm://"):
                for spec in run.hosts:
                    pairs.append((spec, run.lock or host_lock(spec)))
        locks = []
        for spec, lock in dict.fromkeys(pairs):
            locks.append(await _lock_of(spec, lock, targets))
    finally:
        await targets.close()
    runs.sort(key=lambda r: (r.state != LIVE, -(r.started or 0.0)))
    return Status(runs, locks)


def holder_words(holder: dict[str, Any]) -> str:
    if not holder:
        return ""
    who = f"{holder.get('user', '?')}@{holder.get('console_host', '?')}"
    extra = [f"run {holder['run_id']}"] if holder.get("run_id") else []
    if holder.get("pgid"):
        extra.append(f"pgid {holder['pgid']}")
    return f"{who} ({', '.join(extra)})" if extra else who


def elapsed_words(seconds: float | None) -> str:
    """42s, 2m05s, 1h02m, 3d04h: each unit named ("0:42" read as 42 minutes beside "1h02m")."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def status_lines(status: Status) -> list[str]:
    """The runs, then the locks, as columns an operator reads on a terminal."""
    rows = [("STATE", "RUN", "PRESET", "KIND", "VERDICT", "HOSTS", "ELAPSED", "NOTE")]
    for r in status.runs:
        state = r.state + (" (followed)" if r.followed and r.state == LIVE else "")
        rows.append(
            (
                state,
                r.run_id,
                r.preset,
                r.kind,
                r.verdict or "-",
                ",".join(r.hosts),
                elapsed_words(r.elapsed_s),
                r.note,
            )
        )
    lines = _columns(rows) if status.runs else ["no runs recorded here"]
    lines.append("")
    locks = [("HOST", "LOCK", "STATE", "HOLDER")]
    for lk in status.locks:
        holder = holder_words(lk.holder)
        if lk.state in ("free", "absent") and holder:
            holder = f"last: {holder}"
        locks.append((lk.host, lk.lock, lk.state, holder or lk.note))
    return lines + _columns(locks)


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
