"""A fleet run: one run's cells spread over several hosts, one event stream, one verdict.

Each host runs batches of cells as ordinary detached runs ("members"), each in its own run
directory (RUNS/RUN_ID/HOST-N: hosts sharing a home directory never collide), under the host's
own lock, with its own marker (TRACEDECK_RUN_ID=RUN_ID@HOST-N), so the run's processes on one
host are never taken for another's. Cells wait in one queue of groups (the cells a kind
compares with each other, such as a B3.67 seed's prefill and decode, stay on one host unless
the preset says `fleet.together = false`); a host takes a share of the queue whenever it is
free. A busy host is skipped or waited for (`fleet.busy`). A host lost for good (its link, or
its run crashed) gives its unfinished cells back to the queue for the others
(`fleet.requeue`), or they are lost.

Every event a host's part emits carries its host (Event.host); HostAssigned records each
batch, so attach, cancel and replay rebuild every host's part from the record alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from runners import kinds
from runners.cells import SETUP_CELL, CellState, cell_name
from runners.config import run_lock
from runners.determinism import run_env
from runners.events import (
    CellFinished,
    CellRequeued,
    Connection,
    Error,
    Event,
    HostAssigned,
    HostState,
    LockAcquired,
    LockBusy,
    RunFinished,
    RunStarted,
)
from runners.follower import RunFollower
from runners.kind import Ending, JudgeContext
from runners.launchers.base import LockBusyError, NotStartedError
from runners.launchers.detached import DetachedLauncher, parse_holder
from runners.leftovers import report_leftovers
from runners.plan import RunPlan, build_plan, cell_scripts, interpreter, plan_document
from runners.presets import Preset
from runners.record import (
    EVENTS,
    FLEET,
    Recorder,
    RecordError,
    RunRecord,
    drop_torn_tail,
    iter_events,
)
from runners.session import (
    ALIVE_EVERY_S,
    CANCEL_GRACE_S,
    DISCONNECTED,
    POLL_S,
    Session,
    by_id_link,
    link_by_id,
    new_record,
    resolve_dir,
    ship_reference,
)
from runners.targets.base import ConnectionLost, Target, TargetError
from runners.targets.factory import parse_target

WAIT_S = 2.0  # between looks at a busy host's lock (fleet.busy = "wait")
CANCEL_MARK = "cancel"  # in the local run directory: `tracedeck cancel` asked; start nothing more
# HostState words
CONNECTING, WAITING, SKIPPED, RUNNING = "connecting", "waiting", "skipped", "running"
IDLE, DONE, LOST, FAILED = "idle", "done", "lost", "failed"
OUT = (LOST, FAILED, SKIPPED)  # a host in one of these states takes no more cells this run


def host_slug(spec: str, taken: set[str]) -> str:
    """A directory name for a host: its spec in safe characters, unique within the fleet."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.strip().removeprefix("ssh://")).strip("_.")
    slug, n = base or "host", 1
    while slug in taken:
        n += 1
        slug = f"{base}_{n}"
    return slug


def member_plan(
    preset: Preset,
    *,
    run_id: str,
    member: str,
    run_dir: str,
    workdir: str,
    python: str,
    date: str,
    lock: str,
    cells: list[int],
) -> RunPlan:
    """One host's batch: the run's plan rendered for that host's directory, with only the
    batch's cells and their traces, and the batch's own marker as its run id."""
    ship = preset.section("engine")["ship_reference"]
    full = build_plan(
        preset,
        run_id=run_id,
        run_dir=run_dir,
        workdir=workdir,
        python=python,
        date=date,
        lock=lock,
        pythonpath=f"{run_dir}/pkg" if ship else "",
    )
    wanted = set(cells)
    return replace(
        full,
        run_id=member,
        cells=[c for c in full.cells if c.index in wanted],
        traces=tuple(t for t in full.traces if t.cell is None or t.cell in wanted),
    )


