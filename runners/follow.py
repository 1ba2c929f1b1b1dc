"""Follow files on a target by byte offset, handing out complete lines only."""

from __future__ import annotations

from dataclasses import dataclass

from runners.targets.base import Target, TargetError

CHUNK = 1 << 20
MAX_LINE = 64 << 20


@dataclass(slots=True)
class Lines:
    lines: list[bytes]  # without their newlines
    first_line: int  # 1-based number of lines[0] in the file
    start_offset: int  # offset of lines[0]
    end_offset: int  # offset just past the last complete line

    def offsets(self) -> list[int]:
        """The byte offset each line starts at."""
        out, at = [], self.start_offset
        for line in self.lines:
            out.append(at)
            at += len(line) + 1
        return out

    def split(self, boundary: int) -> tuple[Lines | None, Lines | None]:
        """The lines that start before `boundary`, and the rest."""
        offsets = self.offsets()
        n = sum(1 for o in offsets if o < boundary)
        if n == 0:
            return None, self
        if n == len(self.lines):
            return self, None
        cut = offsets[n]
        head = Lines(self.lines[:n], self.first_line, self.start_offset, cut)
        tail = Lines(self.lines[n:], self.first_line + n, cut, self.end_offset)
        return head, tail


class FileFollower:
    """The offset only ever moves to the end of a complete line, so a reconnect loses nothing."""

    def __init__(self, target: Target, path: str, offset: int = 0, line_no: int = 0) -> None:
        self.target = target
        self.path = path
        self.offset = offset
        self.lines_read = line_no
        self._chunk = CHUNK

    async def poll(self, until: int | None = None) -> Lines | None:
        """Complete lines appended since the last poll (ending at or before `until` when given)."""
        collected: list[bytes] = []
        first, start = self.lines_read + 1, self.offset
        while until is None or self.offset < until:
            want = self._chunk if until is None else min(self._chunk, until - self.offset)
            data = await self.target.read_from(self.path, self.offset, want)
            if not data:
                break
            cut = data.rfind(b"\n")
            if cut < 0:
                if len(data) < want:
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
            if len(data) < want:
                break
        if not collected:
            return None
        return Lines(collected, first, start, self.offset)
