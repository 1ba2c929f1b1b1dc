"""Readout (B3.11/B3.12) judged from the numbers, never from the engine's word (issue 20, 4-6).

Built from seed 003's real MI300X lines: an honest pair (prefill_last, decode with the same
top-1) is OK; every claim a line makes, told as a lie, is refused (a line that contradicts
itself) or judged NO OK (a line whose indices contradict tokens_total), never OK.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from runhelp import ROOT, cli_env, tracedeck

from analysis.readout import TraceError, analyze_trace, gap_tolerance
from runners.events import RunFinished
from runners.kinds.readout import ReadoutPrinter

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)

SAMPLE = ROOT / "presets" / "samples" / "b3_12_mi300x.jsonl"
Line = dict[str, Any]


def seed_lines() -> list[Line]:
    return [json.loads(line) for line in SAMPLE.read_text().splitlines()]


def honest() -> tuple[Line, Line]:
    """Seed 003's first prompt as a correct engine writes it: decode0_top1 == prefill's."""
    prefill, decode, _ = seed_lines()
    decode["top1_id"] = prefill["top1_id"]
    return prefill, decode


def write(path: Path, lines: list[Line]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def verdict_of(path: Path) -> str:
    """ "refused" (the line is not believed: analyze exits 2), else the trace's verdict."""
    try:
        return analyze_trace(path).verdict()
    except TraceError:
        return "refused"


def test_the_honest_pair_is_ok(tmp_path: Path) -> None:
    assert verdict_of(write(tmp_path / "t.jsonl", list(honest()))) == "OK"


def test_seed_003_lines_pass_every_consistency_check() -> None:
    agg = analyze_trace(SAMPLE)  # raises if any of its three real lines were refused
    assert [row["index_problem_lines"] for row in agg.rows()] == [0, 0]


# --- 4: every index against tokens_total - 1 and the buffer kind --------------------------


def test_issue_4_a_prefill_line_reading_index_100_of_205_is_not_ok(tmp_path: Path) -> None:
    prefill, decode = honest()
    for key in ("used_index", "logical_last_index", "expected_last_index"):
        prefill[key] = 100
    prefill["hidden_token_index_used"] = 100
    prefill["readout_mismatch"] = False
    for key in ("hidden_offset_bytes", "rms_offset_bytes", "pos_id", "token_index"):
        prefill.pop(key)  # the issue's line carries these four indices and the flag only
    prefill.pop("logits_offset_bytes")
    (row,) = analyze_trace(write(tmp_path / "t.jsonl", [prefill, decode])).rows()
    assert row["verdict"] == "NO OK"
    assert row["readout_mismatch_count"] == 1  # seq buffer: used 100 != 204, whatever the flag
    assert "logical_last_index 100 != tokens_total - 1 = 204" in row["note"]
    assert "contradicts its own indices" in row["note"]


def test_issue_4_the_same_line_with_its_offsets_contradicts_itself(tmp_path: Path) -> None:
    prefill, decode = honest()
    for key in ("used_index", "hidden_token_index_used"):
        prefill[key] = 100
    err = pytest.raises(TraceError, analyze_trace, write(tmp_path / "t.jsonl", [prefill, decode]))
    assert err.value.key == "hidden_offset_bytes" and err.value.line == 1


def test_issue_4_single_token_reads_row_0_whatever_the_flag(tmp_path: Path) -> None:
    prefill, decode = honest()
    decode.update(used_index=205, hidden_token_index_used=205, hidden_offset_bytes=205 * 16384)
    (row,) = analyze_trace(write(tmp_path / "t.jsonl", [prefill, decode])).rows()
    assert row["verdict"] == "NO OK" and row["readout_mismatch_count"] == 1


# --- 5: attribution is never a guess ---------------------------------------------------------


