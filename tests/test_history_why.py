"""History's why column at 120x40: the reason takes the width the other columns leave, cut
with an ellipsis, and the highlighted run's reason is shown whole under the table (it was cut
to its header's three letters, the rest off the right edge)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_console import LOADED_S, screen_text, wait_for, wait_for_screen
from textual.widgets import DataTable

from console.app import create_app
from console.screens.history import HistoryScreen

DATA = Path(__file__).resolve().parent / "data"
SIZE = (120, 40)
READOUT_WHY = (
    "p1_len_16 (line 10): prefill_last_top1 4413 != decode0_top1 9023; p2_len_64 (line 15): "
    "readout_mismatch=true on 1 line(s); p3_collapsed (line 19): prefill_last_top1 500 != "
    "decode0_top1 13; collapsed: decode top-1 stuck on 13 for 8 steps; p4_prefill_only "
    "(line 28): no decode step"
)


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRACEDECK_HOME", str(tmp_path / "td"))
    out = tmp_path / "td" / "runs"
    for name in ("readout_run", "hello_command_run"):
        shutil.copytree(DATA / name, out / name)
    return out


def why_row(text: str) -> str:
    return next(line for line in text.splitlines() if "NO OK" in line)


async def test_the_why_column_fills_the_width_and_the_reason_is_shown_whole(out: Path) -> None:
    app = create_app(out_dir=out)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        history = await wait_for_screen(pilot, HistoryScreen)
        await wait_for(pilot, lambda: len(history.entries) == 2, LOADED_S, "the history scan")
        table = history.query_one("#runs", DataTable)
        readout = next(i for i, e in enumerate(history.entries) if e.verdict == "NO OK")
        table.move_cursor(row=readout)
        await wait_for(
            pilot,
            lambda: "…" in why_row(screen_text(app)) and "why  p1" in screen_text(app),
            LOADED_S,
            "the why column and line drawn",
        )
        text = screen_text(app)
        row = why_row(text)
        assert history.entries[readout].why == READOUT_WHY
        # the column starts the reason and ends it with an ellipsis at the table's right edge
        shown = row[row.index("p1_len_16") :].rstrip(" ▁▎▌")
        assert len(shown) >= 12 and shown.endswith("…"), row
        assert READOUT_WHY.startswith(shown[:-1]), row
        assert len(row.rstrip()) <= SIZE[0]
        # the whole reason, wrapped, under the table
        assert "\nwhy  p1_len_16 (line 10)" in text, text
        assert READOUT_WHY in " ".join(text.split()), text
        # a run without a reason shows no why line
        table.move_cursor(row=1 - readout)
        await wait_for(pilot, lambda: "why  " not in screen_text(app), LOADED_S, "no why line")


async def test_the_why_column_follows_a_resize(out: Path) -> None:
    app = create_app(out_dir=out)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("f2")
        history = await wait_for_screen(pilot, HistoryScreen)
        await wait_for(pilot, lambda: len(history.entries) == 2, LOADED_S, "the history scan")
        table = history.query_one("#runs", DataTable)
        await wait_for(
            pilot, lambda: table.columns["why"].width > 40, LOADED_S, "a wide why column"
        )
        wide = table.columns["why"].width
        await pilot.resize_terminal(120, 40)
        await wait_for(
            pilot, lambda: table.columns["why"].width < wide, LOADED_S, "the column to narrow"
        )
        assert table.columns["why"].width == wide - 40
