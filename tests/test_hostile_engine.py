"""An engine that attacks the run it is part of (it shares the run's directory on its target):
it cannot replace the run's record with an artifact, fake a cell's end in progress.jsonl, hang
the fetch with a FIFO, fill this machine's disk with a device, or crash the follower with a
line of garbage. Each case a real run of a command preset on this machine."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from runhelp import cli_env, events, run_dirs, tracedeck

from runners.fetch import OutsideRun, download_into
from runners.targets.local import LocalTarget


def _preset(tmp_path: Path, script: str, fetch: list[str], cells: str = "[1]") -> Path:
    engine = tmp_path / "engine.sh"
    engine.write_text(script)
    preset = tmp_path / "hostile.toml"
    preset.write_text(
        f"""[preset]
name = "hostile"
kind = "command"
[target]
host = "local"
runs = "{tmp_path}/remote"
lock = "{tmp_path}/lock"
[engine]
command = "bash {engine} {{out}} {{n}} {{run_dir}}"
[matrix]
n = {cells}
[artifacts]
fetch = {json.dumps(fetch)}
"""
    )
    return preset


def _run(tmp_path: Path, preset: Path) -> tuple[subprocess.CompletedProcess[str], Path | None]:
    out = tmp_path / "out"
    done = tracedeck("run", str(preset), "--out", str(out), env=cli_env(tmp_path), timeout=120)
    dirs = run_dirs(out)
    return done, (dirs[0] if dirs else None)


@pytest.mark.parametrize("name", ["run.json", "events.jsonl", "record.lock", "plan.json", "cancel"])
def test_an_artifact_named_like_the_record_is_refused_by_the_preset(
    name: str, tmp_path: Path
) -> None:
    done, _ = _run(tmp_path, _preset(tmp_path, "exit 0\n", [name]))
    assert done.returncode == 2 and f"is the run's own {name}" in done.stderr


def test_an_artifact_path_of_the_record_is_refused_when_fetched(tmp_path: Path) -> None:
    import asyncio

    remote = tmp_path / "remote.json"
    remote.write_text("{}")
    local = tmp_path / "run"
    local.mkdir()
    (local / "run.json").write_text("the record")
    with pytest.raises(OutsideRun, match="tracedeck's record"):
        asyncio.run(download_into(LocalTarget(), str(remote), local, "run.json"))
    assert (local / "run.json").read_text() == "the record"


def test_a_forged_end_in_progress_jsonl_is_not_believed(tmp_path: Path) -> None:
    """Cell 1 writes a start and an end (rc 0) for cell 2 into progress.jsonl; cell 2 then
    really exits 1: the run is no pass, and the forged lines are named."""
    script = """n=$2; rd=$3
if [ "$n" = 1 ]; then
  t=$(date +%s)
  printf '{"e":"start","cell":"001","t":%s}\\n{"e":"end","cell":"001","rc":0,"t":%s}\\n' $t $t >> $rd/progress.jsonl
  exit 0
fi
exit 1
"""
    done, local = _run(tmp_path, _preset(tmp_path, script, [], "[1, 2]"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert local is not None
    said = [e["message"] for e in events(local) if e["type"] == "error"]
    assert any("a second start of 001" in m and "not believed" in m for m in said), said


def test_a_line_of_garbage_in_progress_jsonl_is_named_not_a_crash(tmp_path: Path) -> None:
    script = 'echo "not json" >> $3/progress.jsonl; exit 0\n'
    done, local = _run(tmp_path, _preset(tmp_path, script, []))
    assert done.returncode == 1 and "NOT_JUDGED" not in done.stdout, done.stdout + done.stderr
    assert local is not None
    said = [e["message"] for e in events(local) if e["type"] == "error"]
    assert any("progress.jsonl:" in m and "not a JSON object" in m for m in said), said


@pytest.mark.parametrize("what", ["fifo", "device"])
def test_an_artifact_that_is_no_regular_file_is_refused_never_hangs_or_fills_the_disk(
    what: str, tmp_path: Path
) -> None:
    make = "mkfifo $1/a.bin" if what == "fifo" else "ln -s /dev/zero $1/a.bin"
    done, local = _run(tmp_path, _preset(tmp_path, f"mkdir -p $1; {make}; exit 0\n", ["a.bin"]))
    assert done.returncode != 0, done.stdout + done.stderr
    assert local is not None and not (local / "a.bin").exists()
    assert not list(local.rglob("*.part"))
    said = [e["message"] for e in events(local) if e["type"] == "error"]
    assert any("is not a regular file" in m for m in said), said
    assert os.path.getsize(local) < 1 << 20  # (a directory entry: nothing was copied)