@dataclass(slots=True)
class Member:
    """One batch of cells on one host: an ordinary detached run of its own."""

    host: str
    member: str
    plan: RunPlan
    launcher: DetachedLauncher
    follower: RunFollower
    started: bool = False  # the lock was taken and the run started
    ended: bool = False
    requeued: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Host:
    spec: str
    slug: str
    target: Target
    lock: str
    state: str = ""
    message: str = ""
    members: list[Member] = field(default_factory=list)
    dirs: tuple[str, str, str] | None = None  # workdir, runs, python once resolved
    batch: list[list[int]] | None = None  # groups taken, not yet started
    waited: bool = False

    @property
    def active(self) -> Member | None:
        return self.members[-1] if self.members else None


class _FleetTargets:
    """What callers that expect session.target get: the fleet's name, and connect/close of
    every host (a host that cannot be reached is left out, and said so by cancel)."""

    def __init__(self, session: FleetSession) -> None:
        self.session = session
        self.name = session.record.target

    async def connect(self) -> None:
        return None  # each host connects when it is used

    async def close(self) -> None:
        for host in self.session.hosts.values():
            await host.target.close()


class FleetSession(Session):
    """Drives one run over several hosts; same interface as Session (launch, follow, cancel,
    attach) and the same one path of every event (record, fold, consumers)."""

    def __init__(  # noqa: PLR0913 - the record, the preset, the hosts, the consumer
        self,
        record: RunRecord,
        preset: Preset,
        hosts: list[str],
        emit: Callable[[Event], None],
        *,
        reconnect_attempts: int | None = None,
    ) -> None:
        self.record = record
        self.preset = preset
        self.kind = kinds.get(preset.kind)
        self._consumers = emit
        self.local_dir = Path(record.local_dir)
        self.by_id: Path | None = None  # OUT/by-id/RUN_ID, made at launch (create_fleet)
        tgt = preset.section("target")
        self.attempts = (
            reconnect_attempts if reconnect_attempts is not None else int(tgt["reconnect_attempts"])
        )
        self.settings = preset.section(FLEET)
        taken: set[str] = set()
        self.hosts: dict[str, Host] = {}
        for spec in hosts:
            slug = host_slug(spec, taken)
            taken.add(slug)
            target = parse_target(
                spec, connect_timeout=tgt["connect_timeout_s"], keepalive=tgt["keepalive_s"]
            )
            self.hosts[spec] = Host(spec, slug, target, run_lock(spec, preset, record.target))
        self.target = _FleetTargets(self)  # type: ignore[assignment]
        self.plan = None
        self.follower = None
        self.finished: RunFinished | None = None
        self._recorder: Recorder | None = None
        self._changes = None  # no change notifier: each host's batch is polled
        self._cancelling = False
        self._cancelled = False
        self.stage = ""
        self.pressure: Callable[[], bool] | None = None
        self._advance_lock: asyncio.Lock | None = None
        # The run's cells (a plan rendered for no host in particular: the judge needs only
        # their indices, parameters and artifacts).
        nominal = build_plan(
            preset,
            run_id=record.run_id,
            run_dir=f"{tgt['runs']}/{record.run_id}",
            workdir=tgt["workdir"],
            python=tgt["python"] or "python3",
            date=record.date,
            lock="",
        )
        self.cells = list(nominal.cells)
        self.nominal = nominal
        together = self.kind.together(self.cells) if self.settings["together"] else None
        self.groups = together or [[c.index] for c in self.cells]
        self.queue: list[list[int]] = [list(g) for g in self.groups]
        self.judge = self.kind.judge(
            JudgeContext(
                preset=preset,
                local_dir=self.local_dir,
                date=record.date,
                emit=self.emit,
                cells=self.cells,
                progress=self._consumers,
            )
        )

    # -- the one path of every event ---------------------------------------------------------

    def _fold(self, event: Event) -> None:
        host = self.hosts.get(event.host) if event.host else None
        if isinstance(event, HostAssigned) and host is not None:
            self._add_member(host, event)
        member = host.active if host is not None else None
        if member is not None and not member.ended:
            member.follower.fold(event)
            if isinstance(event, LockAcquired):
                member.started = True
            elif isinstance(event, CellRequeued):
                member.requeued.add(event.cell)
            elif isinstance(event, HostState) and event.state not in (RUNNING, CONNECTING):
                member.ended = True
        if host is not None and isinstance(event, HostState):
            host.state, host.message = event.state, event.message
        self.judge.fold(event)
        if isinstance(event, RunFinished):
            self.finished = event

    def _add_member(self, host: Host, event: HostAssigned) -> None:
        plan = member_plan(
            self.preset,
            run_id=self.record.run_id,
            member=event.member,
            run_dir=event.run_dir,
            workdir=event.workdir,
            python=event.python,
            date=self.record.date,
            lock=event.lock,
            cells=list(event.cells),
        )
        launcher = DetachedLauncher(host.target)
        spec = host.spec

        def tagged(e: Event) -> None:
            e.host = spec
            self.emit(e)

        follower = RunFollower(
            host.target,
            plan,
            self.judge,
            self.local_dir,
            tagged,
            progress=self._consumers,
            progress_files=launcher.progress_files(plan),
            advance=self._advance,
        )
        host.members.append(Member(spec, event.member, plan, launcher, follower))

    async def _advance(self) -> None:
        """The judge judges for every host, one host at a time (no pair judged twice)."""
        if self._advance_lock is None:
            self._advance_lock = asyncio.Lock()
        async with self._advance_lock:
            await self.judge.advance()

    def _host_emit(self, host: Host, event: Event) -> None:
        event.host = host.spec
        self.emit(event)

    # -- creating ------------------------------------------------------------------------------

    @classmethod
    def create_fleet(
        cls,
        preset: Preset,
        target_spec: str,
        hosts: list[str],
        out_dir: Path,
        emit: Callable[[Event], None],
    ) -> FleetSession:
        if preset.section("target")["scheduler"]:
            raise ValueError(
                f"{preset.source}: target.scheduler = {preset.section('target')['scheduler']!r} "
                f"with --target {target_spec!r}: a cluster's scheduler places the cells itself; "
                "give its login node as the target (slurm://LOGIN/PARTITION), not a fleet"
            )
        extra = {FLEET: {"hosts": list(hosts), "members": []}}
        record = new_record(preset, target_spec, out_dir, lock="", extra=extra)
        fleet = cls(record, preset, hosts, emit)
        fleet.by_id = by_id_link(out_dir, record.run_id)
        return fleet

    async def launch(self) -> None:
        """Record the run and say it started; each host starts its part when it follows."""
        self.stage = "uploading"
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self.record.save()
        if self.by_id is not None:
            with contextlib.suppress(OSError):  # a convenience: find_run also scans the out dir
                link_by_id(self.by_id, self.local_dir)
        self._recorder = Recorder(self.local_dir)
        tgt = self.preset.section("target")
        plan_json = orjson.dumps(
            plan_document(self.nominal, self.preset), option=orjson.OPT_INDENT_2
        )
        (self.local_dir / "plan.json").write_bytes(plan_json)
        self.emit(self._fleet_started(attached=False, runs=tgt["runs"]))
        self.stage = "started"

    def _fleet_started(self, attached: bool, runs: str) -> RunStarted:
        hosts = ", ".join(self.hosts)
        return RunStarted(
            run_id=self.record.run_id,
            preset=self.preset.name,
            kind=self.preset.kind,
            target=self.record.target,
            local_dir=str(self.local_dir),
            remote_dir=f"{runs}/{self.record.run_id}/HOST-N on each host of {hosts}",
            cells=[
                {"index": c.index, "params": c.params, "command": c.command} for c in self.cells
            ],
            profile=self.preset.section("determinism")["profile"],
            env=run_env(self.preset.data),
            attached=attached,
            notes=self._notes(),
        )

    def _notes(self) -> list[str]:
        """Where the run is judged: here, for a fleet (every artifact comes home)."""
        if self.kind.host_judging is None or self.preset.section("judge")["on"] == "console":
            return []
        return ["judged on this console: a fleet run brings every artifact home"]

    # -- attaching -----------------------------------------------------------------------------

    @classmethod
    def fleet_from_record(cls, record: RunRecord, emit: Callable[[Event], None]) -> FleetSession:
        preset = Preset(
            source=record.source,
            data=record.preset_data,
            overrides=record.overrides,
            options=frozenset(record.options),
        )
        fleet = record.extra.get(FLEET)
        if not isinstance(fleet, dict) or not isinstance(fleet.get("hosts"), list):
            raise ValueError(f"{record.local_dir}/run.json: extra.fleet.hosts is missing")
        session = cls(record, preset, [str(h) for h in fleet["hosts"]], emit)
        # Every batch that was ever assigned, so that cancel reaches it without the events.
        for m in fleet.get("members") or []:
            host = session.hosts.get(m["host"])
            if host is not None:
                session._add_member(
                    host,
                    HostAssigned(
                        member=m["member"],
                        cells=list(m["cells"]),
                        run_dir=m["run_dir"],
                        lock=m["lock"],
                        workdir=m["workdir"],
                        python=m["python"],
                        host=m["host"],
                    ),
                )
        return session

    @classmethod
    def fleet_attach(
        cls,
        record: RunRecord,
        emit: Callable[[Event], None],
        replay: Callable[[Event], None],
    ) -> FleetSession:
        session = cls(
            record,
            Preset(
                source=record.source,
                data=record.preset_data,
                overrides=record.overrides,
                options=frozenset(record.options),
            ),
            [str(h) for h in record.extra[FLEET]["hosts"]],
            emit,
        )
        local_dir = session.local_dir
        recorder = Recorder(local_dir)
        try:
            events_path = local_dir / EVENTS
            if events_path.exists():
                drop_torn_tail(events_path)
                for event in iter_events(events_path):
                    if isinstance(event, RunFinished) and event.verdict == DISCONNECTED:
                        continue
                    session._fold(event)
                    replay(event)
        except BaseException:
            recorder.close()
            raise
        session._recorder = recorder
        session._rebuild_queue()
        return session

    def _rebuild_queue(self) -> None:
        """After a replay: the groups with a cell neither finished nor in a running batch."""
        running = {
            c.index
            for h in self.hosts.values()
            for m in h.members
            if not m.ended
            for c in m.plan.cells
        }
        done = {c for c in self.judge.finished if c >= 0}
        self.queue = [
            list(g) for g in self.groups if any(c not in done for c in g) and not set(g) & running
        ]

    # -- following -----------------------------------------------------------------------------

    async def follow(self) -> RunFinished:
        if self.finished is not None:
            return self.finished
        drivers = [
            asyncio.ensure_future(self._drive(h)) for h in self.hosts.values() if h.state not in OUT
        ]
        try:
            await asyncio.gather(*drivers)
        except RecordError as exc:
            for d in drivers:
                d.cancel()
            await asyncio.gather(*drivers, return_exceptions=True)
            self._stop_recording(exc)
            assert self.finished is not None
            return self.finished
        except BaseException:
            for d in drivers:
                d.cancel()
            await asyncio.gather(*drivers, return_exceptions=True)
            raise
        await self._finish_fleet()
        assert self.finished is not None
        return self.finished

    def _stopping(self) -> bool:
        if not self._cancelled and (self.local_dir / CANCEL_MARK).exists():
            self._cancelled = True
        return self._cancelled

    def _usable(self, but: Host | None = None) -> list[Host]:
        return [h for h in self.hosts.values() if h is not but and h.state not in OUT]

    def _take(self, host: Host) -> list[list[int]]:
        """A fair share of the queue for a host that is free: the queue over the hosts that
        have no work in hand (this one included)."""
        if not self.queue:
            return []
        free = [
            h
            for h in self._usable()
            if h.batch is None and (h.active is None or h.active.ended or h is host)
        ]
        share = math.ceil(len(self.queue) / max(1, len(free)))
        taken, self.queue = self.queue[:share], self.queue[share:]
        return taken

    def _give_back(self, groups: list[list[int]]) -> None:
        self.queue = [list(g) for g in groups] + self.queue

    def _work_may_come(self, host: Host) -> bool:
        """Can cells still come back to the queue (a batch runs that could be lost)?"""
        return any(
            h.active is not None and not h.active.ended and h.active.started
            for h in self.hosts.values()
            if h is not host
        ) or any(h.batch is not None for h in self.hosts.values() if h is not host)

    async def _drive(self, host: Host) -> None:
        """One host's part: follow its batch (after an attach), then take batches until the
        queue is empty and no other host's work could come back to it."""
        member = host.active
        if member is not None and not member.ended and await self._connect(host):
            await self._follow_member(host, member)
        while host.state not in OUT:
            if self._stopping():
                break
            groups = self._take(host)
            if not groups:
                if self.queue or self._work_may_come(host):
                    await asyncio.sleep(POLL_S * 5)
                    continue
                break
            host.batch = groups
            try:
                member = await self._start_member(host, groups)
            finally:
                host.batch = None
            if member is not None:
                if self._stopping():
                    # `tracedeck cancel` came while this batch started: it may not know of it
                    await member.launcher.cancel(member.plan, CANCEL_GRACE_S)
                await self._follow_member(host, member)
            elif host.state == WAITING:
                await asyncio.sleep(WAIT_S)
        if host.state not in OUT:
            self._set_state(host, DONE)

    def _set_state(self, host: Host, state: str, message: str = "") -> None:
        if host.state != state or host.message != message:
            self._host_emit(host, HostState(state=state, message=message))

    async def _connect(self, host: Host) -> bool:
        """Connect (with the run's reconnect attempts); False when the host is lost."""
        try:
            await host.target.connect()
            return True
        except ConnectionLost as exc:
            if await self._reconnect_host(host, str(exc)):
                return True
            self._lose_host(host, str(exc))
            return False
        except TargetError as exc:  # a host key or a login refused: no retry mends it
            self._fail_host(host, str(exc))
            return False

    async def _start_member(self, host: Host, groups: list[list[int]]) -> Member | None:
        cells = sorted(c for g in groups for c in g)
        if not host.state:
            self._set_state(host, CONNECTING)
        if not await self._connect(host):
            self._give_back(groups)
            return None
        try:
            workdir, runs, python = await self._host_dirs(host)
            if host.waited and not await self._lock_free(host):
                self._give_back(groups)
                return None
            n = len(host.members) + 1
            run_dir = f"{runs}/{self.record.run_id}/{host.slug}-{n}"
            assigned = HostAssigned(
                member=f"{self.record.run_id}@{host.slug}-{n}",
                cells=cells,
                run_dir=run_dir,
                lock=host.lock,
                workdir=workdir,
                python=python,
            )
            self._host_emit(host, assigned)
            self._save_member(host, assigned)
            member = host.active
            assert member is not None
            await self._upload(host, member)
            started = await member.launcher.start(member.plan)
        except LockBusyError as error:
            self._busy(host, error, groups)
            return None
        except ConnectionLost as exc:
            self._give_back(groups)
            if await self._reconnect_host(host, str(exc)):
                self._set_state(host, IDLE, "reconnected; the batch goes back to the queue")
            else:
                self._lose_host(host, str(exc))
            return None
        except (NotStartedError, TargetError, OSError) as exc:
            self._give_back(groups)
            self._fail_host(host, str(exc))
            return None
        self._host_emit(host, LockAcquired(lock=host.lock, holder=started.holder))
        self._set_state(host, RUNNING, f"cells {', '.join(str(c + 1) for c in cells)}")
        return member

    def _fail_host(self, host: Host, message: str) -> None:
        """A host that cannot take cells this run; its cells go to the others. Not a verdict:
        a run whose cells all ran elsewhere passes, and one whose cells no host could take
        ends HOST_LOST (exit 3)."""
        self._host_emit(
            host, Error(message=f"{host.spec}: {message}", where=host.spec, affects_verdict=False)
        )
        self._set_state(host, FAILED, message)

    async def _host_dirs(self, host: Host) -> tuple[str, str, str]:
        if host.dirs is None:
            tgt = self.preset.section("target")
            workdir = await resolve_dir(host.target, tgt["workdir"], "target.workdir")
            runs = await resolve_dir(host.target, tgt["runs"], "target.runs")
            python = interpreter(host.target.name, tgt["python"])
            host.dirs = (workdir, runs, python)
        return host.dirs

    async def _lock_free(self, host: Host) -> bool:
        """A waiting host: is its lock free now? (Says who holds it while it is not.)"""
        lock = shlex.quote(host.lock)
        result = await host.target.run(
            f"exec 9>>{lock} && flock -n 9 && exit 0; cat {lock}.json 2>/dev/null; exit 75"
        )
        if result.exit_status == 0:
            return True
        holder = parse_holder(result.stdout)
        self._set_state(host, WAITING, f"lock {host.lock} held by {_who(holder)}")
        return False

    def _busy(self, host: Host, error: LockBusyError, groups: list[list[int]]) -> None:
        self._give_back(groups)
        member = host.active
        if member is not None:
            member.ended = True
        self._host_emit(host, LockBusy(lock=error.lock, holder=error.holder))
        if error.holder.get("run_id") == self.record.run_id:
            self._host_emit(
                host,
                Error(
                    message=f"{host.spec}: its lock {error.lock} is held by this same run on "
                    f"another host of the fleet: both hosts share that lock file (the same "
                    f"machine listed twice, or a lock on a shared filesystem). Give each host "
                    f"its own lock ([hosts.NAME] lock in the config) to run both at once",
                    where=host.spec,
                    affects_verdict=False,
                ),
            )
        who = _who(error.holder)
        if self.settings["busy"] == "wait":
            host.waited = True
            self._set_state(host, WAITING, f"lock {error.lock} held by {who}")
        else:
            self._set_state(host, SKIPPED, f"lock {error.lock} held by {who}")

    def _save_member(self, host: Host, event: HostAssigned) -> None:
        members = self.record.extra.setdefault(FLEET, {}).setdefault("members", [])
        members.append(
            {
                "host": host.spec,
                "member": event.member,
                "cells": list(event.cells),
                "run_dir": event.run_dir,
                "lock": event.lock,
                "workdir": event.workdir,
                "python": event.python,
            }
        )
        self.record.save()

    async def _upload(self, host: Host, member: Member) -> None:
        plan = member.plan
        plan_json = orjson.dumps(plan_document(plan, self.preset), option=orjson.OPT_INDENT_2)
        holder = {**self._holder(), "member": member.member, "host": host.spec}
        files = {
            **cell_scripts(plan),
            **member.launcher.files(plan, holder),
            "plan.json": plan_json.decode(),
        }
        for rel, text in files.items():
            await host.target.write_file(f"{plan.run_dir}/{rel}", text.encode())
        if self.preset.section("engine")["ship_reference"]:
            await ship_reference(host.target, f"{plan.run_dir}/pkg")

    async def _follow_member(self, host: Host, member: Member) -> None:
        loop = asyncio.get_running_loop()
        last_alive = 0.0
        while not member.ended:
            if self.pressure is not None and self.pressure():
                await asyncio.sleep(POLL_S / 2)
                continue
            try:
                if await member.follower.poll():
                    await self._end_member(
                        host, member, "cancelled" if member.follower.cancelled else "done"
                    )
                    return
                now = loop.time()
                if now - last_alive >= ALIVE_EVERY_S:
                    last_alive = now
                    how = await self._member_alive(host, member)
                    if how is not None:
                        await self._end_member(host, member, how)
                        return
            except ConnectionLost as exc:
                if not await self._reconnect_host(host, str(exc)):
                    self._lose_host(host, str(exc))
                    return
                continue
            await asyncio.sleep(0 if member.follower.behind else POLL_S)

    async def _member_alive(self, host: Host, member: Member) -> str | None:
        """None while the batch's run lives; else how it ended (as Session._check_alive)."""
        plan, follower = member.plan, member.follower
        if self._cancelling or await member.launcher.alive(plan):
            return None
        if await follower.poll():
            return "cancelled" if follower.cancelled else "done"
        if await host.target.read_from(f"{plan.run_dir}/pgid", 0, 64) is None:
            return "not_started"
        if await host.target.read_from(f"{plan.run_dir}/cancel", 0, 0) is not None:
            for _ in range(50):
                if await follower.poll():
                    break
                await asyncio.sleep(POLL_S)
            return "cancelled"
        tail = await follower.tail(f"{plan.run_dir}/runner.err")
        self._host_emit(
            host,
            Error(
                message=f"{host.spec}: the run in {plan.run_dir} ended without finishing "
                f"(remote crash or killed outside tracedeck); runner.err: {tail}",
                where=plan.run_dir,
                # its cells are requeued or end lost (HOST_LOST): never a verdict of its own
                affects_verdict=False,
            ),
        )
        return "crashed"

    async def _end_member(self, host: Host, member: Member, how: str) -> None:
        follower = member.follower
        await follower.drain_started()
        await follower.drain_rest()
        if how == "cancelled":
            self._cancelled = True
        left = [i for i, t in follower.cells.items() if not t.finished and i not in member.requeued]
        if how == "crashed":
            self._release(host, member, "its run on the host ended without finishing")
        elif how == "not_started":
            self._give_back([g for g in self.groups if set(g) & set(left)])
        else:
            for index in left:
                if how == "cancelled":
                    state = CellState.CANCELLED
                elif follower.setup_failed:
                    state = CellState.SKIPPED
                else:
                    state = CellState.LOST
                self._host_emit(
                    host,
                    CellFinished(cell=index, state=state, exit_code=None, duration_s=None),
                )
        for path in follower.never_appeared():
            self._host_emit(
                host,
                Error(
                    message=f"trace file {host.spec}:{path} never appeared: the engine wrote no "
                    "trace there (check [traces] follow and the engine's trace path)",
                    where=path,
                ),
            )
        await report_leftovers(
            host.target,
            member.launcher,
            member.plan,
            self.local_dir,
            lambda e: self._host_emit(host, e),
        )
        await self._advance()
        if how == "crashed":
            self._set_state(host, FAILED, "its run ended without finishing")
        else:
            self._set_state(host, IDLE)
        member.ended = True
        if how == "cancelled" and not self._cancelling:
            # cancelled from elsewhere: every other host's batch stops too
            try:
                await self._cancel_members(CANCEL_GRACE_S)
            except TargetError as exc:
                self._host_emit(
                    host, Error(message=str(exc), where=host.spec, affects_verdict=False)
                )

    async def _reconnect_host(self, host: Host, message: str) -> bool:
        self._host_emit(host, Connection(state="lost", message=message))
        delay = 0.5
        for attempt in range(1, self.attempts + 1):
            await asyncio.sleep(delay)
            delay = min(delay * 2, 8.0)
            self._host_emit(host, Connection(state="retrying", message=message, attempt=attempt))
            try:
                await host.target.close()
                await host.target.connect()
            except ConnectionLost as exc:
                message = str(exc)
                continue
            self._host_emit(
                host, Connection(state="restored", message="following resumes", attempt=attempt)
            )
            return True
        return False

    def _lose_host(self, host: Host, message: str) -> None:
        member = host.active
        running = member is not None and not member.ended and member.started
        tail = (
            f"; its run there may go on (it holds that host's lock until it ends): "
            f"`tracedeck cancel {self.local_dir}` stops it once the host is reachable"
            if running
            else ""
        )
        self._host_emit(
            host,
            Error(
                message=f"{host.spec}: lost ({self.attempts} reconnect attempts failed: "
                f"{message}){tail}",
                where=host.spec,
                affects_verdict=False,
            ),
        )
        if member is not None and not member.ended:
            if member.started:
                self._release(host, member, f"{host.spec} was lost")
            else:
                member.ended = True
        self._set_state(host, LOST, message)

    def _release(self, host: Host, member: Member, reason: str) -> None:
        """The unfinished cells of a batch that will not finish: back to the queue (whole
        groups) when requeue is allowed and another host can take them, else lost."""
        tracks = member.follower.cells
        left = {i for i, t in tracks.items() if i >= 0 and not t.finished} - member.requeued
        groups = [g for g in self.groups if set(g) & left]
        others = self._usable(but=host)
        if self.settings["requeue"] and others and not self._stopping():
            for group in groups:
                for cell in group:
                    self._host_emit(
                        host,
                        CellRequeued(
                            cell=cell,
                            reason=f"{reason}; runs again on {', '.join(h.spec for h in others)}",
                        ),
                    )
            self._give_back(groups)
        else:
            why = reason + ("" if self.settings["requeue"] else " (fleet.requeue is off)")
            if self.settings["requeue"] and not others:
                why += " and no other host can take its cells"
            for cell in sorted(left):
                self._host_emit(
                    host,
                    CellFinished(
                        cell=cell,
                        state=CellState.LOST,
                        exit_code=None,
                        duration_s=None,
                        stderr_tail=why,
                    ),
                )
        setup = tracks.get(SETUP_CELL)
        if setup is not None and setup.started is not None and not setup.finished:
            self._host_emit(
                host,
                CellFinished(
                    cell=SETUP_CELL, state=CellState.LOST, exit_code=None, duration_s=None
                ),
            )
        member.ended = True

    async def _finish_fleet(self) -> None:
        cancelled = self._stopping()
        finished = self.judge.finished
        left = [c for c in self.cells if c.index not in finished]
        busy = [h for h in self.hosts.values() if h.state in (SKIPPED, WAITING)]
        gone = [h for h in self.hosts.values() if h.state in (LOST, FAILED)]
        total = len(self.cells)
        why = ""
        if left and not cancelled:
            if busy:
                why = "every host that could take them was busy: " + "; ".join(
                    f"{h.spec}: {h.message}" for h in busy
                )
            else:
                why = "no host could take them: " + "; ".join(
                    f"{h.spec} {h.state} ({h.message})" for h in gone
                )
        for cell in left:
            self.emit(
                CellFinished(
                    cell=cell.index,
                    state=CellState.CANCELLED if cancelled else CellState.SKIPPED,
                    exit_code=None,
                    duration_s=None,
                    stderr_tail="" if cancelled else f"never ran: {why}",
                )
            )
        lost = [
            cell_name(e.cell, self._params(e.cell), total)
            for e in self.judge.finished.values()
            if e.cell >= 0 and e.state == CellState.LOST
        ]
        if cancelled:
            ending = Ending("cancelled")
        elif lost:
            ending = Ending("host_lost", f"cells lost with their host: {', '.join(lost)}")
        elif left and busy:
            ending = Ending("lock_busy", f"{len(left)} cells never ran: {why}")
        elif left:
            ending = Ending("host_lost", f"{len(left)} cells never ran: {why}")
        else:
            ending = Ending("done")
        await self._advance()
        result = await self._judged_end(ending)
        result.summary = {**result.summary, "hosts": self._host_summary()}
        self.emit(result)

    def _params(self, index: int) -> dict[str, Any]:
        return next((c.params for c in self.cells if c.index == index), {})

    def _host_summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for h in self.hosts.values():
            ran = sorted(
                e.cell for e in self.judge.finished.values() if e.host == h.spec and e.cell >= 0
            )
            out[h.spec] = {"state": h.state, "cells": ran, "message": h.message}
        return out

    # -- cancelling ------------------------------------------------------------------------------

    async def cancel(self, grace_s: float = CANCEL_GRACE_S) -> str:
        """Start nothing more; TERM every batch on every host, KILL after the grace."""
        self._cancelled = True
        (self.local_dir / CANCEL_MARK).touch()
        self._cancelling = True
        try:
            return await self._cancel_members(grace_s)
        finally:
            self._cancelling = False

    async def _cancel_members(self, grace_s: float) -> str:
        """Cancel every batch that may run, on every host at once. A host that cannot be
        reached is named (an error when no host could be)."""

        async def one(host: Host, member: Member) -> str:
            try:
                await host.target.connect()
                return await member.launcher.cancel(member.plan, grace_s)
            except TargetError as exc:
                return f"TRACEDECK_UNREACHABLE {host.spec}: {exc}"

        jobs = [
            one(h, m) for h in self.hosts.values() for m in h.members if not m.ended or m.started
        ]
        words = list(await asyncio.gather(*jobs))
        unreachable = [w.split(" ", 1)[1] for w in words if w.startswith("TRACEDECK_UNREACHABLE")]
        if unreachable and len(unreachable) == len(words):
            raise TargetError("; ".join(unreachable))
        for text in unreachable:
            self.emit(
                Error(
                    message=f"cancel could not reach {text}; its batch goes on there until "
                    "it ends: cancel again once the host is reachable",
                    where=text.split(":", 1)[0],
                    affects_verdict=False,
                )
            )
        for word in ("TRACEDECK_STILL_ALIVE", "TRACEDECK_KILLED", "TRACEDECK_CANCELLED"):
            if word in words:
                return word
        return "TRACEDECK_NOT_RUNNING"

    async def close(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        for host in self.hosts.values():
            await host.target.close()


def _who(holder: dict[str, Any]) -> str:
    if holder.get("raw"):
        return str(holder["raw"])
    return (
        f"run {holder.get('run_id')} of {holder.get('user')}@{holder.get('console_host')} "
        f"(preset {holder.get('preset')}, pgid {holder.get('pgid')})"
    )
