"""The change notifier (issue 12): the target wakes the follower when a followed file changes,
locally and over a real sshd; it ends with its channel; without python there, polling goes on."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from faults import assert_run_gone, record_of
from patience import patience
from runhelp import (
    cli_env,
    notifier_alive,
    run_dirs,
    spawn,
    tracedeck,
    wait_for,
    write_lines_preset,
)
from sshd import CuttableProxy, SshHome

from runners.changes import Changes
from runners.targets.base import Target
from runners.targets.factory import parse_target

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)


@pytest.fixture(params=["local", "ssh"])
async def target(request: pytest.FixtureRequest) -> Target:
    if request.param == "local":
        t = parse_target("local")
    else:
        home: SshHome = request.getfixturevalue("ssh_home")
        t = parse_target(home.server.spec)
    await t.connect()
    yield t
    await t.close()


async def test_an_append_a_new_file_and_a_new_set_each_wake_it(
    target: Target, tmp_path: Path
) -> None:
    log = tmp_path / "a.log"
    log.write_text("first\n")
    changes = Changes(target, sys.executable, "wake-test")
    await changes.start()
    try:
        assert changes.available, changes.problem
        changes.watch([str(log), str(tmp_path / "later.log"), str(tmp_path)])
        assert await changes.wait(10)  # a new set: look once
        assert not await changes.wait(0.3)  # nothing written: no wake-up, the poll decides
        with log.open("a") as fh:
            fh.write("second\n")
        assert await changes.wait(10)
        (tmp_path / "later.log").write_text("born\n")  # a file that did not exist yet
        assert await changes.wait(10)
    finally:
        await changes.close()
    assert not changes.available
    wait_for(lambda: not notifier_alive("wake-test"), timeout=10, what="the notifier to end")


async def test_without_python_on_the_target_it_says_why_and_polling_goes_on(
    target: Target, tmp_path: Path
) -> None:
    changes = Changes(target, str(tmp_path / "no-python"), "nopython-test")
    await changes.start()
    changes.watch([str(tmp_path)])
    await wait_for_async(lambda: not changes.available)
    assert "no-python" in changes.problem  # the shell's own words: not found
    assert not await changes.wait(0.2)  # a plain timeout: the follower polls
    await changes.close()


async def wait_for_async(predicate, timeout: float = 10) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience(timeout)
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.ssh
def test_a_cut_link_ends_the_notifier_and_a_new_one_follows_the_run(
    ssh_proxy: CuttableProxy, ssh_home: SshHome, tmp_path: Path
) -> None:
    preset = write_lines_preset(tmp_path, lines=40, pause=0.05)
    env = cli_env(ssh_home.path)
    out = tmp_path / "out"
    console = spawn("run", str(preset), "--target", ssh_proxy.spec, "--out", str(out), env=env)
    local = wait_for(lambda: run_dirs(out), what="run dir")[0]
    run_id = record_of(local)["run_id"]
    wait_for(lambda: notifier_alive(run_id), what="the notifier")
    ssh_proxy.cut()
    stdout, stderr = console.communicate(timeout=patience(120))
    assert console.returncode == 0, stdout + stderr
    assert "connection restored" in stdout
    assert_run_gone(local)  # the notifier of each connection ended with it


def test_a_run_leaves_no_notifier_behind(tmp_path: Path) -> None:
    preset = write_lines_preset(tmp_path, lines=3, pause=0.01)
    out = tmp_path / "out"
    done = tracedeck("run", str(preset), "--out", str(out), env=cli_env(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert_run_gone(run_dirs(out)[0])
