"""Trends of a preset's runs: sparklines per item, and drift while still passing."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from runhelp import cli_env, tracedeck
from textual.pilot import Pilot
from textual.widgets import Static

from analysis.run_compare import Item, RunSide
from analysis.trends import spark, trends
from console.app import create_app
from console.screens.history import HistoryScreen

DATA = Path(__file__).resolve().parent / "data"


def run(n: int, max_abs: float, p99: float, drift_max: float) -> RunSide:
    fails = p99 > 1e-3
    items = [
        Item(
            "pair",
            "kv_aligned=1 seed=0",
            "FAIL_EQUIV" if fails else "PASS_EQUIV",
            "fail" if fails else "pass",
            {"max_abs_diff": max_abs, "p99_abs_diff": p99, "top1_agreement": 1.0},
            ["p99_abs_diff"] if fails else [],
        ),
        Item("pair", "kv_aligned=0 seed=0", "EXPECTED_DRIFT", "drift", {"max_abs_diff": drift_max}),
    ]
    return RunSide(
        run_id=f"run-{n}",
        preset="b3_67_smoke",
        kind="equivalence",
        matrix={},
        verdict="FAIL_GUARDRAIL" if fails else "PASS_GUARDRAIL",
        tone="fail" if fails else "pass",
        exit_code=1 if fails else 0,
        items=items,
        started_at=f"2026-11-2{n}T00:00:00+00:00",
    )


def test_a_metric_worse_run_after_run_while_passing_is_drift() -> None:
    sides = [run(1, 0.001, 0.0002, 0.1), run(2, 0.002, 0.0004, 0.1), run(3, 0.004, 0.0008, 0.2)]
    t = trends(sides, k=3)
    [aligned, drift] = t.items
    assert aligned.tones == "✓✓✓"
    by_name = {m.name: m for m in aligned.metrics}
    assert by_name["max_abs_diff"].drifting and by_name["p99_abs_diff"].drifting
    assert not by_name["top1_agreement"].drifting  # flat is not drift
    assert by_name["max_abs_diff"].spark == "▁▃█"
    assert (
        "pair kv_aligned=1 seed=0: max_abs_diff drifting worse over 3 runs while still passing "
        "(0.001 -> 0.002 -> 0.004)" in t.drifting
    )
    # 0.1, 0.1, 0.2 is not worse at each step: no drift.
    assert not drift.metrics[0].drifting and drift.tones == "~~~"


def test_a_metric_that_crossed_into_failure_is_a_failure_not_drift() -> None:
    sides = [run(1, 0.001, 0.0002, 0.1), run(2, 0.002, 0.0006, 0.1), run(3, 0.004, 0.002, 0.1)]
    t = trends(sides, k=3)
    assert t.items[0].tones == "✓✓✗" and t.drifting == []


def test_sparkline_marks_a_run_without_the_item() -> None:
    assert spark([1.0, None, 3.0]) == "▁·█"


async def until(pilot: Pilot, condition: Callable[[], bool], timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "the screen did not settle"
        await pilot.pause(0.05)


@pytest.fixture
def out(tmp_path: Path) -> Path:
    runs = tmp_path / "td" / "runs"
    for name in ("compare_pass", "compare_canary"):
        shutil.copytree(DATA / name, runs / name)
    return runs


def test_history_json_of_a_preset(out: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    done = tracedeck("history", "b3_67_smoke", "--out", str(out), "--json", env=cli_env(home))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert [r["verdict"] for r in doc["runs"]] == ["PASS_GUARDRAIL", "FAIL_GUARDRAIL"]
    [pair] = [i for i in doc["items"] if i["key"] == "kv_aligned=1 seed=0"]
    assert pair["tones"] == "✓✗"
    [max_abs] = [m for m in pair["metrics"] if m["metric"] == "max_abs_diff"]
    assert max_abs["values"][0] == 0 and max_abs["values"][1] > 14 and max_abs["spark"] == "▁█"
    assert doc["left_out"] == []
    # a record that cannot be read (a failed run's, for all anyone knows) is named, never
    # silently missing from the trend: on stderr and in the document
    shutil.copytree(out / "compare_canary", out / "damaged")
    (out / "damaged" / "run.json").write_text("{")
    done = tracedeck("history", "b3_67_smoke", "--out", str(out), "--json", env=cli_env(home))
    assert done.returncode == 0, done.stderr
    [why] = json.loads(done.stdout)["left_out"]
    assert why.startswith(f"{out / 'damaged'}: left out: its record cannot be read"), why
    assert why in done.stderr
    missing = tracedeck("history", "nope", "--out", str(out), env=cli_env(home))
    assert missing.returncode == 2 and "no finished run of preset 'nope'" in missing.stderr


async def test_history_screen_shows_the_trends_of_the_selected_preset(
    out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(out.parent))
    app = create_app(out_dir=out, preset_paths=[])
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f2")
        await until(
            pilot, lambda: isinstance(app.screen, HistoryScreen) and len(app.screen.entries) == 2
        )
        await pilot.press("t")
        text = app.screen.query_one("#trends-text", Static)
        await until(pilot, lambda: "oldest first" in str(text.render()))
        shown = str(text.render())
        assert "b3_67_smoke: last 2 run(s), oldest first" in shown
        assert "✓✗  pair kv_aligned=1 seed=0" in shown and "▁█  max_abs_diff" in shown
