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
        assert list(doc)[: len(METRICS_KEYS)] == METRICS_KEYS
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
    assert list(summary)[: len(SUMMARY_KEYS)] == SUMMARY_KEYS
    assert summary["unjudged"] == []
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
    decode = "runs/kv_aligned_1/seed_2/decode/logits.jsonl.gz"  # from the tree's root
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
    write_tree(root, {1: {0: 1e-4, 1: 1e-4}, 0: {0: 0.5, 1: 0.5}})
    summary, _ = analyze_tree(root, seeds=[0, 1])
    assert summary["global_verdict"] == "PASS_GUARDRAIL" and summary["first_fail"] is None
    assert exit_code_for(summary["global_verdict"]) == 0
    assert "PASS_GUARDRAIL" in (root / REPORT_NAME).read_text()


def test_a_drift_only_tree_guards_nothing_and_never_passes(root: Path) -> None:
    write_tree(root, {0: {0: 0.5, 1: 0.5}})
    (root / "config.json").write_text(
        json.dumps({"config_matrix": {"kv_aligned": [0], "seeds": [0, 1]}})
    )
    summary, results = analyze_tree(root)
    assert [r.verdict for r in results] == ["EXPECTED_DRIFT"] * 2
    assert summary["global_verdict"] == "FAIL_GUARDRAIL"
    assert "no kv_aligned=1 pair" in summary["reason"]
    assert summary["results"]["kv_aligned_1"]["total_runs"] == 0
    assert exit_code_for(summary["global_verdict"]) == 1


def test_without_config_json_the_seeds_matrix_is_expected(root: Path) -> None:
    """Issue 9 case 5: a whole seed missing, or no kv_aligned_1 at all, is never a pass."""
    write_tree(root, {1: {0: 1e-4, 2: 1e-4}, 0: {0: 0.5, 2: 0.5}})
    summary, _ = analyze_tree(root)
    assert summary["global_verdict"] == "INPUT_ERROR"
    pairs = [u["pair"] for u in summary["unjudged"]]
    assert pairs == ["kv_aligned_1/seed_1", "kv_aligned_0/seed_1"]
    assert "missing" in summary["unjudged"][0]["why"]
    assert load(root / "summary.json")["global_verdict"] == "INPUT_ERROR"
    # --seeds narrows the matrix on purpose; a pair outside it is refused, never skipped
    summary, _ = analyze_tree(root, seeds=[0, 2])
    assert summary["global_verdict"] == "PASS_GUARDRAIL"
    with pytest.raises(InputError, match="outside the matrix"):
        analyze_tree(root, seeds=[0])


def test_no_kv_aligned_1_directory_is_never_expected_drift(root: Path) -> None:
    write_tree(root, {0: {0: 0.5, 1: 0.5, 2: 0.5}})
    summary, _ = analyze_tree(root)
    assert summary["global_verdict"] == "INPUT_ERROR"
    assert [u["pair"] for u in summary["unjudged"]] == [f"kv_aligned_1/seed_{n}" for n in range(3)]


def test_config_json_sets_the_order_and_may_tighten_but_never_loosen(root: Path) -> None:
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
    # Issue 9 case 6: the tree's own thresholds 1e9-style loosening is refused.
    assert summary["global_verdict"] == "FAIL_GUARDRAIL"
    assert summary["threshold_config"] == THRESHOLDS
    assert any("looser than the seed's" in note for note in summary["notes"])
    written = load(root / "config.json")
    assert written["run_id"] == "r-7" and written["config_matrix"] == config["config_matrix"]
    assert written["thresholds"] == THRESHOLDS
    # Stricter thresholds in config.json are honoured.
    write_tree_again = {**config, "thresholds": {"max_abs_diff_max": 1e-9}}
    (root / "config.json").write_text(json.dumps(write_tree_again))
    summary, _ = analyze_tree(root)
    assert summary["threshold_config"]["max_abs_diff_max"] == 1e-9
    # An explicit argument is what the caller (analyze --threshold) checked already.
    summary, _ = analyze_tree(root, thresholds=loose)
    assert summary["global_verdict"] == "PASS_GUARDRAIL_LOOSENED"
    assert summary["thresholds_loosened"]["p99_abs_diff_max"]["factor"] == 1000.0
    assert "Thresholds loosened by the operator" in (root / REPORT_NAME).read_text()


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


