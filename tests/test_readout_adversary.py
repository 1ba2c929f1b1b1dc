"""Readout traces an adversarial round found judged differently live and by analyze, or passed:
each line handed to the live judge as its own batch (a slow engine), the same file analyzed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_readout_liars import honest, verdict_of

from runners.cells import CellState, PlannedCell
from runners.events import CellFinished, Error, Event
from runners.kind import Ending, JudgeContext
from runners.kinds import all_kinds, load_preset
from runners.presets import resolve_preset


def live_verdict(path: Path, tmp_path: Path) -> tuple[str, list[str]]:
    """The readout judge fed the file's lines one batch each, as followed: its verdict word and
    the errors it said."""
    preset = load_preset(resolve_preset("b3_12_readout_greta"), [])
    errors: list[str] = []
    judge: Any = None

    def emit(event: Event) -> None:
        judge.fold(event)

    ctx = JudgeContext(preset=preset, local_dir=tmp_path, date="d", emit=emit)
    ctx.cells = [PlannedCell(0, {}, "true", {})]
    judge = all_kinds()["readout"].judge(ctx)
    data = path.read_bytes()
    offset = 0
    for n, raw in enumerate(data.split(b"\n")[:-1], start=1):
        offset += len(raw) + 1
        for message, where in judge.take_lines(0, str(path), [raw], n, offset).errors:
            errors.append(message)
            judge.fold(Error(message=message, where=where))
    judge.fold(CellFinished(cell=0, state=CellState.PASSED, exit_code=0, duration_s=1.0))
    return judge.verdict(Ending("done")).verdict, errors


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _dumps(line: dict[str, Any]) -> bytes:
    return json.dumps(line).encode()


def test_the_honest_pair_is_ok_live_and_in_analyze(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [_dumps(x) for x in honest()])
    assert verdict_of(path) == "OK" and live_verdict(path, tmp_path) == ("OK", [])


def test_seed_001_s_name_contradicting_seed_003_s_is_refused(tmp_path: Path) -> None:
    prefill, decode = honest()
    decode["top1"] = decode["top1_id"] + 1  # read by seed 001's name, decode0 differs
    path = _write(tmp_path / "t.jsonl", [_dumps(prefill), _dumps(decode)])
    assert verdict_of(path) == "refused"
    word, errors = live_verdict(path, tmp_path)
    assert word != "OK" and any("'top1' (seed 001's name)" in e for e in errors)


def test_a_value_nested_past_the_checks_depth_is_a_located_refusal(tmp_path: Path) -> None:
    prefill, decode = honest()
    deep = _dumps(decode)[:-1] + b', "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    path = _write(tmp_path / "t.jsonl", [_dumps(prefill), deep])
    assert verdict_of(path) == "refused"
    word, errors = live_verdict(path, tmp_path)
    assert word != "OK" and any(":2: a value nested deeper" in e for e in errors)


def test_a_repeated_decode_step_in_its_own_batch_is_refused_live_as_in_analyze(
    tmp_path: Path,
) -> None:
    prefill, decode = honest()
    again = dict(decode, tokens_total=decode["tokens_total"] + 1)  # its step still says 1
    path = _write(tmp_path / "t.jsonl", [_dumps(prefill), _dumps(decode), _dumps(again)])
    assert verdict_of(path) == "refused"
    word, errors = live_verdict(path, tmp_path)
    assert word != "OK" and any(":3: decode step 1 does not follow step 1" in e for e in errors)


def test_a_blank_line_inside_the_trace_is_no_ok_live_as_in_analyze(tmp_path: Path) -> None:
    prefill, decode = honest()
    path = _write(tmp_path / "t.jsonl", [_dumps(prefill), b"", _dumps(decode)])
    assert verdict_of(path) == "refused"
    word, errors = live_verdict(path, tmp_path)
    assert word != "OK" and any(":2: blank line inside the trace" in e for e in errors)


@pytest.mark.parametrize("tail", [b"", b"\n", b"\n\n"])
def test_blank_lines_at_the_end_are_allowed_live_as_in_analyze(tmp_path: Path, tail: bytes) -> None:
    path = _write(tmp_path / "t.jsonl", [_dumps(x) for x in honest()])
    path.write_bytes(path.read_bytes() + tail)
    assert verdict_of(path) == "OK" and live_verdict(path, tmp_path) == ("OK", [])


def test_a_single_token_decode_line_tagged_with_prefill_s_hidden_is_refused(
    tmp_path: Path,
) -> None:
    """Seed 003's fix: a single-token decode reads decode's own hidden, tagged
    decode_hidden_single_token; a line tagged with prefill's sequence read something else,
    whatever its top-1 says."""
    prefill, decode = honest()
    decode["hidden_source_tag"] = "prefill_hidden_seq"
    path = _write(tmp_path / "t.jsonl", [_dumps(prefill), _dumps(decode)])
    assert verdict_of(path) == "refused"
    word, errors = live_verdict(path, tmp_path)
    assert word != "OK" and any(":2: hidden_source_tag " in e for e in errors), errors
