"""Screens that never mislead (issue 24): each case was reproduced on the old code first."""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from rich.text import Text
from runhelp import cli_env, tracedeck
from test_console import (
    DATA,
    LOADED_S,
    SIZE,
    banner_text,
    cells,
    home,  # noqa: F401  (a fixture)
    out_dir,
    run_overrides,
    screen_text,
    select_preset,
    start_preset,
    wait_for,
    wait_for_banner,
    wait_for_run_screen,
    wait_for_screen,
)
from textual.app import App, ComposeResult
from textual.pilot import WaitForScreenTimeout
from textual.widgets import TextArea

from analysis.dsa_live import HIST, LiveAgg, log2_bin
from console.app import create_app
from console.panels.dsa_trace import DsaDetail, DsaPanel, bin_edges, counters
from console.panels.readout import TracesScreen, gap_label
from console.run_model import RunModel
from console.screens.presets import PresetsScreen
from console.screens.run import RunScreen
from console.widgets.cells_table import CellsTable
from console.widgets.live_table import LiveTable
from console.widgets.run_header import RunHeader
from console.widgets.run_log import RunLog
from runners.events import CellFinished, CellStarted, RunStarted
from runners.kinds import load_preset
from runners.presets import PresetError

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((DATA / "presets").glob("*.toml"))


def header_text(screen: RunScreen) -> str:
    return str(screen.query_one("#run-header", RunHeader).content)


def footer_keys(screen: RunScreen) -> dict[str, str]:
    """What the key bar offers: key -> description (only the bindings it shows)."""
    return {key: b.binding.description for key, b in screen.active_bindings.items()}


# -- a finished run says it ended, and that its lock is free ---------------------------------------


async def test_finished_live_run_header_says_ended_and_the_lock_released(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await start_preset(pilot, "hello_command", run_overrides(home))
        screen = await wait_for_run_screen(pilot)
        await wait_for(pilot, lambda: "held by" in header_text(screen), 15, "the lock holder")
        assert "LIVE" in header_text(screen)
        assert footer_keys(screen)["escape"] == "Back (run goes on)"
        await wait_for_banner(pilot)
        await wait_for(pilot, lambda: "ENDED" in header_text(screen), 5, "the header to redraw")
        text = header_text(screen)
        assert "LIVE" not in text.split("\n")[0]
        lock_line = text.split("\n")[1]
        assert "released at the run's end (was held by" in lock_line, lock_line
        assert footer_keys(screen)["escape"] == "Back"


async def test_recorded_run_header_and_back_key_do_not_claim_a_live_run(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "hello_command_run", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot)
        lock_line = header_text(screen).split("\n")[1]
        assert "released at the run's end" in lock_line, lock_line
        assert footer_keys(screen)["escape"] == "Back"
        assert "run goes on" not in " ".join(footer_keys(screen).values())


# -- overrides belong to the preset they were typed for --------------------------------------------


async def test_overrides_do_not_carry_over_to_the_next_preset(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home), preset_paths=PRESETS)
    async with app.run_test(size=SIZE) as pilot:
        screen = await select_preset(pilot, "hello_command")
        await pilot.press("ctrl+o", *"matrix.n=[7]")
        detail = str(screen.query_one("#preset-detail").content)
        assert "matrix (with the overrides)" in detail and "n = [7]" in detail, detail
        await select_preset(pilot, "demo_equivalence")
        assert screen.query_one("#overrides", TextArea).text == ""
        detail = str(screen.query_one("#preset-detail").content)
        assert "[7]" not in detail and "with the overrides" not in detail
        await select_preset(pilot, "hello_command")
        assert screen.query_one("#overrides", TextArea).text == "matrix.n=[7]"
        assert isinstance(app.screen, PresetsScreen)


# -- a mistyped matrix key is an error naming the nearest key -------------------------------------


