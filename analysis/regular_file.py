"""A file opened for reading only when it is a regular file (records and traces are)."""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO


class NotRegular(OSError, ValueError):
    """A path that is no regular file (an OSError naming it, and a ValueError: readers that
    turn bad input into a named error catch either), as io.UnsupportedOperation is both."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def open_regular(path: Path | str, fifo: bool = False) -> BinaryIO:
    """A file opened for reading, refused (an OSError naming it) unless a regular file:
    a FIFO nobody writes blocks the open for ever, and a device (/dev/zero) never ends, so a
    reader of its 'lines' would hold them without bound. fifo: a FIFO that a writer holds
    open is read as it is written (a DSA shard piped in: `zcat shard.gz > FIFO`); one nobody
    writes is refused, never waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO's open returns
    try:
        mode = os.fstat(fd).st_mode
        if fifo and stat.S_ISFIFO(mode):
            return io.BufferedReader(_Piped(fd, str(path)))  # read(n): n bytes, or the end
        if not stat.S_ISREG(mode):
            raise NotRegular(
                errno.EINVAL, "not a regular file (a FIFO, device or socket has no end)", str(path)
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class _Piped(io.RawIOBase):
    """A FIFO read while its writer writes: the first read, made without waiting, tells a
    writer (data, or none yet) from none (end of file at once: refused); what it read is
    handed out first."""

    def __init__(self, fd: int, path: str) -> None:
        super().__init__()
        self.fd = fd
        try:
            self.head = os.read(fd, 1 << 16)
        except BlockingIOError:
            self.head = b""  # a writer, nothing written yet
        else:
            if not self.head:
                raise NotRegular(
                    errno.EPIPE,
                    "not a regular file (a FIFO nobody writes: start its writer first)",
                    path,
                )
        os.set_blocking(fd, True)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.head:
            n = min(len(buffer), len(self.head))
            buffer[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        return os.readv(self.fd, [buffer])

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()
