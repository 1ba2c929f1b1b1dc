"""The live log: every cell's output lines, bounded, plain text, filterable by cell.

Long lines wrap at the log's width (continuations indented), so an engine's error message is
read whole; `w` on the run screen turns wrapping off, and the log then scrolls sideways.
"""

from __future__ import annotations

from collections import deque

from rich.cells import cell_len, chop_cells
from rich.style import Style
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.geometry import Region
from textual.strip import Strip
from textual.widgets import Input, Log, Select

from console.run_model import (
    LOG_LINES,
    RUN_CELL,
    SETUP_CELL,
    RunModel,
    params_label,
    varying_keys,
)
from console.widgets.steady import SteadyScroll
from console.widgets.text import clean, plain

MARKS = {"stdout": "|", "stderr": "!"}
CONTINUATION = "    "  # the start of a wrapped line's continuation rows


def wrap_line(line: str, width: int) -> list[str]:
    """One log line as rows of at most `width` cells: the first as is, the rest indented."""
    if "\t" in line:
        line = line.expandtabs()
    # An ASCII line is as wide as it is long (Log shows a control code as one cell): most
    # engine output is, and measuring every line was most of a busy log's cost.
    if width <= len(CONTINUATION) + 8 or (
        len(line) <= width if line.isascii() else cell_len(line) <= width
    ):
        return [line]
    first, *rest = chop_cells(line, width)
    rows = [first]
    remainder = "".join(rest)
    if remainder:
        rows += [CONTINUATION + row for row in chop_cells(remainder, width - len(CONTINUATION))]
    return rows


def format_line(cell: int, stream: str, line: str) -> str:
    if cell == RUN_CELL:
        tag = "[run]"
    elif cell == SETUP_CELL:
        tag = "[setup]"
    else:
        tag = f"[{cell + 1}]"
    return f"{tag} {MARKS.get(stream, '*')} {line}"


class LogLines(SteadyScroll, Log):
    """A Log that measures what it is given where it is written, and that grows without
    laying the screen out again (console.widgets.steady).

    Textual's Log measures every write in a new worker thread, whose measuring holds the
    interpreter while the screen draws and whose answer comes back as one more message; an
    ASCII line's width is its length (a control code shows as one cell), so the measure is
    cheap enough to take here."""

    _pass_style: Style | None = None

    def render_lines(self, crop: Region) -> list[Strip]:
        # Log works out the widget's style (a walk over every ancestor's styles) for each line
        # it draws: once per pass is enough (it was a third of drawing a scrolled log).
        self._pass_style = self.rich_style
        try:
            return super().render_lines(crop)
        finally:
            self._pass_style = None

    @property
    def rich_style(self) -> Style:
        style = self._pass_style
        return super().rich_style if style is None else style

    def _update_size(self, updates: int, lines: list[str]) -> None:  # type: ignore[override]
        if not lines:
            return
        widest = 0
        for line in lines:
            if line.isascii() and "\t" not in line:
                size = len(line)
            else:
                size = cell_len(self._process_line(line))
            if size > widest:
                widest = size
        self._update_maximum_width(updates, widest)


