"""A run's state and the one path every event takes: its record (the one writer), its
placement, its hosts and their batches, its scheduler and its judge.

Every event is recorded, folded into the batch it belongs to (its place in the files) and the
judge (the verdict state), then handed to the consumers; attach replays the record through the
same fold. runners.start launches and runners.run follows a run through this one state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from runners import kinds
from runners.events import CellRequeued, Event, HostAssigned, HostState, LockAcquired, RunFinished
from runners.kind import Ending, JudgeContext
from runners.member import Member
from runners.placement import Placement
from runners.plan import RunPlan
from runners.record import Recorder, RunRecord
from runners.scheduler import CONNECTING, RUNNING, Scheduler, Slot


class RunCore:
    """A run's state (one host, or a fleet's hosts) and its event path."""

    def __init__(
        self, record: RunRecord, placement: Placement, emit: Callable[[Event], None]
    ) -> None:
        self.record, self.placement, self.preset = record, placement, placement.preset
        self.kind = kinds.get(self.preset.kind)
        self.consumers = emit
        self.local_dir = Path(record.local_dir)
        self.by_id: Path | None = None  # OUT/by-id/RUN_ID, made at launch (Run.create)
        self.finished: RunFinished | None = None
        tgt = self.preset.section("target")
        self.attempts = int(tgt["reconnect_attempts"])
        self.fleet = placement.fleet
        self.slots = {h.spec: Slot(h, placement.connect(h)) for h in placement.hosts}
        self.only = next(iter(self.slots.values()))  # the host of a run on one host
        self.target_name = record.target if self.fleet else self.only.target.name
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
                progress=self.consumers,
            )
        )
        self.sched = Scheduler(placement, self.slots, self.judge, self.local_dir, self.emit_at)
        self.recorder: Recorder | None = None
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
        slot = self.slots.get(event.host) if self.fleet else self.only
        if isinstance(event, HostAssigned) and slot is not None:
            self.assigned(slot, event)
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
        if self.recorder is not None:
            self.recorder(event)
        self._fold(event)
        self.consumers(event)

    def emit_at(self, slot: Slot | None, event: Event) -> None:
        """An event of a host's part: it carries its host, in a fleet."""
        if self.fleet and slot is not None:
            event.host = slot.place.spec
        self.emit(event)

    async def advance(self) -> None:
        """The judge judges for every host, one host at a time (no pair judged twice)."""
        async with self._advancing:
            await self.judge.advance()

    def emitter(self, slot: Slot) -> Callable[[Event], None]:
        """Emit as a host's part (its events carry the host, in a fleet)."""
        return lambda event: self.emit_at(slot, event)

    def new_member(self, slot: Slot, plan: RunPlan, judge_python: str = "") -> Member:
        """A batch of the run on a host (judged there with judge_python when it is set)."""
        made = Member(
            slot.place,
            slot.target,
            plan,
            self.placement.launcher(slot.place, slot.target),
            self.judge,
            self.local_dir,
            self.emitter(slot),
            progress=self.consumers,
            advance=self.advance,
            attempts=self.attempts,
            pressure=lambda: self.pressure is not None and self.pressure(),
        )
        if judge_python:
            remote = made.remote_judge(judge_python, self.local_dir)
            self.judge.ctx.hosts.update({c.index: remote for c in plan.cells})
        slot.members.append(made)
        return made

    def assigned(self, slot: Slot, event: HostAssigned) -> None:
        """The batch a recorded HostAssigned names, on its host (once)."""
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
        self.new_member(slot, plan, event.judge_python)

    def stop_recording(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
