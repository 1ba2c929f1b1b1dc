"""Cancelling a run: what `tracedeck cancel` and the runs screen's cancel both do."""

from __future__ import annotations

import time
from pathlib import Path


async def cancel_run(local: Path, grace: float, printer, say=print) -> int:  # type: ignore[no-untyped-def]
    """Kill every live process of the run, whatever its record says, then record its end
    (unless the console that follows it does that); say(line) tells how it ended."""
    from runners.launchers.base import Cancel
    from runners.record import RecordBusy, record_writer
    from runners.run import Run

    session = Run.from_record(local, printer)
    asked = time.time()
    try:
        outcome = await session.cancel(grace)
    finally:
        await session.close()
    word = outcome.removeprefix("TRACEDECK_").lower().replace("_", " ") or "sent"
    run_id = session.record.run_id
    try:
        attached = Run.attach(local, printer, replay=printer.track)
    except RecordBusy:
        writer = record_writer(local)
        if writer is not None and writer[1] in ("T", "t"):  # it records nothing while stopped
            say(
                f"cancel: {word}; the console following run {run_id} (pid {writer[0]}) is "
                f"stopped (a Ctrl-Z?): it records the run's end once it goes on (`fg` in its "
                f"terminal, or kill -CONT {writer[0]})"
            )
        else:
            say(f"cancel: {word}; the console following run {run_id} records its end")
        return 0
    try:
        if attached.finished is not None:
            ended = attached.finished
            if ended.t >= asked:  # the console that followed it recorded the cancel
                say(f"cancel: {word}; run {run_id} ended {ended.verdict}")
            elif outcome == Cancel.NOT_RUNNING:
                say(f"cancel: nothing was running; run {run_id} had ended {ended.verdict}")
            else:
                say(f"cancel: {word} processes left over after run {run_id} ended {ended.verdict}")
            return 0
        result = await attached.follow()
    finally:
        await attached.close()
    say(f"cancel: {word}; run {run_id} ended {result.verdict}")
    return 0
