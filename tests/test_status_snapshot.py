"""Snapshots of the Runs screen (SVG) and of `tracedeck status` (its exact text): live runs on two
real sshd hosts (each in its own mount namespace, its own /tmp and lock) and on this machine,
and a recorded ended run, with who holds each host's lock (issue 24).

What differs from one run of the test to the next is pinned, or checked and then named:
- the clock is the test's (create_app(clock=...), collect(now=...)), and the test chooses when
  each run started (its record's started_at), so each elapsed time is computed, not blanked;
- the user is the test's ($USER, which the console records);
- run ids, process groups and this machine's name cannot be chosen: each is first checked
  against what is real (the run's own record; a live process of that group carrying the run's
  marker TRACEDECK_RUN_ID; socket.gethostname()), then replaced everywhere by a fixed stand-in.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
from patience import patience
from runhelp import cli_env, live_processes, spawn, tracedeck
from sshd import Fleet
from test_console_snapshots import SIZE, columns_fit, until
from test_fleet import lines_preset
from test_status import HOST_LOCK, configure_hosts, started
from textual.pilot import Pilot
from textual.widgets import DataTable

from console.app import create_app
from console.screens.runs import RunsScreen
from runners.record import RunRecord
from runners.status import LIVE, Status, collect, status_lines

pytestmark = pytest.mark.ssh

DATA = Path(__file__).resolve().parent / "data"
NOW = dt.datetime(2026, 11, 25, 12, 0, 0, tzinfo=dt.UTC).timestamp()
USER = "operator"
CONSOLE_HOST = "console"
# where -> (seconds before NOW it started, the stand-in run id, the stand-in process group)
PINS = {
    "gpu-a": (3725, "20261125-105655-lines-aaaa", 4101),
    "gpu-b": (125, "20261125-115755-lines-bbbb", 4202),
    "local": (42, "20261125-115918-lines-cccc", 4303),
}


class Pinned:
    """The real run ids, process groups and console host, checked, and their stand-ins."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.ids: dict[str, str] = {}
        self.pgids: dict[int, int] = {}
        self.problems: list[str] = []  # what a check inside the app's worker found
        self.dirs: dict[str, Path] = {}
        for where, local in dirs.items():
            run_id = RunRecord.load(local).run_id
            self.ids[run_id] = PINS[where][1]
            self.dirs[run_id] = local

    def check(self, status: Status) -> None:
        """Every volatile value of `status` is what is real (AssertionError naming it if not)."""
        processes = live_processes()
        live = {r.run_id for r in status.runs if r.state == LIVE}
        not_live = {run_id: self.dirs[run_id] for run_id in self.ids if run_id not in live}
        assert not not_live, [
            (str(local), [(r.state, r.note) for r in status.runs if r.run_id == run_id],
             last_events(local))
            for run_id, local in not_live.items()
        ]  # fmt: skip
        assert live == set(self.ids), [(r.run_id, r.state) for r in status.runs]
        for lk in status.locks:
            holder = lk.holder
            assert lk.lock == HOST_LOCK and lk.state == "held" and holder, lk
            assert holder["run_id"] in self.ids, (lk, self.ids)
            assert holder["user"] == USER and holder["console_host"] == socket.gethostname(), lk
            marker = f"TRACEDECK_RUN_ID={holder['run_id']}"
            pgid = holder["pgid"]
            assert any(group == pgid and marker in env for _, group, env in processes), (
                f"{lk.host}: no live process of group {pgid} carries {marker}"
            )
            where = lk.host if lk.host in PINS else "local"
            self.pgids[pgid] = PINS[where][2]

    def pin(self, status: Status) -> Status:
        """`status` with each checked volatile value replaced by its stand-in."""
        self.check(status)
        runs = [
            dataclasses.replace(r, run_id=self.ids.get(r.run_id, r.run_id)) for r in status.runs
        ]
        locks = [dataclasses.replace(lk, holder=self.holder(lk.holder)) for lk in status.locks]
        return Status(runs, locks)

    def holder(self, holder: dict[str, Any]) -> dict[str, Any]:
        return {
            **holder,
            "run_id": self.ids[holder["run_id"]],
            "pgid": self.pgids[holder["pgid"]],
            "console_host": CONSOLE_HOST,
        }

    async def collect(self, out_dir: Path, hosts: list[str] | None, now: float) -> Status:
        """runners.status.collect against the real hosts, checked, then pinned."""
        try:
            return self.pin(await collect(out_dir, hosts=hosts, now=now))
        except AssertionError as exc:
            self.problems.append(str(exc))
            raise


