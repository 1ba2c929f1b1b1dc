"""Follow files on a target by byte offset, in bounded chunks, handing out complete lines only."""

from __future__ import annotations

from dataclasses import dataclass

from runners.targets.base import Target

CHUNK = 1 << 20
# At most this much is handed out per poll: a backlog of any size is read in bounded steps, so
# memory stays flat and the consumer (recorder, console) keeps pace between steps.
POLL_BYTES = 4 << 20
MAX_LINE = 64 << 20


def oversize_line(line_no: int, size: int) -> bytes:
    """What a follower hands out in place of a line longer than MAX_LINE: never valid JSON, so
    every judge names it (file and line) as a bad record instead of the follower failing."""
    return (
        f"<tracedeck: line {line_no} is {size} bytes, longer than {MAX_LINE >> 20} MiB; "
        "not read (is this a JSONL/text file?)>"
    ).encode()


@dataclass(slots=True)
class Lines:
    lines: list[bytes]  # without their newlines
    first_line: int  # 1-based number of lines[0] in the file
    start_offset: int  # offset of lines[0]
    end_offset: int  # offset just past the last line

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
        self.seen = offset > 0  # the file has existed
        self.caught_up = True  # the last poll reached the end of what was written
        self._chunk = CHUNK
        self._skipped_to: int | None = None  # an oversize line: how far its newline was sought

    async def poll(self, until: int | None = None, max_bytes: int = POLL_BYTES) -> Lines | None:
        """Complete lines appended since the last poll, at most about max_bytes of them (ending
        at or before `until` when given); caught_up says whether more is already waiting."""
        first, start = self.lines_read + 1, self.offset
        chunk, skipped_to = self._chunk, self._skipped_to
        try:
            return await self._poll(until, max_bytes, first, start)
        except BaseException:
            # The link went mid-poll: the lines read so far were not handed out, so the next
            # poll reads them again (the offset moved past them chunk by chunk), from the read
            # size it started with (one grown for a long line past them is not theirs).
            self.offset, self.lines_read = start, first - 1
            self._chunk, self._skipped_to = chunk, skipped_to
            raise

    async def _poll(
        self, until: int | None, max_bytes: int, first: int, start: int
    ) -> Lines | None:
        collected: list[bytes] = []
        self.caught_up = False
        while until is None or self.offset < until:
            if self.offset - start >= max_bytes:
                return Lines(collected, first, start, self.offset)
            if self._skipped_to is not None or self._chunk > MAX_LINE:
                if not await self._skip_oversize(collected):
                    break  # its newline is not written yet
                continue
            want = self._chunk if until is None else min(self._chunk, until - self.offset)
            data = await self.target.read_from(self.path, self.offset, want)
            if data is not None:
                self.seen = True
            if not data:
                break
            cut = data.rfind(b"\n")
            if cut < 0:
                if len(data) < want or want < self._chunk:
                    break  # an incomplete last line (or one crossing `until`): not handed out
                self._chunk *= 2  # past MAX_LINE: the line is skipped (_skip_oversize)
                continue
            batch = data.split(b"\n")
            batch.pop()  # the incomplete last line (b"" when the data ends with a newline)
            collected.extend(batch)
            self.offset += cut + 1
            self.lines_read += len(batch)
            if len(data) < want:
                break
        self.caught_up = True
        if not collected:
            return None
        return Lines(collected, first, start, self.offset)

    async def _skip_oversize(self, collected: list[bytes]) -> bool:
        """Seek the newline of the line at self.offset (longer than MAX_LINE) in bounded reads,
        remembering how far it got; once found, hand out oversize_line in its place. Memory
        stays at one chunk whatever the line's length."""
        at = self._skipped_to if self._skipped_to is not None else self.offset
        while True:
            data = await self.target.read_from(self.path, at, CHUNK)
            if not data:
                self._skipped_to = at
                return False
            cut = data.find(b"\n")
            if cut >= 0:
                end = at + cut + 1
                self.lines_read += 1
                collected.append(oversize_line(self.lines_read, end - 1 - self.offset))
                self.offset, self._skipped_to, self._chunk = end, None, CHUNK
                return True
            at += len(data)

    async def changed(self) -> str | None:
        """Why the file no longer holds what was read from it, else None: it is gone, shorter
        than the offset, or rewritten (the byte before the offset is not the newline read)."""
        if not self.seen:
            return None
        if self.offset == 0:  # nothing read: only being gone is a change
            return "it is gone" if await self.target.read_from(self.path, 0, 1) is None else None
        last = await self.target.read_from(self.path, self.offset - 1, 1)
        if last is None:
            return "it is gone"
        if not last:
            return f"it is now shorter than the {self.offset} bytes read from it"
        if last != b"\n":
            return f"it was rewritten: byte {self.offset - 1} is no longer the newline read there"
        return None

    async def rest(self) -> Lines | None:
        """What follows the last complete line, as one final line (the writer has ended: a
        last line without its newline is still a line, never dropped)."""
        data = await self.target.read_from(self.path, self.offset, MAX_LINE)
        if not data:
            return None
        self.seen = True
        line = Lines([data], self.lines_read + 1, self.offset, self.offset + len(data))
        self.offset += len(data)
        self.lines_read += 1
        return line
