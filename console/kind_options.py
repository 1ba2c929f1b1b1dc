"""The run kinds' declared options as argparse flags, and what was asked handed back to a kind
with this process's stdout and stderr as where it says things."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from typing import Any

from runners.kind import Asked, Option


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """Each option once, as --NAME (two kinds may share one, e.g. --workers)."""
    seen: set[str] = set()
    for opt in options:
        if opt.name in seen:
            continue
        seen.add(opt.name)
        extra: dict[str, Any] = {"dest": opt.name, "help": opt.help}
        if opt.parse is not None:
            extra["type"] = _argparse_type(opt.parse)
        if opt.metavar is not None:
            extra["metavar"] = opt.metavar
        if opt.many:
            extra.update(action="append", default=[])
        parser.add_argument("--" + opt.name.replace("_", "-"), **extra)


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:  # argparse shows an ArgumentTypeError's text as it is
            raise argparse.ArgumentTypeError(str(exc) or f"{text!r}: not a valid value") from None

    typed.__name__ = getattr(parse, "__name__", "value")
    return typed


def _out(text: str) -> None:
    print(text, flush=True)


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def asked(args: argparse.Namespace) -> Asked:
    """Every option given on the command line, by name; said on stdout and stderr."""
    values = {k: v for k, v in vars(args).items() if k not in ("func", "progress")}
    return Asked(values, _out, _err, getattr(args, "progress", None))
