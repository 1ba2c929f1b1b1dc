"""Issue 14: B3.67 judged on the host, where the logits are; only metrics and context come home.

Over the real sshd: the same verdicts, metrics and first fails as judging on the console; the
logits stay on the host until `tracedeck fetch`; a host whose python cannot judge is judged
here, and the run says why. The shipped judge runs with nothing but what is shipped.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from faults import assert_run_gone, record_of
from patience import patience
from runhelp import (
    cli_env,
    events,
    python_without_numpy,
    run_dirs,
    toy_command,
    toy_engine,
    tracedeck,
    wait_for,
)
from sshd import CuttableProxy, SshHome

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)

FAILING = ["--set", "matrix.seed=[0]", "--set", 'matrix.inject=["readout_offset"]']


def smoke(
    home: SshHome, tmp: Path, out: str, *extra: str
) -> tuple[subprocess.CompletedProcess, Path]:
    done = tracedeck(
        "run",
        "b3_67_smoke",
        "--target",
        home.server.spec,
        "--out",
        str(tmp / out),
        "--set",
        f'target.python="{sys.executable}"',
        "--set",
        f'target.runs="{tmp}/remote"',
        "--set",
        f'target.lock="{tmp}/lock"',
        *toy_engine("b3_67_smoke"),
        *extra,
        env=cli_env(home.path),
        timeout=300,
    )
    return done, run_dirs(tmp / out)[0]


def without_stamps(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in ("timestamp", "date")}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.ssh
def test_judged_on_the_host_or_here_the_verdicts_are_the_same_and_the_logits_stay_there(
    ssh_home: SshHome, tmp_path: Path
) -> None:
    there, there_dir = smoke(ssh_home, tmp_path, "host", *FAILING)
    here, here_dir = smoke(ssh_home, tmp_path, "console", *FAILING, "--set", 'judge.on="console"')
    for done in (there, here):
        assert done.returncode == 1, done.stdout + done.stderr
        assert "RESULT: FAIL_GUARDRAIL (exit 1)" in done.stdout
    assert f"note:        judged on {ssh_home.server.spec}" in there.stdout
    assert "judged on this console ([judge] on = console)" in here.stdout

    metrics = sorted(p.relative_to(here_dir) for p in here_dir.glob("metrics/*/*.json"))
    assert len(metrics) == 2
    for rel in metrics:
        a, b = (json.loads((d / rel).read_text()) for d in (there_dir, here_dir))
        assert without_stamps(a) == without_stamps(b)  # first fail, top-5, where: all the same
    s_there, s_here = (json.loads((d / "summary.json").read_text()) for d in (there_dir, here_dir))
    assert without_stamps(s_there) == without_stamps(s_here)

    logits = sorted(p.relative_to(here_dir) for p in here_dir.rglob("logits.jsonl.gz"))
    assert len(logits) == 4
    assert not list(there_dir.rglob("logits.jsonl.gz"))  # never transferred
    held = [e["path"] for e in events(there_dir) if e["type"] == "artifact_held"]
    assert sorted(held) == [str(p) for p in logits]
    fetched = sum(e["size"] for e in events(there_dir) if e["type"] == "artifact")
    remote = Path(record_of(there_dir)["remote_dir"]) / "artifacts"
    left = sum((remote / p).stat().st_size for p in logits)
    assert fetched < 0.05 * left  # metadata only (the full-size figure is in the closing note)

    late = tracedeck("analyze", str(there_dir), env=cli_env(ssh_home.path))
    assert late.returncode == 2 and "tracedeck fetch" in late.stderr  # says what to do

    got = tracedeck("fetch", str(there_dir), env=cli_env(ssh_home.path))
    assert got.returncode == 0, got.stdout + got.stderr
    assert "fetched 4 file(s)" in got.stdout
    for rel in logits:
        assert sha256(there_dir / rel) == sha256(remote / rel)
    again = tracedeck("fetch", str(there_dir), env=cli_env(ssh_home.path))
    assert again.returncode == 0 and "nothing is held" in again.stdout
    analyzed = tracedeck("analyze", str(there_dir), "--json", env=cli_env(ssh_home.path))
    assert json.loads(analyzed.stdout)["global_verdict"] == "FAIL_GUARDRAIL"
    assert_run_gone(there_dir)


@pytest.mark.ssh
def test_a_host_python_that_cannot_judge_is_judged_here_and_the_run_says_why(
    ssh_home: SshHome, tmp_path: Path
) -> None:
    bare = python_without_numpy(tmp_path)
    done, local = smoke(
        ssh_home, tmp_path, "auto", "--set", "matrix.seed=[0]", "--set", f'judge.python="{bare}"'
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "judged on this console, not on the host" in done.stdout
    assert "cannot import numpy" in done.stdout
    assert len(list(local.rglob("logits.jsonl.gz"))) == 4  # fetched, as judging here needs

    refused, _ = smoke(
        ssh_home,
        tmp_path,
        "strict",
        "--set",
        "matrix.seed=[0]",
        "--set",
        f'judge.python="{bare}"',
        "--set",
        'judge.on="host"',
    )
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "[judge] on = host" in refused.stderr and "numpy" in refused.stderr


def judge_wrapper(tmp: Path, body: str) -> Path:
    """A python for [judge] python that does `body` (sh) before each call that judges a pair."""
    path = tmp / "judge-python"
    path.write_text(
        f'#!/bin/sh\ncase "$*" in *--thresholds*)\n{body}\n;;\nesac\nexec {sys.executable} "$@"\n'
    )
    path.chmod(0o755)
    return path


@pytest.mark.ssh
def test_a_judge_that_dies_on_the_host_is_an_infrastructure_failure_not_a_verdict(
    ssh_home: SshHome, tmp_path: Path
) -> None:
    killed = judge_wrapper(tmp_path, "echo 'Killed (out of memory)' >&2; exit 137")
    done, local = smoke(
        ssh_home, tmp_path, "out", "--set", "matrix.seed=[0]", "--set", f'judge.python="{killed}"'
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "RESULT: INFRA_ERROR (exit 3)" in done.stdout
    assert "exited 137" in done.stdout and "out of memory" in done.stdout
    assert_run_gone(local)


@pytest.mark.ssh
def test_a_link_cut_while_the_host_judges_loses_no_verdict(
    ssh_proxy: CuttableProxy, ssh_home: SshHome, tmp_path: Path
) -> None:
    started = tmp_path / "judging"
    slow = judge_wrapper(tmp_path, f"touch {started}; sleep 2")
    console = subprocess.Popen(
        [sys.executable, "-m", "console.cli", "run", "b3_67_smoke", "--target", ssh_proxy.spec]
        + ["--out", str(tmp_path / "out"), "--set", f'target.python="{sys.executable}"']
        + ["--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"']
        + ["--set", "matrix.seed=[0]", "--set", f'judge.python="{slow}"']
        + toy_engine("b3_67_smoke"),
        cwd=Path(__file__).resolve().parent.parent,
        env=cli_env(ssh_home.path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(started.exists, timeout=120, what="the host to start judging")
        ssh_proxy.cut()
        out, err = console.communicate(timeout=patience(300))
    finally:
        if console.poll() is None:
            console.kill()
    assert console.returncode == 0, out + err
    assert "connection lost" in out and "RESULT: PASS_GUARDRAIL (exit 0)" in out
    local = run_dirs(tmp_path / "out")[0]
    verdicts = [e for e in events(local) if e["type"] == "pair_verdict"]
    assert sorted((v["kv_aligned"], v["seed"]) for v in verdicts) == [(0, 0), (1, 0)]
    assert_run_gone(local)


# ---------------------------------------------------------------- issue 20: a judge the engine
# cannot touch or impersonate. The engine is the toy engine (tests/engines) with its readout_offset canary
# (it fails honestly), wrapped in a script that attacks the judging after it wrote its logits.

# A judge impersonated, for the old protocol (a metrics file, its path on stdout) and the new
# one (the document on stdout) alike: PASS_EQUIV with max |Δ| 14.09 and top-1 agreement 0.889.
FAKE_JUDGE = r"""
import os, sys
a = sys.argv
kv, seed = a[a.index("--kv") + 1], a[a.index("--seed") + 1]
SEED = '{"p99_abs_diff_max": 0.001, "max_abs_diff_max": 0.005, "top1_agreement_min": 0.999}'
thresholds = a[a.index("--thresholds") + 1] if "--thresholds" in a else SEED
word = "PASS_EQUIV" if kv == "1" else "EXPECTED_DRIFT"
doc = (
    '{"seed": %s, "dtype": "bf16", "prompt_len": 64, "gen_len": 16, "kv_aligned": %s, '
    '"pair_count": 16, "metrics": {"max_abs_diff": 14.09, "p99_abs_diff": 0.5, '
    '"top1_agreement": 0.889, "cos_sim_mean": 0.9}, "verdict": "%s", "thresholds": %s, '
    '"first_fail": null, "timestamp": "2026-11-25T00:00:00Z", "tokens": {"prefill": 16, '
    '"decode": 16}, "precision": null}' % (seed, kv, word, thresholds)
)
rel = "metrics/kv_aligned_%s/seed_%s_metrics.json" % (kv, seed)
os.makedirs(os.path.dirname(rel), exist_ok=True)
open(rel, "w").write(doc)
print('{"ok": true, "metrics": "%s", "document": %s}' % (rel, doc))
"""


def hostile_engine(tmp: Path, attack: str) -> list[str]:
    """--set arguments that run the smoke preset's engine, then `attack` (sh, $out is {out})."""
    fake = tmp / "fake_judge.py"
    fake.write_text(FAKE_JUDGE)
    script = tmp / "hostile.sh"
    script.write_text(f'#!/bin/sh\nout="$1"; shift\n"$@" || exit $?\nfake={fake}\n{attack}\n')
    command = toy_command("b3_67_smoke")
    return ["--set", f'engine.command="sh {script} {{out}} {command}"', *FAILING]


