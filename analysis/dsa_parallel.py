"""A DSA trace read on several cores. `analyze` (feed_files): the per-record half of each
chunk (parse, every per-record check, fingerprints, aggregates: most of the work) runs in
worker processes, while this process folds their results through the cross-record checks in
the trace's order (TraceStream.check, TraceStream.absorb). The chunks are feed_file's own
(chunk_spans), and a worker does for a chunk only what feed() does with it alone, so the
counts, the first failure, every problem and every record's mark are the single-process
path's. The data tools (export, what-if, tiers) hand their per-chunk work to the same workers
(map_chunks) and fold the answers in order.

Parsing holds the GIL, so the workers are processes: forked where this process runs one thread,
else plain `python -c` children like the B3.67 side reader (analysis.parallel, whose
HELPER_COMMAND a judge on a target sets), fed one chunk's place (file, offset, size) at a time
over a pipe. At most two chunks wait per worker (memory stays a few chunks' worth, whatever the
trace's size). A worker that dies, or fails, is a WorkerError (never a pass, never a chunk
skipped).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import stat
import struct
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from analysis import parallel
from analysis.dsa_lines import (
    READ_CHUNK,
    chunk_spans,
    complete_lines,
    feed_file,
    read_span,
    torn_line,
)
from analysis.dsa_stream import Checked, TraceStream

_FRAME = struct.Struct("<cQ")  # tag, payload length
_CHUNK, _ERROR = b"C", b"E"
_CHILD = "import sys; from analysis.dsa_parallel import main; sys.exit(main(sys.argv[1:]))"
AHEAD = 2  # chunks handed to a worker before its oldest one is folded


class WorkerError(RuntimeError):
    """A worker process died or failed: the trace was not judged (an infrastructure error)."""


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """In a worker: the job (a picklable callable), then (path, offset, size, first line,
    torn) per chunk; each chunk's answer back, job(path, lines, first line, torn), or the
    error that stopped it."""
    frame = _read_frame(stdin)
    if frame is None:
        return
    job = pickle.loads(frame[1])
    while (frame := _read_frame(stdin)) is not None:
        path, offset, size, first_line, torn = pickle.loads(frame[1])
        try:
            got = job(path, read_span(Path(path), offset, size), first_line, torn)
            tag = _CHUNK
            payload = pickle.dumps((first_line, got), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # the caller must hear of it, never wait on it
            tag, payload = _ERROR, f"{path}:{first_line}: {exc!r}".encode()
        stdout.write(_FRAME.pack(tag, len(payload)))
        stdout.write(payload)
        stdout.flush()
        if tag == _ERROR:
            return


class StreamCheck:
    """The analyze job: TraceStream.check of a chunk, for a stream with these constants."""

    def __init__(self, consts: dict[str, Any]) -> None:
        self.consts = consts
        self.stream: TraceStream | None = None

    def __call__(self, path: str, lines: list[bytes], first_line: int, torn: bool) -> Checked:
        if self.stream is None:
            self.stream = TraceStream(**self.consts, live_view=False)
        return self.stream.check(lines, first_line)


def main(argv: list[str]) -> int:
    """A worker (python -c _CHILD, or runners/hosted/boot.py's entry)."""
    with contextlib.suppress(BrokenPipeError):  # the caller stopped (an error elsewhere)
        serve(sys.stdin.buffer, sys.stdout.buffer)
    return 0


def _read_frame(stream: BinaryIO) -> tuple[bytes, bytes] | None:
    head = stream.read(_FRAME.size)
    if len(head) != _FRAME.size:
        return None
    tag, size = _FRAME.unpack(head)
    payload = stream.read(size)
    return (tag, payload) if len(payload) == size else None


class _Worker(parallel.Child):
    """One worker process and this side's ends of its two pipes."""

    def __init__(
        self,
        pid: int,
        stdin: BinaryIO,
        stdout: BinaryIO,
        popen: subprocess.Popen[bytes] | None = None,
    ) -> None:
        super().__init__(pid, popen)
        self.stdin = stdin
        self.stdout = stdout
        # a spawned worker's stderr is a pipe; a forked one writes to ours
        self.stderr = popen.stderr if popen is not None else None


class Workers:
    """Worker processes that run a job on chunks of files, answering in the order given.

    Forked from this process where it runs one thread (the modules are loaded already, and a
    judge on a target keeps its checked modules); else spawned as `python -c` children (a
    fork beside other threads could inherit a lock one of them holds)."""

    def __init__(self, count: int, job: Callable[[str, list[bytes], int, bool], Any]) -> None:
        self.procs: list[_Worker] = []
        self.waiting: deque[tuple[int, str, int]] = deque()  # worker, path, first line
        self.next = 0
        payload = pickle.dumps(job)
        fork = parallel.forkable()
        try:
            for _ in range(count):
                proc = self._fork() if fork else self._spawn()
                self.procs.append(proc)
                self._send(proc, payload)
        except BaseException:
            self.close()
            raise

    def _fork(self) -> _Worker:
        down_r, down_w = os.pipe()  # chunks to the worker
        up_r, up_w = os.pipe()  # its answers

        def work() -> None:
            os.close(down_w)
            os.close(up_r)
            for other in self.procs:  # their pipes' ends here would keep them open
                os.close(other.stdin.fileno())
                os.close(other.stdout.fileno())
            with os.fdopen(down_r, "rb") as fin, os.fdopen(up_w, "wb") as fout:
                serve(fin, fout)

        pid = parallel.forked(work)
        os.close(down_r)
        os.close(up_w)
        return _Worker(pid, os.fdopen(down_w, "wb"), os.fdopen(up_r, "rb"))

    def _spawn(self) -> _Worker:
        argv, env = parallel.helper_start("analysis.dsa_parallel", _CHILD)
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        assert proc.stdin is not None and proc.stdout is not None
        return _Worker(proc.pid, proc.stdin, proc.stdout, proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def submit(
        self, path: str, offset: int, size: int, first_line: int, torn: bool = False
    ) -> None:
        """Hand a chunk (a chunk_spans span) to the next worker (round robin)."""
        k = self.next
        self.next = (k + 1) % len(self.procs)
        self._send(self.procs[k], pickle.dumps((path, offset, size, first_line, torn)))
        self.waiting.append((k, path, first_line))

    def result(self) -> Any:
        """The job's answer for the oldest submitted chunk."""
        k, path, first_line = self.waiting.popleft()
        proc = self.procs[k]
        frame = _read_frame(proc.stdout)
        if frame is None:
            raise WorkerError(self._died(proc, f"{path}:{first_line}"))
        tag, payload = frame
        if tag != _CHUNK:
            raise WorkerError(_failed(payload))
        at, got = pickle.loads(payload)
        if at != first_line:
            raise WorkerError(f"a worker answered for another chunk than {path}:{first_line}")
        return got

    def _send(self, proc: _Worker, payload: bytes) -> None:
        try:
            proc.stdin.write(_FRAME.pack(b"T", len(payload)) + payload)
            proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerError(self._died(proc, "a chunk handed to it")) from None

    def _died(self, proc: _Worker, where: str) -> str:
        status = proc.wait(kill=True)
        # It may have said why before it ended (an error, after answers not yet read): its
        # pipe holds that, and ends, now that it is gone.
        while (frame := _read_frame(proc.stdout)) is not None:
            if frame[0] != _CHUNK:
                return _failed(frame[1])
        said = proc.stderr.read().decode("utf-8", "replace").strip()[-400:] if proc.stderr else ""
        return (
            f"a worker process judging the trace (pid {proc.pid}) ended without a word at "
            f"{where} (exit {status})" + (f": {said}" if said else "; out of memory?")
        )

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()  # end of the chunks: the worker returns
        for proc in self.procs:
            proc.wait(kill=bool(self.waiting))  # stopped early (an error): answers unwanted
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self.procs = []

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _failed(payload: bytes) -> str:
    return f"a worker judging the trace failed at {payload.decode('utf-8', 'replace')}"


def feed_files(
    stream: TraceStream, files: list[Path], workers: int, chunk: int = READ_CHUNK
) -> list[dict[str, Any]]:
    """feed_file() of each file in order, the chunks checked by `workers` processes once the
    stream's block size and KV bytes per token are known (until then, and with workers < 2,
    here). Returns the torn last lines' problems."""
    torn: list[dict[str, Any]] = []
    workers = _worth(files, workers, chunk)
    pool: Workers | None = None
    pending: deque[tuple[Path, int, int]] = deque()  # path, offset, size (for a reread)

    def fold() -> None:
        assert pool is not None
        path, offset, size = pending.popleft()
        got = pool.result()
        stream.absorb(str(path), got, lambda: read_span(path, offset, size))

    try:
        for path in files:
            if _piped(path):  # read once, as written: a pipe has no spans to hand out
                while pending:
                    fold()
                if (cut_line := feed_file(stream, path, chunk)) is not None:
                    torn.append(cut_line)
                continue
            for offset, size, line_no, cut in chunk_spans(path, chunk):
                if pool is None and workers >= 2 and _known(stream):
                    pool = Workers(workers, StreamCheck(_consts(stream)))
                if pool is None or cut:
                    while pending:
                        fold()
                    if cut:
                        torn.append(torn_line(stream, path, line_no, size))
                        break
                    stream.feed(str(path), read_span(path, offset, size), line_no)
                    continue
                pool.submit(str(path), offset, size, line_no)
                pending.append((path, offset, size))
                if len(pending) > AHEAD * workers:
                    fold()
        while pending:
            fold()
    finally:
        if pool is not None:
            pool.close()
    return torn


def _worth(files: list[Path], workers: int, chunk: int) -> int:
    """workers, or 1 when the files are no more than a chunk per worker (starting the
    processes would cost more than it saves)."""
    if workers < 2:
        return 1
    size = 0
    for path in files:
        with contextlib.suppress(OSError):  # a file that cannot be read fails where it is read
            size += path.stat().st_size
    return workers if size > workers * chunk else 1


def _piped(path: Path) -> bool:
    """Whether path is a FIFO (a shard piped in: `zcat shard.gz > FIFO`), which is read once,
    in order, here: a span of it cannot be read again, nor by another process."""
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False  # the reader names what is wrong with it


def _known(stream: TraceStream) -> bool:
    return stream.block_size is not None and stream.bytes_per_token is not None


def _consts(stream: TraceStream) -> dict[str, Any]:
    """What a worker's TraceStream needs to check chunks as this one would."""
    return {
        "topk": stream.topk,
        "layers": stream.layers if stream.layers_given else None,
        "block_size": stream.block_size,
        "bytes_per_token": stream.bytes_per_token,
        "exact": stream.exact,
        "topk_source": stream.topk_source,
    }


def map_chunks(
    files: list[Path],
    job: Callable[[str, list[bytes], int, bool], Any],
    workers: int,
    ready: Callable[[], bool],
    chunk: int = READ_CHUNK,
) -> Iterator[Any]:
    """job(path, lines, first line, torn) of every chunk of the files, in order: here while
    ready() says no (the job learns from its first chunks what it needs) or workers < 2
    (then each chunk is read once, by complete_lines: the same chunks, the same lines),
    then by `workers` processes, each handed a copy of the job as it is then."""

    def here(path: Path) -> Iterator[Any]:
        """Every chunk of path read once, as complete_lines reads it (no spans first)."""
        for line_no, lines, torn in complete_lines(path, chunk):
            yield job(str(path), lines, line_no, torn)  # type: ignore[arg-type]

    workers = _worth(files, workers, chunk)
    if workers < 2:
        for path in files:
            yield from here(path)
        return
    pool: Workers | None = None
    pending = 0
    try:
        for path in files:
            if _piped(path):  # read once, as written: a pipe has no spans to hand out
                while pending:
                    pending -= 1
                    yield pool.result()  # type: ignore[union-attr]
                yield from here(path)
                continue
            for offset, size, line_no, torn in chunk_spans(path, chunk):
                if pool is None and workers >= 2 and ready():
                    pool = Workers(workers, job)
                if pool is None:
                    yield job(str(path), read_span(path, offset, size), line_no, torn)
                    continue
                pool.submit(str(path), offset, size, line_no, torn)
                pending += 1
                if pending > AHEAD * workers:
                    pending -= 1
                    yield pool.result()
        while pending:
            pending -= 1
            yield pool.result()  # type: ignore[union-attr]
    finally:
        if pool is not None:
            pool.close()
