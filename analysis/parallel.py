"""Reading a pair's two sides at once: one side is read by a helper process and streamed here
row by row, while this process reads the other side and compares (parsing holds the GIL, so
threads would not help). Memory stays O(V) per side: a row is handed over only when the
comparison is ready for it (the pipe is the back-pressure).

The helper is a plain `python -c` child, not multiprocessing: it needs no resource tracker
(which cannot start inside a Textual app, whose stderr has no file descriptor) and shares no
lock with this process's threads. It imports only this package, numpy and what logits.py can
use, so it runs the same on a host that was shipped analysis/ alone.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from collections.abc import Generator
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


def serve_side(path: str) -> None:
    """In the helper: every row of the file on stdout, then the end, or the error."""
    out = sys.stdout.buffer

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


def iter_logits_elsewhere(path: str | Path) -> Generator[LogitsRow, None, None]:
    """iter_logits(path), read by a helper process: the same rows, the same errors."""
    argv, env = helper_start("analysis.parallel", _CHILD, str(path))
    helper = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert helper.stdout is not None and helper.stderr is not None
    frames: queue.Queue[tuple[bytes, bytes | None]] = queue.Queue(maxsize=_AHEAD)
    reader = threading.Thread(
        target=_frames, args=(helper.stdout, frames), name=f"rows of {path}", daemon=True
    )
    reader.start()
    try:
        while True:
            tag, payload = frames.get()
            if payload is None:
                helper.wait()
                said = helper.stderr.read().decode("utf-8", "replace").strip()[-400:]
                raise RuntimeError(
                    f"{path}: the reading process ended without a word (exit {helper.returncode})"
                    + (f": {said}" if said else "; out of memory?")
                )
            if tag == _DONE:
                return
            if tag == _ERROR:
                raise pickle.loads(payload)
            line, idx, tid = _HEAD.unpack_from(payload)
            logits = np.frombuffer(payload, dtype=np.float32, offset=_HEAD.size)
            yield LogitsRow(line, idx, tid, logits)
    finally:
        if helper.poll() is None:
            helper.kill()  # the caller stopped early
        helper.wait()
        # The reader ends at the pipe's end, which the helper's death brings; a full queue
        # would hold it, so take what it still puts.
        while reader.is_alive():
            with contextlib.suppress(queue.Empty):
                frames.get(timeout=0.05)
        reader.join()
        helper.stdout.close()
        helper.stderr.close()
