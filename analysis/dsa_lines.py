"""A DSA trace file's lines in bounded chunks, read whole or by span (any process can read a span)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from analysis.dsa_record import MAX_LINE, Lines, torn_fail
from analysis.dsa_stream import TraceStream, problem
from analysis.regular_file import open_regular

READ_CHUNK = 4 << 20


def complete_lines(
    path: Path, chunk: int = READ_CHUNK
) -> Iterator[tuple[int, Sequence[bytes], bool]]:
    """A file's lines in bounded chunks: (first line's number, lines, torn); a last line with no
    newline comes alone at the end with torn=True.

    Chunk k ends at the last newline before byte (k + 1) x chunk (chunk_spans' chunks). The
    file is read `chunk` bytes at a time (one size: the allocator reuses its block) and the
    lines are a Lines, offsets into what was read: only the line across two reads is copied
    (its head), never the chunk, nor a line each."""
    line_no = 1
    carry = b""  # the bytes after the last newline read (the start of a line)
    with open_regular(path, fifo=True) as fh:
        while data := fh.read(chunk):
            first = data.find(b"\n")
            if first < 0:  # a line longer than a chunk goes on, kept up to MAX_LINE bytes
                carry += data[: max(0, MAX_LINE - len(carry))]
                continue
            cut = data.rfind(b"\n")
            head = carry + data[: min(first, max(0, MAX_LINE - len(carry)))]
            lines = Lines(data, first + 1, cut, head=head)
            yield line_no, lines, False
            line_no += len(lines)
            carry = data[cut + 1 :]
    if carry:
        yield line_no, [carry], True


SPAN_WHOLE = 2 * READ_CHUNK  # a span of chunk_spans' with no line longer than a chunk


def chunk_spans(path: Path, chunk: int = READ_CHUNK) -> Iterator[tuple[int, int, int, bool]]:
    """complete_lines' chunks, found but not split: (byte offset, size without the last
    newline, first line's number, torn). read_span gives the same lines."""
    line_no = 1
    start = at = 0  # the next chunk's first byte; the bytes read so far
    with open_regular(path, fifo=True) as fh:
        while data := fh.read(chunk):
            at += len(data)
            cut = data.rfind(b"\n")
            if cut < 0:
                continue  # no newline yet: the chunk goes on (as complete_lines' rest)
            end = at - len(data) + cut
            yield start, end - start, line_no, False
            line_no += _newlines(data, cut) + 1  # the carried bytes hold no newline
            start = end + 1
    if at > start:
        yield start, at - start, line_no, True


def read_span(path: Path, offset: int, size: int) -> Lines:
    """The lines of one chunk_spans chunk (each kept up to MAX_LINE bytes, as complete_lines
    keeps them: a longer line is no record whatever it holds)."""
    with open_regular(path, fifo=True) as fh:
        fh.seek(offset)
        if size <= SPAN_WHOLE:
            return Lines(fh.read(size))
        out = bytearray()
        kept = 0  # bytes kept of the line being read
        while size > 0 and (data := fh.read(min(READ_CHUNK, size))):
            size -= len(data)
            start = 0
            while True:
                nl = data.find(b"\n", start)
                end = len(data) if nl < 0 else nl
                take = min(end - start, max(0, MAX_LINE - kept))
                out += data[start : start + take]
                kept += take
                if nl < 0:
                    break
                out += b"\n"
                kept, start = 0, nl + 1
        return Lines(bytes(out))


def feed_file(stream: TraceStream, path: Path, chunk: int = READ_CHUNK) -> dict[str, Any] | None:
    """Stream one shard through the judge in bounded chunks; a torn last line is a problem."""
    for line_no, lines, torn in complete_lines(path, chunk):
        if not torn:
            stream.feed(str(path), lines, line_no)
            continue
        return torn_line(stream, path, line_no, len(lines[0]))
    return None


def torn_line(stream: TraceStream, path: Path, line_no: int, size: int) -> dict[str, Any]:
    """A last line with no newline: one invalid record, and its problem."""
    fail = torn_fail(size)
    stream.records += 1
    stream.invalid += 1
    found = problem(str(path), line_no, None, fail)
    if stream.first is None:
        stream.first = found
    stream.torn.append(found)  # listed with the trace's problems (trace_verdict)
    return found


def _newlines(data: bytes, end: int) -> int:
    """data.count(b"\n", 0, end), a memchr a line (count looks at every byte)."""
    n = 0
    find = data.find
    at = find(b"\n", 0, end)
    while at >= 0:
        n += 1
        at = find(b"\n", at + 1, end)
    return n
