"""The 03C reference engine: flows bitwise equal by construction, canaries break what they name,
precondition aborts carry their rule and fix and exit 4."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from patience import patience

from analysis.kv_invariance import (
    BITWISE_EQUAL,
    DIFFERS,
    EXIT_PRECONDITION,
    PRECONDITION,
    PRECONDITION_MARK,
    judge_cell_dir,
    parse_precondition_line,
    point_of,
)
from runners.reference import kv_invariance as engine
from runners.reference.kv_attention import (
    PreconditionError,
    alibi_slopes,
    attend,
    build_mask,
    check_policy,
)

pytestmark = pytest.mark.e2e  # the torch engine's own tests, in process: out of the fast tier

ROOT = Path(__file__).resolve().parent.parent


def cell(**kw: object) -> engine.Cell:
    base: dict[str, object] = dict(
        d=8, kv=256, b=2, gqa=2, mask=1, alibi=0, sinks=0, heads=4, dtype="fp32", seed=0
    )
    base.update(inject="none")
    base.update(kw)
    return engine.Cell(**base)  # type: ignore[arg-type]


@pytest.fixture
def policy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGML_DETERMINISTIC", "1")
    monkeypatch.setenv("RUN_KVCACHE_CHUNK_TESTS", "1")


def run(c: engine.Cell, out: Path) -> tuple[dict, object]:
    result = engine.run_cell(c, out, "cpu")
    return result, judge_cell_dir(out, point_of(c.point()), result.get("chunk_tests"))


def test_the_engines_exit_code_is_the_one_the_judge_reads() -> None:
    assert engine.EXIT_PRECONDITION == EXIT_PRECONDITION == 4
    assert engine.PRECONDITION_MARK == PRECONDITION_MARK


@pytest.mark.parametrize(
    "features",
    [
        {"mask": 1, "alibi": 0, "sinks": 0},
        {"mask": 0, "alibi": 0, "sinks": 0},
        {"mask": 1, "alibi": 1, "sinks": 1},
        {"mask": 0, "alibi": 1, "sinks": 1},
    ],
    ids=["mask", "plain", "mask-alibi-sinks", "alibi-sinks"],
)
def test_every_flow_is_bitwise_equal(policy_env: None, tmp_path: Path, features: dict) -> None:
    result, verdict = run(cell(**features), tmp_path)
    assert result["flows"] == ["single", "incremental", "chunk8", "chunk33", "alone"]
    assert verdict.verdict == BITWISE_EQUAL, verdict.to_json()
    assert result["positions"] == (256 - engine.MASK_TAIL if features["mask"] else 256)


def test_bf16_flows_are_bitwise_equal_too(policy_env: None, tmp_path: Path) -> None:
    result, verdict = run(cell(dtype="bf16", b=1, mask=1, alibi=1), tmp_path)
    assert result["dtype"] == "bfloat16" and verdict.verdict == BITWISE_EQUAL


def test_without_the_chunk_gate_only_the_seeds_two_flows_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GGML_DETERMINISTIC", "1")
    monkeypatch.delenv("RUN_KVCACHE_CHUNK_TESTS", raising=False)
    result, verdict = run(cell(b=1), tmp_path)
    assert result["flows"] == ["single", "incremental"] and not result["chunk_tests"]
    assert verdict.verdict == BITWISE_EQUAL


def test_split_reduction_differs_and_names_the_first_element(
    policy_env: None, tmp_path: Path
) -> None:
    _, verdict = run(cell(inject="split_reduction"), tmp_path)
    assert verdict.verdict == DIFFERS
    first = verdict.detail["first"]
    assert first["flows"] == ["single", "incremental"]
    assert {"batch", "head", "index", "ulp", "values"} <= set(first)
    pairs = {tuple(p["flows"]) for p in verdict.detail["pairs"]}
    # every flow that reduces cached tokens apart differs; `alone` is single-shot, no cache
    assert pairs == {("single", f) for f in ("incremental", "chunk8", "chunk33")}


@pytest.mark.parametrize(
    ("inject", "mask", "rule"),
    [
        ("unpadded_kv", 1, "kv_stride_256"),
        ("unpadded_kv", 0, "kv_stride_256"),
        ("mask_unpadded", 1, "mask_pad_64"),
    ],
)
def test_canaries_on_the_policy_abort_as_preconditions(
    policy_env: None, tmp_path: Path, inject: str, mask: int, rule: str
) -> None:
    result, verdict = run(cell(inject=inject, mask=mask), tmp_path)
    assert result["status"] == "PRECONDITION" and result["rule"] == rule
    assert verdict.verdict == PRECONDITION and verdict.detail["rule"] == rule
    assert "GGML_DETERMINISTIC=1" in verdict.detail["fix"]
    assert not (tmp_path / "flows.bin").exists()


def test_mask_unpadded_leaves_cells_without_a_mask_alone(policy_env: None, tmp_path: Path) -> None:
    _, verdict = run(cell(inject="mask_unpadded", mask=0), tmp_path)
    assert verdict.verdict == BITWISE_EQUAL


def test_without_deterministic_mode_the_view_is_unpadded_and_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("GGML_DETERMINISTIC", raising=False)
    result, _ = run(cell(), tmp_path)
    assert result["status"] == "PRECONDITION" and result["rule"] == "kv_stride_256"
    assert "237" in result["message"] and "enable deterministic mode" in result["fix"]


def test_a_kv_cache_that_is_no_multiple_of_256_is_refused(policy_env: None, tmp_path: Path) -> None:
    result, _ = run(cell(kv=300, mask=0, b=1), tmp_path)
    assert result["status"] == "PRECONDITION" and result["rule"] == "kv_stride_256"
    assert (
        "is 300, not a multiple" in result["message"] and "pad the KV view to 512" in result["fix"]
    )


def test_a_stale_result_is_removed_before_a_cell_runs(policy_env: None, tmp_path: Path) -> None:
    (tmp_path / "flows.bin").write_bytes(b"old")
    result, _ = run(cell(inject="unpadded_kv"), tmp_path)
    assert result["status"] == "PRECONDITION" and not (tmp_path / "flows.bin").exists()


def test_the_policy_checks_name_the_rule() -> None:
    with pytest.raises(PreconditionError) as err:
        check_policy(300, 1, None)
    assert err.value.rule == "kv_stride_256"
    mask = build_mask(3, 256, 0, 3, 3, torch.device("cpu"))
    with pytest.raises(PreconditionError) as err:
        check_policy(256, 3, mask)
    assert err.value.rule == "mask_pad_64" and "[256, 64]" in err.value.message
    check_policy(256, 3, build_mask(3, 256, 0, 3, 64, torch.device("cpu")))


def test_the_mask_hides_the_future_the_tail_and_the_padding_rows() -> None:
    mask = build_mask(2, 256, 5, 7, 64, torch.device("cpu"))
    assert mask.shape == (64, 256)
    assert torch.isfinite(mask[0, :6]).all() and torch.isinf(mask[0, 6:]).all()
    assert torch.isfinite(mask[1, :7]).all() and torch.isinf(mask[1, 7:]).all()
    assert torch.isinf(mask[2:]).all()


def test_alibi_slopes_are_ggmls() -> None:
    assert alibi_slopes(4).tolist() == [0.25, 0.0625, 0.015625, 0.00390625]
    six = alibi_slopes(6).tolist()  # n_head_log2 = 4: two heads on the m1 series
    assert six[:4] == [0.25, 0.0625, 0.015625, 0.00390625]
    assert six[4:] == pytest.approx([0.5, 0.125])


def test_a_row_does_not_depend_on_the_rows_computed_with_it() -> None:
    """The construction itself: the last row alone equals the last row among 37 others."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 38, 16, generator=gen)
    k = torch.randn(1, 2, 256, 16, generator=gen)
    v = torch.randn(1, 2, 256, 16, generator=gen)
    slopes = alibi_slopes(4)
    dev = torch.device("cpu")
    full = attend(
        q, k, v, start=0, mask=build_mask(38, 256, 0, 38, 64, dev), slopes=slopes, sinks=None
    )
    last = attend(
        q[:, :, 37:],
        k,
        v,
        start=37,
        mask=build_mask(1, 256, 37, 38, 64, dev),
        slopes=slopes,
        sinks=None,
    )
    assert torch.equal(full[:, :, 37], last[:, :, 0])


def engine_cli(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runners.reference", "kv_invariance", *args, "--out", str(tmp_path)],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=patience(120),
    )


def test_a_precondition_abort_exits_4_with_its_record_and_guidance(tmp_path: Path) -> None:
    done = engine_cli(
        tmp_path,
        "--d",
        "8",
        "--kv",
        "256",
        "--inject",
        "mask_unpadded",
        env={"GGML_DETERMINISTIC": "1"},
    )
    assert done.returncode == 4, done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith(PRECONDITION_MARK)]
    record = parse_precondition_line(line)
    assert record is not None and record["rule"] == "mask_pad_64"
    assert (
        "PRECONDITION VIOLATED (mask_pad_64)" in done.stderr and "fix: pad the mask" in done.stderr
    )
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "PRECONDITION"


def test_bad_flags_are_usage_errors(tmp_path: Path) -> None:
    done = engine_cli(tmp_path, "--d", "8", "--kv", "256", "--gqa", "3", env={})
    assert done.returncode == 2 and "--heads 4 is not a multiple of --gqa 3" in done.stderr
    done = engine_cli(tmp_path, "--d", "8", "--kv", "10", env={})
    assert done.returncode == 2 and "must exceed 19" in done.stderr
