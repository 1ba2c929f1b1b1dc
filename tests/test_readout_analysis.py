"""Readout consistency judgement (seeds 001 B3.11 / 003 B3.12) on real and built traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from analysis.readout import (
    ReadoutAggregator,
    TraceError,
    analyze_trace,
    format_table,
    recomputed_mismatch,
    to_json,
)

SAMPLE = Path(__file__).resolve().parents[1] / "presets" / "samples" / "b3_12_mi300x.jsonl"


def rec(phase: str, step: int, top1: int, mismatch: bool = False, **extra: Any) -> dict[str, Any]:
    # A 10-token prompt: prefill_last has tokens_total 10, decode step s the token after it.
    record: dict[str, Any] = {
        "phase": phase,
        "step": step,
        "tokens_total": 10 + step + (phase == "decode"),
        "top1_id": top1,
        "top1_logit": 12.5,
        "top2_id": 18 if top1 != 18 else 19,
        "top2_logit": 11.0,
        "gap": 1.5,
        "readout_mismatch": mismatch,
    }
    record.update(extra)
    return record


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def rows_without_file(path: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k != "file"} for row in analyze_trace(path).rows()]


def trace_error(path: Path) -> TraceError:
    with pytest.raises(TraceError) as info:
        analyze_trace(path)
    return info.value


# --- the real MI300X lines of seed 003 ------------------------------------------------------


def test_seed_003_sample_reproduces_the_documented_findings() -> None:
    agg = analyze_trace(SAMPLE)
    first, second = agg.rows()

    assert first["prompt"] == "prompt 1"
    assert first["line"] == 1
    assert first["prefill_last_top1"] == 79
    assert first["decode0_top1"] == 96965
    assert first["decode0_gap"] == pytest.approx(1.41033)
    assert first["decode_steps"] == 1
    assert first["readout_mismatch_count"] == 0
    assert first["collapsed"] is False  # one decode step cannot show a collapse
    assert first["verdict"] == "NO OK"
    assert "79 != decode0_top1 96965" in first["note"]

    assert second["prompt"] == "prompt 2"
    assert second["line"] == 3
    assert second["prefill_last_top1"] == 79
    assert second["decode_steps"] == 0
    assert second["decode0_top1"] is None
    assert second["verdict"] is None
    assert second["note"] == "no decode step"

    assert agg.verdict() == "NO OK"
    assert "no decode step" in agg.reason()


def test_seed_003_sample_table_text() -> None:
    agg = analyze_trace(SAMPLE)
    assert format_table(agg.rows(), agg.verdict()) == (
        "| Prompt | prefill_last_top1 | decode0_top1 | readout_mismatch | verdict |\n"
        "| --- | --- | --- | --- | --- |\n"
        "| prompt 1 | 79 | 96965 | 0 | NO OK |\n"
        "| prompt 2 | 79 | no decode step | 0 | — |\n"
        "\n"
        "`readout_mismatch=true` count: **0**\n"
        "Verdict: **NO OK** — prompt 1 (line 1): prefill_last_top1 79 != decode0_top1 96965; "
        "prompt 2 (line 3): no decode step\n"
    )


def test_seed_003_sample_json() -> None:
    agg = analyze_trace(SAMPLE)
    out = to_json(agg.rows(), agg.verdict())
    assert out["verdict"] == "NO OK"
    assert out["readout_mismatch_count"] == 0
    assert [p["verdict"] for p in out["prompts"]] == ["NO OK", None]
    json.dumps(out)  # JSON-ready as it is


def test_line_by_line_gives_the_same_rows_as_the_whole_file() -> None:
    agg = ReadoutAggregator()
    changed: list[list[dict[str, Any]]] = []
    with SAMPLE.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            changed.append(agg.feed_line(raw, line_no, str(SAMPLE)))
    assert agg.rows() == analyze_trace(SAMPLE).rows()
    # each line changes exactly the row of its own prompt
    assert [[r["prompt"] for r in c] for c in changed] == [["prompt 1"], ["prompt 1"], ["prompt 2"]]
    assert changed[1][0]["decode0_top1"] == 96965

    by_str = ReadoutAggregator()
    for line_no, text in enumerate(SAMPLE.read_text().splitlines(), start=1):
        by_str.feed_line(text, line_no, str(SAMPLE))
    assert by_str.rows() == agg.rows()

    by_record = ReadoutAggregator()
    for line_no, text in enumerate(SAMPLE.read_text().splitlines(), start=1):
        by_record.feed(json.loads(text), line_no, str(SAMPLE))
    assert by_record.rows() == agg.rows()


# --- verdict paths ---------------------------------------------------------------------------


def test_ok_path(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "ok.jsonl",
        [
            rec("prefill_last", 0, 79, prompt="p4_sys"),
            rec("decode", 0, 79, prompt="p4_sys"),
            rec("decode", 1, 18, prompt="p4_sys"),
            rec("prefill_last", 0, 42, prompt="p5_ba"),
            rec("decode", 0, 42),
        ],
    )
    agg = analyze_trace(path)
    rows = agg.rows()
    assert [r["prompt"] for r in rows] == ["p4_sys", "p5_ba"]
    assert [r["verdict"] for r in rows] == ["OK", "OK"]
    assert rows[0]["top1_seq"] == [79, 18]
    assert rows[0]["decode_steps"] == 2
    assert agg.verdict() == "OK"
    table = format_table(rows, agg.verdict())
    assert "| p4_sys | 79 | 79 | 0 | OK |" in table
    assert "Verdict: **OK**" in table


def test_b3_11_collapse_shape(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "b3_11.jsonl",
        [rec("prefill_last", 0, 79, prompt="p4_sys")]
        + [rec("decode", s, 96965, prompt="p4_sys") for s in range(4)],
    )
    (row,) = analyze_trace(path).rows()
    assert row["collapsed"] is True
    assert row["top1_seq"] == [96965] * 4
    assert row["verdict"] == "NO OK"
    assert "stuck on 96965 for 4 steps" in row["note"]


def test_not_collapsed_when_stuck_on_the_prefill_token_or_too_short(tmp_path: Path) -> None:
    same = write_jsonl(
        tmp_path / "same.jsonl",
        [rec("prefill_last", 0, 79)] + [rec("decode", s, 79) for s in range(4)],
    )
    short = write_jsonl(
        tmp_path / "short.jsonl",
        [rec("prefill_last", 0, 79)] + [rec("decode", s, 96965) for s in range(2)],
    )
    varied = write_jsonl(
        tmp_path / "varied.jsonl",
        [rec("prefill_last", 0, 79), *(rec("decode", s, t) for s, t in enumerate([5, 5, 6]))],
    )
    assert analyze_trace(same).rows()[0]["collapsed"] is False
    assert analyze_trace(short).rows()[0]["collapsed"] is False
    assert analyze_trace(varied).rows()[0]["collapsed"] is False


def test_b3_12_like_readout_mismatch_is_no_ok_and_counted(tmp_path: Path) -> None:
    # top-1 agrees but the decode readout used the logical index on a single-token buffer
    path = write_jsonl(
        tmp_path / "b3_12.jsonl",
        [
            rec("prefill_last", 0, 79, readout_buffer_kind="seq"),
            rec(
                "decode",
                1,
                79,
                True,
                readout_buffer_kind="single_token",
                used_index=205,
                tokens_total=11,
            ),
            rec(
                "decode",
                2,
                79,
                True,
                readout_buffer_kind="single_token",
                used_index=206,
                tokens_total=12,
            ),
            rec("prefill_last", 0, 79, True),
        ],
    )
    agg = analyze_trace(path)
    first, second = agg.rows()
    assert first["readout_mismatch_count"] == 2
    assert first["verdict"] == "NO OK"
    assert "readout_mismatch=true on 2 line(s)" in first["note"]
    # a mismatch on the prefill line alone is already a failure, not a guess
    assert second["decode_steps"] == 0
    assert second["verdict"] == "NO OK"
    assert "no decode step" in second["note"]
    assert agg.verdict() == "NO OK"
    assert "`readout_mismatch=true` count: **3**" in format_table(agg.rows(), agg.verdict())
    assert to_json(agg.rows(), agg.verdict())["readout_mismatch_count"] == 3


@pytest.mark.parametrize("text", ["", "\n", " \n\t\n"])
def test_an_empty_trace_file_cannot_be_judged(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    error = trace_error(path)
    assert str(path) in str(error) and "no readout lines" in str(error)


def test_no_prompts_is_not_ok() -> None:
    agg = ReadoutAggregator()
    assert agg.rows() == []
    assert agg.verdict() == "NO OK"
    assert "no prompts" in agg.reason()
    assert "no prompts" in format_table([], agg.verdict())


def test_prompt_without_decode_makes_the_trace_not_ok(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [rec("prefill_last", 0, 79), rec("decode", 0, 79), rec("prefill_last", 0, 79)],
    )
    agg = analyze_trace(path)
    assert [r["verdict"] for r in agg.rows()] == ["OK", None]
    assert agg.verdict() == "NO OK"
    assert "prompt 2 (line 3): no decode step" in agg.reason()


def test_prompt_names_cannot_break_the_table() -> None:
    agg = ReadoutAggregator()
    agg.feed(rec("prefill_last", 0, 1, prompt="a|b\nc"), 1)
    agg.feed(rec("decode", 0, 1, prompt="a|b\nc"), 2)
    table = format_table(agg.rows(), agg.verdict())
    assert "| a\\|b c | 1 | 1 | 0 | OK |" in table


# --- bad input -------------------------------------------------------------------------------


def test_bad_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(rec("prefill_last", 0, 79)) + "\n{not json}\n")
    err = trace_error(path)
    assert (err.file, err.line) == (str(path), 2)
    assert str(err).startswith(f"{path}:2: not valid JSON")
    assert " — " in str(err)


def test_non_object_line(tmp_path: Path) -> None:
    path = tmp_path / "list.jsonl"
    path.write_text("[1, 2]\n")
    err = trace_error(path)
    assert err.line == 1
    assert "expected a JSON object" in err.message


def test_missing_field(tmp_path: Path) -> None:
    record = rec("prefill_last", 0, 79)
    del record["top1_id"]
    err = trace_error(write_jsonl(tmp_path / "m.jsonl", [record]))
    assert err.line == 1
    assert err.key == "top1_id"
    assert "missing required field(s): top1_id" in str(err)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("top1_id", "79"),
        ("top1_id", 79.0),
        ("top1_id", -1),
        ("step", True),
        ("readout_mismatch", "false"),
        ("readout_mismatch", 0),
        ("gap", "0.99"),
        ("top1_logit", None),
        ("phase", 1),
        ("hidden_offset_bytes", 1.5),  # optional seed field: checked when present
        ("prompt", 4),
        ("logits_mean", [0.1]),
    ],
)
def test_wrong_type(tmp_path: Path, key: str, value: Any) -> None:
    record = rec("prefill_last", 0, 79)
    record[key] = value
    err = trace_error(write_jsonl(tmp_path / "t.jsonl", [rec("prefill_last", 0, 1), record]))
    assert err.line == 2
    assert err.key == key
    assert repr(key) in err.message


def test_non_finite_logit_is_rejected() -> None:
    with pytest.raises(TraceError, match="finite number") as info:
        ReadoutAggregator().feed(rec("prefill_last", 0, 79, top1_logit=float("nan")), 7, "x.jsonl")
    assert str(info.value).startswith("x.jsonl:7: ")


def test_token_id_outside_vocab_is_rejected() -> None:
    with pytest.raises(TraceError, match="outside the vocab"):
        ReadoutAggregator().feed(rec("prefill_last", 0, 128256, vocab=128256), 1)


def test_unknown_phase(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [rec("prefill_last", 0, 79), rec("prefill", 0, 79)])
    err = trace_error(path)
    assert err.line == 2
    assert "unknown phase 'prefill'" in err.message


def test_unknown_buffer_kind(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "k.jsonl", [rec("prefill_last", 0, 79, readout_buffer_kind="paged")]
    )
    assert "unknown readout_buffer_kind 'paged'" in trace_error(path).message


def test_decode_before_prefill(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [rec("decode", 1, 79), rec("prefill_last", 0, 79)])
    err = trace_error(path)
    assert (err.file, err.line) == (str(path), 1)
    assert "decode line before any prefill_last" in str(err)


def test_decode_steps_must_increase(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "s.jsonl",
        [
            rec("prefill_last", 0, 79),
            rec("decode", 1, 5, tokens_total=11),
            rec("decode", 1, 5, tokens_total=12),
        ],
    )
    err = trace_error(path)
    assert err.line == 3
    assert err.key == "step"


def test_decode_for_another_prompt(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "n.jsonl",
        [rec("prefill_last", 0, 79, prompt="p4_sys"), rec("decode", 0, 79, prompt="p5_ba")],
    )
    err = trace_error(path)
    assert err.line == 2
    assert "'p5_ba'" in err.message


def test_truncated_last_line(tmp_path: Path) -> None:
    full = SAMPLE.read_bytes()
    path = tmp_path / "trunc.jsonl"
    path.write_bytes(full[: len(full) - 40])  # cut inside the third line
    err = trace_error(path)
    assert err.line == 3
    assert "truncated last line" in err.message


def test_last_line_without_newline_but_complete_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "nonl.jsonl"
    path.write_bytes(SAMPLE.read_bytes().rstrip(b"\n"))
    assert rows_without_file(path) == rows_without_file(SAMPLE)


def test_blank_trailing_lines_are_fine_but_not_inside(tmp_path: Path) -> None:
    body = SAMPLE.read_bytes()
    trailing = tmp_path / "trailing.jsonl"
    trailing.write_bytes(body + b"\n  \n")
    assert rows_without_file(trailing) == rows_without_file(SAMPLE)

    first, rest = body.split(b"\n", 1)
    inside = tmp_path / "inside.jsonl"
    inside.write_bytes(first + b"\n\n" + rest)
    err = trace_error(inside)
    assert err.line == 2
    assert "blank line" in err.message

    with pytest.raises(TraceError, match="blank line"):
        ReadoutAggregator().feed_line(b"\n", 5, "f.jsonl")


def test_bad_line_leaves_state_unchanged() -> None:
    agg = ReadoutAggregator()
    agg.feed(rec("prefill_last", 0, 79), 1)
    before = agg.rows()
    with pytest.raises(TraceError):
        agg.feed_line(b'{"phase": "decode"}', 2)
    assert agg.rows() == before


def test_missing_file(tmp_path: Path) -> None:
    err = trace_error(tmp_path / "nope.jsonl")
    assert "cannot read trace" in str(err)
    assert str(tmp_path / "nope.jsonl") in str(err)


# --- issue 9, case 8: seed 001's lines, tokens_total continuity, the B3.12 rule recomputed --------


def seed_001_line(tokens_total: int, seq_len: int, top1: int, used: int, expected: int) -> dict:
    """A B3.11 line as seed 001 lists its fields: no phase, no step, top1/top2/gap."""
    return {
        "tokens_total": tokens_total,
        "seq_len": seq_len,
        "pos_id": tokens_total - 1,
        "hidden_token_index_used": used,
        "expected_last_index": expected,
        "readout_mismatch": used != expected,
        "top1": top1,
        "top2": top1 + 1,
        "gap": 0.5,
    }


def test_seed_001_lines_without_phase_or_step_are_read(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "b3_11.jsonl",
        [
            seed_001_line(205, 205, 79, 204, 204),  # prefill_last: seq_len == tokens_total
            seed_001_line(206, 1, 79, 205, 205),
            seed_001_line(207, 1, 80, 206, 206),
        ],
    )
    (row,) = analyze_trace(path).rows()
    assert (row["prefill_last_top1"], row["decode0_top1"], row["decode_steps"]) == (79, 79, 2)
    assert row["verdict"] == "OK"


def test_decode_lines_are_credited_by_tokens_total_not_order(tmp_path: Path) -> None:
    """Two prompts in flight at once (a batched engine): each decode line finds its prompt."""
    path = write_jsonl(
        tmp_path / "batch.jsonl",
        [
            rec("prefill_last", 0, 79, tokens_total=205, prompt="long"),
            rec("prefill_last", 0, 42, tokens_total=45, prompt="short"),
            rec("decode", 1, 79, tokens_total=206),
            rec("decode", 1, 43, tokens_total=46),
            rec("decode", 2, 79, tokens_total=207),
        ],
    )
    rows = {r["prompt"]: r for r in analyze_trace(path).rows()}
    assert rows["long"]["top1_seq"] == [79, 79] and rows["long"]["verdict"] == "OK"
    assert rows["short"]["top1_seq"] == [43] and rows["short"]["verdict"] == "NO OK"


def test_a_decode_line_that_continues_no_prompt_is_located(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "gap.jsonl",
        [rec("prefill_last", 0, 79, tokens_total=205), rec("decode", 1, 79, tokens_total=208)],
    )
    err = trace_error(path)
    assert err.line == 2 and err.key == "tokens_total"
    assert "continues no prompt" in err.message and "206" in err.message


def test_the_engines_flag_is_checked_against_its_own_indices(tmp_path: Path) -> None:
    """B3.11's engine said readout_mismatch=false while reading the wrong index: caught."""
    lying = rec("decode", 0, 79, False, readout_buffer_kind="single_token", used_index=205)
    honest = rec("decode", 1, 79, False, readout_buffer_kind="single_token", used_index=0)
    path = write_jsonl(tmp_path / "lie.jsonl", [rec("prefill_last", 0, 79), lying, honest])
    (row,) = analyze_trace(path).rows()
    assert row["readout_mismatch_count"] == 1 and row["verdict"] == "NO OK"
    assert "contradicts its own indices on 1 line(s)" in row["note"]
    assert recomputed_mismatch({"readout_buffer_kind": "seq", "used_index": 3}) is None
    # The rule comes from tokens_total, never from the line's own logical index.
    assert recomputed_mismatch({"used_index": 204, "tokens_total": 205}) is False
    assert recomputed_mismatch({"used_index": 100, "logical_last_index": 100, "tokens_total": 205})
