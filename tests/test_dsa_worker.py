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


def test_a_batch_fed_out_of_its_submitted_order_is_refused(tmp_path: Path) -> None:
    batches = _batches(write_trace(tmp_path / "t"))
    feeder = BookFeeder(TraceBook(32))
    try:
        feeder.submit(*batches[0])
        feeder.submit(*batches[1])
        with pytest.raises(RuntimeError, match="out of the order"):
            feeder.feed(*batches[1])
        with pytest.raises(RuntimeError, match="more than 2"):
            feeder.submit(*batches[2])
    finally:
        feeder.close()


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
