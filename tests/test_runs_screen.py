"""The Runs screen (F3) and `tracedeck status` read as a new operator reads them at 120x40
(issue 24): what runs first, every column on the screen, each state's reason shown, elapsed
times that name their units."""

from __future__ import annotations

import asyncio
import datetime as dt
import shutil
from pathlib import Path

import orjson
import pytest
from runhelp import cli_env, tracedeck
from test_console import LOADED_S, screen_text, wait_for, wait_for_screen
from textual.widgets import DataTable

from console.app import create_app
from console.screens.runs import RunsScreen
from runners.status import Status, collect, elapsed_words

DATA = Path(__file__).resolve().parent / "data"
CLOCK = dt.datetime(2026, 11, 25, 8, 0, 0, tzinfo=dt.UTC).timestamp()
STOPPED_NOTE = "its end is not recorded and no process of it runs"


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Records: an ended run, and a run whose end is not recorded and whose processes are gone
    (a console killed with it), started after it."""
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRACEDECK_HOME", str(tmp_path / "td"))
    out = tmp_path / "td" / "runs"
    shutil.copytree(DATA / "hello_command_run", out / "ended")
    stopped = out / "stopped"
    shutil.copytree(DATA / "hello_command_run", stopped)
    events = stopped / "events.jsonl"
    events.write_bytes(b"".join(events.read_bytes().splitlines(keepends=True)[:6]))
    record = orjson.loads((stopped / "run.json").read_bytes())
    record.update(run_id="20261123-080000-hello_command-beef", remote_dir=str(tmp_path / "gone"))
    record.update(started_at="2026-11-23T08:00:00+00:00")
    (stopped / "run.json").write_bytes(orjson.dumps(record))
    return out


def test_elapsed_names_its_units() -> None:
    assert [elapsed_words(s) for s in (None, 0, 42, 125, 3725, 2 * 86400 + 3 * 3600 + 59)] == [
        "-",
        "0s",
        "42s",
        "2m05s",
        "1h02m",
        "2d03h",
    ]


async def test_runs_screen_orders_by_state_shows_every_column_and_the_reason(out: Path) -> None:
    app = create_app(out_dir=out, clock=lambda: CLOCK)
    app.runs_hosts = []
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f3")
        screen = await wait_for_screen(pilot, RunsScreen)
        await wait_for(pilot, lambda: screen.collected > 0, LOADED_S, "the runs collected")
        # what still needs a look comes first (as `tracedeck status` lists it), not the
        # alphabetical order of the state words ("ended" before "stopped")
        assert [(r.state, r.local_dir) for r in screen.shown] == [
            ("stopped", str(out / "stopped")),
            ("ended", str(out / "ended")),
        ]
        table = screen.query_one("#runs-table", DataTable)
        assert [str(c) for c in table.get_row_at(0)][0] == "stopped"
        # the highlighted run's reason for its state, under the table
        await wait_for(
            pilot, lambda: f"note  {STOPPED_NOTE}" in screen_text(app), LOADED_S, "the note"
        )
        text = screen_text(app)
        header = next(line for line in text.splitlines() if "run id" in line)
        for label in ("state", "verdict", "host(s)", "elapsed", "lock holder"):
            assert label in header, header  # every column on the screen, none off its edge
        ended = next(line for line in text.splitlines() if "PASS" in line)
        assert ended.split()[-1] == "2s", ended
        await pilot.press("down")
        await wait_for(
            pilot, lambda: "note  " not in screen_text(app), LOADED_S, "no note for ended"
        )
        # when the hosts were asked: the states are what they said then
        assert "2 of 2 run(s), asked 08:00:00 UTC, sorted by state (asc)." in screen_text(app)


async def test_runs_screen_says_it_is_asking_until_the_hosts_answer(out: Path) -> None:
    answer = asyncio.Event()

    async def slow(out_dir: Path, hosts: list[str] | None, now: float) -> Status:
        await answer.wait()  # a host that takes its time
        return await collect(out_dir, hosts=hosts, now=now)

    app = create_app(out_dir=out, clock=lambda: CLOCK)
    app.runs_hosts, app.runs_collect = [], slow
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f3")
        screen = await wait_for_screen(pilot, RunsScreen)
        await pilot.resize_terminal(100, 40)  # a redraw meanwhile does not say "0 of 0 run(s)"
        await wait_for(pilot, lambda: screen.size.width == 100, LOADED_S, "the resize")
        assert "asking the hosts of each run ..." in screen_text(app)
        assert "0 of 0" not in screen_text(app)
        answer.set()
        await wait_for(pilot, lambda: screen.collected > 0, LOADED_S, "the runs collected")
        await wait_for(
            pilot, lambda: "2 of 2 run(s), asked" in screen_text(app), LOADED_S, "the count"
        )


def test_status_text_elapsed_and_order(out: Path, tmp_path: Path) -> None:
    done = tracedeck("status", "--out", str(out), env=cli_env(tmp_path / "home"))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].startswith("stopped ") and lines[1].rstrip().endswith(STOPPED_NOTE), lines
    assert lines[2].startswith("ended ") and "  2s" in lines[2], lines
