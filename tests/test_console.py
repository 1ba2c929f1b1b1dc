"""The Textual console driven by Pilot: real runs, replays, History, the first-fail panel."""

from __future__ import annotations

import asyncio
import html
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import orjson
import pytest
from patience import patience
from runhelp import toy_override, wait_until_held
from textual import events
from textual.css.query import NoMatches
from textual.pilot import Pilot
from textual.screen import Screen
from textual.widgets import DataTable, TextArea

from console.app import TracedeckApp, create_app
from console.panels.equivalence import EquivalenceView, FirstFailPanel, VerdictTable
from console.panels.readout import ReadoutTable, TracesScreen
from console.run_model import RunModel
from console.screens.dialogs import ConfirmDialog, HostKeyDialog
from console.screens.help import HelpScreen
from console.screens.history import UNFINISHED, HistoryScreen, last_verdict, scan_runs
from console.screens.presets import PresetsScreen, load_recent
from console.screens.run import RunScreen
from console.widgets.banner import VerdictBanner
from console.widgets.cells_table import CellsTable
from console.widgets.run_log import RunLog
from runners.events import (
    CellFinished,
    CellStarted,
    Connection,
    Error,
    OutputLines,
    RunFinished,
    RunStarted,
    event_from_dict,
)
from runners.kinds import event_types, tone
from runners.kinds.equivalence import PairVerdict

DATA = Path(__file__).resolve().parent / "data"
SIZE = (120, 40)
# The least any wait here allows: what a test waits for can take this long on a loaded 2-core
# machine. Only a failing test ever waits it out.
LOADED_S = 60.0


# -- helpers the lead's B3.67 smoke test reuses ---------------------------------------------------


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TRACEDECK_HOME and HOME in tmp_path, so no test touches the real home."""
    (tmp_path / "home").mkdir(exist_ok=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRACEDECK_HOME", str(tmp_path / "td"))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    return tmp_path


def run_overrides(tmp: Path) -> list[str]:
    """Overrides that keep a run's remote side and lock inside the test's tmp dir."""
    return [f"target.runs={tmp}/runs", f"target.lock={tmp}/lock"]


def out_dir(tmp: Path) -> Path:
    return tmp / "td" / "runs"


async def select_preset(pilot: Pilot, name: str) -> PresetsScreen:
    """On the presets screen, move the table's cursor to `name` with the arrow keys."""
    screen = pilot.app.screen
    assert isinstance(screen, PresetsScreen), f"not on the presets screen: {screen!r}"
    names = [entry.name for entry in screen.entries]
    assert name in names, f"preset {name!r} not listed; have {names}"
    await pilot.press("ctrl+l")
    table = screen.query_one("#presets")
    await pilot.press(*["up"] * table.cursor_row, *["down"] * names.index(name))

    def chosen() -> bool:
        entry = screen.selected()
        return entry is not None and entry.name == name

    await wait_for(pilot, chosen, LOADED_S, f"the cursor on preset {name}")
    return screen


async def start_preset(pilot: Pilot, name: str, overrides: Iterable[str] = ()) -> None:
    """Pick `name`, enter the overrides (one per line) and start it, from the keyboard."""
    screen = await select_preset(pilot, name)
    await pilot.press("ctrl+o")
    if overrides:
        # One bracketed paste, as a terminal delivers pasted text: typing key by key is slow.
        pasted = "\n".join(overrides)
        area = screen.query_one("#overrides", TextArea)
        area.post_message(events.Paste(pasted))
        await wait_for(pilot, lambda: pasted in area.text, LOADED_S, "the pasted overrides")
    await pilot.press("ctrl+r")


def holds(condition) -> bool:  # noqa: ANN001
    try:
        return bool(condition())
    except NoMatches:
        return False


async def wait_for(pilot: Pilot, condition, timeout: float, what: str) -> None:  # noqa: ANN001
    """Poll condition until it holds; fail naming `what` after max(timeout, LOADED_S), stretched
    on a busy machine. A widget not there yet (a screen pushed, its children still mounting on
    a busy machine) is "not yet", not a failure."""
    timeout = patience(max(timeout, LOADED_S))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not holds(condition):
        if loop.time() > deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what}; "
                f"screen {pilot.app.screen!r}\n{screen_text(pilot.app)}"
            )
        await pilot.pause(0.05)


