"""A host whose login shell says things before every command (an rc file that greets, warns,
loads modules): every command tracedeck runs there reads its own output, not the rc's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import enter_ssh_home, rc_host
from faults import assert_run_gone
from runhelp import (
    cli_env,
    events,
    output_lines,
    run_dirs,
    spawn,
    toy_engine,
    tracedeck,
    wait_for,
    write_lines_preset,
)
from sshd import SshServer, make_ssh_home

pytestmark = pytest.mark.ssh

# What such rc files print, on both streams, with what a parser might take for its own: digits
# alone on a line (a pid?), a word tracedeck prints, JSON.
RC = """echo "Welcome to gpu-node-7 (ROCm 6.2)"
echo 4242
echo TRACEDECK_CANCELLED
echo '{"run_id": "nobody"}'
echo "module: rocm/6.2 loaded" >&2
echo 4343 >&2
unset BASH_ENV
"""


@pytest.fixture(scope="module")
def noisy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    with rc_host(tmp_path_factory.mktemp("noisy"), RC) as server:
        yield server


def _home(server: SshServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return enter_ssh_home(server, tmp_path / "home", monkeypatch).path


def test_the_rc_really_speaks_before_each_command(noisy: SshServer, tmp_path: Path) -> None:
    """(the fixture is what it says: without this the tests below would prove nothing)"""
    home = make_ssh_home(noisy, tmp_path / "home")
    done = subprocess.run(
        ["ssh", "-F", str(home.config), "-o", f"UserKnownHostsFile={home.known_hosts}",
         home.alias, "echo mine"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.stdout.splitlines() == [
        "Welcome to gpu-node-7 (ROCm 6.2)", "4242", "TRACEDECK_CANCELLED", '{"run_id": "nobody"}',
        "mine",
    ], done.stdout  # fmt: skip
    assert "module: rocm/6.2 loaded" in done.stderr


def test_a_run_its_status_and_its_cancel_read_only_their_own_output(
    noisy: SshServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = _home(noisy, tmp_path, monkeypatch)
    env = cli_env(home)
    spec = noisy.spec
    out = tmp_path / "out"
    # a B3.67 smoke judged on the host (its python: the judge's own output is parsed)
    done = tracedeck(
        "run", "b3_67_smoke", "--target", spec, "--out", str(out),
        "--set", f'target.python="{sys.executable}"', "--set", "matrix.seed=[0]",
        *toy_engine("b3_67_smoke"), env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: PASS_GUARDRAIL (exit 0)" in done.stdout, done.stdout
    assert "Welcome" not in done.stdout + done.stderr
    # a slow run: status names its lock holder; cancel stops it and says so truly
    preset = write_lines_preset(tmp_path, lines=400, pause=0.05)
    slow_out = tmp_path / "slow"
    console = spawn("run", str(preset), "--target", spec, "--out", str(slow_out), env=env)
    cancelled = False
    try:
        local_dir = wait_for(lambda: run_dirs(slow_out), what="run dir")[0]
        wait_for(lambda: len(output_lines(events(local_dir))) >= 2, what="output")
        run_id = json.loads((local_dir / "run.json").read_text())["run_id"]
        status = tracedeck("status", "--json", "--out", str(slow_out), "--host", spec, env=env)
        assert status.returncode == 0, status.stdout + status.stderr
        doc = json.loads(status.stdout)
        [run] = doc["runs"]
        assert run["state"] == "live" and run["run_id"] == run_id, run
        held = {(lk["state"], lk["holder"]["run_id"]) for lk in doc["locks"]}
        assert held == {("held", run_id)}, doc["locks"]
        console.send_signal(signal.SIGKILL)  # nobody follows it: cancel records its end
        console.communicate()
        cancel = tracedeck("cancel", str(local_dir), "--grace", "2", env=env)
        cancelled = True
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert "ended CANCELLED" in cancel.stdout, cancel.stdout
        final = [e for e in events(local_dir) if e["type"] == "run_finished"]
        assert final[-1]["verdict"] == "CANCELLED", final
        assert not any(
            "4242" in line or "Welcome" in line for line in output_lines(events(local_dir))
        )
        assert_run_gone(local_dir)
    finally:
        if console.poll() is None:
            console.kill()
            console.communicate()
        for left in run_dirs(slow_out) if not cancelled else []:  # a failure leaves no run
            tracedeck("cancel", str(left), "--grace", "1", env=env)


def test_an_rc_that_ends_the_session_is_said_never_a_silent_empty_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An rc that exits (or execs another program) before the command: tracedeck would read an
    empty answer (no pids: the run is over; no lock holder: the lock is free) where the command
    never ran. It says so, naming the host."""
    with rc_host(tmp_path / "host", "echo 'this node is drained'\nexit 0\n") as server:
        env = cli_env(_home(server, tmp_path, monkeypatch))
        preset = write_lines_preset(tmp_path, lines=2, pause=0.01)
        done = tracedeck("run", str(preset), "--target", server.spec, "--out", str(tmp_path / "o"), env=env)  # fmt: skip
        assert done.returncode != 0, done.stdout + done.stderr
        said = done.stdout + done.stderr
        assert f"the login shell on {server.user}@{server.host}:{server.port} never ran" in said
        assert "this node is drained" in said


SFTP_SERVER = Path("/usr/lib/openssh/sftp-server")


@pytest.mark.parametrize("rc_text", ["", "echo 'Welcome to gpu-node-7'\n"])
def test_an_sftp_server_started_through_a_talkative_login_shell_is_named_for_it(
    rc_text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sshd starts an sftp server program (Debian's default subsystem) through the login shell:
    text the rc prints lands where the SFTP protocol begins. tracedeck said 'refused an SFTP
    session (Max packet size exceeded); enable the sftp subsystem', which was enabled; it now
    says what the rc printed and the two ways out. A quiet rc with that server runs."""
    if not SFTP_SERVER.exists():
        pytest.skip(f"{SFTP_SERVER} is missing: install openssh-server")
    with rc_host(tmp_path / "host", rc_text + "unset BASH_ENV\n", sftp=str(SFTP_SERVER)) as server:
        env = cli_env(_home(server, tmp_path, monkeypatch))
        preset = write_lines_preset(tmp_path, lines=2, pause=0.01)
        done = tracedeck("run", str(preset), "--target", server.spec, "--out", str(tmp_path / "o"), env=env)  # fmt: skip
        said = done.stdout + done.stderr
        if not rc_text:
            assert done.returncode == 0, said
            return
        assert done.returncode != 0, said
        assert "whose startup files print 'Welcome to gpu-node-7'" in said, said
        assert "internal-sftp" in said and "case $- in" in said, said
