"""Reading a pair's two sides at once: one side is read by a helper process and streamed here
row by row, while this process reads the other side and compares (parsing holds the GIL, so
threads would not help). Memory stays O(V) per side: a row is handed over only when the
comparison is ready for it (the pipe is the back-pressure).

The helper is started with "spawn": it shares no lock with this process's threads (a console
has many), and it imports only this package, numpy and what logits.py can use.
"""

from __future__ import annotations

import multiprocessing
import pickle
import struct
from collections.abc import Generator
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from analysis.logits import InputError, LogitsRow, iter_logits

_ROW, _ERROR, _DONE = b"R", b"E", b"D"
_HEAD = struct.Struct("<qqq")  # line, token_idx, token_id


def _read_side(path: str, out: Connection) -> None:
    """In the helper: every row of the file, then the end, or the error that stopped it."""
    try:
        for row in iter_logits(path):
            out.send_bytes(
                _ROW + _HEAD.pack(row.line, row.token_idx, row.token_id) + row.logits.tobytes()
            )
    except InputError as exc:
        out.send_bytes(_ERROR + pickle.dumps(exc))
    except BaseException as exc:  # a bug in the reader must reach the caller, not hang it
        out.send_bytes(_ERROR + pickle.dumps(RuntimeError(f"{path}: reader failed: {exc!r}")))
    else:
        out.send_bytes(_DONE)
    finally:
        out.close()


def iter_logits_elsewhere(path: str | Path) -> Generator[LogitsRow, None, None]:
    """iter_logits(path), read by a helper process: the same rows, the same errors."""
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Pipe(duplex=False)
    helper = ctx.Process(target=_read_side, args=(str(path), outbox), daemon=True)
    helper.start()
    outbox.close()
    try:
        while True:
            try:
                message = inbox.recv_bytes()
            except EOFError:
                raise RuntimeError(
                    f"{path}: the reading process ended without a word (exit code "
                    f"{helper.exitcode}); out of memory?"
                ) from None
            tag = message[:1]
            if tag == _DONE:
                return
            if tag == _ERROR:
                raise pickle.loads(message[1:])
            line, idx, tid = _HEAD.unpack_from(message, 1)
            logits = np.frombuffer(message, dtype=np.float32, offset=1 + _HEAD.size)
            yield LogitsRow(line, idx, tid, logits)
    finally:
        inbox.close()
        if helper.is_alive():
            helper.kill()  # the caller stopped early (an error on the other side)
        helper.join()
