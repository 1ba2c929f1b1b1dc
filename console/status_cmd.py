"""`tracedeck status [--json]`: live and recent runs, and who holds each host's lock."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

OUT_HELP = "local run records root (default: ~/.local/share/tracedeck/runs)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    status = sub.add_parser(
        "status",
        help="live and recent runs (state asked on their hosts) and who holds each host's lock",
    )
    status.add_argument("--json", action="store_true", help="print one JSON document")
    status.add_argument("--out", type=Path, help=OUT_HELP)
    status.add_argument(
        "--recent", type=int, default=20, metavar="N", help="ended runs to list (default 20)"
    )
    status.add_argument(
        "--host",
        action="append",
        default=None,
        metavar="TARGET",
        help="a host whose lock to show (repeatable; default: the hosts and fleets of the "
        "config, and this machine)",
    )


def cmd_status(args: argparse.Namespace) -> int:
    from runners.local_run import default_out_dir
    from runners.status import collect, status_lines

    status = asyncio.run(collect(args.out or default_out_dir(), args.recent, hosts=args.host))
    if args.json:
        print(json.dumps(status.document(), indent=2))
    else:
        print("\n".join(status_lines(status)))
    return 0
