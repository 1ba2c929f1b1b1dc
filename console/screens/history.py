"""Past runs from the local run directories: open one (replay or reattach), or replay it paced."""

from __future__ import annotations

import asyncio
import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import orjson
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label, Select, Static

from console.screens.sources import AttachSource, ReplaySource
from console.widgets.fill_table import refill
from console.widgets.text import TONE_STYLES, clean, plain
from runners.events import RunFinished
from runners.kinds import event_types, tone
from runners.record import EVENTS, RUN_JSON, decode_event

UNFINISHED = "running?/unfinished"
WHY_LINES = 4  # the highlighted run's reason under the table, at most this many lines
COLUMNS = (
    ("started (UTC)", "started"),
    ("run id", "run_id"),
    ("preset", "preset"),
    ("target", "target"),
    ("verdict", "verdict"),
    ("why", "why"),
)
TAIL_BYTES = 1 << 18
SPEEDS: list[tuple[str, float]] = [
    ("real time", 1.0),
    ("2x", 2.0),
    ("5x", 5.0),
    ("10x", 10.0),
    ("100x", 100.0),
    ("as fast as possible", 0.0),
]


@dataclass(slots=True)
class RunEntry:
    local_dir: Path
    started: str
    run_id: str
    preset: str
    target: str
    verdict: str | None
    problem: str | None = None
    kind: str = ""
    why: str = ""  # the verdict's reason (a loosened pass says how much, a failure why)
    exit_code: int | None = None  # a non-zero exit is never shown as a pass, whatever the word


def started_words(started: str) -> str:
    """A record's start to the minute in UTC (what leaves room for the why column), or the
    record's own text when it is not an ISO time."""
    try:
        when = dt.datetime.fromisoformat(started)
    except ValueError:
        return started
    if when.tzinfo is not None:
        when = when.astimezone(dt.UTC)
    return f"{when:%Y-%m-%d %H:%M}"


def last_verdict(events: Path) -> str | None:
    """The verdict of the last run_finished event (it is the run's last line), or None."""
    finished = last_finished(events)
    return finished.verdict if finished is not None else None


