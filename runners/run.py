"""A run's life on one host or a fleet: its batches launched under each host's lock
(runners.start), followed to the end, the run judged, cancelled, closed; attach rebuilds one
from its record and replays it.

A Run is a RunCore (runners.run_core: its record, judge and the one path every event takes)
with a life. Its placement is decided once (runners.placement); each batch is a Member; the
Scheduler says which host takes which cells. Every event of a fleet host's part carries its host.
"""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runners import kinds, start
from runners.events import (
    Error,
    Event,
    HostAssigned,
    RunFinished,
)
from runners.exits import EXIT_INFRA, NOT_ENDINGS, NOT_JUDGED, NOT_RECORDED
from runners.launchers.base import Cancel
from runners.local_run import by_id_link, new_record, recorded_preset
from runners.member import POLL_S, Member
from runners.placement import decide
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
from runners.run_core import RunCore
from runners.scheduler import (
    CANCEL_MARK,
    DONE,
    FAILED,
    IDLE,
    OUT,
    WAITING,
    Slot,
)
from runners.targets.base import TargetError

CANCEL_GRACE_S = 5.0
WAIT_S = 2.0  # between looks at a busy host's lock (fleet.busy = "wait")


class Run(RunCore):
    """Drives one run (one host, or a fleet's hosts) and turns what happens into events."""

    # -- creating, launching, attaching ----------------------------------------------------------

    @classmethod
    def create(
        cls, preset: Preset, target_spec: str, out_dir: Path, emit: Callable[[Event], None]
    ) -> Run:
        run = cls(new_record(placement := decide(preset, target_spec), out_dir), placement, emit)
        run.by_id = by_id_link(out_dir, run.record.run_id)
        return run

    async def launch(self) -> None:
        await start.launch(self)

    async def abandon(self) -> None:
        """Remove what was made for a launch that never began (an interrupt came first)."""
        await start.discard(self, made_local=False, remote=False)
        await self.close()

    from_record = staticmethod(lambda local_dir, emit: from_record(local_dir, emit))
    attach = staticmethod(lambda local_dir, emit, replay: attach(local_dir, emit, replay))

    # -- following -----------------------------------------------------------------------------

    async def follow(self) -> RunFinished:
        """Follow every batch until the run finishes; judge it."""
        if self.finished is not None:
            return self.finished
        if not self.fleet and not await start.connect(self, self.only):
            assert self.finished is not None
            return self.finished
        slots = [s for s in self.slots.values() if s.state not in OUT]
        drivers = [asyncio.ensure_future(self._drive(s)) for s in slots]
        try:
            await asyncio.gather(*drivers)
            if self.finished is None:
                await self._finish()
        except BaseException as exc:
            for d in drivers:
                d.cancel()
            await asyncio.gather(*drivers, return_exceptions=True)
            if isinstance(exc, RecordError):
                self._unrecorded(exc)
            elif isinstance(exc, Exception):
                self._following_failed(exc)
            else:
                raise
        assert self.finished is not None
        return self.finished

    async def _drive(self, slot: Slot) -> None:
        """One host's part: follow its batch (after a launch or an attach), then take batches
        until the queue is empty and no other host's work could come back to it."""
        sched = self.sched
        member = slot.active
        if member is not None and not member.ended and await start.connect(self, slot):
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
                member = await start.batch(self, slot, groups)
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

    async def _follow_member(self, slot: Slot, member: Member) -> None:
        ending = await member.follow()
        if ending is None:
            start.link_lost(self, slot, member.lost)
            return
        # A fleet batch that crashed or never started gives its cells back; else each cell
        # without an end of its own ends as the batch did.
        crashed, cut = (
            ending.how == "crashed",
            not self.fleet or ending.how not in ("crashed", "not_started"),
        )
        left = await member.drain(ending, cut)
        if ending.how == "cancelled":
            self.sched.cancelled = True
        if not cut and crashed:
            self.sched.release(slot, member, "its run on the host ended without finishing")
        elif not cut:
            self.sched.give_back(self.sched.groups_of(left))
        await self.advance()
        self.sched.set_state(
            slot, *((FAILED, "its run ended without finishing") if crashed else (IDLE, ""))
        )
        member.ended = True
        self._ending = ending
        if self.fleet and ending.how == "cancelled" and not self._cancelling:
            try:  # cancelled from elsewhere: every other host's batch stops too
                await self.sched.cancel_all(CANCEL_GRACE_S)
            except TargetError as exc:
                self.emit_at(
                    slot, Error(message=str(exc), where=slot.place.spec, affects_verdict=False)
                )

    async def _finish(self) -> None:
        ending = self.sched.ending(self.cells) if self.fleet else self._ending
        await self.advance()
        if self.preset.section("judge")["fetch_held"]:
            for slot, member in self._members():
                if slot.state not in OUT:
                    await member.follower.fetch_held()
        try:  # the documents are written in a thread: they may be large
            result = await asyncio.to_thread(self.judge.finish, ending)
        except OSError as exc:
            error = f"cannot write the run's documents in {exc.filename or self.local_dir}: {exc.strerror}"
            result = RunFinished(
                verdict=NOT_RECORDED, exit_code=EXIT_INFRA, summary={"error": error}
            )
        if self.fleet:
            result.summary = {**result.summary, "hosts": self.sched.summary()}
        self.emit(result)

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
        self._end(message, NOT_JUDGED, recorded=True)

    def _unrecorded(self, exc: RecordError) -> None:
        """The record cannot be written (a full disk): stop following, say so, never guess."""
        self.stop_recording()
        self._end(str(exc.strerror or exc), NOT_RECORDED, recorded=False)

    def _end(self, message: str, verdict: str, recorded: bool) -> None:
        for event in (
            Error(message=message, where=str(self.local_dir), affects_verdict=False),
            RunFinished(verdict=verdict, exit_code=EXIT_INFRA, summary={"error": message}),
        ):
            if recorded and self.recorder is not None:
                self.recorder(event)
            with contextlib.suppress(Exception):  # the judge that failed may fail again
                self._fold(event)
            if isinstance(event, RunFinished):
                self.finished = event
            self.consumers(event)

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
            return await self.sched.cancel_all(grace_s)
        finally:
            self._cancelling = False

    async def close(self) -> None:
        self.stop_recording()
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