async def wait_for_run_screen(pilot: Pilot, timeout: float = 20.0) -> RunScreen:
    def on_run() -> bool:
        return isinstance(pilot.app.screen, RunScreen)

    await wait_for(pilot, on_run, timeout, "the run screen")
    return pilot.app.screen  # type: ignore[return-value]


async def wait_for_banner(pilot: Pilot, timeout: float = 30.0) -> RunScreen:
    """Wait until the run screen shows its final verdict banner; returns that screen."""
    screen = await wait_for_run_screen(pilot, timeout)

    def shown() -> bool:
        return screen.query_one("#banner", VerdictBanner).verdict is not None and not screen.buffer

    await wait_for(pilot, shown, timeout, "the verdict banner")
    await wait_for(pilot, lambda: banner_text(screen).strip() != "", timeout, "the banner's text")
    return screen


async def wait_for_screen(pilot: Pilot, kind: type) -> Screen:
    """Wait until the app shows a screen of this kind; returns it."""
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, kind), LOADED_S, kind.__name__)
    return pilot.app.screen


async def wait_for_text(pilot: Pilot, *texts: str) -> str:
    """Wait until the terminal shows every one of texts; returns what it shows."""
    await wait_for(
        pilot,
        lambda: all(t in screen_text(pilot.app) for t in texts),
        LOADED_S,
        f"the screen to show {texts}",
    )
    return screen_text(pilot.app)


def error_text(app: TracedeckApp) -> str:
    """The presets screen's error line ("" on another screen)."""
    if not isinstance(app.screen, PresetsScreen):
        return ""
    return str(app.screen.query_one("#preset-error").content)


def banner_text(screen: RunScreen) -> str:
    return str(screen.query_one("#banner", VerdictBanner).content)


def cells(screen: RunScreen) -> list[list[str]]:
    return screen.query_one("#cells", CellsTable).contents()


def screen_text(app: TracedeckApp) -> str:
    """What the terminal shows, line by line (read back from the SVG screenshot)."""
    svg = app.export_screenshot()
    lines: dict[int, list[tuple[float, str]]] = {}
    pattern = (
        r'<text [^>]*x="([\d.]+)"[^>]*clip-path="url\(#[\w-]+-line-(\d+)\)"[^>]*>([^<]*)</text>'
    )
    for x, line, text in re.findall(pattern, svg):
        lines.setdefault(int(line), []).append((float(x), html.unescape(text).replace("\xa0", " ")))
    return "\n".join("".join(t for _, t in sorted(lines[n])).rstrip() for n in sorted(lines))


def copy_run(name: str, dest: Path) -> Path:
    target = dest / name
    shutil.copytree(DATA / name, target)
    return target


def recorded(name: str) -> list[dict]:
    return [orjson.loads(line) for line in (DATA / name / "events.jsonl").read_bytes().splitlines()]


# -- the model (no UI) ---------------------------------------------------------------------------


def test_model_folds_events_and_reports_changed_rows_only() -> None:
    model = RunModel(log_lines=4)
    model.apply(
        RunStarted(
            run_id="r",
            preset="p",
            kind="command",
            target="local",
            local_dir="",
            remote_dir="",
            cells=[
                {"index": 0, "params": {"n": 1}, "command": ""},
                {"index": 1, "params": {"n": 2}, "command": ""},
            ],
            profile="none",
            env={},
            t=10.0,
        )
    )
    first = model.take_changes()
    assert list(first.cells) == [0, 1] and first.header
    model.apply(CellStarted(cell=1, params={"n": 2}, command="", t=11.0))
    model.apply(
        OutputLines(
            cell=1, stream="stdout", lines=[f"l{i}" for i in range(6)], file="", end_offset=0
        )
    )
    model.apply(CellFinished(cell=1, state="failed", exit_code=2, duration_s=1.5, t=12.5))
    changes = model.take_changes()
    assert list(changes.cells) == [1] and not changes.header
    assert changes.log_new == 6 and [e[2] for e in model.log] == ["l2", "l3", "l4", "l5"]
    assert model.cells[1].state == "failed" and model.cells[1].exit_code == 2
    assert model.cells[0].state == "pending"
    assert not model.take_changes()
    model.apply(RunFinished(verdict="FAIL", exit_code=1, summary={}, t=20.0))
    assert model.elapsed(now=None) == 10.0


