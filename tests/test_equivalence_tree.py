"""B3.67 tree: judge_pair, write_pair and analyze_tree on trees written here under the seed's contract."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from analysis.equivalence import THRESHOLDS, exit_code_for
from analysis.equivalence_tree import judge_pair, metrics_path
from analysis.logits import InputError
from runners.kinds.equivalence import REPORT_NAME, analyze_tree
from runners.kinds.equivalence import write_pair as write_metrics

T, V = 6, 64
METRICS_KEYS = [
    "seed",
    "dtype",
    "prompt_len",
    "gen_len",
    "kv_aligned",
    "pair_count",
    "metrics",
    "verdict",
    "thresholds",
    "first_fail",
    "timestamp",
]
SUMMARY_KEYS = [
    "benchmark",
    "date",
    "config_matrix",
    "total_runs",
    "pass_equiv",
    "fail_equiv",
    "expected_drift",
    "results",
    "first_fail",
    "global_verdict",
    "threshold_config",
]


# ---------------------------------------------------------------- the engine side of the contract


def side_data(seed: int, noise: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.normal(0.0, 3.0, (T, V)).astype(np.float32)
    b = (a + rng.normal(0.0, noise, (T, V))).astype(np.float32)
    return a, b, np.argmax(a, axis=1)


def write_side(side: Path, logits: np.ndarray, ids: np.ndarray, meta: dict[str, Any]) -> None:
    side.mkdir(parents=True)
    with gzip.open(side / "logits.jsonl.gz", "wt") as fh:
        for i, row in enumerate(logits):
            record = {"token_idx": i, "logits": [float(x) for x in row], "token_id": int(ids[i])}
            fh.write(json.dumps(record) + "\n")
    (side / "metadata.json").write_text(json.dumps(meta, indent=2))


def write_pair(
    root: Path, kv: int, seed: int, noise: float, **meta_overrides: Any
) -> tuple[np.ndarray, np.ndarray]:
    a, b, ids = side_data(100 * kv + seed, noise)
    base = root / "runs" / f"kv_aligned_{kv}" / f"seed_{seed}"
    for mode, logits in (("prefill", a), ("decode", b)):
        meta = {
            "dtype": "bf16",
            "prompt_len": 16,
            "gen_len": T,
            "seed": seed,
            "kv_aligned": kv,
            "mode": mode,
            "timestamp": "2026-02-07T20:00:00Z",
            "git_commit": "abc123",
        }
        meta.update(meta_overrides.get(mode, {}))
        write_side(base / mode, logits, ids, meta)
    return a, b


def write_tree(root: Path, plan: dict[int, dict[int, float]]) -> dict[tuple[int, int], Any]:
    return {
        (kv, seed): write_pair(root, kv, seed, noise)
        for kv, seeds in plan.items()
        for seed, noise in seeds.items()
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "2026-02-07" / "b3_67"
    path.mkdir(parents=True)
    return path


def load(path: Path) -> Any:
    return json.loads(path.read_text())


# ---------------------------------------------------------------- whole trees


def test_analyze_tree_writes_every_output_with_the_seed_schemas(root: Path) -> None:
    data = write_tree(root, {1: {0: 1e-4, 1: 1e-4, 2: 3e-2}, 0: {0: 0.5, 1: 0.5, 2: 0.5}})
    summary, results = analyze_tree(root)

    assert [(r.kv_aligned, r.seed) for r in results] == [
        (1, 0),
        (1, 1),
        (1, 2),
        (0, 0),
        (0, 1),
        (0, 2),
    ]
    assert [r.verdict for r in results] == ["PASS_EQUIV"] * 2 + ["FAIL_EQUIV"] + [
        "EXPECTED_DRIFT"
    ] * 3

    for r in results:
        doc = load(metrics_path(root, r.kv_aligned, r.seed))
        assert list(doc) == METRICS_KEYS
        assert list(doc["metrics"]) == [
            "max_abs_diff",
            "p99_abs_diff",
            "top1_agreement",
            "cos_sim_mean",
        ]
        assert (doc["seed"], doc["kv_aligned"], doc["verdict"]) == (r.seed, r.kv_aligned, r.verdict)
        assert (doc["dtype"], doc["prompt_len"], doc["gen_len"], doc["pair_count"]) == (
            "bf16",
            16,
            T,
            T,
        )
        assert doc["thresholds"] == THRESHOLDS
        assert doc["timestamp"].endswith("Z")
        # Section 8 computed independently from the arrays the writer used.
        a, b = data[(r.kv_aligned, r.seed)]
        diffs = np.abs(a - b)
        assert doc["metrics"]["max_abs_diff"] == float(diffs.max())
        assert doc["metrics"]["p99_abs_diff"] == float(np.percentile(diffs, 99))
        agree = np.mean(np.argmax(a, axis=1) == np.argmax(b, axis=1))
        assert doc["metrics"]["top1_agreement"] == float(agree)

    written = load(root / "summary.json")
    assert written == summary
    assert list(summary) == SUMMARY_KEYS
    assert summary["benchmark"] == "B3.67" and summary["date"] == "2026-02-07"
    assert summary["config_matrix"] == {
        "kv_aligned": [1, 0],
        "dtype": ["bf16"],
        "prompt_len": [16],
        "gen_len": [T],
        "seeds": [0, 1, 2],
    }
    assert (
        summary["total_runs"],
        summary["pass_equiv"],
        summary["fail_equiv"],
        summary["expected_drift"],
    ) == (6, 2, 1, 3)
    assert summary["results"]["kv_aligned_1"]["fail_equiv"] == 1
    assert summary["results"]["kv_aligned_0"]["expected_drift"] == 3
    assert summary["global_verdict"] == "FAIL_GUARDRAIL"
    assert exit_code_for(summary["global_verdict"]) == 1
    ff = summary["first_fail"]
    assert ff == results[2].first_fail and ff["seed"] == 2 and ff["kv_aligned"] == 1
    decode = root / "runs" / "kv_aligned_1" / "seed_2" / "decode" / "logits.jsonl.gz"
    assert ff["where"]["decode"] == f"{decode}:{ff['token_idx'] + 1}"
    assert summary["threshold_config"] == THRESHOLDS

    config = load(root / "config.json")
    assert config["config_matrix"] == summary["config_matrix"]
    assert config["thresholds"] == THRESHOLDS

    report = (root / REPORT_NAME).read_text()
    assert "**Global verdict: FAIL_GUARDRAIL**" in report
    assert f"token_idx {ff['token_idx']}" in report
    assert not list(root.rglob("*.tmp")), "an atomic write left its temporary file"


def test_all_aligned_pairs_passing_is_pass_guardrail(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4, 1: 1e-4}, 0: {0: 0.5}})
    summary, _ = analyze_tree(root)
    assert summary["global_verdict"] == "PASS_GUARDRAIL" and summary["first_fail"] is None
    assert exit_code_for(summary["global_verdict"]) == 0
    assert "PASS_GUARDRAIL" in (root / REPORT_NAME).read_text()


def test_drift_only_tree_is_expected_drift(root: Path) -> None:
    write_tree(root, {0: {0: 0.5, 1: 0.5}})
    summary, results = analyze_tree(root)
    assert [r.verdict for r in results] == ["EXPECTED_DRIFT"] * 2
    assert summary["global_verdict"] == "EXPECTED_DRIFT"
    assert summary["results"]["kv_aligned_1"]["total_runs"] == 0
    assert exit_code_for(summary["global_verdict"]) == 0


def test_config_json_sets_order_thresholds_and_is_kept(root: Path) -> None:
    write_tree(root, {1: {0: 3e-2}, 0: {0: 0.5}})
    loose = {"p99_abs_diff_max": 1.0, "max_abs_diff_max": 1.0, "top1_agreement_min": 0.0}
    config = {
        "run_id": "r-7",
        "config_matrix": {"kv_aligned": [0, 1], "seeds": [0]},
        "thresholds": loose,
    }
    (root / "config.json").write_text(json.dumps(config))
    summary, results = analyze_tree(root)
    assert [(r.kv_aligned, r.seed) for r in results] == [(0, 0), (1, 0)]
    assert summary["global_verdict"] == "PASS_GUARDRAIL"
    assert summary["threshold_config"] == loose
    written = load(root / "config.json")
    assert written["run_id"] == "r-7" and written["thresholds"] == loose
    assert written["config_matrix"] == config["config_matrix"]
    # An explicit argument beats config.json.
    summary, _ = analyze_tree(root, thresholds=THRESHOLDS)
    assert summary["global_verdict"] == "FAIL_GUARDRAIL"


def test_a_judged_pair_writes_its_metrics_file(root: Path) -> None:
    write_tree(root, {1: {3: 1e-4}})
    result = judge_pair(root, 1, 3, {"p99_abs_diff_max": 5e-4})
    assert not metrics_path(root, 1, 3).exists()  # judging reads; writing is the kind's
    write_metrics(root, result)
    doc = load(metrics_path(root, 1, 3))
    assert doc["verdict"] == result.verdict == "PASS_EQUIV"
    assert doc["thresholds"]["p99_abs_diff_max"] == 5e-4
    assert doc["metrics"] == result.metrics


# ---------------------------------------------------------------- bad trees


def expect(root: Path, path: Path, *fragments: str) -> None:
    with pytest.raises(InputError) as info:
        analyze_tree(root)
    text = str(info.value)
    assert text.startswith(f"{path}"), text
    assert " — " in text
    for fragment in fragments:
        assert fragment in text, text


def test_no_runs_directory(root: Path) -> None:
    expect(root, root / "runs", "no runs/")


def test_empty_runs_tree(root: Path) -> None:
    (root / "runs").mkdir()
    expect(root, root / "runs", "empty runs/")


def test_missing_side(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4, 1: 1e-4}})
    side = root / "runs" / "kv_aligned_1" / "seed_1" / "decode"
    for f in side.iterdir():
        f.unlink()
    side.rmdir()
    expect(root, side, "decode side of this pair is missing")
    assert not (root / "summary.json").exists()


def test_missing_logits_file(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4}})
    logits = root / "runs" / "kv_aligned_1" / "seed_0" / "prefill" / "logits.jsonl.gz"
    logits.unlink()
    expect(root, logits, "missing")


def test_unfinished_download(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4}})
    part = root / "runs" / "kv_aligned_1" / "seed_0" / "decode" / "logits.jsonl.gz.part"
    part.write_bytes(b"x")
    expect(root, part, "unfinished download")


@pytest.mark.parametrize(
    "stray",
    [
        "runs/notes.txt",
        "runs/kv_aligned_2",
        "runs/kv_aligned_1/seed_x",
        "runs/kv_aligned_1/seed_01",
        "runs/kv_aligned_1/seed_0/chunked",
    ],
)
def test_stray_names(root: Path, stray: str) -> None:
    write_tree(root, {1: {0: 1e-4}})
    path = root / stray
    if path.suffix:
        path.write_text("x")
    else:
        path.mkdir()
    expect(root, path, "unexpected name")


def test_kv_directory_without_seeds(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4}})
    (root / "runs" / "kv_aligned_0").mkdir()
    expect(root, root / "runs" / "kv_aligned_0", "no seed_<n>")


def test_config_lists_a_seed_that_is_absent(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4}})
    (root / "config.json").write_text(json.dumps({"config_matrix": {"seeds": [0, 1]}}))
    expect(root, root / "runs" / "kv_aligned_1" / "seed_1", "config.json lists this seed")


def test_seed_not_in_config(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4, 5: 1e-4}})
    (root / "config.json").write_text(json.dumps({"config_matrix": {"seeds": [0]}}))
    expect(root, root / "runs" / "kv_aligned_1" / "seed_5", "not in config.json")


def test_config_lists_a_kv_setting_that_is_absent(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4}})
    (root / "config.json").write_text(json.dumps({"config_matrix": {"kv_aligned": [1, 0]}}))
    expect(root, root / "runs" / "kv_aligned_0", "config.json lists it")


def test_bad_config_json(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4}})
    (root / "config.json").write_text('{"config_matrix": {"kv_aligned": [1, 1]}}')
    expect(root, root / "config.json", "config_matrix.kv_aligned")
    (root / "config.json").write_text("{\n  oops\n}")
    expect(root, root / "config.json", "not valid JSON")
    (root / "config.json").write_text('{"thresholds": {"p99": 1}}')
    expect(root, root / "config.json", "unknown threshold")


@pytest.mark.parametrize(
    ("side", "key", "value", "fragment"),
    [
        ("prefill", "seed", 9, "'seed' is 9 but the directory says 0"),
        ("decode", "kv_aligned", 0, "'kv_aligned' is 0 but the directory says 1"),
        ("decode", "mode", "prefill", "'mode' is 'prefill' but the directory says 'decode'"),
    ],
)
def test_metadata_must_match_its_place(
    root: Path, side: str, key: str, value: Any, fragment: str
) -> None:
    write_pair(root, 1, 0, 1e-4, **{side: {key: value}})
    meta = root / "runs" / "kv_aligned_1" / "seed_0" / side / "metadata.json"
    expect(root, meta, fragment)


def test_sides_must_share_their_configuration(root: Path) -> None:
    write_pair(root, 1, 0, 1e-4, decode={"dtype": "fp16"})
    base = root / "runs" / "kv_aligned_1" / "seed_0"
    expect(
        root,
        base / "decode" / "metadata.json",
        "'dtype' is 'fp16' here but 'bf16'",
        str(base / "prefill" / "metadata.json"),
    )


def test_bad_metadata_is_reported_by_key(root: Path) -> None:
    write_pair(root, 1, 0, 1e-4, prefill={"gen_len": "6"})
    meta = root / "runs" / "kv_aligned_1" / "seed_0" / "prefill" / "metadata.json"
    expect(root, meta, "key 'gen_len' must be an integer")


def test_bad_logits_stop_the_analysis(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4, 1: 1e-4}})
    logits = root / "runs" / "kv_aligned_1" / "seed_1" / "decode" / "logits.jsonl.gz"
    logits.write_bytes(logits.read_bytes()[:-10])
    expect(root, logits, "corrupt gzip")
    assert not (root / "summary.json").exists()
