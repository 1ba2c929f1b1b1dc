"""The B3.11/B3.12 readout table (prefill_last vs decode0 per prompt) and its step sparklines."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Sparkline, Static

from console.run_model import RunModel
from console.widgets.live_table import LiveTable
from console.widgets.text import number, plain

COLUMNS = (
    ("prompt", "prompt"),
    ("prefill_last_top1", "prefill_last_top1"),
    ("prefill gap", "prefill_last_gap"),
    ("decode0_top1", "decode0_top1"),
    ("decode0 gap", "decode0_gap"),
    ("steps", "decode_steps"),
    ("readout_mismatch", "readout_mismatch_count"),
    ("verdict", "verdict"),
    ("note", "note"),
)
VERDICT_STYLES = {"OK": "bold green", "NO OK": "bold red"}


class ReadoutTable(LiveTable):
    COLUMNS = COLUMNS

    """One row per prompt, keyed by where its prefill_last line is; rows refill as steps arrive."""

    DEFAULT_CSS = """
    ReadoutTable { height: 1fr; }
    """

    class PromptChosen(Message):
        """The operator moved to a prompt's row."""

        def __init__(self, key: str) -> None:
            super().__init__()
            self.key = key

    def cells(self, row: dict[str, Any]) -> tuple[Text, ...]:
        verdict = row.get("verdict")
        steps = row.get("decode_steps") or 0
        return (
            plain(row.get("prompt", "?")),
            Text(number(row.get("prefill_last_top1")), justify="right"),
            Text(number(row.get("prefill_last_gap")), justify="right"),
            Text(number(row.get("decode0_top1")) if steps else "no decode", justify="right"),
            Text(number(row.get("decode0_gap")) if steps else "", justify="right"),
            Text(str(steps), justify="right"),
            Text(
                str(row.get("readout_mismatch_count", 0)),
                justify="right",
                style="bold red" if row.get("readout_mismatch_count") else "",
            ),
            Text(verdict or "—", style=VERDICT_STYLES.get(verdict or "", "dim")),
            plain(row.get("note", "")),
        )

    def show(self, model: RunModel, changed: Iterable[str]) -> None:
        for key in changed:
            values = self.cells(model.readout[key])
            self.upsert(key, values)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key.value is not None:
            self.post_message(self.PromptChosen(event.row_key.value))


class StepSparklines(Vertical):
    """Top-1 token id and top-1/top-2 gap per decode step of one prompt."""

    DEFAULT_CSS = """
    StepSparklines { height: auto; padding: 0 1; }
    StepSparklines > Sparkline { height: 2; margin-bottom: 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static("no prompt selected", id="spark-title", markup=False)
        yield Static("top-1 id per decode step", id="spark-top1-label", markup=False)
        yield Sparkline([], id="spark-top1")
        yield Static("gap (top1 - top2 logit) per decode step", id="spark-gap-label", markup=False)
        yield Sparkline([], id="spark-gap")

    def show(self, row: dict[str, Any] | None) -> None:
        title = self.query_one("#spark-title", Static)
        top1 = [float(v) for v in (row or {}).get("top1_seq", [])]
        gaps = [float(v) for v in (row or {}).get("gap_seq", [])]
        if row is None:
            title.update("no prompt selected")
        else:
            ids = ", ".join(str(v) for v in row.get("top1_seq", [])[:12])
            more = " ..." if len(top1) > 12 else ""
            summary = plain(f"{row.get('prompt')}: {len(top1)} decode steps; top-1 ids {ids}{more}")
            title.update(Text("\n").join([summary, plain(row.get("note", ""), "italic")]))
        self.query_one("#spark-top1", Sparkline).data = top1
        self.query_one("#spark-gap", Sparkline).data = gaps
