"""`tracedeck history PRESET`: the last runs of a preset, per item verdicts and metric trends."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from runners.exits import EXIT_USAGE


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    history = sub.add_parser(
        "history",
        help="the last runs of a preset: verdicts and headline metrics per seed/cell/prompt as "
        "sparklines, and metrics drifting worse while still passing",
    )
    history.add_argument("preset", help="preset name, as runs recorded it")
    history.add_argument("--out", type=Path, help="run records root (default: the usual one)")
    history.add_argument("--target", help="only runs on this target (as the run named it)")
    history.add_argument("--last", type=int, default=10, metavar="N", help="runs shown (10)")
    history.add_argument(
        "--drift",
        type=int,
        default=3,
        metavar="K",
        help="a metric worse in each of the last K runs while passing is drifting (3)",
    )
    history.add_argument("--json", action="store_true", help="print one JSON document")


def cmd_history(args: argparse.Namespace) -> int:
    from analysis.trends import trend_lines, trends
    from runners.local_run import default_out_dir
    from runners.run_history import preset_runs

    if args.last < 1 or args.drift < 2:
        print("tracedeck: history: --last must be >= 1 and --drift >= 2", file=sys.stderr)
        return EXIT_USAGE
    out = args.out or default_out_dir()
    if not out.is_dir():
        print(f"tracedeck: history: --out {out}: no such directory", file=sys.stderr)
        return EXIT_USAGE
    sides, skipped = preset_runs(out, args.preset, args.target, args.last)
    for why in skipped:
        print(f"tracedeck: history: {why}", file=sys.stderr)
    if not sides:
        where = f" on {args.target}" if args.target else ""
        print(
            f"tracedeck: history: no finished run of preset {args.preset!r}{where} under {out}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    result = trends(sides, args.drift)
    if args.json:  # what was left out is in the document too: a reader of it sees no gap
        doc = {**result.to_json(), "left_out": skipped}
        print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    else:
        print("\n".join(trend_lines(result)))
    return 0
