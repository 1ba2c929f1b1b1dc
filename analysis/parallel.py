"""Reading a pair's two sides at once: one side is read by a helper process and streamed here
row by row, while this process reads the other side and compares (parsing holds the GIL, so
threads would not help). Memory stays O(V) per side: the helper runs at most _AHEAD rows
ahead of the comparison (a bounded queue, then the pipe, are the back-pressure).

The helper is forked where this process runs one thread (it starts at once, its modules loaded,
a judge on a target keeping its checked ones); else it is a plain `python -c` child, not
multiprocessing: it needs no resource tracker (which cannot start inside a Textual app, whose
stderr has no file descriptor) and shares no lock with this process's threads. It imports only
this package, numpy and what logits.py can use, so it runs the same on a host that was shipped
analysis/ alone.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from analysis.logits import InputError, LogitsRow, iter_logits

_ROW, _ERROR, _DONE = b"R", b"E", b"D"
_FRAME = struct.Struct("<cQ")  # tag, payload length
_HEAD = struct.Struct("<qqq")  # line, token_idx, token_id
# The directory that holds analysis/: the child imports it from there, wherever that is.
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
_CHILD = "import sys; from analysis.parallel import serve_side; serve_side(sys.argv[1])"
# How the helper starts: None is `python -c _CHILD` with this package first on PYTHONPATH. A
# judge on a target (runners/hosted/boot.py) sets the command it was itself run with, so the
# helper, too, runs isolated from checked bytes; the module and the file are appended.
HELPER_COMMAND: list[str] | None = None


def helper_start(module: str, child: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a helper process that runs `module` (`child` as `-c` code)."""
    env = dict(os.environ)
    # numpy's OpenBLAS starts a thread at import that spins for ~0.1 s of CPU waiting for work,
    # as much as a helper's own start; a helper multiplies no matrices, so it goes without.
    env["OPENBLAS_NUM_THREADS"] = "1"
    if HELPER_COMMAND is not None:
        return [*HELPER_COMMAND, module, *args], env
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return [sys.executable, "-c", child, *args], env


def forkable() -> bool:
    """May a helper be forked from this process? Only where it runs one thread: a fork beside
    other threads could inherit a lock one of them holds."""
    return hasattr(os, "fork") and threading.active_count() == 1


def serve_side(path: str, out: BinaryIO | None = None) -> None:
    """In the helper: every row of the file on `out` (stdout), then the end, or the error."""
    out = sys.stdout.buffer if out is None else out

    def send(tag: bytes, *payload: bytes | memoryview) -> None:
        out.write(_FRAME.pack(tag, sum(len(p) for p in payload)))
        for part in payload:
            out.write(part)  # a row's logits go from its array to the pipe, not through copies

    try:
        for row in iter_logits(path):
            head = _HEAD.pack(row.line, row.token_idx, row.token_id)
            send(_ROW, head, memoryview(row.logits).cast("B"))
    except InputError as exc:
        send(_ERROR, pickle.dumps(exc))
    except BrokenPipeError:
        return  # the caller stopped reading (an error on the other side)
    except BaseException as exc:  # a bug in the reader must reach the caller, not hang it
        send(_ERROR, pickle.dumps(RuntimeError(f"{path}: reader failed: {exc!r}")))
    else:
        send(_DONE, b"")
    out.flush()


def main(argv: list[str]) -> int:
    """The helper, run by runners/hosted/boot.py: serve_side(the file)."""
    serve_side(argv[0])
    return 0


def _read_exact(stream: BinaryIO, n: int) -> bytes | None:
    data = stream.read(n)
    return data if len(data) == n else None


# Rows the helper may run ahead of the comparison: a pipe holds a tenth of one 128k-vocab row,
# so without this the helper waited on every row for the comparison to take it.
_AHEAD = 8


def _frames(stream: BinaryIO, out: queue.Queue[tuple[bytes, bytes | None]]) -> None:
    """On a thread: the helper's frames, in order, until its end or the pipe's."""
    while True:
        frame = _read_exact(stream, _FRAME.size)
        tag, size = _FRAME.unpack(frame) if frame else (b"", 0)
        payload = _read_exact(stream, size) if frame else None
        out.put((tag, payload))
        if payload is None or tag in (_DONE, _ERROR):
            return


