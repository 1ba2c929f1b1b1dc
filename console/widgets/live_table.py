"""A DataTable whose rows are rewritten in place as a run's model changes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Self

from rich.text import Text
from textual.cache import LRUCache
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey, RowKey

from console.widgets.steady import SteadyScroll

CELL_CACHE = 1024  # rendered cells kept; more than a screen shows
LINE_CACHE = 256  # rendered lines kept; more than a screen shows
RENDER_CACHE = 200  # rendered rows and lines kept
REPAINT_ROWS = 8  # more rows updated at once than this: the whole table is repainted


class LiveTable(SteadyScroll, DataTable):
    """Subclasses name their COLUMNS as (label, key); rows are keyed by the caller's key.

    A DataTable renders every visible cell again after any one changes (its caches are keyed
    by a counter every update bumps): a run's tables change a few times a second, and drawing
    them was most of a frame. Here a rendered cell is kept until its own value changes (or the
    table's shape, width or styles do), so a frame renders only the cells that changed; the
    header's cells are kept while their labels are unchanged. So is a rendered line, until a
    cell of its row changes (or the row moves, or the table's shape does): joining a line's
    cells was most of a frame once many rows were drawn again for one new row."""

    COLUMNS: ClassVar[tuple[tuple[str, str], ...]] = ()
    _row_refresh_only = False  # set while update_cell runs (DataTable refreshes in __init__)
    _repaint: set[Any] | None = None  # rows to repaint at the end of updating()

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self._cell_versions: dict[tuple[Any, Any], int] = {}
        self._kept_cells: dict[tuple[Any, ...], Any] = {}
        self._row_versions: dict[Any, int] = {}
        self._kept_lines: dict[tuple[Any, ...], Any] = {}
        # DataTable keeps 1,000 rows and lines and 10,000 cells per table, keyed by its update
        # count: a table updated a few times a second fills them with stale renders, tens of
        # thousands of objects every full garbage collection walks (a stalled frame). A screen
        # shows a few dozen rows.
        self._row_render_cache = LRUCache(RENDER_CACHE)
        self._row_renderable_cache = LRUCache(RENDER_CACHE)
        self._line_cache = LRUCache(RENDER_CACHE)
        self._cell_render_cache = LRUCache(CELL_CACHE)

    def _render_cell(
        self,
        row_index: int,
        column_index: int,
        base_style: Any,
        width: int,
        cursor: bool = False,
        hover: bool = False,
    ) -> Any:
        if column_index < 0:  # row labels: as DataTable does
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        column_key = self._column_locations.get_key(column_index)
        if row_index < 0:  # the header: kept while its label is what it was drawn from
            label = self.columns[column_key].label
            row_key: Any = (
                "header",
                label.plain,
                str(label.style),
                label.justify,
                self.header_height,
            )
            version = 0
        else:
            row_key = self._row_locations.get_key(row_index)
            version = self._cell_versions.get((row_key, column_key), 0)
        key = (
            row_key,
            column_key,
            version,
            row_index,
            column_index,
            base_style,
            width,
            cursor,
            hover,
            self.show_cursor,
            self._show_hover_cursor,
            self._pseudo_class_state,
            self.cell_padding,
        )
        lines = self._kept_cells.get(key)
        if lines is None:
            if len(self._kept_cells) >= CELL_CACHE:
                self._kept_cells.clear()
            lines = super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
            self._kept_cells[key] = lines
        return lines

    def _render_line(self, y: int, x1: int, x2: int, base_style: Any) -> Any:
        try:
            row_key, offset = self._get_offsets(y)
        except LookupError:
            return super()._render_line(y, x1, x2, base_style)
        columns = self.ordered_columns
        if row_key is self._header_row_key:
            version: Any = tuple((c.label.plain, str(c.label.style)) for c in columns)
        else:
            version = self._row_versions.get(row_key, 0)
        key = (
            row_key,
            offset,
            self._row_locations.get(row_key),
            version,
            x1,
            x2,
            self.size.width,
            base_style,
            self.cursor_coordinate,
            self.hover_coordinate,
            self.cursor_type,
            self.show_cursor,
            self._show_hover_cursor,
            self._pseudo_class_state,
            tuple(c.get_render_width(self) for c in columns),
            self.fixed_columns,
            self.show_row_labels and self._labelled_row_exists,
            self._row_label_column_width,
            self.cell_padding,
        )
        strip = self._kept_lines.get(key)
        if strip is None:
            if len(self._kept_lines) >= LINE_CACHE:
                self._kept_lines.clear()
            strip = super()._render_line(y, x1, x2, base_style)
            self._kept_lines[key] = strip
        return strip

    def _forget_cells(self) -> None:
        self._kept_cells.clear()
        self._cell_versions.clear()
        self._kept_lines.clear()
        self._row_versions.clear()

    def update_cell(
        self, row_key: Any, column_key: Any, value: Any, *, update_width: bool = False
    ) -> None:
        """DataTable's update_cell, repainting the cell's row only (not the whole table)."""
        row = RowKey(row_key) if isinstance(row_key, str) else row_key
        column = ColumnKey(column_key) if isinstance(column_key, str) else column_key
        self._cell_versions[(row, column)] = self._cell_versions.get((row, column), 0) + 1
        self._row_versions[row] = self._row_versions.get(row, 0) + 1
        self._row_refresh_only = True
        try:
            super().update_cell(row_key, column_key, value, update_width=update_width)
        finally:
            self._row_refresh_only = False
        if self._repaint is not None:
            self._repaint.add(row)  # repainted once when the row's update is done
        else:
            self.refresh_row(self._row_locations.get(row))

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Update cells, then repaint each row they are in once (or the table, for many)."""
        if self._repaint is not None:  # within an outer updating(): it repaints
            yield
            return
        self._repaint = set()
        try:
            yield
        finally:
            rows, self._repaint = self._repaint, None
            if len(rows) > REPAINT_ROWS:
                super().refresh()
            else:
                for row in rows:
                    self.refresh_row(self._row_locations.get(row))

    def refresh(self, *regions: Any, **kwargs: Any) -> Self:
        if self._row_refresh_only and not regions and not kwargs:
            return self  # update_cell's repaint of everything: its row is repainted instead
        return super().refresh(*regions, **kwargs)

    def notify_style_update(self) -> None:
        self._kept_cells.clear()
        self._kept_lines.clear()
        super().notify_style_update()

    def clear(self, columns: bool = False) -> Self:
        self._forget_cells()
        return super().clear(columns)

    def remove_row(self, row_key: Any) -> None:
        self._forget_cells()
        super().remove_row(row_key)

    def remove_column(self, column_key: Any) -> None:
        self._forget_cells()
        super().remove_column(column_key)

    def sort(self, *columns: Any, key: Any = None, reverse: bool = False) -> Self:
        self._forget_cells()
        return super().sort(*columns, key=key, reverse=reverse)

    def on_mount(self) -> None:
        for label, key in self.COLUMNS:
            self.add_column(label, key=key)

    def upsert(self, key: str, values: Sequence[Any]) -> None:
        """Rewrite an existing row cell by cell (no full redraw), or add it."""
        if key in self.rows:
            with self.updating():
                for (_, column), value in zip(self.COLUMNS, values, strict=True):
                    self.set_cell(key, column, value)
        else:
            self.add_row(*values, key=key)

    def set_cell(self, row: str, column: str, value: Any) -> None:
        """Update one cell; its column widens when the value would not fit (a column sized by
        its first values would otherwise cut '13.6s' to '13.6' or EXPECTED_DRIFT to
        EXPECTED_DR without a sign that anything is missing)."""
        if isinstance(value, Text):
            value.no_wrap, value.overflow = True, "ellipsis"
            width = value.cell_len
        else:
            width = len(str(value))
        current = self.columns.get(column)  # type: ignore[call-overload]
        wider = current is not None and current.auto_width and width > current.content_width
        self.update_cell(row, column, value, update_width=wider)

    def contents(self) -> list[list[str]]:
        """The table as plain strings, row by row (what an operator reads)."""
        return [[str(cell) for cell in self.get_row(key)] for key in self.rows]
