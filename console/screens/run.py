"""The run screen: header, banner, the run kind's panel, cells and the live log."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.screen import Screen
from textual.worker import Worker, WorkerState

from console.heap import freeze_screen, thaw_screen
from console.panel import KindPanel
from console.panels import panel_for
from console.run_model import RunModel
from console.screens.dialogs import ConfirmDialog, HostKeyDialog
from console.screens.sources import (
    AttachSource,
    LiveSource,
    ReplayClock,
    ReplaySource,
    RunSource,
    is_fast,
    replay_events,
)
from console.widgets.banner import VerdictBanner
from console.widgets.cells_table import CellsTable
from console.widgets.hosts_line import HostsLine
from console.widgets.progress import ProgressView
from console.widgets.run_header import RunHeader
from console.widgets.run_log import RunLog
from console.widgets.steady import SteadyFooter
from runners.events import Error, Event
from runners.kinds import event_types
from runners.presets import PresetError
from runners.record import RecordBusy, recorded_count
from runners.run import Run, fetch_held_into
from runners.targets.base import HostKeyUnknown, TargetError
from runners.trust import trust_host
from runners.viewer import skipping, view

TICK_HZ = 15
# Per tick, events are applied for at most this long; the rest waits for the next tick so
# the screen keeps drawing while a big batch (an attach, a fast replay) goes in.
BUDGET_S = 0.035
TABLES_EVERY_S = 0.25
BUFFER_HIGH = 20_000
# A replay decodes this far ahead of the screen (a few ticks' worth), not the whole record.
REPLAY_AHEAD = 10_000


class RunScreen(Screen[None]):
    """Drains the event buffer on a timer into a RunModel and redraws only what changed."""

    BINDINGS = [
        Binding("escape", "leave", "Back (run goes on)"),
        Binding("escape", "back", "Back"),
        Binding("c", "cancel_run", "Cancel run"),
        Binding("d", "details", "Details"),
        Binding("f", "filter_log", "Filter log"),
        Binding("slash", "search_log", "Search log"),
        Binding("n", "next_match", "Next match", show=False),
        Binding("N", "next_match(False)", "Previous match", show=False),
        Binding("w", "wrap_log", "Wrap log"),
        Binding("g", "fetch_held", "Fetch held files"),
    ]

    class HostKeyNeeded(Message):
        def __init__(self, error: HostKeyUnknown) -> None:
            super().__init__()
            self.error = error

    class Notice(Message):
        """Something a worker wants the operator to read (a cancel's outcome, a failure)."""

        def __init__(self, text: str, severity: str = "information") -> None:
            super().__init__()
            self.text = text
            self.severity = severity

    def __init__(self, source: RunSource) -> None:
        super().__init__()
        self.source = source
        self.model = RunModel()
        self.buffer: deque[Event] = source.buffer if isinstance(source, LiveSource) else deque()
        self.session: Run | None = source.session if isinstance(source, LiveSource) else None
        self.clock = ReplayClock()
        self.ticks: list[tuple[float, float]] = []  # (start, end) of each drain, for the bench
        self.record_ticks = False
        self._feed: Worker[None] | None = None
        self._header_key: tuple[object, ...] = ()
        self._pending_cells: dict[int, None] = {}
        self._tables_shown = 0.0
        self._log_shown = 0.0
        self._log_pending = 0  # lines in the model not yet written to the log
        self._feed_ended = False
        self._stopped = False
        self._status = ""
        self._bindings_shown: tuple[bool | None, ...] = ()
        self.panel: KindPanel = panel_for(source.kind)

    # -- layout -----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield RunHeader(self.source.mode, id="run-header")
        yield VerdictBanner(id="banner")
        yield HostsLine(id="hosts")
        yield ProgressView(id="progress")
        yield self.panel
        with Horizontal(id="run-bottom"):
            yield CellsTable(id="cells")
            yield RunLog(id="log")
        yield SteadyFooter()

    def on_mount(self) -> None:
        self.set_interval(1 / TICK_HZ, self.drain)
        self.query_one("#cells", CellsTable).focus()
        # The footer composes with what is offered now: the first tick does not rebuild it.
        self._bindings_shown = self._bindings_state()
        self._start_feed()
        self.call_after_refresh(freeze_screen)

    def on_unmount(self) -> None:
        if self.app.is_running:  # (not while the app shuts down: it thaws everything then)
            thaw_screen()

    def _start_feed(self) -> None:
        source = self.source
        if isinstance(source, LiveSource):
            self._feed = self.run_worker(
                self._feed_follow(source.session), group="feed", exclusive=True, exit_on_error=False
            )
        elif isinstance(source, AttachSource):
            self._feed = self.run_worker(
                self._feed_attach(source.local_dir),
                group="feed",
                exclusive=True,
                exit_on_error=False,
            )
        else:
            self._feed = self.run_worker(
                self._feed_replay(source), group="feed", exclusive=True, exit_on_error=False
            )

    # -- workers: they only append to the buffer or post messages ------------------------------

    async def _feed_follow(self, session: Run, offer_trust: bool = False) -> None:
        # Backpressure: the session reads no further while this many events wait to be drawn.
        session.pressure = lambda: len(self.buffer) > BUFFER_HIGH
        try:
            await session.follow()
        except HostKeyUnknown as exc:
            if offer_trust:
                self.post_message(self.HostKeyNeeded(exc))
            else:
                self.buffer.append(Error(message=str(exc), where=session.target_name))
        except TargetError as exc:
            self.buffer.append(Error(message=str(exc), where=session.target_name))
        finally:
            with contextlib.suppress(Exception):
                await session.close()

    async def _feed_attach(self, local_dir: Path, replay: bool = True) -> None:
        """Reattach as the record's writer; while another console writes it, view it read-only
        and take the writing over if that console goes."""
        # Events of the record already in the model (a first attempt replayed them) are skipped.
        shown = 0 if replay else await asyncio.to_thread(recorded_count, local_dir, event_types())
        while True:
            try:
                session = await asyncio.to_thread(
                    Run.attach,
                    local_dir,
                    self.buffer.append,
                    skipping(self.buffer.append, shown),
                )
            except RecordBusy:
                if shown == 0:
                    self.post_message(
                        self.Notice(
                            "another console follows this run and writes its record: viewing "
                            "it read-only; this console takes over if that one goes"
                        )
                    )
                finished, count = await view(local_dir, skipping(self.buffer.append, shown))
                if finished is not None:
                    return
                shown = count
                continue
            except (FileNotFoundError, ValueError, KeyError, TypeError, PresetError) as exc:
                self.buffer.append(Error(message=f"cannot reattach: {exc}", where=str(local_dir)))
                return
            break
        self.session = session
        await self._feed_follow(session, offer_trust=True)

    async def _feed_replay(self, source: ReplaySource) -> None:
        await replay_events(
            source.local_dir,
            self.buffer.append,
            source.speed,
            self.clock,
            pressure=lambda: len(self.buffer) > REPLAY_AHEAD,
        )

    async def _trust_and_follow(self, error: HostKeyUnknown) -> None:
        try:
            await trust_host(error.host, error.port, expected_fingerprint=error.fingerprint)
        except (TargetError, OSError) as exc:
            self.buffer.append(Error(message=str(exc), where=error.host))
            return
        if isinstance(self.source, AttachSource):
            # The first attempt already replayed the record into the model.
            await self._feed_attach(self.source.local_dir, replay=False)

    async def _cancel(self, session: Run) -> None:
        try:
            outcome = await session.cancel()
        except TargetError as exc:
            self.post_message(self.Notice(str(exc), "error"))
            return
        word = outcome.removeprefix("TRACEDECK_").lower().replace("_", " ") or "sent"
        self.post_message(self.Notice(f"cancel: {word}; the run's end will show here"))

    # -- the tick ---------------------------------------------------------------------------

    def now(self) -> float | None:
        """The run's clock: wall time when live, the recording's time when replaying."""
        if isinstance(self.source, ReplaySource):
            paced = None if is_fast(self.source.speed) else self.clock.now()
            return paced if paced is not None else self.model.last_t
        return time.time()

    def drain(self) -> None:
        """Apply what the workers buffered (within a time budget), then redraw what changed."""
        started = time.perf_counter()
        buffer, model = self.buffer, self.model
        if buffer:
            deadline = time.perf_counter() + BUDGET_S
            n = 0
            panel = self.panel
            while buffer:
                event = buffer.popleft()
                model.apply(event)
                panel.fold(event)
                n += 1
                if not n & 255 and time.perf_counter() > deadline:
                    break
        self.show_changes()
        if self.record_ticks:
            self.ticks.append((started, time.perf_counter()))

    def show_changes(self) -> None:
        model = self.model
        changes = model.take_changes()
        self._pending_cells.update(changes.cells)
        # While a backlog drains (attach, fast replay) tables redraw a few times a second only:
        # any change re-renders a whole DataTable.
        now = time.perf_counter()
        backlog = bool(self.buffer) or self._fast_feed_running()
        if not backlog or model.finished or now - self._tables_shown >= TABLES_EVERY_S:
            self._tables_shown = now
            self._show_tables()
        # The log too: a backlog's lines (thousands a tick, most pushed out of the log's
        # scrollback by the next tick's) are written a few times a second, the newest kept.
        self._log_pending += changes.log_new
        if self._log_pending and (
            not backlog or model.finished or now - self._log_shown >= TABLES_EVERY_S
        ):
            self._log_shown = now
            count, self._log_pending = self._log_pending, 0
            self.query_one("#log", RunLog).show_new(model, count)
        if changes.hosts:
            self.query_one("#hosts", HostsLine).show(model)
        if changes.progress:
            self.query_one("#progress", ProgressView).show(model.progress)
        status = self.panel.status()
        if changes.cells or changes.finished or status != self._status:
            self._status = status
            self.query_one("#banner", VerdictBanner).show(model, status)
        # cancel goes away at the end; details come with the panel; fetch with held files. The
        # footer is rebuilt (tens of ms) only when what it shows changes.
        shown = self._bindings_state()
        if shown != self._bindings_shown:
            self._bindings_shown = shown
            self.refresh_bindings()
        if self._feed_ended and not self.buffer and model.finished is None and not self._stopped:
            self._stopped = True
            self._show_stopped()
        self._show_header(
            force=bool(
                changes.header
                or changes.cells
                or changes.errors
                or changes.connection
                or changes.finished
            )
        )

    def _fast_feed_running(self) -> bool:
        source = self.source
        return (
            isinstance(source, ReplaySource)
            and is_fast(source.speed)
            and self._feed is not None
            and self._feed.is_running
        )

    def _show_tables(self) -> None:
        model = self.model
        if self._pending_cells:
            cells, self._pending_cells = self._pending_cells, {}
            self.query_one("#cells", CellsTable).show(model, cells)
            self.query_one("#log", RunLog).update_filter_options(model)
        self.panel.show_changes(finished=model.finished is not None)

    def _show_header(self, force: bool) -> None:
        now = self.now()
        elapsed = self.model.elapsed(now)
        key = (int(elapsed) if elapsed is not None else None,)
        if force or key != self._header_key:
            self._header_key = key
            self.query_one("#run-header", RunHeader).show(self.model, now)

    # -- actions ----------------------------------------------------------------------------

    def run_goes_on(self) -> bool:
        """Whether leaving this screen leaves a run going that this console follows."""
        return not isinstance(self.source, ReplaySource) and self.model.finished is None

    def _bindings_state(self) -> tuple[bool | None, ...]:
        """Which of the screen's actions the footer offers now."""
        return tuple(self.check_action(b.action, ()) for b in self.BINDINGS)  # type: ignore[union-attr]

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "leave":
            return self.run_goes_on()
        if action == "back":
            return not self.run_goes_on()
        if action == "cancel_run":
            return self.session is not None and self.model.finished is None
        if action == "details":
            return self.panel.has_detail()
        if action == "fetch_held":
            return bool(self.model.held) and not isinstance(self.source, ReplaySource)
        return True

    async def stop_following(self) -> None:
        """Stop following (the run goes on on its target) and close the session."""
        feed = self._feed
        if feed is not None and feed.is_running:
            feed.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await feed.wait()

    async def action_back(self) -> None:
        await self.action_leave()

    async def action_leave(self) -> None:
        await self.stop_following()
        if self.session is not None and self.model.finished is None:
            self.notify(
                f"the run goes on on its target; reopen it from History (F2) to "
                f"reattach: {self.session.local_dir}",
                timeout=8,
                markup=False,
            )
        self.dismiss(None)

    def action_cancel_run(self) -> None:
        session = self.session
        if session is None or self.model.finished is not None:
            return
        question = (
            f"Cancel run {session.record.run_id} on {session.target_name}? Its processes "
            f"get TERM, then KILL after a grace period (a Slurm job: scancel)."
        )

        def answered(yes: bool | None) -> None:
            if yes and self.session is not None:
                self.run_worker(self._cancel(self.session), group="cancel", exit_on_error=False)

        self.app.push_screen(ConfirmDialog(question, yes="Cancel the run", no="Keep it"), answered)

    def action_details(self) -> None:
        screen = self.panel.detail()
        if screen is not None:
            self.app.push_screen(screen)

    def action_fetch_held(self) -> None:
        if self.model.held:
            self.run_worker(self._fetch_held(), group="fetch", exit_on_error=False)

    async def _fetch_held(self) -> None:
        """What the run judged on its host and left there, brought home and recorded: by the
        session that follows it, or (once it has ended) as the record's writer."""
        session = self.session
        try:
            if session is not None and self.model.finished is None:
                count = await session.fetch_held()
            else:
                count = await fetch_held_into(Path(self.model.header.local_dir), self.buffer.append)
        except (TargetError, RecordBusy, OSError) as exc:
            self.post_message(self.Notice(f"fetch: {exc}", "error"))
            return
        self.post_message(
            self.Notice(f"fetched {count} file(s) into {self.model.header.local_dir}")
        )

    def action_filter_log(self) -> None:
        self.query_one("#log-filter").focus()

    def action_search_log(self) -> None:
        self.query_one("#log", RunLog).open_search()

    def action_next_match(self, forward: bool = True) -> None:
        log = self.query_one("#log", RunLog)
        self.notify(log.search(forward), timeout=3, markup=False)

    def action_wrap_log(self) -> None:
        log = self.query_one("#log", RunLog)
        log.set_wrap(not log.wrap)
        self.notify(
            "long log lines wrap" if log.wrap else "long log lines scroll sideways",
            timeout=3,
        )

    # -- messages from workers -----------------------------------------------------------------

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.worker is not self._feed:
            return
        if event.state == WorkerState.ERROR:
            error = event.worker.error
            self.buffer.append(
                Error(
                    message=f"the console stopped following: {type(error).__name__}: {error}",
                    where="console",
                )
            )
        if event.state in (WorkerState.SUCCESS, WorkerState.ERROR):
            self._feed_ended = True  # judged once the buffer it filled has gone in

    def _show_stopped(self) -> None:
        if isinstance(self.source, ReplaySource):
            text = (
                "UNFINISHED: the record ends before the run did; reopen it from History (F2) "
                "to reattach and follow it on its target"
            )
        else:
            text = (
                "NOT FOLLOWING: following stopped before the run ended (see the errors in the "
                "log); the run may go on on its target: reopen it from History (F2)"
            )
        self.query_one("#banner", VerdictBanner).show_stopped(text)

    def on_run_screen_host_key_needed(self, message: HostKeyNeeded) -> None:
        error = message.error

        def answered(trust: bool | None) -> None:
            if trust:
                self._feed_ended = self._stopped = False
                self._feed = self.run_worker(
                    self._trust_and_follow(error), group="feed", exclusive=True, exit_on_error=False
                )
            else:
                self.buffer.append(Error(message=f"{error}; not trusted", where=error.host))

        self.app.push_screen(HostKeyDialog(error), answered)

    def on_run_screen_notice(self, message: Notice) -> None:
        self.notify(message.text, severity=message.severity, markup=False)  # type: ignore[arg-type]
