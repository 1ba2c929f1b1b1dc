"""Two recorded runs side by side: what changed from A to B (the same diff as `tracedeck diff`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label, Static

from analysis.run_compare import (
    ENGINE_SWITCHES,
    FIXED,
    REGRESSED,
    SAME,
    RunDiff,
    compare_runs,
    shift_lines,
)
from console.widgets.text import TONE_STYLES, plain
from runners.run_view import load_side

CHANGE_STYLES = {
    REGRESSED: "bold red",
    "gone": "bold red",
    "changed": "yellow",
    FIXED: "bold green",
    "new": "cyan",
    SAME: "dim",
}
RESULT_STYLES = {0: TONE_STYLES["pass"], 1: TONE_STYLES["fail"], 2: TONE_STYLES["drift"]}


def load_diff(a: Path, b: Path) -> RunDiff:
    return compare_runs(load_side(a), load_side(b), ENGINE_SWITCHES)


class CompareScreen(Screen[None]):
    """Regressions first; each row is a pair, cell, prompt or shard with its metric deltas."""

    DEFAULT_CSS = """
    CompareScreen #compare-head { height: auto; padding: 0 1; }
    CompareScreen #compare-result { height: 1; padding: 0 1; }
    CompareScreen #changes { height: 1fr; }
    CompareScreen #compare-detail { height: auto; max-height: 16; padding: 0 1; }
    """

    BINDINGS = [
        Binding("escape", "close", "Back"),
        Binding("a", "toggle_same", "Unchanged too"),
    ]

    class Loaded(Message):
        def __init__(self, diff: RunDiff | None, error: str = "") -> None:
            super().__init__()
            self.diff = diff
            self.error = error

    def __init__(self, a: Path, b: Path) -> None:
        super().__init__()
        self.a, self.b = a, b
        self.diff: RunDiff | None = None
        self.show_same = False

    def compose(self) -> ComposeResult:
        yield Label("Compare runs", classes="section-title")
        yield Static(Text("reading both runs ...", style="dim"), id="compare-head")
        yield Static("", id="compare-result")
        yield DataTable(id="changes", cursor_type="row", zebra_stripes=True)
        yield Static("", id="compare-detail")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#changes", DataTable)
        for label in ("change", "item", "A", "B", "metrics A -> B"):
            table.add_column(label, key=label)
        table.focus()
        self.run_worker(self._load(), group="load", exclusive=True, exit_on_error=False)

    async def _load(self) -> None:
        try:
            diff = await asyncio.to_thread(load_diff, self.a, self.b)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.post_message(self.Loaded(None, str(exc)))
            return
        self.post_message(self.Loaded(diff))

    def on_compare_screen_loaded(self, message: Loaded) -> None:
        if message.diff is None:
            self.query_one("#compare-head", Static).update(plain(message.error, "red"))
            return
        self.diff = message.diff
        self._show()

    def _show(self) -> None:
        d = self.diff
        assert d is not None
        head = Text()
        for name, side in (("A", d.a), ("B", d.b)):
            style = TONE_STYLES.get(side.tone or "", "bold yellow")
            head.append(f"{name}: ", style="bold")
            head.append_text(plain(f"{side.run_id}  {side.preset}  {side.started_at}  "))
            head.append_text(plain(side.verdict or "unfinished", style))
            head.append("\n")
        for what, x, y in d.identity:
            if what != "engine command":
                head.append_text(plain(f"{what}: {x} -> {y}", "magenta"))
                head.append("\n")
        for key, x, y in d.switches:
            head.append_text(plain(f"engine switch matrix.{key}: {x} -> {y}", "magenta"))
            head.append("\n")
        for why in d.incomparable:
            head.append_text(plain(f"incomparable: {why}", "yellow"))
            head.append("\n")
        self.query_one("#compare-head", Static).update(head)
        result = Text(f"{d.word} (exit {d.exit_code})", style=RESULT_STYLES[d.exit_code])
        if d.run_regressed:
            result.append_text(plain(f"  {d.run_regressed}", "red"))
        self.query_one("#compare-result", Static).update(result)
        table = self.query_one("#changes", DataTable)
        table.clear()
        for n, c in enumerate(d.changes):
            if c.change == SAME and not self.show_same:
                continue
            deltas = "; ".join(x.text() for x in c.deltas) or "—"
            table.add_row(
                plain(c.change.upper(), CHANGE_STYLES.get(c.change, "")),
                plain(f"{c.klass} {c.key}"),
                plain(c.a.verdict if c.a else "-"),
                plain(c.b.verdict if c.b else "-"),
                plain(deltas),
                key=str(n),
            )
        self._detail()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self._detail()

    def _detail(self) -> None:
        d = self.diff
        table = self.query_one("#changes", DataTable)
        if d is None or table.row_count == 0 or table.cursor_row < 0:
            self.query_one("#compare-detail", Static).update("")
            return
        key = table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value
        c = d.changes[int(key or 0)]
        text = Text()
        text.append_text(plain(f"{c.klass} {c.key}: {c.verdicts()}", "bold"))
        for x in c.deltas:
            text.append("\n")
            text.append_text(plain(f"  {x.text()}", "red" if x.crossed else ""))
        for line in shift_lines(c):
            text.append("\n")
            text.append_text(plain(f"  {line}"))
        if c.first_fail_moved:
            text.append("\n")
            text.append_text(plain(f"  first fail moved: {c.first_fail_moved[0]} -> "))
            text.append_text(plain(c.first_fail_moved[1]))
        if c.b is not None and c.b.first_fail:
            text.append("\n")
            text.append_text(plain(f"  first fail (B): {c.b.first_fail}", "dim"))
        self.query_one("#compare-detail", Static).update(text)

    def action_toggle_same(self) -> None:
        self.show_same = not self.show_same
        if self.diff is not None:
            self._show()

    def action_close(self) -> None:
        self.dismiss(None)
