"""Wake the follower as soon as a followed file changes on the target, instead of at its next
poll: a small stat loop runs there and says "changed" (a few bytes; the data is still read by
offset, so nothing about what is judged, or resumed after a cut, depends on it).

A stat loop rather than inotify: it sees writes made by other nodes on a shared (NFS) directory
too. Where it cannot run (no python3 on the host), the follower polls as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex

import orjson

from runners.targets.base import Target, TargetError, TargetStream

# How often the target looks; the wake-up reaches the console one link latency later.
SCAN_S = 0.005
# False: poll only (what the benchmark compares against).
ENABLED = True
MARK = "tracedeck-changes"  # in the notifier's command line, so it can be found and counted

# stdlib only; reads the set of paths to watch (a JSON list per line) on stdin, writes "c" when
# any of them changed size or time (or came to exist), and exits when its stdin closes.
NOTIFIER = r"""
import json, os, select, sys
interval = float(sys.argv[1])
watch, last, pending = [], None, b""
while True:
    ready, _, _ = select.select([0], [], [], interval)
    if ready:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if lines:
            watch, last = json.loads(lines[-1]), None
            os.write(1, b"c\n")  # the set changed: look once at what is there now
    now = []
    for path in watch:
        try:
            st = os.stat(path)
            now.append((st.st_size, st.st_mtime_ns))
        except OSError:
            now.append(None)
    if last is not None and now != last:
        os.write(1, b"c\n")
    last = now
"""


class Changes:
    """The console's end of the notifier: `watch(paths)`, then `await wait(timeout)`."""

    def __init__(self, target: Target, python: str, run_id: str = "") -> None:
        self.target = target
        self.python = python
        self.tag = f"{MARK}={run_id}" if run_id else MARK
        self.available = False
        self.problem = ""  # why wake-ups are not available (the notifier's last words)
        self._stream: TargetStream | None = None
        self._reader: asyncio.Task[None] | None = None
        self._woken = asyncio.Event()
        self._watching: list[str] = []

    async def start(self) -> None:
        """Start (or, after a reconnect, restart) the notifier; never fails the run."""
        await self.close()
        if not ENABLED:
            self.problem = "wake-ups switched off"
            return
        command = f"exec {shlex.quote(self.python)} -c {shlex.quote(NOTIFIER)} {SCAN_S} {shlex.quote(self.tag)}"
        try:
            self._stream = await self.target.open_stream(command)
        except TargetError as exc:
            self.problem = str(exc)
            return
        self.available = True
        self._reader = asyncio.create_task(self._read(self._stream))
        if self._watching:
            self._send(self._watching)

    def watch(self, paths: list[str]) -> None:
        """The files (and directories, for new files) whose changes should wake the follower."""
        if paths != self._watching:
            self._watching = list(paths)
            self._send(self._watching)

    async def wait(self, timeout: float) -> bool:
        """Until the target says something changed (True), or timeout (the poll stays the floor)."""
        try:
            await asyncio.wait_for(self._woken.wait(), timeout)
        except TimeoutError:
            return False
        self._woken.clear()
        return True

    async def close(self) -> None:
        reader, stream = self._reader, self._stream
        self._reader = self._stream = None
        self.available = False
        if stream is not None:
            await stream.close()
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    def _send(self, paths: list[str]) -> None:
        if self._stream is not None:
            self._stream.write(orjson.dumps(paths) + b"\n")

    async def _read(self, stream: TargetStream) -> None:
        said: list[str] = []
        while line := await stream.readline():
            if line == b"c\n":
                self._woken.set()
            else:
                said = [*said[-4:], line.decode("utf-8", "replace").rstrip()]
        # Ended (no python3 there, or the link dropped): polling carries on alone.
        if self._stream is stream:
            self.available = False
            self.problem = " / ".join(said) or "the notifier ended"