def test_panel_view_keeps_the_first_real_failure() -> None:
    model = EquivalenceView()
    drift = {"token_idx": 1, "metric": "max_abs_diff", "value": 1.0, "threshold": 0.005}
    fail = {"token_idx": 7, "metric": "p99_abs_diff", "value": 0.5, "threshold": 0.001}
    later = {"token_idx": 9, "metric": "p99_abs_diff", "value": 0.7, "threshold": 0.001}
    for kv, seed, word, ff in (
        (0, 0, "EXPECTED_DRIFT", drift),
        (1, 1, "FAIL_EQUIV", fail),
        (1, 2, "FAIL_EQUIV", later),
    ):
        model.take(
            PairVerdict(
                seed=seed,
                kv_aligned=kv,
                verdict=word,
                metrics={},
                thresholds={},
                first_fail=ff,
                metrics_path="",
            )
        )
    assert model.first_fail is not None and model.first_fail["token_idx"] == 7
    assert model.first_fail["seed"] == 1 and model.first_fail_verdict == "FAIL_EQUIV"


def test_unknown_verdict_words_are_failures() -> None:
    assert tone("equivalence", "PASS_GUARDRAIL") == tone("readout", "OK") == "pass"
    assert tone("command", "PASS") == "pass"
    assert tone("equivalence", "EXPECTED_DRIFT") == "drift"
    assert tone("command", "EXPECTED_DRIFT") == "fail"  # drift means something to B3.67 only
    assert tone("no_such_kind", "PASS") == "fail"
    for word in (
        "FAIL_GUARDRAIL",
        "NO OK",
        "CRASHED",
        "CANCELLED",
        "DISCONNECTED",
        "PASSED?",
        None,
    ):
        for kind in ("command", "equivalence", "readout"):
            assert tone(kind, word) == "fail"


# -- live runs -------------------------------------------------------------------------------------


async def test_live_hello_command_from_presets_to_banner(home: Path) -> None:
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await start_preset(pilot, "hello_command", run_overrides(home))
        screen = await wait_for_banner(pilot, timeout=30)
        rows = cells(screen)
        assert [row[:4] for row in rows] == [
            ["1", "n=1", "passed", "0"],
            ["2", "n=2", "passed", "0"],
            ["3", "n=3", "passed", "0"],
        ]
        assert banner_text(screen).startswith("PASS  (exit 0)")
        assert screen.query_one("#banner").has_class("-pass")
        log = screen.query_one("#log", RunLog).lines()
        assert "[2] | cell 2 line 3" in log
        assert load_recent(out_dir(home)) == ["local"]
        await wait_for_text(pilot, "PASS  (exit 0)", "hello_command")


async def test_live_run_replayed_from_history_shows_the_same(home: Path) -> None:
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await start_preset(pilot, "hello_command", run_overrides(home))
        live = await wait_for_banner(pilot, timeout=30)
        live_cells, live_log, live_banner = (
            cells(live),
            live.query_one(RunLog).lines(),
            banner_text(live),
        )
        await pilot.press("escape", "f2")
        history = await wait_for_screen(pilot, HistoryScreen)
        await wait_for(pilot, lambda: len(history.entries) == 1, 10, "the history scan")
        assert history.entries[0].verdict == "PASS"
        await pilot.press("enter")
        replay = await wait_for_banner(pilot, timeout=10)
        assert replay is not live and replay.source.mode == "REPLAY"
        assert cells(replay) == live_cells
        assert replay.query_one(RunLog).lines() == live_log
        assert banner_text(replay) == live_banner


async def test_cancel_asks_first_then_cancels(home: Path) -> None:
    app = create_app(out_dir=out_dir(home))
    overrides = [*run_overrides(home), 'engine.command="sleep 30"']
    async with app.run_test(size=SIZE) as pilot:
        await start_preset(pilot, "hello_command", overrides)
        screen = await wait_for_run_screen(pilot)
        await wait_for(
            pilot,
            lambda: (
                screen.model.cells.get(0) is not None and screen.model.cells[0].state == "running"
            ),
            15,
            "cell 1 to run",
        )
        await pilot.press("c")
        await wait_for_screen(pilot, ConfirmDialog)
        await pilot.press("n")
        await wait_for(pilot, lambda: app.screen is screen, LOADED_S, "the dialog to close")
        assert screen.model.finished is None
        await pilot.press("c")
        await wait_for_screen(pilot, ConfirmDialog)
        await pilot.press("y")
        await wait_for_banner(pilot, timeout=30)
        assert screen.model.finished is not None and screen.model.finished.verdict == "CANCELLED"
        assert screen.query_one("#banner").has_class("-fail")
        assert {row[2] for row in cells(screen)} == {"cancelled"}


