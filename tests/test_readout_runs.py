"""B3.11/B3.12 readout: reference runs, injections, the seed 003 lines, rows live over SSH."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from patience import patience
from runhelp import ROOT, cli_env, events, run_dirs, spawn, tracedeck, wait_for
from sshd import SshHome

from runners.events import event_from_dict
from runners.kinds import event_types
from runners.kinds.readout import RowBook

SAMPLE = ROOT / "presets" / "samples" / "b3_12_mi300x.jsonl"


def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir(exist_ok=True)
    return path


def isolated(tmp_path: Path) -> list[str]:
    return ["--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"']


def final_rows(local_dir: Path) -> dict[str, dict]:
    """The rows as a replay rebuilds them: the recorded trace digests folded in order."""
    book = RowBook()
    for e in events(local_dir):
        book.fold(event_from_dict(e, event_types()))
    return {row["prompt"]: row for row in book.rows().values()}


def test_seed_003_lines_reproduce_its_findings(tmp_path: Path) -> None:
    done = tracedeck("analyze", str(SAMPLE), env=cli_env(home(tmp_path)))
    assert done.returncode == 1  # NO OK
    assert "| prompt 1 | 79 | 96965 | 0 | NO OK |" in done.stdout
    assert "| prompt 2 | 79 | no decode step |" in done.stdout
    assert "`readout_mismatch=true` count: **0**" in done.stdout
    as_json = json.loads(
        tracedeck("analyze", str(SAMPLE), "--json", env=cli_env(home(tmp_path))).stdout
    )
    assert as_json["verdict"] == "NO OK"
    first, second = as_json["prompts"]
    assert (first["prefill_last_top1"], first["decode0_top1"]) == (79, 96965)
    assert second["decode_steps"] == 0 and second["note"] == "no decode step"


def test_reference_run_is_ok_on_every_prompt(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = tracedeck(
        "run",
        "b3_11_readout",
        "--out",
        str(out),
        *isolated(tmp_path),
        env=cli_env(home(tmp_path)),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: OK (exit 0)" in done.stdout
    rows = final_rows(run_dirs(out)[0])
    assert list(rows) == ["p0_short", "p4_sys", "p5_ba", "p6_len_16"]
    for row in rows.values():
        assert row["verdict"] == "OK"
        assert row["prefill_last_top1"] == row["decode0_top1"]
        assert row["readout_mismatch_count"] == 0 and row["decode_steps"] == 8


@pytest.mark.parametrize("inject", ["b3_11", "b3_12"])
def test_injections_are_no_ok_and_show_the_bad_ids(tmp_path: Path, inject: str) -> None:
    out = tmp_path / "out"
    done = tracedeck(
        "run",
        "b3_11_readout",
        "--out",
        str(out),
        *isolated(tmp_path),
        "--set",
        f'matrix.inject=["{inject}"]',
        "--set",
        'matrix.prompt=["p4_sys"]',
        env=cli_env(home(tmp_path)),
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: NO OK (exit 1)" in done.stdout
    row = final_rows(run_dirs(out)[0])["p4_sys"]
    assert row["verdict"] == "NO OK"
    assert row["decode0_top1"] != row["prefill_last_top1"]
    if inject == "b3_11":  # top-1 collapses to one id and stays there
        assert row["collapsed"] and len(set(row["top1_seq"])) == 1
        assert row["readout_mismatch_count"] == 0
    else:  # logical index used in a single-token buffer
        assert row["readout_mismatch_count"] == row["decode_steps"] > 0


WRITER = """
import sys, time, pathlib
lines = pathlib.Path(sys.argv[1]).read_text().splitlines(keepends=True)
go = pathlib.Path(sys.argv[3])
with open(sys.argv[2], "a") as fh:
    fh.write(lines[0]); fh.write(lines[1]); fh.flush()
    deadline = time.time() + 60
    while not go.exists() and time.time() < deadline:  # the test saw the first row
        time.sleep(0.02)
    fh.write(lines[2]); fh.flush()
"""


@pytest.mark.ssh
def test_rows_appear_over_ssh_while_the_engine_writes(ssh_home: SshHome, tmp_path: Path) -> None:
    writer = tmp_path / "writer.py"
    writer.write_text(WRITER)
    go = tmp_path / "go"
    preset = tmp_path / "live.toml"
    preset.write_text(f"""
