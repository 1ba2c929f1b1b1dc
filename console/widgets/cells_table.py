"""The run's cells: parameters, state, exit code and duration, one row per cell."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rich.text import Text

from console.run_model import SETUP_CELL, CellRow, RunModel, params_label, varying_keys
from console.widgets.live_table import LiveTable
from console.widgets.text import STATE_STYLES, clean, duration, plain
from runners.cells import CellState
from runners.kinds import all_kinds

COLUMNS = (("#", "n"), ("params", "params"), ("state", "state"), ("exit", "exit"), ("time", "time"))
# Shown once a cell has one: the fleet host (or Slurm node) that runs it, the scheduler's state.
HOST_COLUMN = ("host", "host")
SCHED_COLUMN = ("slurm", "sched")
SCHED_STYLES = {
    "PENDING": "yellow",
    "RUNNING": "cyan",
    "COMPLETED": "green",
    "COMPLETING": "green",
}


class CellsTable(LiveTable):
    COLUMNS = COLUMNS

    """Rows keyed by cell index; only the cells a batch touched are rewritten."""

    DEFAULT_CSS = """
    CellsTable { height: 1fr; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._cell_count = 0
        self._varying: set[str] = set()
        self.shown: list[tuple[str, str]] = list(COLUMNS)
        self._exit_is_verdict = True

    def upsert(self, key: str, values: Sequence[Any]) -> None:
        if key in self.rows:
            with self.updating():
                for (_, column), value in zip(self.shown, values, strict=True):
                    # the host and scheduler words change length as the cell goes on
                    if column in (HOST_COLUMN[1], SCHED_COLUMN[1]):
                        self.update_cell(key, column, value, update_width=True)
                    else:
                        self.set_cell(key, column, value)
        else:
            self.add_row(*values, key=key)

    def _columns_for(self, model: RunModel) -> None:
        """Add the host and scheduler columns once a cell has a value for them."""
        rows = model.cells.values()
        sched = any(r.sched for r in rows)
        for column, wanted in (
            (HOST_COLUMN, sched or any(r.host for r in rows)),  # Slurm: the node
            (SCHED_COLUMN, sched),
        ):
            if wanted and column not in self.shown:
                self.add_column(column[0], key=column[1], default=Text(""))
                self.shown.append(column)

    def state_word(self, row: CellRow) -> str:
        """The cell's state as what it is: where a cell's exit code is not the kind's verdict
        (the pairs or traces are judged), a cell that exited 0 "exited 0", never "passed"
        beside a failed verdict."""
        if row.state == CellState.PASSED and not self._exit_is_verdict:
            return "exited 0"
        return row.state

    def cells(self, row: CellRow) -> tuple[Text, ...]:
        label = "setup" if row.index == SETUP_CELL else str(row.index + 1)
        if row.index == SETUP_CELL:
            params = row.command
        else:
            shown = {k: v for k, v in row.params.items() if k in self._varying} or row.params
            params = params_label(shown)
        code = "" if row.exit_code is None else str(row.exit_code)
        code_style = "" if row.exit_code in (None, 0) else "bold red"
        values = [
            Text(label, justify="right"),
            plain(params),
            Text(self.state_word(row), style=STATE_STYLES.get(row.state, "")),
            Text(code, style=code_style, justify="right"),
            Text(duration(row.duration_s), justify="right"),
        ]
        if HOST_COLUMN in self.shown:
            values.append(plain(row.host))
        if SCHED_COLUMN in self.shown:
            word = row.sched.split(" ", 1)[0]
            values.append(Text(clean(row.sched), style=SCHED_STYLES.get(word, "bold red")))
        return tuple(values)

    def show(self, model: RunModel, changed: Iterable[int]) -> None:
        changed = set(changed)
        kind = all_kinds().get(model.header.kind)
        exit_is_verdict = kind is None or kind.cell_exit_is_verdict
        if exit_is_verdict != self._exit_is_verdict:
            self._exit_is_verdict = exit_is_verdict
            changed |= {index for index in model.cells if str(index) in self.rows}
        before = len(self.shown)
        self._columns_for(model)
        if len(self.shown) != before:
            changed |= {index for index in model.cells if str(index) in self.rows}
        if len(model.cells) != self._cell_count:
            # Keys with one value in every cell say nothing about a row; the header has them.
            self._cell_count = len(model.cells)
            self._varying = varying_keys(r.params for r in model.cells.values() if r.index >= 0)
            changed |= {index for index in model.cells if str(index) in self.rows}
        with self.updating():
            for index in sorted(changed):
                row = model.cells[index]
                key = str(index)
                values = self.cells(row)
                self.upsert(key, values)
