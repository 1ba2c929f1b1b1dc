"""The tests' forked CLI (tests/cli_forks.py) is the CLI: the same output and exit status as a
fresh `python -m console.cli`, in the caller's environment, directory and stdin, and a fresh
process wherever the interpreter's start would differ."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_forks import ROOT, Forks
from runhelp import cli_env, held_engine, spawn, tracedeck, wait_for, write_lines_preset

pytestmark = pytest.mark.e2e


@pytest.fixture
def forks() -> Iterator[Forks]:
    server = Forks()
    yield server
    server.close()


@pytest.mark.parametrize(
    "args",
    [
        ["--version"],
        ["presets"],
        ["run", "no_such_preset"],
        ["analyze", "/nonexistent/tree"],
        ["history", "--json"],
        ["run", "hello_command", "--set", "matrix.n=[1]"],
        ["run", "hello_command", "--target", "ssh://nobody@127.0.0.1:1", "--set", "matrix.n=[1]"],
        ["doctor"],
    ],
    ids=[
        "version",
        "presets",
        "unknown-preset",
        "analyze-missing",
        "history",
        "a-run",
        "an-ssh-run-refused",
        "doctor",
    ],  # fmt: skip
)
def test_a_forked_command_says_what_a_fresh_one_says(
    args: list[str], forks: Forks, tmp_path: Path
) -> None:
    env = cli_env(tmp_path)
    got, want = forks.run(args, env, 120), tracedeck(*args, env=env, fresh=True)
    assert (got.returncode, got.stderr) == (want.returncode, want.stderr)
    if args[:2] == ["run", "hello_command"]:  # its lines hold its run id and times
        assert got.stdout.splitlines()[-1:] == want.stdout.splitlines()[-1:]
        assert "--target" in args or got.stdout.splitlines()[-1] == "RESULT: PASS (exit 0)"
    else:
        assert got.stdout == want.stdout


def test_the_command_has_the_callers_environment_argv_and_stdin(tmp_path: Path) -> None:
    probe = tmp_path / "probe.toml"
    probe.write_text(
        """[preset]
name = "probe"
kind = "command"
description = "says where it runs"

[target]
host = "local"
runs = "{runs}"
lock = "{lock}"

[engine]
command = "sh -c 'echo home=$HOME marker=$FORKS_MARKER'"