def expect_refused(root: Path, path: Path, *fragments: str) -> None:
    """A tree whose layout cannot be read at all: a located InputError, nothing judged."""
    with pytest.raises(InputError) as info:
        analyze_tree(root, seeds=[0])
    text = str(info.value)
    assert text.startswith(f"{path}"), text
    assert " — " in text
    for fragment in fragments:
        assert fragment in text, text


def expect(root: Path, path: Path, *fragments: str, seeds: list[int] | None = None) -> None:
    """A pair that cannot be judged: named with where and why, and the tree is not a pass."""
    summary, _ = analyze_tree(root, seeds=seeds or [0])
    assert summary["global_verdict"] == "INPUT_ERROR", summary
    whys = [u["why"] for u in summary["unjudged"]]
    found = [w for w in whys if w.startswith(str(path))]
    assert found, whys
    for fragment in fragments:
        assert fragment in found[0], found[0]
    assert load(root / "summary.json")["global_verdict"] == "INPUT_ERROR"
    assert "**Global verdict: INPUT_ERROR**" in (root / REPORT_NAME).read_text()


def test_no_runs_directory(root: Path) -> None:
    expect_refused(root, root / "runs", "no runs/")


def test_empty_runs_tree(root: Path) -> None:
    (root / "runs").mkdir()
    expect(root, root / "runs" / "kv_aligned_1" / "seed_0", "missing")


def test_missing_side(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4, 1: 1e-4}, 0: {0: 0.5, 1: 0.5}})
    side = root / "runs" / "kv_aligned_1" / "seed_1" / "decode"
    for f in side.iterdir():
        f.unlink()
    side.rmdir()
    expect(root, side, "decode side of this pair is missing", seeds=[0, 1])


def test_a_failed_analyze_replaces_the_previous_verdict(root: Path) -> None:
    """Issue 9 case 2: analyze a good tree, delete one side, analyze again."""
    write_tree(root, {1: {0: 1e-4}, 0: {0: 0.5}})
    assert analyze_tree(root, seeds=[0])[0]["global_verdict"] == "PASS_GUARDRAIL"
    (root / "runs" / "kv_aligned_1" / "seed_0" / "decode" / "logits.jsonl.gz").unlink()
    expect(root, root / "runs" / "kv_aligned_1" / "seed_0" / "decode", "missing")
    assert "PASS_GUARDRAIL" not in (root / "summary.json").read_text()


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
    expect_refused(root, path, "unexpected name")


def test_kv_directory_without_seeds(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4}})
    (root / "runs" / "kv_aligned_0").mkdir()
    expect(root, root / "runs" / "kv_aligned_0" / "seed_0", "missing")


def test_config_lists_a_seed_that_is_absent(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4}})
    config = {"config_matrix": {"kv_aligned": [1], "seeds": [0, 1]}}
    (root / "config.json").write_text(json.dumps(config))
    summary, _ = analyze_tree(root)
    assert summary["global_verdict"] == "INPUT_ERROR"
    assert [u["pair"] for u in summary["unjudged"]] == ["kv_aligned_1/seed_1"]


def test_seed_not_in_config(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4, 5: 1e-4}})
    (root / "config.json").write_text(json.dumps({"config_matrix": {"seeds": [0]}}))
    with pytest.raises(InputError, match="a pair outside the matrix being judged"):
        analyze_tree(root)


def test_config_lists_a_kv_setting_that_is_absent(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4}})
    config = {"config_matrix": {"kv_aligned": [1, 0], "seeds": [0]}}
    (root / "config.json").write_text(json.dumps(config))
    summary, _ = analyze_tree(root)
    assert summary["global_verdict"] == "INPUT_ERROR"
    assert [u["pair"] for u in summary["unjudged"]] == ["kv_aligned_0/seed_0"]


