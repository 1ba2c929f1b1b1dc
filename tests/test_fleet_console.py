"""The console on fleet and Slurm runs: a host column and a status line per host; each cell's
scheduler state next to its verdict. Replays of real recorded runs (tests/data/make_fleet_slurm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sshd import Fleet
from test_console import SIZE, banner_text, cells, copy_run, start_preset, wait_for_banner

from console.app import create_app
from console.run_model import RunModel
from console.widgets.hosts_line import HostsLine
from runners.events import (
    CellFinished,
    CellStarted,
    Connection,
    Error,
    HostAssigned,
    HostState,
    LockAcquired,
    RunStarted,
    SchedulerState,
)


def hosts_text(screen) -> str:  # noqa: ANN001
    return str(screen.query_one("#hosts", HostsLine).content)


async def test_a_fleet_run_shows_each_cell_s_host_and_a_line_per_host(tmp_path: Path) -> None:
    run = copy_run("fleet_run", tmp_path)
    app = create_app(out_dir=tmp_path / "td", replay_dir=run, speed=1000.0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot)
        rows = cells(screen)
        assert [r[5] for r in rows] == ["gpu-b"] * 4  # every cell ended on gpu-b
        assert [r[2] for r in rows] == ["passed"] * 4
        text = hosts_text(screen)
        lines = text.splitlines()
        assert lines[0].startswith("gpu-a lost") and "cells 0/0 done" in lines[0]
        assert "last error: gpu-a: lost" in lines[0]
        assert lines[1].startswith("gpu-b done") and "cells 4/4 done" in lines[1]
        assert "PASS" in banner_text(screen)


async def test_a_slurm_run_shows_each_cell_s_scheduler_state(tmp_path: Path) -> None:
    run = copy_run("slurm_run", tmp_path)
    app = create_app(out_dir=tmp_path / "td", replay_dir=run, speed=1000.0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot)
        rows = cells(screen)
        assert [(r[2], r[6]) for r in rows] == [("passed", "COMPLETED"), ("lost", "TIMEOUT")]
        assert "slurm job 1 on partition debug" in hosts_text(screen)
        assert "1 COMPLETED, 1 TIMEOUT" in hosts_text(screen)
        assert "TIMEOUT  (exit 3)" in banner_text(screen)


def test_the_model_keeps_each_host_s_status() -> None:
    model = RunModel()
    model.apply(
        RunStarted(
            run_id="r",
            preset="p",
            kind="command",
            target="a,b",
            local_dir="/l",
            remote_dir="/r",
            cells=[{"index": 0, "params": {"n": 1}}, {"index": 1, "params": {}}],
            profile="none",
            env={},
        )  # fmt: skip
    )
    model.apply(HostState(state="connecting", host="a"))
    model.apply(
        HostAssigned(
            member="r@a-1",
            cells=[0],
            run_dir="/r/a-1",
            lock="/tmp/l",
            workdir="/",
            python="python3",
            host="a",
        )  # fmt: skip
    )
    model.apply(LockAcquired(lock="/tmp/l", holder={}, host="a"))
    model.apply(CellStarted(cell=0, params={"n": 1}, command="x", host="a"))
    model.apply(Connection(state="lost", message="cut", host="a"))
    model.apply(CellFinished(cell=0, state="passed", exit_code=0, duration_s=1.0, host="a"))
    model.apply(Error(message="b: no route", host="b"))
    model.apply(SchedulerState(cell=1, state="PENDING", reason="Resources"))
    a, b = model.hosts["a"], model.hosts["b"]
    assert (a.lock, a.lock_held, a.connection, a.done, a.cells) == (
        "/tmp/l",
        True,
        "lost",
        {0},
        {0},
    )
    assert b.last_error == "b: no route"
    assert model.cells[0].host == "a" and model.cells[1].sched == "PENDING (Resources)"
    assert model.header.fleet and model.header.lock == ""  # a host's lock is not the run's


@pytest.mark.ssh
async def test_a_fleet_run_from_the_presets_screen(
    fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEDECK_HOME", str(tmp_path / "td"))
    app = create_app(out_dir=tmp_path / "td" / "runs")
    async with app.run_test(size=SIZE) as pilot:
        overrides = [f"target.runs={tmp_path}/remote", "target.host=gpu-a,gpu-b"]
        await start_preset(pilot, "hello_command", overrides)
        screen = await wait_for_banner(pilot, timeout=60)
        assert banner_text(screen).startswith("PASS")
        hosts = {row[0]: row[5] for row in cells(screen)}
        assert set(hosts.values()) == {"gpu-a", "gpu-b"}
        lines = hosts_text(screen).splitlines()
        assert [line.split()[:2] for line in lines] == [["gpu-a", "done"], ["gpu-b", "done"]]
        assert all("connected" in line for line in lines)
