"""Issue 12: watching a DSA trace directory as it is written, and the DSA panel live."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from dsa_writer import write_trace
from patience import patience
from runhelp import ROOT, cli_env, run_dirs, spawn, tracedeck
from runhelp import wait_for as wait_until
from sshd import SshHome
from test_console import LOADED_S, wait_for, wait_for_screen

from console.app import create_app
from console.panels.dsa_trace import DsaDetail
from console.screens.run import RunScreen

WRITER = """
import pathlib, shutil, sys, time
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
dst.mkdir(parents=True)
for shard in sorted(src.glob("trace_steps_*.jsonl"), key=lambda p: int(p.name.split("_")[2])):
    with open(dst / shard.name, "wb", buffering=0) as fh:
        for line in shard.read_bytes().splitlines(keepends=True):
            fh.write(line)
            time.sleep(0.01)
shutil.copy(src / "summary.json", dst / "summary.json")
"""


def _watch_while_writing(tmp_path: Path, target: str, env: dict) -> tuple[str, dict]:
    src = write_trace(tmp_path / "src")
    out = tmp_path / "live"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(src), str(out / "block16")])
    try:
        # Watched once the directory exists (the first shard is being written).
        wait_until(lambda: (out / "block16").exists(), LOADED_S, what=f"the writer to make {out}")
        watched = tracedeck(
            "watch", target.format(dir=out), "--idle", "1", "--dsa-topk", "32", env=env, timeout=120
        )
    finally:
        writer.wait(timeout=patience(60))
    finished = tracedeck("analyze", str(out), "--json", env=env)
    return watched.stdout + watched.stderr, json.loads(finished.stdout)


def test_watch_follows_shards_as_a_writer_fills_them(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    text, analyzed = _watch_while_writing(tmp_path, "{dir}", cli_env(tmp_path / "home"))
    block = analyzed["dirs"][0]
    assert "dsa: following shard trace_steps_4_5.jsonl" in text, text
    assert (
        f"{block['records']} records, {block['requests']} requests, 3 layers; 0 invalid -> TRACE_OK"
        in text
    )
    assert text.rstrip().endswith("RESULT: TRACE_OK")


@pytest.mark.ssh
def test_watch_over_ssh_shows_the_same_totals_as_analyze(ssh_home: SshHome, tmp_path: Path) -> None:
    spec = ssh_home.server.spec.rstrip("/") + "{dir}"
    text, analyzed = _watch_while_writing(tmp_path, spec, cli_env(ssh_home.path))
    block = analyzed["dirs"][0]
    assert (
        f"{block['records']} records, {block['requests']} requests, 3 layers; 0 invalid -> TRACE_OK"
        in text
    ), text


def test_watch_waits_for_a_directory_the_writer_has_not_made_yet(tmp_path: Path) -> None:
    """Issue 21.6: `watch DIR` quit at once when DIR did not exist yet."""
    (tmp_path / "home").mkdir()
    src = write_trace(tmp_path / "src")
    out = tmp_path / "later"
    watch = spawn(
        "watch", str(out), "--idle", "1", "--dsa-topk", "32", env=cli_env(tmp_path / "home")
    )
    try:
        assert watch.stderr is not None
        said = watch.stderr.readline()  # it says it waits, and waits: then the writer starts
        assert f"waiting for {out} to appear" in said, said
        assert watch.poll() is None
        subprocess.run([sys.executable, "-c", WRITER, str(src), str(out / "block16")], check=True)
        stdout, stderr = watch.communicate(timeout=patience(120))
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate()
    assert watch.returncode == 0, stdout + stderr
    assert stdout.rstrip().endswith("RESULT: TRACE_OK")


@pytest.mark.parametrize("link", ["block", "shard"])
def test_watch_refuses_a_symlink_to_elsewhere_naming_it(tmp_path: Path, link: str) -> None:
    """Issue 21.6: a block directory or shard that is a symbolic link was followed and judged."""
    (tmp_path / "home").mkdir()
    block = write_trace(tmp_path / "elsewhere")  # the block directory
    watched = tmp_path / "watched"
    watched.mkdir()
    if link == "block":
        named = watched / block.name
        named.symlink_to(block)
    else:
        (watched / block.name).mkdir()
        for f in block.iterdir():
            (watched / block.name / f.name).write_bytes(f.read_bytes())
        shard = next(f for f in sorted(block.iterdir()) if f.name.startswith("trace_steps_"))
        named = watched / block.name / shard.name
        named.unlink()
        named.symlink_to(shard)
    done = tracedeck("watch", str(watched), "--idle", "1", env=cli_env(tmp_path / "home"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{named} on local is a symbolic link" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


async def test_the_dsa_panel_and_detail_screen_after_a_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (tmp_path / "home").mkdir()
    iso = ["--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"']
    done = tracedeck(
        "run", "dsa_smoke", "--out", str(out), *iso, env=cli_env(tmp_path / "home"), timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [local] = run_dirs(out)
    app = create_app(out_dir=tmp_path / "td", replay_dir=local, speed=0)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await wait_for_screen(pilot, RunScreen)
        await wait_for(pilot, lambda: screen.model.finished is not None, LOADED_S, "the replay")
        panel = screen.panel
        assert type(panel).__name__ == "DsaPanel"

        def drawn(widget: str, text: str) -> Callable[[], bool]:
            return lambda: text in str(app.screen.query_one(widget).render())

        await wait_for(pilot, lambda: panel.display, LOADED_S, "the DSA panel")
        await wait_for(pilot, drawn("#dsa-counters", "records 45"), LOADED_S, "45 records")
        counters = str(panel.query_one("#dsa-counters").render())
        assert "records 45" in counters and "invalid 0" in counters
        await wait_for(pilot, drawn("#dsa-h-touched", "n=45"), LOADED_S, "the histogram")
        await pilot.press("d")
        detail = await wait_for_screen(pilot, DsaDetail)
        heat = "request 2: records touching"
        await wait_for(pilot, drawn("#dd-heat", heat), LOADED_S, "the heat map")
        await pilot.press("l")
        await wait_for(pilot, lambda: panel.view.label() == "layer 0 only", LOADED_S, "layer 0")
        await pilot.press("r")
        await wait_for(pilot, lambda: panel.view.label() == "request 0 only", LOADED_S, "req 0")
        assert "records 15" not in str(detail.query_one("#dd-counters").render())
        hist = panel.view.live().vector(request=0)
        assert int(hist[-2]) == 15  # request 0: 5 decode steps x 3 layers


def test_a_live_run_spawned_shows_records_before_it_ends(tmp_path: Path) -> None:
    """The run's events carry DSA digests while the engine still writes (followed live)."""
    (tmp_path / "home").mkdir()
    out = tmp_path / "out"
    iso = ["--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"']
    run = spawn(
        "run",
        "dsa_smoke",
        "--out",
        str(out),
        *iso,
        "--set",
        "matrix.gen=[12]",
        env=cli_env(tmp_path / "home"),
    )
    stdout, stderr = run.communicate(timeout=patience(300))
    assert run.returncode == 0, stdout + stderr
    lines = stdout.splitlines()
    first_dsa = next(i for i, line in enumerate(lines) if line.startswith("dsa: following shard"))
    cell_end = next(i for i, line in enumerate(lines) if "passed exit 0" in line)
    assert first_dsa < cell_end
    assert ROOT.exists()


@pytest.mark.parametrize(
    "name", ["trace_steps_0.jsonl", "trace_steps-old.jsonl", "trace_steps_1_2.json"]
)
def test_a_trace_file_under_another_name_is_never_silently_skipped(
    tmp_path: Path, name: str
) -> None:
    block = write_trace(tmp_path / "t")
    ok = tracedeck("analyze", str(tmp_path / "t"), env=cli_env(tmp_path))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (block / name).write_text(sorted(block.glob("trace_steps_*_*.jsonl"))[0].read_text())
    stray = tracedeck("analyze", str(tmp_path / "t"), env=cli_env(tmp_path))
    assert stray.returncode == 1, stray.stdout + stray.stderr
    assert f"{block / name}: shards:" in stray.stdout and "not judged" in stray.stdout