def test_bad_config_json(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4}})
    (root / "config.json").write_text('{"config_matrix": {"kv_aligned": [1, 1]}}')
    expect_refused(root, root / "config.json", "config_matrix.kv_aligned")
    (root / "config.json").write_text("{\n  oops\n}")
    expect_refused(root, root / "config.json", "not valid JSON")
    (root / "config.json").write_text('{"thresholds": {"p99": 1}}')
    expect_refused(root, root / "config.json", "unknown threshold")


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


def test_bad_logits_leave_their_pair_unjudged(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4, 1: 1e-4}, 0: {0: 0.5, 1: 0.5}})
    logits = root / "runs" / "kv_aligned_1" / "seed_1" / "decode" / "logits.jsonl.gz"
    logits.write_bytes(logits.read_bytes()[:-10])
    expect(root, logits, "corrupt gzip", seeds=[0, 1])


def test_missing_tokens_are_never_a_pass(root: Path) -> None:
    """Issue 9 case 4: both sides with fewer lines than gen_len, no early stop recorded."""
    write_tree(root, {1: {0: 1e-4}, 0: {0: 0.5}})
    for mode in ("prefill", "decode"):
        meta = root / "runs" / "kv_aligned_1" / "seed_0" / mode / "metadata.json"
        doc = load(meta)
        doc["gen_len"] = T + 3
        meta.write_text(json.dumps(doc))
    expect(
        root, root / "runs" / "kv_aligned_1" / "seed_0", f"{T} token lines but gen_len is {T + 3}"
    )


def test_an_early_stop_recorded_on_both_sides_is_judged(root: Path) -> None:
    write_tree(root, {1: {0: 1e-4}, 0: {0: 0.5}})
    base = root / "runs" / "kv_aligned_1" / "seed_0"
    eos = int(side_data(100, 1e-4)[2][T - 1])  # the id both sides chose last
    for mode, stop in (("prefill", T - 1), ("decode", T - 1)):
        doc = load(base / mode / "metadata.json")
        doc.update(gen_len=T + 10, eos_at_token=stop, eos_token_id=eos)
        (base / mode / "metadata.json").write_text(json.dumps(doc))
    summary, _ = analyze_tree(root, seeds=[0])
    assert summary["global_verdict"] == "PASS_GUARDRAIL"
    doc = load(base / "decode" / "metadata.json")
    doc["eos_at_token"] = T - 2  # the sides disagree on where they stopped
    (base / "decode" / "metadata.json").write_text(json.dumps(doc))
    expect(root, base, "no early stop at token")


# ---------------------------------------------------------------- across processes


@pytest.mark.e2e  # runs the engine or a process: out of the fast tier
def test_judging_across_processes_gives_the_same_results_and_errors(root: Path) -> None:
    """A tree's pairs in a pool, and one pair's sides in two processes, judge exactly as one
    process does: the same metrics, first fails and located errors, in the same order."""
    from analysis.equivalence_tree import judge_tree

    write_tree(root, {1: {0: 0.0, 1: 0.5, 2: 1e-4}, 0: {0: 1e-3}})
    decode = root / "runs" / "kv_aligned_1" / "seed_2" / "decode" / "logits.jsonl.gz"
    lines = gzip.decompress(decode.read_bytes()).split(b"\n")
    lines[3] = lines[3].replace(b'"token_id"', b'"token_ix"')  # a broken line on a decode side
    decode.write_bytes(gzip.compress(b"\n".join(lines)))
    alone = judge_tree(root, workers=1)
    pooled = judge_tree(root, workers=2)
    assert [r.__dict__ for r in pooled.results] == [r.__dict__ for r in alone.results]
    assert pooled.unjudged == alone.unjudged
    assert len(alone.results) == 3 and "decode/logits.jsonl.gz:4" in alone.unjudged[0].why
    for kv, seed in ((1, 1), (1, 0)):
        one = judge_pair(root, kv, seed, workers=1)
        two = judge_pair(root, kv, seed, workers=2)  # the decode side read by a helper process
        assert two.__dict__ == one.__dict__
    with pytest.raises(InputError) as info:
        judge_pair(root, 1, 2, workers=2)
    assert str(info.value) == alone.unjudged[0].why  # raised there, told here, word for word
