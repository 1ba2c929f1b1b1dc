"""A recorded run read back (diff, replay, the CI reports) never believes a verdict its own
events deny, never hides a cell behind another with the same parameters, and names a damaged
record instead of a traceback. Real runs of the command kind, records then edited by hand."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from runhelp import cli_env, run_dirs, tracedeck, wait_until_held


def _run(tmp_path: Path, out: Path, command: str, matrix: str) -> Path:
    before = set(run_dirs(out))
    done = tracedeck(
        "run", "hello_command", "--out", str(out),
        "--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"',
        "--set", f"matrix.n={matrix}", "--set", f"engine.command={json.dumps(command)}",
        env=cli_env(tmp_path),
    )  # fmt: skip
    [local] = set(run_dirs(out)) - before
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return local


def _edit_end(local: Path, how: str) -> None:
    """The run's end made a PASS: the last run_finished edited, or a second one appended."""
    path = local / "events.jsonl"
    lines = path.read_text().splitlines()
    at = max(i for i, line in enumerate(lines) if json.loads(line)["type"] == "run_finished")
    end = json.loads(lines[at])
    end.update(verdict="PASS", exit_code=0)
    if how == "edit":
        lines[at] = json.dumps(end)
    else:
        lines.append(json.dumps(end))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("how", ["edit", "append"])
def test_a_pass_written_over_a_failed_cell_is_not_believed(how: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    failed = _run(tmp_path, out, "sh -c 'test {n} != 2'", "[1, 2]")
    _edit_end(failed, how)
    env = cli_env(tmp_path)
    junit, summary = tmp_path / "j.xml", tmp_path / "s.md"
    done = tracedeck(
        "replay", str(failed), "--headless", "--junit", str(junit), "--summary-md", str(summary),
        env=env,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "is contradicted by its own events (cell n=2: FAILED): not believed" in done.stderr
    assert summary.read_text().startswith("## ❌ hello_command: PASS (contradicted) (exit 1)")
    assert 'failures="0"' not in junit.read_text()
    done = tracedeck("diff", str(failed), str(failed), "--out", str(out), env=env)
    assert "-> PASS (contradicted)" in done.stdout


def test_cells_with_the_same_parameters_are_compared_one_by_one(tmp_path: Path) -> None:
    """matrix n = [1, 1, 2]: the first n=1 cell fails in B only; the diff says so."""
    out = tmp_path / "out"
    a = _run(tmp_path, out, "sh -c 'test {n} != 2'", "[1, 1, 2]")
    flag = tmp_path / "flag"
    b = _run(tmp_path, out, f"sh -c 'test {{n}} = 2 && exit 1; mkdir {flag} 2>/dev/null && exit 1; exit 0'", "[1, 1, 2]")  # fmt: skip
    done = tracedeck("diff", str(a), str(b), "--out", str(out), env=cli_env(tmp_path))
    assert done.returncode == 1, done.stdout
    assert "3 item(s) compared: 1 regressed, 2 same" in done.stdout
    assert "REGRESSED cell n=1 (cell " in done.stdout


def test_a_run_end_whose_summary_is_no_object_is_named_not_a_traceback(tmp_path: Path) -> None:
    out = tmp_path / "out"
    local = _run(tmp_path, out, "true", "[1]")
    path = local / "events.jsonl"
    lines = path.read_text().splitlines()
    end = json.loads(lines[-1])
    assert end["type"] == "run_finished"
    end["summary"] = ["x"]
    lines[-1] = json.dumps(end)
    path.write_text("\n".join(lines) + "\n")
    env = cli_env(tmp_path)
    for args in (["diff", str(local), str(local), "--out", str(out)],
                 ["replay", str(local), "--headless", "--junit", str(tmp_path / "j.xml")]):  # fmt: skip
        done = tracedeck(*args, env=env)
        assert "Traceback" not in done.stderr, done.stderr
        assert done.returncode == 2, done.stderr
        assert "events.jsonl:" in done.stderr and "field 'summary' is ['x']" in done.stderr


def test_a_run_refused_by_a_busy_lock_writes_its_reports_never_leaving_a_green_one(
    tmp_path: Path,
) -> None:
    """The same --junit / --summary-md paths: a passing run, then one a busy lock refuses (no
    record of its own). Its reports say LOCK_BUSY (exit 3); the first run's green ones go."""
    junit, summary, lock = tmp_path / "j.xml", tmp_path / "s.md", tmp_path / "lock"
    args = [
        "run", "hello_command", "--out", str(tmp_path / "out"), "--set", "matrix.n=[1]",
        "--set", f'target.lock="{lock}"', "--set", f'target.runs="{tmp_path}/remote"',
        "--junit", str(junit), "--summary-md", str(summary),
    ]  # fmt: skip
    env = cli_env(tmp_path)
    assert tracedeck(*args, env=env).returncode == 0
    assert summary.read_text().startswith("## ✅")
    # flock runs sleep as its child, which holds the lock too: both go, as a process group
    holder = subprocess.Popen(["flock", str(lock), "sleep", "600"], start_new_session=True)
    try:
        wait_until_held(lock)
        done = tracedeck(*args, env=env)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    assert done.returncode == 3, done.stdout + done.stderr
    assert summary.read_text().startswith("## ❌ hello_command: LOCK_BUSY (exit 3)")
    assert 'errors="1"' in junit.read_text()


def test_a_run_id_two_directories_record_is_refused_naming_both(tmp_path: Path) -> None:
    """Two records of one id (a copy edited by hand) and no by-id link: `diff ID` was given
    the first found; which one is meant is not a guess."""
    import shutil

    out = tmp_path / "out"
    local = _run(tmp_path, out, "true", "[1]")
    run_id = json.loads((local / "run.json").read_text())["run_id"]
    twin = local.parent / "copy"
    shutil.copytree(local, twin)
    for link in (out / "by-id").iterdir():
        link.unlink()
    done = tracedeck("diff", run_id, run_id, "--out", str(out), env=cli_env(tmp_path))
    assert done.returncode == 2 and "is recorded by 2 directories" in done.stderr
    assert str(local) in done.stderr and str(twin) in done.stderr


@pytest.mark.parametrize("cut", ["no end", "torn end", "passing cells, no end"])
def test_a_record_without_its_end_never_replays_as_a_pass(cut: str, tmp_path: Path) -> None:
    """The exit code of a replay is its run_finished's: a record cut before it (a console
    killed mid-run) exits 3 and says so, even when its last cell passed with exit code 0."""
    out = tmp_path / "out"
    command = "true" if cut == "passing cells, no end" else "sh -c 'test {n} != 2'"
    local = _run(tmp_path, out, command, "[1, 2]")
    path = local / "events.jsonl"
    lines = path.read_text().splitlines()
    at = max(i for i, line in enumerate(lines) if json.loads(line)["type"] == "run_finished")
    kept = lines[:at]
    tail = lines[at][: len(lines[at]) // 2] if cut == "torn end" else ""
    assert json.loads(kept[-1]).get("exit_code", 0) == 0 or cut != "passing cells, no end"
    path.write_text("\n".join(kept) + "\n" + tail)
    done = tracedeck("replay", str(local), "--headless", env=cli_env(tmp_path))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "the record has no end (no run_finished event)" in done.stderr
