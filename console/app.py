"""The Textual console: one app factory shared by the CLI and the tests."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from textual.app import App
from textual.binding import Binding
from textual.screen import Screen

from console.heap import freeze_startup, thaw_all
from console.panels import detail_screens
from console.screens.compare import CompareScreen
from console.screens.dialogs import ConfirmDialog, HostKeyDialog
from console.screens.help import HelpScreen
from console.screens.history import HistoryScreen
from console.screens.plan import PlanScreen
from console.screens.presets import PresetsScreen
from console.screens.run import RunScreen
from console.screens.runs import Collect, RunsScreen
from console.screens.sources import ReplaySource
from runners.local_run import default_out_dir
from runners.presets import preset_files
from runners.record import EVENTS


class TracedeckApp(App[int]):
    """Presets first; Run, Traces, History and Help screens on top of it."""

    CSS_PATH = "app.tcss"
    TITLE = "tracedeck"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", priority=True),
        Binding("f1", "help", "Help"),
        Binding("question_mark", "help", "Help", show=False),
        Binding("f2", "history", "History"),
        Binding("f3", "runs", "Runs"),
    ]

    def __init__(
        self,
        out_dir: Path,
        replay_dir: Path | None = None,
        speed: float = 1.0,
        preset_paths: list[Path] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.clock = clock  # "now" for what the console computes from the time (elapsed)
        self.replay_dir = replay_dir
        self.speed = speed
        self.preset_paths = preset_paths
        # Said on the terminal after the console closes: runs left going and how to reattach.
        self.quit_notes: list[str] = []
        # The hosts whose locks the Runs screen shows (None: the configured ones); tests set it.
        self.runs_hosts: list[str] | None = None
        # How the Runs screen collects (None: runners.status.collect); tests pin volatile values.
        self.runs_collect: Collect | None = None

    def get_default_screen(self) -> Screen:
        paths = self.preset_paths if self.preset_paths is not None else preset_files()
        return PresetsScreen(self.out_dir, paths)

    def on_mount(self) -> None:
        freeze_startup()
        if self.replay_dir is not None:
            self.push_screen(RunScreen(ReplaySource(self.replay_dir, self.speed)))

    def on_unmount(self) -> None:
        thaw_all()

    def help_screens(self) -> list[tuple[str, type]]:
        return [
            ("presets", PresetsScreen),
            ("plan", PlanScreen),
            ("run", RunScreen),
            *((f"{kind} details", screen) for kind, screen in detail_screens()),
            ("history", HistoryScreen),
            ("compare", CompareScreen),
            ("runs", RunsScreen),
            ("help", HelpScreen),
            ("confirm dialog", ConfirmDialog),
            ("host key dialog", HostKeyDialog),
        ]

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_history(self) -> None:
        if isinstance(self.screen, HistoryScreen):
            return
        for screen in self.screen_stack:
            if isinstance(screen, HistoryScreen):
                return  # already open below: escape goes back to it
        self.push_screen(HistoryScreen(self.out_dir))

    def action_runs(self) -> None:
        if not any(isinstance(screen, RunsScreen) for screen in self.screen_stack):
            self.push_screen(RunsScreen(self.out_dir, self.runs_hosts, self.runs_collect))

    async def action_quit(self) -> None:
        # Quitting never cancels a run: stop following, close sessions, leave runs going.
        for screen in self.screen_stack:
            if isinstance(screen, RunScreen):
                if screen.run_goes_on():
                    self.quit_notes.append(left_going(screen))
                await screen.stop_following()
        self.exit(0)


def left_going(screen: RunScreen) -> str:
    """What quitting leaves behind: a run that goes on on its target, and how to get back to it."""
    header = screen.model.header
    where = header.local_dir or "its run directory"
    return (
        f"run {header.run_id or '?'} ({header.preset or '?'}) goes on on {header.target or '?'}; "
        f"follow it: tracedeck attach {where} (or reopen it from History, F2); "
        f"stop it: tracedeck cancel {where}"
    )


def create_app(
    out_dir: Path | None = None,
    replay_dir: Path | None = None,
    speed: float = 1.0,
    *,
    preset_paths: list[Path] | None = None,
    clock: Callable[[], float] = time.time,
) -> TracedeckApp:
    """The console app; `replay_dir` opens the Run screen on that recorded run directly.

    preset_paths replaces the shipped and user presets (tests use it for a fixed list); clock
    gives "now" (tests pin it, so that an elapsed time is the same on every run of them).
    """
    return TracedeckApp(
        out_dir=Path(out_dir) if out_dir is not None else default_out_dir(),
        replay_dir=Path(replay_dir) if replay_dir is not None else None,
        speed=speed,
        preset_paths=preset_paths,
        clock=clock,
    )


def run_app(out_dir: Path | None = None, replay_dir: Path | None = None, speed: float = 1.0) -> int:
    """Run the console until the operator quits; returns the process exit code."""
    if replay_dir is not None and not (Path(replay_dir) / EVENTS).is_file():
        print(
            f"tracedeck: {Path(replay_dir) / EVENTS}: no recorded events; pass a run "
            f"directory written by `tracedeck run`",
            file=sys.stderr,
        )
        return 2
    app = create_app(out_dir=out_dir, replay_dir=replay_dir, speed=speed)
    app.run()
    for note in app.quit_notes:
        print(f"tracedeck: {note}", file=sys.stderr)
    return app.return_code or 0
