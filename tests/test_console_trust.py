"""What the screen and the headless printer say can be trusted: an engine's text never moves the
cursor, retitles the terminal or reorders what is shown, and a recorded pass its own events
deny is never shown as a pass (the run screen, the History screen, replay --headless)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from runhelp import cli_env, tracedeck
from test_console import SIZE, banner_text, wait_for, wait_for_banner, wait_for_screen
from test_record_lies import _run

from console.app import create_app
from console.headless import Printer
from console.screens.history import HistoryScreen, scan_runs
from console.widgets.banner import VerdictBanner
from console.widgets.run_log import RunLog
from runners.events import OutputLines, RunStarted

HOSTILE = "\x1b]0;PWNED\x07 \x1b[2J\x1b[8m hidden \u202eSSAP :TLUSER\u202c zero\u200bwidth \x9b31m"
UNSAFE = ("\x1b", "\x07", "\x9b", "\u202e", "\u202c", "\u200b")


def _record(tmp_path: Path, command: str, matrix: str = "[1, 2]") -> Path:
    return _run(tmp_path, tmp_path / "out", command, matrix)


def _contradicted(tmp_path: Path) -> Path:
    """A record whose cell n=2 failed, its end edited to say PASS, exit 0."""
    local = _record(tmp_path, "sh -c 'test {n} != 2'")
    path = local / "events.jsonl"
    lines = path.read_text().splitlines()
    end = json.loads(lines[-1])
    end.update(verdict="PASS", exit_code=0)
    lines[-1] = json.dumps(end)
    path.write_text("\n".join(lines) + "\n")
    return local


def test_the_headless_printer_shows_engine_text_without_its_escapes() -> None:
    out = io.StringIO()
    printer = Printer(out)
    printer(RunStarted(run_id="r", preset="p", kind="command", target="local", local_dir="d",
                       remote_dir="d", cells=[{"index": 0, "params": {"n": HOSTILE},
                       "command": "c"}], profile="none", env={}, notes=[]))  # fmt: skip
    printer(OutputLines(cell=0, stream="stdout", lines=[HOSTILE], file="f", end_offset=1))
    text = out.getvalue()
    assert "hidden" in text and "SSAP :TLUSER" in text
    assert not [c for c in UNSAFE if c in text], repr(text)


async def test_the_run_log_shows_engine_text_without_its_escapes(tmp_path: Path) -> None:
    local = _record(tmp_path, f"printf '%s\\n' {json.dumps(HOSTILE)}", "[1]")
    app = create_app(out_dir=tmp_path / "out", replay_dir=local, speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot, timeout=60)
        log = screen.query_one(RunLog)
        await wait_for(pilot, lambda: any("hidden" in line for line in log.lines()), 60, "the line")
        shown = "\n".join(log.lines() + log.rows())
        assert not [c for c in UNSAFE if c in shown], repr(shown)


async def test_a_contradicted_pass_is_a_red_banner_and_a_red_history_row(tmp_path: Path) -> None:
    local = _contradicted(tmp_path)
    app = create_app(out_dir=tmp_path / "out", replay_dir=local, speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot, timeout=60)
        banner = screen.query_one("#banner", VerdictBanner)
        assert banner.has_class("-fail") and not banner.has_class("-pass")
        assert banner_text(screen).startswith("PASS (contradicted)  (exit 1)")
    [entry] = scan_runs(tmp_path / "out")
    assert (entry.verdict, entry.exit_code) == ("PASS (contradicted)", 1)
    app = create_app(out_dir=tmp_path / "out")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        history = await wait_for_screen(pilot, HistoryScreen)
        await wait_for(pilot, lambda: len(history.entries) == 1, 60, "the history scan")
        table = history.query_one("#runs")
        cell = table.get_row_at(0)[4]
        assert str(cell) == "PASS (contradicted)" and "red" in str(cell.style)


def test_replay_headless_says_contradicted_on_its_result_line(tmp_path: Path) -> None:
    local = _contradicted(tmp_path)
    done = tracedeck("replay", str(local), "--headless", env=cli_env(tmp_path))
    assert done.returncode == 1
    assert done.stdout.rstrip().endswith("RESULT: PASS (contradicted) (exit 1)"), done.stdout
