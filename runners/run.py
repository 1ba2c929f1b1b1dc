"""A run's life on one host or a fleet: launch its batches under each host's lock, follow them
to the end, judge the run, emit events.

The run owns its record (the one writer), its judge and the one path every event takes:
recorded, folded into the batch it belongs to (its place in the files) and the judge (the
verdict state), then handed to the consumers. Attach replays the record through the same fold.
Its placement is decided once (runners.placement); each batch is a Member; the Scheduler says
which host takes which cells. Every event of a fleet host's part carries its host.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import shutil
import traceback
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

import orjson

from runners import kinds
from runners.determinism import run_env
from runners.events import (
    CellRequeued,
    EngineVersion,
    Error,
    Event,
    HostAssigned,
    HostState,
    LockAcquired,
    LockBusy,
    RunFinished,
    RunStarted,
)
from runners.exits import EXIT_INFRA
from runners.kind import Ending, JudgeContext
from runners.launchers.base import LockBusyError, NotStartedError, Started
from runners.member import POLL_S, Member, reconnect
from runners.placement import HOST, Placement, by_id_link, decide, link_by_id, new_record
from runners.placement import recorded_preset as _preset
from runners.plan import RunPlan, dir_command, interpreter, plan_document
from runners.presets import Preset
from runners.record import (
    EVENTS,
    FLEET,
    RECORD_LOCK,
    RUN_JSON,
    Recorder,
    RecordError,
    RunRecord,
    drop_torn_tail,
    iter_events,
)
from runners.scheduler import (
    CANCEL_MARK,
    CONNECTING,
    DONE,
    FAILED,
    IDLE,
    OUT,
    RUNNING,
    WAITING,
    Scheduler,
    Slot,
)
from runners.targets.base import ConnectionLost, Target, TargetError
from runners.templates import render

NOT_RECORDED = "NOT_RECORDED"
NOT_JUDGED = "NOT_JUDGED"  # tracedeck itself failed while following: nothing was judged
DISCONNECTED = "DISCONNECTED"
CANCEL_GRACE_S = 5.0
WAIT_S = 2.0  # between looks at a busy host's lock (fleet.busy = "wait")
VERSION_TIMEOUT_S = 30.0  # [engine] version_command: a version query, not work


class Cancel(StrEnum):
    """What a cancel did (the launchers' words)."""

    CANCELLED = "TRACEDECK_CANCELLED"
    KILLED = "TRACEDECK_KILLED"
    STILL_ALIVE = "TRACEDECK_STILL_ALIVE"
    NOT_RUNNING = "TRACEDECK_NOT_RUNNING"
    SENT = ""  # the launcher said nothing


async def resolve_dir(target: Target, path: str, key: str) -> str:
    """An absolute path on the target, made when missing: absolute as written; `~`, `~/x` and
    relative paths under the target's home (the login user's, on the local target $HOME)."""
    result = await target.run(dir_command(path, create=True))
    if result.exit_status != 0:
        raise TargetError(
            f"{target.name}: {key} {path!r} is not usable: "
            f"{result.stderr.strip()}; set {key} to a writable directory"
        )
    return result.stdout.strip()


class Run:
    """Drives one run (one host, or a fleet's hosts) and turns what happens into events."""

    def __init__(
        self,
        record: RunRecord,
        placement: Placement,
        emit: Callable[[Event], None],
        *,
        reconnect_attempts: int | None = None,
    ) -> None:
        self.record, self.placement, self.preset = record, placement, placement.preset
        self.kind = kinds.get(self.preset.kind)
        self._consumers = emit
        self.local_dir = Path(record.local_dir)
        self.by_id: Path | None = None  # OUT/by-id/RUN_ID, made at launch (Run.create)
        self.finished: RunFinished | None = None
        tgt = self.preset.section("target")
        self.attempts = (
            reconnect_attempts if reconnect_attempts is not None else int(tgt["reconnect_attempts"])
        )
        self.fleet = placement.fleet
        self.slots = {h.spec: Slot(h, placement.connect(h)) for h in placement.hosts}
        self.target_name = (
            record.target if self.fleet else next(iter(self.slots.values())).target.name
        )
        # The run's cells on no host in particular: the judge needs only their indices,
        # parameters and artifacts.
        self.nominal = placement.plan(
            run_id=record.run_id,
            run_dir=f"{tgt['runs']}/{record.run_id}",
            workdir=tgt["workdir"],
            python=tgt["python"] or "python3",
            date=record.date,
            lock="",
        )
        self.cells = list(self.nominal.cells)
        self.judge = self.kind.judge(
            JudgeContext(
                preset=self.preset,
                local_dir=self.local_dir,
                date=record.date,
                emit=self.emit,
                cells=self.cells,
                progress=self._consumers,
            )
        )
        self.sched = Scheduler(placement, self.slots, self.judge, self.local_dir, self._emit_at)
        self._recorder: Recorder | None = None
        self._made_local = False
        self._cancelling = False
        self._advancing = asyncio.Lock()
        self._ending = Ending("done")  # a run on one host ends as its batch did
        # How far launch() got: "" (not begun), "connecting", "uploading", "starting" (the
        # launcher was asked; the run may be going), "started".
        self.stage = ""
        # The consumer says it is behind (the console's buffer is full): wait before reading
        # more, so a backlog of any size flows through in bounded steps.
        self.pressure: Callable[[], bool] | None = None

    # -- the one path of every event ---------------------------------------------------------

    def _fold(self, event: Event) -> None:
        slot = self.slots.get(event.host) if self.fleet else next(iter(self.slots.values()))
        if isinstance(event, HostAssigned) and slot is not None:
            self._add_member(slot, event)
        member = slot.active if slot is not None else None
        if member is not None and not member.ended:
            member.follower.fold(event)
            if isinstance(event, LockAcquired):
                member.started = True
            elif isinstance(event, CellRequeued):
                member.requeued.add(event.cell)
            elif isinstance(event, HostState) and event.state not in (RUNNING, CONNECTING):
                member.ended = True
        if slot is not None and isinstance(event, HostState):
            slot.state, slot.message = event.state, event.message
        self.judge.fold(event)
        if isinstance(event, RunFinished):
            self.finished = event

    def emit(self, event: Event) -> None:
        if self._recorder is not None:
            self._recorder(event)
        self._fold(event)
        self._consumers(event)

    def _emit_at(self, slot: Slot | None, event: Event) -> None:
        """An event of a host's part: it carries its host, in a fleet."""
        if self.fleet and slot is not None:
            event.host = slot.place.spec
        self.emit(event)

    async def _advance(self) -> None:
        """The judge judges for every host, one host at a time (no pair judged twice)."""
        async with self._advancing:
            await self.judge.advance()

    def _member(self, slot: Slot, plan: RunPlan, judge_python: str = "") -> Member:
        member = Member(
            slot.place,
            slot.target,
            plan,
            self.placement.launcher(slot.place, slot.target),
            self.judge,
            self.local_dir,
            lambda e: self._emit_at(slot, e),
            progress=self._consumers,
            advance=self._advance,
            attempts=self.attempts,
            pressure=lambda: self.pressure is not None and self.pressure(),
        )
        self._member_judging(member, judge_python)
        slot.members.append(member)
        return member

    def _add_member(self, slot: Slot, event: HostAssigned) -> None:
        if any(m.plan.run_id == event.member for m in slot.members):
            return  # started by this console: already there
        plan = self.placement.plan(
            run_id=self.record.run_id,
            run_dir=event.run_dir,
            workdir=event.workdir,
            python=event.python,
            date=self.record.date,
            lock=event.lock,
            cells=list(event.cells),
            marker=event.member,
        )
        self._member(slot, plan, event.judge_python)

    # -- creating and launching ----------------------------------------------------------------

    @classmethod
    def create(
        cls, preset: Preset, target_spec: str, out_dir: Path, emit: Callable[[Event], None]
    ) -> Run:
        run = cls(new_record(placement := decide(preset, target_spec), out_dir), placement, emit)
        run.by_id = by_id_link(out_dir, run.record.run_id)
        return run

    async def launch(self) -> None:
        """Record the run; on one host connect, upload the plan, take the lock and start it
        detached (a fleet's hosts each start their part as they follow).

        A launch refused by the lock leaves no directory behind, here or on the target: nothing
        ran, there is nothing to see; nor does one that never reached the target. (A launch that
        failed while uploading keeps its record, which says why it never started.)
        """
        try:
            await self._launch()
        except LockBusyError:
            await self._discard(remote=True)
            raise
        except NotStartedError:
            raise  # its record says why it never started
        except BaseException:
            if self.stage == "connecting":  # the target was not reached: nothing was written
                await self._discard(remote=False)
            raise

    async def abandon(self) -> None:
        """Remove what was made for a launch that never began (an interrupt came first)."""
        await self._discard(remote=False)
        await self.close()

    async def _discard(self, remote: bool) -> None:
        """Remove what this launch made: the local directory, its by-id link, and (remote) the
        run's directory on the target. Only ever this run's own fresh directories."""
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        if self.by_id is not None and self.by_id.is_symlink():
            self.by_id.unlink()
        local = self.local_dir
        if self._made_local:
            shutil.rmtree(local, ignore_errors=True)
            with contextlib.suppress(OSError):
                local.parent.rmdir()  # the date directory, when this run was its only one
        else:  # a directory that was there before: only the files this launch wrote
            for name in (RUN_JSON, EVENTS, RECORD_LOCK, "plan.json"):
                with contextlib.suppress(OSError):
                    (local / name).unlink()
        run_dir = self.record.remote_dir
        if remote and run_dir.endswith("/" + self.record.run_id):
            with contextlib.suppress(TargetError):
                await self.slots[self.placement.hosts[0].spec].target.run(
                    f"rm -rf -- {shlex.quote(run_dir)}"
                )

    def _open_record(self, plan: RunPlan) -> None:
        self.record.save()
        if self.by_id is not None:
            with contextlib.suppress(OSError):  # a convenience: find_run also scans the out dir
                link_by_id(self.by_id, self.local_dir)
        self._recorder = Recorder(self.local_dir)
        doc = plan_document(plan, self.preset)
        (self.local_dir / "plan.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))

    async def _launch(self) -> None:
        self.stage = "connecting"
        self._made_local = not self.local_dir.exists()
        self.local_dir.mkdir(parents=True, exist_ok=True)
        if self.fleet:
            self._open_record(self.nominal)
            self.emit(self._run_started(self.nominal, self._notes()))
            self.stage = "started"
            return
        slot = next(iter(self.slots.values()))
        await slot.target.connect()
        workdir, runs, python = await self._dirs(slot)
        self.sched.take(slot)  # one host: everything at once
        plan = self.placement.plan(
            run_id=self.record.run_id,
            run_dir=f"{runs}/{self.record.run_id}",
            workdir=workdir,
            python=python,
            date=self.record.date,
            lock=self.record.lock,
        )
        member = self._member(slot, plan)
        self.record.remote_dir = plan.run_dir
        self.record.extra = {"workdir": workdir, "python": python, "judge_on": "console"}
        self.stage = "uploading"
        self._open_record(plan)
        await member.upload(self.preset, self._holder())
        judge_python, note = await self._place_judging(member)
        if judge_python:
            self.record.extra.update(judge_on="host", judge_python=judge_python)
            self._member_judging(member, judge_python)
        self.record.save()
        self.emit(self._run_started(plan, self._notes() or ([note] if note else [])))
        version = await self._engine_version(slot.target, workdir, python)
        if version is not None:
            self.emit(version)
        self.stage = "starting"
        try:
            started = await member.start()
        except LockBusyError as error:
            self.emit(LockBusy(lock=plan.lock, holder=error.holder))
            summary = {"error": str(error)}
            self.emit(RunFinished(verdict="LOCK_BUSY", exit_code=EXIT_INFRA, summary=summary))
            raise
        except NotStartedError as error:
            self.emit(Error(message=str(error), where=plan.run_dir))
            summary = {"error": str(error)}
            self.emit(RunFinished(verdict="NOT_STARTED", exit_code=EXIT_INFRA, summary=summary))
            raise
        self.stage = "started"
        self._started(slot, member, started)

    def _started(self, slot: Slot, member: Member, started: Started) -> None:
        for event in started.events or (
            LockAcquired(lock=member.plan.lock, holder=started.holder),
        ):
            self._emit_at(slot, event)
        member.started = True

    async def _start_batch(self, slot: Slot, groups: list[list[int]]) -> Member | None:
        """A fleet host's next batch, uploaded and started under the host's lock; None (the
        groups back in the queue) when the host cannot take it now."""
        cells = sorted(c for g in groups for c in g)
        if not slot.state:
            self.sched.set_state(slot, CONNECTING)
        if not await self._connect(slot):
            self.sched.give_back(groups)
            return None
        try:
            workdir, runs, python = await self._dirs(slot)
            if slot.waited and not await self.sched.lock_free(slot):
                self.sched.give_back(groups)
                return None
            name = f"{slot.place.slug}-{len(slot.members) + 1}"
            plan = self.placement.plan(
                run_id=self.record.run_id,
                run_dir=f"{runs}/{self.record.run_id}/{name}",
                workdir=workdir,
                python=python,
                date=self.record.date,
                lock=slot.place.lock,
                cells=cells,
                marker=f"{self.record.run_id}@{name}",
            )
            member = self._member(slot, plan)
            judge_python, note = await self._place_judging(member)
            if note and not judge_python:
                text = f"{slot.place.spec}: {note}"
                self._emit_at(
                    slot, Error(message=text, where=slot.place.spec, affects_verdict=False)
                )
            assigned = HostAssigned(
                member=plan.run_id, cells=cells, run_dir=plan.run_dir, lock=plan.lock,
                workdir=workdir, python=python, judge_python=judge_python,
            )  # fmt: skip
            self._emit_at(slot, assigned)
            self._save_member(slot, assigned)
            self._member_judging(member, judge_python)
            holder = {**self._holder(), "member": plan.run_id, "host": slot.place.spec}
            await member.upload(self.preset, holder)
            started = await member.start()
        except LockBusyError as error:
            self.sched.give_back(groups)
            self.sched.busy(slot, error, self.record.run_id)
            return None
        except ConnectionLost as exc:
            self.sched.give_back(groups)
            if slot.active is not None:
                slot.active.ended = True
            said = await reconnect(
                slot.target, self.attempts, lambda e: self._emit_at(slot, e), str(exc)
            )
            if said is None:
                self.sched.set_state(slot, IDLE, "reconnected; the batch goes back to the queue")
            else:
                self.sched.lose(slot, said, self.attempts)
            return None
        except (NotStartedError, TargetError, OSError) as exc:
            self.sched.give_back(groups)
            if slot.active is not None:
                slot.active.ended = True
            self.sched.fail(slot, str(exc))
            return None
        self._started(slot, member, started)
        self.sched.set_state(slot, RUNNING, f"cells {', '.join(str(c + 1) for c in cells)}")
        return member

    def _member_judging(self, member: Member, judge_python: str) -> None:
        """The batch's cells are judged on its host, with that python."""
        if judge_python:
            remote = member.remote_judge(judge_python, self.local_dir)
            self.judge.ctx.hosts.update({c.index: remote for c in member.plan.cells})

    def _save_member(self, slot: Slot, event: HostAssigned) -> None:
        members = self.record.extra.setdefault(FLEET, {}).setdefault("members", [])
        keys = ("member", "cells", "run_dir", "lock", "workdir", "python", "judge_python")
        members.append({"host": slot.place.spec, **{k: getattr(event, k) for k in keys}})
        self.record.save()

    async def _dirs(self, slot: Slot) -> tuple[str, str, str]:
        if slot.dirs is None:
            tgt = self.preset.section("target")
            workdir = await resolve_dir(slot.target, tgt["workdir"], "target.workdir")
            runs = await resolve_dir(slot.target, tgt["runs"], "target.runs")
            slot.dirs = (workdir, runs, interpreter(slot.target.name, tgt["python"]))
        return slot.dirs

    async def _place_judging(self, member: Member) -> tuple[str, str]:
        """Judge on the batch's host when the placement says so and its python has what that
        needs: (that python, or "" when judged here; what the run says of it)."""
        judging, spec = self.placement.judging, self.kind.host_judging
        if judging is None or spec is None or judging.where not in (HOST, "host if it can"):
            return "", ""
        got = await member.judge_here(spec, judging.python or member.plan.python, self.local_dir)
        if isinstance(got, str):
            if judging.where == HOST:
                raise TargetError(
                    f"[judge] on = host, but {got}. Install it there, name another python with "
                    f"[judge] python, or set [judge] on = auto"
                )
            return "", f"judged on this console, not on the host: {got}; every artifact is fetched"
        where = member.target.name
        return got.python, (
            f"judged on {where}: what is judged there stays there (`tracedeck fetch "
            f"{self.local_dir}` brings it home)"
        )

    def _notes(self) -> list[str]:
        """Where the run is judged, when the placement says before any host is asked."""
        judging = self.placement.judging
        if judging is None:
            return []
        if self.preset.section("judge")["on"] == "console":
            return ["judged on this console ([judge] on = console): every artifact is fetched"]
        if judging.where == "console":
            return [f"judged on this console: {judging.why}"] if self.fleet else []
        if self.fleet:
            return [
                f"judged on each host whose python can: what is judged there stays there "
                f"(`tracedeck fetch {self.local_dir}` brings it home)"
            ]
        return []

    async def _engine_version(
        self, target: Target, workdir: str, python: str
    ) -> EngineVersion | None:
        """The engine's identity from [engine] version_command, run in the workdir (None when
        the preset has none). A failure is recorded, never fatal: it says nothing of results."""
        template = self.preset.section("engine")["version_command"]
        if not template:
            return None
        values = {**self.preset.section("vars"), "python": python, "workdir": workdir}
        command = render(template, values)
        try:
            done = await target.run(
                f"cd {shlex.quote(workdir)} && {command}", timeout=VERSION_TIMEOUT_S
            )
        except TargetError as exc:
            return EngineVersion(command=command, version="", error=str(exc))
        except TimeoutError:
            why = f"no answer within {VERSION_TIMEOUT_S:g}s"
            return EngineVersion(command=command, version="", error=why)
        first = next((ln.strip() for ln in done.stdout.splitlines() if ln.strip()), "")
        if done.exit_status != 0 or not first:
            tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
            why = f"exit {done.exit_status}: {tail[0][:200]}" if done.exit_status else "no output"
            return EngineVersion(command=command, version=first[:200], error=why)
        return EngineVersion(command=command, version=first[:200])

    def _holder(self) -> dict[str, Any]:
        keys = ("user", "console_host", "run_id", "preset", "started_at")
        return {k: getattr(self.record, k) for k in keys}

    def _run_started(self, plan: RunPlan, notes: list[str]) -> RunStarted:
        runs = self.preset.section("target")["runs"]
        remote = f"{runs}/{self.record.run_id}/HOST-N on each host of {', '.join(self.slots)}"
        return RunStarted(
            run_id=self.record.run_id,
            preset=self.preset.name,
            kind=self.preset.kind,
            target=self.target_name,
            local_dir=str(self.local_dir),
            remote_dir=remote if self.fleet else plan.run_dir,
            cells=[
                {"index": c.index, "params": c.params, "command": c.command} for c in plan.cells
            ],
            profile=self.preset.section("determinism")["profile"],
            env=run_env(self.preset.data),
            notes=notes,
        )

    # -- attaching -----------------------------------------------------------------------------

    @classmethod
    def from_record(cls, local_dir: Path, emit: Callable[[Event], None]) -> Run:
        """A run rebuilt from its record, every batch it started with it; nothing replayed,
        nothing written."""
        record = RunRecord.load(local_dir)
        preset, extra = _preset(record), record.extra
        fleet = extra.get(FLEET)
        if fleet is not None and (
            not isinstance(fleet, dict) or not isinstance(fleet.get("hosts"), list)
        ):
            raise ValueError(f"{record.local_dir}/run.json: extra.fleet.hosts is missing")
        hosts = [str(h) for h in fleet["hosts"]] if fleet else None
        run = cls(record, decide(preset, record.target, hosts=hosts or [], lock=record.lock), emit)
        if fleet is None:
            slot = next(iter(run.slots.values()))
            plan = run.placement.plan(
                run_id=record.run_id,
                run_dir=record.remote_dir,
                workdir=extra["workdir"],
                python=extra["python"],
                date=record.date,
                lock=record.lock,
            )
            host_python = extra["judge_python"] if extra.get("judge_on") == "host" else ""
            run._member(slot, plan, host_python)
            return run
        for m in fleet.get("members") or []:  # every batch ever assigned: cancel reaches it
            slot = run.slots.get(m["host"])
            if slot is not None:
                keys = ("member", "cells", "run_dir", "lock", "workdir", "python")
                values = {k: m[k] for k in keys}
                run._add_member(
                    slot, HostAssigned(**values, judge_python=m.get("judge_python", ""))
                )
        return run

    @classmethod
    def attach(
        cls, local_dir: Path, emit: Callable[[Event], None], replay: Callable[[Event], None]
    ) -> Run:
        """Rebuild a run from its record, as the record's one writer; recorded events go to
        `replay`, new ones to `emit`. RecordBusy when another console writes the record."""
        run = cls.from_record(local_dir, emit)
        recorder = Recorder(local_dir)  # the writer lock first: no two consoles append
        try:
            events_path = Path(local_dir) / EVENTS
            if events_path.exists():
                drop_torn_tail(events_path)
                for event in iter_events(events_path):
                    if isinstance(event, RunFinished) and event.verdict == DISCONNECTED:
                        continue  # the console gave up following; the run itself went on
                    run._fold(event)
                    replay(event)
        except BaseException:
            recorder.close()
            raise
        run._recorder = recorder
        run.sched.rebuild()
        return run

    # -- following -----------------------------------------------------------------------------

    async def follow(self) -> RunFinished:
        """Follow every batch until the run finishes; judge it."""
        if self.finished is not None:
            return self.finished
        if not self.fleet and not await self._connect(next(iter(self.slots.values()))):
            assert self.finished is not None
            return self.finished
        drivers = [
            asyncio.ensure_future(self._drive(s)) for s in self.slots.values() if s.state not in OUT
        ]
        try:
            await asyncio.gather(*drivers)
            if self.finished is None:
                await self._finish()
        except Exception as exc:  # noqa: BLE001 - said, and recorded
            for d in drivers:
                d.cancel()
            await asyncio.gather(*drivers, return_exceptions=True)
            if isinstance(exc, RecordError):
                self._stop_recording(exc)
            else:
                self._following_failed(exc)
        except BaseException:
            for d in drivers:
                d.cancel()
            await asyncio.gather(*drivers, return_exceptions=True)
            raise
        assert self.finished is not None
        return self.finished

    async def _drive(self, slot: Slot) -> None:
        """One host's part: follow its batch (after a launch or an attach), then take batches
        until the queue is empty and no other host's work could come back to it."""
        sched = self.sched
        member = slot.active
        if member is not None and not member.ended and await self._connect(slot):
            await self._follow_member(slot, member)
        while slot.state not in OUT and self.finished is None and not sched.stopping():
            groups = sched.take(slot)
            if not groups:
                if sched.queue or sched.work_may_come(slot):
                    await asyncio.sleep(POLL_S * 5)
                    continue
                break
            slot.batch = groups
            try:
                member = await self._start_batch(slot, groups)
            finally:
                slot.batch = None
            if member is not None:
                if sched.stopping():  # `tracedeck cancel` came while this batch started
                    await member.cancel(CANCEL_GRACE_S)
                await self._follow_member(slot, member)
            elif slot.state == WAITING:
                await asyncio.sleep(WAIT_S)
        if slot.state not in OUT:
            sched.set_state(slot, DONE)

    async def _connect(self, slot: Slot) -> bool:
        """Connect (with the run's reconnect attempts); False when the host is lost."""
        try:
            await slot.target.connect()
            return True
        except ConnectionLost as exc:
            emit = lambda e: self._emit_at(slot, e)  # noqa: E731
            said = await reconnect(slot.target, self.attempts, emit, str(exc))
            if said is None:
                return True
            self._link_lost(slot, said)
            return False
        except TargetError as exc:  # a host key or a login refused: no retry mends it
            if not self.fleet:
                raise
            self.sched.fail(slot, str(exc))
            return False

    def _link_lost(self, slot: Slot, message: str) -> None:
        """Reconnecting failed: a fleet host is lost (its cells go elsewhere); a run on one
        host stops being followed (it goes on there)."""
        if self.fleet:
            self.sched.lose(slot, message, self.attempts)
            return
        text = (
            f"{slot.target.name}: connection lost and {self.attempts} reconnect attempts failed "
            f"({message}). The run goes on on the target; reattach with: "
            f"tracedeck attach {self.local_dir}"
        )
        self.emit(Error(message=text, where=slot.target.name, affects_verdict=False))
        summary = {"error": text, "attach": str(self.local_dir)}
        self.emit(RunFinished(verdict=DISCONNECTED, exit_code=EXIT_INFRA, summary=summary))

    async def _follow_member(self, slot: Slot, member: Member) -> None:
        ending = await member.follow()
        if ending is None:
            self._link_lost(slot, member.lost)
            return
        # A fleet batch that crashed or never started gives its cells back; else each cell
        # without an end of its own ends as the batch did.
        cut = not self.fleet or ending.how not in ("crashed", "not_started")
        left = await member.drain(ending, cut)
        if ending.how == "cancelled":
            self.sched.cancelled = True
        if not cut and ending.how == "crashed":
            self.sched.release(slot, member, "its run on the host ended without finishing")
        elif not cut:
            self.sched.give_back(self.sched.groups_of(left))
        await self._advance()
        self.sched.set_state(slot, FAILED if ending.how == "crashed" else IDLE,
                             "its run ended without finishing" if ending.how == "crashed" else "")  # fmt: skip
        member.ended = True
        self._ending = ending
        if self.fleet and ending.how == "cancelled" and not self._cancelling:
            try:  # cancelled from elsewhere: every other host's batch stops too
                await self._cancel_members(CANCEL_GRACE_S)
            except TargetError as exc:
                self._emit_at(
                    slot, Error(message=str(exc), where=slot.place.spec, affects_verdict=False)
                )

    async def _finish(self) -> None:
        ending = self.sched.ending(self.cells) if self.fleet else self._ending
        await self._advance()
        if self.preset.section("judge")["fetch_held"]:
            for slot in self.slots.values():
                if slot.state not in OUT:
                    for member in slot.members:
                        await member.follower.fetch_held()
        result = await self._judged_end(ending)
        if self.fleet:
            result.summary = {**result.summary, "hosts": self.sched.summary()}
        self.emit(result)

    async def _judged_end(self, ending: Ending) -> RunFinished:
        """The judge's verdict on the run, its documents written (a thread: they may be large);
        NOT_RECORDED (exit 3) when this machine cannot write them."""
        try:
            return await asyncio.to_thread(self.judge.finish, ending)
        except OSError as exc:
            where = exc.filename or self.local_dir
            error = f"cannot write the run's documents in {where}: {exc.strerror}"
            return RunFinished(verdict=NOT_RECORDED, exit_code=EXIT_INFRA, summary={"error": error})

    def _following_failed(self, exc: Exception) -> None:
        """Following or judging raised what nothing expected: the record still gets its end (the
        error, where it came from, how to go on), never a bare traceback and no end."""
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" at {Path(where.filename).name}:{where.lineno}" if where is not None else ""
        message = (
            f"tracedeck failed while following run {self.record.run_id}: "
            f"{type(exc).__name__}{at}: {exc}. The run goes on on {self.target_name}; reattach: "
            f"tracedeck attach {self.local_dir}; cancel: tracedeck cancel {self.local_dir}"
        )
        for event in (
            Error(message=message, where=str(self.local_dir), affects_verdict=False),
            RunFinished(verdict=NOT_JUDGED, exit_code=EXIT_INFRA, summary={"error": message}),
        ):
            if self._recorder is not None:
                self._recorder(event)
            with contextlib.suppress(Exception):  # the judge that failed may fail again
                self._fold(event)
            if isinstance(event, RunFinished):
                self.finished = event
            self._consumers(event)

    def _stop_recording(self, exc: RecordError) -> None:
        """The record cannot be written (a full disk): stop following, say so, never guess."""
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        message = str(exc.strerror or exc)
        for event in (
            Error(message=message, where=str(self.local_dir), affects_verdict=False),
            RunFinished(verdict=NOT_RECORDED, exit_code=EXIT_INFRA, summary={"error": message}),
        ):
            self._fold(event)
            self._consumers(event)

    # -- held artifacts, cancelling, closing ----------------------------------------------------

    def _members(self) -> list[tuple[Slot, Member]]:
        return [(s, m) for s in self.slots.values() for m in s.members]

    async def fetch_held(self) -> int:
        """Bring home every artifact judged on a host and not fetched yet; how many."""
        count = 0
        for slot, member in self._members():
            held = len(member.follower.held_artifacts())
            if held:
                await slot.target.connect()
                await member.follower.fetch_held()
                count += held
        return count

    async def cancel(self, grace_s: float = CANCEL_GRACE_S) -> Cancel:
        """Start nothing more; TERM every batch on every host, KILL after the grace."""
        if self.fleet:
            self.sched.cancelled = True
            (self.local_dir / CANCEL_MARK).touch()
        self._cancelling = True
        try:
            return await self._cancel_members(grace_s)
        finally:
            self._cancelling = False

    async def _cancel_members(self, grace_s: float) -> Cancel:
        """Cancel every batch that may run, on every host at once. A fleet host that cannot be
        reached is named (an error when no host could be)."""

        async def one(slot: Slot, member: Member) -> str | TargetError:
            try:
                return await member.cancel(grace_s)
            except TargetError as exc:
                if not self.fleet:
                    raise
                return TargetError(f"{slot.place.spec}: {exc}")

        jobs = [one(s, m) for s, m in self._members() if not m.ended or m.started]
        said = list(await asyncio.gather(*jobs))
        unreachable = [str(w) for w in said if isinstance(w, TargetError)]
        if unreachable and len(unreachable) == len(said):
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
        for word in (Cancel.STILL_ALIVE, Cancel.KILLED, Cancel.CANCELLED, Cancel.NOT_RUNNING):
            if word in said:
                return word
        return Cancel.SENT

    async def close(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        for slot in self.slots.values():
            await slot.target.close()


async def fetch_held_into(local_dir: Path, emit: Callable[[Event], None]) -> int:
    """Bring home what a run left on its hosts, recorded in its record (as its writer: raises
    RecordBusy while another console follows it); how many files."""
    run = Run.attach(local_dir, emit, replay=lambda event: None)
    try:
        return await run.fetch_held()
    finally:
        await run.close()
