"""A second console on a live run: it follows the writer's record, read-only.

One console writes a run's record (it holds record.lock); another that attaches meanwhile
reads events.jsonl as it grows, until the run's end is recorded, or until the writer is gone
(its lock freed), when it may take the writing over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from runners.events import Event, RunFinished
from runners.exits import NOT_ENDINGS
from runners.follow import FileFollower
from runners.kinds import event_types
from runners.record import EVENTS, decode_event, writer_present
from runners.targets.local import LocalTarget

POLL_S = 0.1


async def view(
    local_dir: Path, sink: Callable[[Event], None], poll_s: float = POLL_S
) -> tuple[RunFinished | None, int]:
    """Feed the record's events to `sink` as they are written; returns (the run's end, or None
    when the writer left before it, and how many events were fed)."""
    path = Path(local_dir) / EVENTS
    follower = FileFollower(LocalTarget(), str(path))
    types = event_types()
    count = 0
    while True:
        writer_was_there = writer_present(local_dir)
        got = await follower.poll()
        for number, line in enumerate(got.lines if got else [], start=got.first_line if got else 1):
            if not line.strip():
                continue
            event = decode_event(path, number, line, types)
            sink(event)
            count += 1
            if isinstance(event, RunFinished) and event.verdict not in NOT_ENDINGS:
                return event, count
        if got is None and follower.caught_up and not writer_was_there:
            return None, count  # read to the end after the writer had gone: nothing more comes
        await asyncio.sleep(0 if got is not None else poll_s)


def skipping(sink: Callable[[Event], None], count: int) -> Callable[[Event], None]:
    """A sink that lets the first `count` events pass unseen (a viewer showed them already)."""
    left = count

    def feed(event: Event) -> None:
        nonlocal left
        if left > 0:
            left -= 1
            return
        sink(event)

    return feed
