"""Issue 23: what the console's speed-ups must not change (and that they are there)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from rich.text import Text
from test_console import SIZE, wait_for
from textual.app import App, ComposeResult

from console.widgets.live_table import LiveTable
from console.widgets.run_log import LogLines, wrap_line
from runners.events import Error, OutputLines
from runners.kinds import event_types
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
    base = LiveTable.__mro__[1]._render_cell  # DataTable's

    def counting(self, row, column, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if row >= 0 and column >= 0:
            rendered.append((row, column))
        return base(self, row, column, *args, **kwargs)

    monkeypatch.setattr(LiveTable.__mro__[1], "_render_cell", counting)
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
