"""A link cut while a trace is read ahead loses and repeats no line (the follower hands each batch
to the judge as soon as it is read, and reads a backlog in several chunks per poll)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from dsa_writer import write_trace

from runners.cells import PlannedCell
from runners.events import Event, TraceBatch
from runners.follow import CHUNK, POLL_BYTES, FileFollower
from runners.follower import RunFollower
from runners.kind import JudgeContext
from runners.kinds import all_kinds, load_preset
from runners.plan import RunPlan, TraceFile
from runners.presets import resolve_preset
from runners.targets.base import ConnectionLost
from runners.targets.local import LocalTarget


class CutOnce(LocalTarget):
    """This machine's files, and one link cut: the first read of `path` at `at` or past it."""

    def __init__(self, path: str, at: int | None) -> None:
        super().__init__()
        self.path, self.at = path, at

    async def read_from(self, path: str, offset: int, max_bytes: int) -> bytes | None:
        if self.at is not None and path == self.path and offset >= self.at:
            self.at = None
            raise ConnectionLost("the link was cut (test)")
        return await super().read_from(path, offset, max_bytes)


# one shard of ~2,000-position records, a few POLL_BYTES long
BIG: dict[str, Any] = {
    "requests": 2, "per_file": 2, "layers": 3, "steps": 150, "prompt": 2000, "topk": 2000, "bs": 16
}  # fmt: skip


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One shard of ~2,000-position records, a few POLL_BYTES long."""
    folder = write_trace(tmp_path_factory.mktemp("trace"), **BIG)
    [path] = sorted(folder.glob("trace_steps_*.jsonl"))
    assert path.stat().st_size > 2 * POLL_BYTES + CHUNK
    return path


def test_a_poll_cut_after_its_first_chunk_hands_those_lines_out_next_time(shard: Path) -> None:
    async def go() -> list[bytes]:
        follower = FileFollower(CutOnce(str(shard), CHUNK), str(shard))
        got: list[bytes] = []
        with pytest.raises(ConnectionLost):
            while (lines := await follower.poll()) is not None:
                got += lines.lines
        assert follower.offset == 0 and follower.lines_read == 0  # nothing handed out, kept
        while (lines := await follower.poll()) is not None:
            assert lines.first_line == len(got) + 1
            got += lines.lines
        return got

    assert asyncio.run(go()) == shard.read_bytes().splitlines()


def _follow(shard: Path, tmp: Path, cut_at: int | None) -> list[TraceBatch]:
    """A DSA judge (its helper process, batches handed over ahead) fed by a follower of one
    cell's shard, the link cut once at cut_at and the pass tried again, as a member does."""
    preset = load_preset(resolve_preset("dsa_smoke"), ["vars.topk=2000", "dsa.topk=2000"])
    events: list[Event] = []
    ctx = JudgeContext(preset=preset, local_dir=tmp, date="d", emit=events.append)
    ctx.cells = [PlannedCell(0, {}, "true", {})]
    judge: Any = all_kinds()["dsa_trace"].judge(ctx)
    plan = RunPlan(
        run_id="r", run_dir=str(tmp / "run"), workdir=str(tmp), lock=str(tmp / "lock"),
        python=sys.executable, setup=[], cells=ctx.cells, traces=(TraceFile(str(shard), 0),),
    )  # fmt: skip
    follower = RunFollower(CutOnce(str(shard), cut_at), plan, judge, tmp, events.append)
    track = follower.cells[0]
    track.started = 1.0
    cuts = 0

    async def go() -> None:
        nonlocal cuts
        while True:
            try:
                await follower.drain_started()
            except ConnectionLost:
                cuts += 1
                continue
            if follower.traces[str(shard)].caught_up:
                return

    try:
        asyncio.run(go())
    finally:
        judge.feeder.close()
    assert cuts == (cut_at is not None)
    assert judge.feeder.helper_error == "closed"  # judged in the helper throughout
    return [e for e in events if isinstance(e, TraceBatch)]


