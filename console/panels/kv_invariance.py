"""The 03C panel: the KV-invariance grid filling in as cells are judged, and the selected cell.

Rows are D x KV (prefixed with the llama.cpp backend for that source), columns GQA x B x
features ('mas': mask, ALiBi, sinks; '-' for one off). A cell is green when its flows are
bitwise equal, red when they differ, yellow for a precondition abort, magenta when it could not be
judged, cyan while it runs. Below the grid, the selected cell in words (the first failure until
the operator moves the cursor); `d` opens the grid on a screen of its own.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from analysis.kv_invariance import (
    BITWISE_EQUAL,
    DIFFERS,
    PRECONDITION,
    SYMBOL,
    UNJUDGED,
    CellResult,
    Grid,
    col_key,
    col_label,
    describe,
    mark,
    point_label,
    point_of,
    row_key,
    row_label,
)
from analysis.kv_invariance_llamacpp import LlamaCppBook
from console.panel import KindPanel
from console.widgets.text import clean
from runners.events import CellFinished, CellStarted, Event, RunFinished, RunStarted, TraceBatch
from runners.kinds.kv_invariance import KvCellVerdict

RUNNING = "RUNNING"
Key = tuple[tuple[str, int, int], tuple[int, int, int, int, int]]
STYLES = {
    BITWISE_EQUAL: "bold black on green",
    DIFFERS: "bold white on red",
    PRECONDITION: "bold black on yellow",
    UNJUDGED: "bold white on magenta",
    RUNNING: "bold black on cyan",
}
MARKS = {**SYMBOL, RUNNING: "…"}
FAIL_ORDER = (DIFFERS, PRECONDITION, UNJUDGED)


def key_of(point: dict[str, Any], source: str = "") -> Key:
    return (row_key(point, source), col_key(point))


def col_name(col: tuple[int, int, int, int, int]) -> str:
    top, features = col_label(col)
    return f"{top} {features}"


class GridView:
    """UI-free: every grid cell's verdict (or live state), and what changed since the last draw."""

    def __init__(self) -> None:
        self.grid = Grid()
        self.verdicts: dict[Key, CellResult] = {}
        self.live: dict[Key, str] = {}  # RUNNING, or a llama.cpp cell's state before its verdict
        self.cells: dict[int, Key] = {}  # tracedeck cell -> its grid point (reference source)
        self.book = LlamaCppBook()
        self.changed: dict[Key, None] = {}
        self.reshaped = False
        self.finished: RunFinished | None = None

    # -- folding -------------------------------------------------------------------------------

    def take(self, event: Event) -> bool:
        if isinstance(event, RunStarted):
            for cell in event.cells:
                try:
                    point = point_of(cell.get("params") or {})
                except (KeyError, TypeError, ValueError):
                    continue
                key = self._place(point)
                self.cells[int(cell["index"])] = key
            return bool(self.cells)
        if isinstance(event, CellStarted) and event.cell in self.cells:
            return self._set_live(self.cells[event.cell], RUNNING)
        if isinstance(event, CellFinished) and event.cell in self.cells:
            return self._set_live(self.cells[event.cell], None)
        if isinstance(event, KvCellVerdict):
            result = event.result()
            key = self._place(result.point, result.source)
            self.verdicts[key] = result
            self.live.pop(key, None)
            self.changed[key] = None
            return True
        if isinstance(event, TraceBatch) and event.digest and "llamacpp" in event.digest:
            for fact in event.digest["llamacpp"]:
                self.book.apply(fact)
            self._llamacpp_live()
            return True
        if isinstance(event, RunFinished):
            self.finished = event
            return True
        return False

    def _place(self, point: dict[str, Any], source: str = "") -> Key:
        rows, cols = len(self.grid.rows), len(self.grid.cols)
        key = self.grid.place(point, source)
        if (len(self.grid.rows), len(self.grid.cols)) != (rows, cols):
            self.reshaped = True
        self.changed[key] = None
        return key

    def _set_live(self, key: Key, state: str | None) -> bool:
        if key in self.verdicts:
            return False
        if state is None:
            self.live.pop(key, None)
        else:
            self.live[key] = state
        self.changed[key] = None
        return True

    def _llamacpp_live(self) -> None:
        """Rebuild the llama.cpp rows from the book: a backend is named only when it ends."""
        seen: set[Key] = set()
        for source, point, state in self.book.live():
            key = self._place(point, source)
            seen.add(key)
            if key not in self.verdicts:
                if state is None:
                    self.live.pop(key, None)
                else:
                    self.live[key] = state
        stale = [
            k
            for k in self.grid.cells
            if k[0][0] and k not in seen and k not in self.verdicts and k not in self.cells.values()
        ]
        for key in stale:
            del self.grid.cells[key]
            self.live.pop(key, None)
        if stale:
            used_rows = {k[0] for k in self.grid.cells}
            self.grid.rows = [r for r in self.grid.rows if r in used_rows]
            self.reshaped = True

    # -- reading -------------------------------------------------------------------------------

    def state(self, key: Key) -> str | None:
        if key in self.verdicts:
            return self.verdicts[key].verdict
        return self.live.get(key)

    def first_failure(self) -> Key | None:
        for word in FAIL_ORDER:
            for key, result in self.verdicts.items():
                if result.verdict == word:
                    return key
        return None

    def counts(self) -> dict[str, int]:
        out = {w: 0 for w in (BITWISE_EQUAL, DIFFERS, PRECONDITION, UNJUDGED)}
        for result in self.verdicts.values():
            out[result.verdict] = out.get(result.verdict, 0) + 1
        return out


