"""The Runs screen (F3): every live and recent run of this machine's records, its state asked on
its hosts, and who holds each host's lock, as `tracedeck status` shows them.

`/` filters the rows, clicking a column header (or `s`) sorts by it, Enter opens the run (a live
one is reattached, an ended one replayed), `c` cancels a live one after asking, `f5` asks again.
Live runs come first; the lock holder column takes what the others leave of the width, and the
highlighted run's note and lock holders are spelled out under the table.
"""

from __future__ import annotations

import datetime as dt
import io
import time
from collections.abc import Awaitable, Callable
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
from console.widgets.fill_table import refill
from console.widgets.text import TONE_STYLES, clean, plain
from runners.kinds import tone
from runners.status import (
    ENDED,
    ENDING,
    LIVE,
    STOPPED,
    UNKNOWN,
    RunStatus,
    Status,
    elapsed_words,
    holder_words,
)

COLUMNS = (
    ("state", "state"),
    ("run id", "run_id"),
    ("preset", "preset"),
    ("kind", "kind"),
    ("verdict", "verdict"),
    ("host(s)", "hosts"),
    ("elapsed", "elapsed"),
    ("lock holder", "holder"),  # the long one, last: it takes what the others leave
)
# runners.status.collect's shape: (records root, hosts whose locks to show, now) -> Status.
Collect = Callable[[Path, list[str] | None, float], Awaitable[Status]]
STATE_STYLES = {"live": "bold cyan", "ending": "cyan", "ended": "", "stopped": "yellow"}
# The order of states when sorting by state: what runs first (as `tracedeck status` lists them).
STATE_ORDER = {LIVE: 0, ENDING: 1, UNKNOWN: 2, STOPPED: 3, ENDED: 4}


def holders_of(run: RunStatus, status: Status, short: bool = False) -> str:
    """Who holds the locks of the run's hosts ('' when none is held), the host named when the
    run has several: "this run" when it is the run itself (with who and the process group
    unless `short`). A run that is not live shows only locks it holds itself (leftovers): who
    holds its hosts now is the locks line's to say, not its row's."""
    held = []
    for lk in status.locks:
        if lk.host not in run.hosts or lk.state != "held":
            continue
        mine = lk.holder.get("run_id") == run.run_id
        if not mine and run.state != LIVE:
            continue
        who = holder_words(lk.holder)
        if mine:
            user = f"{lk.holder.get('user', '?')}@{lk.holder.get('console_host', '?')}"
            pgid = lk.holder.get("pgid")
            who = f"{user}, pgid {pgid}" if pgid else user
            who = "this run" if short else f"this run ({who})"
        held.append(f"{lk.host}: {who}" if len(run.hosts) > 1 else who)
    return "; ".join(held)


def row_values(run: RunStatus, status: Status) -> dict[str, Any]:
    """The sortable values of one row, by column key."""
    return {
        "state": (STATE_ORDER.get(run.state, len(STATE_ORDER)), -(run.started or 0.0)),
        "run_id": run.run_id,
        "preset": run.preset,
        "kind": run.kind,
        "verdict": run.verdict or "",
        "hosts": ",".join(run.hosts),
        "holder": holders_of(run, status, short=True),
        "elapsed": run.elapsed_s if run.elapsed_s is not None else -1.0,
    }


def state_words(run: RunStatus) -> str:
    return run.state + (" (followed)" if run.followed and run.state == LIVE else "")


async def _collect(out_dir: Path, hosts: list[str] | None, now: float) -> Status:
    from runners.status import collect

    return await collect(out_dir, hosts=hosts, now=now)