async def test_leaving_keeps_the_run_going_and_history_reattaches(home: Path) -> None:
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await start_preset(pilot, "hello_command", run_overrides(home))
        first = await wait_for_run_screen(pilot)
        await wait_for(pilot, lambda: first.model.header.holder != {}, 15, "the lock holder")
        await pilot.press("escape")
        await wait_for_screen(pilot, PresetsScreen)
        await pilot.press("f2")
        history = await wait_for_screen(pilot, HistoryScreen)
        await wait_for(pilot, lambda: len(history.entries) == 1, 10, "the history scan")
        assert history.entries[0].verdict is None  # nobody followed it to the end
        # The row's verdict cell (the text drawn from it may be cut: DataTable sizes columns on
        # its own idle, which a headless app under load may not reach; see the i21 report).
        runs = history.query_one("#runs", DataTable)
        await wait_for(pilot, lambda: runs.row_count == 1, LOADED_S, "the history row")
        assert str(runs.get_row_at(0)[4]) == UNFINISHED
        await pilot.press("enter")
        attached = await wait_for_banner(pilot, timeout=30)
        assert attached.source.mode == "ATTACHED"
        assert [row[2:4] for row in cells(attached)] == [["passed", "0"]] * 3
        assert banner_text(attached).startswith("PASS")
    assert last_verdict(Path(attached.model.header.local_dir) / "events.jsonl") == "PASS"


async def test_bad_override_is_shown_naming_the_key_and_nothing_starts(home: Path) -> None:
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await select_preset(pilot, "hello_command")
        await pilot.press("ctrl+o", *"matrix.n=[]", "ctrl+r")  # typed key by key
        await wait_for(pilot, lambda: "matrix.n" in error_text(app), LOADED_S, "the error")
        error = error_text(app)
        assert "(--set matrix.n=[])" in error and "matrix.n: must be a non-empty list" in error
        assert not list(out_dir(home).glob("**/run.json"))


# -- replays of recorded runs ----------------------------------------------------------------------


async def test_recorded_equivalence_run_from_history(home: Path) -> None:
    copy_run("equivalence_fail", out_dir(home))
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        history = await wait_for_screen(pilot, HistoryScreen)
        await wait_for(pilot, lambda: len(history.entries) == 1, 10, "the history scan")
        await pilot.press("enter")
        screen = await wait_for_banner(pilot, timeout=10)
        expected = [
            [str(e["kv_aligned"]), str(e["seed"]), e["verdict"]]
            for e in recorded("equivalence_fail")
            if e["type"] == "pair_verdict"
        ]
        table = screen.query_one("#verdicts", VerdictTable).contents()
        assert [[row[0], row[1], row[-1]] for row in table] == expected
        assert table[1][2:6] == ["0.0123", "0.0021", "0.9921", "0.99871"]
        assert banner_text(screen).split("\n")[0] == "FAIL_GUARDRAIL  (exit 1)"
        assert screen.query_one("#banner").has_class("-fail")
        assert len(cells(screen)) == 12 and {row[2] for row in cells(screen)} == {"exited 0"}
        # engine output is shown literally, never as markup
        assert "[1] | [bold]engine text, not markup[/bold]" in screen.query_one(RunLog).lines()


