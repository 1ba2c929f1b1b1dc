"""The traces screen: the readout table filling row by row, and per-step sparklines."""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Static

from console.run_model import RunModel
from console.widgets.readout_table import ReadoutTable, StepSparklines
from console.widgets.text import clean


class TracesScreen(Screen[None]):
    """Reads the run screen's model; the run screen forwards which rows changed."""

    BINDINGS = [Binding("escape", "close", "Back to the run")]

    def __init__(self, model: RunModel) -> None:
        super().__init__()
        self.model = model
        self.selected: str | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="traces-title", markup=False)
        yield ReadoutTable(id="readout")
        yield StepSparklines(id="sparks")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#readout", ReadoutTable)
        table.show(self.model, list(self.model.readout))
        table.focus()
        self._show_title()

    def show_changes(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.query_one("#readout", ReadoutTable).show(self.model, keys)
        if self.selected in keys:
            self.query_one("#sparks", StepSparklines).show(self.model.readout[self.selected])
        self._show_title()

    def _show_title(self) -> None:
        rows = list(self.model.readout.values())
        mismatches = sum(int(r.get("readout_mismatch_count") or 0) for r in rows)
        not_ok = sum(1 for r in rows if r.get("verdict") == "NO OK")
        h = self.model.header
        text = Text.assemble(
            ("readout  ", "bold"),
            ("run ", "dim"),
            clean(h.run_id or "?"),
            ("  prompts ", "dim"),
            str(len(rows)),
            ("  NO OK ", "dim"),
            (str(not_ok), "bold red" if not_ok else ""),
            ("  readout_mismatch=true lines ", "dim"),
            (str(mismatches), "bold red" if mismatches else ""),
        )
        if self.model.finished is not None:
            text.append(f"  verdict {clean(self.model.finished.verdict)}", style="bold")
        self.query_one("#traces-title", Static).update(text)

    def on_readout_table_prompt_chosen(self, message: ReadoutTable.PromptChosen) -> None:
        self.selected = message.key
        self.query_one("#sparks", StepSparklines).show(self.model.readout.get(message.key))

    def action_close(self) -> None:
        self.dismiss(None)