def assert_not_a_pass(done: subprocess.CompletedProcess, local: Path) -> None:
    assert done.returncode in (1, 3), done.stdout + done.stderr
    assert "PASS" not in json.loads((local / "summary.json").read_text())["global_verdict"]
    for path in local.glob("metrics/*/*.json"):
        assert json.loads(path.read_text())["metrics"]["max_abs_diff"] != 14.09


@pytest.mark.ssh
def test_an_engine_that_plants_a_judge_in_its_output_is_never_judged_by_it(
    ssh_home: SshHome, tmp_path: Path
) -> None:
    plant = (
        'mkdir -p "$out/runners/hosted" "$out/analysis"\n'
        "for f in runners/__init__.py runners/hosted/__init__.py analysis/__init__.py; do "
        ': > "$out/$f"; done\n'
        'cp "$fake" "$out/runners/hosted/equivalence.py"\n'
        'cp "$fake" "$out/runners/hosted/check.py"\n'
        'echo "raise SystemExit(\'planted\')" > "$out/numpy.py"\n'
    )
    done, local = smoke(ssh_home, tmp_path, "out", *hostile_engine(tmp_path, plant))
    assert_not_a_pass(done, local)
    # The real judge ran (the planted one never did): the canary's honest failure.
    assert done.returncode == 1 and "RESULT: FAIL_GUARDRAIL (exit 1)" in done.stdout
    assert f"judged on {ssh_home.server.spec}" in done.stdout
    verdicts = [e for e in events(local) if e["type"] == "pair_verdict"]
    assert {(v["kv_aligned"], v["verdict"]) for v in verdicts} == {
        (1, "FAIL_EQUIV"),
        (0, "EXPECTED_DRIFT"),
    }