async def test_first_fail_panel_shows_token_and_both_top5(home: Path) -> None:
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "equivalence_fail", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot, timeout=10)
        panel = screen.query_one("#first-fail", FirstFailPanel)
        assert panel.has_class("-shown") and panel.first_fail is not None
        text = await wait_for_text(pilot, "token_idx=17", "decode: runs/")
        assert "kv_aligned=1  seed=1  token_idx=17  token_id=4242  FAIL_EQUIV" in text
        assert "max_abs_diff = 0.0123  threshold 0.005 (must be <=)" in text
        rows = [line for line in text.splitlines() if re.match(r"^│\s+[1-5]\s", line)]
        got = [line.strip("│ ").split() for line in rows]
        assert got == [
            ["1", "4242", "12.5", "311", "12.49"],
            ["2", "311", "11.9", "4242", "12.48"],
            ["3", "17", "11.2", "17", "11.21"],
            ["4", "905", "10.8", "905", "10.79"],
            ["5", "66", "10.1", "66", "10.12"],
        ]
        assert "prefill: runs/kv_aligned_1/seed_1/prefill/logits.jsonl.gz:18" in text
        assert "decode: runs/kv_aligned_1/seed_1/decode/logits.jsonl.gz:18" in text
        assert "[red]not markup[/red]" in text


async def test_no_first_fail_panel_when_every_pair_passes(home: Path) -> None:
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "hello_command_run", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot, timeout=10)
        assert not any(p.has_class("-shown") for p in screen.query(FirstFailPanel))
        assert not screen.check_action("cancel_run", ())  # a replay cannot cancel anything


async def test_readout_run_fills_the_traces_screen(home: Path) -> None:
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "readout_run", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot, timeout=10)
        assert banner_text(screen).split("\n")[0] == "NO OK  (exit 1)"
        await pilot.press("d")
        traces = await wait_for_screen(pilot, TracesScreen)
        table = traces.query_one("#readout", ReadoutTable)
        await wait_for(pilot, lambda: len(table.contents()) == 5, LOADED_S, "the five rows")
        rows = table.contents()
        assert [(r[0], r[1], r[3], r[6], r[7]) for r in rows] == [
            ("p0_short", "79", "79", "0", "OK"),
            ("p1_len_16", "4413", "9023", "0", "NO OK"),
            ("p2_len_64", "311", "311", "1", "NO OK"),
            ("p3_collapsed", "500", "13", "0", "NO OK"),
            ("p4_prefill_only", "1200", "no decode", "0", "—"),
        ]
        await pilot.press("down", "down", "down")

        def on_p3() -> bool:
            return screen.panel.rows[traces.selected]["prompt"] == "p3_collapsed"

        await wait_for(pilot, on_p3, LOADED_S, "the cursor on p3_collapsed")
        spark = traces.query_one("#spark-top1")
        await wait_for(pilot, lambda: spark.data == [13.0] * 8, LOADED_S, "p3's sparkline")
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is screen, LOADED_S, "the run screen again")


async def test_replay_at_speed_paces_by_recorded_time(home: Path) -> None:
    copy_run("equivalence_fail", out_dir(home))
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        history = await wait_for_screen(pilot, HistoryScreen)
        await wait_for(pilot, lambda: len(history.entries) == 1, 10, "the history scan")
        history.query_one("#speed").value = 10.0  # 31 recorded seconds in about 3 s
        await pilot.press("r")
        screen = await wait_for_run_screen(pilot)
        assert screen.source.mode == "REPLAY x10"
        total = len(recorded("equivalence_fail"))
        seen: set[int] = set()

        def done() -> bool:
            seen.add(screen.model.events)
            return screen.model.finished is not None

        await wait_for(pilot, done, 20, "the end of the replay")
        assert any(0 < n < total for n in seen), seen  # events came in over time, not at once
        assert screen.model.events == total
        assert screen.model.finished.verdict == "FAIL_GUARDRAIL"


