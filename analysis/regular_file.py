"""A file opened for reading only when it is a regular file (records and traces are)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO


class NotRegular(OSError, ValueError):
    """A path that is no regular file (an OSError naming it, and a ValueError: readers that
    turn bad input into a named error catch either), as io.UnsupportedOperation is both."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def open_regular(path: Path | str, fifo: bool = False) -> BinaryIO:
    """A file opened for reading, refused (an OSError naming it) unless a regular file:
    a FIFO nobody writes blocks the open for ever, and a device (/dev/zero) never ends, so a
    reader of its 'lines' would hold them without bound. fifo: a FIFO is read as it is
    written (a DSA shard: tests/test_dsa_export_faults.py streams one), waiting for its writer."""
    if fifo and stat.S_ISFIFO(os.stat(path).st_mode):
        return open(path, "rb")  # noqa: SIM115 (the caller closes it)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO's open returns
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegular(
                errno.EINVAL, "not a regular file (a FIFO, device or socket has no end)", str(path)
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
