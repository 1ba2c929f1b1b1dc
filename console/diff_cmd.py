"""`tracedeck diff RUN_A RUN_B`: what changed from run A to run B (exit 0 / 1 / 2)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from runners.exits import EXIT_USAGE


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    diff = sub.add_parser(
        "diff",
        help="what changed from run A to run B: verdicts, metric deltas, engine and host "
        "(exit 0 no regression, 1 regression, 2 incomparable)",
    )
    diff.add_argument("a", help="run A (before): run directory or run id")
    diff.add_argument("b", help="run B (after): run directory or run id")
    diff.add_argument("--out", type=Path, help="run records root where ids are looked up")
    diff.add_argument(
        "--allow-matrix",
        action="append",
        default=[],
        metavar="KEY",
        help="a matrix key whose values may differ between the runs (inject always may)",
    )
    diff.add_argument(
        "--all", action="store_true", help="list unchanged items too, not only what changed"
    )
    diff.add_argument("--json", action="store_true", help="print the diff as one JSON document")


def cmd_diff(args: argparse.Namespace) -> int:
    from analysis.run_compare import ENGINE_SWITCHES, compare_runs, diff_lines
    from console.run_lookup import find_run
    from runners.run_view import load_side

    sides = []
    for name, run in (("A", args.a), ("B", args.b)):
        try:
            sides.append(load_side(find_run(run, args.out)))
        except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:
            print(f"tracedeck: diff: run {name} {run}: {exc}", file=sys.stderr)
            return EXIT_USAGE
    allowed = ENGINE_SWITCHES | frozenset(args.allow_matrix)
    result = compare_runs(sides[0], sides[1], allowed)
    if args.json:
        print(orjson.dumps(result.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        print("\n".join(diff_lines(result, show_same=args.all)))
    return result.exit_code
