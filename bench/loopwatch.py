"""How long the console's event loop stops answering, for the console benches.

Two measures, kept from the screen's first paint on (its cost is printed apart):
- the worst stall: how late a 10 ms heartbeat task wakes (wall time: what an operator sees);
- the longest callback in CPU time of the loop's thread: what one piece of the console's own
  work costs, whatever else the machine runs (a loaded machine stretches the wall time only).
"""

from __future__ import annotations

import asyncio
import asyncio.events
import time
from collections.abc import Callable
from typing import Any

HEARTBEAT_S = 0.01


class LoopWatch:
    """Start inside the running loop; read `worst_stall` and `worst_callback_cpu` (seconds)."""

    def __init__(self) -> None:
        self.worst_stall = 0.0
        self.worst_callback_cpu = 0.0
        self.worst_callback = ""
        # The figures count from the screen's first paint (opening the screen is not streaming);
        # that paint's own CPU time is kept apart.
        self.painted = False
        self.first_paint_cpu = 0.0
        self._task: asyncio.Task[None] | None = None
        self._original: Callable[[Any], None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._beat())
        original = asyncio.events.Handle._run
        self._original = original
        watch = self

        def timed(handle: Any) -> None:
            begin = time.thread_time()
            original(handle)
            spent = time.thread_time() - begin
            if not watch.painted:
                name = _name(handle)
                if "screen_update" in name:  # the screen's first paint: opening, not streaming
                    watch.painted = True
                    watch.first_paint_cpu = spent
                    watch.worst_stall = 0.0
                    watch.worst_callback_cpu, watch.worst_callback = 0.0, ""
                    return
            if spent > watch.worst_callback_cpu:
                watch.worst_callback_cpu = spent
                watch.worst_callback = _name(handle)

        asyncio.events.Handle._run = timed  # type: ignore[method-assign]

    def stop(self) -> None:
        if self._original is not None:
            asyncio.events.Handle._run = self._original  # type: ignore[method-assign]
            self._original = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            now = loop.time()
            self.worst_stall = max(self.worst_stall, now - last - HEARTBEAT_S)
            last = now

    def line(self) -> str:
        return (
            f"worst event-loop stall {self.worst_stall * 1e3:.0f} ms; longest callback "
            f"{self.worst_callback_cpu * 1e3:.0f} ms of CPU ({self.worst_callback}); "
            f"the screen's first paint {self.first_paint_cpu * 1e3:.0f} ms of CPU"
        )


def _name(handle: Any) -> str:
    """What a callback runs: a task's coroutine, else the callback's name."""
    callback = getattr(handle, "_callback", None)
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        coro = task.get_coro()
        frame = getattr(coro, "cr_frame", None)
        owner = frame.f_locals.get("self") if frame is not None else None
        name = getattr(coro, "__qualname__", repr(coro))
        if type(owner).__name__ == "Timer":  # which timer: the screen's drain, its repaint...
            target = getattr(owner, "_callback", None)
            name += f" {getattr(owner, 'name', '')} {getattr(target, '__qualname__', '')}".rstrip()
        return name
    return getattr(callback, "__qualname__", repr(callback))