[matrix]
n = [1]
""".format(runs=tmp_path / "runs", lock=tmp_path / "gpu.lock")
    )
    env = cli_env(tmp_path, FORKS_MARKER="m-1")
    done = tracedeck("run", str(probe), "--out", str(tmp_path / "out"), env=env)
    assert done.returncode == 0, done.stderr
    assert f"home={tmp_path} marker=m-1" in done.stdout
    # the next command sees its own environment, not the first one's
    env2 = cli_env(tmp_path / "other", FORKS_MARKER="m-2")
    (tmp_path / "other").mkdir()
    done = tracedeck("run", str(probe), "--out", str(tmp_path / "out"), env=env2)
    assert f"home={tmp_path / 'other'} marker=m-2" in done.stdout


def test_a_command_past_its_timeout_is_killed_and_raised_as_subprocess_does(
    forks: Forks, tmp_path: Path
) -> None:
    marker = f"FORKS_TIMEOUT_MARK=m{os.getpid()}"
    env = cli_env(tmp_path, FORKS_TIMEOUT_MARK=marker.split("=")[1])
    (tmp_path / "empty").mkdir()
    with pytest.raises(subprocess.TimeoutExpired):  # watch with no --idle follows forever
        forks.run(["watch", str(tmp_path / "empty"), "--headless"], env, 2)

    server = str(forks.pid)  # started with this environment

    def alive() -> list[str]:
        found = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            if environ.parent.name == server:
                continue
            try:
                if marker.encode() in environ.read_bytes().split(b"\0"):
                    found.append(environ.parent.name)
            except OSError:
                continue
        return found

    wait_for(lambda: not alive(), 30, "the timed-out command to be gone")


def test_an_interpreter_setting_of_its_start_makes_a_fresh_process(
    forks: Forks, tmp_path: Path
) -> None:
    env = cli_env(tmp_path)
    forks.run(["--version"], env, 60)  # starts the server with this environment
    assert forks.forkable(dict(env))
    assert not forks.forkable({**env, "PYTHONPATH": str(tmp_path)})
    assert not forks.forkable({**env, "LC_ALL": "C"})
    plugins = tmp_path / "plugins"
    (plugins / "runners" / "kinds").mkdir(parents=True)
    (plugins / "runners" / "kinds" / "zz_seen.py").write_text("raise RuntimeError('zz seen')\n")
    # with a kind package on PYTHONPATH, tracedeck() starts a fresh process, which sees it
    done = tracedeck("presets", env={**env, "PYTHONPATH": f"{ROOT}{os.pathsep}{plugins}"})
    assert "zz seen" in done.stdout + done.stderr


def test_a_started_command_signalled_ends_as_a_fresh_one_does(tmp_path: Path) -> None:
    """spawn()'s forked process: running (poll None) until Ctrl-C, which cancels its run, then
    the same exit status and verdict as a fresh process given the same Ctrl-C."""
    ended = []
    for fresh_one in (False, True):
        folder = tmp_path / ("fresh" if fresh_one else "forked")
        folder.mkdir()
        held, _release = held_engine(folder)
        preset = write_lines_preset(folder)
        out = folder / "out"
        proc = spawn(
            "run", str(preset), *held, "--out", str(out), env=cli_env(folder), fresh=fresh_one
        )
        try:
            wait_for(lambda o=out: any(o.glob("**/run.json")), 60, "the run started")
            wait_for(lambda o=out: "output" in events_text(o), 60, "the run's first lines")
            assert proc.poll() is None
            proc.send_signal(signal.SIGINT)
            out_text, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        ended.append((proc.returncode, out_text.splitlines()[-1:]))
    assert ended[0] == ended[1]
    assert ended[0][0] != 0 and "CANCELLED" in ended[0][1][0], ended


def events_text(out: Path) -> str:
    return "".join(p.read_text() for p in out.glob("**/events.jsonl"))


def test_communicate_after_the_command_ended_gives_its_output_as_popen_does(
    tmp_path: Path,
) -> None:
    """Its pipes already at their end when communicate() starts (the adversarial review's case:
    it raised 'I/O operation on closed file')."""
    proc = spawn("run", "no_such_preset", env=cli_env(tmp_path))
    assert proc.wait(timeout=60) == 2
    out, err = proc.communicate(timeout=60)
    assert out == "" and "no_such_preset" in err


END_CASES = [
    # (what the command does before its end, its exit code, stdout, stderr) as Python ends it
    ("print('out', end='')", "0", "out", ""),
    ("pass", "None", "", ""),
    ("pass", "3", "", ""),
    ("pass", "'words'", "", "words\n"),
    ("atexit.register(lambda: print('atexit'))", "0", "atexit\n", ""),
    (
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()",
        "0",
        "thread\n",
        "",
    ),  # fmt: skip
    # garbage the command left, whose finalizer speaks: it still does
    (
        "gc.disable(); G = type('G', (), {'__del__': lambda s: print('finalized')}); g = G(); g.me = g; del g",
        "0",
        "finalized\n",
        "",
    ),  # fmt: skip
]


@pytest.mark.parametrize(("before", "code", "out", "err"), END_CASES)
def test_a_forked_command_ends_as_the_interpreter_would_end_it(
    before: str, code: str, out: str, err: str
) -> None:
    """cli_forks._end (os._exit after what shutdown does that anyone sees) against the
    interpreter's own end, on the same few lines: the same code, stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = str(ROOT / "tests")
    head = "import atexit, gc, sys, threading, time\n" + before + "\n"
    ends = {
        "python": head + f"sys.exit({code})\n",
        "_end": head + f"import cli_forks; cli_forks._end({code})\n",
    }
    for how, source in ends.items():
        done = subprocess.run(
            [sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=60
        )
        got = (done.returncode, done.stdout, done.stderr)
        rc = {"None": 0, "'words'": 1}[code] if code in ("None", "'words'") else int(code)
        assert got == (rc, out, err), (how, got)
