"""The Runs screen (F3): every live and recent run of this machine's records, its state asked on
its hosts, and who holds each host's lock, as `tracedeck status` shows them.

`/` filters the rows, clicking a column header (or `s`) sorts by it, Enter opens the run (a live
one is reattached, an ended one replayed), `c` cancels a live one after asking, `f5` asks again.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Label, Static

from console.screens.dialogs import ConfirmDialog
from console.screens.sources import AttachSource, ReplaySource
from console.widgets.text import TONE_STYLES, plain
from runners.kinds import tone
from runners.status import LIVE, RunStatus, Status, elapsed_words, holder_words

COLUMNS = (
    ("state", "state"),
    ("run id", "run_id"),
    ("preset", "preset"),
    ("kind", "kind"),
    ("verdict", "verdict"),
    ("host(s)", "hosts"),
    ("lock holder", "holder"),
    ("elapsed", "elapsed"),
)
STATE_STYLES = {"live": "bold cyan", "ending": "cyan", "ended": "", "stopped": "yellow"}


def holders_of(run: RunStatus, status: Status) -> str:
    """Who holds the locks of the run's hosts ('' when none is held)."""
    held = [
        f"{lk.host}: {holder_words(lk.holder)}"
        for lk in status.locks
        if lk.host in run.hosts and lk.state == "held"
    ]
    return "; ".join(held)


def row_values(run: RunStatus, status: Status) -> dict[str, Any]:
    """The sortable values of one row, by column key."""
    return {
        "state": run.state + (" (followed)" if run.followed and run.state == LIVE else ""),
        "run_id": run.run_id,
        "preset": run.preset,
        "kind": run.kind,
        "verdict": run.verdict or "",
        "hosts": ",".join(run.hosts),
        "holder": holders_of(run, status),
        "elapsed": run.elapsed_s if run.elapsed_s is not None else -1.0,
    }


class RunsScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "close", "Back"),
        Binding("slash", "filter", "Filter"),
        Binding("s", "sort_next", "Sort"),
        Binding("c", "cancel_run", "Cancel run"),
        Binding("f5", "refresh", "Ask again"),
    ]

    class Collected(Message):
        def __init__(self, status: Status) -> None:
            super().__init__()
            self.status = status

    def __init__(self, out_dir: Path, hosts: list[str] | None = None) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.hosts = hosts
        self.status = Status([], [])
        self.shown: list[RunStatus] = []
        self.sort_key = "state"
        self.sort_reverse = False
        self.filter_text = ""
        self.collected = 0  # how many times the runs were collected (tests wait on it)

    def compose(self) -> ComposeResult:
        yield Label("Runs", classes="section-title")
        yield Input(placeholder="/ filter: any text of a row", id="runs-filter")
        yield DataTable(id="runs-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="runs-locks", markup=False)
        yield Static("", id="runs-status", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#runs-table", DataTable)
        for label, key in COLUMNS:
            table.add_column(label, key=key)
        self.query_one("#runs-filter", Input).display = False
        table.focus()
        self.action_refresh()

    # -- collecting -------------------------------------------------------------------------------

    def action_refresh(self) -> None:
        self.query_one("#runs-status", Static).update(
            Text("asking the hosts of each run ...", style="dim")
        )
        self.run_worker(self._collect(), group="collect", exclusive=True, exit_on_error=False)

    async def _collect(self) -> None:
        from runners.status import collect

        self.post_message(self.Collected(await collect(self.out_dir, hosts=self.hosts)))

    def on_runs_screen_collected(self, message: Collected) -> None:
        self.status = message.status
        self.collected += 1
        self.show()

    # -- drawing ----------------------------------------------------------------------------------

    def show(self) -> None:
        status = self.status
        needle = self.filter_text.lower()
        rows = [(run, row_values(run, status)) for run in status.runs]
        if needle:
            rows = [
                (run, values)
                for run, values in rows
                if any(needle in str(v).lower() for v in values.values())
            ]
        rows.sort(key=lambda rv: rv[1][self.sort_key], reverse=self.sort_reverse)
        self.shown = [run for run, _ in rows]
        table = self.query_one("#runs-table", DataTable)
        table.clear()
        for run, values in rows:
            verdict = (
                plain(run.verdict, TONE_STYLES[tone(run.kind, run.verdict)])
                if run.verdict
                else Text("-", style="dim")
            )
            table.add_row(
                plain(values["state"], STATE_STYLES.get(run.state, "bold red")),
                plain(run.run_id),
                plain(run.preset),
                plain(run.kind),
                verdict,
                plain(values["hosts"]),
                plain(values["holder"]),
                Text(elapsed_words(run.elapsed_s), justify="right"),
                key=run.local_dir,
            )
        locks = Text("locks  ", style="bold")
        for lk in status.locks:
            style = (
                "bold red"
                if lk.state == "held"
                else "green"
                if lk.state
                in (
                    "free",
                    "absent",
                )
                else "yellow"
            )
            locks.append(f"{lk.host} ", style="bold")
            locks.append(lk.state, style=style)
            who = holder_words(lk.holder)
            if lk.state == "held" and who:
                locks.append(f" by {who}")
            elif lk.note:
                locks.append(f" ({lk.note})", style="dim")
            locks.append("   ")
        self.query_one("#runs-locks", Static).update(locks)
        arrow = "desc" if self.sort_reverse else "asc"
        filtered = f", filter {self.filter_text!r}" if self.filter_text else ""
        self.query_one("#runs-status", Static).update(
            Text(
                f"{len(self.shown)} of {len(status.runs)} run(s), sorted by {self.sort_key} "
                f"({arrow}){filtered}. Enter: open (live: reattach; ended: replay). c: cancel.",
                style="dim",
            )
        )

    # -- filter and sort ---------------------------------------------------------------------------

    def action_filter(self) -> None:
        box = self.query_one("#runs-filter", Input)
        box.display = True
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "runs-filter":
            self.filter_text = event.value.strip()
            self.show()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "runs-filter":
            self.query_one("#runs-table", DataTable).focus()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        self.sort_by(str(event.column_key.value))

    def sort_by(self, key: str) -> None:
        if key == self.sort_key:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_key, self.sort_reverse = key, False
        self.show()

    def action_sort_next(self) -> None:
        keys = [key for _, key in COLUMNS]
        self.sort_key = keys[(keys.index(self.sort_key) + 1) % len(keys)]
        self.sort_reverse = False
        self.show()

    # -- open and cancel --------------------------------------------------------------------------

    def selected(self) -> RunStatus | None:
        table = self.query_one("#runs-table", DataTable)
        if not self.shown or not 0 <= table.cursor_row < len(self.shown):
            return None
        return self.shown[table.cursor_row]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_open()

    def action_open(self) -> None:
        from console.screens.run import RunScreen

        run = self.selected()
        if run is None or run.preset == "?":
            return
        local = Path(run.local_dir)
        if run.state == "ended":
            self.app.push_screen(RunScreen(ReplaySource(local, speed=0.0)))
        else:
            self.app.push_screen(RunScreen(AttachSource(local)))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "cancel_run":
            run = self.selected()
            return run is not None and run.state == LIVE
        return True

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.refresh_bindings()

    def action_cancel_run(self) -> None:
        run = self.selected()
        if run is None or run.state != LIVE:
            return
        question = (
            f"Cancel run {run.run_id} ({run.preset}) on {', '.join(run.hosts)}? Its processes "
            f"get TERM, then KILL after a grace period (a Slurm job: scancel)."
        )

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self._cancel(run), group="cancel", exit_on_error=False)

        self.app.push_screen(ConfirmDialog(question, yes="Cancel the run", no="Keep it"), answered)

    async def _cancel(self, run: RunStatus) -> None:
        from console.cancel_cmd import cancel_run
        from console.headless import Printer
        from runners.targets.base import TargetError

        try:
            code = await cancel_run(Path(run.local_dir), 5.0, Printer(out=io.StringIO()))
        except (TargetError, OSError, ValueError) as exc:
            self.notify(f"cancel {run.run_id}: {exc}", severity="error", markup=False)
            return
        self.notify(f"cancel {run.run_id}: done (exit {code})", markup=False)
        self.action_refresh()

    def action_close(self) -> None:
        self.dismiss(None)
