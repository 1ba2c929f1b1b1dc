"""03C judgement on hand-made inputs: result files (good and broken), ULPs, the global word, the
grid, and llama.cpp's output lines (fixtures in tests/data/kv_invariance_llamacpp/)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from analysis.kv_invariance import (
    BITWISE_EQUAL,
    DIFFERS,
    ENGINE_ERROR,
    FAIL_INVARIANCE,
    FORMAT,
    INFRA_ERROR,
    INPUT_ERROR,
    PASS_INVARIANCE,
    PRECONDITION,
    PRECONDITION_VIOLATED,
    UNJUDGED,
    VERDICT_EXIT,
    CellResult,
    compare,
    global_verdict,
    grid_of,
    judge_cell_dir,
    ordered,
    parse_precondition_line,
    unjudged,
)
from analysis.kv_invariance_llamacpp import GRID, LlamaCppBook, parse_line, read_log

DATA = Path(__file__).resolve().parent / "data" / "kv_invariance_llamacpp"
POINT = {"d": 4, "kv": 256, "b": 2, "gqa": 1, "mask": 1, "alibi": 0, "sinks": 0}
SHAPE = [2, 3, 4]  # B, H, D


def flow_values(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(24).astype("<f4")


def write_cell(folder: Path, arrays: dict[str, np.ndarray] | None = None, **meta: Any) -> Path:
    """A cell directory as the engine writes it; keyword arguments override result.json."""
    base = flow_values()
    arrays = arrays or {f: base for f in ("single", "incremental", "chunk8", "chunk33", "alone")}
    data = b"".join(v.tobytes() for v in arrays.values())
    doc = {
        "format": FORMAT,
        "status": "DONE",
        "point": POINT,
        "dtype": "float32",
        "shape": SHAPE,
        "byte_order": "little",
        "flows": list(arrays),
        "flow_bytes": 24 * 4,
        "flows_sha256": hashlib.sha256(data).hexdigest(),
        "chunk_tests": True,
        **meta,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").write_text(json.dumps(doc))
    (folder / "flows.bin").write_bytes(data)
    return folder


def test_equal_flows_are_bitwise_equal(tmp_path: Path) -> None:
    result = judge_cell_dir(write_cell(tmp_path / "c"), POINT, chunk_tests=True)
    assert result.verdict == BITWISE_EQUAL
    assert result.detail["flows"] == ["single", "incremental", "chunk8", "chunk33", "alone"]


def test_one_ulp_in_one_flow_is_located(tmp_path: Path) -> None:
    base = flow_values()
    bumped = base.copy()
    flat = 1 * 12 + 2 * 4 + 3  # batch 1, head 2, index 3
    bumped[flat] = np.nextafter(bumped[flat], np.float32(np.inf))
    flows = {"single": base, "incremental": base, "chunk8": bumped, "chunk33": base, "alone": base}
    result = judge_cell_dir(write_cell(tmp_path / "c", flows), POINT, chunk_tests=True)
    assert result.verdict == DIFFERS
    first = result.detail["first"]
    assert (first["flows"], first["batch"], first["head"], first["index"]) == (
        ["single", "chunk8"],
        1,
        2,
        3,
    )
    assert first["ulp"] == 1 and result.detail["differing"] == 1
    assert result.detail["max_ulp"] == 1
    assert result.detail["max_abs_diff"] == pytest.approx(abs(float(bumped[flat] - base[flat])))


def test_ulps_cross_zero_and_negative_zero_is_zero() -> None:
    def bits(*values: float) -> bytes:
        return struct.pack("<" + "f" * len(values), *values)

    tiny = struct.unpack("<f", struct.pack("<I", 1))[0]  # the smallest positive subnormal
    assert list(ordered(bits(0.0, -0.0, tiny, -tiny), "float32")) == [0, 0, 1, -1]
    diff = compare(bits(tiny, 1.0), bits(-tiny, 1.0), "float32", (1, 1, 2))
    assert diff is not None and diff["first"]["ulp"] == 2 and diff["differing"] == 1
    # -0.0 and +0.0 are different bytes, so not bitwise equal, but 0 ULP apart
    diff = compare(bits(0.0), bits(-0.0), "float32", (1, 1, 1))
    assert diff is not None and diff["max_ulp"] == 0


def test_bf16_values_are_read_and_compared() -> None:
    one, next_one = struct.pack("<H", 0x3F80), struct.pack("<H", 0x3F81)
    diff = compare(one, next_one, "bfloat16", (1, 1, 1))
    assert diff is not None
    assert diff["first"]["values"] == [1.0, 1.0078125] and diff["first"]["ulp"] == 1


BROKEN: list[tuple[str, dict[str, Any], str]] = [
    ("wrong dtype", {"dtype": "float64"}, "dtype 'float64' is not one of"),
    ("wrong shape", {"shape": [2, 3, 5]}, "does not fit b=2 d=4"),
    ("shape not a list", {"shape": "2x3x4"}, "'shape' must be [B, H, D]"),
    ("missing flow", {"flows": ["single", "incremental", "chunk8", "alone"]}, "chunk33 missing"),
    ("unknown flow", {"flows": ["single", "incremental", "chunk8", "chunk33", "zz"]}, "unknown"),
    ("duplicate flow", {"flows": ["single", "single", "chunk8", "chunk33", "alone"]}, "distinct"),
    ("flow_bytes", {"flow_bytes": 95}, "flow_bytes is 95"),
    ("sha256", {"flows_sha256": "0" * 64}, "sha256 differs"),
    ("other point", {"point": {**POINT, "kv": 1024}}, "the result is for d=4 kv=1024"),
    ("no point", {"point": {"d": 4}}, "'point' must hold"),
    ("status", {"status": "MAYBE"}, "neither DONE nor PRECONDITION"),
    ("format", {"format": "something/else"}, "format is 'something/else'"),
    ("byte order", {"byte_order": "middle"}, "neither little nor big"),
    ("engine ignored the gate", {"chunk_tests": False}, "ran without the chunked flows"),
    ("precondition without a fix", {"status": "PRECONDITION", "rule": "r", "message": "m"}, "fix"),
]


@pytest.mark.parametrize(("name", "meta", "message"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_result_is_unjudged_and_located(
    tmp_path: Path, name: str, meta: dict[str, Any], message: str
) -> None:
    folder = write_cell(tmp_path / "c", **meta)
    result = judge_cell_dir(folder, POINT, chunk_tests=True)
    assert result.verdict == UNJUDGED and result.klass == "output"
    assert message in result.reason and str(folder) in result.reason


def test_a_truncated_flows_file_is_unjudged(tmp_path: Path) -> None:
    folder = write_cell(tmp_path / "c")
    data = (folder / "flows.bin").read_bytes()
    (folder / "flows.bin").write_bytes(data[:-7])
    result = judge_cell_dir(folder, POINT, chunk_tests=True)
    assert result.verdict == UNJUDGED
    assert "473 bytes; result.json promises 5 flows x 96 bytes = 480" in result.reason
    assert str(folder / "flows.bin") in result.reason


def test_nan_in_every_flow_is_never_a_pass(tmp_path: Path) -> None:
    nan = flow_values()
    nan[13] = np.nan  # batch 1 head 0 index 1
    flows = {f: nan for f in ("single", "incremental", "chunk8", "chunk33", "alone")}
    result = judge_cell_dir(write_cell(tmp_path / "c", flows), POINT, chunk_tests=True)
    assert result.verdict == UNJUDGED and result.klass == "output"
    assert "flow single holds nan at batch 1 head 0 index 1" in result.reason


def test_missing_files_and_bad_json(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = judge_cell_dir(empty, POINT)
    assert result.verdict == UNJUDGED and result.klass == "engine"
    assert "no result.json" in result.reason
    folder = write_cell(tmp_path / "nobin")
    (folder / "flows.bin").unlink()
    assert "flows.bin is not here" in judge_cell_dir(folder, POINT).reason
    bad = write_cell(tmp_path / "bad")
    (bad / "result.json").write_text('{"format": ')
    result = judge_cell_dir(bad, POINT)
    assert result.verdict == UNJUDGED and "not valid JSON" in result.reason


def test_a_precondition_result_carries_rule_and_fix(tmp_path: Path) -> None:
    folder = write_cell(
        tmp_path / "c",
        status="PRECONDITION",
        rule="kv_stride_256",
        message="the KV length presented to attention is 237",
        fix="pad the KV view to 256",
        where="flow single",
    )
    result = judge_cell_dir(folder, POINT)
    assert result.verdict == PRECONDITION
    assert result.detail == {
        "rule": "kv_stride_256",
        "fix": "pad the KV view to 256",
        "at": "flow single",
    }


def test_the_engines_precondition_line_is_read_and_anything_else_is_not() -> None:
    record = {"rule": "mask_pad_64", "message": "m", "fix": "f", "where": "w"}
    assert parse_precondition_line("KV_INVARIANCE_PRECONDITION " + json.dumps(record)) == record
    assert parse_precondition_line("KV_INVARIANCE_PRECONDITION {not json") is None
    assert parse_precondition_line('KV_INVARIANCE_PRECONDITION {"rule": "r"}') is None
    assert parse_precondition_line("kv_invariance d=64: single 0.1s") is None


def cell(verdict: str, klass: str = "", **point: int) -> CellResult:
    return CellResult({**POINT, **point}, verdict, klass=klass, reason="why")


def test_the_global_word_and_its_exit_code() -> None:
    eq = cell(BITWISE_EQUAL)
    cases = [
        ([eq, cell(BITWISE_EQUAL, kv=1024)], PASS_INVARIANCE),
        ([eq, cell(DIFFERS), cell(PRECONDITION), cell(UNJUDGED, "engine")], FAIL_INVARIANCE),
        ([eq, cell(PRECONDITION), cell(UNJUDGED, "engine")], PRECONDITION_VIOLATED),
        ([eq, cell(UNJUDGED, "infra"), cell(UNJUDGED, "engine")], ENGINE_ERROR),
        ([eq, cell(UNJUDGED, "infra")], INFRA_ERROR),
        ([eq, cell(UNJUDGED, "output")], FAIL_INVARIANCE),
        ([eq, cell(UNJUDGED, "not_run")], FAIL_INVARIANCE),
        ([eq, cell(UNJUDGED, "input")], INPUT_ERROR),
        ([], FAIL_INVARIANCE),
    ]
    for cells, word in cases:
        assert global_verdict(cells)[0] == word, cells
    assert global_verdict([eq], [("engine", "required backend ROCm0 did not run")])[0] == (
        ENGINE_ERROR
    )
    assert VERDICT_EXIT == {
        PASS_INVARIANCE: 0,
        FAIL_INVARIANCE: 1,
        PRECONDITION_VIOLATED: 1,
        INPUT_ERROR: 2,
        ENGINE_ERROR: 3,
        INFRA_ERROR: 3,
    }


def test_the_grid_text_places_every_cell() -> None:
    cells = [
        cell(BITWISE_EQUAL),
        cell(DIFFERS, gqa=2),
        cell(PRECONDITION, kv=1024),
        unjudged({**POINT, "kv": 1024, "gqa": 2, "mask": 0}, "engine", "killed"),
    ]
    lines = grid_of(cells).text()
    assert lines[0].split() == ["g1", "b2", "g2", "b2", "g2", "b2"]
    assert lines[1].split() == ["m--", "---", "m--"]
    assert lines[2].split() == ["D=4", "KV=256", "=", "X"]
    assert lines[3].split() == ["D=4", "KV=1024", "P", "?"]


# -- llama.cpp's test output ---------------------------------------------------------------------


def test_every_line_the_test_prints_is_a_fact() -> None:
    assert parse_line("[kvci] q ne=[128,256,8,1]") == ["q", 128, 256, 8]
    assert parse_line("[kvci] k ne=[128,256,4,1]") == ["k", 256, 4]
    assert parse_line("[kvci] v ne=[128,256,4,1]") is None
    assert parse_line("[kvci] D=128 H=8 gqa=2 step s=5 KVp=256") is None
    line = "[FAIL] KV invariance: backend=CUDA0 D=256 KV=1024 gqa=2"
    assert parse_line(line) == ["fail_cell", "CUDA0", 256, 1024, 2, line]
    assert parse_line("[FAIL] CUDA0 rc=1") == ["fail", "CUDA0", 1]
    assert parse_line("[OK] CPU\r\n") == ["ok", "CPU"]
    assert parse_line("[SKIP] cannot init backend: Vulkan0") == ["skip_init", "Vulkan0"]
    assert parse_line("[SKIP] backend error: bad KV size") == ["skip_error", "bad KV size"]
    assert parse_line("[SKIP] No backend initialized") == ["none", "[SKIP] No backend initialized"]
    assert parse_line("No backends available") == ["none", "No backends available"]
    assert parse_line("Backends passed: 2") == ["passed", 2]
    assert parse_line("[tracedeck] test-kvcache-invariance exited 134") == ["exit", 134]
    assert parse_line("ggml_cuda_init: found 1 ROCm devices:") is None


def verdicts(cells: list[CellResult]) -> dict[tuple[str, int, int, int], str]:
    return {(c.source, c.point["d"], c.point["kv"], c.point["gqa"]): c.verdict for c in cells}


def book(name: str) -> LlamaCppBook:
    return read_log((DATA / name).read_text())


def test_a_backend_that_passed_fills_its_eight_cells() -> None:
    cells, problems, notes = book("cpu_ok.log").results(None)
    assert verdicts(cells) == {("CPU", *cell): BITWISE_EQUAL for cell in GRID}
    assert problems == [] and notes == []
    assert all(c.point["b"] == 1 and c.point["mask"] == 1 for c in cells)
    assert global_verdict(cells, problems)[0] == PASS_INVARIANCE


def test_a_failing_backend_stops_and_later_cells_are_not_run() -> None:
    cells, problems, notes = book("rocm_fail.log").results(None)
    got = verdicts(cells)
    order = [("ROCm0", *c) for c in GRID]
    assert [got[k] for k in order] == [BITWISE_EQUAL] * 3 + [DIFFERS] + [UNJUDGED] * 4
    failing = next(c for c in cells if c.verdict == DIFFERS)
    assert failing.point == {
        "d": 128,
        "kv": 1024,
        "b": 1,
        "gqa": 2,
        "mask": 1,
        "alibi": 0,
        "sinks": 0,
    }
    assert failing.detail["reported"] == "[FAIL] KV invariance: backend=ROCm0 D=128 KV=1024 gqa=2"
    assert {c.klass for c in cells if c.verdict == UNJUDGED} == {"not_run"}
    assert notes == ["backend Vulkan0 was skipped: the test could not initialise it"]
    assert problems == []  # exit 1 with a [FAIL] line is the test's verdict, not a crash
    assert global_verdict(cells, problems)[0] == FAIL_INVARIANCE


def test_a_backend_that_threw_is_never_counted_as_passed() -> None:
    cells, problems, notes = book("backend_error.log").results(None)
    got = verdicts(cells)
    assert got[("CUDA0", 256, 256, 1)] == UNJUDGED
    assert sum(v == BITWISE_EQUAL for v in got.values()) == 4
    assert any("counted it as passed, tracedeck does not" in n for n in notes)
    assert any("'Backends passed: 1'; 0 backend(s)" in n for n in notes)
    assert global_verdict(cells, problems)[0] != PASS_INVARIANCE


def test_an_abort_on_the_padding_assert_is_a_precondition() -> None:
    cells, problems, _ = book("abort.log").results(None)
    got = verdicts(cells)
    assert got[("backend 1", 128, 256, 1)] == BITWISE_EQUAL
    assert got[("backend 1", 128, 1024, 1)] == PRECONDITION
    assert problems and "exited 134" in problems[0][1]
    assert global_verdict(cells, problems)[0] == PRECONDITION_VIOLATED


def test_no_backend_and_a_required_backend_missing_are_not_a_pass() -> None:
    cells, problems, _ = book("no_backend.log").results(None)
    assert cells == [] and problems == [("engine", "no backend ran: No backends available")]
    cells, problems, _ = book("cpu_ok.log").results(None, required=["ROCm0"])
    assert global_verdict(cells, problems)[0] == ENGINE_ERROR
    assert "required backend ROCm0 did not run (seen: CPU)" in problems[0][1]


def test_exit_codes_that_contradict_the_lines_are_problems() -> None:
    text = (DATA / "cpu_ok.log").read_text().replace("exited 0", "exited 1")
    _, problems, _ = read_log(text).results(None)
    assert problems == [("engine", "the test exited 1 without a [FAIL] line")]
    text = (DATA / "rocm_fail.log").read_text().replace("exited 1", "exited 0")
    _, problems, _ = read_log(text).results(None)
    assert problems == [("output", "the test printed [FAIL] but exited 0")]


def test_facts_fold_the_same_in_any_batching() -> None:
    """A digest batch boundary may fall between a single-shot q line and its k line."""
    lines = (DATA / "rocm_fail.log").read_text().splitlines()
    whole = read_log("\n".join(lines)).results(None)
    pieces = LlamaCppBook()
    for line in lines:  # one line a batch, as a follower could deliver them
        fact = parse_line(line)
        if fact is not None and pieces.wants(fact):
            pieces.apply(fact)
    assert [c.to_json() for c in pieces.results(None)[0]] == [c.to_json() for c in whole[0]]


def test_judgement_and_kind_load_neither_textual_nor_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, analysis.kv_invariance, analysis.kv_invariance_llamacpp, "
        "runners.kinds.kv_invariance; "
        "print(','.join(m for m in ('textual', 'torch') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_a_tree_keeps_its_broken_cells_and_names_them(tmp_path: Path) -> None:
    from analysis.kv_invariance import find_cells, parse_point_dir, point_dir

    good = write_cell(tmp_path / "kv" / point_dir(POINT))
    cut = write_cell(tmp_path / "kv" / "elsewhere")
    (cut / "result.json").write_text("{")
    named = tmp_path / "kv" / point_dir({**POINT, "kv": 1024})
    named.mkdir()
    (named / "result.json").write_text("[]")
    other = tmp_path / "other"
    other.mkdir()
    (other / "result.json").write_text('{"format": "someone-else/1"}')
    assert find_cells(tmp_path) == [named, good, cut]  # path order
    assert parse_point_dir(point_dir(POINT)) == POINT and parse_point_dir("elsewhere") is None
    results = [judge_cell_dir(d) for d in find_cells(tmp_path)]
    assert [r.verdict for r in results] == [UNJUDGED, BITWISE_EQUAL, UNJUDGED]
    assert results[0].point == {**POINT, "kv": 1024} and results[2].point == {}
    grid = grid_of(results)
    assert len(grid.cells) == 2  # the cell with no known point is counted, not placed
    assert global_verdict(results)[0] == FAIL_INVARIANCE
