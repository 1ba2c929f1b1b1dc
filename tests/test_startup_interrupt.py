"""Issue 21.4: Ctrl-C while `tracedeck run` starts up: nothing launches (one line, exit 130), or
the run that did launch is cancelled; never a traceback, never a run left going.

The start-up phases (imports, preset loading, the record, connecting, uploading) have no marker
of their own, so the interrupt is swept over several delays counted from the first observable
point: the process has mapped asyncio's C module, which cli.py imports only after it began
recording Ctrl-C. The invariant is asserted for each delay.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import orjson
import pytest
from faults import assert_run_gone, lock_free
from patience import patience
from runhelp import cli_env, run_dirs, spawn, wait_for, write_lines_preset

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)


def started_python(pid: int) -> bool:
    try:
        return "_asyncio" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return True  # it already ended: the assertions say how


def ignores_sigint(pid: int) -> bool:
    """Was the process started with SIGINT ignored (inherited SIG_IGN)? /proc's SigIgn mask."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(
        int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigIgn:")
    )
    return bool(mask & (1 << (signal.SIGINT - 1)))


@pytest.mark.parametrize("delay", [0.0, 0.1, 0.25, 0.5, 0.8, 1.2, 2.0])
def test_ctrl_c_during_start_up_launches_nothing_or_cancels(tmp_path: Path, delay: float) -> None:
    home = tmp_path / "home"
    home.mkdir()
    preset = write_lines_preset(tmp_path, lines=400, pause=0.05)
    out = tmp_path / "out"
    console = spawn(
        "run", str(preset), "--target", "local", "--out", str(out), env=cli_env(home), fresh=True
    )
    try:
        wait_for(lambda: started_python(console.pid), what="the program's imports")
        assert not ignores_sigint(console.pid), "the console was started with Ctrl-C ignored"
        time.sleep(delay)  # the sweep: where in the start-up the interrupt lands
        console.send_signal(signal.SIGINT)
        stdout, stderr = console.communicate(timeout=patience(90))
    finally:
        if console.poll() is None:
            console.kill()
            console.communicate()
    said = stdout + stderr
    assert console.returncode == 130, said
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said
    remote = tmp_path / "remote-runs"
    launched = [d for d in remote.glob("*") if (d / "pgid").exists()] if remote.is_dir() else []
    if not launched:
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, said
        assert "nothing was launched" in lines[0] or "never started" in lines[0], said
        assert lock_free(str(tmp_path / "gpu.lock"))
        assert not run_dirs(out) or all(
            not (d / "events.jsonl").exists()
            or b'"run_finished"' in (d / "events.jsonl").read_bytes()
            for d in run_dirs(out)
        ), said
    else:
        local = run_dirs(out)[0]
        finished = [
            e
            for e in map(orjson.loads, (local / "events.jsonl").read_bytes().splitlines())
            if e["type"] == "run_finished"
        ]
        assert finished and finished[-1]["verdict"] == "CANCELLED", said
        assert_run_gone(local)


def test_ctrl_c_has_a_handler_from_the_launch_to_the_follow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between the launch's Ctrl-C handler and the follow's, SIGINT was back to Python's
    default: a Ctrl-C there raised KeyboardInterrupt, `tracedeck run` exited 130 without a
    word and the run went on (seen once in CI at delay 0.25). The follow now starts with the
    launch's handler still in place."""
    import asyncio
    from types import SimpleNamespace

    from console import cli

    seen: list[object] = []

    class Session:
        stage = "started"
        record = SimpleNamespace(run_id="r")
        local_dir = Path("/nowhere")

        async def launch(self) -> None:
            return None

        async def follow(self) -> SimpleNamespace:
            return SimpleNamespace(exit_code=0)

        async def close(self) -> None:
            return None

    follow = cli._follow_interruptible

    async def watched(session: object, cancelling: object = None) -> int:
        seen.append(signal.getsignal(signal.SIGINT))  # what a Ctrl-C now would meet
        return await follow(session, cancelling)

    monkeypatch.setattr(cli, "_follow_interruptible", watched)
    assert asyncio.run(cli._launch_and_follow(Session())) == 0
    assert seen and seen[0] is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # and given back