def last_events(local: Path, n: int = 4) -> list[str]:
    """The run's last events (or what its directory holds), to say why it is not live."""
    try:
        lines = (local / "events.jsonl").read_text().splitlines()
    except OSError as exc:
        return [f"{exc}; the directory holds {sorted(p.name for p in local.glob('*'))}"]
    return [line[:400] for line in lines[-n:]]


def choose_start(local: Path, seconds_before_now: int) -> None:
    """Set when the run started, as its record says (what elapsed is computed from)."""
    path = local / "run.json"
    record = orjson.loads(path.read_bytes())
    when = dt.datetime.fromtimestamp(NOW - seconds_before_now, dt.UTC)
    record["started_at"] = when.isoformat(timespec="seconds")
    path.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2))


STATUS_TEXT = """\
STATE            RUN                                 PRESET         KIND     VERDICT  HOSTS  ELAPSED  NOTE
live (followed)  20261125-115918-lines-cccc          lines          command  -        local  42s
live (followed)  20261125-115755-lines-bbbb          lines          command  -        gpu-b  2m05s
live (followed)  20261125-105655-lines-aaaa          lines          command  -        gpu-a  1h02m
ended            20261122-122835-hello_command-b1a5  hello_command  command  PASS     local  2s

HOST   LOCK                             STATE  HOLDER
local  /tmp/tracedeck-status-test.lock  held   operator@console (run 20261125-115918-lines-cccc, pgid 4303)
gpu-a  /tmp/tracedeck-status-test.lock  held   operator@console (run 20261125-105655-lines-aaaa, pgid 4101)
gpu-b  /tmp/tracedeck-status-test.lock  held   operator@console (run 20261125-115755-lines-bbbb, pgid 4202)
"""


@pytest.fixture
def three_live_runs(fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Live runs on gpu-a, gpu-b and this machine (the hosts the config names, each with its
    lock), and a recorded ended one, in one records root; cancelled at the end."""
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    configure_hosts(fleet.home.path)
    env = cli_env(fleet.home.path, USER=USER, LOGNAME=USER)
    preset = lines_preset(tmp_path, cells=1, lines=3000, pause=0.1, attempts=10)
    # patient links: a loaded machine must not turn a slow keepalive into a lost run
    text = preset.read_text().replace("keepalive_s = 1\n", "keepalive_s = 10\n")
    preset.write_text(text.replace("connect_timeout_s = 3\n", "connect_timeout_s = 10\n"))
    root = tmp_path / "records"
    shutil.copytree(DATA / "hello_command_run", root / "hello_command_run")
    consoles: list[subprocess.Popen[str]] = []
    dirs: dict[str, Path] = {}
    known = {root / "hello_command_run"}
    try:
        for where in PINS:
            consoles.append(
                spawn("run", str(preset), "--target", where, "--out", str(root), env=env)
            )
            dirs[where] = started(root, known | set(dirs.values()), where)
            choose_start(dirs[where], PINS[where][0])
        yield root, dirs
    finally:
        for local in dirs.values():
            tracedeck("cancel", str(local), "--grace", "1", env=env)
        for console in consoles:
            try:
                console.communicate(timeout=patience(60))
            except subprocess.TimeoutExpired:
                console.kill()
                console.communicate()


async def test_status_text_shows_two_sshd_hosts_and_a_local_run_with_lock_holders(
    three_live_runs: tuple[Path, dict[str, Path]],
) -> None:
    root, dirs = three_live_runs
    pinned = Pinned(dirs)
    status = await pinned.collect(root, None, NOW)  # None: the configured hosts
    text = "\n".join(status_lines(status)) + "\n"
    assert text == STATUS_TEXT, text


def test_runs_screen_shows_two_sshd_hosts_and_a_local_run_with_lock_holders(
    snap_compare,  # noqa: ANN001
    three_live_runs: tuple[Path, dict[str, Path]],
) -> None:
    root, dirs = three_live_runs
    pinned = Pinned(dirs)
    app = create_app(out_dir=root, clock=lambda: NOW)
    app.runs_collect = pinned.collect

    async def open_runs(pilot: Pilot) -> None:
        await pilot.press("f3")

        def shown() -> bool:
            assert not pinned.problems, "\n".join(pinned.problems)
            screen = pilot.app.screen
            return (
                isinstance(screen, RunsScreen)
                and screen.collected > 0
                and not screen.workers
                and columns_fit(screen.query_one("#runs-table", DataTable))
            )

        await until(pilot, shown)

    assert snap_compare(app, terminal_size=SIZE, run_before=open_runs)
