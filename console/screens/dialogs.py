"""Modal questions: confirm a cancel, trust or refuse an unknown host key."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from console.widgets.text import clean
from runners.targets.base import HostKeyUnknown


class ConfirmDialog(ModalScreen[bool]):
    """A yes/no question; dismisses with True for yes."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str, yes: str = "Yes", no: str = "No") -> None:
        super().__init__()
        self.question = question
        self.yes, self.no = yes, no

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(Text(clean(self.question)), classes="dialog-text", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self.yes} (y)", variant="error", id="yes")
                yield Button(f"{self.no} (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)


class HostKeyDialog(ModalScreen[bool]):
    """Shows an unknown host's key; Trust adds it to known_hosts, Refuse leaves it out."""

    BINDINGS = [
        Binding("t", "answer(True)", "Trust"),
        Binding("r,escape", "answer(False)", "Refuse"),
    ]

    def __init__(self, error: HostKeyUnknown) -> None:
        super().__init__()
        self.error = error

    def compose(self) -> ComposeResult:
        e = self.error
        port = "" if e.port == 22 else f":{e.port}"
        text = Text.assemble(
            ("Unknown host key\n\n", "bold"),
            ("host         ", "dim"),
            clean(f"{e.host}{port}"),
            "\n",
            ("key type     ", "dim"),
            clean(e.key_type),
            "\n",
            ("fingerprint  ", "dim"),
            (clean(e.fingerprint), "bold"),
            "\n\n",
            "This host is not in your known_hosts. Compare the fingerprint with one obtained "
            "out of band (the host's administrator, its console) before trusting it.\n",
            ("Same as: ", "dim"),
            clean(e.trust_command),
        )
        with Vertical(classes="dialog"):
            yield Static(text, classes="dialog-text", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Trust (t)", variant="warning", id="trust")
                yield Button("Refuse (r)", variant="primary", id="refuse")

    def on_mount(self) -> None:
        self.query_one("#refuse", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "trust")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)
