"""The plan of a run before it starts: what `tracedeck plan` prints, and its read-only check."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Button, Footer, Label, Log, Static

from console.plan_text import check_lines, plan_lines
from console.widgets.text import clean
from runners.preflight import PROBLEM, WARN, Checked, check
from runners.preview import Preview

LEVEL_STYLES = {PROBLEM: "bold red", WARN: "yellow"}


class PlanScreen(Screen[bool]):
    """Every cell's command, environment, remote paths and files, before anything starts.

    ctrl+r starts the run (dismisses with True), c checks the target (connects, reads only),
    escape goes back to the presets without starting anything.
    """

    BINDINGS = [
        Binding("escape", "back", "Back (start nothing)"),
        Binding("ctrl+r", "start", "Start run", priority=True),
        Binding("c", "check", "Check target"),
    ]

    DEFAULT_CSS = """
    PlanScreen > #plan-checks { height: auto; max-height: 12; padding: 0 1; display: none; }
    PlanScreen > #plan-checks.-shown { display: block; }
    PlanScreen > #plan-lines { height: 1fr; }
    PlanScreen > #plan-buttons { height: auto; }
    PlanScreen > #plan-buttons > Button { margin: 0 1; }
    """

    class Done(Message):
        def __init__(self, checked: Checked) -> None:
            super().__init__()
            self.checked = checked

    def __init__(self, view: Preview) -> None:
        super().__init__()
        self.view = view
        self.checked: Checked | None = None
        self.checking = False

    def compose(self) -> ComposeResult:
        p = self.view
        yield Label(
            clean(f"Plan: {p.preset.name} on {p.target_name} (nothing started yet)"),
            classes="section-title",
        )
        yield Static("", id="plan-checks", markup=False)
        yield Log(id="plan-lines", highlight=False)
        with Horizontal(id="plan-buttons"):
            yield Button("Start run (ctrl+r)", id="plan-start", variant="success")
            yield Button("Check target (c)", id="plan-check")
            yield Button("Back (esc)", id="plan-back")
        yield Footer()

    def on_mount(self) -> None:
        self.show_plan(self.view)
        self.query_one("#plan-lines", Log).focus()

    def show_plan(self, view: Preview) -> None:
        log = self.query_one("#plan-lines", Log)
        log.clear()
        log.write_lines(plan_lines(view), scroll_end=False)
        log.scroll_home(animate=False)

    def lines(self) -> list[str]:
        return [str(line) for line in self.query_one("#plan-lines", Log).lines]

    def on_button_pressed(self, event: Button.Pressed) -> None:
        actions = {"plan-start": self.action_start, "plan-check": self.action_check}
        actions.get(event.button.id or "", self.action_back)()

    def action_start(self) -> None:
        self.dismiss(True)

    def action_back(self) -> None:
        self.dismiss(False)

    def action_check(self) -> None:
        if self.checking:
            return
        self.checking = True
        box = self.query_one("#plan-checks", Static)
        box.add_class("-shown")
        box.update(Text(f"checking {self.view.target_name} (read-only) ...", style="bold"))
        self.run_worker(self._check(), group="check", exclusive=True, exit_on_error=False)

    async def _check(self) -> None:
        self.post_message(self.Done(await check(self.view)))

    def on_plan_screen_done(self, message: Done) -> None:
        self.checking = False
        self.checked = checked = message.checked
        text = Text()
        lines = check_lines(checked)
        for finding, line in zip(checked.findings, lines, strict=False):
            text.append(clean(line) + "\n", style=LEVEL_STYLES.get(finding.level, ""))
        text.append(clean(lines[-1]), style="bold red" if checked.problems else "bold green")
        self.query_one("#plan-checks", Static).update(text)
        if checked.preview is not None:
            self.show_plan(checked.preview)
