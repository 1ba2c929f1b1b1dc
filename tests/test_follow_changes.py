"""A followed file that changes under its follower: cut shorter or rewritten, a long line's read
size across a link cut, a size recorded inside a line. Nothing read is lost or misnamed, and a
file that no longer holds what was judged is said to (never judged as if it did)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dsa_writer import write_trace

import runners.follow as follow
from runners.cells import PlannedCell
from runners.events import Error, Event
from runners.follow import FileFollower
from runners.follower import RunFollower
from runners.kind import Ending, JudgeContext
from runners.kinds import all_kinds, load_preset
from runners.plan import RunPlan, TraceFile
from runners.presets import resolve_preset
from runners.targets.base import ConnectionLost
from runners.targets.local import LocalTarget


async def _read_all(follower: FileFollower) -> list[bytes]:
    """Every line, polling again after each link cut."""
    got: list[bytes] = []
    while True:
        try:
            lines = await follower.poll()
        except ConnectionLost:
            continue
        if lines is None:
            return got
        got += lines.lines


class CutWhenGrown(LocalTarget):
    """One link cut: the first read made once the follower's read size has grown past `size`."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size: int | None = size
        self.follower: FileFollower | None = None

    async def read_from(self, path: str, offset: int, max_bytes: int) -> bytes | None:
        assert self.follower is not None
        if self.size is not None and self.follower._chunk > self.size:
            self.size = None
            raise ConnectionLost("the link was cut (test)")
        return await super().read_from(path, offset, max_bytes)


