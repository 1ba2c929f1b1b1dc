"""A recorded run read back (diff, replay, the CI reports) never believes a verdict its own
events deny, never hides a cell behind another with the same parameters, and names a damaged
record instead of a traceback. Real runs of the command kind, records then edited by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runhelp import cli_env, run_dirs, tracedeck


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
