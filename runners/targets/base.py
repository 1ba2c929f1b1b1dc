"""The one interface every target (local, ssh) implements; sessions know nothing else."""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class TargetError(Exception):
    """An infrastructure failure on or reaching a target (CLI exit 3)."""


class NotRegular(TargetError):
    """A path that is no regular file (a FIFO, a device, a directory): never opened to read."""


class ConnectionLost(TargetError):
    """The link to the target failed or dropped; the caller may reconnect and resume."""


class LocalWriteError(TargetError):
    """This machine could not write a downloaded file (disk full, quota, read-only)."""

    def __init__(self, path: Path, exc: OSError) -> None:
        self.path = path
        self.errno = exc.errno
        self.strerror = exc.strerror or str(exc)
        super().__init__(f"cannot write {path}: {self.strerror}")


# What only the writing side of a download can fail with.
_LOCAL_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def local_write_error(exc: BaseException, path: Path) -> LocalWriteError | None:
    """The download's failure as a LocalWriteError when it was this machine that could not write."""
    if isinstance(exc, OSError) and exc.errno in _LOCAL_WRITE_ERRNOS:
        return LocalWriteError(path, exc)
    return None


class HostKeyUnknown(TargetError):
    """The host's key is not in known_hosts: refuse, show the fingerprint, say how to trust it."""

    def __init__(self, host: str, port: int, fingerprint: str, key_type: str) -> None:
        self.host = host
        self.port = port
        self.fingerprint = fingerprint
        self.key_type = key_type
        spec = host if port == 22 else f"{host}:{port}"
        self.trust_command = f"tracedeck trust {spec}"
        super().__init__(
            f"host key for {spec} is not known ({key_type} {fingerprint}); "
            f"refusing to connect. If this fingerprint is right, run: {self.trust_command}"
        )


class HostKeyMismatch(TargetError):
    """The host presented a key that differs from known_hosts: never connect."""


@dataclass(frozen=True, slots=True)
class CommandResult:
    exit_status: int
    stdout: str
    stderr: str


class TargetStream(Protocol):
    """A long-running command on the target, talked to over its stdin and stdout (stderr merged);
    it ends when its stdin is closed or the link drops."""

    async def readline(self) -> bytes:
        """The next line with its newline; b"" once the command has ended."""
        ...

    def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


class Target(Protocol):
    """Paths are POSIX strings on the target; relative ones are relative to its home (ssh) or cwd."""

    name: str

    async def connect(self) -> None: ...

    async def close(self) -> None: ...

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        """Run a shell command to completion (sh -c semantics) and return its result."""
        ...

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write atomically: to path.part, then rename."""
        ...

    async def read_from(self, path: str, offset: int, max_bytes: int) -> bytes | None:
        """Bytes of path from offset (at most max_bytes); None when the file does not exist."""
        ...

    async def list_dir(self, path: str) -> list[str] | None:
        """The names in a directory (no . or ..); None when the directory does not exist."""
        ...

    async def download(
        self, path: str, local: Path, progress: Callable[[int, int], None] | None = None
    ) -> None:
        """Copy a file home: to local.part, renamed when complete. progress(done, total) is
        called on the event loop as bytes arrive (total 0 when the size is unknown)."""
        ...

    async def open_stream(self, command: str) -> TargetStream:
        """Start a shell command (sh -c semantics) that keeps running while we talk to it."""
        ...
