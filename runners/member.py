"""One launched batch on one target: its launcher, its follower and its change notifier.

A member uploads its plan and starts it, follows it to its end (the one follow loop, woken by
the target's notifier, the poll its floor), tells a live batch from a dead one (the one alive
and crash diagnosis), reconnects when the link drops, and drains what is left once it ended,
ending each cell that wrote no end of its own. It never judges: its run owns the verdict.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson

from runners.cells import CellState
from runners.changes import Changes
from runners.events import CellFinished, Connection, Error, Event
from runners.follower import RunFollower
from runners.host_prep import own_dirs, ship_reference
from runners.kind import Ending, HostJudging, Judge
from runners.launchers.base import Launcher, Started
from runners.leftovers import report_leftovers
from runners.placement import Host
from runners.plan import RunPlan, cell_scripts, plan_document
from runners.presets import Preset
from runners.remote_judge import RemoteJudge
from runners.targets.base import ConnectionLost, Target

POLL_S = 0.1
END_GRACE_S = 5.0  # for run.sh to exit once it wrote the run's end
ALIVE_EVERY_S = 2.0


async def reconnect(
    target: Target, attempts: int, emit: Callable[[Event], None], message: str
) -> str | None:
    """Connect again with backoff, saying each try; None once restored, else the last error."""
    emit(Connection(state="lost", message=message))
    delay = 0.5
    for attempt in range(1, attempts + 1):
        await asyncio.sleep(delay)
        delay = min(delay * 2, 8.0)
        emit(Connection(state="retrying", message=message, attempt=attempt))
        try:
            await target.close()
            await target.connect()
        except ConnectionLost as exc:
            message = str(exc)
            continue
        emit(Connection(state="restored", message="following resumes", attempt=attempt))
        return None
    return message


class Member:
    """One batch of cells on one host, from its upload to its last line."""

    def __init__(  # noqa: PLR0913 - the batch, where it runs, and the run's hands
        self,
        host: Host,
        target: Target,
        plan: RunPlan,
        launcher: Launcher,
        judge: Judge,
        local_dir: Path,
        emit: Callable[[Event], None],
        *,
        progress: Callable[[Event], None],
        advance: Callable[[], Awaitable[None]],
        attempts: int,
        pressure: Callable[[], bool],
    ) -> None:
        self.host, self.target, self.plan, self.launcher = host, target, plan, launcher
        self.emit, self.local_dir = emit, local_dir
        self.attempts = attempts
        self.pressure = pressure
        self.label = host.spec if host.slug else target.name  # how errors name where it runs
        self.follower = RunFollower(
            target,
            plan,
            judge,
            local_dir,
            emit,
            progress=progress,
            progress_files=launcher.progress_files(plan),
            advance=advance,
        )
        self.changes = Changes(target, plan.python, plan.run_id)
        self.started = False  # the lock was taken and the batch started
        self.ended = False
        self.requeued: set[int] = set()
        self.cancelling = False
        self.lost = ""  # why the link was given up, once reconnecting failed

    # -- starting ------------------------------------------------------------------------------

    async def upload(self, preset: Preset, holder: dict[str, Any]) -> None:
        plan = self.plan
        await own_dirs(self.target, plan.run_dir, parents=1 if self.host.slug else 0)
        plan_json = orjson.dumps(plan_document(plan, preset), option=orjson.OPT_INDENT_2)
        files = {
            **cell_scripts(plan),
            **self.launcher.files(plan, holder),
            "plan.json": plan_json.decode(),
        }
        for rel, text in files.items():
            await self.target.write_file(f"{plan.run_dir}/{rel}", text.encode())
        if preset.section("engine")["ship_reference"]:
            await ship_reference(self.target, f"{plan.run_dir}/pkg")

    async def judge_here(
        self, spec: HostJudging, python: str, local_dir: Path
    ) -> RemoteJudge | str:
        """The host's judge when its python can run the kind's judging, else why it cannot."""
        remote = self.remote_judge(python, local_dir)
        await remote.ship(spec)
        why = await remote.unusable(spec, spec.entry)
        return remote if why is None else why

    def remote_judge(self, python: str, local_dir: Path) -> RemoteJudge:
        plan = self.plan
        return RemoteJudge(self.target, python, f"{plan.run_dir}/judge", plan.artifacts, local_dir)

    async def start(self) -> Started:
        return await self.launcher.start(self.plan)

    # -- following -----------------------------------------------------------------------------

    async def follow(self) -> Ending | None:
        """Follow until the batch ends, and say how; None when the link was lost for good."""
        loop = asyncio.get_running_loop()
        last_alive = 0.0
        await self.changes.start()
        try:
            while True:
                if self.pressure():
                    await asyncio.sleep(POLL_S / 2)
                    continue
                try:
                    if await self.follower.poll() and await self._over():
                        return self._ended()
                    if loop.time() - last_alive >= ALIVE_EVERY_S:
                        last_alive = loop.time()
                        ending = await self.diagnose()
                        if ending is not None:
                            return ending
                except ConnectionLost as exc:
                    said = await reconnect(self.target, self.attempts, self.emit, str(exc))
                    if said is not None:
                        self.lost = said
                        return None
                    await self.changes.start()
                    continue
                if self.follower.behind:
                    await asyncio.sleep(0)  # a backlog is read step after step
                else:  # woken by the target, or at the poll at the latest
                    self.changes.watch(self.follower.watched())
                    await self.changes.wait(POLL_S)
        finally:
            await self.changes.close()

    async def _over(self) -> bool:
        """The run's end was read: is it over? run.sh writes its end last and exits; a 'done'
        while it still runs after END_GRACE_S is the engine's (it shares the directory): said,
        never believed, and the run is followed on to its real end."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + END_GRACE_S
        while await self.launcher.runner_alive(self.plan):
            if loop.time() >= deadline:
                self.follower.ended = self.follower.cancelled = False
                self.follower.forged_end()
                return False
            await asyncio.sleep(POLL_S)
        return True

    def _ended(self) -> Ending:
        return Ending("cancelled" if self.follower.cancelled else "done")

    async def diagnose(self) -> Ending | None:
        """None while the batch lives; else how it ended, its launcher's word first."""
        plan, follower = self.plan, self.follower
        for event in await self.launcher.watch(plan):
            self.emit(event)
        if self.cancelling or await self.launcher.alive(plan):
            return None  # a cancel in flight writes its own "cancelled" line once all died
        if await follower.poll():  # "done" written just before the last process exited
            return self._ended()
        outcome = await self.launcher.outcome(plan, follower)
        if outcome is not None:
            for event in await self.launcher.watch(plan):
                self.emit(event)
            await follower.drain_started()
            for finished in outcome.cells:
                self.emit(finished)
            return outcome.ending
        fleet = bool(self.host.slug)  # a fleet batch's cells go elsewhere: never a verdict
        if await self.target.read_from(f"{plan.run_dir}/pgid", 0, 64) is None:
            message = (
                f"{self.label}: the run never started: {plan.run_dir} holds its plan but no "
                f"process group (the console stopped during the launch); nothing ran, no lock "
                f"is held; start it again"
            )
            self.emit(Error(message=message, where=plan.run_dir, affects_verdict=not fleet))
            return Ending("not_started", message)
        if await self.target.read_from(f"{plan.run_dir}/cancel", 0, 0) is not None:
            for _ in range(50):  # its script records the cancel once every process died
                if await follower.poll():
                    break
                await asyncio.sleep(POLL_S)
            return Ending("cancelled")
        tail = await follower.tail(f"{plan.run_dir}/runner.err")
        message = (
            f"{self.label}: the run in {plan.run_dir} ended without finishing (remote crash "
            f"or killed outside tracedeck); runner.err: {tail}"
        )
        self.emit(Error(message=message, where=plan.run_dir, affects_verdict=not fleet))
        return Ending("crashed")

    async def drain(self, ending: Ending, cut: bool = True) -> list[int]:
        """Every line left, then (cut) an end for each cell that wrote none: cancelled, skipped
        (after a failed setup, or never started) or lost. Returns the cells left without one."""
        follower = self.follower
        await follower.drain_started()
        await follower.drain_rest()
        left = [i for i, t in follower.cells.items() if not t.finished and i not in self.requeued]
        for index in left if cut else []:
            if ending.how == "cancelled":
                state = CellState.CANCELLED
            elif follower.setup_failed or ending.how == "not_started":
                state = CellState.SKIPPED
            else:
                state = CellState.LOST
            self.emit(CellFinished(cell=index, state=state, exit_code=None, duration_s=None))
        for path in follower.never_appeared():
            self.emit(
                Error(
                    message=f"trace file {self.label}:{path} never appeared: the engine wrote "
                    "no trace there (check [traces] follow and the engine's trace path)",
                    where=path,
                )
            )
        await report_leftovers(self.target, self.launcher, self.plan, self.local_dir, self.emit)
        return [] if cut else left

    async def cancel(self, grace_s: float) -> str:
        """TERM the batch's processes, KILL after the grace; the launcher's word."""
        await self.target.connect()
        self.cancelling = True
        try:
            return await self.launcher.cancel(self.plan, grace_s)
        finally:
            self.cancelling = False
