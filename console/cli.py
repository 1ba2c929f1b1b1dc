"""The `tracedeck` command: the console with no arguments, headless subcommands otherwise."""

from __future__ import annotations

import signal
import sys

from console.quiet_blas import load_numpy
from console.startup import (
    installed_as_program,
    interrupted,
    is_program,
    stop_recording_interrupts,
)

installed_as_program(__name__)  # before the imports below: a Ctrl-C in them is recorded
if is_program(__name__):
    load_numpy()  # before the imports below load it with OpenBLAS's spinning threads

import argparse  # noqa: E402
import asyncio  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

from console import doctor_cmd, logs_cmd, status_cmd  # noqa: E402
from console.cancel_cmd import cancel_run  # noqa: E402
from console.run_lookup import find_run  # noqa: E402
from console.version import VersionAction  # noqa: E402
from runners.exits import EXIT_INFRA, EXIT_INTERRUPT, EXIT_USAGE  # noqa: E402

OUT_HELP = "local run records root (default: ~/.local/share/tracedeck/runs)"


def build_parser() -> argparse.ArgumentParser:
    from console.kind_options import add_options

    parser = argparse.ArgumentParser(
        prog="tracedeck",
        description="Operator console for GPU inference verification runs. "
        "With no command, opens the console.",
    )
    parser.add_argument(
        "--version", action=VersionAction, nargs=0, help="print the version and exit"
    )
    sub = parser.add_subparsers(dest="command")
    from console import ci_cmd, diff_cmd, history_cmd

    run = sub.add_parser("run", help="run a preset headless")
    run.add_argument("preset", help="preset name (see `tracedeck presets`) or path to a .toml")
    run.add_argument(
        "--target",
        help="local | ssh://user@host:port | ALIAS | slurm://LOGIN/PARTITION | several hosts "
        "as a,b or a [fleets.NAME] of the config (default: the preset's)",
    )
    run.add_argument(
        "--out", type=Path, help="local run directory root (default: ~/.local/share/tracedeck/runs)"
    )
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a preset field, TOML value syntax (e.g. matrix.seed=[0])",
    )
    run.add_argument("--json", action="store_true", help="print events as JSONL")
    run.add_argument(
        "--busy",
        choices=("skip", "wait"),
        help="a fleet host whose lock is held: skip it (its cells go to the others) or wait "
        "for it (default: the preset's fleet.busy, skip)",
    )
    add_kind_options(run)
    ci_cmd.add_report_args(run)

    plan = sub.add_parser(
        "plan",
        help="show what a run would do (each cell's command, environment, remote paths, files "
        "fetched and followed) without starting it; --check also checks the target, read-only",
    )
    plan.add_argument("preset", help="preset name (see `tracedeck presets`) or path to a .toml")
    plan.add_argument(
        "--target", help="local | ssh://user@host:port | ALIAS (default: the preset's)"
    )
    plan.add_argument("--out", type=Path, help="local run directory root, as for `run`")
    plan.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a preset field, as for `run`",
    )
    plan.add_argument(
        "--check",
        action="store_true",
        help="connect and check, reading only: reachable, host key known, lock holder, free "
        "space in the runs directory, interpreter and packages (exit 3 when a run would fail)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON document")
    add_kind_options(plan)

    attach = sub.add_parser("attach", help="reconnect to a run and follow it to the end")
    attach.add_argument("run", help="local run directory or run id")
    attach.add_argument("--out", type=Path, help=OUT_HELP)
    attach.add_argument("--json", action="store_true", help="print events as JSONL")

    cancel = sub.add_parser("cancel", help="stop a run: TERM its process group, KILL after a grace")
    cancel.add_argument("run", help="local run directory or run id")
    cancel.add_argument("--out", type=Path, help=OUT_HELP)
    cancel.add_argument("--grace", type=float, default=5.0, help="seconds between TERM and KILL")

    fetch = sub.add_parser(
        "fetch", help="bring home what a run judged on its host and left there (e.g. logits)"
    )
    fetch.add_argument("run", help="local run directory or run id")
    fetch.add_argument("--out", type=Path, help=OUT_HELP)

    replay = sub.add_parser("replay", help="replay a recorded run from its events.jsonl")
    replay.add_argument("dir", type=Path, help="a run directory (holds run.json and events.jsonl)")
    replay.add_argument(
        "--headless", action="store_true", help="print instead of opening the console"
    )
    replay.add_argument(
        "--speed",
        type=float,
        default=0.0,
        help="1 = real time, 10 = ten times faster, 0 = at once (headless default)",
    )
    replay.add_argument("--json", action="store_true", help="with --headless: events as JSONL")
    ci_cmd.add_report_args(replay)

    analyze = sub.add_parser(
        "analyze", help="judge what a run kind writes (a B3.67 tree, a readout trace, ...)"
    )
    analyze.add_argument("path", type=Path, help="what to judge: " + _analyze_forms())
    analyze.add_argument("--kind", help="the run kind to judge it as (default: the one it fits)")
    analyze.add_argument(
        "--json", action="store_true", help="print the result as one JSON document"
    )
    analyze.add_argument(
        "--output",
        type=Path,
        metavar="DIR",
        help="write the documents analyze writes (summary, metrics, report) into DIR and leave "
        "the input untouched (default: into the tree judged; every file written is named)",
    )
    add_options(analyze, (o for kind in _kinds().values() for o in kind.analyze_options))
    add_kind_options(analyze)
    ci_cmd.add_report_args(analyze)

    sub.add_parser("presets", help="list shipped and user presets")

    prune = sub.add_parser(
        "prune",
        help="delete old run directories, here and on a target (a dry run unless --yes); "
        "never a live run, nor one another console follows",
    )
    prune.add_argument(
        "--older-than", metavar="AGE", help="runs started longer ago than AGE (7d, 12h, 1d12h)"
    )
    prune.add_argument("--keep", type=int, metavar="N", help="keep the N newest runs")
    prune.add_argument(
        "--out", type=Path, help="local run records root (default: ~/.local/share/tracedeck/runs)"
    )
    prune.add_argument(
        "--target",
        help="prune the run directories in this target's runs directory instead of this "
        "machine's records (local | ssh://user@host:port | ALIAS)",
    )
    prune.add_argument(
        "--runs",
        help="with --target: its runs directory, as target.runs says it (default .tracedeck/runs)",
    )
    prune.add_argument("--yes", action="store_true", help="delete (without it: only say what)")

    watch = sub.add_parser(
        "watch", help="follow a trace directory another process writes (no preset, no lock)"
    )
    watch.add_argument("dir", help="DIR or ssh://[user@]host[:port]/DIR (e.g. a DSA --trace-out)")
    watch.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="stop once the writer's summary is there and nothing came for this many seconds",
    )
    watch.add_argument(
        "--headless",
        action="store_true",
        help="print lines, not the console (the default when not on a terminal)",
    )
    add_options(
        watch, (o for kind in _kinds().values() if kind.watch_dirs for o in kind.watch_options)
    )

    trust = sub.add_parser("trust", help="add a host's key to ~/.ssh/known_hosts after showing it")
    trust.add_argument("host", help="HOST or HOST:PORT")
    trust.add_argument("--yes", action="store_true", help="trust without asking")

    diff_cmd.add_parser(sub)
    history_cmd.add_parser(sub)
    from console.dsa_data_cli import add_parsers as add_dsa_data_parsers

    add_dsa_data_parsers(sub)
    logs_cmd.add_parser(sub)
    status_cmd.add_parser(sub)
    doctor_cmd.add_parser(sub)

    ui = sub.add_parser("ui", help="open the console (the default)")
    ui.add_argument("--out", type=Path, help=OUT_HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command or "ui"
    if command != "run":  # `run` keeps recording until its launch begins (_launch_and_follow)
        stop_recording_interrupts()
    if interrupted():
        _err("interrupted while starting: nothing was launched")
        return EXIT_INTERRUPT
    handler = {
        "run": cmd_run,
        "plan": cmd_plan,
        "attach": cmd_attach,
        "cancel": cmd_cancel,
        "fetch": cmd_fetch,
        "replay": cmd_replay,
        "analyze": cmd_analyze,
        "presets": cmd_presets,
        "prune": cmd_prune,
        "watch": cmd_watch,
        "trust": cmd_trust,
        "ui": cmd_ui,
        "diff": _diff,
        "history": _history,
        "export": _dsa_data("cmd_export"),
        "dsa": _dsa_data("cmd_dsa"),
        "logs": logs_cmd.cmd_logs,
        "status": status_cmd.cmd_status,
        "doctor": doctor_cmd.cmd_doctor,
    }[command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPT
    except BrokenPipeError:  # e.g. `tracedeck analyze ... | head`
        sys.stderr.close()
        return 0


def _diff(args: argparse.Namespace) -> int:
    from console.diff_cmd import cmd_diff

    return cmd_diff(args)


def _history(args: argparse.Namespace) -> int:
    from console.history_cmd import cmd_history

    return cmd_history(args)


class Terminated(KeyboardInterrupt):
    """A SIGTERM (kill, timeout, a scheduler's cancel), raised where Ctrl-C would be."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def _dsa_data(name: str) -> Callable[[argparse.Namespace], int]:
    """A handler of console.dsa_data_cli (export, dsa whatif|tiers), imported when run. A
    SIGTERM ends it as Ctrl-C does: its workers stopped, no part file left."""

    def handler(args: argparse.Namespace) -> int:
        from console import dsa_data_cli

        signal.signal(signal.SIGTERM, _terminate)
        try:
            return int(getattr(dsa_data_cli, name)(args))
        except Terminated:
            _err("terminated (SIGTERM): nothing was written")
            return 128 + signal.SIGTERM
        except KeyboardInterrupt:
            _err("interrupted: nothing was written")
            return EXIT_INTERRUPT

    return handler


def _err(message: str) -> None:
    print(f"tracedeck: {message}", file=sys.stderr)


def _infra_error(exc: Exception) -> int:
    from runners.targets.base import HostKeyUnknown

    _err(str(exc))
    if isinstance(exc, HostKeyUnknown):
        _err(f"to trust it: {exc.trust_command}")
    return EXIT_INFRA


def cmd_run(args: argparse.Namespace) -> int:
    from console.ci_cmd import report_paths_problem
    from console.headless import Printer
    from runners.kinds import load_preset
    from runners.local_run import default_out_dir
    from runners.presets import PresetError, resolve_preset
    from runners.run import Run
    from runners.targets.base import TargetError

    problem = report_paths_problem(args)  # before anything is launched
    if problem:
        _err(problem)
        return EXIT_USAGE
    try:
        overrides = list(args.overrides)
        if args.busy:
            overrides.append(f'fleet.busy="{args.busy}"')
        preset = load_preset(resolve_preset(args.preset), overrides, chosen_options(args))
        target = args.target or preset.section("target")["host"]
        out = usable_out_dir(args.out or default_out_dir())
        if interrupted():
            _err("interrupted before the launch: nothing was launched")
            return EXIT_INTERRUPT
        session = Run.create(preset, target, out, Printer(json_lines=args.json))
    except (PresetError, ValueError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    from console.ci_cmd import after_run

    try:
        code = asyncio.run(_launch_and_follow(session))
    except PresetError as exc:
        _err(str(exc))
        code = EXIT_USAGE
    except TargetError as exc:
        code = _infra_error(exc)
    except OSError as exc:
        _err(f"{exc.filename or session.local_dir}: {exc.strerror or exc}")
        code = EXIT_INFRA
    return after_run(args, session, code)


def cmd_plan(args: argparse.Namespace) -> int:
    from console import plan_text
    from runners import preflight, preview
    from runners.kinds import load_preset
    from runners.local_run import default_out_dir
    from runners.presets import PresetError, resolve_preset

    try:
        preset = load_preset(resolve_preset(args.preset), args.overrides, chosen_options(args))
        target = args.target or preset.section("target")["host"]
        view = preview.preview(preset, target, args.out or default_out_dir())
    except (PresetError, ValueError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    checked = asyncio.run(preflight.check(view)) if args.check else None
    shown = checked.preview if checked is not None and checked.preview is not None else view
    if args.json:
        doc = plan_text.plan_document(shown)
        if checked is not None:
            doc["checks"] = preflight.checked_document(checked)
        print(plan_text.to_json(doc))
    else:
        print("\n".join(plan_text.plan_lines(shown)))
        if checked is not None:
            print(f"\ncheck of {view.target_name} (read-only):")
            print("\n".join(plan_text.check_lines(checked)))
    if checked is not None and checked.problems:
        for problem in checked.problems:
            _err(f"{view.target_name}: {problem.what}: {problem.text}")
        return EXIT_INFRA
    return 0


def usable_out_dir(out: Path) -> Path:
    """The run records' root, created if needed; ValueError naming it when it cannot hold runs."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=out, prefix=".tracedeck-probe-", delete=True)  # noqa: SIM115
        probe.close()
    except FileExistsError:
        raise ValueError(f"--out {out}: a file is in the way; name a directory") from None
    except NotADirectoryError:
        raise ValueError(f"--out {out}: a file on that path is not a directory") from None
    except OSError as exc:
        raise ValueError(
            f"--out {out}: cannot write run records there ({exc.strerror}); name a writable "
            "directory"
        ) from None
    if not out.is_dir():
        raise ValueError(f"--out {out}: not a directory")
    return out


async def _launch_and_follow(session) -> int:  # type: ignore[no-untyped-def]
    """Launch, then follow. A Ctrl-C during the launch lets it finish and then cancels the run;
    a second one stops waiting, and either way the run's id and the commands to attach to it or
    cancel it are printed: a run is never left going unreported."""
    loop = asyncio.get_running_loop()
    if interrupted():
        await session.abandon()
        _err(f"interrupted before the launch of run {session.record.run_id}: nothing was launched")
        return EXIT_INTERRUPT
    launch = asyncio.ensure_future(session.launch())
    interrupts = 0
    where = session.local_dir
    commands = f"attach: tracedeck attach {where}; cancel: tracedeck cancel {where}"

    def on_sigint() -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            _err(
                f"interrupt during the launch of run {session.record.run_id}: it is cancelled "
                "as soon as it has started (Ctrl-C again to stop waiting and leave it)"
            )
        else:
            launch.cancel()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    stop_recording_interrupts(restore=False)  # the loop's handler took over
    if interrupted():  # between the check above and the loop's handler
        on_sigint()
    try:
        await launch
    except asyncio.CancelledError:
        loop.remove_signal_handler(signal.SIGINT)
        if session.stage in ("starting", "started"):
            _err(
                f"stopped waiting for the launch of run {session.record.run_id}; it may have "
                f"started on its target ({commands})"
            )
        else:
            _err(
                f"stopped the launch of run {session.record.run_id} while {session.stage}: it "
                "never started on its target; nothing to cancel"
            )
        await session.close()
        return EXIT_INTERRUPT
    except Exception:
        loop.remove_signal_handler(signal.SIGINT)
        await session.close()
        raise
    # Launched: this handler stays until the follow's replaces it. Put back to the default
    # between the two, a Ctrl-C raised KeyboardInterrupt there, and the run went on unreported.
    if interrupts:
        _err(f"run {session.record.run_id} started; cancelling it now ({commands})")
        cancelling = asyncio.ensure_future(session.cancel())
        code = await _follow_interruptible(session, cancelling)
        if cancelling.done() and not cancelling.cancelled() and cancelling.exception():
            _err(f"the cancel failed: {cancelling.exception()} ({commands})")
        return code
    return await _follow_interruptible(session)


async def _follow_interruptible(session, cancelling=None) -> int:  # type: ignore[no-untyped-def]
    """Follow to the end; the first Ctrl-C cancels the run on the target, a second detaches
    (a cancel already under way finishes there without this console)."""
    loop = asyncio.get_running_loop()
    follow = asyncio.ensure_future(session.follow())
    interrupts = 1 if cancelling is not None else 0

    def on_sigint() -> None:
        nonlocal interrupts, cancelling
        interrupts += 1
        if interrupts == 1:
            _err("interrupt: cancelling the run (Ctrl-C again to detach and leave it running)")
            cancelling = asyncio.ensure_future(session.cancel())
        else:
            going = (
                "the cancel already asked finishes there without this console"
                if cancelling is not None and not cancelling.done()
                else "the run goes on"
            )
            _err(
                f"detached; {going}. Reattach: tracedeck attach {session.local_dir}; "
                f"cancel: tracedeck cancel {session.local_dir}"
            )
            follow.cancel()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        result = await follow
        return result.exit_code
    except asyncio.CancelledError:
        return EXIT_INTERRUPT
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        await session.close()


def cmd_attach(args: argparse.Namespace) -> int:
    from console.headless import Printer
    from runners.targets.base import TargetError

    printer = Printer(json_lines=args.json)
    try:
        local = find_run(args.run, args.out)
        return asyncio.run(_attach(local, printer))
    except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    except TargetError as exc:
        return _infra_error(exc)


async def _attach(local: Path, printer) -> int:  # type: ignore[no-untyped-def]
    """Follow a run as its record's writer; or, while another console writes it, read-only,
    taking the writing over if that console goes."""
    from runners.record import RecordBusy
    from runners.run import Run
    from runners.viewer import skipping, view

    shown = 0
    while True:
        try:
            session = Run.attach(local, printer, replay=skipping(printer, shown))
        except RecordBusy:
            if shown == 0:
                _err(
                    "another console follows this run and writes its record: following that "
                    "record read-only (this console takes over if that one goes)"
                )
            finished, shown = await view(local, skipping(printer, shown))
            if finished is not None:
                return finished.exit_code
            continue
        return await _follow_interruptible(session)


def cmd_cancel(args: argparse.Namespace) -> int:
    from console.headless import Printer
    from runners.targets.base import TargetError

    try:
        local = find_run(args.run, args.out)
        return asyncio.run(cancel_run(local, args.grace, Printer()))
    except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    except TargetError as exc:
        return _infra_error(exc)


def cmd_fetch(args: argparse.Namespace) -> int:
    from console.headless import Printer
    from runners.record import RecordBusy, RecordError
    from runners.targets.base import TargetError

    try:
        local = find_run(args.run, args.out)
        return asyncio.run(_fetch(local, Printer()))
    except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    except RecordBusy:
        _err(
            f"{args.run}: another console follows this run and writes its record: press f on "
            "its run screen, or fetch once it has ended"
        )
        return EXIT_INFRA
    except RecordError as exc:
        _err(str(exc))
        return EXIT_INFRA
    except TargetError as exc:
        return _infra_error(exc)


async def _fetch(local: Path, printer) -> int:  # type: ignore[no-untyped-def]
    from runners.run import fetch_held_into

    count = await fetch_held_into(local, printer)
    if count == 0:
        print(f"{local}: nothing is held on the host (everything judged there is home)")
    else:
        print(f"fetched {count} file(s) into {local}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from console.ci_cmd import report_paths_problem
    from runners.kinds import event_types
    from runners.record import EVENTS, read_events

    path = args.dir / EVENTS
    if not path.exists():
        _err(f"{path}: no recorded events; pass a run directory written by `tracedeck run`")
        return EXIT_USAGE
    problem = report_paths_problem(args)
    if problem:
        _err(problem)
        return EXIT_USAGE
    if not args.headless:
        from console.app import run_app
        from console.ci_cmd import write_reports

        code = run_app(replay_dir=args.dir, speed=args.speed or 1.0)
        return code if write_reports(args, args.dir) else (code or EXIT_USAGE)
    from console.headless import Printer

    try:
        recorded = read_events(path, event_types())
    except ValueError as exc:
        _err(str(exc))
        return EXIT_USAGE
    printer = Printer(json_lines=args.json)
    previous = None
    from runners.events import RunFinished

    end: RunFinished | None = None  # the run's exit code is its end's, and only its end's
    from runners.run_view import as_recorded, believed_end, item_words

    try:  # each item's recorded word is shown as its recomputation has it
        shown = item_words(args.dir)
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        shown = as_recorded  # a pass is still checked (and refused) at the end, below
    for event in recorded.events:
        event = shown(event)
        if args.speed > 0 and previous is not None:
            time.sleep(max(0.0, (event.t - previous) / args.speed))
        previous = event.t
        if isinstance(event, RunFinished) and event.exit_code == 0:
            try:  # a recorded pass is believed only when its own events agree
                event = believed_end(args.dir, event)
            except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
                _err(f"the record cannot be read back to check its verdict: {exc}")
                return EXIT_USAGE
            if event.exit_code:
                _err(event.summary["error"])
        printer(event)
        if isinstance(event, RunFinished):
            end = event
    if recorded.torn_tail:
        _err(
            f"{path}: the last line is incomplete (the console stopped mid-write); "
            f"`tracedeck attach {args.dir}` resumes from the last complete event"
        )
    if end is not None:
        code = end.exit_code
    else:  # no verdict was recorded: never a pass, whatever its cells said
        code = EXIT_INFRA
        _err(
            f"{path}: the record has no end (no run_finished event): the run had not finished "
            f"when its console stopped recording, or it still runs; `tracedeck attach "
            f"{args.dir}` follows it to its verdict"
        )
    from console.ci_cmd import write_reports

    return code if write_reports(args, args.dir) else (code or EXIT_USAGE)


def add_kind_options(parser: argparse.ArgumentParser) -> None:
    """The run kinds' explicit operator options, as --flags (e.g. --loose-thresholds)."""
    seen: dict[str, str] = {}
    for kind in _kinds().values():
        seen.update(kind.options)
    for name, text in sorted(seen.items()):
        parser.add_argument(
            "--" + name.replace("_", "-"), dest=name, action="store_true", help=text
        )


def chosen_options(args: argparse.Namespace) -> frozenset[str]:
    names = {n for k in _kinds().values() for n in k.options}
    return frozenset(n for n in names if getattr(args, n, False))


def _kinds() -> dict:  # type: ignore[type-arg]
    from runners.kinds import all_kinds

    return all_kinds()


def _analyze_forms() -> str:
    return "; ".join(
        f"{k.analyze_help()} ({name})" for name, k in _kinds().items() if k.analyze_help()
    )


def cmd_analyze(args: argparse.Namespace) -> int:
    from console.ci_cmd import reports_for_analyze

    return reports_for_analyze(args, args.path, _analyze(args))


def _analyze(args: argparse.Namespace) -> int:
    from console.headless import ProgressShow
    from console.kind_options import asked
    from runners.record import RUN_JSON, RunRecord
    from runners.rejudge import guard_record

    path: Path = args.path
    kinds = _kinds()
    if not path.exists():
        _err(f"{path}: no such file or directory; pass {_analyze_forms()}")
        return EXIT_USAGE
    from console.ci_cmd import report_paths_problem

    problem = report_paths_problem(args)  # before anything is judged or written
    if problem:
        _err(problem)
        return EXIT_USAGE
    given = args.output
    said, args.output = guard_record(path, given)  # a run's recorded verdict is never rewritten
    if said:
        _err(said.removeprefix("note: "))
        if not said.startswith("note: "):
            return EXIT_USAGE
    if given is not None:
        problem = _output_problem(path, given)
        if problem:
            _err(f"--output {given}: {problem}")
            return EXIT_USAGE
    args.progress = ProgressShow(sys.stderr).show  # long judging, drawn on stderr
    if args.kind is not None:
        if args.kind not in kinds:
            _err(f"--kind {args.kind}: unknown run kind; known: {', '.join(kinds)}")
            return EXIT_USAGE
        return _analyze_as(kinds[args.kind], path, args)
    if (path / RUN_JSON).is_file():
        try:
            recorded = RunRecord.load(path).kind
        except (OSError, ValueError, TypeError) as exc:
            _err(str(exc))
            return EXIT_USAGE
        if recorded in kinds:
            return _analyze_as(kinds[recorded], path, args, f"a {recorded} run: ")
    for kind in kinds.values():
        if kind.claims(path):
            return kind.analyze(path, asked(args))
    _err(f"{path}: not something tracedeck can judge; pass {_analyze_forms()}")
    return EXIT_USAGE


def _analyze_as(kind, path: Path, args: argparse.Namespace, what: str = "") -> int:  # type: ignore[no-untyped-def]
    """The kind's analyze; a usage error naming the kind when it has none."""
    from console.kind_options import asked

    if not kind.analyzes:
        able = ", ".join(n for n, k in _kinds().items() if k.analyzes) or "none"
        _err(
            f"{path}: {what}the {kind.name} kind has no analyze (a {kind.name} run is judged "
            f"as it runs: `tracedeck replay {path}` shows its verdict); kinds with one: {able}"
        )
        return EXIT_USAGE
    return int(kind.analyze(path, asked(args)))


def _output_problem(path: Path, output: Path) -> str:
    """Why analyze cannot write into `output` ('' when it can; it is made when missing)."""
    if output.exists() and not output.is_dir():
        return "a file is in the way; name a directory"
    src, dst = path.resolve(), output.resolve()
    if dst != src and path.is_dir() and dst.is_relative_to(src):
        return f"inside the tree judged ({path}); name a directory outside it"
    if dst == src:
        return ""
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make it ({exc.strerror})"
    return ""


def cmd_watch(args: argparse.Namespace) -> int:
    """Handed to the run kind that watches directories (kinds declare it: watch_dirs). On a
    terminal, the kind's panel module shows it when it has a console view (`watch(args)`)."""
    from console.kind_options import asked

    watchers = [k for k in _kinds().values() if k.watch_dirs]
    if not watchers:
        _err("no run kind can watch a directory")
        return EXIT_USAGE
    kind = watchers[0]
    if not args.headless and sys.stdin.isatty() and sys.stdout.isatty():
        console_watch = _console_watch(kind.name)
        if console_watch is not None:
            return int(console_watch(args))
    return int(kind.watch(asked(args)))


def _console_watch(kind: str) -> Callable[[argparse.Namespace], int] | None:
    """The console view of `tracedeck watch` for a kind: its panel module's watch(args)."""
    from console.panels import all_panels

    panel = all_panels().get(kind)
    return getattr(sys.modules[panel.__module__], "watch", None) if panel is not None else None


def cmd_presets(args: argparse.Namespace) -> int:
    from runners.kinds import load_preset, problems
    from runners.presets import PresetError, preset_files

    rows = []
    broken = 0
    for problem in problems():
        broken += 1
        _err(problem)
    for path in preset_files():
        try:
            p = load_preset(path)
            rows.append((p.name, p.kind, str(p.cell_count()), p.description, str(path)))
        except PresetError as exc:
            broken += 1
            _err(str(exc))
    widths = [
        max([len(r[i]) for r in rows] + [len(h)]) for i, h in enumerate(("name", "kind", "cells"))
    ]
    print(f"{'name':<{widths[0]}}  {'kind':<{widths[1]}}  {'cells':>{widths[2]}}  description")
    for name, kind, cells, desc, _ in rows:
        print(f"{name:<{widths[0]}}  {kind:<{widths[1]}}  {cells:>{widths[2]}}  {desc}")
    return EXIT_USAGE if broken else 0


def cmd_prune(args: argparse.Namespace) -> int:
    from runners.local_run import default_out_dir
    from runners.prune import parse_duration

    if args.older_than is None and args.keep is None:
        _err("prune: say which runs go: --older-than AGE and/or --keep N")
        return EXIT_USAGE
    if args.keep is not None and args.keep < 0:
        _err(f"--keep {args.keep}: give a count of runs to keep, 0 or more")
        return EXIT_USAGE
    if args.runs is not None and args.target is None:
        _err("--runs names a target's runs directory: give --target too")
        return EXIT_USAGE
    try:
        older = parse_duration(args.older_than) if args.older_than is not None else None
        if args.target is not None:
            from runners.targets.factory import parse_target

            parse_target(args.target)
    except ValueError as exc:
        _err(str(exc))
        return EXIT_USAGE
    out = args.out or default_out_dir()
    if args.target is None and not out.is_dir():
        _err(f"--out {out}: no such directory (no run records to prune)")
        return EXIT_USAGE
    return asyncio.run(_prune(args, out, older))


async def _prune(args: argparse.Namespace, out: Path, older: float | None) -> int:
    from runners import prune
    from runners.targets.base import TargetError

    targets = prune.Targets()
    now = time.time()
    try:
        if args.target is None:
            items = prune.local_items(out)
            prune.choose(items, older, args.keep, now)
            await prune.check_local(items, targets)
            where = f"local run records under {out}"
        else:
            runs = args.runs or ".tracedeck/runs"
            try:
                items, root = await prune.remote_items(args.target, runs, targets)
            except TargetError as exc:
                return _infra_error(exc)
            prune.choose(items, older, args.keep, now)
            await prune.check_remote(items, args.target, out, targets, now)
            where = f"run directories in {args.target}:{root}"
        chosen = [i for i in items if i.delete]
        failures = await prune.delete(items, out, targets) if args.yes else []
    finally:
        await targets.close()
    print(f"prune: {len(items)} run(s) in {where}")
    for item in items:
        when = "?"
        if item.started:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(item.started))
        if not item.delete:
            print(f"  keep     {when}  {item.run_id}  {item.path}: {item.why}")
            continue
        verb = "deleted" if item.done else ("delete" if not args.yes else "FAILED")
        also = "".join(f"  (and {spec}:{rdir})" for spec, rdir in item.remote)
        print(f"  {verb:<8} {when}  {item.run_id}  {item.path}{also}")
        if item.note:
            print(f"           {item.note}")
    for failure in failures:
        _err(failure)
    if not args.yes:
        print(f"dry run: nothing deleted; {len(chosen)} run(s) would go. Add --yes to delete them.")
        return 0
    print(f"deleted {sum(1 for i in chosen if i.done)} of {len(chosen)} run(s)")
    return EXIT_INFRA if failures else 0


def cmd_trust(args: argparse.Namespace) -> int:
    from runners.trust import fetch_host_key, trust_host

    host, _, port_text = args.host.partition(":")
    try:
        port = int(port_text) if port_text else None  # None: the Port ~/.ssh/config gives
    except ValueError:
        _err(f"{args.host}: port must be a number (HOST or HOST:PORT)")
        return EXIT_USAGE
    if not host or (port is not None and not 0 < port < 65536):
        _err(f"{args.host}: give HOST or HOST:PORT (port 1 to 65535)")
        return EXIT_USAGE
    from runners.targets.base import TargetError

    try:
        key_type, fingerprint, _ = asyncio.run(fetch_host_key(host, port))
    except (OSError, TargetError) as exc:
        _err(f"{args.host}: could not fetch the host key ({exc})")
        return EXIT_INFRA
    print(f"{args.host} presents {key_type} {fingerprint}")
    if not args.yes:
        if not sys.stdin.isatty():
            _err("not a terminal: compare the fingerprint out of band, then rerun with --yes")
            return EXIT_USAGE
        answer = input("Trust this key and add it to ~/.ssh/known_hosts? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("not trusted")
            return 1
    from runners.targets.base import TargetError

    try:
        asyncio.run(trust_host(host, port, expected_fingerprint=fingerprint))
    except TargetError as exc:  # the key changed between showing and trusting
        _err(str(exc))
        return EXIT_INFRA
    print(f"trusted {args.host}")
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    from console.app import run_app

    return run_app(out_dir=getattr(args, "out", None))


if __name__ == "__main__":
    sys.exit(main())