@pytest.mark.parametrize("cut_at", [POLL_BYTES, POLL_BYTES + CHUNK + CHUNK // 2])
def test_a_cut_while_a_batch_is_judged_ahead_loses_and_repeats_nothing(
    shard: Path, tmp_path: Path, cut_at: int
) -> None:
    """Cut at the first read of the pass's second batch (the first one handed to the judge and
    not yet emitted), or in the middle of that batch's reads: the batches recorded are those of
    a follow with no cut, digests and all."""
    whole = _follow(shard, tmp_path / "whole", None)
    cut = _follow(shard, tmp_path / "cut", cut_at)
    lines = len(shard.read_bytes().splitlines())
    assert len(whole) > 2 and [(b.first_line, b.last_line) for b in whole][-1][1] == lines
    firsts = [b.first_line for b in cut]
    assert firsts == [1] + [b.last_line + 1 for b in cut[:-1]] and cut[-1].last_line == lines
    assert [_recorded(b) for b in cut] == [_recorded(b) for b in whole]


def _recorded(batch: TraceBatch) -> bytes:
    """The batch as the record keeps it, less the time it was read."""
    return orjson.dumps({k: v for k, v in batch.to_dict().items() if k != "t"})


def test_two_hosts_followed_at_once_share_one_dsa_judge_as_a_fleet_does(tmp_path: Path) -> None:
    """A fleet's members follow their hosts concurrently, each its own cell's traces, into the
    run's one judge (its helper holding batches of both): each trace is judged whole, to the
    offline verdict (one of them lying)."""
    from analysis.dsa_tree import analyze_block, read_summary, trace_verdict

    # each a few POLL_BYTES: several batches a pass, the helper holding both's
    folders = [write_trace(tmp_path / host, **BIG) for host in ("host-a", "host-b")]
    shard = sorted(folders[1].glob("trace_steps_*.jsonl"))[0]
    assert shard.stat().st_size > 2 * POLL_BYTES
    lines = shard.read_text().splitlines()
    lines[200] = lines[200].replace('"unique_blocks": ', '"unique_blocks": 1', 1)  # a lie
    shard.write_text("\n".join(lines) + "\n")
    preset = load_preset(resolve_preset("dsa_smoke"), ["vars.topk=2000", "dsa.topk=2000"])
    events: list[Event] = []

    def emit(event: Event) -> None:  # as the run's one event path: recorded, then folded
        events.append(event)
        judge.fold(event)

    ctx = JudgeContext(preset=preset, local_dir=tmp_path, date="d", emit=emit)
    ctx.cells = [PlannedCell(0, {}, "true", {}), PlannedCell(1, {}, "true", {})]
    judge: Any = all_kinds()["dsa_trace"].judge(ctx)
    followers = []
    for cell, folder in enumerate(folders):
        plan = RunPlan(
            run_id="r", run_dir=str(tmp_path / f"run{cell}"), workdir=str(tmp_path),
            lock=str(tmp_path / "lock"), python=sys.executable, setup=[], cells=[ctx.cells[cell]],
            traces=(TraceFile(f"{folder}/trace_steps_*.jsonl", cell),),
        )  # fmt: skip
        follower = RunFollower(LocalTarget(), plan, judge, tmp_path, emit)
        follower.cells[cell].started = 1.0
        followers.append(follower)

    async def drive(follower: RunFollower) -> None:
        while not follower.traces or not all(f.caught_up for f in follower.traces.values()):
            await follower.poll()
            await asyncio.sleep(0)
        await follower.drain_rest()

    async def go() -> None:
        await asyncio.gather(*(drive(f) for f in followers))

    try:
        asyncio.run(go())
        assert judge.feeder.helper_error == ""  # judged in the helper throughout
    finally:
        judge.feeder.close()
    for folder in folders:
        offline = analyze_block(folder, 2000, None)
        engine, why = read_summary(folder / "summary.json")
        stream = judge.book.streams[str(folder)]
        live = trace_verdict(str(folder), stream, engine, why, None, None)
        assert (live["records"], live["invalid"]) == (offline["records"], offline["invalid"])
        assert live["verdict"] == offline["verdict"]
    assert [analyze_block(f, 2000, None)["verdict"] for f in folders] == [
        "TRACE_OK",
        "TRACE_INVALID",
    ]
