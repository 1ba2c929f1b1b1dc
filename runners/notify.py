"""The operator's [notify] command, run when a headless run ends, so a failed cron run reaches
someone: `COMMAND RUN_ID PRESET VERDICT EXIT_CODE REPORT`, each argument shell-quoted."""

from __future__ import annotations

import shlex
import subprocess
from typing import Any

DEFAULT_TIMEOUT_S = 60.0


def notify_command(config: dict[str, Any], args: list[str]) -> str | None:
    """The shell line to run, or None when the config has no [notify] command."""
    command = (config.get("notify") or {}).get("command")
    if not command:
        return None
    return command + " " + " ".join(shlex.quote(a) for a in args)


def run_notify(config: dict[str, Any], args: list[str]) -> str:
    """Run the [notify] command; '' when it ran and exited 0 (or there is none), else why not.

    Its output goes to this process's stderr (a cron mail shows it); it never changes the
    run's exit code: the run's verdict is what it is whether or not someone was told.
    """
    line = notify_command(config, args)
    if line is None:
        return ""
    timeout = float((config.get("notify") or {}).get("timeout_s", DEFAULT_TIMEOUT_S))
    try:
        done = subprocess.run(
            ["/bin/sh", "-c", line], stdin=subprocess.DEVNULL, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return f"[notify] command did not end within {timeout:g}s and was stopped: {line}"
    except OSError as exc:
        return f"[notify] command could not start ({exc.strerror}): {line}"
    if done.returncode != 0:
        return f"[notify] command exited {done.returncode}: {line}"
    return ""