def test_a_new_matrix_key_nothing_uses_is_refused_naming_the_nearest() -> None:
    smoke = ROOT / "presets" / "b3_67_smoke.toml"
    for typo, nearest in (("seeds", "seed"), ("genn", "gen_len")):
        try:
            load_preset(smoke, [f"matrix.{typo}=[0]"])
        except PresetError as exc:
            assert f"matrix.{typo}:" in str(exc) and f"did you mean matrix.{nearest}?" in str(exc)
        else:
            raise AssertionError(f"matrix.{typo} was accepted")
    # A key the file has, or one an override puts to use in a template, stays fine.
    assert load_preset(smoke, ["matrix.seed=[0]"]).cell_count() == 4
    hello = DATA / "presets" / "hello_command.toml"
    preset = load_preset(hello, ["matrix.rc=[3]", "engine.command='exit {rc}'"])
    assert preset.cell_count() == 3


def test_plan_with_a_mistyped_matrix_key_exits_2(home: Path) -> None:  # noqa: F811
    done = tracedeck("plan", "b3_67_smoke", "--set", "matrix.seeds=[0]", env=cli_env(home))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "matrix.seeds" in done.stderr and "did you mean matrix.seed?" in done.stderr
    assert done.stdout == ""


# -- quitting during a live run says the run goes on and how to get back to it ----------------------


async def test_quit_during_a_live_run_says_it_goes_on_and_how_to_attach(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home))
    overrides = [*run_overrides(home), 'engine.command="sleep 30"']
    async with app.run_test(size=SIZE) as pilot:
        await start_preset(pilot, "hello_command", overrides)
        screen = await wait_for_run_screen(pilot)
        await wait_for(pilot, lambda: screen.model.header.local_dir != "", 15, "the run's start")
        local_dir = screen.model.header.local_dir
        # Pilot waits at most 30 s for the screen to settle after the key; on a loaded machine
        # the app may still be closing then. The key was sent: what follows checks what
        # quitting did.
        with contextlib.suppress(WaitForScreenTimeout):
            await pilot.press("ctrl+q")
    assert app.return_code == 0
    assert len(app.quit_notes) == 1
    note = app.quit_notes[0]
    assert "goes on" in note and f"tracedeck attach {local_dir}" in note, note
    assert f"tracedeck cancel {local_dir}" in note
    done = tracedeck("cancel", local_dir, env=cli_env(home))
    assert done.returncode == 0, done.stdout + done.stderr


async def test_quit_after_the_run_ended_says_nothing(home: Path, tmp_path: Path) -> None:  # noqa: F811
    run = tmp_path / "rec"
    shutil.copytree(DATA / "hello_command_run", run)
    app = create_app(out_dir=out_dir(home), replay_dir=run, speed=0)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_banner(pilot)
        await pilot.press("ctrl+q")
    assert app.quit_notes == []


# -- text is never cut without a sign; the time column has one format; cells say what they did ----


class _TableApp(App[None]):
    def compose(self) -> ComposeResult:
        yield CellsTable(id="cells")


async def test_a_cell_column_widens_for_a_longer_value_instead_of_cutting_it() -> None:
    model = RunModel()
    cells_ = [{"index": i, "params": {"n": i}} for i in range(3)]
    model.apply(
        RunStarted(
            run_id="r",
            preset="p",
            kind="command",
            target="local",
            local_dir="",
            remote_dir="",
            cells=cells_,
            profile="none",
            env={},
        )
    )
    app = _TableApp()
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(CellsTable)
        table.show(model, model.take_changes().cells)
        for cell, seconds in ((0, 9.7), (1, 13.6), (2, 123.4)):
            model.apply(CellStarted(cell=cell, params={"n": cell}, command="x"))
            model.apply(CellFinished(cell=cell, state="passed", exit_code=0, duration_s=seconds))
            table.show(model, model.take_changes().cells)
            await pilot.pause()
        shown = screen_text(app)
        for text in ("9.7s", "13.6s", "123.4s"):
            assert re.search(rf"(?<![\d.]){re.escape(text)}", shown), shown


async def test_cells_of_a_judged_kind_say_exited_0_not_passed(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "equivalence_fail", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot)
        states = {row[2] for row in cells(screen)}
        assert states == {"exited 0"}, states
        assert "cells 12 exited 0" in header_text(screen)
        assert "FAIL" in banner_text(screen)


