"""The DSA panel in the console (issue #12): snapshots of the panel and its detail screen from a
recorded run, a live dsa_smoke run launched from the presets screen, the same kind of run left
and reattached from History, and `tracedeck watch DIR` with its console view.

Update the snapshots after an intended change with:
    python -m pytest tests/test_dsa_console.py --snapshot-update
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from dsa_writer import write_trace
from patience import patience
from runhelp import ROOT, cli_env, tracedeck
from runhelp import wait_for as wait_until
from test_console import (  # noqa: F401 (home is a fixture)
    LOADED_S,
    banner_text,
    home,
    out_dir,
    run_overrides,
    start_preset,
    wait_for,
    wait_for_banner,
    wait_for_run_screen,
    wait_for_screen,
)
from test_console_snapshots import run_finished
from test_dsa_live import WRITER

from console.app import create_app
from console.panels.dsa_trace import DsaDetail, DsaPanel, DsaWatchApp, DsaWatchScreen
from console.screens.history import HistoryScreen
from console.screens.presets import PresetsScreen
from runners.events import event_from_dict
from runners.kinds import event_types
from runners.kinds.dsa_trace import TraceBook

DATA = Path(__file__).resolve().parent / "data"
SIZE = (120, 40)


@pytest.fixture
def out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRACEDECK_HOME", str(tmp_path / "td"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return tmp_path / "td" / "runs"


# -- snapshots from tests/data/dsa_run (tests/data/make_dsa_run.py) --------------------------


def test_dsa_panel_snapshot(snap_compare, out: Path) -> None:  # noqa: ANN001
    app = create_app(out_dir=out, replay_dir=DATA / "dsa_run", speed=0)
    assert snap_compare(app, terminal_size=SIZE, run_before=run_finished)


def test_dsa_detail_screen_snapshot(snap_compare, out: Path) -> None:  # noqa: ANN001
    app = create_app(out_dir=out, replay_dir=DATA / "dsa_run", speed=0)

    async def open_details(pilot) -> None:  # noqa: ANN001
        await run_finished(pilot)
        await pilot.press("d")
        detail = await wait_for_screen(pilot, DsaDetail)
        await wait_for(
            pilot, lambda: "request" in str(detail.query_one("#dd-heat").render()), 0, "the heat"
        )

    assert snap_compare(app, terminal_size=SIZE, run_before=open_details)


# -- live and reattached runs ------------------------------------------------------------------


def rebuilt(local_dir: Path) -> TraceBook:
    """The DSA state folded from the run's record, as a replay builds it."""
    book = TraceBook()
    for line in (local_dir / "events.jsonl").read_bytes().splitlines():
        event = orjson.loads(line)
        if event["type"] == "trace":
            book.apply(event_from_dict(event, event_types()))  # type: ignore[arg-type]
    return book


def same_state(panel: DsaPanel, book: TraceBook) -> None:
    assert panel.book.totals() == book.totals()
    [(folder, mine)] = panel.book.streams.items()
    theirs = book.streams[folder]
    assert mine.summary.summary() == theirs.summary.summary()
    assert mine.live.all.tolist() == theirs.live.all.tolist()
    assert mine.live.heat.tolist() == theirs.live.heat.tolist()
    assert {r: s.state() for r, s in mine.reqs.items()} == {
        r: s.state() for r, s in theirs.reqs.items()
    }


async def test_a_live_dsa_smoke_run_fills_the_panel_while_it_runs(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home))
    gen = 40
    async with app.run_test(size=SIZE) as pilot:
        await start_preset(pilot, "dsa_smoke", [*run_overrides(home), f"matrix.gen=[{gen}]"])
        screen = await wait_for_run_screen(pilot)
        panel = screen.panel
        assert isinstance(panel, DsaPanel)
        seen_live = []

        def records_shown() -> bool:
            counters = str(panel.query_one("#dsa-counters").render())
            if screen.model.finished is None and "records 0" not in counters and panel.display:
                seen_live.append(counters)
            return screen.model.finished is not None and not screen.buffer

        await wait_for(pilot, records_shown, 120, "the run to end")
        assert seen_live, "no DSA record was shown before the run ended"
        records = 3 * (gen - 1) * 3  # requests x decode steps x layers

        def counted() -> bool:
            return f"records {records}" in str(panel.query_one("#dsa-counters").render())

        await wait_for(pilot, counted, LOADED_S, f"the counters to show records {records}")
        counters = str(panel.query_one("#dsa-counters").render())
        assert f"records {records}" in counters and "invalid 0" in counters
        assert banner_text(screen).startswith("TRACE_OK  (exit 0)")
        assert "no invalid record" in str(panel.query_one("#dsa-first").render())
        same_state(panel, rebuilt(Path(screen.model.header.local_dir)))
        await pilot.press("d")
        detail = await wait_for_screen(pilot, DsaDetail)

        def heat_drawn() -> bool:
            return "request 2: records touching" in str(detail.query_one("#dd-heat").render())

        await wait_for(pilot, heat_drawn, LOADED_S, "the detail's heat map of request 2")
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is screen, LOADED_S, "the run screen again")