class RunsScreen(Screen[None]):
    DEFAULT_CSS = """
    RunsScreen #runs-table { height: 1fr; }
    RunsScreen #runs-detail, RunsScreen #runs-locks { height: auto; padding: 0 1; }
    RunsScreen #runs-status { height: auto; padding: 0 1; }
    """
    BINDINGS = [
        Binding("escape", "close", "Back"),
        Binding("slash", "filter", "Filter"),
        Binding("s", "sort_next", "Sort"),
        Binding("c", "cancel_run", "Cancel run"),
        Binding("f5", "refresh", "Ask again"),
    ]

    class Collected(Message):
        def __init__(self, status: Status, now: float) -> None:
            super().__init__()
            self.status = status
            self.now = now

    def __init__(
        self, out_dir: Path, hosts: list[str] | None = None, collect: Collect | None = None
    ) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.hosts = hosts
        self.collect = collect or _collect
        self.status = Status([], [])
        self.shown: list[RunStatus] = []
        self.sort_key = "state"
        self.sort_reverse = False
        self.filter_text = ""
        self.collected = 0  # how many times the runs were collected (tests wait on it)
        self.asked_at: float | None = None  # the clock when the hosts were last asked
        self.asking = False

    def compose(self) -> ComposeResult:
        yield Label("Runs", classes="section-title")
        yield Input(placeholder="/ filter: any text of a row", id="runs-filter")
        yield DataTable(id="runs-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="runs-detail", markup=False)
        yield Static("", id="runs-locks", markup=False)
        yield Static("", id="runs-status", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#runs-table", DataTable)
        refill(table, COLUMNS, [], "holder")
        self.query_one("#runs-filter", Input).display = False
        table.focus()
        self.action_refresh()

    # -- collecting -------------------------------------------------------------------------------

    def action_refresh(self) -> None:
        self.asking = True
        self.show_status_line()
        self.run_worker(self._collect(), group="collect", exclusive=True, exit_on_error=False)

    async def _collect(self) -> None:
        now = getattr(self.app, "clock", time.time)()
        status = await self.collect(self.out_dir, self.hosts, now)
        self.post_message(self.Collected(status, now))

    def on_runs_screen_collected(self, message: Collected) -> None:
        self.status, self.asked_at, self.asking = message.status, message.now, False
        self.collected += 1
        self.show()

    # -- drawing ----------------------------------------------------------------------------------

    def show(self) -> None:
        status = self.status
        needle = self.filter_text.lower()
        rows = []
        for run in status.runs:
            values = row_values(run, status)
            cells = self.cells(run, values)
            if needle and not any(needle in cell.plain.lower() for cell in cells):
                continue
            rows.append((run, values, cells))
        rows.sort(key=lambda row: row[1][self.sort_key], reverse=self.sort_reverse)
        table = self.query_one("#runs-table", DataTable)
        previous = self.selected()
        self.shown = [run for run, _, _ in rows]
        refill(table, COLUMNS, [(run.local_dir, cells) for run, _, cells in rows], "holder")
        dirs = [run.local_dir for run in self.shown]
        if previous is not None and previous.local_dir in dirs:
            table.move_cursor(row=dirs.index(previous.local_dir))
        self.show_locks()
        self.show_detail()
        self.show_status_line()

    def show_status_line(self) -> None:
        """How many runs, in what order, and when the hosts were asked (the states are what
        they said then: f5 asks again)."""
        if self.asking or self.asked_at is None:
            line = "asking the hosts of each run ..."
        else:
            asked = dt.datetime.fromtimestamp(self.asked_at, dt.UTC)
            arrow = "desc" if self.sort_reverse else "asc"
            filtered = f", filter {self.filter_text!r}" if self.filter_text else ""
            line = (
                f"{len(self.shown)} of {len(self.status.runs)} run(s), asked {asked:%H:%M:%S} "
                f"UTC, sorted by {self.sort_key} ({arrow}){filtered}. Enter: open (live: "
                "reattach; ended: replay). c: cancel."
            )
        self.query_one("#runs-status", Static).update(Text(line, style="dim"))

    @staticmethod
    def cells(run: RunStatus, values: dict[str, Any]) -> list[Text]:
        verdict = (
            plain(run.verdict, TONE_STYLES[tone(run.kind, run.verdict)])
            if run.verdict
            else Text("-", style="dim")
        )
        return [
            plain(state_words(run), STATE_STYLES.get(run.state, "bold red")),
            plain(run.run_id),
            plain(run.preset),
            plain(run.kind),
            verdict,
            plain(values["hosts"]),
            Text(elapsed_words(run.elapsed_s), justify="right"),
            plain(values["holder"]),
        ]

    def show_locks(self) -> None:
        locks = Text("locks  ", style="bold")
        for lk in self.status.locks:
            if lk.state == "held":
                style = "bold red"
            elif lk.state in ("free", "absent"):
                style = "green"
            else:
                style = "yellow"
            locks.append(f"{lk.host} ", style="bold")
            locks.append(lk.state, style=style)
            who = holder_words(lk.holder)
            if lk.state == "held" and who:
                locks.append(f" by {who}")
            elif lk.note:
                locks.append(f" ({clean(lk.note)})", style="dim")
            locks.append("   ")
        self.query_one("#runs-locks", Static).update(locks)

    def show_detail(self) -> None:
        """The highlighted run in words its row may cut: its note (why its state is what it
        is) and who holds its hosts' locks."""
        run = self.selected()
        detail = self.query_one("#runs-detail", Static)
        line = Text()
        if run is not None and run.note:
            line.append("note  ", style="bold")
            line.append(clean(run.note))
        holder = holders_of(run, self.status) if run is not None else ""
        if holder:
            line.append("\n" if line else "")
            line.append("lock  ", style="bold")
            line.append(clean(holder))
        detail.display = bool(line)
        detail.update(line)

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
        self.show_detail()

    def on_resize(self) -> None:
        self.show()  # the holder column takes what the other columns leave of the new width

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

        said: list[str] = []
        try:
            code = await cancel_run(
                Path(run.local_dir), 5.0, Printer(out=io.StringIO()), said.append
            )
        except (TargetError, OSError, ValueError) as exc:
            self.notify(f"cancel {run.run_id}: {exc}", severity="error", markup=False)
            return
        how = "; ".join(line.removeprefix("cancel: ") for line in said) or "done"
        self.notify(f"cancel {run.run_id}: {how} (exit {code})", markup=False)
        self.action_refresh()

    def action_close(self) -> None:
        self.dismiss(None)