class _Verdicts(LiveTable):
    COLUMNS = (("pair", "pair"), ("verdict", "verdict"))


class _VerdictApp(App[None]):
    def compose(self) -> ComposeResult:
        yield _Verdicts()


async def test_a_verdict_that_grows_longer_is_shown_whole() -> None:
    """A pair first shown PASS_EQUIV, later EXPECTED_DRIFT (as a live run goes): not EXPECTED_DR."""
    app = _VerdictApp()
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(_Verdicts)
        table.upsert("a", (Text("seed 0"), Text("PASS")))
        await pilot.pause()
        table.upsert("a", (Text("seed 0"), Text("EXPECTED_DRIFT")))
        await pilot.pause()
        assert "EXPECTED_DRIFT" in screen_text(app), screen_text(app)


async def test_a_long_preset_description_ends_in_an_ellipsis(home: Path, tmp_path: Path) -> None:  # noqa: F811
    text = (DATA / "presets" / "hello_command.toml").read_text()
    long = "a description long enough to reach past the table's edge " * 2 + "keeps top-32"
    preset = tmp_path / "long.toml"
    preset.write_text(
        text.replace('name = "hello_command"', 'name = "long"').replace(
            'description = "Generic command runner demo: prints a few lines per cell, judged by exit code"',
            f'description = "{long}"',
        )
    )
    app = create_app(out_dir=out_dir(home), preset_paths=[preset])
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        line = next(li for li in screen_text(app).splitlines() if "a description long" in li)
        assert "…" in line and "top-3" not in line, line


# -- the DSA panel: counts that add up, a rate that is one, axes scaled to the data ---------------


async def dsa_replayed(pilot) -> DsaPanel:  # noqa: ANN001
    screen = await wait_for_banner(pilot)
    panel = screen.panel
    assert isinstance(panel, DsaPanel)
    await pilot.pause(0.3)  # the charts redraw at most every CHARTS_EVERY_S
    return panel