def interleaved(named: bool) -> list[Line]:
    """Two prompts at tokens_total 205, their decode lines interleaved; each prompt is broken
    (decode0 differs from its prefill), but swapping the decode lines makes both look OK."""
    a_pre, a_dec = honest()
    b_pre, b_dec = honest()
    b_pre.update(top1_id=18, top1_logit=12.0042, top2_id=79, logits_max=12.0042)
    a_dec.update(top1_id=18)
    b_dec.update(top1_id=79)
    if named:
        for line, name in ((a_pre, "A"), (a_dec, "A"), (b_pre, "B"), (b_dec, "B")):
            line["prompt"] = name
    return [a_pre, b_pre, a_dec, b_dec]


def test_issue_5_ambiguous_decode_lines_are_refused_naming_the_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", interleaved(named=False))
    with pytest.raises(TraceError) as info:
        analyze_trace(path)
    assert info.value.line == 3 and "continues 2 prompts" in info.value.message
    assert "(line 1)" in info.value.message and "(line 2)" in info.value.message
    home = tmp_path / "home"
    done = tracedeck("analyze", str(path), env=cli_env(home))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{path}:3:" in done.stderr


def test_issue_5_prompt_names_disambiguate_and_both_prompts_fail(tmp_path: Path) -> None:
    agg = analyze_trace(write(tmp_path / "t.jsonl", interleaved(named=True)))
    assert [(r["prompt"], r["verdict"]) for r in agg.rows()] == [("A", "NO OK"), ("B", "NO OK")]


def test_issue_5_steps_disambiguate_a_sequential_trace(tmp_path: Path) -> None:
    """A prompt that ended at tokens_total 206 and a new one at 206: step 1 is the new one's."""
    a_pre, a_dec = honest()
    b_pre, b_dec = honest()
    b_pre.update(tokens_total=206, seq_len=206, pos_id=205, token_index=205)
    b_pre.update(used_index=205, logical_last_index=205, expected_last_index=205)
    b_pre.update(hidden_token_index_used=205, hidden_offset_bytes=205 * 16384)
    b_pre.update(logits_offset_bytes=205 * 128256 * 4)
    b_dec.update(tokens_total=207, pos_id=206, token_index=206, logical_last_index=206)
    b_dec.update(expected_last_index=206, logits_offset_bytes=206 * 128256 * 4)
    rows = analyze_trace(write(tmp_path / "t.jsonl", [a_pre, a_dec, b_pre, b_dec])).rows()
    assert [r["decode_steps"] for r in rows] == [1, 1]
    assert [r["verdict"] for r in rows] == ["OK", "OK"]


# --- 6: lines that contradict themselves -------------------------------------------------------


def test_issue_6_gap_tolerance_is_six_printed_digits(tmp_path: Path) -> None:
    prefill, decode = honest()
    t1, t2 = decode["top1_logit"], decode["top2_logit"]
    tol = gap_tolerance(t1, t2, t1 - t2)
    assert 1e-4 < tol < 2e-4  # three numbers of six digits near 10: 5e-5 + 5e-5 + 5e-6
    decode["gap"] = t1 - t2 + 0.9 * tol
    assert verdict_of(write(tmp_path / "in.jsonl", [prefill, decode])) == "OK"
    decode["gap"] = t1 - t2 + 1.2 * tol
    assert verdict_of(write(tmp_path / "out.jsonl", [prefill, decode])) == "refused"


def test_issue_6_a_report_never_says_ok_above_a_failed_result() -> None:
    """The final table carries the run's verdict and reason, not its rows' OK."""
    row = analyze_trace(SAMPLE).rows()[0] | {"verdict": "OK", "note": "fine"}
    summary = {
        "verdict": "OK",
        "reason": "1 problem(s) with the trace: x.jsonl:9: bad",
        "prompts": [row],
    }
    text = "\n".join(ReadoutPrinter().final(RunFinished("NO OK", 1, summary)))
    assert "Verdict: **NO OK**" in text and "Verdict: **OK**" not in text
    assert "x.jsonl:9: bad" in text


# --- the liar matrix: every claim a readout line makes, told as a lie ------------------------

Lie = Callable[[Line, Line], None]


def _set(which: int, **values: Any) -> Lie:
    def lie(prefill: Line, decode: Line) -> None:
        (prefill, decode)[which].update(values)

    return lie


