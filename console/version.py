"""`tracedeck --version`: the installed version, where it runs from and what it runs on."""

from __future__ import annotations

import argparse
import platform
from importlib import metadata
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def version_text() -> str:
    """One line an operator can paste into a bug report."""
    return (
        f"tracedeck {_version('tracedeck')} (from {SOURCE}; Python {platform.python_version()}, "
        f"textual {_version('textual')}, asyncssh {_version('asyncssh')})"
    )


class VersionAction(argparse.Action):
    """Prints version_text() unwrapped (argparse's own version action wraps it) and exits 0."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]  # noqa: ANN001
        print(version_text())
        parser.exit(0)
