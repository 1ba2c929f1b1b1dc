"""A DSA judge's trace batches judged in a helper process, its digests folded back here.

Judging a batch (parsing 2048-position records, the checks) holds the interpreter: in a thread
beside the console's event loop it starves the screen, and it gets one core at most. The helper
starts from a copy of the judge's TraceBook (an attach has folded the recorded digests into it)
and feeds it every batch in order; this process folds each digest into its book the way an
attach does (TraceBook.take), so the two books hold the same state, the
verdict is computed from this one, and the digests recorded are the helper's, byte for byte
what an in-process feed makes. Should the helper fail (it cannot start, it dies), judging goes
on here from this book, which already holds every batch judged so far.

The helper is a plain `python -c` child, as in analysis.parallel: no multiprocessing (its
resource tracker cannot start inside a Textual app, whose stderr has no file descriptor).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import weakref
from collections import deque
from pathlib import Path
from typing import IO, Any, Protocol


class TraceBook(Protocol):
    """What a helper needs of runners.kinds.dsa_trace.TraceBook (named here, not imported: that
    module uses this one)."""

    def feed(self, file: str, lines: list[bytes], first_line: int) -> dict[str, Any]: ...

    def apply_data(self, file: str, digest: dict[str, Any]) -> None: ...


_LEN = struct.Struct("<Q")
_OK, _RAISED = "ok", "raised"
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
_CHILD = "from runners.dsa_worker import serve; serve()"
AHEAD = 2  # batches a helper may hold at once (the one judged, the next)
# A batch (at most POLL_BYTES of lines) is judged in well under a second: a helper silent this
# long is stopped or stuck, and is killed so its batches are judged here (never a wait forever).
SILENCE_S = 120.0
# False: every judge feeds its book in this process (bench/bench_dsa_console.py's baseline).
USE_HELPER = True
BOOK_CLASS = "runners.kinds.dsa_trace.TraceBook"


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LEN.pack(len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    """The next message, or EOFError when the other side has gone."""
    head = stream.read(_LEN.size)
    if len(head) != _LEN.size:
        raise EOFError
    (size,) = _LEN.unpack(head)
    data = stream.read(size)
    if len(data) != size:
        raise EOFError
    return pickle.loads(data)


def serve() -> None:
    """In the helper: the parent's TraceBook (the first message), then each batch fed to it in
    order and its digest (or what it raised) sent back; ends when the parent closes the pipe.

    A thread reads the batches as they come, so the parent can hand over the next one while
    this one is judged (BookFeeder.submit) and never waits on its own write."""
    # Ctrl-C is the parent's to handle: it closes the pipe, and this process ends with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        book = _receive(inp)
    except (EOFError, BrokenPipeError):
        return
    # unpickling it imported its class; only runners.kinds.dsa_trace's book is served
    if f"{type(book).__module__}.{type(book).__qualname__}" != BOOK_CLASS:
        return  # not from a parent of ours
    batches: queue.Queue[Any] = queue.Queue(maxsize=AHEAD + 1)
    threading.Thread(target=_read_batches, args=(inp, batches), daemon=True).start()
    try:
        while (batch := batches.get()) is not None:
            file, lines, first_line = batch
            try:
                reply: tuple[str, Any] = (_OK, book.feed(file, lines, first_line))
            except Exception as exc:  # the in-process feed would have raised it: so does this
                reply = (_RAISED, exc)
            try:
                _send(out, reply)
            except (pickle.PicklingError, TypeError, AttributeError):
                _send(out, (_RAISED, RuntimeError(repr(reply[1]))))
    except BrokenPipeError:
        return


def _read_batches(inp: IO[bytes], batches: queue.Queue[Any]) -> None:
    try:
        while True:
            batches.put(_receive(inp))
    except (EOFError, OSError, pickle.UnpicklingError):
        batches.put(None)


class HelperGone(Exception):
    """The helper did not answer (it could not start, or it died): judge here instead."""


class _Helper:
    def __init__(self, book: TraceBook) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        # its stderr to a file: a pipe nobody reads would stop it once full
        self.err = tempfile.TemporaryFile()  # noqa: SIM115 - closed by _stop, with the helper
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        # the book as it is (an attach has folded the recorded digests into it): the helper
        # goes on from the same state
        _send(self.stdin, book)

    def submit(self, file: str, lines: list[bytes], first_line: int) -> None:
        try:
            _send(self.stdin, (file, lines, first_line))
        except (OSError, ValueError) as exc:  # ValueError: the pipe was closed here
            raise HelperGone(str(exc) or type(exc).__name__) from exc

    def collect(self) -> dict[str, Any]:
        """The digest of the oldest batch submitted and not collected (HelperGone when it is
        silent for SILENCE_S: it is killed)."""
        fired = threading.Event()

        def silent() -> None:
            fired.set()
            self.proc.kill()

        watchdog = threading.Timer(SILENCE_S, silent)
        watchdog.daemon = True
        watchdog.start()
        try:
            tag, value = _receive(self.stdout)
        except (EOFError, OSError, ValueError, pickle.UnpicklingError) as exc:
            said = self._said()
            why = str(exc) or type(exc).__name__
            if fired.is_set():
                why = f"no answer in {SILENCE_S:g} s: killed"
            raise HelperGone(why + (f"; it said: {said}" if said else "")) from exc
        finally:
            watchdog.cancel()
        if tag == _RAISED:
            raise value
        return value  # type: ignore[no-any-return]

    def _said(self) -> str:
        """The end of what the helper wrote on its stderr."""
        with contextlib.suppress(OSError, ValueError):
            self.err.seek(0, os.SEEK_END)
            self.err.seek(max(0, self.err.tell() - 400))
            return self.err.read().decode("utf-8", "replace").strip().replace("\n", " | ")
        return ""


def _stop(proc: subprocess.Popen[bytes], err: IO[bytes] | None = None) -> None:
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    if proc.poll() is None:
        try:
            proc.wait(timeout=2)  # its stdin closed: it ends by itself
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if err is not None:
        with contextlib.suppress(OSError):
            err.close()


class BookFeeder:
    """Feeds a TraceBook's batches through a helper process (started at the first batch).

    A batch may be submitted ahead (while at most AHEAD wait in the helper; past that submit
    does nothing, and no later batch of that trace directory is taken ahead until it is fed,
    so each directory's batches reach the helper in their order): the helper judges it while
    this process emits the one before. feed() collects a batch's digest, submitted or not.
    Several followers share one judge (a fleet's hosts, each reading its own traces), so
    batches may be fed in another order than they were submitted in: the helper answers in
    its order, and each digest is folded into this book in that order (so it mirrors the
    helper's) and kept until its batch is fed."""

    def __init__(self, book: TraceBook, use_helper: bool | None = None) -> None:
        self.book = book
        self._helper: _Helper | None = None
        self._use_helper = USE_HELPER if use_helper is None else use_helper
        self._lock = threading.Lock()  # one caller at a time
        self._sent: deque[tuple[str, list[bytes]]] = deque()  # in the helper, oldest first
        self._done: list[tuple[list[bytes], dict[str, Any]]] = []  # collected, not yet fed
        self._owed: list[tuple[str, list[bytes]]] = []  # submitted, not taken: their directories
        self.helper_error = ""  # why judging went on in-process, when it did

    def submit(self, file: str, lines: list[bytes], first_line: int) -> None:
        """Hand the batch to the helper now, when it has room; feed(file, lines, first_line)
        collects it."""
        with self._lock:
            folder = file.rpartition("/")[0]
            if self._holds(lines) or any(owed is lines for _, owed in self._owed):
                return
            if len(self._sent) < AHEAD and all(f != folder for f, _ in self._owed):
                self._hand_over(file, lines, first_line)
            else:
                self._owed.append((folder, lines))

    def feed(self, file: str, lines: list[bytes], first_line: int) -> dict[str, Any]:
        """The batch's digest, as book.feed(...) gives it; the book has it folded in."""
        with self._lock:
            for i, (done, digest) in enumerate(self._done):
                if done is lines:
                    del self._done[i]
                    return digest
            if not self._holds(lines):  # not taken ahead: now
                self._owed = [(f, owed) for f, owed in self._owed if owed is not lines]
                self._hand_over(file, lines, first_line)
            while self._helper is not None and self._holds(lines):
                head_file, head = self._sent.popleft()
                try:
                    digest = self._helper.collect()
                except HelperGone as exc:
                    self._give_up(f"the judging process stopped ({exc})")
                    break
                self.book.apply_data(head_file, digest)
                if head is lines:
                    return digest
                self._done.append((head, digest))  # another follower's: kept for its feed
            # no helper (any more): this book holds every batch collected so far
            return self.book.feed(file, lines, first_line)

    def _holds(self, lines: list[bytes]) -> bool:
        return any(sent is lines for _, sent in self._sent)

    def _hand_over(self, file: str, lines: list[bytes], first_line: int) -> None:
        """The batch to the helper (started at the first); without one it is judged when fed."""
        helper = self._start()
        if helper is None:
            return
        try:
            helper.submit(file, lines, first_line)
        except HelperGone as exc:
            self._give_up(f"the judging process stopped ({exc})")
        else:
            self._sent.append((file, lines))

    def _start(self) -> _Helper | None:
        if self._helper is None and self._use_helper:
            self._use_helper = False  # one helper per book: its state cannot be rebuilt
            try:
                self._helper = _Helper(self.book)
            except (OSError, pickle.PicklingError, TypeError, AttributeError) as exc:
                self.helper_error = f"the judging process could not start ({exc})"
                return None
            weakref.finalize(self, _stop, self._helper.proc, self._helper.err)
        return self._helper

    def _give_up(self, why: str) -> None:
        helper, self._helper = self._helper, None
        self._sent.clear()  # what it had is judged here, as each batch is fed
        self.helper_error = why
        if helper is not None:
            _stop(helper.proc, helper.err)

    def close(self) -> None:
        """Stop the helper; later batches (if any) are judged in this process."""
        with self._lock:
            self._give_up("closed")
