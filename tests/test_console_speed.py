"""Issue 23: what the console's speed-ups must not change (and that they are there)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import orjson
import pytest
from rich.text import Text
from test_console import SIZE, wait_for
from textual.app import App, ComposeResult
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import DataTable, Static
from textual.widgets._footer import FooterKey

import console.screens.run
from analysis.dsa_live import LiveAgg
from console.app import create_app
from console.panels.dsa_trace import CHART_PARTS, DsaPanel
from console.panels.equivalence import EquivalencePanel, VerdictTable
from console.screens.run import RunScreen
from console.widgets.dsa_charts import ColumnHistogram, LayerBars
from console.widgets.live_table import LiveTable
from console.widgets.run_log import LogLines, RunLog, wrap_line
from console.widgets.steady import SteadyFooter, SteadyStatic
from runners.events import (
    CellFinished,
    CellStarted,
    Error,
    OutputLines,
    RunFinished,
    RunStarted,
    TraceBatch,
)
from runners.kinds import event_types
from runners.kinds.equivalence import PairVerdict
from runners.record import iter_events, read_events


def _record(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_decoding_pauses_the_collector_and_stops_at_a_bad_line_after_the_good_ones(
    tmp_path: Path,
) -> None:
    good = [
        OutputLines(cell=0, stream="stdout", lines=[f"l{i}"], file="o", end_offset=i)
        for i in range(3)
    ]
    lines = [e.to_json() for e in good] + [b"", b"{not json", Error(message="m").to_json()]
    path = _record(tmp_path / "events.jsonl", lines)
    seen = []
    with pytest.raises(ValueError, match=r"events\.jsonl:5: not a tracedeck event"):
        for event in iter_events(path, event_types()):
            seen.append(event)
            assert gc.isenabled()  # paused while a chunk decodes, never while the caller runs
    assert [e.lines for e in seen] == [["l0"], ["l1"], ["l2"]]  # type: ignore[attr-defined]
    assert gc.isenabled()
    path = _record(tmp_path / "ok.jsonl", lines[:3])
    assert len(read_events(path, event_types()).events) == 3


def test_an_ascii_line_is_wrapped_by_its_length_and_a_wide_one_by_its_cells() -> None:
    assert wrap_line("x" * 40, 40) == ["x" * 40]
    assert wrap_line("x" * 41, 40) == ["x" * 40, "    x"]
    assert wrap_line("\tx", 40) == [" " * 8 + "x"]
    assert wrap_line("漢" * 20, 40) == ["漢" * 20]  # 40 cells
    assert wrap_line("漢" * 21, 40) == ["漢" * 20, "    漢"]


class _LogApp(App[None]):
    def compose(self) -> ComposeResult:
        yield LogLines(max_lines=100, id="log")


async def test_the_log_knows_its_width_as_soon_as_lines_are_written() -> None:
    app = _LogApp()
    async with app.run_test(size=SIZE) as pilot:
        log = app.query_one(LogLines)
        log.write_lines(["short", "y" * 70, "漢字" * 10, "a\tb"], scroll_end=False)
        # measured where it is written (Textual's Log measured in a thread, later)
        assert log.virtual_size.width == 70 and log.virtual_size.height == 4
        log.write_lines(["漢" * 50], scroll_end=False)
        assert log.virtual_size.width == 100
        await pilot.pause()


class _TableApp(App[None]):
    def compose(self) -> ComposeResult:
        table = LiveTable(id="t")
        yield table

    def on_mount(self) -> None:
        table = self.query_one(LiveTable)
        table.add_column("a", key="a")
        table.add_column("b", key="b")
        for i in range(10):
            table.add_row(Text(f"a{i}"), Text(f"b{i}"), key=str(i))


async def test_a_live_table_renders_again_only_the_cell_that_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = _TableApp()
    rendered: list[tuple[int, int]] = []
    base = DataTable._render_cell

    def counting(self, row, column, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if row >= 0 and column >= 0:
            rendered.append((row, column))
        return base(self, row, column, *args, **kwargs)

    monkeypatch.setattr(DataTable, "_render_cell", counting)
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(LiveTable)
        await wait_for(pilot, lambda: len(set(rendered)) >= 20, 10, "the table drawn")
        rendered.clear()
        table.set_cell("3", "b", Text("zz"))  # as wide as before: its column keeps its width
        await wait_for(pilot, lambda: (3, 1) in rendered, 10, "the changed cell drawn")
        await pilot.pause()
        assert set(rendered) == {(3, 1)}, rendered
        assert table.contents()[3] == ["a3", "zz"]
        assert "zz" in "".join(s.text for s in table.render_line(4))  # header + rows 0..2
        rendered.clear()
        table.set_cell("5", "b", Text("wider"))  # the column widens: all of it is drawn again
        await wait_for(pilot, lambda: {(r, 1) for r in range(10)} <= set(rendered), 10, "b wider")
        assert "wider" in "".join(s.text for s in table.render_line(6))
        rendered.clear()
        table.clear()
        table.add_row(Text("new"), Text("row"), key="3")
        await wait_for(pilot, lambda: (0, 1) in rendered, 10, "the new row drawn")
        assert table.contents() == [["new", "row"]]


class _GrowingApp(App[None]):
    """A log and a table of fixed sizes under a line of text, the way the run screen has them."""

    def compose(self) -> ComposeResult:
        yield LogLines(max_lines=1000, id="log")
        yield LiveTable(id="t")

    def on_mount(self) -> None:
        self.query_one(LogLines).styles.height = 10
        table = self.query_one(LiveTable)
        table.styles.height = 6
        table.add_column("a", key="a")


async def test_a_growing_log_or_table_lays_nothing_out_again_and_still_scrolls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = _GrowingApp()
    layouts: list[str] = []
    refresh = Widget.refresh

    def counting(self, *regions, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if kwargs.get("layout"):
            layouts.append(type(self).__name__)
        return refresh(self, *regions, **kwargs)

    async with app.run_test(size=SIZE) as pilot:
        log, table = app.query_one(LogLines), app.query_one(LiveTable)
        log.write_lines([f"line {i}" for i in range(30)], scroll_end=True)
        for i in range(10):
            table.add_row(Text(f"a{i}"), key=str(i))
        # overflowing: each shows its vertical scrollbar (that one layout is theirs to ask)
        await wait_for(
            pilot,
            lambda: log.show_vertical_scrollbar and table.show_vertical_scrollbar,
            10,
            "the scrollbars",
        )
        await pilot.pause()
        monkeypatch.setattr(Widget, "refresh", counting)
        log.write_lines([f"more {i}" for i in range(30)], scroll_end=True)
        for i in range(10, 20):
            table.add_row(Text(f"a{i}"), key=str(i))
        await wait_for(pilot, lambda: table.virtual_size.height == 21, 10, "the rows measured")
        await wait_for(pilot, lambda: log.scroll_y == log.max_scroll_y > 40, 10, "the log's end")
        await pilot.pause()
        # Textual lays the screen out again (and redraws every widget whose size moved) for
        # each growth of a scroll view's content; a fixed-size one only scrolls further
        assert layouts == [], layouts
        assert log.vertical_scrollbar.window_virtual_size == 60
        assert table.vertical_scrollbar.window_virtual_size == 21
        table.scroll_end(animate=False, immediate=True)
        await pilot.pause()
        assert table.scroll_y == table.max_scroll_y > 0


async def test_a_live_table_draws_its_header_again_only_when_a_label_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = _TableApp()
    headers: list[int] = []
    base = DataTable._render_cell

    def counting(self, row, column, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if row < 0:
            headers.append(column)
        return base(self, row, column, *args, **kwargs)

    monkeypatch.setattr(DataTable, "_render_cell", counting)
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(LiveTable)
        await wait_for(pilot, lambda: {0, 1} <= set(headers), 10, "the header drawn")
        await pilot.pause()
        headers.clear()
        table.add_row(Text("ax"), Text("bx"), key="10")  # as wide: the whole table is drawn again
        await wait_for(pilot, lambda: "ax" in str(table.render_lines(table.region)), 10, "row")
        await pilot.pause()
        assert headers == []
        table.columns[table.ordered_columns[1].key].label = Text("renamed")
        table.refresh()
        await wait_for(pilot, lambda: 1 in headers, 10, "the renamed header drawn")
        # drawn from the new label (its column keeps the width it had: "re")
        assert "".join(s.text for s in table.render_line(0)).split() == ["a", "re"]


class _PairsApp(App[None]):
    def compose(self) -> ComposeResult:
        yield EquivalencePanel(id="panel")
        yield Static("below", id="below")


def _pair(kv: int, seed: int) -> PairVerdict:
    return PairVerdict(
        seed=seed,
        kv_aligned=kv,
        verdict="PASS_EQUIV",
        metrics={"max_abs_diff": 0.0, "pair_count": 4},
        thresholds={},
        first_fail=None,
        metrics_path="m.json",
    )


async def test_the_verdict_table_takes_the_planned_pairs_height_at_its_first_row() -> None:
    app = _PairsApp()
    cells = [
        {"index": i, "params": {"kv_aligned": kv, "seed": seed, "mode": mode}, "command": "e"}
        for i, (kv, seed, mode) in enumerate(
            (kv, seed, mode) for kv in (0, 1) for seed in (0, 1) for mode in ("prefill", "decode")
        )
    ]
    started = RunStarted(
        run_id="r",
        preset="p",
        kind="equivalence",
        target="local",
        local_dir="/tmp/r",
        remote_dir="/tmp/r",
        cells=cells,
        profile="none",
        env={},
    )
    async with app.run_test(size=SIZE) as pilot:
        panel, below = app.query_one(EquivalencePanel), app.query_one("#below")
        panel.fold(started)
        panel.fold(_pair(0, 0))
        panel.show_changes()
        table = panel.query_one(VerdictTable)
        await wait_for(pilot, lambda: table.size.height == 5, 10, "4 rows and the header")
        await pilot.pause()
        where = below.region
        for kv, seed in ((0, 1), (1, 0), (1, 1)):  # the rest fill it: nothing below moves
            panel.fold(_pair(kv, seed))
            panel.show_changes()
            await pilot.pause()
            assert below.region == where
        await wait_for(pilot, lambda: len(table.rows) == 4, 10, "the four rows")
        assert table.size.height == 5
        panel.fold(_pair(2, 0))  # a pair the plan did not have still gets its row
        panel.show_changes()
        await wait_for(pilot, lambda: table.size.height == 6, 10, "a fifth row")


class _StaticApp(App[None]):
    def compose(self) -> ComposeResult:
        yield SteadyStatic("", id="s")


async def test_a_steady_static_lays_out_again_only_when_its_text_changes_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = _StaticApp()
    layouts: list[bool] = []
    update = SteadyStatic.update

    def counting(self, content="", *, layout=True):  # noqa: ANN001, ANN202
        layouts.append(layout)
        return update(self, content, layout=layout)

    monkeypatch.setattr(SteadyStatic, "update", counting)
    async with app.run_test(size=SIZE) as pilot:
        static = app.query_one(SteadyStatic)
        static.show_text(Text("records 1\nrate 5"))
        static.show_text(Text("records 22\nrate 50"))  # as many lines, as wide as the screen
        static.show_text(Text("records 22\nrate 50\nmore"))  # a third line: taller
        assert layouts == [True, False, True]
        await pilot.pause()
        assert static.size.height == 3
        static.show_text(Text("x" * 150 + "\nb\nc"))  # wraps: as tall as its wrapped rows
        static.show_text(Text("x" * 250 + "\nb\nc"))
        assert layouts[3:] == [True, True]
        await wait_for(pilot, lambda: static.size.height == 5, 10, "the wrapped rows")
        static.styles.width = "auto"
        static.show_text(Text("ab"))
        static.show_text(Text("abc"))  # as wide as its text: one more column
        assert layouts[5:] == [True, True]


def _dsa_events() -> list[Any]:
    path = Path(__file__).resolve().parent / "data" / "dsa_run" / "events.jsonl"
    return read_events(path, event_types()).events


async def test_the_dsa_panel_draws_its_charts_one_per_tick_while_records_stream_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    drawn: list[str] = []
    histogram, bars = ColumnHistogram.show, LayerBars.show

    def hist(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        drawn.append(self.id.removeprefix("dsa-h-"))
        return histogram(self, *args, **kwargs)

    def layers(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        drawn.append("layers")
        return bars(self, *args, **kwargs)

    monkeypatch.setattr(ColumnHistogram, "show", hist)
    monkeypatch.setattr(LayerBars, "show", layers)
    app = _PanelApp(DsaPanel(id="panel"))
    events = _dsa_events()
    traces = [e for e in events if isinstance(e, TraceBatch)]
    async with app.run_test(size=SIZE) as pilot:
        panel = app.query_one(DsaPanel)
        panel.fold(traces[0])
        panel.show_changes()
        assert drawn == list(CHART_PARTS)  # the first time all (sized together, one layout)
        drawn.clear()
        panel.fold(traces[1])
        panel.show_changes()
        assert drawn == [CHART_PARTS[0]]  # then one chart a tick: a tick's work stays small
        panel.fold(traces[2])  # new records: every chart is behind again
        for _ in range(len(CHART_PARTS)):
            panel.show_changes()
        assert drawn[1:] == list(CHART_PARTS)  # each drawn from the newest state, in turn
        drawn.clear()
        panel.show_changes()
        assert drawn == []  # nothing new: nothing drawn
        for event in traces[3:]:
            panel.fold(event)
        panel.fold(next(e for e in events if isinstance(e, RunFinished)))
        panel.show_changes()
        assert sorted(drawn) == sorted(CHART_PARTS)  # the run's end: all of them at once
        await pilot.pause()
        final = int(sum(LiveAgg.hist(panel.view.vector(), "touched")))
        assert f"n={final}" in str(panel.query_one("#dsa-h-touched", ColumnHistogram).render())


class _PanelApp(App[None]):
    def __init__(self, panel: Any) -> None:
        super().__init__()
        self.panel = panel

    def compose(self) -> ComposeResult:
        yield self.panel


class _FooterScreen(Screen[None]):
    BINDINGS = [("x", "go", "Go"), ("y", "stay", "Stay")]
    allowed = True

    def compose(self) -> ComposeResult:
        yield SteadyFooter()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return None if action == "go" and not self.allowed else True  # None: shown, disabled


class _FooterApp(App[None]):
    def on_mount(self) -> None:
        self.push_screen(_FooterScreen())


async def test_the_footer_rebuilds_its_keys_only_when_what_it_offers_changes() -> None:
    app = _FooterApp()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, _FooterScreen), 10, "the screen")
        screen = app.screen
        assert isinstance(screen, _FooterScreen)
        footer = screen.query_one(SteadyFooter)

        def keys() -> list[FooterKey]:
            return list(footer.query(FooterKey))

        await wait_for(pilot, lambda: {"Go", "Stay"} <= {k.description for k in keys()}, 10, "keys")
        shown = keys()
        for _ in range(3):  # Textual asks for a rebuild: the same keys are offered
            screen.refresh_bindings()
            await pilot.pause()
        assert keys() == shown  # the same widgets: nothing was rebuilt
        screen.allowed = False
        screen.refresh_bindings()
        await wait_for(pilot, lambda: keys() != shown, 10, "the keys rebuilt")
        go = next(k for k in keys() if k.description == "Go")
        assert go.has_class("-disabled")


async def test_a_live_table_joins_again_only_the_lines_of_rows_that_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = _TableApp()
    joined: list[str] = []
    base = DataTable._render_line_in_row

    def counting(self, row_key, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        joined.append(row_key.value)
        return base(self, row_key, *args, **kwargs)

    monkeypatch.setattr(DataTable, "_render_line_in_row", counting)
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(LiveTable)
        await wait_for(pilot, lambda: {str(i) for i in range(10)} <= set(joined), 10, "drawn")
        await pilot.pause()
        joined.clear()
        table.add_row(Text("ax"), Text("bx"), key="10")  # as wide: the whole table repaints
        await wait_for(pilot, lambda: "10" in joined, 10, "the new row drawn")
        await pilot.pause()
        assert set(joined) == {"10"}, joined
        joined.clear()
        table.set_cell("4", "a", Text("zz"))
        table.refresh()  # everything asked to repaint: only row 4's line is joined again
        await wait_for(pilot, lambda: "4" in joined, 10, "row 4 drawn")
        await pilot.pause()
        assert set(joined) == {"4"}, joined
        assert "zz" in "".join(s.text for s in table.render_line(5))  # the header, rows 0..3
        joined.clear()
        table.set_cell("6", "b", Text("much wider"))  # the column widens: every line again
        await wait_for(pilot, lambda: {str(i) for i in range(11)} <= set(joined), 10, "all")
        assert "much wider" in "".join(s.text for s in table.render_line(7))
        assert "b0" in "".join(s.text for s in table.render_line(1))


def _long_record(folder: Path, lines: int) -> None:
    """A recorded one-cell run whose cell writes `lines` output lines (one an event)."""
    t = 1_780_000_000.0
    events: list[Any] = [
        RunStarted(
            run_id="r",
            preset="p",
            kind="equivalence",
            target="local",
            local_dir=str(folder),
            remote_dir="/tmp/r",
            cells=[{"index": 0, "params": {}, "command": "e"}],
            profile="none",
            env={},
            t=t,
        ),
        CellStarted(cell=0, params={}, command="e", t=t),
    ]
    for n in range(lines):
        events.append(
            OutputLines(cell=0, stream="stdout", lines=[f"line {n}"], file="o", end_offset=n, t=t)
        )
    events.append(CellFinished(cell=0, state="passed", exit_code=0, duration_s=1.0, t=t))
    events.append(RunFinished(verdict="PASS_EQUIV", exit_code=0, summary={}, t=t + 1))
    record = {
        "run_id": "r",
        "preset": "p",
        "kind": "equivalence",
        "source": "test",
        "overrides": [],
        "preset_data": {},
        "target": "local",
        "remote_dir": "/tmp/r",
        "lock": "/tmp/r.lock",
        "local_dir": str(folder),
        "started_at": "2026-01-01",
        "user": "u",
        "console_host": "h",
        "date": "2026-01-01",
        "extra": {},
    }
    (folder / "run.json").write_bytes(orjson.dumps(record))
    _record(folder / "events.jsonl", [e.to_json() for e in events])


async def test_a_fast_replay_writes_its_log_when_the_backlog_allows_and_ends_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _long_record(tmp_path, 30_000)
    monkeypatch.setattr(console.screens.run, "TABLES_EVERY_S", 1e9)  # never during the backlog
    during: list[bool] = []
    show_new = RunLog.show_new

    def counting(self, model, count):  # noqa: ANN001, ANN202
        screen = self.screen
        during.append(bool(screen.buffer) or screen._fast_feed_running())
        return show_new(self, model, count)

    monkeypatch.setattr(RunLog, "show_new", counting)
    app = create_app(out_dir=tmp_path / "out", replay_dir=tmp_path, speed=0)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, RunScreen), 10, "the run screen")
        screen = app.screen
        assert isinstance(screen, RunScreen)
        await wait_for(
            pilot,
            lambda: screen.model.finished is not None and not screen.buffer,
            10,
            "the replay's end",
        )
        await pilot.pause()
        log = screen.query_one("#log", RunLog)
        await wait_for(pilot, lambda: log.lines()[-1:] == ["[1] | line 29999"], 10, "the end")
        # thousands of lines a tick were formatted and pushed out of the scrollback by the
        # next tick's: while the backlog drains the log waits (here: to the end)
        assert during and not any(during[:-1]), during
        assert len(log.lines()) == log.max_lines
        assert log.lines()[0] == f"[1] | line {30_000 - log.max_lines}"


def test_a_replay_decodes_a_bounded_number_of_bytes_per_step() -> None:
    """A DSA run's TraceBatch lines carry digests of ~12 KB: 1,000 of them at once held the
    screen's loop for 58 ms, so a step stops at CHUNK_BYTES as well as at CHUNK lines."""
    from console.screens.sources import CHUNK, CHUNK_BYTES, _chunks

    big = [b"x" * 12_000] * 2_500
    steps = list(_chunks(big))
    assert [s for s, _ in steps] == [0, *[e for _, e in steps[:-1]]] and steps[-1][1] == len(big)
    assert all(sum(map(len, big[s:e])) < CHUNK_BYTES + 12_000 for s, e in steps)
    assert len(steps) > len(big) // CHUNK + 1
    small = [b"{}"] * 2_500
    assert list(_chunks(small)) == [(0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, 2_500)]
    assert list(_chunks([])) == []
