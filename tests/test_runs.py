"""Headless runs end to end, on the local target and over a real OpenSSH sshd on loopback."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import orjson
import pytest
from conftest import Where
from faults import assert_run_gone
from patience import patience
from runhelp import (
    cli_env,
    events,
    group_alive,
    kill_group,
    output_lines,
    run_dirs,
    spawn,
    tracedeck,
    wait_for,
    write_lines_preset,
)
from sshd import CuttableProxy, SshHome, SshServer

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)


def expected_lines(lines: int) -> list[str]:
    return [f"cell {n} line {i}" for n in (1, 2, 3) for i in range(1, lines + 1)]


def remote_pgid(local_dir: Path) -> int:
    record = orjson.loads((local_dir / "run.json").read_bytes())
    return int((Path(record["remote_dir"]) / "pgid").read_text())


def test_run_passes_and_records_every_line(where: Where, tmp_path: Path) -> None:
    preset = write_lines_preset(tmp_path, lines=4, pause=0.01)
    out = tmp_path / "out"
    done = tracedeck(
        "run", str(preset), "--target", where.spec, "--out", str(out), env=cli_env(where.home)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: PASS (exit 0)" in done.stdout
    [local_dir] = run_dirs(out)
    evts = events(local_dir)
    assert output_lines(evts) == expected_lines(4)
    assert [e["state"] for e in evts if e["type"] == "cell_finished"] == ["passed"] * 3
    started = next(e for e in evts if e["type"] == "run_started")
    assert started["target"] == (where.spec if where.spec != "local" else "local")

    replay = tracedeck("replay", str(local_dir), "--headless", env=cli_env(where.home))
    assert replay.returncode == 0
    assert replay.stdout == done.stdout  # a recorded run prints as it was printed live

    as_json = tracedeck("replay", str(local_dir), "--headless", "--json", env=cli_env(where.home))
    types = [orjson.loads(line)["type"] for line in as_json.stdout.splitlines()]
    assert types[0] == "run_started" and types[-1] == "run_finished"


def test_failing_cell_fails_the_run_and_shows_stderr(where: Where, tmp_path: Path) -> None:
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    done = tracedeck(
        "run",
        str(preset),
        "--target",
        where.spec,
        "--out",
        str(tmp_path / "out"),
        "--set",
        "matrix.rc=[3]",
        "--set",
        "engine.command='echo boom-on-stderr >&2; exit {rc}'",
        env=cli_env(where.home),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    # cells are named as the headless lines number them: 1-based, out of the total
    assert (
        "cell 1/3 (n=1 lines=1 pause=0 rc=3) exited 3; stderr ends: boom-on-stderr" in done.stdout
    )
    assert "RESULT: FAIL (exit 1)" in done.stdout


def test_hostile_values_are_data_never_run(where: Where, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    hostile = f'["x; touch {marker}", "$(touch {marker})", "`touch {marker}`"]'
    done = tracedeck(
        "run",
        str(preset),
        "--target",
        where.spec,
        "--out",
        str(tmp_path / "out"),
        "--set",
        f"matrix.n={hostile}",
        "--set",
        f'vars.v="; touch {marker}"',
        "--set",
        "engine.command='echo {n}{v}'",
        env=cli_env(where.home),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"x; touch {marker}; touch {marker}" in done.stdout
    assert not marker.exists()


def test_second_run_on_a_held_lock_exits_3_naming_the_holder(where: Where, tmp_path: Path) -> None:
    lock = tmp_path / "gpu.lock"
    # The first run's cells wait for `release`: it holds the lock until the test says, however
    # long the second console takes to start on a loaded machine.
    release = tmp_path / "release"
    slow = write_lines_preset(tmp_path, lines=1, pause=0, lock=lock)
    text = slow.read_text()
    slow.write_text(
        text.replace("sh -c '", f"sh -c 'until [ -e {release} ]; do sleep 0.05; done; ")
    )
    env = cli_env(where.home)
    first = spawn("run", str(slow), "--target", where.spec, "--out", str(tmp_path / "a"), env=env)
    try:
        local_a = wait_for(lambda: run_dirs(tmp_path / "a"), what="first run dir")[0]
        wait_for(
            lambda: any(e["type"] == "lock_acquired" for e in events(local_a)),
            what="first run to hold the lock",
        )
        run_a = events(local_a)[0]["run_id"]
        second = tracedeck(
            "run", str(slow), "--target", where.spec, "--out", str(tmp_path / "b"), env=env
        )
        assert second.returncode == 3, second.stdout + second.stderr
        assert run_a in second.stderr and "user=" in second.stderr
        assert "lock busy" in second.stdout
    finally:
        release.touch()
        out, err = first.communicate(timeout=patience(120))
    assert first.returncode == 0, out + err
    # The kernel released the lock when the first run ended: no cleanup needed.
    third = tracedeck(
        "run",
        str(write_lines_preset(tmp_path, lines=1, pause=0, lock=lock)),
        "--target",
        where.spec,
        "--out",
        str(tmp_path / "c"),
        env=env,
    )
    assert third.returncode == 0, third.stdout + third.stderr


def test_console_killed_then_attach_shows_every_line_once(where: Where, tmp_path: Path) -> None:
    preset = write_lines_preset(tmp_path, lines=15, pause=0.05)
    env = cli_env(where.home)
    out = tmp_path / "out"
    console = spawn("run", str(preset), "--target", where.spec, "--out", str(out), env=env)
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    wait_for(lambda: len(output_lines(events(local_dir))) >= 5, what="some output")
    console.send_signal(signal.SIGKILL)
    console.communicate()
    pgid = remote_pgid(local_dir)
    wait_for(lambda: not group_alive(pgid), timeout=60, what="the run to finish on its own")

    attach = tracedeck("attach", str(local_dir), env=env)
    assert attach.returncode == 0, attach.stdout + attach.stderr
    shown = [line.split("| ", 1)[1] for line in attach.stdout.splitlines() if "] | " in line]
    assert Counter(shown) == Counter(expected_lines(15))
    assert output_lines(events(local_dir)) == expected_lines(15)
    assert "RESULT: PASS (exit 0)" in attach.stdout
    again = tracedeck("attach", str(local_dir), env=env)  # a finished run: replay, same result
    assert again.returncode == 0 and again.stdout == attach.stdout
    assert_run_gone(local_dir)


def test_cancel_kills_the_whole_group_and_records_cells(where: Where, tmp_path: Path) -> None:
    preset = write_lines_preset(tmp_path, lines=400, pause=0.05)
    env = cli_env(where.home)
    out = tmp_path / "out"
    console = spawn("run", str(preset), "--target", where.spec, "--out", str(out), env=env)
    try:
        local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(lambda: len(output_lines(events(local_dir))) >= 2, what="output")
        pgid = remote_pgid(local_dir)
        console.send_signal(signal.SIGKILL)
        console.communicate()
        assert group_alive(pgid)
        cancel = tracedeck("cancel", str(local_dir), "--grace", "2", env=env)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert "ended CANCELLED" in cancel.stdout
        assert not group_alive(pgid)
        states = [e["state"] for e in events(local_dir) if e["type"] == "cell_finished"]
        assert states == ["cancelled"] * 3
        final = [e for e in events(local_dir) if e["type"] == "run_finished"]
        assert final[-1]["verdict"] == "CANCELLED" and final[-1]["exit_code"] == 130
        assert_run_gone(local_dir)
    finally:
        if console.poll() is None:
            console.kill()


def test_ctrl_c_cancels_the_run_and_exits_130(tmp_path: Path) -> None:
    preset = write_lines_preset(tmp_path, lines=400, pause=0.05)
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "out"
    console = spawn("run", str(preset), "--out", str(out), env=cli_env(home))
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    wait_for(lambda: len(output_lines(events(local_dir))) >= 2, what="output")
    pgid = remote_pgid(local_dir)
    console.send_signal(signal.SIGINT)
    stdout, stderr = console.communicate(timeout=patience(60))
    try:
        assert console.returncode == 130, stdout + stderr
        assert "RESULT: CANCELLED (exit 130)" in stdout
        assert not group_alive(pgid)
        assert_run_gone(local_dir)
    finally:
        kill_group(pgid)


@pytest.mark.ssh
def test_dropped_link_is_resumed_without_loss_or_repeat(
    ssh_proxy: CuttableProxy, ssh_home: SshHome, tmp_path: Path
) -> None:
    preset = write_lines_preset(tmp_path, lines=30, pause=0.05)
    env = cli_env(ssh_home.path)
    out = tmp_path / "out"
    console = spawn("run", str(preset), "--target", ssh_proxy.spec, "--out", str(out), env=env)
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    wait_for(lambda: len(output_lines(events(local_dir))) >= 5, what="output")
    ssh_proxy.cut()
    stdout, stderr = console.communicate(timeout=patience(120))
    assert console.returncode == 0, stdout + stderr
    assert "connection lost" in stdout and "connection restored" in stdout
    assert output_lines(events(local_dir)) == expected_lines(30)
    assert_run_gone(local_dir)


@pytest.mark.ssh
def test_link_down_for_good_exits_3_then_attach_completes(
    ssh_proxy: CuttableProxy, ssh_home: SshHome, tmp_path: Path
) -> None:
    preset = write_lines_preset(tmp_path, lines=20, pause=0.05, attempts=2)
    env = cli_env(ssh_home.path)
    out = tmp_path / "out"
    console = spawn("run", str(preset), "--target", ssh_proxy.spec, "--out", str(out), env=env)
    local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
    wait_for(lambda: len(output_lines(events(local_dir))) >= 3, what="output")
    ssh_proxy.pause()
    ssh_proxy.cut()
    stdout, stderr = console.communicate(timeout=patience(120))
    assert console.returncode == 3, stdout + stderr
    assert f"tracedeck attach {local_dir}" in stdout
    ssh_proxy.resume()
    pgid = remote_pgid(local_dir)
    wait_for(lambda: not group_alive(pgid), what="run to finish")
    attach = tracedeck("attach", str(local_dir), env=env)
    assert attach.returncode == 0, attach.stdout + attach.stderr
    assert output_lines(events(local_dir)) == expected_lines(20)
    shown = [line.split("| ", 1)[1] for line in attach.stdout.splitlines() if "] | " in line]
    assert shown == expected_lines(20)
    assert_run_gone(local_dir)


@pytest.mark.ssh
def test_unknown_host_key_is_refused_with_fingerprint(sshd: SshServer, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    key = home / ".ssh" / "id_ed25519"
    key.write_bytes(sshd.client_key.read_bytes())
    key.chmod(0o600)
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    done = tracedeck(
        "run", str(preset), "--target", sshd.spec, "--out", str(tmp_path / "out"), env=cli_env(home)
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert sshd.fingerprint in done.stderr
    assert f"tracedeck trust 127.0.0.1:{sshd.port}" in done.stderr
    refused = tracedeck("trust", f"127.0.0.1:{sshd.port}", env=cli_env(home))
    assert refused.returncode == 2 and sshd.fingerprint in refused.stdout  # no tty, no --yes
    trusted = tracedeck("trust", f"127.0.0.1:{sshd.port}", "--yes", env=cli_env(home))
    assert trusted.returncode == 0, trusted.stdout + trusted.stderr
    again = tracedeck(
        "run", str(preset), "--target", sshd.spec, "--out", str(tmp_path / "o2"), env=cli_env(home)
    )
    assert again.returncode == 0, again.stdout + again.stderr


def test_presets_command_lists_shipped_presets(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    listed = tracedeck("presets", env=cli_env(home))
    assert listed.returncode == 0, listed.stderr
    assert "hello_command" in listed.stdout and "command" in listed.stdout


def test_bad_preset_exits_2_naming_file_and_key(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    preset = write_lines_preset(tmp_path)
    done = tracedeck("run", str(preset), "--set", "matrix.n=5", env=cli_env(home))
    assert done.returncode == 2
    assert str(preset) in done.stderr and "matrix.n" in done.stderr


@pytest.mark.parametrize("setup_rc", [0, 4])
def test_setup_runs_once_before_the_cells_and_is_judged_like_one(
    tmp_path: Path, setup_rc: int
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    out = tmp_path / "out"
    step = f"echo building-once; echo build-log-tail >&2; exit {setup_rc}"
    done = tracedeck(
        "run",
        str(preset),
        "--out",
        str(out),
        "--set",
        f"engine.setup=['echo sync', '{step}']",
        env=cli_env(home),
    )
    [local_dir] = run_dirs(out)
    evts = events(local_dir)
    started = [e["cell"] for e in evts if e["type"] == "cell_started"]
    states = {e["cell"]: e["state"] for e in evts if e["type"] == "cell_finished"}
    assert "[setup] | building-once" in done.stdout
    if setup_rc == 0:
        assert done.returncode == 0, done.stdout + done.stderr
        assert started == [-1, 0, 1, 2]  # once, first
        assert states == {-1: "passed", 0: "passed", 1: "passed", 2: "passed"}
    else:
        assert done.returncode == 1, done.stdout + done.stderr
        assert started == [-1]
        assert states == {-1: "failed", 0: "skipped", 1: "skipped", 2: "skipped"}
        assert "setup exited 4; stderr ends: build-log-tail" in done.stdout
        assert "RESULT: FAIL (exit 1)" in done.stdout
