"""A DataTable whose rows are rewritten in place as a run's model changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

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
                self.update_cell(key, column, value)
        else:
            self.add_row(*values, key=key)

    def contents(self) -> list[list[str]]:
        """The table as plain strings, row by row (what an operator reads)."""
        return [[str(cell) for cell in self.get_row(key)] for key in self.rows]
