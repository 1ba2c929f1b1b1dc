"""What feeds a run screen: a launched session, a reattached one, or a recorded run replayed.

Feeders only append events to a buffer (a deque); the run screen drains it on a timer.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from runners.events import Error, Event, RunFinished
from runners.kinds import event_types
from runners.record import EVENTS, RUN_JSON, decode_lines, split_lines
from runners.run import Run
from runners.run_view import checked_end, item_words

# A speed at or above this (or 0) replays as fast as the screen can take it.
FAST_SPEED = 1e6
CHUNK = 1000  # lines decoded in one step of the event loop, at most
# ... and bytes: a DSA run's TraceBatch lines carry ~12 KB digests, and 1,000 of them took 58 ms
CHUNK_BYTES = 1 << 20
PRESSURE_WAIT_S = 0.01


@dataclass(slots=True)
class LiveSource:
    """A session that launch() started; `buffer` already holds what the launch emitted."""

    session: Run
    buffer: deque[Event] = field(default_factory=deque)
    mode: str = "LIVE"

    @property
    def kind(self) -> str:
        return self.session.preset.kind


@dataclass(slots=True)
class AttachSource:
    """A run started earlier: its recorded events replayed, then followed on its target."""

    local_dir: Path
    mode: str = "ATTACHED"

    @property
    def kind(self) -> str:
        return recorded_kind(self.local_dir)


@dataclass(slots=True)
class ReplaySource:
    """A recorded run played back at `speed` times real time (0: as fast as possible)."""

    local_dir: Path
    speed: float = 0.0

    @property
    def kind(self) -> str:
        return recorded_kind(self.local_dir)

    @property
    def mode(self) -> str:
        if is_fast(self.speed):
            return "REPLAY"
        return f"REPLAY x{self.speed:g}"


RunSource = LiveSource | AttachSource | ReplaySource


def recorded_kind(local_dir: Path) -> str:
    """The kind run.json names ('' when it cannot be read: the feed reports why)."""
    try:
        data = orjson.loads((Path(local_dir) / RUN_JSON).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return ""
    kind = data.get("kind") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) else ""


def is_fast(speed: float) -> bool:
    return speed <= 0 or speed >= FAST_SPEED


class ReplayClock:
    """Maps wall time to the recorded run's time while a paced replay plays."""

    def __init__(self) -> None:
        self.origin: tuple[float, float] | None = None  # (recorded t, monotonic at that point)
        self.speed = 1.0
        self.end: float | None = None

    def start(self, recorded_t: float, speed: float, end: float) -> None:
        self.origin = (recorded_t, time.monotonic())
        self.speed = speed
        self.end = end

    def now(self) -> float | None:
        if self.origin is None:
            return None
        t0, wall = self.origin
        now = t0 + (time.monotonic() - wall) * self.speed
        return min(now, self.end) if self.end is not None else now


def _chunks(lines: Sequence[Any]) -> Iterator[tuple[int, int]]:
    """(start, end) of each step's lines: CHUNK lines or CHUNK_BYTES, whichever comes first."""
    start, n = 0, len(lines)
    while start < n:
        end, size = start, 0
        while end < n and end - start < CHUNK and size < CHUNK_BYTES:
            size += len(lines[end])
            end += 1
        yield start, end
        start = end


async def replay_events(
    local_dir: Path,
    sink: Callable[[Event], None],
    speed: float,
    clock: ReplayClock | None = None,
    pressure: Callable[[], bool] | None = None,
) -> None:
    """Feed a run's recorded events to `sink`, paced by their recorded times over `speed`.

    Lines are parsed in chunks on the event loop (the collector paused for each chunk), so the
    first events show at once and no thread competes with the screen for the interpreter. While
    `pressure()` says the sink holds enough, no further chunk is parsed (a fast replay of a long
    record would otherwise hold all of it decoded, for every full collection to walk).
    """
    path = Path(local_dir) / EVENTS
    try:
        # split there too: a long record's lines are hundreds of MB to cut
        lines, torn = await asyncio.to_thread(lambda: split_lines(path.read_bytes()))
    except OSError as exc:
        sink(
            Error(
                message=f"{path}: cannot read the recorded events ({exc.strerror or exc}); "
                f"pick a run directory written by `tracedeck run`",
                where=str(path),
            )
        )
        return
    try:  # a recorded pair's (cell's) word its own data contradicts is shown marked
        shown = item_words(local_dir)
    except (OSError, ValueError, KeyError, TypeError):
        shown = None  # the end is still checked (checked_end) and says why
    types = event_types()
    fast = is_fast(speed)
    loop = asyncio.get_running_loop()
    t0: float | None = None
    wall0 = loop.time()
    last_t: float | None = None
    for start, end in _chunks(lines):
        while pressure is not None and pressure():
            await asyncio.sleep(PRESSURE_WAIT_S)
        events, bad = decode_lines(path, start + 1, lines[start:end], types)
        for event in events:
            if t0 is None:
                t0 = event.t
                if clock is not None and not fast:
                    clock.start(t0, speed, _last_time(lines, t0))
            if not fast:
                delay = wall0 + (event.t - t0) / speed - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            last_t = event.t
            if isinstance(event, RunFinished) and event.exit_code == 0:
                event = await asyncio.to_thread(checked_end, local_dir, event, lines)
            sink(event if shown is None else shown(event))
        if bad is not None:
            number, exc = bad
            sink(
                Error(
                    message=f"cannot replay further: {exc}",
                    where=f"{path}:{number}",
                    t=last_t if last_t is not None else time.time(),
                )
            )
            return
        await asyncio.sleep(0)  # let the screen's timer run between chunks
    if last_t is None:
        sink(Error(message=f"{path}: the file holds no events", where=str(path)))
    if torn:
        sink(
            Error(
                message=f"{path}: the last line is incomplete (the console stopped "
                f"mid-write); it was not replayed",
                where=str(path),
                t=last_t if last_t is not None else time.time(),
            )
        )


def _last_time(lines: list[bytes], default: float) -> float:
    """The recorded time of the last event, for the replay clock to stop at."""
    for line in reversed(lines):
        try:
            value = orjson.loads(line).get("t")
        except (orjson.JSONDecodeError, AttributeError):
            continue
        if isinstance(value, int | float):
            return float(value)
    return default
