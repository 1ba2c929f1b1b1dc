"""Issue 23: a DSA judge's batches judged in a helper process give what an in-process feed gives."""

from __future__ import annotations

import json
import os
from pathlib import Path

import orjson
import pytest
from dsa_writer import write_trace

from analysis.dsa_tree import read_summary, trace_verdict
from runners.dsa_worker import BookFeeder
from runners.kinds.dsa_trace import TraceBook

REMOTE = "/remote/run/artifacts/dsa/block16"


def _batches(folder: Path, size: int = 7) -> list[tuple[str, list[bytes], int]]:
    """Every shard's lines in batches of `size`, as the follower hands them to the judge."""
    out = []
    for shard in sorted(
        folder.glob("trace_steps_*.jsonl"), key=lambda p: int(p.name.split("_")[2])
    ):
        lines = shard.read_bytes().splitlines()
        for start in range(0, len(lines), size):
            out.append((f"{REMOTE}/{shard.name}", lines[start : start + size], start + 1))
    return out


def _verdict(book: TraceBook, folder: Path) -> dict:
    engine, why = read_summary(folder / "summary.json")
    [(name, stream)] = book.streams.items()
    return trace_verdict(name, stream, engine, why, None, book.serving_stats(name))


def _same_digest(
    feeder: BookFeeder, here: TraceBook, file: str, lines: list[bytes], first: int
) -> None:
    """The batch fed through the helper and here give the same digest, serialised when made as
    the recorder does: the digest recorded is the same bytes."""
    assert orjson.dumps(feeder.feed(file, lines, first)) == orjson.dumps(
        here.feed(file, lines, first)
    )


def _kill_helper(feeder: BookFeeder) -> None:
    helper = feeder._helper
    assert helper is not None
    helper.proc.kill()
    helper.proc.wait()


def _lying_trace(tmp_path: Path) -> Path:
    """A trace whose fourth record of the second shard claims a block it did not touch."""
    folder = write_trace(tmp_path / "t")
    shard = folder / "trace_steps_2_4.jsonl"
    lines = shard.read_text().splitlines()
    rec = json.loads(lines[3])
    rec["selected_block_ids"] = [*rec["selected_block_ids"], 9999]
    lines[3] = json.dumps(rec)
    shard.write_text("\n".join(lines) + "\n")
    return folder


def test_the_helper_judges_every_batch_as_this_process_would(tmp_path: Path) -> None:
    folder = _lying_trace(tmp_path)
    here, there = TraceBook(32), TraceBook(32)
    feeder = BookFeeder(there)
    try:
        for file, lines, first in _batches(folder):
            _same_digest(feeder, here, file, lines, first)
            helper = feeder._helper
            assert helper is not None and helper.proc.poll() is None
            assert helper.proc.pid != os.getpid()
        assert feeder.helper_error == ""
    finally:
        feeder.close()
    assert here.totals() == there.totals() and there.totals()["invalid"] >= 1
    assert there.first_fail() == here.first_fail()
    assert "trace_steps_2_4.jsonl:4" in there.first_fail()["message"]  # type: ignore[index]
    mine, theirs = _verdict(here, folder), _verdict(there, folder)
    assert theirs == mine and theirs["verdict"] == "TRACE_INVALID"
    assert feeder._helper is None  # closed: the helper has gone


