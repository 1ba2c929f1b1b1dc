"""The pure comparison of two runs (analysis.run_compare) and the CI reports built from a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import xmlschema

from analysis.ci_report import junit_xml, summary_markdown
from analysis.compare_items import equivalence_items, kv_items
from analysis.run_compare import ENGINE_SWITCHES, RunSide, compare_runs, diff_lines, overlay
from runners.config import ConfigError, load_config

SCHEMA = Path(__file__).parent / "data" / "junit.xsd"
THRESHOLDS = {"p99_abs_diff_max": 1e-3, "max_abs_diff_max": 5e-3, "top1_agreement_min": 0.999}


def pair(seed: int, verdict: str, max_abs: float, top1: float = 1.0) -> dict[str, Any]:
    return {
        "type": "pair_verdict",
        "seed": seed,
        "kv_aligned": 1,
        "verdict": verdict,
        "metrics": {
            "max_abs_diff": max_abs,
            "p99_abs_diff": max_abs / 2,
            "top1_agreement": top1,
            "cos_sim_mean": 1.0,
        },
        "thresholds": THRESHOLDS,
        "first_fail": None,
    }


def side(
    events: list[dict[str, Any]],
    verdict: str | None = "PASS_GUARDRAIL",
    tone: str | None = "pass",
    matrix: dict[str, Any] | None = None,
    **kw: Any,
) -> RunSide:
    return RunSide(
        run_id=kw.pop("run_id", "run-a"),
        preset="b3_67_smoke",
        kind="equivalence",
        matrix=matrix if matrix is not None else {"seed": [0, 1], "inject": ["none"]},
        verdict=verdict,
        tone=tone,
        exit_code={"pass": 0, "fail": 1}.get(tone or "", 3),
        items=equivalence_items(events),
        **kw,
    )


def test_a_recorded_pass_its_metrics_contradict_is_a_failure() -> None:
    [item] = equivalence_items([pair(0, "PASS_EQUIV", max_abs=0.5)])
    assert item.tone == "fail" and item.verdict == "FAIL_EQUIV"
    assert "the record says PASS_EQUIV" in item.first_fail
    assert item.failing == ["p99_abs_diff", "max_abs_diff"]


def test_a_pass_under_loosened_thresholds_is_not_the_seeds_pass() -> None:
    event = pair(0, "PASS_EQUIV", max_abs=0.004)
    event["thresholds"] = {**THRESHOLDS, "p99_abs_diff_max": 0.01}
    [item] = equivalence_items([event])
    assert item.tone == "drift" and item.verdict == "PASS_EQUIV (loosened)"
    assert "p99_abs_diff past the seed's" in item.first_fail


def test_a_metric_crossing_its_threshold_is_named() -> None:
    a = side([pair(0, "PASS_EQUIV", 0.001), pair(1, "PASS_EQUIV", 0.0)])
    b = side([pair(0, "FAIL_EQUIV", 0.004, top1=0.9), pair(1, "PASS_EQUIV", 0.0)], run_id="b")
    d = compare_runs(a, b)
    assert d.exit_code == 1
    [reg] = d.regressions
    assert reg.key == "kv_aligned=1 seed=0"
    crossed = {x.name: x.crossed for x in reg.deltas}
    # max_abs_diff 0.004 is still within 0.005; p99 0.002 and top1 0.9 crossed.
    assert crossed == {
        "max_abs_diff": False,
        "p99_abs_diff": True,
        "top1_agreement": True,
    }
    assert any("CROSSED INTO FAILURE" in line for line in diff_lines(d))


def test_a_pair_judged_before_and_missing_after_is_a_regression() -> None:
    a = side([pair(0, "PASS_EQUIV", 0.0), pair(1, "PASS_EQUIV", 0.0)])
    b = side([pair(0, "PASS_EQUIV", 0.0)])
    d = compare_runs(a, b)
    assert d.exit_code == 1 and [c.key for c in d.regressions] == ["kv_aligned=1 seed=1"]


def test_a_run_that_failed_outside_every_item_is_a_regression() -> None:
    a = side([pair(0, "PASS_EQUIV", 0.0)])
    b = side([pair(0, "PASS_EQUIV", 0.0)], verdict="ENGINE_ERROR", tone="fail")
    b.problems = ["kv_aligned=1 seed=1 decode: the engine crashed (exit 139)"]
    d = compare_runs(a, b)
    assert d.exit_code == 1 and "the engine crashed" in d.run_regressed


def test_different_matrices_are_incomparable_unless_allowed() -> None:
    a = side([pair(0, "PASS_EQUIV", 0.0)], matrix={"seed": [0], "prompt_len": [64]})
    b = side([pair(0, "PASS_EQUIV", 0.0)], matrix={"seed": [0], "prompt_len": [128]})
    d = compare_runs(a, b)
    assert d.exit_code == 2
    assert d.incomparable == ["matrix.prompt_len differs: [64] (A) vs [128] (B)"]
    allowed = compare_runs(a, b, ENGINE_SWITCHES | {"prompt_len"})
    assert allowed.exit_code == 0 and allowed.switches == [("prompt_len", [64], [128])]


def test_an_unfinished_run_is_incomparable() -> None:
    a = side([pair(0, "PASS_EQUIV", 0.0)])
    b = side([], verdict=None, tone=None, path="/runs/b")
    d = compare_runs(a, b)
    assert d.exit_code == 2 and "tracedeck attach /runs/b" in d.incomparable[0]


def test_identity_differences_are_listed() -> None:
    a = side([pair(0, "PASS_EQUIV", 0.0)], identity={"engine git_commit": "abc123"})
    b = side([pair(0, "PASS_EQUIV", 0.0)], identity={"engine git_commit": "def456"})
    d = compare_runs(a, b)
    assert d.exit_code == 0 and "engine git_commit: abc123 -> def456" in diff_lines(d)


def test_kv_cell_items_carry_the_first_differing_element() -> None:
    event = {
        "type": "kv_cell_verdict",
        "point": {"d": 64, "kv": 256, "b": 1, "gqa": 2, "mask": 1, "alibi": 0, "sinks": 0},
        "verdict": "DIFFERS",
        "detail": {
            "first": {
                "flows": ["single", "chunk8"],
                "batch": 0,
                "head": 1,
                "index": 7,
                "values": [0.5, 0.5000001],
                "ulp": 1,
            },
            "differing": 3,
            "max_abs_diff": 1e-7,
            "max_ulp": 2,
        },
    }
    [item] = kv_items([event])
    assert item.tone == "fail" and item.where == "batch 0 head 1 index 7"
    assert "single vs chunk8 differ first at batch 0 head 1 index 7: 0.5 vs 0.5000001" in (
        item.first_fail
    )


def test_junit_of_a_crashed_run_errors_on_the_run_testcase() -> None:
    s = side([], verdict="ENGINE_ERROR", tone="fail")
    s.exit_code = 3  # infrastructure: an error, not a failure of the engine's results
    s.problems = ["cell 2: the engine crashed (exit 139); stderr ends: \x1b[31mboom\x00"]
    text = junit_xml(s)
    xmlschema.XMLSchema(str(SCHEMA)).validate(text)
    assert '<error type="ENGINE_ERROR"' in text and "\\x1b[31mboom\\x00" in text
    assert "ENGINE_ERROR (exit 3)" in summary_markdown(s)


def test_notify_config_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[notify]\ncomand = "x"\n')
    with pytest.raises(ConfigError, match="notify.comand: unknown key"):
        load_config(path)
    path.write_text('[notify]\ncommand = ""\n')
    with pytest.raises(ConfigError, match="notify.command: must not be empty"):
        load_config(path)
    path.write_text('[notify]\ncommand = "mail -s tracedeck ops"\ntimeout_s = 30\n')
    assert load_config(path)["notify"]["command"] == "mail -s tracedeck ops"


def test_overlay_shows_each_sides_share_per_value() -> None:
    lines = overlay([[6.0, 1], [7.0, 3]], [[7.0, 1], [8.0, 1]], width=4)
    assert [line.split()[0] for line in lines] == ["6", "7", "8"]
    assert lines[1].split() == ["7", "A", "███", "75.0%", "B", "██", "50.0%"]
    wide = overlay([[0.0, 1], [100.0, 1]], [[50.0, 2]], bins=4)
    assert len(wide) == 4 and wide[0].split()[0] == "0..25"