def render_cell(view: GridView, key: Key) -> Text:
    state = view.state(key)
    if state is None:
        return Text("·", style="dim", justify="center")
    result = view.verdicts.get(key)
    if result is not None and mark(result) == "-":
        return Text(" - ", style="dim", justify="center")
    return Text(f" {MARKS.get(state, '?')} ", style=STYLES.get(state, "bold"), justify="center")


def render_detail(view: GridView, key: Key | None) -> Text:
    """The selected cell in words; every value from the engine is shown literally."""
    if key is None:
        return Text("no cell selected", style="dim")
    result = view.verdicts.get(key)
    row, col = key
    if result is None:
        point = {"d": row[1], "kv": row[2], "gqa": col[0], "b": col[1]}
        point.update(zip(("mask", "alibi", "sinks"), col[2:], strict=True))
        state = view.live.get(key)
        words = "running" if state == RUNNING else (state or "not judged yet")
        return Text.assemble(clean(point_label(point, row[0])), ("  " + words, "dim"))
    title = Text.assemble(
        clean(point_label(result.point, result.source)),
        "  ",
        (f" {result.verdict} ", STYLES.get(result.verdict, "bold")),
    )
    d = result.detail
    if result.verdict == PRECONDITION:
        body = [
            Text.assemble(("rule ", "dim"), clean(d.get("rule", "?")), ": ", clean(result.reason)),
            Text.assemble(("at   ", "dim"), clean(d.get("at", ""))),
            Text.assemble(("fix  ", "bold"), clean(d.get("fix", ""))),
        ]
    elif result.verdict == UNJUDGED:
        body = [Text.assemble((f"({result.klass}) ", "dim"), clean(result.reason))]
    else:
        body = [Text(clean(line.strip())) for line in describe(result)[1:]]
    if result.where:
        body.append(Text.assemble(("from ", "dim"), clean(result.where)))
    return Text("\n").join([title, *body])