def from_record(local_dir: Path, emit: Callable[[Event], None]) -> Run:
    """A run rebuilt from its record, every batch it started with it; nothing replayed,
    nothing written."""
    record = RunRecord.load(local_dir)
    preset, extra = recorded_preset(record), record.extra
    fleet = extra.get(FLEET)
    if fleet is not None and not (isinstance(fleet, dict) and isinstance(fleet.get("hosts"), list)):
        raise ValueError(f"{record.local_dir}/run.json: extra.fleet.hosts is missing")
    hosts = [str(h) for h in fleet["hosts"]] if fleet else []
    run = Run(record, decide(preset, record.target, hosts=hosts, lock=record.lock), emit)
    members = fleet.get("members") or [] if fleet is not None else [_only_batch(run)]
    for m in members:  # every batch: cancel reaches each
        slot = run.slots.get(m["host"])
        if slot is not None:
            keys = ("member", "cells", "run_dir", "lock", "workdir", "python")
            event = HostAssigned(**{k: m[k] for k in keys}, judge_python=m.get("judge_python", ""))
            run.assigned(slot, event)
    return run


def _only_batch(run: Run) -> dict[str, Any]:
    """A run on one host's batch as a fleet's record names each of its own: all its cells."""
    record, extra = run.record, run.record.extra
    judged_there = extra.get("judge_on") == "host"
    return {
        "host": run.only.place.spec, "member": record.run_id, "run_dir": record.remote_dir,
        "cells": [c.index for c in run.cells], "lock": record.lock,
        "workdir": extra["workdir"], "python": extra["python"],
        "judge_python": extra["judge_python"] if judged_there else "",
    }  # fmt: skip


def attach(local_dir: Path, emit: Callable[[Event], None], replay: Callable[[Event], None]) -> Run:
    """Rebuild a run from its record, as the record's one writer; recorded events go to
    `replay`, new ones to `emit`. RecordBusy when another console writes the record."""
    run = from_record(local_dir, emit)
    recorder = Recorder(local_dir)  # the writer lock first: no two consoles append
    try:
        events_path = Path(local_dir) / EVENTS
        if events_path.exists():
            drop_torn_tail(events_path)
            for event in iter_events(events_path, kinds.event_types()):
                if isinstance(event, RunFinished) and event.verdict in NOT_ENDINGS:
                    continue  # a console's following ended there; the run itself went on
                run._fold(event)
                replay(event)
    except BaseException:
        recorder.close()
        raise
    run.recorder = recorder
    run.sched.rebuild()
    return run