P, D = 0, 1
LIES: dict[str, tuple[Lie, str]] = {
    # flags and indices against tokens_total and the buffer kind: the row is NO OK
    "readout_mismatch true is honoured": (_set(D, readout_mismatch=True), "NO OK"),
    "used_index off the single-token row 0": (
        _set(D, used_index=1, hidden_token_index_used=1, hidden_offset_bytes=16384),
        "NO OK",
    ),
    "seq used_index off the logical row": (
        _set(P, used_index=203, hidden_token_index_used=203, hidden_offset_bytes=203 * 16384),
        "NO OK",
    ),
    "pos_id": (_set(P, pos_id=203), "NO OK"),
    "token_index": (_set(D, token_index=204), "NO OK"),
    "logical_last_index": (_set(D, logical_last_index=204), "NO OK"),
    "expected_last_index": (_set(P, expected_last_index=205), "NO OK"),
    "logits_offset_bytes at row 0 (B3.11)": (_set(D, logits_offset_bytes=0), "NO OK"),
    # numbers that contradict each other: the line is refused
    "top1_logit below top2_logit": (_set(D, top1_logit=11.0, logits_max=11.0), "refused"),
    "gap not top1 - top2": (_set(D, gap=0.5), "refused"),
    "gap negative": (_set(P, gap=-0.993584), "refused"),
    "top2_id is top1_id": (_set(P, top2_id=79), "refused"),
    "top1_logit not the row max": (_set(P, logits_max=13.0), "refused"),
    "top2_logit below logits_min": (_set(P, logits_min=11.5), "refused"),
    "hidden_mean outside min..max": (_set(P, hidden_mean=5000.0), "refused"),
    "rms_min above rms_max": (_set(D, rms_min=4.0), "refused"),
    "logits_mean outside min..max": (_set(D, logits_mean=-14.0), "refused"),
    "hidden_token_index_used contradicts used_index (seq)": (
        _set(P, hidden_token_index_used=0),
        "refused",
    ),
    "hidden_token_index_used contradicts used_index (single_token)": (
        _set(D, hidden_token_index_used=205),
        "refused",
    ),
    "hidden_offset_bytes not used x stride": (_set(P, hidden_offset_bytes=0), "refused"),
    "hidden row past the allocation": (_set(P, hidden_alloc_bytes=204 * 16384), "refused"),
    "seq_len above tokens_total": (_set(P, seq_len=206), "refused"),
    "top1_id outside the vocab": (_set(P, top1_id=128256), "refused"),
    "tokens_total zero": (_set(P, tokens_total=0), "refused"),
    "unknown buffer kind": (_set(D, readout_buffer_kind="paged"), "refused"),
    "unknown phase": (_set(D, phase="decode2"), "refused"),
}


@pytest.mark.parametrize("name", list(LIES))
def test_liar_matrix(tmp_path: Path, name: str) -> None:
    lie, expected = LIES[name]
    prefill, decode = honest()
    lie(prefill, decode)
    assert verdict_of(write(tmp_path / "t.jsonl", [prefill, decode])) == expected


# --- runs of the real reference engine ---------------------------------------------------------

WAIT_FOLLOWED = """
import glob, sys, time
pattern, want = sys.argv[1], '"last_line":' + sys.argv[2] + ","
deadline = time.time() + 120
while time.time() < deadline:  # until the console has followed every line the engine wrote
    if any(want in open(p).read() for p in glob.glob(pattern)):
        sys.exit(0)
    time.sleep(0.05)
sys.exit("the console never followed the trace")
"""