def last_finished(events: Path) -> RunFinished | None:
    """The last run_finished event (the run's last line), or None while it has none."""
    try:
        with open(events, "rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - TAIL_BYTES))
            tail = fh.read()
    except OSError:
        return None
    for line in reversed(tail.split(b"\n")):
        if b'"run_finished"' not in line:
            continue
        try:
            event = decode_event(events, 0, line, event_types())
        except ValueError:
            continue  # the tail may start mid-line, or a line may be torn
        if isinstance(event, RunFinished):
            return event
    return None


# A recorded pass is checked against its own events (runners.run_view.believed_end) up to this
# size; a larger record is listed as recorded and says so (its replay checks it when opened).
CHECK_MAX_BYTES = 32 << 20


def _checked(local: Path, end: RunFinished) -> RunFinished:
    from runners.run_view import checked_end

    try:
        if (local / EVENTS).stat().st_size > CHECK_MAX_BYTES:
            reason = "(a large record: its pass is checked when it is opened)"
            return RunFinished(end.verdict, end.exit_code, {**end.summary, "reason": reason})
    except OSError:
        pass  # checked_end says why it cannot be read
    return checked_end(local, end)


def scan_runs(out_dir: Path) -> list[RunEntry]:
    """Every run.json under out_dir, newest first; a damaged record is listed with its problem."""
    entries: list[RunEntry] = []
    for path in out_dir.glob(f"**/{RUN_JSON}"):
        local = path.parent
        try:
            data = orjson.loads(path.read_bytes())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            entries.append(RunEntry(local, "", local.name, "?", "?", None, f"{path}: {exc}"))
            continue
        finished = last_finished(local / EVENTS)
        if finished is not None and finished.exit_code == 0:
            finished = _checked(local, finished)
        summary = finished.summary if finished is not None else {}
        entries.append(
            RunEntry(
                local_dir=local,
                started=str(data.get("started_at", "")),
                run_id=str(data.get("run_id", local.name)),
                preset=str(data.get("preset", "?")),
                target=str(data.get("target", "?")),
                verdict=finished.verdict if finished is not None else None,
                kind=str(data.get("kind", "")),
                why=str(summary.get("reason") or summary.get("error") or ""),
                exit_code=finished.exit_code if finished is not None else None,
            )
        )
    entries.sort(key=lambda e: (e.started, e.run_id), reverse=True)
    return entries


def trend_text(out_dir: Path, preset: str, target: str, last: int = 10) -> list[str]:
    """The trends of a preset's last runs on a target, as lines (analysis.trends)."""
    from analysis.trends import trend_lines, trends
    from runners.run_history import preset_runs

    sides, skipped = preset_runs(out_dir, preset, target, last)
    if not sides:
        return [f"no finished run of {preset} on {target}", *skipped]
    return [*trend_lines(trends(sides)), *skipped]


def previous_run(entries: list[RunEntry], entry: RunEntry) -> RunEntry | None:
    """The newest finished run of the same preset and target started before `entry`."""
    for other in entries:  # newest first
        if (
            other.started < entry.started
            and other.preset == entry.preset
            and other.target == entry.target
            and other.verdict is not None
            and not other.problem
        ):
            return other
    return None


class HistoryScreen(Screen[None]):
    """Enter opens a run (finished: instant replay; unfinished: reattach); r replays it paced."""

    BINDINGS = [
        Binding("escape", "close", "Back"),
        Binding("r", "replay", "Replay at speed"),
        Binding("s", "focus_speed", "Speed"),
        Binding("f5", "rescan", "Rescan"),
        Binding("m", "mark", "Mark A"),
        Binding("c", "compare", "Compare"),
        Binding("l", "compare_last", "vs last"),
        Binding("t", "trends", "Trends"),
    ]

    DEFAULT_CSS = """
    HistoryScreen #history-trends { height: auto; max-height: 50%; display: none; padding: 0 1; }
    HistoryScreen #history-trends.shown { display: block; }
    HistoryScreen #history-why { height: auto; padding: 0 1; }
    """

    class Scanned(Message):
        def __init__(self, entries: list[RunEntry]) -> None:
            super().__init__()
            self.entries = entries

    class TrendsRead(Message):
        def __init__(self, lines: list[str]) -> None:
            super().__init__()
            self.lines = lines

    def __init__(self, out_dir: Path) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.entries: list[RunEntry] = []
        self.marked: RunEntry | None = None  # run A of a comparison

    def compose(self) -> ComposeResult:
        with Horizontal(id="history-bar"):
            yield Label("History", classes="section-title")
            yield Select(
                [(Text(label), speed) for label, speed in SPEEDS],
                value=1.0,
                allow_blank=False,
                id="speed",
            )
        yield DataTable(id="runs", cursor_type="row", zebra_stripes=True)
        yield Static("", id="history-why", markup=False)
        yield VerticalScroll(Static("", id="trends-text", markup=False), id="history-trends")
        yield Static("", id="history-status", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#runs", DataTable)
        refill(table, COLUMNS, [], "why")
        table.focus()

    def on_resize(self) -> None:
        self.show()  # the why column takes what the other columns leave of the new width

    def on_screen_resume(self) -> None:
        self.action_rescan()  # a run opened from here may have finished meanwhile

    def action_rescan(self) -> None:
        self.query_one("#history-status", Static).update(Text("scanning ...", style="dim"))
        self.run_worker(self._scan(), group="scan", exclusive=True, exit_on_error=False)

    async def _scan(self) -> None:
        entries = await asyncio.to_thread(scan_runs, self.out_dir)
        self.post_message(self.Scanned(entries))

    def on_history_screen_scanned(self, message: Scanned) -> None:
        previous = self.selected()
        self.entries = message.entries
        self.show(previous)
        count = len(self.entries)
        self.query_one("#history-status", Static).update(
            Text(
                f"{count} run(s). Enter: open (or reattach). r: replay at speed. "
                f"m, c: compare two runs; l: with the last of its preset.",
                style="dim",
            )
        )

    def show(self, previous: RunEntry | None = None) -> None:
        """Draw the entries, the cursor put back on `previous` (default: the run it is on)."""
        table = self.query_one("#runs", DataTable)
        previous = previous or self.selected()
        rows = []
        for entry in self.entries:
            if entry.problem:
                verdict = plain(entry.problem, "red")
            elif entry.verdict is None:
                verdict = Text(UNFINISHED, style="bold yellow")
            else:
                said = tone(entry.kind, entry.verdict) if entry.exit_code == 0 else "fail"
                verdict = plain(entry.verdict, TONE_STYLES[said])
            cells = [
                plain(started_words(entry.started)),
                plain(entry.run_id),
                plain(entry.preset),
                plain(entry.target),
                verdict,
                plain(entry.why, "dim"),
            ]
            rows.append((str(entry.local_dir), cells))
        refill(table, COLUMNS, rows, "why")
        if previous is not None:
            dirs = [entry.local_dir for entry in self.entries]
            if previous.local_dir in dirs:
                table.move_cursor(row=dirs.index(previous.local_dir))
        self.show_why()

    def show_why(self) -> None:
        """The highlighted run's reason in full under the table (its column may cut it)."""
        entry = self.selected()
        why = self.query_one("#history-why", Static)
        why.display = bool(entry and entry.why)
        if entry and entry.why:
            text = clean(entry.why)
            room = WHY_LINES * max(self.size.width - 2, 20) - len("why  ")
            if len(text) > room:  # Enter opens the run, which shows all of it
                text = text[: room - 1] + "…"
            line = Text("why  ", style="bold")
            line.append(text)
            why.update(line)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_why()

    def selected(self) -> RunEntry | None:
        table = self.query_one("#runs", DataTable)
        if not self.entries or table.cursor_row < 0 or table.cursor_row >= len(self.entries):
            return None
        return self.entries[table.cursor_row]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_open()

    def action_open(self) -> None:
        from console.screens.run import RunScreen

        entry = self.selected()
        if entry is None or entry.problem:
            return
        if entry.verdict is None:
            self.app.push_screen(RunScreen(AttachSource(entry.local_dir)))
        else:
            self.app.push_screen(RunScreen(ReplaySource(entry.local_dir, speed=0.0)))

    def action_replay(self) -> None:
        from console.screens.run import RunScreen

        entry = self.selected()
        if entry is None or entry.problem:
            return
        speed = self.query_one("#speed", Select).value
        value = float(speed) if isinstance(speed, int | float) else 1.0
        self.app.push_screen(RunScreen(ReplaySource(entry.local_dir, speed=value)))

    # -- comparing two runs (console/screens/compare.py) -------------------------------------

    def _say(self, text: str, style: str = "dim") -> None:
        self.query_one("#history-status", Static).update(plain(text, style))

    def action_mark(self) -> None:
        entry = self.selected()
        if entry is None or entry.problem:
            return
        self.marked = entry
        self._say(f"A = {entry.run_id}; move to another run and press c to compare", "bold")

    def action_compare(self) -> None:
        entry = self.selected()
        if entry is None or entry.problem:
            return
        if self.marked is None:
            self._say("mark run A first (m), then compare it with the run under the cursor (c)")
            return
        self._open_compare(self.marked, entry)

    def action_compare_last(self) -> None:
        """The run under the cursor against the run of the same preset on the same target
        that came before it."""
        entry = self.selected()
        if entry is None or entry.problem:
            return
        before = previous_run(self.entries, entry)
        if before is None:
            self._say(f"no earlier finished run of {entry.preset} on {entry.target}", "yellow")
            return
        self._open_compare(before, entry)

    def _open_compare(self, a: RunEntry, b: RunEntry) -> None:
        from console.screens.compare import CompareScreen

        self.app.push_screen(CompareScreen(a.local_dir, b.local_dir))

    # -- trends of the selected run's preset (analysis/trends.py) ----------------------------

    def action_trends(self) -> None:
        pane = self.query_one("#history-trends")
        entry = self.selected()
        if pane.has_class("shown") or entry is None or entry.problem:
            pane.remove_class("shown")
            return
        pane.add_class("shown")
        self.query_one("#trends-text", Static).update(
            Text(f"reading the runs of {entry.preset} ...", style="dim")
        )
        self.run_worker(self._trends(entry), group="trends", exclusive=True, exit_on_error=False)

    async def _trends(self, entry: RunEntry) -> None:
        lines = await asyncio.to_thread(trend_text, self.out_dir, entry.preset, entry.target)
        self.post_message(self.TrendsRead(lines))

    def on_history_screen_trends_read(self, message: TrendsRead) -> None:
        text = Text()
        for n, line in enumerate(message.lines):
            style = "bold yellow" if line.startswith("DRIFT:") or "DRIFTING" in line else ""
            text.append_text(plain(line, style))
            if n < len(message.lines) - 1:
                text.append("\n")
        self.query_one("#trends-text", Static).update(text)

    def action_focus_speed(self) -> None:
        self.query_one("#speed", Select).focus()

    def action_close(self) -> None:
        self.dismiss(None)
