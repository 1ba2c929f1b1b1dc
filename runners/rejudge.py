"""`tracedeck analyze` on a run's directory: the run's recorded verdict is never rewritten, and
a kind can re-judge the run from what it kept.

Two things every kind shares live here, once:

- guard_record: a run directory's own documents (its summary, its events) are what the run
  said; a later analyze writes its documents elsewhere (a sibling directory named after the run
  and the time, unless --output names one) and says so, and refuses --output naming the run's
  own directory;
- rejudge: the run's own judge rebuilt from its record (run.json, plan), fed the record's cell
  ends, fetched artifacts and errors, and then what the kind reads from the kept raw data (a
  kind passes `feed`); its verdict is the re-judgement, compared by the caller with the one
  the run recorded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from runners.events import Error, Event, RunFinished, TraceBatch
from runners.kind import ENDINGS, Ending, Judge
from runners.kinds import event_types
from runners.record import EVENTS, RUN_JSON, read_events

ANALYZE_DIR = "{name}.analyze-{stamp}"


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and (path / RUN_JSON).is_file()


def run_dir_holding(path: Path) -> Path | None:
    """The run directory that is path or holds it (links and '..' resolved), or None."""
    resolved = path.resolve()
    return next((p for p in (resolved, *resolved.parents) if is_run_dir(p)), None)


def guard_record(path: Path, output: Path | None) -> tuple[str, Path | None]:
    """Keep a run directory's recorded verdict: point --output elsewhere when path is a run's
    directory and none was named. Returns (a refusal, or a note starting with 'note: ' for the
    caller to say, or ''; the output to use). Whatever is analyzed, --output may name no run's
    directory nor a place inside one (that run's record is not this analyze's)."""
    if output is not None:
        if is_run_dir(path) and Path(output).resolve() == path.resolve():
            return (
                f"--output {output}: that is the run's own directory; analyze never rewrites a "
                "run's recorded verdict: name another directory"
            ), output
        held = run_dir_holding(Path(output))
        if held is not None:
            return (
                f"--output {output}: that is inside the run's directory {held}; analyze never "
                "rewrites a run's recorded verdict: name a directory outside every run's"
            ), output
        return "", output
    if not is_run_dir(path):
        return "", None
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    output = path.parent / ANALYZE_DIR.format(name=path.name, stamp=stamp)
    return (
        f"note: {path} is a run's directory: its recorded verdict stays as the run wrote it; "
        f"whatever this analyze writes goes to {output} (--output names another place)"
    ), output


@dataclass
class Rejudged:
    """A run judged again: the new result, the recorded one, and what could not be re-read."""

    result: RunFinished
    recorded: RunFinished | None
    events: list[Event] = field(default_factory=list)


def recorded_ending(recorded: RunFinished | None) -> Ending:
    """How the run ended, from its recorded verdict word (a cut-short run stays cut short)."""
    if recorded is not None:
        for how, (word, _) in ENDINGS.items():
            if recorded.verdict == word:
                return Ending(how, str(recorded.summary.get("error", "")))
    return Ending("done")


def rejudge(run_dir: Path, feed: Callable[[Judge, list[Event]], None]) -> Rejudged:
    """The run's own judge over its record, fed the kept raw data by `feed`.

    Recorded trace digests are not folded (feed reads the kept lines instead), nor the errors
    they raised (feed raises them again from the same lines), nor the kind's own verdict
    events (advance judges again). ValueError when the record cannot be read or rebuilt.
    """
    from runners.run import Run

    events = (
        read_events(run_dir / EVENTS, event_types()).events if (run_dir / EVENTS).is_file() else []
    )
    emitted: list[Event] = []
    try:
        session = Run.from_record(run_dir, emitted.append)
    except (OSError, KeyError, TypeError) as exc:
        raise ValueError(f"{run_dir}: the run's record cannot be rebuilt ({exc})") from None
    judge = getattr(session, "judge", None)
    if judge is None:
        raise ValueError(f"{run_dir}: this run's record holds no judge to run again")
    judge.ctx.host = None  # judged here, from what the run kept
    judge.ctx.hosts.clear()
    followed = {e.file for e in events if isinstance(e, TraceBatch)}
    recorded: RunFinished | None = None
    for e in events:
        if isinstance(e, RunFinished):
            recorded = e
            continue
        if isinstance(e, TraceBatch) or type(e).__module__.startswith("runners.kinds"):
            continue
        if isinstance(e, Error) and any(e.where.startswith(f + ":") for f in followed):
            continue
        judge.fold(e)
    feed(judge, events)
    asyncio.run(judge.advance())
    for e in emitted:
        judge.fold(e)
    return Rejudged(judge.finish(recorded_ending(recorded)), recorded, events)
