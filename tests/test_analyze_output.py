"""`tracedeck analyze` says every file it writes; --output DIR writes there and leaves the input
untouched; --json is one document for CI (B3.67: the summary, every pair's metrics and first
fail)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_engines_doc import write_example
from test_kv_invariance_analysis import POINT, write_cell

from analysis.kv_invariance import point_dir
from console.cli import main


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A B3.67 tree written by the outside engine of docs/ENGINES.md: seed 0 passes, seed 1's
    decode carries the canary from token 2."""
    engine, _ = write_example(tmp_path)
    root = tmp_path / "tree"
    for kv in (1, 0):
        for seed in (0, 1):
            for mode in ("prefill", "decode"):
                bug = "2" if (seed, mode) == (1, "decode") else "-1"
                side = root / "runs" / f"kv_aligned_{kv}" / f"seed_{seed}" / mode
                subprocess.run(
                    [sys.executable, str(engine), "--mode", mode, "--kv-aligned", str(kv),
                     "--seed", str(seed), "--bug-at", bug, "--out", str(side)],
                    check=True, capture_output=True,
                )  # fmt: skip
    return root


def test_output_leaves_the_tree_untouched_and_names_what_it_wrote(
    tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(tree)
    report = tmp_path / "report"
    assert main(["analyze", str(tree), "--seeds", "0,1", "--output", str(report)]) == 1
    said = capsys.readouterr().out
    assert snapshot(tree) == before
    wrote = [line.removeprefix("wrote ") for line in said.splitlines() if line.startswith("wrote ")]
    assert wrote == [
        f"{report}/summary.json",
        f"{report}/B3_67_EQUIVALENCE_GUARDRAIL.md",
        f"{report}/config.json",
        *(f"{report}/metrics/kv_aligned_{k}/seed_{s}_metrics.json" for k in (1, 0) for s in (0, 1)),
    ]
    assert all(Path(w).is_file() for w in wrote)
    assert "first fail: kv_aligned=1 seed=1 token_idx=2" in said
    # Without --output the documents go into the tree, and it says so.
    assert main(["analyze", str(tree), "--seeds", "0,1"]) == 1
    said = capsys.readouterr().out
    assert f"wrote {tree}/summary.json" in said and (tree / "summary.json").is_file()


def test_json_is_one_document_with_every_pairs_metrics_and_first_fail(
    tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["analyze", str(tree), "--seeds", "0,1", "--json", "--output", str(tmp_path / "r")])
    said = capsys.readouterr()
    doc = json.loads(said.out)
    assert code == 1 and doc["global_verdict"] == "FAIL_GUARDRAIL"
    assert doc["first_fail"]["seed"] == 1 and doc["first_fail"]["token_idx"] == 2
    pairs = {(p["kv_aligned"], p["seed"]): p for p in doc["pairs"]}
    assert set(pairs) == {(1, 0), (1, 1), (0, 0), (0, 1)}
    assert pairs[(1, 1)]["verdict"] == "FAIL_EQUIV" and pairs[(1, 1)]["first_fail"]["top5"]
    assert pairs[(1, 0)]["verdict"] == "PASS_EQUIV" and pairs[(1, 0)]["first_fail"] is None
    assert set(pairs[(1, 0)]["metrics"]) >= {"max_abs_diff", "p99_abs_diff", "top1_agreement"}
    assert len(doc["wrote"]) == 7 and "wrote 7 files" in said.err


def test_kv_invariance_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "kv"
    write_cell(root / "kv_invariance" / point_dir(POINT))  # a directory named for its point
    before = snapshot(root)
    out = tmp_path / "out"
    assert main(["analyze", str(root), "--kind", "kv_invariance", "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert snapshot(root) == before
    assert f"wrote {out}/kv_invariance_summary.json" in said
    assert json.loads((out / "kv_invariance_summary.json").read_text())["global_verdict"] == (
        "PASS_INVARIANCE"
    )
