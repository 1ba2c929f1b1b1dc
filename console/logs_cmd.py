"""`tracedeck logs RUN [-f] [--cell N]`: a run's output lines, as `tail` would show them.

Without -f: what the record holds, then exit 0. With -f: the record, then the run followed on
its target to its end (as `attach` follows it, or read-only while another console writes its
record), exiting with the run's exit code. Ctrl-C stops following and leaves the run going.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import TextIO

from console.safe_text import clean
from runners.cells import SETUP_CELL
from runners.events import Error, Event, OutputLines, RunFinished, RunStarted
from runners.exits import EXIT_INFRA, EXIT_INTERRUPT, EXIT_USAGE

OUT_HELP = "local run records root (default: ~/.local/share/tracedeck/runs)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    logs = sub.add_parser(
        "logs",
        help="print a run's output lines; -f follows a live run to its end (exit: the run's)",
    )
    logs.add_argument("run", help="local run directory or run id")
    logs.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="after the recorded lines, follow the run on its target to its end and exit with "
        "its exit code (Ctrl-C stops following; the run goes on)",
    )
    logs.add_argument(
        "--cell",
        type=int,
        metavar="N",
        help="only cell N's lines (numbered from 1, as the console and `run` number them; 0: "
        "the setup step)",
    )
    logs.add_argument("--out", type=Path, help=OUT_HELP)


class LogPrinter:
    """Output lines, each tagged with its cell unless one cell was asked for; errors and the
    run's end go to stderr, so stdout holds the run's own lines only."""

    def __init__(self, cell: int | None, out: TextIO = sys.stdout, err: TextIO = sys.stderr):
        self.cell = cell  # the cell's index (0-based; SETUP_CELL for the setup step), or None
        self.out, self.err = out, err
        self.total = 0
        self.cells_known: set[int] = set()
        self.finished: RunFinished | None = None
        self.lines = 0

    def tag(self, cell: int) -> str:
        if cell == SETUP_CELL:
            return "[setup] "
        return f"[{cell + 1}/{self.total}] " if self.total else f"[{cell + 1}] "

    def __call__(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.total = len(event.cells)
            self.cells_known = {int(c["index"]) for c in event.cells} | {SETUP_CELL}
        elif isinstance(event, OutputLines):
            if self.cell is not None and event.cell != self.cell:
                return
            prefix = "" if self.cell is not None else self.tag(event.cell)
            for line in event.lines:  # shown, not replayed into the terminal: escapes replaced
                self.out.write(f"{prefix}{clean(line)}\n")
            self.lines += len(event.lines)
            self.out.flush()
        elif isinstance(event, Error):
            self.err.write(
                f"tracedeck logs: error at {clean(event.where)}: {clean(event.message)}\n"
            )
        elif isinstance(event, RunFinished):
            self.finished = event
            self.err.write(
                f"tracedeck logs: the run ended: {event.verdict} (exit {event.exit_code})\n"
            )


def cmd_logs(args: argparse.Namespace) -> int:
    from console.run_lookup import find_run
    from runners.kinds import event_types
    from runners.record import EVENTS, read_events
    from runners.targets.base import TargetError

    if args.cell is not None and args.cell < 0:
        print(f"tracedeck: --cell {args.cell}: cells are numbered from 1", file=sys.stderr)
        return EXIT_USAGE
    cell = None if args.cell is None else (SETUP_CELL if args.cell == 0 else args.cell - 1)
    printer = LogPrinter(cell)
    try:
        local = find_run(args.run, args.out)
        if args.follow:
            code = asyncio.run(_follow(local, printer))
        else:
            for event in read_events(local / EVENTS, event_types()).events:
                printer(event)
            code = 0
    except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
        print(f"tracedeck: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TargetError as exc:
        print(f"tracedeck: {exc}", file=sys.stderr)
        return EXIT_INFRA
    if cell is not None and printer.cells_known and cell not in printer.cells_known:
        print(
            f"tracedeck: --cell {args.cell}: run has cells 1..{printer.total} (0: setup)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return code


async def _follow(local: Path, printer: LogPrinter) -> int:
    """The record, then the run to its end: as its record's writer, or read-only while
    another console writes it (taking the writing over if that one goes)."""
    from runners.record import RecordBusy
    from runners.run import Run
    from runners.viewer import skipping, view

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def on_sigint() -> None:
        print(
            f"tracedeck logs: stopped following; the run goes on (tracedeck logs -f {local} "
            "to follow it again)",
            file=sys.stderr,
        )
        task.cancel()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    shown = 0
    try:
        while True:
            try:
                session = Run.attach(local, printer, replay=skipping(printer, shown))
            except RecordBusy:
                finished, shown = await view(local, skipping(printer, shown))
                if finished is not None:
                    return finished.exit_code
                continue
            try:
                result = await session.follow()
            finally:
                await session.close()
            return result.exit_code
    except asyncio.CancelledError:
        return EXIT_INTERRUPT
    finally:
        loop.remove_signal_handler(signal.SIGINT)