class GridTable(DataTable):
    """The grid: one row per (source, D, KV), one column per (GQA, B, features)."""

    DEFAULT_CSS = """
    GridTable { height: auto; max-height: 16; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(
            id=id, cursor_type="cell", zebra_stripes=False, header_height=2, cell_padding=0
        )
        self.shape: tuple[tuple[Any, ...], tuple[Any, ...]] = ((), ())
        self.keys: dict[tuple[str, str], Key] = {}

    def show(self, view: GridView, changed: list[Key]) -> None:
        shape = (tuple(sorted(view.grid.rows)), tuple(sorted(view.grid.cols)))
        if shape != self.shape:
            self._rebuild(view, shape)
            return
        for key in changed:
            if key in view.grid.cells:
                self.update_cell(row_label(key[0]), col_name(key[1]), render_cell(view, key))

    def _rebuild(self, view: GridView, shape: tuple[tuple[Any, ...], tuple[Any, ...]]) -> None:
        cursor = self.cursor_coordinate
        self.clear(columns=True)
        self.shape = shape
        self.keys = {}
        for col in shape[1]:
            top, features = col_label(col)
            label = Text(f"{top:^6}\n{features:^6}")
            self.add_column(label, width=6, key=col_name(col))
        for row in shape[0]:
            cells = []
            for col in shape[1]:
                key = (row, col)
                self.keys[(row_label(row), col_name(col))] = key
                cells.append(render_cell(view, key) if key in view.grid.cells else Text(""))
            label = Text(f" {row_label(row)} ", style="bold")
            self.add_row(*cells, key=row_label(row), label=label)
        if self.row_count and self.columns:
            self.cursor_coordinate = self.validate_cursor_coordinate(cursor)

    def key_at(self, row: str | None, col: str | None) -> Key | None:
        if row is None or col is None:
            return None
        return self.keys.get((row, col))


class CellDetail(Static):
    """The selected cell (or the first failure) in words."""

    DEFAULT_CSS = """
    CellDetail {
        border: round $primary;
        border-title-color: $primary;
        padding: 0 1;
        height: auto;
        max-height: 8;
        display: none;
    }
    CellDetail.-shown { display: block; }
    CellDetail.-fail { border: round $error; border-title-color: $error; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)
        self.border_title = "cell"

    def show(self, view: GridView, key: Key | None, chosen: bool) -> None:
        self.set_class(key is not None, "-shown")
        result = view.verdicts.get(key) if key is not None else None
        failing = result is not None and result.verdict in FAIL_ORDER
        self.set_class(failing, "-fail")
        self.border_title = "first fail" if failing and not chosen else "cell"
        if key is not None:
            self.update(render_detail(view, key))


