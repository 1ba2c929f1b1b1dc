"""Command line: ``python -m runners.reference COMMAND ...``; the commands are found, not listed.

A command is a module of this package that defines ``add_arguments(parser)`` and ``run(args)``
at top level; its docstring's first line is its help. Listing the commands reads the sources
only, so ``--help`` never waits for torch.

Exit status: 0 done, 1 engine failure (traceback), 2 bad flags or environment, 3 device missing.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import importlib
import os
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent


def commands() -> dict[str, str]:
    """Command name -> one-line help, from the sources (no import, so no torch)."""
    found: dict[str, str] = {}
    for path in sorted(HERE.glob("*.py")):
        doc = command_help(path)
        if doc is not None:
            found[path.stem] = doc
    return found


def command_help(path: Path) -> str | None:
    """A module's one-line help if it is a command (its source read, not imported), else None."""
    if path.stem.startswith("_") or not path.is_file():
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    if not {"add_arguments", "run"} <= defined:
        return None
    doc = (ast.get_docstring(tree) or "").strip().splitlines()
    return doc[0] if doc else ""


def _usage(known: dict[str, str]) -> str:
    lines = ["usage: python -m runners.reference COMMAND [flags]", "", "commands:"]
    lines += [f"  {name:<14} {doc}" for name, doc in known.items()]
    lines += ["", "python -m runners.reference COMMAND --help shows a command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(commands()))
        return 0 if args else 2
    name = args[0]
    # only the named command's source is read: an engine cell starts without parsing them all
    help_line = command_help(HERE / f"{name}.py") if name.isidentifier() else None
    if help_line is None:
        print(f"error: unknown command {name!r}\n\n{_usage(commands())}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"runners.reference.{name}")
    from runners.reference.runtime import DeviceError, UsageError

    parser = argparse.ArgumentParser(
        prog=f"python -m runners.reference {name}", description=help_line
    )
    module.add_arguments(parser)
    parsed = parser.parse_args(args[1:])
    try:
        module.run(parsed)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    return 0


def finish(code: int) -> None:
    """Ends the engine. Done (0), with no other thread: what Python's shutdown does that anyone
    sees (atexit handlers, the standard streams flushed; a failed flush is exit 120, as there),
    then os._exit. The rest of that shutdown is freeing torch's modules object by object, ~0.3 s
    of CPU at the end of every cell here, after every output file was closed. Any other end
    (an error, an interrupt, a thread still running) gets Python's own shutdown."""
    if code != 0 or threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = 120
    os._exit(code)


if __name__ == "__main__":
    finish(main())
