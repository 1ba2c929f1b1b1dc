"""Which host runs which cells. One queue of groups (the cells a kind compares with each other,
such as a B3.67 seed's prefill and decode, stay on one host unless `fleet.together = false`);
a free host takes a fair share. One host is a queue that gives everything at once. In a fleet a
busy host is skipped or waited for (`fleet.busy`); a host lost for good gives its unfinished
cells back to the queue (`fleet.requeue`), or they are lost; each host's state is an event.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runners.cells import SETUP_CELL, CellState, cell_name
from runners.events import CellFinished, CellRequeued, Error, Event, HostState, LockBusy
from runners.kind import Ending, Judge
from runners.launchers.base import Cancel, LockBusyError
from runners.launchers.detached import holder_text, lock_state
from runners.member import Member
from runners.placement import Host, Placement
from runners.plan import PlannedCell
from runners.record import FLEET
from runners.targets.base import Target, TargetError

CANCEL_MARK = "cancel"  # in the local run directory: `tracedeck cancel` asked; start nothing more
# HostState words
CONNECTING, WAITING, SKIPPED, RUNNING = "connecting", "waiting", "skipped", "running"
IDLE, DONE, LOST, FAILED = "idle", "done", "lost", "failed"
OUT = (LOST, FAILED, SKIPPED)  # a host in one of these states takes no more cells this run


@dataclass(slots=True)
class Slot:
    """One host of the run: its target, the batches it ran, its state."""

    place: Host
    target: Target
    members: list[Member] = field(default_factory=list)
    state: str = ""
    message: str = ""
    dirs: tuple[str, str, str] | None = None  # workdir, runs, python once resolved
    batch: list[list[int]] | None = None  # groups taken, not yet started
    waited: bool = False

    @property
    def active(self) -> Member | None:
        return self.members[-1] if self.members else None


class Scheduler:
    def __init__(
        self,
        placement: Placement,
        slots: dict[str, Slot],
        judge: Judge,
        local_dir: Path,
        emit: Callable[[Slot | None, Event], None],
    ) -> None:
        self.fleet = placement.fleet
        self.settings = placement.preset.section(FLEET)
        self.slots, self.judge, self.local_dir, self._emit = slots, judge, local_dir, emit
        self.groups = [list(g) for g in placement.groups]
        self.queue = [list(g) for g in self.groups]
        self.cancelled = False

    def stopping(self) -> bool:
        if self.fleet and not self.cancelled and (self.local_dir / CANCEL_MARK).exists():
            self.cancelled = True
        return self.cancelled

    def usable(self, but: Slot | None = None) -> list[Slot]:
        return [s for s in self.slots.values() if s is not but and s.state not in OUT]

    def take(self, slot: Slot) -> list[list[int]]:
        """A fair share of the queue for a free host: the queue over the hosts with no work in
        hand (this one included)."""
        if not self.queue:
            return []
        free = [
            s
            for s in self.usable()
            if s.batch is None and (s.active is None or s.active.ended or s is slot)
        ]
        share = math.ceil(len(self.queue) / max(1, len(free)))
        taken, self.queue = self.queue[:share], self.queue[share:]
        return taken

    def give_back(self, groups: list[list[int]]) -> None:
        self.queue = [list(g) for g in groups] + self.queue

    def groups_of(self, cells: list[int]) -> list[list[int]]:
        return [g for g in self.groups if set(g) & set(cells)]

    def rebuild(self) -> None:
        """After a replay: the groups with a cell neither finished nor in a running batch."""
        running = {
            c.index for s in self.slots.values() for m in s.members if not m.ended
            for c in m.plan.cells
        }  # fmt: skip
        done = {c for c in self.judge.finished if c >= 0}
        self.queue = [
            list(g) for g in self.groups if any(c not in done for c in g) and not set(g) & running
        ]

    def work_may_come(self, slot: Slot) -> bool:
        """Can cells still come back to the queue (a batch runs that could be lost)?"""
        others = [s for s in self.slots.values() if s is not slot]
        return any(
            s.active is not None and not s.active.ended and s.active.started for s in others
        ) or any(s.batch is not None for s in others)

    # -- a fleet host's life ---------------------------------------------------------------------

    def set_state(self, slot: Slot, state: str, message: str = "") -> None:
        if self.fleet and (slot.state != state or slot.message != message):
            self._emit(slot, HostState(state=state, message=message))

    def fail(self, slot: Slot, message: str) -> None:
        """A host that cannot take cells this run; its cells go to the others. Not a verdict:
        a run whose cells all ran elsewhere passes, one whose cells no host could take ends
        HOST_LOST (exit 3)."""
        spec = slot.place.spec
        self._emit(slot, Error(message=f"{spec}: {message}", where=spec, affects_verdict=False))
        self.set_state(slot, FAILED, message)

    def lose(self, slot: Slot, message: str, attempts: int) -> None:
        member, spec = slot.active, slot.place.spec
        running = member is not None and not member.ended and member.started
        tail = (
            f"; its run there may go on (it holds that host's lock until it ends): "
            f"`tracedeck cancel {self.local_dir}` stops it once the host is reachable"
            if running
            else ""
        )
        text = f"{spec}: lost ({attempts} reconnect attempts failed: {message}){tail}"
        self._emit(slot, Error(message=text, where=spec, affects_verdict=False))
        if member is not None and not member.ended:
            if member.started:
                self.release(slot, member, f"{spec} was lost")
            else:
                member.ended = True
        self.set_state(slot, LOST, message)

    def release(self, slot: Slot, member: Member, reason: str) -> None:
        """The unfinished cells of a batch that will not finish: back to the queue (whole
        groups) when requeue is allowed and another host can take them, else lost."""
        tracks = member.follower.cells
        left = {i for i, t in tracks.items() if i >= 0 and not t.finished} - member.requeued
        groups = self.groups_of(sorted(left))
        others = self.usable(but=slot)
        if self.settings["requeue"] and others and not self.stopping():
            names = ", ".join(s.place.spec for s in others)
            for cell in (c for g in groups for c in g):
                self._emit(slot, CellRequeued(cell=cell, reason=f"{reason}; runs again on {names}"))
            self.give_back(groups)
        else:
            why = reason + ("" if self.settings["requeue"] else " (fleet.requeue is off)")
            if self.settings["requeue"] and not others:
                why += " and no other host can take its cells"
            for cell in sorted(left):
                lost = CellFinished(
                    cell=cell, state=CellState.LOST, exit_code=None, duration_s=None,
                    stderr_tail=why,
                )  # fmt: skip
                self._emit(slot, lost)
        setup = tracks.get(SETUP_CELL)
        if setup is not None and setup.started is not None and not setup.finished:
            lost = CellFinished(
                cell=SETUP_CELL, state=CellState.LOST, exit_code=None, duration_s=None
            )
            self._emit(slot, lost)
        member.ended = True

    def busy(self, slot: Slot, error: LockBusyError, run_id: str) -> None:
        member, spec = slot.active, slot.place.spec
        if member is not None:
            member.ended = True
        self._emit(slot, LockBusy(lock=error.lock, holder=error.holder))
        if error.holder.get("run_id") == run_id:
            text = (
                f"{spec}: its lock {error.lock} is held by this same run on another host of the "
                "fleet: both hosts share that lock file (the same machine listed twice, or a "
                "lock on a shared filesystem). Give each host its own lock ([hosts.NAME] lock "
                "in the config) to run both at once"
            )
            self._emit(slot, Error(message=text, where=spec, affects_verdict=False))
        if self.settings["busy"] == "wait":
            slot.waited = True
            self.set_state(slot, WAITING, f"lock {error.lock} held by {holder_text(error.holder)}")
        else:
            self.set_state(slot, SKIPPED, f"lock {error.lock} held by {holder_text(error.holder)}")

    async def lock_free(self, slot: Slot) -> bool:
        """A waiting host: is its lock free now? (Says who holds it while it is not.)"""
        state, holder, _ = await lock_state(slot.target, slot.place.lock)
        if state != "held":
            return True
        self.set_state(slot, WAITING, f"lock {slot.place.lock} held by {holder_text(holder)}")
        return False

    async def cancel_all(self, grace_s: float) -> Cancel:
        """Cancel every batch that may run, on every host at once. A fleet host that cannot be
        reached is named (an error when no host could be)."""

        async def one(slot: Slot, member: Member) -> str | TargetError:
            try:
                return await member.cancel(grace_s)
            except TargetError as exc:
                if not self.fleet:
                    raise
                return TargetError(f"{slot.place.spec}: {exc}")

        jobs = [
            one(s, m) for s in self.slots.values() for m in s.members if not m.ended or m.started
        ]
        said = await asyncio.gather(*jobs)
        unreachable = [str(w) for w in said if isinstance(w, TargetError)]
        if unreachable and len(unreachable) == len(said):
            raise TargetError("; ".join(unreachable))
        for text in unreachable:
            message = (
                f"cancel could not reach {text}; its batch goes on there until it ends: cancel "
                "again once the host is reachable"
            )
            self._emit(
                None, Error(message=message, where=text.split(":", 1)[0], affects_verdict=False)
            )
        for word in (Cancel.STILL_ALIVE, Cancel.KILLED, Cancel.CANCELLED, Cancel.NOT_RUNNING):
            if word in said:
                return word
        return Cancel.SENT

    # -- the end of a fleet run ------------------------------------------------------------------

    def ending(self, cells: list[PlannedCell]) -> Ending:
        """How a fleet run ended; the cells no host ran end skipped (or cancelled)."""
        cancelled = self.stopping()
        finished = self.judge.finished
        left = [c for c in cells if c.index not in finished]
        busy = [s for s in self.slots.values() if s.state in (SKIPPED, WAITING)]
        gone = [s for s in self.slots.values() if s.state in (LOST, FAILED)]
        why = ""
        if left and not cancelled and busy:
            why = "every host that could take them was busy: " + "; ".join(
                f"{s.place.spec}: {s.message}" for s in busy
            )
        elif left and not cancelled:
            why = "no host could take them: " + "; ".join(
                f"{s.place.spec} {s.state} ({s.message})" for s in gone
            )
        for cell in left:
            state = CellState.CANCELLED if cancelled else CellState.SKIPPED
            tail = "" if cancelled else f"never ran: {why}"
            end = CellFinished(
                cell=cell.index, state=state, exit_code=None, duration_s=None, stderr_tail=tail
            )
            self._emit(None, end)
        params = {c.index: c.params for c in cells}
        lost = [
            cell_name(e.cell, params.get(e.cell, {}), len(cells))
            for e in self.judge.finished.values()
            if e.cell >= 0 and e.state == CellState.LOST
        ]
        if cancelled:
            return Ending("cancelled")
        if lost:
            return Ending("host_lost", f"cells lost with their host: {', '.join(lost)}")
        if left:
            return Ending(
                "lock_busy" if busy else "host_lost", f"{len(left)} cells never ran: {why}"
            )
        return Ending("done")

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for spec, s in self.slots.items():
            ran = sorted(
                e.cell for e in self.judge.finished.values() if e.host == spec and e.cell >= 0
            )
            out[spec] = {"state": s.state, "cells": ran, "message": s.message}
        return out
