"""Lying or self-contradicting inputs to the offline B3.67 and 03C judges, found by an adversarial
round: each was a PASS (exit 0) and is now refused or left unjudged, naming the file and key."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from test_equivalence_tree import expect, write_tree
from test_kv_invariance_analysis import POINT, write_cell

from analysis.kv_invariance import UNJUDGED, judge_cell_dir, once_per_point
from analysis.logits import InputError
from runners.kinds.equivalence import analyze_tree

SEEDS = [0, 1, 2]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "2026-02-07" / "b3_67"
    path.mkdir(parents=True)
    write_tree(path, {1: {0: 1e-5, 1: 1e-5, 2: 1e-5}, 0: {0: 0.5, 1: 0.5, 2: 0.5}})
    return path


def _side(root: Path, kv: int, seed: int, mode: str) -> Path:
    return root / "runs" / f"kv_aligned_{kv}" / f"seed_{seed}" / mode


def test_the_honest_tree_passes(root: Path) -> None:
    summary, _ = analyze_tree(root)
    assert summary["global_verdict"] == "PASS_GUARDRAIL"


@pytest.mark.parametrize(
    ("matrix", "said"),
    [({"dtype": ["fp32"]}, "says ['fp32'] but the pairs' metadata.json say ['bf16']"),
     ({"gen_len": [128]}, "says [128] but the pairs' metadata.json say [6]"),
     ({"dtype": "bf16"}, "'config_matrix.dtype' must be a list of strings"),
     ({"prompt_len": ["16"]}, "'config_matrix.prompt_len' must be a list of integers")],
)  # fmt: skip
def test_a_config_matrix_the_runs_contradict_is_refused(
    root: Path, matrix: dict, said: str
) -> None:
    config = {"config_matrix": {"kv_aligned": [1, 0], "seeds": [0, 1, 2], **matrix}}
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError) as info:
        analyze_tree(root)
    assert str(info.value).startswith(f"{root / 'config.json'}: ") and said in str(info.value)


def test_a_config_matrix_that_agrees_with_the_runs_is_kept(root: Path) -> None:
    matrix = {"kv_aligned": [1, 0], "seeds": [0, 1, 2], "dtype": ["bf16"], "gen_len": [6]}
    (root / "config.json").write_text(json.dumps({"config_matrix": matrix}))
    summary, _ = analyze_tree(root)
    assert summary["global_verdict"] == "PASS_GUARDRAIL"


def _rewrite_first_line(path: Path, change) -> None:  # type: ignore[no-untyped-def]
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    lines[0] = change(lines[0])
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))


@pytest.mark.parametrize("escaped", [False, True])
def test_a_logits_line_giving_a_key_twice_is_refused(root: Path, escaped: bool) -> None:
    """The first reading says one thing, the last another; a plain parse keeps the last."""
    path = _side(root, 1, 0, "decode") / "logits.jsonl.gz"
    record = json.loads(gzip.decompress(path.read_bytes()).decode().splitlines()[0])
    fake = [v + 100.0 for v in record["logits"]]
    key = '"logit\\u0073"' if escaped else '"logits"'
    _rewrite_first_line(path, lambda line: line[:-1] + f", {key}: {json.dumps(fake)}}}")
    expect(root, path, ":1: key 'logits' is given twice", seeds=SEEDS)


def test_metadata_giving_a_key_twice_is_refused(root: Path) -> None:
    path = _side(root, 1, 0, "prefill") / "metadata.json"
    text = path.read_text().rstrip().rstrip("}") + ', "kv_aligned": 0}'
    path.write_text(text)
    expect(root, path, "key 'kv_aligned' is given twice", seeds=SEEDS)


@pytest.mark.parametrize("how", ["hard link", "symlink"])
def test_a_decode_side_that_is_the_prefill_file_itself_is_unjudged(root: Path, how: str) -> None:
    prefill = _side(root, 1, 0, "prefill") / "logits.jsonl.gz"
    decode = _side(root, 1, 0, "decode") / "logits.jsonl.gz"
    decode.unlink()
    (os.link if how == "hard link" else os.symlink)(prefill, decode)
    expect(root, decode, "is the prefill side's file itself", seeds=SEEDS)


@pytest.mark.parametrize("said", [0, "0", "false", None, 1, "true"])
def test_a_deterministic_claim_other_than_true_is_no_pass(said: object, tmp_path: Path) -> None:
    extra = {} if said is None else {"deterministic": said}
    result = judge_cell_dir(write_cell(tmp_path / "c", **extra))
    if said is None:
        assert result.verdict != UNJUDGED  # no claim: judged by the bytes (unchanged)
    else:
        assert result.verdict == UNJUDGED and f"deterministic={said!r}" in result.reason


@pytest.mark.parametrize(
    "point",
    [{**POINT, "kv": 256.9}, {**POINT, "kv": "256"}, {**POINT, "kv": 0}, {**POINT, "mask": True},
     {**POINT, "mask": 2}, {**POINT, "d": -4}],
)  # fmt: skip
def test_a_point_value_that_is_not_the_grid_s_integer_is_unjudged(
    point: dict, tmp_path: Path
) -> None:
    result = judge_cell_dir(write_cell(tmp_path / "c", point=point))
    assert result.verdict == UNJUDGED and "'point' must hold" in result.reason


def test_a_cell_named_for_one_point_holding_another_s_result_is_unjudged(tmp_path: Path) -> None:
    named = "d4_kv1024_b2_gqa1_mask1_alibi0_sinks0"
    result = judge_cell_dir(write_cell(tmp_path / named))  # its result says kv 256
    assert result.verdict == UNJUDGED
    assert "the result is for d=4 kv=256" in result.reason and "kv=1024" in result.reason


def test_a_point_judged_twice_counts_once_and_names_both(tmp_path: Path) -> None:
    a = judge_cell_dir(write_cell(tmp_path / "a"))
    b = judge_cell_dir(write_cell(tmp_path / "b"))
    a.where, b.where = "a", "b"
    cells = once_per_point([a, b])
    assert cells[0] is a and cells[1].verdict == UNJUDGED
    assert "judged twice: here and in a" in cells[1].reason and cells[1].where == "b"