class GridBox(Vertical):
    """The grid and the selected cell under it; the panel and the detail screen both use one."""

    DEFAULT_CSS = """
    GridBox { height: auto; }
    """

    def __init__(self, view: GridView, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view = view
        self.chosen: Key | None = None  # what the operator moved the cursor to

    def compose(self) -> ComposeResult:
        yield GridTable(id="kv-grid")
        yield CellDetail(id="kv-cell")

    def on_mount(self) -> None:
        self.refresh_from(list(self.view.grid.cells))

    def refresh_from(self, changed: list[Key]) -> None:
        self.query_one(GridTable).show(self.view, changed)
        self._detail()

    def _detail(self) -> None:
        key = self.chosen if self.chosen is not None else self.view.first_failure()
        self.query_one(CellDetail).show(self.view, key, self.chosen is not None)

    def on_data_table_cell_highlighted(self, event: DataTable.CellHighlighted) -> None:
        table = self.query_one(GridTable)
        if event.data_table is not table or not table.has_focus:
            return
        key = table.key_at(event.cell_key.row_key.value, event.cell_key.column_key.value)
        if key is not None:
            self.chosen = key
            self._detail()


class KvGridScreen(Screen[None]):
    """The grid on a screen of its own, with room for every row and the selected cell."""

    DEFAULT_CSS = """
    KvGridScreen > #kv-title { height: 1; padding: 0 1; background: $panel; }
    KvGridScreen > #kv-legend { height: 2; padding: 0 1; }
    KvGridScreen GridTable { max-height: 30; }
    KvGridScreen CellDetail { max-height: 14; }
    """

    BINDINGS = [Binding("escape", "close", "Back to the run")]

    def __init__(self, panel: KvInvariancePanel) -> None:
        super().__init__()
        self.panel = panel

    def compose(self) -> ComposeResult:
        yield Static("", id="kv-title", markup=False)
        yield Static(legend_text(), id="kv-legend", markup=False)
        yield GridBox(self.panel.view, id="kv-screen-box")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(GridTable).focus()
        self.show_title()

    def show_changes(self, changed: list[Key]) -> None:
        self.query_one(GridBox).refresh_from(changed)
        self.show_title()

    def show_title(self) -> None:
        self.query_one("#kv-title", Static).update(title_text(self.panel.view))

    def action_close(self) -> None:
        self.panel.detail_screen = None
        self.dismiss(None)


def legend_text() -> Text:
    """What the marks and the column headers mean (the headless grid says it too)."""
    text = Text()
    for word, what in (
        (BITWISE_EQUAL, "equal"),
        (DIFFERS, "differs"),
        (PRECONDITION, "precondition"),
        (UNJUDGED, "unjudged"),
        (RUNNING, "running"),
    ):
        text.append(f" {MARKS[word]} ", style=STYLES[word])
        text.append(f" {what}  ", style="dim")
    text.append("· not judged yet\n", style="dim")
    text.append(
        "rows D=head dim KV=cache length; columns g=GQA group b=batch, m a s = mask ALiBi "
        "sinks on (- off)",
        style="dim",
    )
    text.no_wrap = True
    text.overflow = "ellipsis"
    return text


def title_text(view: GridView) -> Text:
    counts = view.counts()
    total = len(view.grid.cells)
    text = Text.assemble(
        ("KV-cache invariance  ", "bold"),
        (f"{sum(counts.values())}/{total} judged", ""),
    )
    for word in (BITWISE_EQUAL, DIFFERS, PRECONDITION, UNJUDGED):
        if counts.get(word):
            text.append("  ")
            text.append(f" {counts[word]} {word} ", style=STYLES[word])
    running = view.book.running()
    if running and view.finished is None:
        text.append(f"  {running}", style="dim")
    return text


class KvInvariancePanel(KindPanel):
    """Hidden until the grid has a cell; then the grid and the selected (or first failing) cell."""

    DEFAULT_CSS = """
    KvInvariancePanel { height: auto; max-height: 24; display: none; }
    KvInvariancePanel.-grid { display: block; }
    KvInvariancePanel > #kv-panel-title { height: 1; padding: 0 1; }
    KvInvariancePanel > #kv-panel-legend { height: 2; padding: 0 1; }
    """

    kind = "kv_invariance"

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view = GridView()
        self.detail_screen: KvGridScreen | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="kv-panel-title", markup=False)
        yield Static(legend_text(), id="kv-panel-legend", markup=False)
        yield GridBox(self.view, id="kv-panel-box")

    def take(self, event: Event) -> bool:
        return self.view.take(event)

    def redraw(self) -> None:
        view = self.view
        changed, view.changed = list(view.changed), {}
        view.reshaped = False
        if view.grid.cells:
            self.add_class("-grid")
        self.query_one("#kv-panel-title", Static).update(title_text(view))
        self.query_one(GridBox).refresh_from(changed)
        if self.detail_screen is not None and self.detail_screen.is_mounted:
            self.detail_screen.show_changes(changed)

    def status(self) -> str:
        counts = self.view.counts()
        if not self.view.grid.cells:
            return ""
        bad = counts[DIFFERS] + counts[PRECONDITION] + counts[UNJUDGED]
        return (
            f"kv grid: {sum(counts.values())}/{len(self.view.grid.cells)} judged, "
            f"{bad} not equal (d: grid)"
        )

    def detail(self) -> Screen[None]:
        self.detail_screen = KvGridScreen(self)
        return self.detail_screen


KvInvariancePanel.detail_class = KvGridScreen
PANEL = KvInvariancePanel
