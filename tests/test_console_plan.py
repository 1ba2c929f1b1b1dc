"""The console before and during a run: the plan shown before Start (with its read-only check),
long log lines wrapped (or scrolled with `w`), progress of long work."""

from __future__ import annotations

from pathlib import Path

from test_console import (  # noqa: F401  (home is a fixture)
    LOADED_S,
    SIZE,
    banner_text,
    home,
    out_dir,
    run_overrides,
    select_preset,
    wait_for,
    wait_for_banner,
    wait_for_screen,
)
from textual import events
from textual.widgets import TextArea

from console.app import create_app
from console.screens.plan import PlanScreen
from console.screens.presets import PresetsScreen
from console.screens.run import RunScreen
from console.widgets.progress import ProgressView
from console.widgets.run_log import CONTINUATION, RunLog
from runners.events import OutputLines, Progress

DATA = Path(__file__).resolve().parent / "data"


async def open_plan(pilot, name: str, overrides: list[str]) -> PlanScreen:  # noqa: ANN001
    screen = await select_preset(pilot, name)
    await pilot.press("ctrl+o")
    pasted = "\n".join(overrides)
    area = screen.query_one("#overrides", TextArea)
    area.post_message(events.Paste(pasted))
    await wait_for(pilot, lambda: pasted in area.text, LOADED_S, "the pasted overrides")
    await pilot.press("ctrl+l", "enter")  # Enter on a preset: its plan, nothing started
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, PlanScreen), 10, "the plan")
    return pilot.app.screen  # type: ignore[return-value]


async def test_the_plan_is_shown_before_start_checked_then_started(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        plan = await open_plan(pilot, "hello_command", run_overrides(home))
        lines = plan.lines()
        assert lines[0].startswith("plan: preset hello_command (command), 3 cells on local")
        assert "cell 2/3 (n=2)" in lines
        assert any(
            line.startswith("  command: sh -c ") and line.endswith(" hello 2") for line in lines
        )
        assert any(line == "  env:     HELLO_CELL=2" for line in lines)
        assert not out_dir(home).exists()  # nothing started, nothing written
        await pilot.press("c")
        checks = plan.query_one("#plan-checks")
        await wait_for(pilot, lambda: plan.checked is not None, 20, "the check")
        await wait_for(pilot, lambda: "check:" in str(checks.content), LOADED_S, "its lines")
        assert "check: the target is ready for this run" in str(checks.content)
        assert "lock: " in str(checks.content)
        assert any(line.startswith(f"  runs:        {home}/runs") for line in plan.lines())
        await pilot.press("ctrl+r")
        screen = await wait_for_banner(pilot, timeout=30)
        assert banner_text(screen).startswith("PASS  (exit 0)")


async def test_leaving_the_plan_starts_nothing(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home))
    async with app.run_test(size=SIZE) as pilot:
        await open_plan(pilot, "hello_command", run_overrides(home))
        await pilot.press("escape")
        await wait_for_screen(pilot, PresetsScreen)
        await pilot.press("ctrl+p")  # the plan again, from its key
        await wait_for(pilot, lambda: isinstance(app.screen, PlanScreen), 10, "the plan")
        await pilot.press("escape")
        await wait_for_screen(pilot, PresetsScreen)
        assert not app.screen.launching
        assert not out_dir(home).exists()


async def replay_screen(pilot, app) -> RunScreen:  # noqa: ANN001
    await wait_for(pilot, lambda: isinstance(app.screen, RunScreen), 10, "the run screen")
    screen = app.screen
    await wait_for(pilot, lambda: screen.model.finished is not None, 10, "the replay")
    return screen


async def test_long_log_lines_wrap_whole_and_scroll_when_unwrapped(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "hello_command_run", speed=0)
    long = "engine says: " + " ".join(f"word{i:03d}" for i in range(60)) + " END"
    async with app.run_test(size=SIZE) as pilot:
        screen = await replay_screen(pilot, app)
        log = screen.query_one("#log", RunLog)
        screen.buffer.append(
            OutputLines(cell=0, stream="stderr", lines=[long], file="f", end_offset=1)
        )
        await wait_for(pilot, lambda: any(long in line for line in log.lines()), 5, "the line")
        assert f"[1] ! {long}" in log.lines()
        width = log.log_widget.scrollable_content_region.width

        def wrapped_rows() -> bool:
            rows = log.rows()
            return any(r.startswith("[1] ! engine says:") for r in rows) and rows[
                -1
            ].rstrip().endswith("END")

        await wait_for(pilot, wrapped_rows, LOADED_S, "the line's rows, wrapped")
        rows = log.rows()
        start = rows.index(next(r for r in rows if r.startswith("[1] ! engine says:")))
        wrapped = [rows[start]] + [r for r in rows[start + 1 :] if r.startswith(CONTINUATION)]
        assert len(wrapped) > 2 and all(len(r) <= width for r in wrapped)
        rebuilt = wrapped[0] + "".join(r[len(CONTINUATION) :] for r in wrapped[1:])
        assert rebuilt == f"[1] ! {long}"  # every character shown, none cut
        await pilot.press("w")  # unwrapped: one row, the log scrolls sideways to its end
        await wait_for(pilot, lambda: f"[1] ! {long}" in log.rows(), LOADED_S, "one row")
        await wait_for(
            pilot,
            lambda: log.log_widget.virtual_size.width >= len(f"[1] ! {long}"),
            LOADED_S,
            "the log as wide as the line",
        )


async def test_progress_of_long_work_shows_while_it_lasts(home: Path) -> None:  # noqa: F811
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "hello_command_run", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await replay_screen(pilot, app)
        view = screen.query_one("#progress", ProgressView)
        assert not view.display
        fetch = Progress(
            what="fetch",
            label="runs/x/logits.jsonl.gz",
            done=3 << 20,
            total=12 << 20,
            unit="bytes",
            rate=1 << 20,
            eta_s=9,
        )
        screen.buffer.append(fetch)
        await wait_for(pilot, lambda: view.display, 5, "the progress line")
        assert view.shown == [
            "fetch runs/x/logits.jsonl.gz: 3.0 MiB of 12.0 MiB (25%), 1.0 MiB/s, ETA 9s"
        ]
        screen.buffer.append(
            Progress(
                what="fetch",
                label=fetch.label,
                done=12 << 20,
                total=12 << 20,
                unit="bytes",
                finished=True,
            )
        )
        await wait_for(pilot, lambda: not view.display, 5, "the progress line to go")