def engine_preset(tmp_path: Path, then: str = "", fetch: bool = True) -> Path:
    """b3_11_readout's engine on one prompt (1 prefill + 2 decode lines), then `then`."""
    preset = tmp_path / "readout_then.toml"
    engine = (
        "{python} -m runners.reference readout --prompt-name p0 --prompt-len 24 --gen-len 2 "
        "--vocab 512"
    )
    command = (f"{engine} && {then}" if then else engine).replace('"', '\\"')  # TOML string
    preset.write_text(f"""
[preset]
name = "readout_then"
kind = "readout"
[target]
host = "local"
runs = "{tmp_path}/remote"
lock = "{tmp_path}/lock"
[determinism]
profile = "cpu"
[engine]
ship_reference = true
env = {{ GRETA_TRACE_READOUT = "1", GRETA_TRACE_READOUT_OUT = "{{out}}/trace.jsonl" }}
command = "sh -c '{command}'"
[matrix]
n = [1]
[artifacts]
fetch = {'["trace.jsonl"]' if fetch else "[]"}
[traces]
follow = ["trace.jsonl"]
""")
    return preset


def run_preset(tmp_path: Path, preset: Path) -> tuple[Any, Path]:
    out = tmp_path / "out"
    (tmp_path / "home").mkdir(exist_ok=True)
    done = tracedeck(
        "run", str(preset), "--out", str(out), env=cli_env(tmp_path / "home"), timeout=300
    )
    dirs = [p.parent for p in out.glob("*/*/run.json") if p.parent.parent.name != "by-id"]
    assert len(dirs) == 1, done.stdout + done.stderr
    return done, dirs[0]


def test_issue_6_a_broken_line_makes_every_verdict_no_ok(tmp_path: Path) -> None:
    done, _ = run_preset(tmp_path, engine_preset(tmp_path, 'echo "{{broken" >> {out}/trace.jsonl'))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: NO OK (exit 1)" in done.stdout
    assert "Verdict: **OK**" not in done.stdout
    assert "Verdict: **NO OK**" in done.stdout and "trace.jsonl:4: not valid JSON" in done.stdout


def test_issue_6_a_trace_truncated_after_it_was_followed_is_not_ok(tmp_path: Path) -> None:
    waiter = tmp_path / "wait_followed.py"
    waiter.write_text(WAIT_FOLLOWED)
    events = f"{tmp_path}/out/*/*/events.jsonl"
    then = f'{{python}} {waiter} "{events}" 3 && : > {{out}}/trace.jsonl'
    done, run_dir = run_preset(tmp_path, engine_preset(tmp_path, then))
    assert (run_dir / "trace.jsonl").stat().st_size == 0  # the kept artifact is empty
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: NO OK (exit 1)" in done.stdout
    # both are said: the trace shrank under its follower (first), and its kept copy differs
    assert "2 problem(s) with the trace" in done.stdout
    assert "it is now shorter than the" in done.stdout and "(truncated or rewritten)" in done.stdout
    record = (run_dir / "events.jsonl").read_text()
    assert "the kept trace is not what the engine wrote while it ran" in record
    again = tracedeck("analyze", str(run_dir), env=cli_env(tmp_path / "home"))
    assert again.returncode == 1, again.stdout + again.stderr
    assert "the kept trace is not what was judged while the run ran" in again.stdout


def test_issue_15_analyze_rejudges_a_readout_runs_directory(tmp_path: Path) -> None:
    done, run_dir = run_preset(tmp_path, engine_preset(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    again = tracedeck("analyze", str(run_dir), env=cli_env(tmp_path / "home"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "| p0 |" in again.stdout and "re-judged from the kept trace: OK" in again.stdout
    assert "recorded verdict: OK" in again.stdout
    # 14: the run's record is untouched, and analyze said where its documents would go
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert "its recorded verdict stays as the run wrote it" in again.stderr
    refused = tracedeck(
        "analyze", str(run_dir), "--output", str(run_dir), env=cli_env(tmp_path / "home")
    )
    assert refused.returncode == 2 and "never rewrites a run's recorded verdict" in refused.stderr


def test_issue_15_a_run_that_kept_no_trace_says_it_cannot_be_rejudged(tmp_path: Path) -> None:
    done, run_dir = run_preset(tmp_path, engine_preset(tmp_path, fetch=False))
    assert done.returncode == 0, done.stdout + done.stderr
    again = tracedeck("analyze", str(run_dir), env=cli_env(tmp_path / "home"))
    assert again.returncode == 2, again.stdout + again.stderr
    assert "never fetched home" in again.stderr
