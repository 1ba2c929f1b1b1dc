"""Helpers for tests that run the real `tracedeck` CLI in a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from cli_forks import Forks
from patience import patience

ROOT = Path(__file__).resolve().parent.parent

LINES_PRESET = """
[preset]
name = "lines"
kind = "command"
description = "numbered output lines, slowly"

[target]
runs = "{runs}"
lock = "{lock}"
reconnect_attempts = {attempts}
connect_timeout_s = 5
keepalive_s = 1

[engine]
command = "sh -c 'i=1; while [ $i -le $1 ]; do echo \\"cell $2 line $i\\"; i=$((i+1)); [ $3 = 0 ] || sleep $3; done; exit $4' x {{lines}} {{n}} {{pause}} {{rc}}"

[matrix]
n = [1, 2, 3]
lines = [{lines}]
pause = [{pause}]
rc = [0]
"""


def write_lines_preset(
    tmp: Path, *, lines: int = 5, pause: float = 0.05, attempts: int = 5, lock: Path | None = None
) -> Path:
    path = tmp / "lines.toml"
    path.write_text(
        LINES_PRESET.format(
            runs=tmp / "remote-runs",
            lock=lock or tmp / "gpu.lock",
            attempts=attempts,
            lines=lines,
            pause=pause,
        )
    )
    return path


HELD_ENGINE = """i=1
while [ $i -le 5 ]; do echo "cell $1 line $i"; i=$((i+1)); done
while [ ! -e {release} ]; do sleep 0.05; done
echo "cell $1 released"
"""


def held_engine(tmp: Path) -> tuple[list[str], Path]:
    """--set options making each cell print five lines, then wait until the test creates the
    returned release file (so a run goes on exactly as long as the test needs it to)."""
    release = tmp / "release"
    script = tmp / "held.sh"
    script.write_text(HELD_ENGINE.format(release=release))
    return ["--set", f"engine.command='sh {script} {{n}}'"], release


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HOME=str(home), TRACEDECK_HOME=str(home / "td"), PYTHONUNBUFFERED="1", **extra)
    return env


_FORKS = Forks()


def tracedeck(
    *args: str, env: dict[str, str], timeout: float = 120, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`tracedeck ARGS` to its end, output captured: forked from a server that has imported the
    CLI already (tests/cli_forks.py), or a fresh `python -m console.cli` (fresh, or where the
    environment asks for one the server cannot be, or TRACEDECK_TEST_FRESH=1 in the tests')."""
    if not (fresh or os.environ.get("TRACEDECK_TEST_FRESH")) and _FORKS.forkable(env):
        return _FORKS.run(list(args), env, patience(timeout))
    return subprocess.run(
        [sys.executable, "-m", "console.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=patience(timeout),
    )


def spawn(*args: str, env: dict[str, str], fresh: bool = False) -> subprocess.Popen[str]:
    """`tracedeck ARGS` started, its output on pipes: forked as tracedeck() is, or a fresh
    process (fresh: a test of the program's own start, its imports and what they record)."""
    if not (fresh or os.environ.get("TRACEDECK_TEST_FRESH")) and _FORKS.forkable(env):
        return _FORKS.start(list(args), env)  # type: ignore[return-value]
    return subprocess.Popen(
        [sys.executable, "-m", "console.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def events(local_dir: Path) -> list[dict[str, Any]]:
    path = local_dir / "events.jsonl"
    if not path.exists():
        return []
    data = path.read_bytes()
    return [orjson.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


def run_dirs(out: Path) -> list[Path]:
    return sorted(p.parent for p in out.glob("**/run.json"))


def wait_for(predicate: Callable[[], Any], timeout: float = 60, what: str = "condition") -> Any:
    timeout = patience(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_until_held(lock: Path, timeout: float = 60) -> None:
    """Wait until another process holds lock (a non-blocking flock on it fails)."""

    def held() -> bool:
        return subprocess.run(["flock", "-n", str(lock), "true"]).returncode != 0

    wait_for(held, timeout, what=f"a process to hold {lock}")


def output_lines(evts: list[dict[str, Any]]) -> list[str]:
    return [line for e in evts if e["type"] == "output" for line in e["lines"]]


def live_processes() -> list[tuple[int, int, list[str]]]:
    """(pid, process group, environment) of every process that is not a zombie."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] != b"Z":
            out.append((int(entry.name), int(fields[2]), [e.decode(errors="replace") for e in env]))
    return out


def pid_alive(pid: int) -> bool:
    """Is the process there and not a zombie?"""
    return any(p == pid for p, _, _ in live_processes())


def group_alive(pgid: int) -> bool:
    """Does a process of the group live? Zombies (reaped later by PID 1) do not count."""
    return any(group == pgid for _, group, _ in live_processes())


def run_alive(run_id: str) -> bool:
    """Does any process of the run live, in its group or escaped from it (its marker says)?"""
    marker = f"TRACEDECK_RUN_ID={run_id}"
    return any(marker in env for _, _, env in live_processes())


def notifier_alive(run_id: str) -> bool:
    """Does the change notifier of the run (runners/changes.py) still run on the target?"""
    mark = f"tracedeck-changes={run_id}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if mark in (entry / "cmdline").read_bytes():
                    return True
    return False


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


TOY_ENGINE = ROOT / "tests" / "engines" / "toy.py"


def toy_command(preset: str) -> str:
    """A shipped preset's engine.command with the torch reference engine swapped for the toy
    engine (tests/engines/toy.py: the same flags, the same files, no torch)."""
    from runners.kinds import load_preset
    from runners.presets import resolve_preset

    command = load_preset(resolve_preset(preset)).section("engine")["command"]
    assert "-m runners.reference " in command, f"{preset} does not run the reference engine"
    return command.replace("-m runners.reference ", f"{TOY_ENGINE} ")


def toy_override(preset: str) -> str:
    """The override (key=TOML value) that runs a shipped preset on the toy engine."""
    return f"engine.command={json.dumps(toy_command(preset))}"


def toy_engine(preset: str) -> list[str]:
    """--set arguments that run a shipped preset on the toy engine."""
    return ["--set", toy_override(preset)]


def python_without_numpy(tmp: Path) -> Path:
    """A python whose site-packages lack numpy: a venv of its own (-S alone no longer hides
    site-packages from a judge, which puts them on its path itself)."""
    venv = tmp / "py-without-numpy"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"
