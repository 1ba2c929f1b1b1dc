"""`tracedeck doctor [--target T] [--json]`: this machine and a target checked, read-only."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from runners.exits import EXIT_INFRA

# What the console itself imports (runners names no UI package: the import contract).
CONSOLE_PACKAGES = ("textual", "asyncssh", "orjson", "numpy")


def add_parser(sub: argparse._SubParsersAction) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="check this machine and a target, reading only (python, packages, config, ssh, "
        "host key, lock, free space) and say what to fix; exit 3 when something must be fixed",
    )
    doctor.add_argument(
        "--target",
        default="local",
        help="local | ssh://user@host:port | ALIAS | slurm://LOGIN/PARTITION (default: local)",
    )
    doctor.add_argument(
        "--out", type=Path, help="local run records root (default: ~/.local/share/tracedeck/runs)"
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON document")


def cmd_doctor(args: argparse.Namespace) -> int:
    from console.plan_text import check_lines
    from runners.doctor import check_here, check_target
    from runners.local_run import default_out_dir
    from runners.preflight import checked_document

    out_dir = args.out or default_out_dir()
    here = check_here(out_dir, CONSOLE_PACKAGES)
    there = asyncio.run(check_target(args.target, out_dir))
    problems = here.problems + there.problems
    if args.json:
        doc = {
            "this_machine": checked_document(here),
            "target": args.target,
            "target_checks": checked_document(there),
            "problems": len(problems),
        }
        print(json.dumps(doc, indent=2))
    else:
        print("this machine (the console):")
        print("\n".join(check_lines(here)[:-1]))
        print(f"\ntarget {args.target} (read-only; as a reference-engine run would need it):")
        print("\n".join(check_lines(there)[:-1]))
        n = len(problems)
        print(
            "\ndoctor: all good"
            if n == 0
            else f"\ndoctor: {n} thing{'s' if n != 1 else ''} to fix (PROBLEM lines above)"
        )
    return EXIT_INFRA if problems else 0
