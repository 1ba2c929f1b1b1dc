"""SVG snapshots of each console screen at 120x40, built from fixed presets and recorded runs.

Update after an intended change with: python -m pytest tests/test_console_snapshots.py --snapshot-update
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import orjson
import pytest
from rich.text import Text
from textual.pilot import Pilot
from textual.widgets import DataTable

from console.app import create_app
from console.panels.readout import TracesScreen
from console.screens.history import HistoryScreen
from console.screens.run import RunScreen
from console.widgets.banner import VerdictBanner

DATA = Path(__file__).resolve().parent / "data"
SIZE = (120, 40)
PRESETS = sorted((DATA / "presets").glob("*.toml"))


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Out dir in tmp; HOME too, so no ~/.ssh/config alias or recent target leaks in."""
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRACEDECK_HOME", str(tmp_path / "td"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return tmp_path / "td" / "runs"


# What a loaded 2-core machine may need; only a failing test waits it out.
LOADED_S = 60.0


def columns_fit(table: DataTable) -> bool:
    """Every column of `table` sized to its content is measured as wide as its widest cell (a
    DataTable measures them when idle, which a loaded machine puts off); a column given a width
    (one that takes what the others leave) is drawn at that width."""
    for key, column in table.columns.items():
        if not column.auto_width:
            continue
        cells = [v.cell_len if isinstance(v, Text) else len(str(v)) for v in table.get_column(key)]
        if column.content_width < max(cells, default=0):
            return False
    return True


async def until(pilot: Pilot, condition, timeout: float = LOADED_S) -> None:  # noqa: ANN001
    """Poll condition, then let pending messages and animations finish (no fixed time)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "the screen did not settle"
        await pilot.pause(0.05)
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


async def run_finished(pilot: Pilot) -> None:
    def done() -> bool:
        screen = pilot.app.screen
        return (
            isinstance(screen, RunScreen)
            and not screen.buffer
            and screen.query_one("#banner", VerdictBanner).verdict is not None
        )

    await until(pilot, done)


def test_presets_screen(snap_compare, out: Path) -> None:  # noqa: ANN001
    app = create_app(out_dir=out, preset_paths=PRESETS)
    assert snap_compare(app, terminal_size=SIZE, press=["down"])


def test_run_screen_from_recorded_run(snap_compare, out: Path) -> None:  # noqa: ANN001
    app = create_app(out_dir=out, replay_dir=DATA / "equivalence_fail", speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=run_finished)


def test_traces_screen(snap_compare, out: Path) -> None:  # noqa: ANN001
    app = create_app(out_dir=out, replay_dir=DATA / "readout_run", speed=0)

    async def open_traces(pilot: Pilot) -> None:
        await run_finished(pilot)
        await pilot.press("d", "down", "down", "down")
        await until(pilot, lambda: isinstance(pilot.app.screen, TracesScreen))

    assert snap_compare(app, terminal_size=SIZE, run_before=open_traces)


def test_history_screen(snap_compare, out: Path) -> None:  # noqa: ANN001
    for name in ("equivalence_fail", "readout_run", "hello_command_run"):
        shutil.copytree(DATA / name, out / name)
    unfinished = out / "unfinished"
    shutil.copytree(DATA / "hello_command_run", unfinished)
    events = unfinished / "events.jsonl"
    events.write_bytes(b"".join(events.read_bytes().splitlines(keepends=True)[:6]))
    run_json = unfinished / "run.json"
    record = orjson.loads(run_json.read_bytes())
    record.update(
        run_id="20260529-080000-hello_command-beef", started_at="2026-05-29T08:00:00+00:00"
    )
    run_json.write_bytes(orjson.dumps(record))
    app = create_app(out_dir=out, preset_paths=PRESETS)

    async def open_history(pilot: Pilot) -> None:
        await pilot.press("f2")
        await until(
            pilot,
            lambda: (
                isinstance(pilot.app.screen, HistoryScreen)
                and len(pilot.app.screen.entries) == 4
                and not pilot.app.screen.workers  # the scan is over, not about to refill
                and columns_fit(pilot.app.screen.query_one("#runs", DataTable))
            ),
        )
        await pilot.press("down", "down")  # the readout run: its reason in full under the table
        await until(pilot, lambda: pilot.app.screen.query_one("#history-why").display)

    assert snap_compare(app, terminal_size=SIZE, run_before=open_history)


def test_help_screen(snap_compare, out: Path) -> None:  # noqa: ANN001
    app = create_app(out_dir=out, preset_paths=PRESETS)
    assert snap_compare(app, terminal_size=SIZE, press=["f1"])