@pytest.mark.parametrize("grown", [128, 4096])
def test_a_cut_after_a_long_line_grew_the_read_size_reads_the_lines_again_as_they_are(
    grown: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read size grows for a line longer than a chunk; when that line (or one past
    MAX_LINE) comes after short ones in the same poll and the link is cut, the short ones are
    read again whole: not handed out in place of the oversize line."""
    monkeypatch.setattr(follow, "CHUNK", 64)
    monkeypatch.setattr(follow, "MAX_LINE", 4096)
    lines = [b'{"line": 1}', b'{"line": 2}', b"x" * (1500 if grown < 4096 else 10_000), b"{}"]
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    target = CutWhenGrown(grown)  # 4096: cut while the oversize line's newline is sought
    target.follower = follower = FileFollower(target, str(path))
    got = asyncio.run(_read_all(follower))
    want = lines if grown < 4096 else [*lines[:2], follow.oversize_line(3, 10_000), lines[3]]
    assert got == want


def test_a_size_recorded_inside_a_line_stops_there_without_calling_the_line_oversize(
    tmp_path: Path,
) -> None:
    """A shared trace's size recorded at a cell's end can fall inside a line (its writer died
    mid-line): the poll up to it hands out the lines before, the next one the rest."""
    lines = [b'{"line": 1}', b'{"line": 2, "pad": "' + b"z" * 100 + b'"}', b'{"line": 3}']
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    follower = FileFollower(LocalTarget(), str(path))
    until = len(lines[0]) + 1 + 30

    async def go() -> tuple[list[bytes], list[bytes]]:
        head = await follower.poll(until=until)
        assert await follower.poll(until=until) is None and follower._chunk == follow.CHUNK
        rest = await follower.poll()
        assert head is not None and rest is not None
        return head.lines, rest.lines

    assert asyncio.run(go()) == (lines[:1], lines[1:])


def _follow_dsa(
    folder: Path,
    tmp_path: Path,
    meanwhile: Callable[[], None] = lambda: None,
    traces: tuple[str, ...] = ("trace_steps_*.jsonl",),
) -> tuple[Any, list[Event]]:
    """A DSA judge (its helper) and a follower of the directory's shards, as a run has them:
    followed until caught up, then meanwhile(), then to the run's end. The judge and every
    event emitted (each folded into the judge, as the run's one event path does)."""
    preset = load_preset(resolve_preset("dsa_smoke"), ["vars.topk=32", "dsa.topk=32"])
    events: list[Event] = []
    judge: Any = None

    def emit(event: Event) -> None:
        events.append(event)
        judge.fold(event)

    ctx = JudgeContext(preset=preset, local_dir=tmp_path, date="d", emit=emit)
    ctx.cells = [PlannedCell(0, {}, "true", {})]
    judge = all_kinds()["dsa_trace"].judge(ctx)
    plan = RunPlan(
        run_id="r", run_dir=str(tmp_path / "run"), workdir=str(tmp_path),
        lock=str(tmp_path / "lock"), python=sys.executable, setup=[], cells=ctx.cells,
        traces=tuple(TraceFile(f"{folder}/{name}", 0) for name in traces),
    )  # fmt: skip
    follower = RunFollower(LocalTarget(), plan, judge, tmp_path, emit)
    follower.cells[0].started = 1.0

    async def go() -> None:
        while not follower.traces or not all(f.caught_up for f in follower.traces.values()):
            await follower.poll()
        meanwhile()
        await follower.poll()
        await follower.drain_rest()

    try:
        asyncio.run(go())
    finally:
        judge.feeder.close()
    return judge, events


@pytest.mark.parametrize("how", ["shorter", "rewritten", "gone"])
def test_a_trace_changed_under_its_follower_is_an_error_that_fails_the_run(
    how: str, tmp_path: Path
) -> None:
    """A DSA shard read whole, then deleted and written again (compact: shorter; or the same
    length with one record changed), or deleted: the run's end says so, naming the file, and
    the verdict is not TRACE_OK (what was judged is not the trace)."""
    folder = write_trace(tmp_path / "artifacts" / "dsa")
    shard = folder / "trace_steps_2_4.jsonl"
    size = shard.stat().st_size

    def change() -> None:
        records = [json.loads(line) for line in shard.read_bytes().splitlines()]
        records[3]["unique_blocks"] += 1  # a lie the follower never reads
        os.unlink(shard)
        if how == "shorter":
            shard.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
        elif how == "rewritten":
            text = "".join(json.dumps(r) + "\n" for r in records)
            shard.write_text(text[1:] + " ")  # each newline one byte early

    judge, events = _follow_dsa(folder, tmp_path, change)
    assert judge.trace_applied[str(shard)] == size  # read whole before the change
    said = [e for e in events if isinstance(e, Error) and e.where == str(shard)]
    assert len(said) == 1 and said[0].affects_verdict, [e.message for e in events]
    assert "while it was followed (truncated or rewritten)" in said[0].message
    word = {"shorter": "shorter than", "rewritten": "rewritten", "gone": "gone"}[how]
    assert word in said[0].message
    judge.fold(_finished(0))
    assert judge.verdict(Ending("done")).verdict != "TRACE_OK"


def _finished(cell: int) -> Event:
    from runners.cells import CellState
    from runners.events import CellFinished

    return CellFinished(cell=cell, state=CellState.PASSED, exit_code=0, duration_s=1.0)


def _live_and_offline(folder: Path, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trace directory followed live to the run's end, and judged by analyze: both
    verdicts."""
    from analysis.dsa_tree import analyze_block, read_summary, trace_verdict

    judge, _ = _follow_dsa(folder, tmp_path)
    engine, why = read_summary(folder / "summary.json")
    live = trace_verdict(str(folder), judge.book.streams[str(folder)], engine, why, None, None)
    return live, analyze_block(folder, 32, None)


@pytest.mark.parametrize("tail", ["json", "cut", "spaces"])
def test_a_shard_s_last_line_with_no_newline_is_judged_live_as_analyze_judges_it(
    tail: str, tmp_path: Path
) -> None:
    """At the run's end a DSA shard's last line has no newline (a complete record, one cut
    mid-line, or blanks): live, it is the one invalid record analyze counts there, with the
    same reason: the counts, the verdict and the first failure are analyze's."""
    folder = write_trace(tmp_path / "artifacts" / "dsa")
    shard = folder / "trace_steps_4_5.jsonl"
    data = shard.read_bytes()
    shard.write_bytes(
        {"json": data.rstrip(b"\n"), "cut": data[:-500], "spaces": data + b"   "}[tail]
    )
    live, offline = _live_and_offline(folder, tmp_path)
    for key in ("verdict", "records", "invalid", "first_fail", "problems"):
        assert live[key] == offline[key], key
    assert offline["verdict"] == "TRACE_INVALID"
    line = 10 if tail == "spaces" else 9  # the blanks are a line after the shard's 9 records
    assert offline["first_fail"]["line"] == line and "no newline" in offline["first_fail"]["found"]


@pytest.mark.parametrize("empty", ["trace_steps_6_8.jsonl", "trace_steps_4_5.jsonl"])
def test_an_empty_shard_is_a_shard_live_as_in_analyze(empty: str, tmp_path: Path) -> None:
    """A shard the engine made and never wrote (one past the requests, or one emptied) is one
    of the directory's shards live too: the same problems, the same verdict as analyze."""
    folder = write_trace(tmp_path / "artifacts" / "dsa")
    (folder / empty).write_bytes(b"")
    live, offline = _live_and_offline(folder, tmp_path)
    assert offline["verdict"] == "TRACE_INVALID"
    for key in ("verdict", "records", "invalid", "first_fail", "problems"):
        assert live[key] == offline[key], key


@pytest.mark.parametrize(
    "serving",
    [b'{"latency_ms": 1.5}\r{"latency_ms": 2.5}\n{"latency_ms": 3.0}\n',
     b'{"latency_ms": 1.5}\n{"latency_ms": 2.5}\n{"latency_ms": 3.',
     b'{"latency_ms": 1.5}\n{"latency_ms": 2.5}\n{"latency_ms": NaN}',
     b'{"latency_ms": 1.5}\n{"latency_ms": 2.5}\n{"latency_ms": 3.0}'],
)  # fmt: skip
def test_serving_jsonl_is_split_and_its_last_line_read_live_as_analyze_does(
    serving: bytes, tmp_path: Path
) -> None:
    """serving.jsonl's lines end at a newline only, and its last line without one is a line
    like any (good or bad), live as in analyze."""
    from analysis.dsa_tree import analyze_block, read_summary, serving_stats, trace_verdict

    folder = write_trace(tmp_path / "artifacts" / "dsa")
    (folder / "serving.jsonl").write_bytes(serving)
    judge, _ = _follow_dsa(folder, tmp_path, traces=("trace_steps_*.jsonl", "serving.jsonl"))
    live_stats = judge.book.serving_stats(str(folder))
    assert live_stats == serving_stats(folder / "serving.jsonl")
    engine, why = read_summary(folder / "summary.json")
    live = trace_verdict(
        str(folder), judge.book.streams[str(folder)], engine, why, None, live_stats
    )
    offline = analyze_block(folder, 32, None)
    assert (live["verdict"], live["problems"]) == (offline["verdict"], offline["problems"])


def test_a_trace_seen_empty_and_gone_at_the_end_is_said_not_judged_as_a_shard(
    tmp_path: Path,
) -> None:
    folder = write_trace(tmp_path / "artifacts" / "dsa")
    extra = folder / "trace_steps_6_8.jsonl"
    extra.write_bytes(b"")
    judge, events = _follow_dsa(folder, tmp_path, extra.unlink)
    said = [e for e in events if isinstance(e, Error) and e.where == str(extra)]
    assert len(said) == 1 and "it is gone while it was followed" in said[0].message
    assert str(extra) not in judge.book.streams[str(folder)].files
