"""03C judged from the bytes and the cell's parameters, never from the engine's word (issue 20,
items 12 and 13): preconditions, shapes and log lines that lie are refused; a pass says what it
covered. Built cells for the judge, llama.cpp logs cut from tests/data, and runs of the real
reference engine wrapped by a liar."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runhelp import cli_env, tracedeck
from test_kv_invariance_analysis import POINT, flow_values, write_cell
from test_kv_invariance_runs import fake_engine, run

from analysis.kv_invariance import (
    BITWISE_EQUAL,
    PASS_INVARIANCE,
    SUMMARY,
    UNJUDGED,
    global_verdict,
    judge_cell_dir,
    summarize,
)
from analysis.kv_invariance_llamacpp import GRID, read_log

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)

DATA = Path(__file__).resolve().parent / "data" / "kv_invariance_llamacpp"
# A reference engine's honest result.json fields on top of write_cell's (H=3, gqa=1, mask on)
HONEST: dict[str, Any] = {
    "positions": 237,
    "heads": 3,
    "kv_heads": 3,
    "deterministic": True,
    "policy": {
        "kv_stride": 256,
        "mask_pad": 64,
        "pad_kv": True,
        "pad_mask": True,
        "split_reduction": False,
    },
}
PARAMS = {**POINT, "heads": 3, "dtype": "fp32"}


def judged(
    tmp_path: Path,
    point: dict[str, int] = POINT,
    params: dict[str, Any] = PARAMS,
    arrays=None,
    **meta: Any,
) -> str:  # noqa: ANN001, E501
    doc = {**HONEST, "point": point, **meta}
    folder = write_cell(tmp_path / "cell", arrays, **doc)
    return judge_cell_dir(folder, point, True, params, True).verdict


def test_the_honest_cell_is_bitwise_equal(tmp_path: Path) -> None:
    assert judged(tmp_path) == BITWISE_EQUAL


def test_issue_12_done_at_kv_300_is_not_believed(tmp_path: Path) -> None:
    point = {**POINT, "kv": 300}
    folder = write_cell(tmp_path / "c", None, **{**HONEST, "point": point})
    result = judge_cell_dir(folder, point, True, {**PARAMS, "kv": 300}, True)
    assert result.verdict == UNJUDGED and "not a multiple of FATTN_KQ_STRIDE" in result.reason
    assert global_verdict([result])[0] != PASS_INVARIANCE


def test_issue_12_one_head_claimed_with_gqa_2_is_refused(tmp_path: Path) -> None:
    """H=1 cannot be with two query heads per KV head: the bytes hide or invent heads."""
    point = {**POINT, "gqa": 2}
    one_head = {
        f: flow_values()[:8] for f in ("single", "incremental", "chunk8", "chunk33", "alone")
    }
    folder = write_cell(
        tmp_path / "c",
        one_head,
        **{
            **HONEST,
            "point": point,
            "shape": [2, 1, 4],
            "flow_bytes": 32,
            "heads": 1,
            "kv_heads": 1,
        },
    )
    result = judge_cell_dir(folder, point, True, {}, True)
    assert result.verdict == UNJUDGED and "not a multiple of gqa=2" in result.reason


# -- the liar matrix: every claim of a result.json, told as a lie ---------------------------------

Lie = Callable[[Path], str]
LIES: dict[str, dict[str, Any]] = {
    "heads (result)": {"heads": 4},
    "kv_heads": {"kv_heads": 1},
    "positions beyond kv": {"positions": 300},
    "positions short of kv with the mask off": {"point": {**POINT, "mask": 0}, "positions": 237},
    "policy.kv_stride": {"policy": {**HONEST["policy"], "kv_stride": 128}},
    "policy.mask_pad": {"policy": {**HONEST["policy"], "mask_pad": 32}},
    "policy.pad_kv false": {"policy": {**HONEST["policy"], "pad_kv": False}},
    "policy.pad_mask false": {"policy": {**HONEST["policy"], "pad_mask": False}},
    "deterministic false": {"deterministic": False},
    "status": {"status": "OK"},
    "point": {"point": {**POINT, "d": 8}},
    "dtype": {"dtype": "float16"},
    "flow_bytes": {"flow_bytes": 48},
    "flows_sha256": {"flows_sha256": "0" * 64},
    "flows missing one": {"flows": ["single", "incremental", "chunk8", "chunk33"]},
    "chunk_tests": {"chunk_tests": False},
    "byte_order": {"byte_order": "middle"},
    "format": {"format": "tracedeck.kv_invariance/0"},
    "precondition without its fix": {"status": "PRECONDITION", "rule": "r", "message": "m"},
}
PARAM_LIES: dict[str, dict[str, Any]] = {
    "heads the cell ran": {**PARAMS, "heads": 4},
    "dtype the cell ran": {**PARAMS, "dtype": "bf16"},
}


@pytest.mark.parametrize("name", list(LIES))
def test_liar_matrix_result(tmp_path: Path, name: str) -> None:
    meta = dict(LIES[name])
    point = POINT if "point" not in meta or name == "point" else meta["point"]
    folder = write_cell(tmp_path / "c", None, **{**HONEST, **meta})
    params = {**PARAMS, **point}
    result = judge_cell_dir(folder, point, True, params, True)
    assert result.verdict != BITWISE_EQUAL, result
    assert global_verdict([result])[0] != PASS_INVARIANCE


@pytest.mark.parametrize("name", list(PARAM_LIES))
def test_liar_matrix_against_the_cells_parameters(tmp_path: Path, name: str) -> None:
    assert judged(tmp_path, params=PARAM_LIES[name]) == UNJUDGED


def test_liar_matrix_the_cells_environment(tmp_path: Path) -> None:
    folder = write_cell(tmp_path / "c", None, **HONEST)
    assert judge_cell_dir(folder, POINT, True, PARAMS, False).verdict == UNJUDGED


def test_a_nan_flow_and_a_one_bit_flip_are_never_equal(tmp_path: Path) -> None:
    base = flow_values()
    flipped = base.copy().view("<u4")
    flipped[5] ^= 1
    arrays = {"single": base, "incremental": flipped.view("<f4"), "chunk8": base, "chunk33": base}
    arrays["alone"] = base
    assert judged(tmp_path, arrays=arrays) == "DIFFERS"
    nan = base.copy()
    nan[0] = np.nan
    arrays = {f: nan for f in arrays}
    assert judged(tmp_path / "n", arrays=arrays) == UNJUDGED


# -- 13: llama.cpp's log: every cell seen judged -----------------------------------------------


def cpu_ok_lines() -> list[str]:
    return (DATA / "cpu_ok.log").read_text().splitlines()


def kvci_free(lines: list[str], keep: Callable[[int], bool]) -> str:
    """The log with the [kvci] lines of the cells whose index (in the test's order) keep()
    refuses taken out."""
    out, cell = [], -1
    for line in lines:
        if line.startswith("[kvci] q ne="):  # a single-shot q line (N > 1) opens a cell
            cell += int(line.split("[")[2].split(",")[1]) > 1
        if line.startswith("[kvci]") and not keep(cell):
            continue
        out.append(line)
    return "\n".join(out)


def judge_log(text: str) -> tuple[str, str, list[Any]]:
    cells, problems, _ = read_log(text).results(None)
    word, reason = global_verdict(cells, problems)
    return word, reason, cells


def test_issue_13_ok_with_no_kvci_line_is_no_pass() -> None:
    text = "\n".join(x for x in cpu_ok_lines() if not x.startswith("[kvci]"))
    word, _, cells = judge_log(text)
    assert word != PASS_INVARIANCE
    assert [c.verdict for c in cells] == [UNJUDGED] * 8
    assert all("no [kvci] line shows this cell run" in c.reason for c in cells)


def test_issue_13_ok_with_half_the_cells_seen_judges_only_those() -> None:
    word, _, cells = judge_log(kvci_free(cpu_ok_lines(), lambda i: i < 4))
    assert word != PASS_INVARIANCE
    assert [c.verdict for c in cells] == [BITWISE_EQUAL] * 4 + [UNJUDGED] * 4


def test_issue_13_a_single_shot_graph_without_incremental_ones_is_not_judged() -> None:
    lines = cpu_ok_lines()
    first_inc = next(i for i, x in enumerate(lines) if x.startswith("[kvci] q ne=[128,1,"))
    cut = [x for i, x in enumerate(lines) if not (first_inc <= i < first_inc + 9)]
    word, _, cells = judge_log("\n".join(cut))
    assert word != PASS_INVARIANCE
    assert cells[0].verdict == UNJUDGED and "no incremental graph" in cells[0].reason


def test_issue_13_a_graph_outside_the_tests_grid_is_a_problem() -> None:
    text = "\n".join(cpu_ok_lines()).replace(
        "[kvci] k ne=[128,256,4,1]", "[kvci] k ne=[128,256,3,1]"
    )
    cells, problems, _ = read_log(text).results(None)
    assert any("not a cell of the test's grid" in why for _, why in problems)
    assert global_verdict(cells, problems)[0] != PASS_INVARIANCE


def test_issue_13_a_pass_says_it_covers_8_of_the_seeds_96_cells() -> None:
    word, reason, cells = judge_log("\n".join(cpu_ok_lines()))
    assert word == PASS_INVARIANCE and len(cells) == len(GRID) == 8
    assert "cover 8 of the seed's 96 grid points" in reason
    assert "never covered: d 64, b 8, mask 0, alibi 1" in reason
    assert "flows never compared: chunk8, chunk33" in reason
    summary = summarize(cells, "2026-01-01")
    assert summary["coverage"]["covered"] == 8 and summary["coverage"]["seed_points"] == 96


LOG_LIES: dict[str, Callable[[str], str]] = {
    "[OK] with no [kvci] lines": lambda t: "\n".join(
        x for x in t.splitlines() if not x.startswith("[kvci]")
    ),
    "Backends passed: 2 claims a backend that never ran": lambda t: t.replace(
        "Backends passed: 1", "Backends passed: 2"
    ),
    "exit 0 after a [FAIL]": lambda t: t.replace(
        "[OK] CPU", "[FAIL] KV invariance: backend=CPU D=256 KV=1024 gqa=2\n[FAIL] CPU rc=1"
    ),
    "exit 1 without a [FAIL]": lambda t: t.replace("exited 0", "exited 1"),
    "a crash after [OK]": lambda t: t.replace("exited 0", "exited 134"),
    "a k line whose heads are no gqa of 8": lambda t: t.replace(
        "[kvci] k ne=[128,256,8,1]", "[kvci] k ne=[128,256,5,1]", 1
    ),
}


@pytest.mark.parametrize("name", list(LOG_LIES))
def test_liar_matrix_llamacpp_log(name: str) -> None:
    text = LOG_LIES[name]((DATA / "cpu_ok.log").read_text())
    assert judge_log(text)[0] != PASS_INVARIANCE


# -- runs of the real reference engine, wrapped by a liar ---------------------------------------

LIAR = """
import hashlib, json, sys
from pathlib import Path
cell, lie = Path(sys.argv[1]), sys.argv[2]
meta = json.loads((cell / "result.json").read_text())
if lie == "kv300":  # ran at kv=256, says it ran the kv=300 cell
    meta["point"]["kv"] = 300
elif lie == "one_head":  # keeps one head of the single-shot flow, for every flow
    b, h, d = meta["shape"]
    size = meta["flow_bytes"] // (b * h * d)
    data = (cell / "flows.bin").read_bytes()[: meta["flow_bytes"]]
    head0 = b"".join(data[(r * h) * d * size : (r * h + 1) * d * size] for r in range(b))
    payload = head0 * len(meta["flows"])
    (cell / "flows.bin").write_bytes(payload)
    meta.update(shape=[b, 1, d], heads=1, kv_heads=1, flow_bytes=len(head0))
    meta["flows_sha256"] = hashlib.sha256(payload).hexdigest()
(cell / "result.json").write_text(json.dumps(meta))
"""


def liar_engine(tmp_path: Path, lie: str, kv: int, inject: str = "none") -> list[str]:
    liar = tmp_path / "liar.py"
    liar.write_text(LIAR)
    real = (
        f"{sys.executable} -m runners.reference kv_invariance --d 64 --kv {kv} --gqa 2 --alibi 1 "
        f'--sinks 1 --inject {inject} --out "$1" && {sys.executable} {liar} "$1" {lie}'
    )
    return fake_engine(real)


@pytest.mark.e2e  # runs the engine or a process: out of the fast tier
def test_issue_12_a_run_whose_engine_claims_kv_300_fails(tmp_path: Path) -> None:
    done, _, _ = run(tmp_path, *liar_engine(tmp_path, "kv300", 256), "--set", "matrix.kv=[300]")
    assert done.returncode != 0, done.stdout + done.stderr
    assert "not a multiple of FATTN_KQ_STRIDE" in done.stdout
    assert "PASS_INVARIANCE" not in done.stdout


@pytest.mark.e2e  # runs the engine or a process: out of the fast tier
def test_issue_12_a_run_whose_engine_hides_heads_fails(tmp_path: Path) -> None:
    args = liar_engine(tmp_path, "one_head", 256, inject="split_reduction")
    done, _, _ = run(tmp_path, *args)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "not a multiple of gqa=2" in done.stdout
    assert "PASS_INVARIANCE" not in done.stdout


def test_issue_14_analyze_never_rewrites_a_runs_summary(tmp_path: Path) -> None:
    from test_kv_invariance_runs import ONE_CELL

    done, local_dir, home = run(tmp_path, *ONE_CELL)
    assert done.returncode == 0 and local_dir is not None, done.stdout + done.stderr
    before = {p: p.read_bytes() for p in local_dir.rglob("*") if p.is_file()}
    again = tracedeck("analyze", str(local_dir), env=cli_env(home))
    assert again.returncode == 0, again.stdout + again.stderr
    assert {p: p.read_bytes() for p in local_dir.rglob("*") if p.is_file()} == before
    assert "its recorded verdict stays as the run wrote it" in again.stderr
    (written,) = local_dir.parent.glob(f"{local_dir.name}.analyze-*/{SUMMARY}")
    assert json.loads(written.read_text())["global_verdict"] == PASS_INVARIANCE
    assert f"wrote {written}" in again.stdout
