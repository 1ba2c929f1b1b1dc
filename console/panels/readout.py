"""The readout panel: the prefill_last vs decode0 rows live, and the traces detail screen."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Sparkline, Static

from console.panel import KindPanel
from console.widgets.live_table import LiveTable
from console.widgets.text import clean, number, plain
from runners.events import Event, RunFinished, RunStarted
from runners.kinds.readout import RowBook

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

    def show(self, rows: dict[str, dict[str, Any]], changed: Iterable[str]) -> None:
        with self.updating():
            for key in changed:
                self.upsert(key, self.cells(rows[key]))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key.value is not None:
            self.post_message(self.PromptChosen(event.row_key.value))


def gap_label(gaps: list[float]) -> str:
    """The gap sparkline's scale: its bars run from the lowest gap to the highest, so a 1%
    change fills the height; the label says how far apart they are."""
    head = "gap (top1 - top2 logit) per decode step"
    if not gaps:
        return head
    low, high = min(gaps), max(gaps)
    spread = (high - low) / abs(high) * 100 if high else 0.0
    return f"{head}: bars span {low:.4g} (lowest) to {high:.4g} (highest), {spread:.2g}% apart"


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
        self.query_one("#spark-gap-label", Static).update(gap_label(gaps))
        self.query_one("#spark-top1", Sparkline).data = top1
        self.query_one("#spark-gap", Sparkline).data = gaps


class TracesScreen(Screen[None]):
    """The readout rows in full, and the selected prompt's top-1 and gap per decode step."""

    DEFAULT_CSS = """
    TracesScreen > #traces-title { height: 1; padding: 0 1; background: $panel; }
    TracesScreen > #readout { height: 1fr; }
    TracesScreen > #sparks { border-top: solid $primary; }
    """

    BINDINGS = [Binding("escape", "close", "Back to the run")]

    def __init__(self, panel: ReadoutPanel) -> None:
        super().__init__()
        self.panel = panel
        self.selected: str | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="traces-title", markup=False)
        yield ReadoutTable(id="readout")
        yield StepSparklines(id="sparks")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#readout", ReadoutTable)
        rows = self.panel.rows
        table.show(rows, list(rows))
        table.focus()
        self._show_title()

    def show_changes(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        rows = self.panel.rows
        self.query_one("#readout", ReadoutTable).show(rows, keys)
        if self.selected in keys:
            self.query_one("#sparks", StepSparklines).show(rows[self.selected])
        self._show_title()

    def _show_title(self) -> None:
        rows = list(self.panel.rows.values())
        mismatches = sum(int(r.get("readout_mismatch_count") or 0) for r in rows)
        not_ok = sum(1 for r in rows if r.get("verdict") == "NO OK")
        h = self.panel.header
        text = Text.assemble(
            ("readout  ", "bold"),
            ("run ", "dim"),
            clean(getattr(h, "run_id", "") or "?"),
            ("  prompts ", "dim"),
            str(len(rows)),
            ("  NO OK ", "dim"),
            (str(not_ok), "bold red" if not_ok else ""),
            ("  readout_mismatch=true lines ", "dim"),
            (str(mismatches), "bold red" if mismatches else ""),
        )
        if self.panel.finished is not None:
            text.append(f"  verdict {clean(self.panel.finished.verdict)}", style="bold")
        self.query_one("#traces-title", Static).update(text)

    def on_readout_table_prompt_chosen(self, message: ReadoutTable.PromptChosen) -> None:
        self.selected = message.key
        self.query_one("#sparks", StepSparklines).show(self.panel.rows.get(message.key))

    def action_close(self) -> None:
        self.panel.detail_screen = None
        self.dismiss(None)


class ReadoutPanel(KindPanel):
    """The rows on the run screen; `d` opens the traces screen with per-step sparklines."""

    DEFAULT_CSS = """
    ReadoutPanel { height: auto; max-height: 10; display: none; }
    ReadoutPanel.-rows { display: block; }
    ReadoutPanel > ReadoutTable { height: auto; max-height: 9; }
    """

    kind = "readout"

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.book = RowBook()
        self.rows: dict[str, dict[str, Any]] = {}
        self.changed: dict[str, None] = {}
        self.header: Any = None
        self.finished: RunFinished | None = None
        self.detail_screen: TracesScreen | None = None

    def compose(self) -> ComposeResult:
        yield ReadoutTable(id="readout-rows")

    def take(self, event: Event) -> bool:
        if isinstance(event, RunStarted):
            self.header = event
        elif isinstance(event, RunFinished):
            self.finished = event
            return True
        changed = self.book.fold(event)
        if not changed:
            return False
        self.rows = self.book.rows()
        self.changed.update(dict.fromkeys(changed))
        return True

    def redraw(self) -> None:
        changed, self.changed = list(self.changed), {}
        if self.rows:
            self.add_class("-rows")
        self.query_one("#readout-rows", ReadoutTable).show(self.rows, changed)
        if self.detail_screen is not None and self.detail_screen.is_mounted:
            self.detail_screen.show_changes(changed)

    def status(self) -> str:
        if not self.rows:
            return ""
        bad = sum(1 for r in self.rows.values() if r.get("verdict") == "NO OK")
        return f"readout: {len(self.rows)} prompts, {bad} NO OK (d: details)"

    def detail(self) -> Screen[None]:
        self.detail_screen = TracesScreen(self)
        return self.detail_screen


ReadoutPanel.detail_class = TracesScreen
PANEL = ReadoutPanel
