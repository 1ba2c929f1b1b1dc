"""`tracedeck status`: runs on two real sshd hosts and one local run at once, with the lock
holder of each host (issue 24)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from patience import patience
from runhelp import cli_env, events, output_lines, run_dirs, spawn, tracedeck, wait_for
from sshd import Fleet
from test_console import wait_for as wait_for_screen_condition
from test_fleet import lines_preset
from textual.widgets import DataTable, Input

from console.app import create_app
from console.screens.dialogs import ConfirmDialog
from console.screens.run import RunScreen
from console.screens.runs import RunsScreen

pytestmark = pytest.mark.ssh


# The lock each host of these tests takes (configured, as an operator would): a name of their
# own, since a run elsewhere on this machine reaps whatever holds a lock file of its lock's path,
# here the default /tmp/tracedeck.lock in any mount namespace (each test host has its own /tmp).
HOST_LOCK = "/tmp/tracedeck-status-test.lock"


def configure_hosts(home: Path, hosts: tuple[str, ...] = ("gpu-a", "gpu-b", "local")) -> None:
    """config.toml under `home` naming `hosts`, each with the lock HOST_LOCK."""
    config = home / ".config" / "tracedeck" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("".join(f'[hosts.{h}]\nlock = "{HOST_LOCK}"\n\n' for h in hosts))


def started(out: Path, known: set[Path], what: str) -> Path:
    """The run directory that appeared beside `known`, once its run prints."""
    new = wait_for(lambda: set(run_dirs(out)) - known, what=f"{what}'s run directory")
    (local,) = new
    wait_for(lambda: output_lines(events(local)), what=f"{what}'s first output line")
    return local


async def test_status_and_runs_screen_show_two_hosts_and_a_local_run_with_lock_holders(
    fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    configure_hosts(fleet.home.path)
    env = cli_env(fleet.home.path)
    preset = lines_preset(tmp_path, cells=1, lines=3000, pause=0.1)  # cancelled at the end
    consoles: list[subprocess.Popen[str]] = []
    dirs: dict[str, Path] = {}
    try:
        root = tmp_path / "records"  # one machine's records: the three runs side by side
        for where in ("gpu-a", "gpu-b", "local"):
            consoles.append(
                spawn("run", str(preset), "--target", where, "--out", str(root), env=env)
            )
            dirs[where] = started(root, set(dirs.values()), where)
        done = tracedeck(
            "status", "--json", "--out", str(root), "--host", "gpu-a", "--host", "gpu-b", env=env
        )
        assert done.returncode == 0, done.stdout + done.stderr
        doc = json.loads(done.stdout)
        runs = {r["hosts"][0]: r for r in doc["runs"]}
        assert set(runs) == {"gpu-a", "gpu-b", "local"}, doc["runs"]
        for where in dirs:
            run = runs[where]
            assert run["state"] == "live" and run["followed"], run
            assert run["preset"] == "lines" and run["kind"] == "command"
            assert run["verdict"] is None and run["elapsed_s"] >= 0
            assert run["local_dir"] == str(dirs[where])
        locks = {lk["host"]: lk for lk in doc["locks"]}
        for where in ("gpu-a", "gpu-b", "local"):
            assert locks[where]["state"] == "held", locks
            assert locks[where]["holder"]["run_id"] == runs[where]["run_id"]
        text = tracedeck(
            "status", "--out", str(root), "--host", "gpu-a", "--host", "gpu-b", env=env
        )
        lines = text.stdout.splitlines()
        assert sum(line.startswith("live (followed)") for line in lines) == 3, text.stdout
        for where in ("gpu-a", "gpu-b", "local"):
            lock_line = next(li for li in lines if li.split()[:1] == [where])
            assert " held " in lock_line and runs[where]["run_id"] in lock_line, lock_line
        await runs_screen_shows(root, runs, locks, dirs)
    finally:
        for local in dirs.values():
            tracedeck("cancel", str(local), "--grace", "1", env=env)
        for console in consoles:
            try:
                console.communicate(timeout=patience(60))
            except subprocess.TimeoutExpired:
                console.kill()
                console.communicate()


async def runs_screen_shows(root: Path, runs: dict, locks: dict, dirs: dict[str, Path]) -> None:  # type: ignore[type-arg]
    """F3: the same three live runs with their lock holders; / filters, a header sorts, Enter
    reattaches, c asks before cancelling."""
    app = create_app(out_dir=root)
    app.runs_hosts = ["gpu-a", "gpu-b"]
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("f3")
        screen = app.screen
        assert isinstance(screen, RunsScreen)
        await wait_until(pilot, lambda: screen.collected > 0, "the runs to be collected")
        table = screen.query_one("#runs-table", DataTable)
        rows = [[str(c) for c in table.get_row(key)] for key in table.rows]
        assert len(rows) == 3, rows
        for row in rows:
            where = row[5]
            assert row[0] == "live (followed)" and row[1] == runs[where]["run_id"], row
            assert row[7] == "this run", row  # the lock of its host is held by the run itself
        selected = screen.selected()
        assert selected is not None
        holder = locks[selected.hosts[0]]["holder"]  # said in full under the table
        who = f"{holder['user']}@{holder['console_host']}, pgid {holder['pgid']}"
        detail = str(screen.query_one("#runs-detail").content)
        assert detail == f"lock  this run ({who})", detail
        line = str(screen.query_one("#runs-locks").content)
        for where in ("local", "gpu-a", "gpu-b"):
            assert f"{where} held by " in line, line
        await pilot.press("slash", *"gpu-b", "enter")
        assert [r.hosts for r in screen.shown] == [["gpu-b"]]
        screen.query_one("#runs-filter", Input).value = ""
        await pilot.pause()
        screen.sort_by("hosts")
        assert [r.hosts[0] for r in screen.shown] == ["gpu-a", "gpu-b", "local"]
        screen.sort_by("hosts")
        assert [r.hosts[0] for r in screen.shown] == ["local", "gpu-b", "gpu-a"]
        selected = screen.selected()  # the cursor stayed on gpu-b's run through filter and sorts
        assert selected is not None and selected.hosts == ["gpu-b"], selected
        await pilot.press("up")
        assert screen.selected() is not None and screen.selected().hosts == ["local"]
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("n")
        assert app.screen is screen
        await pilot.press("enter")
        run_screen = app.screen
        assert isinstance(run_screen, RunScreen) and run_screen.source.mode == "ATTACHED"
        assert run_screen.source.local_dir == dirs["local"]


async def wait_until(pilot, condition, what: str, timeout: float = 60.0) -> None:  # noqa: ANN001
    await wait_for_screen_condition(pilot, condition, timeout, what)
