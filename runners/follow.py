"""Follow files on a target by byte offset, handing out complete lines only."""

from __future__ import annotations

from dataclasses import dataclass

from runners.targets.base import Target, TargetError

CHUNK = 1 << 20
MAX_LINE = 64 << 20


@dataclass(slots=True)
class Lines:
    lines: list[bytes]
    first_line: int  # 1-based number of lines[0] in the file
    end_offset: int  # offset just past the last complete line


class FileFollower:
    """The offset only ever moves to the end of a complete line, so a reconnect loses nothing."""

    def __init__(self, target: Target, path: str, offset: int = 0, line_no: int = 0) -> None:
        self.target = target
        self.path = path
        self.offset = offset
        self.lines_read = line_no
        self._chunk = CHUNK

    async def poll(self) -> Lines | None:
        """Read what was appended since the last poll; None when nothing complete is new."""
        collected: list[bytes] = []
        first = self.lines_read + 1
        while True:
            data = await self.target.read_from(self.path, self.offset, self._chunk)
            if not data:
                break
            cut = data.rfind(b"\n")
            if cut < 0:
                if len(data) < self._chunk:
                    break  # an incomplete last line: wait for its newline
                if self._chunk >= MAX_LINE:
                    raise TargetError(
                        f"{self.target.name}:{self.path}: line {self.lines_read + 1} is longer "
                        f"than {MAX_LINE >> 20} MiB with no newline; is this a JSONL/text file?"
                    )
                self._chunk *= 2
                continue
            complete = data[: cut + 1]
            batch = complete.split(b"\n")[:-1]
            collected.extend(batch)
            self.offset += len(complete)
            self.lines_read += len(batch)
            if len(data) < self._chunk:
                break
        if not collected:
            return None
        return Lines(collected, first, self.offset)
