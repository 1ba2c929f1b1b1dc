"""Fill a DataTable so that its one long column (a reason, a lock holder) takes the width the
other columns leave, cut with an ellipsis, instead of running off the right edge where an
operator sees only its first letters (or none) unless they scroll sideways."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import DataTable

MIN_FILL = 12  # narrower than this, the long column keeps this width and the table scrolls


def fill_width(
    table: DataTable,  # type: ignore[type-arg]
    columns: Sequence[tuple[str, str]],
    rows: Sequence[Sequence[Text]],
    fill_key: str,
    minimum: int = MIN_FILL,
) -> int | None:
    """The width for column `fill_key` (None: as wide as its widest cell, which fits)."""
    pad = 2 * table.cell_padding
    widths = {
        key: max([Text(label).cell_len, *(row[i].cell_len for row in rows)])
        for i, (label, key) in enumerate(columns)
    }
    others = sum(width + pad for key, width in widths.items() if key != fill_key)
    room = table.size.width - table.styles.scrollbar_size_vertical - others - pad
    if widths[fill_key] <= room:
        return None
    return max(room, minimum)


def refill(
    table: DataTable,  # type: ignore[type-arg]
    columns: Sequence[tuple[str, str]],
    rows: Sequence[tuple[str, Sequence[Text]]],
    fill_key: str,
    minimum: int = MIN_FILL,
) -> None:
    """Clear `table` and add `columns` (label, key) and `rows` (row key, cells), the column
    `fill_key` as wide as the table leaves it."""
    width = fill_width(table, columns, [cells for _, cells in rows], fill_key, minimum)
    table.clear(columns=True)
    for label, key in columns:
        table.add_column(label, key=key, width=width if key == fill_key else None)
    for key, cells in rows:
        table.add_row(*cells, key=key)
