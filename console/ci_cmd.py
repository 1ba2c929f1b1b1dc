"""CI output of run, replay and analyze: --junit FILE, --summary-md FILE, and [notify]."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from runners.exits import EXIT_USAGE


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--junit",
        type=Path,
        metavar="FILE",
        help="write JUnit XML: one testcase per pair / cell / prompt / DSA shard, failures "
        "carrying the first-fail text",
    )
    parser.add_argument(
        "--summary-md",
        type=Path,
        metavar="FILE",
        help="write a short markdown summary (e.g. $GITHUB_STEP_SUMMARY)",
    )


def _err(message: str) -> None:
    print(f"tracedeck: {message}", file=sys.stderr)


def report_paths_problem(args: argparse.Namespace) -> str:
    """Why a --junit / --summary-md path cannot be written ('' when it can): never over or
    inside a run's directory (its run.json, events: that run's record, not a report's place)."""
    from runners.rejudge import run_dir_holding

    for flag, path in (("--junit", args.junit), ("--summary-md", args.summary_md)):
        if path is None:
            continue
        held = run_dir_holding(Path(path).parent)  # the name itself: replaced, never followed
        if held is not None:
            return (
                f"{flag} {path}: inside the run's directory {held}; a report is never written "
                "into a run's record: name a file outside every run's directory"
            )
    return ""


def write_reports(args: argparse.Namespace, local_dir: Path, side: Any = None) -> bool:
    """Write the reports asked for from the run's record (or `side`, a run that left none);
    False (said on stderr) when they could not be written."""
    junit, summary = getattr(args, "junit", None), getattr(args, "summary_md", None)
    if junit is None and summary is None:
        return True
    from analysis.ci_report import junit_xml, summary_markdown
    from runners.atomic import write_atomic
    from runners.run_view import load_side

    problem = report_paths_problem(args)
    if problem:
        _err(f"{problem}; the CI reports were not written")
        return False
    try:
        side = side or load_side(local_dir)
    except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
        _err(f"cannot write the CI reports: {exc}")
        return False
    for path, text in ((junit, junit_xml(side)), (summary, summary_markdown(side))):
        if path is None:
            continue
        try:
            write_atomic(path, text)
        except OSError as exc:
            _err(f"{path}: cannot write it ({exc.strerror})")
            return False
    return True


def after_run(args: argparse.Namespace, session: Any, code: int) -> int:
    """Once a headless run has ended, however it ended (a verdict, a host that could not be
    reached, a busy lock): its reports, then the operator's [notify] command."""
    from runners.config import ConfigError, load_config
    from runners.notify import run_notify
    from runners.record import RUN_JSON
    from runners.run_view import load_side

    local = Path(session.local_dir)
    recorded = (local / RUN_JSON).is_file()
    # a run that left no record (refused by a busy lock, never started) still has its reports
    # said: never a green one left from an earlier run at the same paths
    wrote = write_reports(args, local, None if recorded else _unrecorded(session, code))
    if not wrote:  # a report asked for and not written: no exit 0 (as replay and analyze)
        code = code or EXIT_USAGE
    try:
        config = load_config()
    except ConfigError as exc:
        _err(f"{exc}; nobody was notified")
        return code
    if not (config.get("notify") or {}).get("command"):
        return code
    run_id, preset = session.record.run_id, session.record.preset
    verdict = "NOT_STARTED"  # the launch failed before the run had a record of its end
    if recorded:
        try:
            verdict = load_side(local).verdict or "NOT_FINISHED"
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            verdict = "NOT_FINISHED"
    report: Path | str = local if recorded else "-"
    asked = getattr(args, "summary_md", None) or getattr(args, "junit", None)
    if wrote and asked:
        report = asked
    problem = run_notify(config, [run_id, preset, verdict, str(code), str(report)])
    if problem:
        _err(problem)
    return code


def reports_for_analyze(args: argparse.Namespace, path: Path, code: int) -> int:
    """analyze --junit / --summary-md: written for a recorded run (a directory with run.json)."""
    if getattr(args, "junit", None) is None and getattr(args, "summary_md", None) is None:
        return code
    if not (path / "run.json").is_file():
        _err(
            f"{path}: --junit and --summary-md report a recorded run (a directory `tracedeck "
            "run` wrote); for a bare tree or trace use --json"
        )
        return code if code else EXIT_USAGE
    from runners.run_view import load_side

    try:
        recorded = load_side(path).exit_code
    except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
        _err(f"cannot write the CI reports: {exc}")
        return code or EXIT_USAGE
    if recorded != code:
        # The reports are built from the run's record: they must say what analyze said.
        _err(
            f"{path}: analyze judged it exit {code}, the run's record says exit {recorded}; "
            "the CI reports were not written (they would disagree with this exit code)"
        )
        return code or EXIT_USAGE
    return code if write_reports(args, path) else (code or EXIT_USAGE)


def _unrecorded(session: Any, code: int) -> Any:
    """A run that left no record of its own, as the reports show it: what ended it."""
    from analysis.run_compare import FAIL, RunSide

    finished = getattr(session, "finished", None)
    verdict = finished.verdict if finished is not None else "NOT_STARTED"
    why = (finished.summary or {}).get("error", "") if finished is not None else ""
    record = session.record
    return RunSide(
        run_id=record.run_id,
        preset=record.preset,
        kind=record.kind,
        matrix={},
        verdict=verdict,
        tone=FAIL,
        exit_code=code,
        items=[],
        started_at=record.started_at,
        path=str(session.local_dir),
        problems=[str(why or f"the run left no record ({verdict})")],
    )