def test_a_helper_that_dies_leaves_the_judging_here_with_the_same_results(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    here, there = TraceBook(32), TraceBook(32)
    feeder = BookFeeder(there)
    batches = _batches(folder)
    for file, lines, first in batches[:3]:
        _same_digest(feeder, here, file, lines, first)
    _kill_helper(feeder)
    for file, lines, first in batches[3:]:
        _same_digest(feeder, here, file, lines, first)
    assert "the judging process stopped" in feeder.helper_error
    assert feeder._helper is None
    mine, theirs = _verdict(here, folder), _verdict(there, folder)
    assert theirs == mine and theirs["verdict"] == "TRACE_OK"


def test_after_an_attach_the_helper_goes_on_from_the_recorded_state(tmp_path: Path) -> None:
    """A reattached judge's book holds the recorded digests (folded, not fed): the helper
    starts from that book, so the batches after it are judged as one unbroken stream."""
    folder = _lying_trace(tmp_path)
    batches = _batches(folder)
    here = TraceBook(32)
    recorded = [(file, here.feed(file, lines, first)) for file, lines, first in batches[:2]]
    recorded = [(file, orjson.loads(orjson.dumps(d))) for file, d in recorded]  # as recorded
    attached = TraceBook(32)
    for file, digest in recorded:
        attached.apply_data(file, digest)
    feeder = BookFeeder(attached)
    try:
        for file, lines, first in batches[2:]:  # from the middle of request 1
            _same_digest(feeder, here, file, lines, first)
        assert feeder.helper_error == "" and feeder._helper is not None
    finally:
        feeder.close()
    assert attached.totals() == here.totals()
    assert _verdict(attached, folder) == _verdict(here, folder)


def test_batches_submitted_ahead_are_judged_in_order_as_this_process_would(
    tmp_path: Path,
) -> None:
    """The follower hands a batch over as soon as it is read (submit) and collects it after
    emitting the one before (feed): the helper holds two at once, the digests are unchanged."""
    folder = _lying_trace(tmp_path)
    here, there = TraceBook(32), TraceBook(32)
    feeder = BookFeeder(there)
    batches = _batches(folder)
    try:
        feeder.submit(*batches[0])
        for i, (file, lines, first) in enumerate(batches):
            if i + 1 < len(batches):
                feeder.submit(*batches[i + 1])  # the next one, before this one is collected
                assert len(feeder._sent) == 2
            _same_digest(feeder, here, file, lines, first)
        assert feeder.helper_error == "" and not feeder._sent
    finally:
        feeder.close()
    assert there.totals() == here.totals() and there.first_fail() == here.first_fail()
    assert _verdict(there, folder) == _verdict(here, folder)


def _two_hosts(tmp_path: Path) -> list[list[tuple[str, list[bytes], int]]]:
    """Two traces as two hosts of a fleet write them (each its own directory), one lying."""
    a = _batches(_lying_trace(tmp_path / "a"))
    b = _batches(write_trace(tmp_path / "b" / "t"))
    return [[(f.replace(REMOTE, "/host-a" + REMOTE), ls, n) for f, ls, n in a],
            [(f.replace(REMOTE, "/host-b" + REMOTE), ls, n) for f, ls, n in b]]  # fmt: skip


@pytest.mark.parametrize("helper_dies_at", [None, 3, 8])
def test_two_followers_submitting_and_feeding_interleaved_get_their_own_digests(
    helper_dies_at: int | None, tmp_path: Path
) -> None:
    """A fleet's hosts share the run's judge: each follower submits its next batch ahead and
    feeds its own, interleaved with the other's (and past AHEAD, where submit does nothing).
    Every digest is what one in-process book makes of the batches in the order fed, and the
    helper dying midway changes none of them."""
    a, b = _two_hosts(tmp_path)
    here, there = TraceBook(32), TraceBook(32)
    feeder = BookFeeder(there)
    steps = 0
    try:
        for i in range(max(len(a), len(b))):
            mine = [batches[i] for batches in (a, b) if i < len(batches)]
            for batch in mine:
                feeder.submit(*batch)  # both hosts hand theirs over before either feeds
            nxt = [batches[i + 1] for batches in (a, b) if i + 1 < len(batches)]
            for batch in nxt:
                feeder.submit(*batch)  # and the next, past AHEAD: a no-op
            assert len(feeder._sent) <= 2
            for batch in reversed(mine):  # b's before a's: not the order submitted
                steps += 1
                if steps == helper_dies_at:
                    _kill_helper(feeder)
                _same_digest(feeder, here, *batch)
        assert not feeder._done
        if helper_dies_at is None:
            assert feeder.helper_error == ""
        else:
            assert "the judging process stopped" in feeder.helper_error
    finally:
        feeder.close()
    assert there.totals() == here.totals() and there.first_fail() == here.first_fail()


def test_a_batch_not_taken_ahead_keeps_its_directory_s_later_batches_behind_it(
    tmp_path: Path,
) -> None:
    """The helper is full (host b's two batches), so host a's first batch is not taken ahead;
    once there is room, a's second must still wait for its first (a directory's batches reach
    the helper in their order, or a's records would be judged out of order)."""
    a, b = _two_hosts(tmp_path)
    here, there = TraceBook(32), TraceBook(32)
    feeder = BookFeeder(there)
    try:
        feeder.submit(*b[0])
        feeder.submit(*b[1])
        feeder.submit(*a[0])  # no room: not taken
        _same_digest(feeder, here, *b[0])  # room for one
        feeder.submit(*a[1])
        assert [lines for _, lines in feeder._sent] == [b[1][1]]  # a[1] waits behind a[0]
        for batch in (a[0], a[1], b[1], *a[2:], *b[2:]):
            _same_digest(feeder, here, *batch)
        assert feeder.helper_error == "" and not feeder._owed and not feeder._done
    finally:
        feeder.close()
    assert there.totals() == here.totals() and there.first_fail() == here.first_fail()


def test_a_helper_that_dies_holding_two_batches_leaves_both_judged_here(tmp_path: Path) -> None:
    folder = _lying_trace(tmp_path)
    here, there = TraceBook(32), TraceBook(32)
    feeder = BookFeeder(there)
    batches = _batches(folder)
    for file, lines, first in batches[:2]:
        _same_digest(feeder, here, file, lines, first)
    feeder.submit(*batches[2])
    feeder.submit(*batches[3])
    _kill_helper(feeder)
    for file, lines, first in batches[2:]:  # the two it held, then the rest
        _same_digest(feeder, here, file, lines, first)
    assert "the judging process stopped" in feeder.helper_error and not feeder._sent
    assert _verdict(there, folder) == _verdict(here, folder)
    assert _verdict(there, folder)["verdict"] == "TRACE_INVALID"


def test_a_helper_that_stops_answering_is_killed_and_its_batch_judged_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped (SIGSTOP) helper holding a batch: feed() waits SILENCE_S at most, kills it and
    judges the batch here, with the digest this process makes; close() then returns too."""
    import signal

    import runners.dsa_worker as dsa_worker

    folder = _lying_trace(tmp_path)
    here, there = TraceBook(32), TraceBook(32)
    feeder = BookFeeder(there)
    batches = _batches(folder)
    try:
        _same_digest(feeder, here, *batches[0])  # the helper started (at any speed)
        helper = feeder._helper
        assert helper is not None
        monkeypatch.setattr(dsa_worker, "SILENCE_S", 0.5)  # only the stopped one is waited on
        os.kill(helper.proc.pid, signal.SIGSTOP)
        feeder.submit(*batches[1])
        for batch in batches[1:]:
            _same_digest(feeder, here, *batch)
        assert "no answer in 0.5 s: killed" in feeder.helper_error
        assert helper.proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        feeder.close()
    assert _verdict(there, folder) == _verdict(here, folder)


def test_the_first_invalid_record_is_said_by_its_batch_whoever_collected_it(
    tmp_path: Path,
) -> None:
    """Host b's batch holds its trace's first invalid record and is handed over ahead; host a's
    batch is collected first, which folds b's answer into the judge before b's own turn: b's
    batch still says 'first invalid DSA record', once."""
    from runners.cells import PlannedCell
    from runners.kind import JudgeContext
    from runners.kinds import all_kinds, load_preset
    from runners.presets import resolve_preset

    a, b = _two_hosts(tmp_path)  # a lies in its second shard; b is honest
    preset = load_preset(resolve_preset("dsa_smoke"), ["vars.topk=32", "dsa.topk=32"])
    ctx = JudgeContext(preset=preset, local_dir=tmp_path, date="d", emit=lambda e: None)
    ctx.cells = [PlannedCell(0, {}, "true", {}), PlannedCell(1, {}, "true", {})]
    judge = all_kinds()["dsa_trace"].judge(ctx)
    said: list[tuple[str, int]] = []
    try:
        for i in range(len(a)):
            judge.submit_lines(0, *a[i])  # host a's batch, ahead
            if i < len(b):
                file, lines, first = b[i]
                judge.take_lines(1, file, lines, first, 0)  # b's collected first: a's folded
            file, lines, first = a[i]
            for message, _ in judge.take_lines(0, file, lines, first, 0).errors:
                said.append((message, i))
    finally:
        judge.feeder.close()
    assert len(said) == 1 and "first invalid DSA record" in said[0][0], said
    assert "trace_steps_2_4.jsonl:4: " in said[0][0]  # the lie _lying_trace planted