async def test_replay_of_a_damaged_record_names_the_line(home: Path, tmp_path: Path) -> None:
    run = copy_run("hello_command_run", tmp_path / "bad")
    events = run / "events.jsonl"
    lines = events.read_bytes().splitlines(keepends=True)
    events.write_bytes(b"".join(lines[:3]) + b"{not json}\n" + b"".join(lines[3:]))
    app = create_app(out_dir=out_dir(home), replay_dir=run, speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_run_screen(pilot)
        await wait_for(pilot, lambda: bool(screen.model.errors), 10, "the error")
        message = screen.model.errors[0].message
        assert f"{events}:4" in message
        assert screen.model.finished is None
        await wait_for(pilot, lambda: "UNFINISHED" in banner_text(screen), 10, "the banner")
        assert screen.query_one("#banner").has_class("-fail")


async def test_connection_loss_and_retries_are_shown(home: Path, tmp_path: Path) -> None:
    run = copy_run("hello_command_run", tmp_path / "conn")
    lines = (run / "events.jsonl").read_bytes().splitlines(keepends=True)
    t = orjson.loads(lines[2])["t"]
    extra = [
        Connection(state="lost", message="gpu-box:22: connection reset", t=t),
        Connection(state="retrying", message="gpu-box:22: connection reset", attempt=2, t=t),
    ]
    # the record ends while the link is down: the screen must say so, not look finished
    (run / "events.jsonl").write_bytes(
        b"".join(lines[:3]) + b"".join(e.to_json() + b"\n" for e in extra)
    )
    app = create_app(out_dir=out_dir(home), replay_dir=run, speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_run_screen(pilot)
        await wait_for(pilot, lambda: "UNFINISHED" in banner_text(screen), 10, "the banner")
        await wait_for_text(
            pilot,
            "connection retrying (attempt 2): gpu-box:22: connection reset",
            "[run] * connection lost: gpu-box:22: connection reset",
        )


async def test_busy_lock_is_reported_on_the_presets_screen(home: Path) -> None:
    lock = home / "lock"
    holder = subprocess.Popen(["flock", str(lock), "sleep", "60"])
    try:
        wait_until_held(lock)
        app = create_app(out_dir=out_dir(home))
        async with app.run_test(size=SIZE) as pilot:
            await start_preset(pilot, "hello_command", run_overrides(home))
            screen = app.screen
            await wait_for(pilot, lambda: not screen.launching, 20, "the launch to end")
            await wait_for(pilot, lambda: "is held" in error_text(app), LOADED_S, "the error")
            error = error_text(app)
            assert f"lock {lock} is held" in error and "wait for that run to end" in error
    finally:
        holder.kill()
        holder.wait()


# -- history, help -----------------------------------------------------------------------------------


def test_scan_runs_lists_verdicts_and_unfinished_runs(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    copy_run("equivalence_fail", root)
    copy_run("readout_run", root)
    unfinished = copy_run("hello_command_run", root)
    events = unfinished / "events.jsonl"
    events.write_bytes(b"".join(events.read_bytes().splitlines(keepends=True)[:5]))
    entries = {e.run_id: e for e in scan_runs(root)}
    assert entries["20260528-202640-b3_67_equivalence-0001"].verdict == "FAIL_GUARDRAIL"
    assert entries["20260528-210000-b3_12_readout-0002"].verdict == "NO OK"
    hello = [e for e in entries.values() if e.preset == "hello_command"]
    assert len(hello) == 1 and hello[0].verdict is None


async def test_help_lists_every_binding(home: Path) -> None:
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        await wait_for_screen(pilot, HelpScreen)
        table = app.screen.query_one("#keys")
        rows = [[str(c) for c in table.get_row(k)] for k in table.rows]
        listed = {(r[0], r[2]) for r in rows}
        for where, cls in app.help_screens():
            for binding in cls.BINDINGS:
                description = binding.description or binding.action
                assert (where, description) in listed, (where, description)
        assert ("everywhere", "Quit") in listed
        await pilot.press("escape")
        await wait_for_screen(pilot, PresetsScreen)


async def test_ctrl_q_quits_with_zero(home: Path) -> None:
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+q")
    assert app.return_code == 0


# -- ssh: an unknown host key is asked about, then trusted -----------------------------------------


@pytest.mark.ssh
async def test_unknown_host_key_dialog_trusts_and_launches(ssh_home, sshd, home: Path) -> None:  # noqa: ANN001
    ssh_home.known_hosts.write_text("")
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        assert "testbox" in [value for _, value in app.screen._target_options()]
        overrides = [*run_overrides(home), "target.host=testbox"]
        await start_preset(pilot, "hello_command", overrides)
        await wait_for(pilot, lambda: isinstance(app.screen, HostKeyDialog), 20, "the dialog")
        await wait_for_text(pilot, sshd.fingerprint, sshd.key_type)  # drawn, not just pushed
        await pilot.press("t")
        screen = await wait_for_banner(pilot, timeout=40)
        assert banner_text(screen).startswith("PASS")
    assert sshd.known_hosts_line().split()[2] in ssh_home.known_hosts.read_text()


@pytest.mark.ssh
async def test_refusing_an_unknown_host_key_trusts_nothing(ssh_home, sshd, home: Path) -> None:  # noqa: ANN001
    ssh_home.known_hosts.write_text("")
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await start_preset(pilot, "hello_command", [*run_overrides(home), "target.host=testbox"])
        await wait_for(pilot, lambda: isinstance(app.screen, HostKeyDialog), 20, "the dialog")
        await wait_for_text(pilot, sshd.fingerprint)
        await pilot.press("r")
        await wait_for(pilot, lambda: "not trusted" in error_text(app), LOADED_S, "the refusal")
        error = error_text(app)
        assert "not trusted" in error and "tracedeck trust testbox" in error
    assert ssh_home.known_hosts.read_text() == ""


def test_errors_in_the_model_are_logged_plainly() -> None:
    model = RunModel()
    model.apply(Error(message="[bold]boom[/bold] at x", where="x"))
    assert model.log[-1][2] == "error: [bold]boom[/bold] at x"
    assert event_from_dict(Error(message="m").to_dict(), event_types()).message == "m"


@pytest.mark.slow
async def test_b3_67_smoke_from_presets_to_banner(home: Path) -> None:
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await start_preset(
            pilot, "b3_67_smoke", [*run_overrides(home), toy_override("b3_67_smoke")]
        )
        screen = await wait_for_banner(pilot, timeout=240)
        verdicts = screen.query_one("#verdicts", VerdictTable).contents()
        assert [(r[0], r[1], r[-1]) for r in verdicts] == [
            *(("1", str(seed), "PASS_EQUIV") for seed in range(3)),
            *(("0", str(seed), "EXPECTED_DRIFT") for seed in range(3)),
        ]
        assert [row[2:4] for row in cells(screen)] == [["exited 0", "0"]] * 12
        assert banner_text(screen) == "PASS_GUARDRAIL  (exit 0)"
        assert not screen.query_one("#first-fail").has_class("-shown")


LIVE_WRITER = """
import sys, time, pathlib
lines = pathlib.Path(sys.argv[1]).read_text().splitlines(keepends=True)
go = pathlib.Path(sys.argv[3])
with open(sys.argv[2], "a") as fh:
    fh.write(lines[0]); fh.write(lines[1]); fh.flush()
    deadline = time.time() + 60
    while not go.exists() and time.time() < deadline:  # held until the row is on screen
        time.sleep(0.02)
    fh.write(lines[2]); fh.flush()
"""


@pytest.mark.ssh
async def test_readout_rows_reach_the_traces_screen_over_ssh_while_writing(  # noqa: ANN001
    ssh_home, sshd, home: Path
) -> None:
    sample = DATA.parent.parent / "presets" / "samples" / "b3_12_mi300x.jsonl"
    writer = home / "writer.py"
    writer.write_text(LIVE_WRITER)
    go = home / "go"
    presets = home / "home" / ".config" / "tracedeck" / "presets"
    presets.mkdir(parents=True)
    (presets / "live_readout.toml").write_text(f"""
[preset]
name = "live_readout"
kind = "readout"
description = "the seed 003 lines, written slowly"
[target]
python = "{sys.executable}"
[engine]
command = "mkdir -p {{out}} && {{python}} {writer} {sample} {{out}}/trace.jsonl {go}"
[matrix]
n = [1]
[traces]
follow = ["trace.jsonl"]
""")
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await start_preset(
            pilot, "live_readout", [*run_overrides(home), f"target.host={sshd.spec}"]
        )
        run = await wait_for_run_screen(pilot)
        await wait_for(pilot, lambda: bool(run.panel.rows), 30, "the first readout row")
        await pilot.press("d")
        traces = await wait_for_screen(pilot, TracesScreen)

        def first_row() -> list[str] | None:
            rows = traces.query_one("#readout", ReadoutTable).contents()
            return rows[0] if rows else None

        await wait_for(pilot, lambda: first_row() is not None, 10, "the row on screen")
        row = first_row()
        assert row is not None and (row[1], row[3]) == ("79", "96965")
        assert not go.exists() and run.model.finished is None  # the engine is still writing
        go.touch()
        await pilot.press("escape")
        screen = await wait_for_banner(pilot, timeout=40)
        assert banner_text(screen).split("\n")[0] == "NO OK  (exit 1)"
        prompts = [r["prompt"] for r in screen.panel.rows.values()]
        assert prompts == ["prompt 1", "prompt 2"]