def forked(run: Callable[[], None]) -> int:
    """Fork a helper that runs `run` and exits (3 if it raised), never returning into the
    caller's code; its pid here. Only where forkable()."""
    pid = os.fork()
    if pid:
        return pid
    # What the parent made is never collected here: a collection would write to every object
    # shared with the parent, copying their pages.
    gc.freeze()
    code = 0
    try:
        run()
    except BaseException:
        code = 3
    finally:
        os._exit(code)


class Child:
    """A helper process, forked (pid) or spawned (popen): waited for once, killed only while
    it runs."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self.popen = popen
        self.status: int | None = None

    def wait(self, kill: bool = False) -> int:
        """Its exit code; `kill`: SIGKILL it first if it still runs."""
        if self.status is None and kill and self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self.status is None:
            if self.popen is not None:
                self.status = self.popen.wait()
            else:
                self.status = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.status

    def running(self) -> bool:
        if self.status is not None:
            return False
        if self.popen is not None:
            return self.popen.poll() is None
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            return True
        self.status = os.waitstatus_to_exitcode(status)
        return False


class _Helper(Child):
    """The reading process and the pipe of its frames (and its stderr where spawned)."""

    def __init__(self, path: str, fork: bool) -> None:
        if fork:
            down_r, down_w = os.pipe()

            def serve() -> None:
                os.close(down_r)
                with os.fdopen(down_w, "wb") as out:
                    serve_side(path, out)

            super().__init__(forked(serve))
            os.close(down_w)
            self.stdout: BinaryIO = os.fdopen(down_r, "rb")
            self.stderr: BinaryIO | None = None  # a forked helper writes to this one's
            return
        argv, env = helper_start("analysis.parallel", _CHILD, path)
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        assert popen.stdout is not None
        super().__init__(popen.pid, popen)
        self.stdout, self.stderr = popen.stdout, popen.stderr

    def said(self) -> str:
        if self.stderr is None:
            return ""
        return self.stderr.read().decode("utf-8", "replace").strip()[-400:]

    def close(self) -> None:
        self.stdout.close()
        if self.stderr is not None:
            self.stderr.close()


class SideRows:
    """iter_logits(path), read by a helper process that starts at once: the same rows, the same
    errors. close() ends the helper and its reader, whether or not a row was taken; so does
    losing the last reference to it (or the interpreter's exit) without close()."""

    def __init__(self, path: str | Path, fork: bool | None = None) -> None:
        self.path = str(path)
        self.helper = _Helper(self.path, forkable() if fork is None else fork)
        self.frames: queue.Queue[tuple[bytes, bytes | None]] = queue.Queue(maxsize=_AHEAD)
        self.reader = threading.Thread(
            target=_frames, args=(self.helper.stdout, self.frames), name=f"rows of {path}"
        )
        self.reader.daemon = True
        self.reader.start()
        self.closed = False
        # holds no reference to self: a SideRows dropped unclosed is still ended
        self._end = weakref.finalize(self, _end_side, self.helper, self.frames, self.reader)

    def __iter__(self) -> Iterator[LogitsRow]:
        return self

    def __next__(self) -> LogitsRow:
        if self.closed:
            raise StopIteration
        tag, payload = self.frames.get()
        if payload is None:
            code = self.helper.wait()
            said = self.helper.said()
            self.close()
            raise RuntimeError(
                f"{self.path}: the reading process ended without a word (exit {code})"
                + (f": {said}" if said else "; out of memory?")
            )
        if tag == _ROW:
            line, idx, tid = _HEAD.unpack_from(payload)
            logits = np.frombuffer(payload, dtype=np.float32, offset=_HEAD.size)
            return LogitsRow(line, idx, tid, logits)
        self.close()
        if tag == _ERROR:
            raise pickle.loads(payload)
        raise StopIteration  # _DONE

    def close(self) -> None:
        self.closed = True
        self._end()  # once: later calls do nothing


def _end_side(
    helper: _Helper, frames: queue.Queue[tuple[bytes, bytes | None]], reader: threading.Thread
) -> None:
    helper.wait(kill=True)  # still running: the caller stopped early
    # The reader ends at the pipe's end, which the helper's death brings; a full queue would
    # hold it, so take what it still puts.
    while reader.is_alive():
        with contextlib.suppress(queue.Empty):
            frames.get(timeout=0.05)
    reader.join()
    helper.close()


def iter_logits_elsewhere(path: str | Path, fork: bool | None = None) -> SideRows:
    """The rows of `path` read by a helper process. `fork`: fork the helper, or spawn it;
    None: fork where forkable(). The helper starts now, so that it is forked before this
    process starts the other side's threads."""
    return SideRows(path, fork)
