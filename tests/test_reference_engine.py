"""The torch reference engine, run for real as ``python -m runners.reference`` on tiny shapes."""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from patience import patience

from runners.reference import SHIPPED_WITH

if importlib.util.find_spec("torch") is None:  # not imported here: the engine runs in subprocesses
    pytest.skip("the reference engine needs torch", allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent
REFERENCE_SUPPORT = SHIPPED_WITH
PACKAGE = REPO / "runners" / "reference"
# Small enough for seconds per run, and the prompt crosses the 256 KV padding boundary, so the
# aligned path is exercised with more than one padded key length.
TINY = ["--vocab", "512", "--layers", "2", "--d-model", "64", "--heads", "4", "--kv-heads", "2"]
PROMPT_LEN, GEN_LEN = 250, 12
THRESHOLDS = {"p99_abs_diff_max": 1e-3, "max_abs_diff_max": 5e-3, "top1_agreement_min": 0.999}
# A real MI300X decode line from seed 003: the trace lines must carry the same keys and types.
SEED_003_LINE = (
    '{"phase":"decode","readout_buffer_kind":"single_token","hidden_source_tag":'
    '"decode_hidden_single_token","step":1,"tokens_total":206,"seq_len":1,"pos_id":205,'
    '"token_index":205,"used_index":0,"logical_last_index":205,"expected_last_index":205,'
    '"hidden_token_index_used":0,"readout_mismatch":false,"hidden_src_ptr":125303806492672,'
    '"hidden_alloc_bytes":4194304,"hidden_stride_bytes":16384,"hidden_offset_bytes":0,'
    '"hidden_hash":12423339041135058718,"hidden_min":-14515.1,"hidden_max":5624.58,'
    '"hidden_mean":3839.34,"rms_in_ptr":125303806492672,"rms_out_ptr":125303800201216,'
    '"lm_in_ptr":125303800201216,"rms_offset_bytes":0,"rms_hash":6402361988135106224,'
    '"rms_min":-7.59063,"rms_max":3.52933,"rms_mean":2.4467,"logits_offset_bytes":105169920,'
    '"logits_ptr":125284086972416,"logits_hash":11245132921339454899,"logits_min":-13.0573,'
    '"logits_max":13.3366,"logits_mean":-0.459103,"top1_id":96965,"top1_logit":13.3366,'
    '"top2_id":198,"top2_logit":11.9263,"gap":1.41033,"vocab":128256}'
)
METADATA_KEYS = {
    # seed 000, section 2.1
    "dtype",
    "prompt_len",
    "gen_len",
    "seed",
    "kv_aligned",
    "mode",
    "timestamp",
    "git_commit",
    # the reference engine's additions
    "engine",
    "model",
    "model_seed",
    "torch_version",
    "device",
    "inject",
    "inject_first_token",
    "determinism_env",
    "elapsed_s",
}


def engine(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "runners.reference", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, expect_rc: int = 0) -> str:
    out, err = proc.communicate(timeout=patience(300))
    assert proc.returncode == expect_rc, f"rc {proc.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    return out + err


def equivalence_args(out: Path, mode: str, aligned: int, inject: str = "none") -> list[str]:
    return [
        "equivalence", "--mode", mode, "--kv-aligned", str(aligned), "--seed", "3",
        "--prompt-len", str(PROMPT_LEN), "--gen-len", str(GEN_LEN), "--out", str(out),
        "--inject", inject, *TINY,
    ]  # fmt: skip


def load_side(d: Path) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    meta = json.loads((d / "metadata.json").read_text())
    with gzip.open(d / "logits.jsonl.gz", "rt") as fh:
        rows = [json.loads(line) for line in fh]
    assert [r["token_idx"] for r in rows] == list(range(len(rows)))
    ids = np.array([r["token_id"] for r in rows])
    logits = np.array([r["logits"] for r in rows], dtype=np.float32)
    return meta, ids, logits


def per_token_pass(a: np.ndarray, b: np.ndarray) -> list[bool]:
    """Each token judged alone against the seed-000 thresholds."""
    out = []
    for ra, rb in zip(a, b, strict=True):
        d = np.abs(ra.astype(np.float64) - rb.astype(np.float64))
        out.append(
            bool(
                d.max() <= THRESHOLDS["max_abs_diff_max"]
                and np.percentile(d, 99) <= THRESHOLDS["p99_abs_diff_max"]
                and np.argmax(ra) == np.argmax(rb)
            )
        )
    return out


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every equivalence side the tests judge, run two at a time (two cores)."""
    root = tmp_path_factory.mktemp("equiv")
    plan = {
        "a1_prefill": ("prefill", 1, "none"),
        "a1_decode": ("decode", 1, "none"),
        "a0_prefill": ("prefill", 0, "none"),
        "a0_decode": ("decode", 0, "none"),
        "readout_offset": ("decode", 1, "readout_offset"),
        "split_kv": ("decode", 1, "split_kv"),
        "prefill_split_kv": ("prefill", 1, "split_kv"),
    }
    names = list(plan)
    for i in range(0, len(names), 2):
        procs = [engine(*equivalence_args(root / n, *plan[n])) for n in names[i : i + 2]]
        for p in procs:
            finish(p)
    return {n: root / n for n in names}


def test_side_files_and_metadata(sides: dict[str, Path]) -> None:
    meta, ids, logits = load_side(sides["a1_decode"])
    assert set(meta) == METADATA_KEYS
    assert (meta["dtype"], meta["prompt_len"], meta["gen_len"]) == ("bf16", PROMPT_LEN, GEN_LEN)
    assert (meta["seed"], meta["kv_aligned"], meta["mode"]) == (3, 1, "decode")
    assert meta["timestamp"].endswith("Z") and "T" in meta["timestamp"]
    assert isinstance(meta["git_commit"], str) and meta["git_commit"]
    assert meta["model"]["vocab"] == 512 and meta["model"]["kv_pad"] == 256
    assert meta["inject"] == "none" and meta["inject_first_token"] is None
    assert logits.shape == (GEN_LEN, 512)
    assert np.isfinite(logits).all()
    assert (ids == logits.argmax(axis=1)).all()
    assert sorted(p.name for p in sides["a1_decode"].iterdir()) == [
        "logits.jsonl.gz",
        "metadata.json",
    ]


def test_aligned_bf16_prefill_and_decode_agree(sides: dict[str, Path]) -> None:
    _, ids_p, lp = load_side(sides["a1_prefill"])
    _, ids_d, ld = load_side(sides["a1_decode"])
    diff = np.abs(lp.astype(np.float64) - ld.astype(np.float64))
    assert diff.max() <= THRESHOLDS["max_abs_diff_max"]
    assert np.percentile(diff, 99) <= THRESHOLDS["p99_abs_diff_max"]
    assert (lp.argmax(1) == ld.argmax(1)).mean() >= THRESHOLDS["top1_agreement_min"]
    assert (ids_p == ids_d).all()
    # measured on CPU: the aligned path is bitwise identical, not merely close
    assert np.array_equal(lp.view(np.uint32), ld.view(np.uint32))


def test_unaligned_drifts(sides: dict[str, Path]) -> None:
    _, _, lp = load_side(sides["a0_prefill"])
    _, _, ld = load_side(sides["a0_decode"])
    assert np.abs(lp.astype(np.float64) - ld.astype(np.float64)).max() > 0.0


@pytest.mark.parametrize("inject", ["readout_offset", "split_kv"])
def test_injection_fails_exactly_at_its_first_token(sides: dict[str, Path], inject: str) -> None:
    _, _, lp = load_side(sides["a1_prefill"])
    meta, _, ld = load_side(sides[inject])
    first = meta["inject_first_token"]
    assert meta["inject"] == inject
    assert first == GEN_LEN // 2 and first > 0
    verdicts = per_token_pass(lp, ld)
    assert all(verdicts[:first]), verdicts
    assert not verdicts[first], verdicts


def test_prefill_records_but_ignores_an_injection(sides: dict[str, Path]) -> None:
    meta, _, lp_inj = load_side(sides["prefill_split_kv"])
    _, _, lp = load_side(sides["a1_prefill"])
    assert meta["inject"] == "split_kv" and meta["inject_first_token"] is None
    assert np.array_equal(lp.view(np.uint32), lp_inj.view(np.uint32))


def test_injection_needs_two_tokens(tmp_path: Path) -> None:
    args = equivalence_args(tmp_path / "x", "decode", 1, "split_kv")
    args[args.index("--gen-len") + 1] = "1"
    out = finish(engine(*args), expect_rc=2)
    assert "--gen-len >= 2" in out
    assert not (tmp_path / "x" / "metadata.json").exists()


# -- readout trace ---------------------------------------------------------------------------


def readout_args(name: str, inject: str, *extra: str) -> list[str]:
    return [
        "readout", "--prompt-name", name, "--prompt-len", "20", "--gen-len", "5",
        "--seed", "1", "--inject", inject, *TINY, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Three runs appending to one file: by GRETA_TRACE_READOUT env, then by --trace-out."""
    path = tmp_path_factory.mktemp("readout") / "b3_12_readout.jsonl"
    env = {**os.environ, "GRETA_TRACE_READOUT": "1", "GRETA_TRACE_READOUT_OUT": str(path)}
    finish(engine(*readout_args("p4_sys", "none"), env=env))
    procs = [
        engine(*readout_args("p5_ba", "b3_11", "--trace-out", str(path))),
        engine(*readout_args("p6_len_16", "b3_12", "--trace-out", str(path))),
    ]
    for p in procs:
        finish(p)
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    return [json.loads(line) for line in raw.splitlines()]


def lines_of(trace: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    return [x for x in trace if x["prompt"] == prompt]


def test_trace_lines_have_every_field_with_the_seed_types(trace: list[dict[str, Any]]) -> None:
    ref = json.loads(SEED_003_LINE)
    assert len(trace) == 3 * (1 + 5)
    for line in trace:
        assert list(line) == [*ref, "prompt"]
        for key, value in ref.items():
            assert type(line[key]) is type(value), key
        assert line["vocab"] == 512


def test_trace_correct_engine(trace: list[dict[str, Any]]) -> None:
    first, *decode = lines_of(trace, "p4_sys")
    assert (first["phase"], first["readout_buffer_kind"]) == ("prefill_last", "seq")
    assert first["hidden_source_tag"] == "prefill_hidden_seq"
    assert first["tokens_total"] == first["seq_len"] == 20
    assert first["used_index"] == first["hidden_token_index_used"] == 19
    assert first["hidden_offset_bytes"] == 19 * first["hidden_stride_bytes"]
    assert first["logits_offset_bytes"] == 19 * 512 * 4
    assert first["readout_mismatch"] is False
    # seed 003's MI300X lines: decode step 1 has one more token than prefill_last, and so on
    assert [d["step"] for d in decode] == [1, 2, 3, 4, 5]
    assert [d["tokens_total"] for d in decode] == [21, 22, 23, 24, 25]
    for d in decode:
        assert (d["phase"], d["readout_buffer_kind"]) == ("decode", "single_token")
        assert d["hidden_source_tag"] == "decode_hidden_single_token"
        assert d["seq_len"] == 1 and d["used_index"] == d["hidden_token_index_used"] == 0
        assert d["logical_last_index"] == d["expected_last_index"] == d["tokens_total"] - 1
        assert d["pos_id"] == d["token_index"] == d["tokens_total"] - 1
        assert d["readout_mismatch"] is False
        assert d["hidden_src_ptr"] == first["hidden_src_ptr"] == d["rms_in_ptr"]
        assert d["lm_in_ptr"] == d["rms_out_ptr"]
        assert d["top1_logit"] >= d["top2_logit"] and d["top1_id"] != d["top2_id"]
    # a correct readout: the token prefill picked is read back as decode0's top-1
    assert decode[0]["top1_id"] == first["top1_id"]
    assert decode[0]["logits_offset_bytes"] == 20 * 512 * 4  # the logical slot tokens_total - 1


def test_trace_b3_11_collapses(trace: list[dict[str, Any]]) -> None:
    first, *decode = lines_of(trace, "p5_ba")
    tops = {d["top1_id"] for d in decode}
    assert len(tops) == 1 and first["top1_id"] not in tops
    assert all(d["logits_offset_bytes"] == 0 for d in decode)
    assert all(d["readout_mismatch"] is False for d in decode)


def test_trace_b3_12_mismatch(trace: list[dict[str, Any]]) -> None:
    first, *decode = lines_of(trace, "p6_len_16")
    assert first["readout_mismatch"] is False
    for d in decode:
        assert d["readout_mismatch"] is True
        assert d["used_index"] == d["hidden_token_index_used"] == d["logical_last_index"] != 0
        assert d["hidden_offset_bytes"] == d["used_index"] * d["hidden_stride_bytes"]
    assert decode[0]["top1_id"] != first["top1_id"]


def test_readout_without_a_trace_file_is_a_usage_error() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRETA_TRACE")}
    out = finish(engine(*readout_args("p0_short", "none"), env=env), expect_rc=2)
    assert "GRETA_TRACE_READOUT_OUT" in out and "--trace-out" in out


def test_the_engine_cli_names_its_commands_and_refuses_any_other_module() -> None:
    """Commands are the package's modules with add_arguments and run: listed from the sources
    (no torch), found by name alone for a run; a support module, a private one or a path is an
    unknown command (exit 2, the list shown)."""
    listed = subprocess.run(
        [sys.executable, "-c", "import sys, runners.reference.__main__ as m; "
         "sys.exit(m.main(['--help']) or ('torch' in sys.modules))"],
        cwd=REPO, capture_output=True, text=True, timeout=patience(60),
    )  # fmt: skip
    assert listed.returncode == 0, listed.stdout + listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.startswith("  ")]
    assert "equivalence" in names and "runtime" not in names and "__main__" not in names
    for bad in ("runtime", "__main__", "_x", "../reference/equivalence", "nosuch"):
        out = finish(engine(bad), expect_rc=2)
        assert f"unknown command {bad!r}" in out and "  equivalence " in out, out
    assert "--kv-aligned" in finish(engine("equivalence", "--help"))


@pytest.mark.parametrize(
    ("body", "rc", "out"),
    [
        # done: atexit handlers run and stdout is flushed before the fast exit
        ("print('x', end=''); atexit.register(lambda: print(' atexit'))", 0, "x atexit\n"),
        # a thread still running: Python's own shutdown waits for it
        (
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()",
            0,
            "thread\n",
        ),  # fmt: skip
        ("print('failed')", 2, "failed\n"),  # any other end: Python's own shutdown
        ("print('lost', end=''); os.close(1)", 120, ""),  # stdout not flushed: as Python says
    ],
)
def test_the_engine_ends_as_python_would_only_sooner(body: str, rc: int, out: str) -> None:
    code = (
        "import atexit, os, sys, threading, time\n"
        "from runners.reference.__main__ import finish\n"
        f"{body}\n"
        f"finish({rc if rc != 120 else 0})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=patience(60),
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (rc, out), done.stderr


# -- packaging -------------------------------------------------------------------------------


def test_sources_import_only_stdlib_torch_numpy_orjson() -> None:
    allowed = set(sys.stdlib_module_names) | {"torch", "numpy", "orjson"}
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}: relative import"
                names = [node.module or ""]
            else:
                continue
            for name in names:
                shipped = name in {f"runners.{m.removesuffix('.py')}" for m in REFERENCE_SUPPORT}
                ok = name.split(".")[0] in allowed or name.startswith("runners.reference")
                assert ok or shipped, f"{path.name} imports {name}"


def test_runs_from_a_bare_copy_of_the_package(tmp_path: Path) -> None:
    """As tracedeck ships it: runners/reference/*.py and its support modules, nothing else."""
    pkg = tmp_path / "ship"
    (pkg / "runners" / "reference").mkdir(parents=True)
    for name in REFERENCE_SUPPORT:
        shutil.copy(REPO / "runners" / name, pkg / "runners" / name)
    for path in PACKAGE.glob("*.py"):
        shutil.copy(path, pkg / "runners" / "reference" / path.name)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    out_dir = elsewhere / "side"
    args = equivalence_args(out_dir, "decode", 1)
    args[args.index("--prompt-len") + 1] = "8"
    args[args.index("--gen-len") + 1] = "2"
    finish(engine(*args, cwd=elsewhere, env=env))
    assert (out_dir / "metadata.json").exists()
    probe = (
        "import sys, runners.reference.__main__, runners.reference.equivalence, "
        "runners.reference.readout\n"
        "shipped = {'runners.atomic'}\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('analysis', 'console', 'tracedeck')"
        " or (m.startswith('runners.') and not m.startswith('runners.reference')"
        " and m not in shipped)]\n"
        "print(runners.reference.__file__)\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith(str(pkg))


def test_missing_gpu_is_an_infrastructure_error(tmp_path: Path) -> None:
    proc = engine(*equivalence_args(tmp_path / "x", "decode", 1), "--device", "cuda")
    out, err = proc.communicate(timeout=patience(300))
    if proc.returncode == 0:
        pytest.skip("this host has a CUDA/ROCm device")
    assert proc.returncode == 3, out + err
    assert "--device cuda" in err and "no CUDA" in err
