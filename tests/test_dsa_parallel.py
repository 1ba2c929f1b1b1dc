"""DSA judging spread over worker processes: the single-process path's verdict, to the record."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
from dsa_writer import write_trace
from runhelp import wait_for

from analysis.dsa_lines import chunk_spans, complete_lines, read_span
from analysis.dsa_parallel import StreamCheck, WorkerError, Workers, feed_files
from analysis.dsa_stream import TraceStream
from analysis.dsa_tree import analyze_block, feed_file, shard_files


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\n",
        b"a\n",
        b"a\nbb\n\nccc\n",
        b"a\nbb\nccc",  # a torn last line
        b"x" * 100 + b"\n" + b"y" * 3 + b"\n" + b"z" * 50,  # lines longer than a chunk
        b"\n\n\n" + b"q" * 20 + b"\n\n",
    ],
)
def test_chunk_spans_are_complete_lines_chunks(data: bytes, chunk: int, tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(data)
    spans = [
        (line_no, read_span(path, offset, size), torn)
        for offset, size, line_no, torn in chunk_spans(path, chunk)
    ]
    assert spans == list(complete_lines(path, chunk))


def _edit(path: Path, line: int, change) -> None:  # type: ignore[no-untyped-def]
    lines = path.read_text().splitlines()
    rec = json.loads(lines[line - 1])
    change(rec)
    lines[line - 1] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")


def _planted(root: Path) -> Path:
    """A trace of 4 shards with invalid records of every sort the stream finds: per record
    (a value, unreadable JSON), across records (a repeated layer, a step's latency vote), a
    request in the wrong shard, a torn last line."""
    folder = write_trace(root, requests=8, per_file=2, layers=3, steps=5, topk=24)
    shards = shard_files(folder)
    _edit(shards[0], 7, lambda r: r.__setitem__("unique_token_pos_count", 1))
    _edit(shards[1], 4, lambda r: r.__setitem__("layer_id", 0))  # valid alone; repeats layer 0
    _edit(shards[1], 20, lambda r: r["kv_fetch"]["hbm"].__setitem__("latency_us", 1))
    _edit(shards[2], 9, lambda r: r.__setitem__("request_id", 1))  # request 1 is shard 0's
    lines = shards[2].read_text().splitlines()
    lines[12] = lines[12][:-40] + "garbage"
    shards[2].write_text("\n".join(lines) + "\n")
    data = shards[3].read_bytes()
    shards[3].write_bytes(data[: len(data) - 300])  # the writer stopped mid-line
    return folder


@pytest.mark.parametrize("known", [True, False])
def test_workers_mark_every_record_as_one_process_does(known: bool, tmp_path: Path) -> None:
    folder = _planted(tmp_path / "t")
    files = shard_files(folder)
    consts = {"topk": 24, "layers": 3} if known else {}

    def stream() -> TraceStream:
        return TraceStream(block_size=16, live_view=False, marks=[], **consts)  # type: ignore[arg-type]

    one = stream()
    torn = [t for f in files if (t := feed_file(one, f, chunk=4000)) is not None]
    for workers in (2, 3):
        many = stream()
        assert feed_files(many, files, workers, chunk=4000) == torn
        assert many.marks == one.marks and len(one.marks or []) >= 4
        assert (many.records, many.invalid, many.first) == (one.records, one.invalid, one.first)
        assert many.votes == one.votes and many.files == one.files
        assert {k: v.state() for k, v in many.reqs.items()} == {
            k: v.state() for k, v in one.reqs.items()
        }
        assert many.summary.increment() == one.summary.increment()
        assert many.finish(8, None) == one.finish(8, None)
        assert many.end_invalid == one.end_invalid and many.topk == one.topk


def test_analyze_on_workers_is_the_single_process_verdict(tmp_path: Path) -> None:
    folder = _planted(tmp_path / "t")
    one = analyze_block(folder, None, None, 1, chunk=4000)
    assert one["verdict"] == "TRACE_INVALID" and one["invalid"] >= 5
    assert one["first_fail"]["line"] == 7 and one["first_fail"]["field"] == "unique_token_pos_count"
    for workers in (2, 3):
        assert analyze_block(folder, None, None, workers, chunk=4000) == one
    clean = write_trace(tmp_path / "clean", requests=6, per_file=2)
    ok = analyze_block(clean, None, None, 1, chunk=2000)
    assert ok["verdict"] == "TRACE_OK"
    assert analyze_block(clean, None, None, 2, chunk=2000) == ok


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_worker_that_dies_is_an_error_never_a_verdict(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    path = shard_files(folder)[0]
    offset, size, line_no, _ = next(chunk_spans(path))
    consts = {"topk": 32, "layers": 3, "block_size": 16, "bytes_per_token": 0}
    with Workers(2, StreamCheck(consts)) as pool:
        pool.submit(str(path), offset, size, line_no)
        got = pool.result()  # a live worker answers
        assert (got.first_line, got.lines) == (line_no, len(read_span(path, offset, size)))
        os.kill(pool.pids[1], signal.SIGKILL)
        while not _zombie(pool.pids[1]):  # dead, not yet waited for
            os.sched_yield()
        with pytest.raises(WorkerError, match="ended without a word"):
            pool.submit(str(path), offset, size, line_no)  # worker 1's turn
            pool.result()


def test_a_worker_that_failed_is_heard_even_when_the_next_chunk_finds_it_gone(
    tmp_path: Path,
) -> None:
    """Its error was sent before it ended, but the next chunk is handed to it first: the
    broken pipe still reports what the worker said, not a death 'without a word'."""
    consts = {"topk": 32, "layers": 3, "block_size": 16, "bytes_per_token": 0}
    gone = tmp_path / "removed.jsonl"
    with Workers(1, StreamCheck(consts)) as pool:
        pool.submit(str(gone), 0, 10, 1)  # the worker cannot read it: its error, then its end
        [pid] = pool.pids
        while not _zombie(pid):
            os.sched_yield()
        with pytest.raises(WorkerError) as info:
            pool.submit(str(gone), 10, 10, 2)
        assert f"failed at {gone}:1: FileNotFoundError" in str(info.value)


def test_int_lists_as_json_text_are_msgspecs_slices_and_nulls_included() -> None:
    import msgspec
    import pyarrow as pa

    from analysis.dsa_export import _int_lists_json

    lists = pa.array([[1, 2, 3], [], None, [-5, 10**12], [7]], type=pa.list_(pa.int64()))
    for arr in (lists, lists.slice(1, 3), lists.slice(2), lists.slice(4)):
        want = [None if v is None else msgspec.json.encode(v).decode() for v in arr.to_pylist()]
        assert _int_lists_json(arr).to_pylist() == want


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_export_on_workers_writes_the_single_process_file(fmt: str, tmp_path: Path) -> None:
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from analysis.dsa_scan import trace_info
    from console.dsa_data_cli import export_block

    folder = _planted(tmp_path / "t")
    one = export_block(trace_info(folder), tmp_path / f"1.{fmt}", fmt, 1, chunk=4000)
    many = export_block(trace_info(folder), tmp_path / f"2.{fmt}", fmt, 2, chunk=4000)
    assert one == many and one[1] == 3  # a value, a non-JSON line, a torn last line
    read = pq.read_table if fmt == "parquet" else pacsv.read_csv
    a, b = read(tmp_path / f"1.{fmt}"), read(tmp_path / f"2.{fmt}")
    assert a.num_rows == one[0] and a.equals(b)
    valid = a.column("valid").to_pylist()
    assert valid.count(False) == one[1]  # every invalid record marked, none dropped


@pytest.mark.parametrize("workers", [1, 2])
def test_csv_chunks_joined_are_one_writer_s_file_of_the_parquet_rows(
    workers: int, tmp_path: Path
) -> None:
    """Each chunk's csv text is made by the workers, or by one process's writer thread
    (header-less), and the export only appends them: the file is byte for byte what one csv writer makes of the whole export
    (the parquet export's rows, flattened), one header, every row, invalid ones marked."""
    import pyarrow.parquet as pq

    from analysis.dsa_export import csv_text, flat_for_csv
    from analysis.dsa_scan import trace_info
    from console.dsa_data_cli import export_block

    folder = _planted(tmp_path / "t")
    export_block(trace_info(folder), tmp_path / "t.parquet", "parquet", 1, chunk=4000)
    export_block(trace_info(folder), tmp_path / "t.csv", "csv", workers, chunk=4000)
    whole = csv_text(flat_for_csv(pq.read_table(tmp_path / "t.parquet")), header=True).to_pybytes()
    got = (tmp_path / "t.csv").read_bytes()
    assert got.count(b'"shard"') == 1 and got.startswith(b'"shard","line","valid"')
    assert got == whole


def test_whatif_on_workers_is_the_single_process_result(tmp_path: Path) -> None:
    from analysis.dsa_whatif import whatif_dir

    folder = _planted(tmp_path / "t")
    one = whatif_dir(str(folder), [4, 16, 64], workers=1, chunk=4000)
    assert one["invalid"] == 3 and one["used"] > 100
    assert whatif_dir(str(folder), [4, 16, 64], workers=2, chunk=4000) == one


def test_beside_other_threads_the_workers_are_spawned_and_judge_the_same(tmp_path: Path) -> None:
    import threading

    folder = _planted(tmp_path / "t")
    one = analyze_block(folder, None, None, 1, chunk=4000)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # a fork beside it could copy a held lock
    other.start()
    try:
        with Workers(1, StreamCheck({})) as pool:
            [pid] = pool.pids
            ours = Path("/proc/self/cmdline").read_bytes()

            def execed() -> bytes:  # empty, or ours, until the child's exec is done
                line = Path(f"/proc/{pid}/cmdline").read_bytes()
                return line if line and line != ours else b""

            # a fresh interpreter, not a fork (a fork keeps this process's command line)
            assert b"analysis.dsa_parallel" in wait_for(execed, what="the worker's exec")
        assert analyze_block(folder, None, None, 2, chunk=4000) == one
    finally:
        stop.set()
        other.join()


@pytest.mark.parametrize(("policy", "size"), [("lru", None), ("prefix-pinned", 4)])
def test_tiers_on_workers_replay_what_one_process_does(
    policy: str, size: int | None, tmp_path: Path
) -> None:
    from analysis.dsa_tiers import tiers_dir

    folder = _planted(tmp_path / "t")
    one = tiers_dir(str(folder), [2, 8, 64], policy, block_size=size, workers=1, chunk=4000)
    assert one["invalid"] == 3 and one["used"] > 100 and one["first_invalid"]
    many = tiers_dir(str(folder), [2, 8, 64], policy, block_size=size, workers=2, chunk=4000)
    assert many == one


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as fh:
            out += [int(c) for c in fh.read().split()]
    return out


def test_a_worker_killed_mid_trace_stops_analyze_with_an_error(tmp_path: Path) -> None:
    import threading

    folder = _planted(tmp_path / "t")
    killed: list[int] = []
    done = threading.Event()
    # children this process had before (a session's sshd fixture is one): never the target
    before = set(_children(os.getpid()))

    def kill_first_worker() -> None:  # beside this thread the workers are spawned: slow to
        while not done.is_set() and not killed:  # start, so the kill comes before their answers
            for child in _children(os.getpid()):
                if child in before:
                    continue
                os.kill(child, signal.SIGKILL)
                killed.append(child)
                break

    killer = threading.Thread(target=kill_first_worker)
    killer.start()
    try:
        with pytest.raises(WorkerError, match="ended without a word"):
            analyze_block(folder, None, None, 2, chunk=4000)
    finally:
        done.set()
        killer.join()
    assert killed


def test_workers_start_only_for_more_than_a_chunk_each(tmp_path: Path) -> None:
    from analysis.dsa_parallel import _worth

    files = shard_files(_planted(tmp_path / "t"))
    size = sum(f.stat().st_size for f in files)
    assert _worth(files, 3, 4000) == 3 and _worth(files, 2, 4000) == 2  # the tests above
    assert _worth(files, 2, size // 2 + 1) == 1 and _worth(files, 1, 1) == 1


def _piped_in(shard: Path) -> threading.Thread:
    """shard replaced by a FIFO that a thread writes its lines into (`zcat shard.gz > FIFO`).
    The writer's end is open before the judge opens it; the shard is more than a pipe holds,
    so the writer ends (and closes its end) only once the judge has read it."""
    data = shard.read_bytes()
    assert len(data) > 4 * 65536, "a shard larger than the pipe's buffer"
    shard.unlink()
    os.mkfifo(shard)
    fd = os.open(shard, os.O_RDWR)  # a FIFO's O_RDWR never waits for a reader

    def write() -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    return writer


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("which", [0, 1, -1])
def test_a_shard_piped_in_is_judged_as_the_file_it_carries(
    tmp_path: Path, workers: int, which: int
) -> None:
    """A FIFO shard is read once, in order, by the judging process (its spans cannot be read
    again by a worker); the other shards' chunks still go to the workers."""
    folder = write_trace(tmp_path / "t", requests=8, per_file=2, layers=3, steps=40, topk=24)
    broken = shard_files(folder)[2]
    lines = broken.read_text().splitlines()
    rec = json.loads(lines[4])
    rec["unique_blocks"] += 1
    lines[4] = json.dumps(rec)
    broken.write_text("\n".join(lines) + "\n")
    want = analyze_block(folder, None, None, 1, chunk=4000)
    assert want["verdict"] != "TRACE_OK" and want["first_fail"]["line"] == 5
    writer = _piped_in(shard_files(folder)[which])
    got = analyze_block(folder, None, None, workers, chunk=4000)
    writer.join(timeout=60)
    assert not writer.is_alive()
    assert got == want


def test_tiers_with_a_shard_piped_in_replay_what_one_process_does(tmp_path: Path) -> None:
    """map_chunks' consumers (tiers, what-if, export) read a FIFO shard once, here."""
    from analysis.dsa_tiers import tiers_dir

    folder = write_trace(tmp_path / "t", requests=8, per_file=2, layers=3, steps=40, topk=24)
    one = tiers_dir(str(folder), [2, 8, 64], "lru", workers=1, chunk=4000)
    assert one["used"] > 100
    writer = _piped_in(shard_files(folder)[1])
    many = tiers_dir(str(folder), [2, 8, 64], "lru", workers=2, chunk=4000)
    writer.join(timeout=60)
    assert not writer.is_alive()
    assert many == one
