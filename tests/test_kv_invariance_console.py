"""The 03C panel: the grid from a recorded run (snapshot at 120x40), the selected cell, the grid
screen, and a llama.cpp run filling its rows from trace digests before the verdicts come.

Update the snapshot after an intended change with:
python -m pytest tests/test_kv_invariance_console.py --snapshot-update
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rich.text import Text
from test_console import LOADED_S, wait_for, wait_for_screen
from textual.pilot import Pilot

from analysis.kv_invariance_llamacpp import LlamaCppBook, parse_line
from console.app import create_app
from console.panels.kv_invariance import (
    CellDetail,
    GridTable,
    GridView,
    KvGridScreen,
    KvInvariancePanel,
    key_of,
)
from console.screens.run import RunScreen
from console.widgets.banner import VerdictBanner
from runners.events import TraceBatch

DATA = Path(__file__).resolve().parent / "data"
RUN = DATA / "kv_invariance_run"
SIZE = (120, 40)
DIFFERS_AT = {"d": 128, "kv": 1024, "b": 8, "gqa": 2, "mask": 1, "alibi": 1, "sinks": 0}
PRECONDITION_AT = {"d": 256, "kv": 256, "b": 1, "gqa": 1, "mask": 1, "alibi": 0, "sinks": 0}


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRACEDECK_HOME", str(tmp_path / "td"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return tmp_path / "td" / "runs"


async def settled(pilot: Pilot) -> RunScreen:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LOADED_S
    while True:
        screen = pilot.app.screen
        if (
            isinstance(screen, RunScreen)
            and not screen.buffer
            and screen.query_one("#banner", VerdictBanner).verdict is not None
        ):
            break
        assert loop.time() < deadline, "the run screen did not settle"
        await pilot.pause(0.05)
    banner = screen.query_one("#banner", VerdictBanner)
    await wait_for(pilot, lambda: str(banner.content).strip() != "", LOADED_S, "the banner")
    await wait_for(pilot, lambda: screen.panel.display, LOADED_S, "the 03C panel")
    return screen


def test_grid_panel_from_a_recorded_run(snap_compare, out: Path) -> None:  # noqa: ANN001
    app = create_app(out_dir=out, replay_dir=RUN, speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=settled)


def plain_text(widget: CellDetail) -> str:
    content = widget.content
    return content.plain if isinstance(content, Text) else str(content)


async def test_the_first_failure_then_the_cell_the_operator_picks(out: Path) -> None:
    app = create_app(out_dir=out, replay_dir=RUN, speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await settled(pilot)
        panel = screen.panel
        assert isinstance(panel, KvInvariancePanel) and panel.display
        view = panel.view
        assert len(view.grid.cells) == 96
        assert view.counts() == {
            "BITWISE_EQUAL": 93,
            "DIFFERS": 1,
            "PRECONDITION": 1,
            "UNJUDGED": 1,
        }
        detail = panel.query_one(CellDetail)
        assert detail.border_title == "first fail"
        text = plain_text(detail)
        assert "d=128 kv=1024 b=8 gqa=2 mask=1 alibi=1 sinks=0" in text and "DIFFERS" in text
        assert "single vs chunk33 at batch 3 head 1 index 77" in text
        # the operator moves onto the precondition cell: its rule and fix
        table = panel.query_one(GridTable)
        table.focus()
        await wait_for(pilot, lambda: table.has_focus, LOADED_S, "the grid to take focus")
        row, col = key_of(PRECONDITION_AT)
        keys = ["down"] * sorted(view.grid.rows).index(row)
        keys += ["right"] * sorted(view.grid.cols).index(col)
        await pilot.press(*keys)

        def on_precondition() -> bool:
            return detail.border_title == "cell" and "PRECONDITION" in plain_text(detail)

        await wait_for(pilot, on_precondition, LOADED_S, "the precondition cell's detail")
        text = plain_text(detail)
        assert "PRECONDITION" in text and "rule kv_stride_256" in text
        assert "fix  pad the KV view to 256" in text
        # engine text is shown literally, never as markup
        await pilot.press("d")
        grid_screen = await wait_for_screen(pilot, KvGridScreen)
        title = grid_screen.query_one("#kv-title")
        await wait_for(pilot, lambda: "96/96 judged" in str(title.content), LOADED_S, "96/96")
        await pilot.press("escape")
        await wait_for_screen(pilot, RunScreen)


LOG = (DATA / "kv_invariance_llamacpp" / "rocm_fail.log").read_text().splitlines()


def digest_events() -> list[TraceBatch]:
    """The llama.cpp log as a follower would hand it over: one batch every 10 lines."""
    book = LlamaCppBook()
    out = []
    for start in range(0, len(LOG), 10):
        facts = []
        for line in LOG[start : start + 10]:
            fact = parse_line(line)
            if fact is not None and book.wants(fact):
                book.apply(fact)
                facts.append(fact)
        out.append(
            TraceBatch(
                cell=0,
                file="log",
                first_line=start + 1,
                last_line=start + 10,
                end_offset=start,
                digest={"llamacpp": facts} if facts else None,
            )
        )
    return out


def test_llamacpp_rows_fill_live_and_are_renamed_when_the_backend_is() -> None:
    view = GridView()
    batches = digest_events()
    # part way through: the backend has no name yet, its passed cells are green already
    for event in batches[: len(batches) // 2]:
        view.take(event)
    sources = {k[0][0] for k in view.grid.cells}
    assert sources == {"backend 2"}  # Vulkan0, skipped, was the first device
    states = [view.state(k) for k in view.grid.cells]
    assert "BITWISE_EQUAL" in states and "RUNNING" in states
    assert view.book.running().startswith("llama.cpp backend 2: D=128")
    for event in batches[len(batches) // 2 :]:
        view.take(event)
    assert {k[0][0] for k in view.grid.cells} == {"ROCm0"}
    assert len(view.grid.cells) == 8
    fail = key_of({**DIFFERS_AT, "b": 1, "alibi": 0}, "ROCm0")
    assert view.state(fail) == "DIFFERS"