async def test_a_dsa_run_left_and_reattached_shows_the_same_state(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home))
    gen = 60
    async with app.run_test(size=SIZE) as pilot:
        await start_preset(pilot, "dsa_smoke", [*run_overrides(home), f"matrix.gen=[{gen}]"])
        first = await wait_for_run_screen(pilot)
        await wait_for(
            pilot, lambda: first.panel.book.totals()["records"] > 0, 60, "the first records"
        )
        await pilot.press("escape")  # the run goes on without the console
        await wait_for_screen(pilot, PresetsScreen)
        await pilot.press("f2")
        history = await wait_for_screen(pilot, HistoryScreen)
        await wait_for(pilot, lambda: len(history.entries) == 1, 10, "the history scan")
        await pilot.press("enter")
        attached = await wait_for_banner(pilot, timeout=120)
        assert attached.source.mode == "ATTACHED"
        panel = attached.panel
        assert isinstance(panel, DsaPanel)
        assert banner_text(attached).startswith("TRACE_OK  (exit 0)")
        assert panel.book.totals() == {
            "records": 3 * (gen - 1) * 3,
            "invalid": 0,
            "shards": 2,
            "requests": 3,
        }
        same_state(panel, rebuilt(Path(attached.model.header.local_dir)))


# -- tracedeck watch DIR, on a terminal ----------------------------------------------------------


def _writer(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    src = write_trace(tmp_path / "src")
    out = tmp_path / "live"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(src), str(out / "block16")])
    wait_until(lambda: (out / "block16").exists(), LOADED_S, what=f"the writer to create {out}")
    return writer, out


async def test_the_watch_console_follows_a_directory_being_written(tmp_path: Path) -> None:
    writer, folder = _writer(tmp_path)
    try:
        screen = DsaWatchScreen(str(folder), idle_s=1.0, topk=32)
        app = DsaWatchApp(screen)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: screen.outcome is not None, 60, "the watch to end")
            assert screen.outcome == ("TRACE_OK (exit 0)", 0)

            def counted() -> bool:
                return "records 45" in str(screen.panel.query_one("#dsa-counters").render())

            await wait_for(pilot, counted, LOADED_S, "the counters to show records 45")
            log = screen.query_one("#watch-log").lines
            await wait_for(pilot, lambda: log and log[-1] == "RESULT: TRACE_OK", 0, "the result")
            counters = str(screen.panel.query_one("#dsa-counters").render())
            assert "records 45" in counters and "shards 3" in counters and "invalid 0" in counters
            log = screen.query_one("#watch-log").lines
            assert "following trace_steps_4_5.jsonl" in log and log[-1] == "RESULT: TRACE_OK"
            await pilot.press("d")
            await wait_for_screen(pilot, DsaDetail)
            await pilot.press("escape", "q")
        assert app.return_code == 0
    finally:
        writer.wait(timeout=patience(60))
    analyzed = tracedeck("analyze", str(folder), "--json", env=cli_env(tmp_path))
    assert json.loads(analyzed.stdout)["dirs"][0]["records"] == 45


async def test_the_watch_console_says_it_waits_for_a_missing_directory(tmp_path: Path) -> None:
    screen = DsaWatchScreen(str(tmp_path / "nope"), idle_s=1.0)
    app = DsaWatchApp(screen)
    async with app.run_test(size=SIZE) as pilot:
        log = screen.query_one("#watch-log")
        await wait_for(pilot, lambda: "waiting for" in "\n".join(log.lines), 20, "the note")
        assert screen.outcome is None  # still waiting, not an error
        await pilot.press("q")


def _on_a_terminal(args: list[str], env: dict[str, str], quit_when: bytes) -> tuple[int, bytes]:
    """Run tracedeck on a pseudo-terminal; press q once `quit_when` was printed."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal is its stdin and stdout
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "console.cli", *args], env)
    out, sent, deadline = b"", False, time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    data = os.read(fd, 1 << 16)
                except OSError:
                    break
                if not data:
                    break
                out += data
            if not sent and quit_when in out:
                os.write(fd, b"q")
                sent = True
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), out


@pytest.mark.e2e  # runs the engine or a process: out of the fast tier
def test_watch_on_a_terminal_opens_the_console_and_headless_prints(tmp_path: Path) -> None:
    write_trace(tmp_path / "t")
    env = {**cli_env(tmp_path), "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    args = ["watch", str(tmp_path / "t"), "--idle", "0.5", "--dsa-topk", "32"]
    code, out = _on_a_terminal(args, env, b"TRACE_OK")
    assert code == 0
    assert b"\x1b[?1049h" in out  # the alternate screen: the console
    code, out = _on_a_terminal([*args, "--headless"], env, b"never")
    assert code == 0 and b"\x1b[?1049h" not in out
    assert out.rstrip().endswith(b"RESULT: TRACE_OK")
