"""Ctrl-C while the `tracedeck` program starts: recorded, never raised inside an import.

A KeyboardInterrupt raised inside Python's import machinery can be swallowed (the run then
launched anyway) or escape as a raw traceback. The program records interrupts from its first
import on; `run` checks before it launches anything, so an interrupt before the launch means
nothing launches, with one line saying so and exit 130.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType

_interrupts: list[int] = []
_recording = False


def _record(signum: int, frame: FrameType | None) -> None:
    _interrupts.append(signum)


def is_program(module_name: str) -> bool:
    """Is this process the `tracedeck` program (not an importer such as the test suite)?"""
    return module_name == "__main__" or Path(sys.argv[0]).name == "tracedeck"


def installed_as_program(module_name: str) -> bool:
    """Start recording Ctrl-C when this process is the `tracedeck` program (not an importer such
    as the test suite); True when recording."""
    global _recording
    if (
        is_program(module_name)
        and not _recording
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, _record)
        _recording = True
    return _recording


def interrupted() -> bool:
    """Did a Ctrl-C come while recording?"""
    return bool(_interrupts)


def stop_recording_interrupts(restore: bool = True) -> None:
    """Ctrl-C raises KeyboardInterrupt again (restore), or someone else's handler took over."""
    global _recording
    if _recording and restore:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _recording = False