class RunLog(Vertical):
    """Log lines go to a Log widget, shown literally: markup stays text, control and format
    characters are replaced (text.clean) before they are written."""

    DEFAULT_CSS = """
    RunLog { height: 1fr; }
    RunLog > Select { width: 48; }
    RunLog > #log-search { display: none; height: 1; border: none; padding: 0 1; }
    RunLog.-searching > #log-search { display: block; }
    RunLog > Log { height: 1fr; overflow-x: hidden; }
    /* Unwrapped: a scrollbar that is always there keeps the last line visible. */
    RunLog.-nowrap > Log { overflow-x: scroll; }
    """

    def __init__(self, *, id: str | None = None, max_lines: int = LOG_LINES) -> None:
        super().__init__(id=id)
        self.max_lines = max_lines
        self.cell_filter: int | None = None
        self.wrap = True
        self._known_cells: tuple[int, ...] = ()
        self._model: RunModel | None = None
        self._end_y = 0
        self._width = 0  # the width the rows shown were wrapped at
        self._logical: deque[str] = deque(maxlen=max_lines)  # the lines, unwrapped
        self.needle = ""  # what / searches for
        self.match_row: int | None = None  # the row of the match shown

    def compose(self) -> ComposeResult:
        yield Select([], prompt="log: all cells", allow_blank=True, id="log-filter", compact=True)
        yield Input(placeholder="search the log (Enter; then n / N)", id="log-search")
        yield LogLines(max_lines=self.max_lines, id="log-lines")

    @property
    def log_widget(self) -> Log:
        return self.query_one("#log-lines", Log)

    def lines(self) -> list[str]:
        """The log's lines, whole (as written, before wrapping)."""
        return list(self._logical)

    def rows(self) -> list[str]:
        """What the log shows, row by row (wrapped lines are several rows)."""
        return [str(line) for line in self.log_widget.lines]

    def _wrap_width(self) -> int:
        log = self.log_widget
        return log.scrollable_content_region.width if self.wrap else 0

    def _write(self, lines: list[str]) -> None:
        lines = [clean(line) for line in lines]  # (Log removes \x00-\x14 only: not ESC)
        self._logical.extend(lines)
        width = self._width = self._wrap_width()
        rows = [row for line in lines for row in wrap_line(line, width)] if width else lines
        self.log_widget.write_lines(rows, scroll_end=False)

    def set_wrap(self, wrap: bool) -> None:
        self.wrap = wrap
        self.set_class(not wrap, "-nowrap")
        if self._model is not None:
            self.refill(self._model)

    def update_filter_options(self, model: RunModel) -> None:
        cells = tuple(sorted(model.cells))
        if cells == self._known_cells:
            return
        self._known_cells = cells
        select = self.query_one("#log-filter", Select)
        options = [(plain("tracedeck messages"), RUN_CELL)]
        varying = varying_keys(r.params for r in model.cells.values() if r.index >= 0)
        for index in cells:
            row = model.cells[index]
            params = {k: v for k, v in row.params.items() if k in varying} or row.params
            label = "setup" if index == SETUP_CELL else f"cell {index + 1}: {params_label(params)}"
            options.append((plain(label), index))
        current = select.value
        with self.prevent(Select.Changed):
            select.set_options(options)
            if current is not Select.NULL and current in {v for _, v in options}:
                select.value = current

    def show_new(self, model: RunModel, count: int) -> None:
        """Append the newest `count` lines of the model's log that pass the filter."""
        self._model = model
        if count <= 0:
            return
        entries = model.log_tail(min(count, self.max_lines))
        if self.cell_filter is not None:
            entries = [e for e in entries if e[0] == self.cell_filter]
        if entries:
            log = self.log_widget
            following = log.scroll_y >= self._end_y
            self._write([format_line(*e) for e in entries])
            if following:
                self.follow_end()

    def follow_end(self) -> None:
        """Scroll to the newest line once the layout settles (it moves when panels above grow)."""
        self.call_after_refresh(self._to_end)

    def on_resize(self, event: events.Resize) -> None:
        # Wrapped rows follow the width; panels above grow after the last write (a new verdict
        # row, the first-fail panel): an operator following the tail keeps the newest line.
        if self.wrap and self._model is not None and self._wrap_width() != self._width:
            self.refill(self._model)
        elif self.log_widget.scroll_y >= self._end_y:
            self.follow_end()

    def _to_end(self) -> None:
        log = self.log_widget
        log.scroll_end(animate=False, immediate=True, x_axis=False)
        self._end_y = log.max_scroll_y  # at or past this, the operator is following the tail

    def refill(self, model: RunModel) -> None:
        self._model = model
        log = self.log_widget
        log.clear()
        self._logical.clear()
        entries = model.log_tail(self.max_lines, self.cell_filter)
        self._write([format_line(*e) for e in entries])
        self.follow_end()

    # -- search ------------------------------------------------------------------------------

    def open_search(self) -> None:
        self.add_class("-searching")
        self.query_one("#log-search", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "log-search":
            return
        event.stop()
        self.needle = event.value
        self.match_row = None
        self.app.notify(self.search(forward=True), timeout=3, markup=False)
        self.log_widget.focus()

    def search(self, forward: bool = True) -> str:
        """Scroll to the next (or previous) row holding the search text; says which match of
        how many it is (or that there is none)."""
        needle = self.needle.lower()
        if not needle:
            return "no search: press / and type what to find"
        rows = self.rows()
        hits = [i for i, row in enumerate(rows) if needle in row.lower()]
        if not hits:
            self.match_row = None
            return f"{self.needle!r}: not in the log"
        here = self.match_row
        if here is None:
            row = hits[0] if forward else hits[-1]
        elif forward:
            row = next((i for i in hits if i > here), hits[0])
        else:
            row = next((i for i in reversed(hits) if i < here), hits[-1])
        self.match_row = row
        log = self.log_widget
        log.scroll_to(y=max(0, row - 2), animate=False, immediate=True)
        return f"{self.needle!r}: match {hits.index(row) + 1} of {len(hits)} (row {row + 1})"

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        self.cell_filter = None if event.value is Select.NULL else int(event.value)  # type: ignore[arg-type]
        if self._model is not None:
            self.refill(self._model)
