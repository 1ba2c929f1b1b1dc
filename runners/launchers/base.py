"""The launch protocol every launcher implements; the session knows launchers only by this."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from runners.events import CellFinished, Event
from runners.plan import RunPlan
from runners.targets.base import Target, TargetError

if TYPE_CHECKING:
    from runners.follower import RunFollower
    from runners.kind import Ending

HOLDER_KEYS = ("run_id", "user", "console_host", "preset", "started_at", "pgid")


class Cancel(StrEnum):
    """What a cancel did (the launchers' words)."""

    CANCELLED = "TRACEDECK_CANCELLED"
    KILLED = "TRACEDECK_KILLED"
    STILL_ALIVE = "TRACEDECK_STILL_ALIVE"
    NOT_RUNNING = "TRACEDECK_NOT_RUNNING"
    SENT = ""  # the launcher said nothing


class LockBusyError(TargetError):
    """The host's lock is held by another run; `holder` says whose."""

    def __init__(self, lock: str, holder: dict[str, Any], target: str) -> None:
        self.lock = lock
        self.holder = holder
        who = ", ".join(f"{k}={holder.get(k)}" for k in HOLDER_KEYS)
        super().__init__(
            f"{target}: lock {lock} is held ({who or 'holder unknown'}); wait for that run to "
            f"end, or ask its owner to `tracedeck cancel` it"
        )


class NotStartedError(TargetError):
    """The launcher could not start the run (nothing of it runs on the target)."""


@dataclass(frozen=True, slots=True)
class Started:
    """A run is going on the target: its holder record (with the process group, when it has one).

    events: what to say instead of "lock acquired" when the launcher took no lock at the start
    (a batch scheduler: each task takes its node's lock when it runs)."""

    holder: dict[str, Any]
    events: tuple[Event, ...] = ()


@dataclass(slots=True)
class Outcome:
    """How a run the launcher watched ended: the ending, and the cells it ended for them."""

    ending: Ending
    cells: list[CellFinished] = field(default_factory=list)


class Launcher(Protocol):
    """Starts a planned run under the host lock, tells whether it is alive, and cancels it."""

    target: Target

    def files(self, plan: RunPlan, holder: dict[str, Any]) -> dict[str, str]:
        """The launcher's own scripts (path relative to the run dir -> text) to upload."""
        ...

    async def start(self, plan: RunPlan) -> Started:
        """Start the uploaded run detached; LockBusyError when the lock is held."""
        ...

    async def alive(self, plan: RunPlan) -> bool:
        """Does any process of the run still live (zombies do not count)?"""
        ...

    async def runner_alive(self, plan: RunPlan) -> bool:
        """Does what writes the run's end still run (run.sh; a scheduler's tasks)?"""
        ...

    async def cancel(self, plan: RunPlan, grace_s: float) -> str:
        """TERM the run's processes, KILL after the grace; returns the outcome word."""
        ...

    def progress_files(self, plan: RunPlan) -> list[str]:
        """The files the launcher's scripts write each cell's start and end to."""
        ...

    async def watch(self, plan: RunPlan) -> list[Event]:
        """What changed since the last call that the launcher alone knows (a scheduler's state
        of each cell); called every few seconds while the run goes on."""
        ...

    async def outcome(self, plan: RunPlan, follower: RunFollower) -> Outcome | None:
        """Once alive() says no process of the run is left: how it ended, when the launcher
        knows better than the run's own files (a scheduler that killed cells); None: the
        session judges the ending from the files, as for a detached run."""
        ...
