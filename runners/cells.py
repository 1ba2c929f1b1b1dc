"""What every run has, whatever its kind: cells, their states, and how a cell is named."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class CellState(StrEnum):
    """The life of one cell; the setup step (cell -1) uses the same words."""

    PENDING = "pending"
    RUNNING = "running"
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"  # never ran: the setup step failed, or the run never started
    CANCELLED = "cancelled"
    LOST = "lost"  # the run ended (crashed, killed outside tracedeck) before the cell did

    @property
    def ended(self) -> bool:
        return self not in (CellState.PENDING, CellState.RUNNING)


SETUP_CELL = -1
# Not a cell: trace lines written outside every cell, log lines of the run itself.
NO_CELL = -2


def params_label(params: dict[str, Any]) -> str:
    """A cell's parameters as `k=v k=v`, the way every screen and message names a cell."""
    return " ".join(f"{k}={v}" for k, v in params.items())


def cell_name(index: int, params: dict[str, Any], total: int | None = None) -> str:
    """`cell 2/6 (seed=0 mode=decode)` or `setup`: 1-based, as the console and headless show it."""
    if index == SETUP_CELL:
        return "setup"
    count = f"/{total}" if total else ""
    label = params_label(params)
    return f"cell {index + 1}{count}" + (f" ({label})" if label else "")


@dataclass(frozen=True, slots=True)
class PlannedCell:
    """One cell as the plan renders it: its parameters, exact command and environment."""

    index: int
    params: dict[str, Any]
    command: str
    env: dict[str, str]
    artifacts: tuple[str, ...] = ()  # paths under the run's artifacts dir to bring home
