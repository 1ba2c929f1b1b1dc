"""The local target: /bin/sh subprocesses and this machine's filesystem."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from analysis.regular_file import NotRegular as FileRegularError
from analysis.regular_file import open_regular
from runners.atomic import write_atomic
from runners.targets.base import CommandResult, NotRegular, TargetError, local_write_error


class LocalTarget:
    """Runs everything on this machine; relative paths are relative to the process cwd."""

    name = "local"

    async def connect(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh",
                "-c",
                command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # so a timeout can kill the whole process group
            )
        except OSError as exc:
            raise TargetError(f"cannot start /bin/sh on this machine: {exc}") from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except (TimeoutError, asyncio.CancelledError) as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise TargetError(
                f"local command did not finish within {timeout:g} s and was killed: {command[:200]}"
            ) from exc
        assert proc.returncode is not None
        return CommandResult(
            proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        )

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        await asyncio.to_thread(_write_atomic, Path(path), data, mode)

    async def read_from(self, path: str, offset: int, max_bytes: int) -> bytes | None:
        if offset < 0 or max_bytes < 0:
            raise ValueError(f"read_from({path!r}): offset and max_bytes must be >= 0")
        return await asyncio.to_thread(_read_from, Path(path), offset, max_bytes)

    async def list_dir(self, path: str) -> list[str] | None:
        return await asyncio.to_thread(_list_dir, Path(path))

    async def download(
        self, path: str, local: Path, progress: Callable[[int, int], None] | None = None
    ) -> None:
        report = None
        if progress is not None:
            loop = asyncio.get_running_loop()

            def report(done: int, total: int) -> None:
                loop.call_soon_threadsafe(progress, done, total)

        await asyncio.to_thread(_copy_atomic, Path(path), local, report)

    async def open_stream(self, command: str) -> LocalStream:
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh",
                "-c",
                command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise TargetError(f"cannot start /bin/sh on this machine: {exc}") from exc
        return LocalStream(proc)


class LocalStream:
    """A command on this machine, talked to over pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc

    async def readline(self) -> bytes:
        assert self._proc.stdout is not None
        return await self._proc.stdout.readline()

    def write(self, data: bytes) -> None:
        assert self._proc.stdin is not None
        if not self._proc.stdin.is_closing():
            self._proc.stdin.write(data)

    async def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()  # the command's end of input: it exits by itself
        try:
            await asyncio.wait_for(self._proc.wait(), timeout=2.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            await self._proc.wait()


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    try:
        write_atomic(path, data, mode)
    except OSError as exc:
        raise TargetError(f"cannot write {path} on this machine: {exc}") from exc


def _open_regular(path: Path, what: str = "") -> tuple[BinaryIO, int]:
    """`path` open to read (analysis.regular_file.open_regular), and its size then;
    NotRegular (the target's error) for anything but a regular file."""
    try:
        f = open_regular(path)
    except FileRegularError as exc:
        raise NotRegular(
            f"{path} is not a regular file (a FIFO, device or directory){what}"
        ) from exc
    return f, os.fstat(f.fileno()).st_size


def _read_from(path: Path, offset: int, max_bytes: int) -> bytes | None:
    try:
        f, _ = _open_regular(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TargetError(f"cannot read {path} on this machine: {exc}") from exc
    with f:
        try:
            f.seek(offset)
            return f.read(max_bytes)
        except OSError as exc:
            raise TargetError(f"cannot read {path} on this machine: {exc}") from exc


def _list_dir(path: Path) -> list[str] | None:
    try:
        return sorted(entry.name for entry in os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise TargetError(f"cannot list {path} on this machine: {exc}") from exc


COPY_CHUNK = 4 << 20


def _copy_atomic(
    src: Path, local: Path, progress: Callable[[int, int], None] | None = None
) -> None:
    part = local.with_name(local.name + ".part")
    try:
        local.parent.mkdir(parents=True, exist_ok=True)
        # only a regular file, no more than the size it had when opened
        fin, total = _open_regular(src, ": not fetched")
        with fin:
            done = 0
            with open(part, "wb") as fout:
                while done < total and (chunk := fin.read(min(COPY_CHUNK, total - done))):
                    fout.write(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
        os.replace(part, local)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise local_write_error(exc, local) or TargetError(
            f"cannot download {src} to {local}: {exc}"
        ) from exc