async def test_dsa_counters_after_the_run_say_every_request_done(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "dsa_run", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        panel = await dsa_replayed(pilot)
        requests = panel.book.totals()["requests"]
        assert requests > 1
        text = str(panel.query_one("#dsa-counters").content)
        assert f"requests {requests}  done {requests}  " in text, text
        assert "rec/s" not in text  # nothing streams once the run ended


def test_a_new_shards_backlog_is_no_rate() -> None:
    panel = DsaPanel()
    panel._seen.extend([(100.0, 0), (100.001, 3192)])
    assert panel.rate() is None
    assert "rate —" in str(counters(panel.book, panel.rate()))
    panel._seen.append((102.0, 3292))
    assert panel.rate() == pytest.approx(3292 / 2.0)


async def test_dsa_histograms_scale_their_axis_to_the_data_and_say_so(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "dsa_run", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        panel = await dsa_replayed(pilot)
        values = LiveAgg.hist(panel.view.vector(), "unique_blocks").tolist()
        held = [i for i, v in enumerate(values) if v]
        chart = str(panel.query_one("#dsa-h-unique_blocks").content).splitlines()
        assert chart[1].startswith(f"tallest {int(max(values))}") and "log2 blocks" in chart[1]
        low, high = bin_edges("unique_blocks", held[0])[0], bin_edges("unique_blocks", held[-1])[1]
        axis = chart[-1].split()
        assert axis == [low, high], chart
        assert "8K+" not in "\n".join(chart)  # the top bin holds 4096 and more


def test_log2_bin_edges_match_the_bins_analysis_fills() -> None:
    for value in (0, 1, 2, 3, 64, 100, 4095, 4096, 10**6):
        index = int(log2_bin(np.array([value]), HIST["unique_blocks"])[0])
        low, high = bin_edges("unique_blocks", index)
        number = {"K": 1024, "M": 1 << 20}
        low_n = int(low[:-1]) * number[low[-1]] if low[-1] in number else int(low)
        assert low_n <= value, (value, low, high)
        if high.startswith("<"):
            top = high[1:]
            assert value < (int(top[:-1]) * number[top[-1]] if top[-1] in number else int(top))


async def test_dsa_detail_heat_map_follows_the_layer_and_request_filter(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "dsa_run", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        panel = await dsa_replayed(pilot)
        await pilot.press("d")
        detail = app.screen
        assert isinstance(detail, DsaDetail)
        live = panel.view.live()

        def heat() -> str:
            return str(detail.query_one("#dd-heat").content)

        assert heat().startswith(f"request {live.heat_request}: ")
        await pilot.press("l")
        layer = panel.view.filter[1]
        shown = heat()
        rows = [line for line in shown.splitlines() if line.startswith("L")]
        assert shown.startswith(f"request {live.heat_request}, layer {layer}:"), shown
        assert rows and all(line.startswith(f"L{layer:>3}") for line in rows), rows
        await pilot.press("a", "r")
        while panel.view.filter[1] == live.heat_request:
            await pilot.press("r")
        other = panel.view.filter[1]
        assert heat().startswith(f"request {other}: no heat map kept"), heat()


# -- the KV grid says what its marks mean; the gap sparkline says its scale ------------------------


async def test_kv_grid_has_a_legend_in_the_console(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "kv_invariance_run", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for_banner(pilot)
        legend = ("=  equal", "X  differs", "columns g=GQA group b=batch")
        # the grid's panel draws after the banner (an idle fresh-clone run read it too early)
        await wait_for(
            pilot,
            lambda: all(part in screen_text(app) for part in legend),
            LOADED_S,
            "the kv grid's legend",
        )
        await pilot.press("d")
        await wait_for(
            pilot,
            lambda: "m a s = mask ALiBi sinks on (- off)" in screen_text(app),
            LOADED_S,
            "the detail's legend",
        )


async def test_readout_gap_sparkline_says_its_scale(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "readout_run", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot)
        await pilot.press("d")
        traces = await wait_for_screen(pilot, TracesScreen)
        await wait_for(pilot, lambda: traces.selected is not None, LOADED_S, "a trace selected")
        gaps = [float(v) for v in screen.panel.rows[traces.selected]["gap_seq"]]
        label = str(traces.query_one("#spark-gap-label").content)
        assert f"bars span {min(gaps):.4g} (lowest) to {max(gaps):.4g} (highest)" in label, label
        assert "% apart" in label


def test_a_one_percent_change_reads_as_one_percent() -> None:
    assert gap_label([3.0, 2.97]).endswith("1% apart")


# -- focus you can see: the focused panel is marked, Tab moves between panels -----------------------


async def test_tab_moves_between_panels_and_the_focused_one_is_marked(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "hello_command_run", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot)
        cells_table = screen.query_one("#cells")
        log = screen.query_one("#log").query_one("Log")
        assert app.focused is cells_table
        assert cells_table.styles.outline_left[0] == "outer"
        assert log.styles.outline_left[0] == ""
        seen = []
        for _ in range(4):
            await pilot.press("tab")
            seen.append(app.focused)
            if app.focused is log:
                break
        assert log in seen, seen
        assert log.styles.outline_left[0] == "outer"
        assert cells_table.styles.outline_left[0] == ""
        await pilot.press("shift+tab")
        assert app.focused is not log


async def test_slash_searches_the_log_and_n_jumps_between_matches(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "hello_command_run", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot)
        log = screen.query_one("#log", RunLog)
        await pilot.press("slash")
        await pilot.pause()  # the search box takes the focus
        await pilot.press(*"line 2", "enter")
        rows = log.rows()
        hits = [i for i, row in enumerate(rows) if "line 2" in row]
        assert len(hits) == 3 and log.match_row == hits[0], rows
        assert "line 2" in rows[log.match_row]
        await pilot.press("n")
        assert log.match_row == hits[1]
        await pilot.press("n", "n")
        assert log.match_row == hits[0]  # past the last: from the top again
        await pilot.press("N")
        assert log.match_row == hits[2]
        assert log.search() == f"'line 2': match 1 of 3 (row {hits[0] + 1})"