[preset]
name = "live_readout"
kind = "readout"
[target]
python = "{sys.executable}"
runs = "{tmp_path}/remote"
lock = "{tmp_path}/lock"
[engine]
command = "mkdir -p {{out}} && {{python}} {writer} {SAMPLE} {{out}}/trace.jsonl {go}"
[matrix]
n = [1]
[traces]
follow = ["trace.jsonl"]
""")
    out = tmp_path / "out"
    run = spawn(
        "run",
        str(preset),
        "--target",
        ssh_home.server.spec,
        "--out",
        str(out),
        env=cli_env(ssh_home.path),
    )
    try:
        local_dir = wait_for(lambda: run_dirs(out), what="run dir")[0]
        row = wait_for(lambda: final_rows(local_dir).get("prompt 1"), what="the first row")
        assert row["decode0_top1"] == 96965
        assert not any(e["type"] == "cell_finished" for e in events(local_dir))
        go.touch()
        stdout, stderr = run.communicate(timeout=patience(60))
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1, stdout + stderr  # the seed's lines are NO OK
    assert final_rows(local_dir)["prompt 2"]["note"] == "no decode step"


DATA = ROOT / "tests" / "data"


def test_a_run_recorded_before_trace_digests_still_replays_the_same_rows(tmp_path: Path) -> None:
    env = cli_env(home(tmp_path))
    old = tracedeck("replay", str(DATA / "legacy_readout_run"), "--headless", env=env)
    new = tracedeck("replay", str(DATA / "readout_run"), "--headless", env=env)
    assert old.returncode == new.returncode == 1, old.stderr + new.stderr
    assert old.stdout.split("\n\n", 1)[1] == new.stdout.split("\n\n", 1)[1]  # the final tables
    assert final_rows(DATA / "legacy_readout_run") == final_rows(DATA / "readout_run")
    assert "RESULT: NO OK (exit 1)" in old.stdout


LINES_WRITER = """
import sys
lines = open(sys.argv[1]).read().splitlines(keepends=True)
with open(sys.argv[2], "a") as fh:
    fh.writelines(lines[int(a)] for a in sys.argv[3].split(","))
"""


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ("", ["p4_sys", "p5_ba"]),  # the cell's matrix value of prompt_key ("prompt")
        ('[readout]\nprompts = ["alpha", "beta"]\n', ["alpha", "beta"]),
    ],
)
def test_rows_of_an_engine_that_names_no_prompt_take_the_presets_names(
    tmp_path: Path, extra: str, names: list[str]
) -> None:
    """Issue 9 case 8: greta's lines carry no prompt name; the preset's names label the rows."""
    writer = tmp_path / "writer.py"
    writer.write_text(LINES_WRITER)
    preset = tmp_path / "greta_like.toml"
    preset.write_text(f"""
[preset]
name = "greta_like"
kind = "readout"
[target]
python = "{sys.executable}"
[engine]
# p4_sys writes the seed's first prompt (prefill and decode lines), p5_ba its prefill only
command = "mkdir -p {{out}} && {{python}} {writer} {SAMPLE} {{out}}/trace.jsonl $([ {{prompt}} = p4_sys ] && echo 0,1 || echo 2)"
[matrix]
prompt = ["p4_sys", "p5_ba"]
[traces]
follow = ["trace.jsonl"]
{extra}""")
    out = tmp_path / "out"
    done = tracedeck(
        "run", str(preset), "--out", str(out), *isolated(tmp_path), env=cli_env(home(tmp_path))
    )
    assert done.returncode == 1, done.stdout + done.stderr  # the seed's lines are NO OK
    rows = final_rows(run_dirs(out)[0])
    assert list(rows) == names
    assert rows[names[0]]["decode0_top1"] == 96965 and rows[names[1]]["decode_steps"] == 0
    assert f"| {names[0]} | 79 | 96965 |" in done.stdout


def test_a_missing_prompt_file_fails_the_cell_naming_the_file(tmp_path: Path) -> None:
    """Issue 9 case 9: cells run under bash with set -euo pipefail; no empty prompt."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "p4_sys.txt").write_text("hello")
    done = tracedeck(
        "run",
        "b3_12_readout_greta",
        "--target",
        "local",
        "--out",
        str(tmp_path / "out"),
        *isolated(tmp_path),
        "--set",
        f'target.workdir="{tmp_path}"',
        "--set",
        'vars.bin="/bin/true"',
        "--set",
        f'vars.prompts="{prompts}"',
        env=cli_env(home(tmp_path)),
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "RESULT: ENGINE_ERROR (exit 3)" in done.stdout
    assert f"{prompts}/p5_ba.txt: No such file or directory" in done.stdout
