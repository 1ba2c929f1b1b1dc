"""Every key the console answers to, read from the bindings themselves."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label

from console.widgets.text import plain


def binding_rows(app_bindings: list, screens: list[tuple[str, type]]) -> list[tuple[str, Binding]]:
    """(where, binding) for the app's bindings and each screen class's own."""
    rows: list[tuple[str, Binding]] = [
        ("everywhere", b) for b in Binding.make_bindings(app_bindings)
    ]
    for where, cls in screens:
        rows.extend((where, b) for b in Binding.make_bindings(cls.__dict__.get("BINDINGS", [])))
    return rows


class HelpScreen(Screen[None]):
    """A table of keys: where they work, the key, what it does."""

    BINDINGS = [Binding("escape,q", "close", "Close help")]

    def compose(self) -> ComposeResult:
        yield Label(
            "Keys (tables: arrows move, Enter picks; Tab moves between fields)",
            classes="section-title",
        )
        yield DataTable(id="keys", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#keys", DataTable)
        table.add_column("where", key="where")
        table.add_column("key", key="key")
        table.add_column("does", key="does")
        app = self.app
        screens = getattr(app, "help_screens", lambda: [])()
        for n, (where, binding) in enumerate(binding_rows(list(app.BINDINGS), screens)):
            does = binding.description or binding.action
            table.add_row(
                plain(where),
                Text(app.get_key_display(binding), style="bold"),
                plain(does),
                key=f"{n}",
            )
        table.focus()

    def action_close(self) -> None:
        self.dismiss(None)
