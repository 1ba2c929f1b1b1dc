"""Untrusted text made safe to show: plain Text (never markup) with control characters replaced."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from console.safe_text import clean
from runners.cells import CellState

TONE_STYLES = {"pass": "bold green", "drift": "bold yellow", "fail": "bold red"}
STATE_STYLES = {
    CellState.PENDING: "dim",
    CellState.RUNNING: "bold cyan",
    CellState.PASSED: "green",
    CellState.FAILED: "bold red",
    CellState.CANCELLED: "red",
    CellState.LOST: "red",
    CellState.SKIPPED: "yellow",
}


def plain(value: Any, style: str = "") -> Text:
    """A Text that shows `value` literally: square brackets stay brackets."""
    return Text(clean(value), style=style, no_wrap=True, overflow="ellipsis")


def number(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.6g}"
    return clean(value)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds:.1f}s"


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"
