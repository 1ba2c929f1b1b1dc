"""docs/ENGINES.md is enough: its worked example (an outside engine, stdlib only, and a preset
written from the page) runs to a verdict locally and over a real sshd, and fails its canary."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest
from runhelp import ROOT, cli_env, events, run_dirs, tracedeck
from sshd import SshHome

DOC = ROOT / "docs" / "ENGINES.md"
EXAMPLE = re.compile(r"<!-- example: (\S+) -->\n```\w*\n(.*?)\n```", re.S)


def examples() -> dict[str, str]:
    return {name: body + "\n" for name, body in EXAMPLE.findall(DOC.read_text(encoding="utf-8"))}


def write_example(tmp: Path) -> tuple[Path, Path]:
    """The engine and the preset exactly as the page shows them."""
    found = examples()
    assert set(found) == {"toy_engine.py", "toy_b3_67.toml"}, set(found)
    engine = tmp / "toy" / "toy_engine.py"
    engine.parent.mkdir(parents=True)
    engine.write_text(found["toy_engine.py"])
    preset = tmp / "toy_b3_67.toml"
    preset.write_text(found["toy_b3_67.toml"])
    return engine, preset


def isolated(tmp: Path, engine: Path) -> list[str]:
    """Only what the page says an operator changes: where the engine is on the target; and the
    test's own remote directory and lock."""
    return [
        "--set",
        f'vars.engine="{engine}"',
        "--set",
        f'target.runs="{tmp}/remote"',
        "--set",
        f'target.lock="{tmp}/lock"',
    ]


def test_the_engine_is_outside_tracedeck(tmp_path: Path) -> None:
    engine, _ = write_example(tmp_path)
    tree = ast.parse(engine.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])
    }
    assert imported <= set(sys.stdlib_module_names), imported
    assert {"json", "gzip"} <= imported


def check_passed(out: Path, done) -> Path:  # noqa: ANN001
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: PASS_GUARDRAIL (exit 0)" in done.stdout
    [local] = run_dirs(out)
    summary = json.loads((local / "summary.json").read_text())
    assert summary["global_verdict"] == "PASS_GUARDRAIL"
    assert summary["results"]["kv_aligned_1"]["pass_equiv"] == 3
    assert summary["results"]["kv_aligned_0"]["expected_drift"] == 3
    verdicts = [e for e in events(local) if e["type"] == "pair_verdict"]
    assert len(verdicts) == 6
    drift = [v for v in verdicts if v["kv_aligned"] == 0]
    assert all(v["metrics"]["max_abs_diff"] > 0 for v in drift)  # the unaligned path drifts
    return local


def test_the_worked_example_runs_to_a_verdict_locally(tmp_path: Path) -> None:
    engine, preset = write_example(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    out = tmp_path / "out"
    done = tracedeck("run", str(preset), "--out", str(out), *isolated(tmp_path, engine), env=env)
    local = check_passed(out, done)

    # CI reads one document: the summary, every pair's metrics with its first fail.
    report = tmp_path / "report"
    again = tracedeck("analyze", str(local), "--output", str(report), "--json", env=env)
    assert again.returncode == 0, again.stderr
    doc = json.loads(again.stdout)
    assert doc["global_verdict"] == "PASS_GUARDRAIL" and len(doc["pairs"]) == 6
    assert (report / "summary.json").is_file()

    # The canary: the runner-up logit read too high from token 3 on fails the guardrail.
    bad = tracedeck(
        "run",
        str(preset),
        "--out",
        str(tmp_path / "bad"),
        "--set",
        "vars.bug_at=3",
        "--set",
        "matrix.seed=[0]",
        *isolated(tmp_path, engine),
        env=env,
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    text = bad.stdout
    assert "RESULT: FAIL_GUARDRAIL (exit 1)" in text
    final = text[text.index("\n cell  state") :]  # the first fail is repeated at the end
    assert "first fail: kv_aligned=1 seed=0 token_idx=3" in final
    assert "rank  prefill id      logit   decode id      logit" in final


@pytest.mark.ssh
def test_the_worked_example_runs_to_a_verdict_over_ssh(ssh_home: SshHome, tmp_path: Path) -> None:
    # {python} is the target's python3 there (no target.python): an interpreter without
    # tracedeck runs the engine, as on any host.
    engine, preset = write_example(tmp_path)
    out = tmp_path / "out"
    done = tracedeck(
        "run",
        str(preset),
        "--target",
        ssh_home.server.spec,
        "--out",
        str(out),
        *isolated(tmp_path, engine),
        env=cli_env(ssh_home.path),
    )
    local = check_passed(out, done)
    started = next(e for e in events(local) if e["type"] == "run_started")
    assert started["cells"][0]["command"].startswith("python3 ")
    # Every file came home, or (judged on the host, where its python has numpy) the logits
    # stayed there and only the metadata and each pair's metrics came.
    came = [e["path"] for e in events(local) if e["type"] == "artifact"]
    held = [e["path"] for e in events(local) if e["type"] == "artifact_held"]
    assert len(came) + len(held) == 24
    assert all(p.endswith("/logits.jsonl.gz") for p in held)
    assert sum(p.endswith("/metadata.json") for p in came) == 12