@pytest.mark.ssh
@pytest.mark.parametrize(
    ("change", "said"),
    [('cp "$fake" "$out/../judge/runners/hosted/equivalence.py"\n',
      "judge/runners/hosted/equivalence.py: sha256"),
     # the judge's open of a FIFO would wait for a writer forever: it never opens one
     ('f="$out/../judge/runners/__init__.py"; rm -f "$f"; mkfifo "$f"\n',
      "judge/runners/__init__.py: not a regular file")],
    ids=["overwritten", "a fifo"],
)  # fmt: skip
def test_an_engine_that_changes_the_shipped_judge_after_launch_gets_no_verdict(
    ssh_home: SshHome, tmp_path: Path, change: str, said: str
) -> None:
    done, local = smoke(ssh_home, tmp_path, "out", *hostile_engine(tmp_path, change))
    assert_not_a_pass(done, local)
    assert done.returncode == 3 and "RESULT: INFRA_ERROR (exit 3)" in done.stdout
    assert said in done.stdout
    assert not [e for e in events(local) if e["type"] == "pair_verdict"]


@pytest.mark.ssh
def test_a_lying_metrics_file_and_a_lying_host_judge_are_refused_naming_the_pair(
    ssh_home: SshHome, tmp_path: Path
) -> None:
    """The engine leaves the issue's lying metrics file in its output, and the host's judging
    python says the same on its stdout: the console recomputes the verdict and refuses it."""
    leave = f'cd "$out" && {sys.executable} "$fake" --kv 1 --seed 0\n'
    liar = judge_wrapper(tmp_path, f'exec {sys.executable} {tmp_path / "fake_judge.py"} "$@"')
    done, local = smoke(
        ssh_home,
        tmp_path,
        "out",
        *hostile_engine(tmp_path, leave),
        "--set",
        f'judge.python="{liar}"',
    )
    assert_not_a_pass(done, local)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "kv_aligned_1/seed_0: the metrics judged on" in done.stdout
    assert "refused" in done.stdout
    assert not [e for e in events(local) if e["type"] == "pair_verdict"]
