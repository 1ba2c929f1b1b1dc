"""An adversarial round on verdict truth: each input below made tracedeck report a pass (or a
better word, count or statistic) that its raw data did not support; each is now a failure named
where and why. Recorded runs are the checked-in ones, edited by hand; trees are judged by the
real analyzer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from runhelp import cli_env, run_dirs, tracedeck
from test_equivalence_tree import write_tree

from runners.kinds.equivalence import analyze_tree

DATA = Path(__file__).resolve().parent / "data"


def _edited(tmp_path: Path, name: str, drop: str, verdict: str) -> Path:
    """A copy of a recorded run whose failing verdict events were deleted and whose end was
    rewritten as a pass (`drop`: the event type whose non-passing lines go)."""
    local = tmp_path / name
    shutil.copytree(DATA / name, local)
    path = local / "events.jsonl"
    kept = []
    for line in path.read_text().splitlines():
        e = json.loads(line)
        if e["type"] == drop and e["verdict"] not in (
            "PASS_EQUIV",
            "EXPECTED_DRIFT",
            "BITWISE_EQUAL",
        ):
            continue
        if e["type"] == "run_finished":
            e.update(verdict=verdict, exit_code=0)
        kept.append(json.dumps(e))
    path.write_text("\n".join(kept) + "\n")
    return local


@pytest.mark.parametrize(
    ("name", "drop", "verdict", "item"),
    [("equivalence_fail", "pair_verdict", "PASS_GUARDRAIL", "pair kv_aligned=1 seed=1"),
     ("kv_invariance_run", "kv_cell_verdict", "PASS_INVARIANCE", "cell d=128 kv=1024")],
)  # fmt: skip
def test_a_record_that_lost_its_failing_verdicts_is_no_pass(
    tmp_path: Path, name: str, drop: str, verdict: str, item: str
) -> None:
    """The failing pair (cell) verdicts deleted from events.jsonl, the end made a pass: the
    planned pair (cell) has no verdict, and replay, the CI reports and diff say so instead of
    the pass (replay said PASS_GUARDRAIL exit 0, the summary ✅ with 0 failed)."""
    local = _edited(tmp_path, name, drop, verdict)
    summary = tmp_path / "s.md"
    env = cli_env(tmp_path)
    done = tracedeck("replay", str(local), "--headless", "--summary-md", str(summary), env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"RESULT: {verdict} (contradicted) (exit 1)" in done.stdout
    assert f"is contradicted by its own events ({item}" in done.stderr, done.stderr
    assert summary.read_text().startswith(
        f"## ❌ {json.loads((local / 'run.json').read_text())['preset']}"
    )
    done = tracedeck("diff", str(DATA / name), str(local), env=env)
    assert f"-> {verdict} (contradicted)" in done.stdout, done.stdout


def test_one_stricter_threshold_never_drops_the_trees_stricter_other(tmp_path: Path) -> None:
    """config.json (the run's own thresholds) tightens p99 to 1e-4, which every kv_aligned=1
    pair fails; `analyze --threshold max_abs_diff_max=4e-3` (stricter still) judged with the
    seed's p99 (1e-3) instead, and the tree went from FAIL_GUARDRAIL to PASS_GUARDRAIL."""
    root = tmp_path / "2026-02-07" / "b3_67"
    root.mkdir(parents=True)
    write_tree(root, {1: {0: 3e-4, 1: 3e-4, 2: 3e-4}, 0: {0: 0.5, 1: 0.5, 2: 0.5}})
    strict = {"p99_abs_diff_max": 1e-4, "max_abs_diff_max": 5e-3, "top1_agreement_min": 0.999}
    (root / "config.json").write_text(json.dumps({"thresholds": strict}))
    summary, _ = analyze_tree(root, output=tmp_path / "plain")
    assert summary["global_verdict"] == "FAIL_GUARDRAIL"
    summary, _ = analyze_tree(root, {"max_abs_diff_max": 4e-3}, output=tmp_path / "stricter")
    assert summary["global_verdict"] == "FAIL_GUARDRAIL", summary["threshold_config"]
    assert summary["threshold_config"] == {**strict, "max_abs_diff_max": 4e-3}


# The reference engine behind a wrapper: the first decode of the run writes broken logits
# (the readout_offset bug), every later one is honest.
FIRST_DECODE_BROKEN = (
    'sh -c \'inject=none; if [ "$1" = decode ] && mkdir "$2" 2>/dev/null; then '
    'inject=readout_offset; fi; shift 2; exec "$@" --inject $inject\' x {mode} FLAG '
    "{python} -m runners.reference equivalence --mode {mode} --kv-aligned {kv_aligned} "
    "--seed {seed} --dtype {dtype} --prompt-len {prompt_len} --gen-len {gen_len} "
    "--vocab {vocab} --out {out}/runs/kv_aligned_{kv_aligned}/seed_{seed}/{mode}"
)


@pytest.mark.parametrize("key", ["seed", "kv_aligned"])
def test_a_seed_run_twice_is_refused_never_judged_on_its_last_run(tmp_path: Path, key: str) -> None:
    """matrix.seed = [0, 0]: both runs of seed 0 wrote the same directory and only the last
    pair was judged; the first, broken, was never looked at and the run said PASS_GUARDRAIL
    (exit 0). The B3.67 layout has one place per seed: a repeated value is a preset error."""
    matrix = (
        {"seed": "[0, 0]", "kv_aligned": "[1]"}
        if key == "seed"
        else {"seed": "[0]", "kv_aligned": "[1, 1]"}
    )
    command = FIRST_DECODE_BROKEN.replace("FLAG", str(tmp_path / "broken-once"))
    done = tracedeck(
        "run", "b3_67_smoke", "--out", str(tmp_path / "out"),
        "--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"',
        "--set", f"matrix.seed={matrix['seed']}", "--set", f"matrix.kv_aligned={matrix['kv_aligned']}",
        "--set", f"engine.command={json.dumps(command)}",
        env=cli_env(tmp_path), timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr
    assert f"matrix.{key}" in done.stderr and "more than once" in done.stderr, done.stderr


def test_analyze_of_a_run_whose_fetched_logits_were_swapped_is_refused(tmp_path: Path) -> None:
    """A failed run (the readout_offset bug) whose decode logits were replaced afterwards by a
    copy of the prefill's: analyze of the run's directory judged the files as they are now and
    said PASS_GUARDRAIL (exit 0), though the record's sha256 of what the run fetched and judged
    say otherwise. It is refused, naming the file, and nothing is written."""
    out, env = tmp_path / "out", cli_env(tmp_path)
    done = tracedeck(
        "run", "b3_67_smoke", "--out", str(out),
        "--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"',
        "--set", "matrix.seed=[0]", "--set", 'matrix.inject=["readout_offset"]',
        env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1 and "RESULT: FAIL_GUARDRAIL (exit 1)" in done.stdout
    [local] = run_dirs(out)
    side = local / "runs" / "kv_aligned_1" / "seed_0"
    shutil.copyfile(side / "prefill" / "logits.jsonl.gz", side / "decode" / "logits.jsonl.gz")
    report = tmp_path / "again"
    done = tracedeck("analyze", str(local), "--output", str(report), env=env, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "PASS_GUARDRAIL" not in done.stdout
    assert f"{side / 'decode' / 'logits.jsonl.gz'}: sha256 " in done.stderr, done.stderr
    assert not report.exists() or not any(report.iterdir())


def test_analyze_of_a_kv_run_whose_fetched_cell_was_swapped_is_refused(tmp_path: Path) -> None:
    """03C as B3.67 above: a failed cell's fetched files (split_reduction) replaced afterwards
    by a passing run's made `analyze RUN_DIR` say PASS_INVARIANCE (exit 0) against the record's
    sha256 of what the run fetched and judged. It is refused, naming the file."""
    from test_kv_invariance_runs import ONE_CELL, run

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    bad, failed, _ = run(tmp_path / "a", *ONE_CELL, "--set", 'matrix.inject=["split_reduction"]')
    good, passed, _ = run(tmp_path / "b", *ONE_CELL)
    assert bad.returncode == 1 and good.returncode == 0, bad.stdout + good.stdout
    assert failed is not None and passed is not None
    [cell] = [p.parent for p in (failed / "kv_invariance").rglob("result.json")]
    rel = cell.relative_to(failed)
    for name in ("result.json", "flows.bin"):
        shutil.copyfile(passed / rel / name, cell / name)
    report = tmp_path / "again"
    done = tracedeck("analyze", str(failed), "--output", str(report), env=cli_env(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "PASS_INVARIANCE" not in done.stdout
    assert f"{cell}/" in done.stderr and ": sha256 " in done.stderr, done.stderr
    assert not report.exists() or not any(report.iterdir())
