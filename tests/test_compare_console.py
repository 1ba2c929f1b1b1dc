"""The Compare screen: two recorded B3.67 runs (clean, then the readout_offset canary) compared
from the History screen, by marking run A, and as "this run vs the last of its preset"."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable

from console.app import create_app
from console.screens.compare import CompareScreen
from console.screens.history import HistoryScreen

DATA = Path(__file__).resolve().parent / "data"
SIZE = (120, 40)


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRACEDECK_HOME", str(tmp_path / "td"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    runs = tmp_path / "td" / "runs"
    for name in ("compare_pass", "compare_canary"):
        shutil.copytree(DATA / name, runs / name)
    return runs


async def until(pilot: Pilot, condition, timeout: float = 20.0) -> None:  # noqa: ANN001
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "the screen did not settle"
        await pilot.pause(0.05)
    await pilot.pause(0.1)


async def history_listed(pilot: Pilot) -> HistoryScreen:
    await pilot.press("f2")
    await until(pilot, lambda: isinstance(pilot.app.screen, HistoryScreen))
    screen = pilot.app.screen
    assert isinstance(screen, HistoryScreen)
    await until(pilot, lambda: len(screen.entries) == 2)
    return screen


async def compared(pilot: Pilot) -> CompareScreen:
    await until(
        pilot,
        lambda: isinstance(pilot.app.screen, CompareScreen) and pilot.app.screen.diff is not None,
    )
    screen = pilot.app.screen
    assert isinstance(screen, CompareScreen)
    return screen


async def mark_and_compare(pilot: Pilot) -> None:
    await history_listed(pilot)
    await pilot.press("down", "m", "up", "c")  # A = the older clean run, B = the canary
    await compared(pilot)


def test_compare_screen_snapshot(snap_compare, out: Path) -> None:  # noqa: ANN001
    app = create_app(out_dir=out, preset_paths=[])
    assert snap_compare(app, terminal_size=SIZE, run_before=mark_and_compare)


async def test_compare_with_the_last_run_of_the_preset_names_the_regressed_pair(
    out: Path,
) -> None:
    app = create_app(out_dir=out, preset_paths=[])
    async with app.run_test(size=SIZE) as pilot:
        history = await history_listed(pilot)
        assert history.entries[0].local_dir.name == "compare_canary"
        await pilot.press("l")
        screen = await compared(pilot)
        assert screen.diff is not None and screen.diff.exit_code == 1
        assert screen.diff.a.run_id.endswith("eb24") and screen.diff.b.run_id.endswith("7ab0")
        table = screen.query_one("#changes", DataTable)
        rows = [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]
        assert rows[0][:4] == ["REGRESSED", "pair kv_aligned=1 seed=0", "PASS_EQUIV", "FAIL_EQUIV"]
        assert "max_abs_diff 0 -> 14.0938" in rows[0][4] and "CROSSED INTO FAILURE" in rows[0][4]
        # The older run has no run of its preset before it: said, nothing opened.
        await pilot.press("escape")
        await until(pilot, lambda: isinstance(pilot.app.screen, HistoryScreen))
        await pilot.press("down", "l")
        said = "no earlier finished run of b3_67_smoke on local"
        await until(
            pilot,
            lambda: (
                isinstance(pilot.app.screen, HistoryScreen)
                and said in str(pilot.app.screen.query_one("#history-status").render())
            ),
        )
        assert isinstance(pilot.app.screen, HistoryScreen)  # nothing opened
