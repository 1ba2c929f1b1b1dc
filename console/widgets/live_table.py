"""A DataTable whose rows are rewritten in place as a run's model changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from rich.text import Text
from textual.widgets import DataTable


class LiveTable(DataTable):
    """Subclasses name their COLUMNS as (label, key); rows are keyed by the caller's key."""

    COLUMNS: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        for label, key in self.COLUMNS:
            self.add_column(label, key=key)

    def upsert(self, key: str, values: Sequence[Any]) -> None:
        """Rewrite an existing row cell by cell (no full redraw), or add it."""
        if key in self.rows:
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
