"""DSA top-k traces (seed 004): the reference indexer, the engine's trace, the validator, runs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from dsa_writer import write_trace
from patience import patience
from runhelp import ROOT, cli_env, events, run_dirs, tracedeck
from sshd import SshHome

from runners.events import event_from_dict
from runners.kinds import event_types
from runners.kinds.dsa_trace import TraceBook


def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir(exist_ok=True)
    return path


def isolated(tmp_path: Path) -> list[str]:
    return ["--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"']


def analyze(path: Path, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    done = tracedeck("analyze", str(path), "--json", *extra, env=cli_env(home(tmp_path)))
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return done.returncode, json.loads(done.stdout)


# -- the indexer ------------------------------------------------------------------------------


def test_indexer_topk_is_the_formula_on_random_tensors() -> None:
    torch = pytest.importorskip("torch")
    from runners.reference.dsa_model import DSAConfig, DSAModel, index_scores, reference_topk

    gen = torch.Generator().manual_seed(3)
    b, h, d, t = 2, 4, 8, 40
    q = torch.randn(b, 1, h, d, generator=gen)
    k = torch.randn(b, t, d, generator=gen)
    w = torch.randn(b, 1, h, generator=gen)
    got = index_scores(q, k, w, None).topk(16, dim=-1, sorted=False)[1]
    want = reference_topk(q[:, 0], k, w[:, 0], 16, t)
    assert [set(got[i, 0].tolist()) for i in range(b)] == want

    # The model's indexer on a decode step, against numpy float64 from the same weights:
    # LayerNorm on k, non-interleaved RoPE on the leading rope dims, n_heads^-1/2 head_dim^-1/2.
    cfg = DSAConfig(
        vocab=64,
        dim=16,
        layers=1,
        index_heads=3,
        index_head_dim=8,
        rope_head_dim=4,
        index_topk=5,
        max_seq_len=32,
    )
    model = DSAModel(cfg, seed=1, device="cpu", max_batch=1)
    p = model.layers[0]
    x = torch.randn(1, 12, cfg.dim, generator=gen)
    qr = torch.randn(1, 12, cfg.q_lora_rank, generator=gen)
    mask = torch.full((11, 11), float("-inf")).triu_(1)
    model.indexer(0, x[:, :11], qr[:, :11], 0, mask)  # prefill fills the key cache
    _, idx = model.indexer(0, x[:, 11:], qr[:, 11:], 11, None)

    def rope(v: np.ndarray, pos: np.ndarray) -> np.ndarray:
        half = v.shape[-1] // 2
        inv = 1.0 / (cfg.rope_theta ** (np.arange(0, 2 * half, 2) / (2 * half)))
        ang = pos[:, None] * inv[None, :]
        c, s = np.cos(ang), np.sin(ang)
        if v.ndim == 3:
            c, s = c[:, None, :], s[:, None, :]
        x1, x2 = v[..., :half], v[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    X, QR = x[0].double().numpy(), qr[0].double().numpy()
    kk = X @ p["idx_wk"].double().numpy().T
    kk = (kk - kk.mean(-1, keepdims=True)) / np.sqrt(kk.var(-1, keepdims=True) + 1e-6)
    kk = kk * p["idx_k_norm_w"].double().numpy() + p["idx_k_norm_b"].double().numpy()
    r = cfg.rope_head_dim
    kk = np.concatenate([rope(kk[:, :r], np.arange(12.0)), kk[:, r:]], axis=-1)
    qq = (QR[11:] @ p["idx_wq_b"].double().numpy().T).reshape(
        1, cfg.index_heads, cfg.index_head_dim
    )
    qq = np.concatenate([rope(qq[..., :r], np.array([11.0])), qq[..., r:]], axis=-1)
    ww = (
        (X[11:] @ p["idx_weights"].double().numpy().T)
        * cfg.index_heads**-0.5
        * cfg.index_head_dim**-0.5
    )
    score = (np.maximum(0, np.einsum("hd,td->ht", qq[0], kk)) * ww[0][:, None]).sum(0)
    assert set(idx[0, 0].tolist()) == set(np.argsort(-score)[:5].tolist())


@pytest.mark.e2e  # runs the engine or a process: out of the fast tier
def test_prefill_writes_no_records_and_decode_one_per_layer() -> None:
    torch = pytest.importorskip("torch")
    from runners.reference.dsa_model import DSAConfig, DSAModel

    cfg = DSAConfig(vocab=64, dim=16, layers=3, index_topk=4, max_seq_len=32)
    model = DSAModel(cfg, seed=0, device="cpu", max_batch=1)
    seen: list[int] = []
    model.forward(torch.arange(10)[None], 0, lambda layer, i, v: seen.append(layer))
    assert seen == []  # prefill: mask is not None, seqlen > 1
    model.forward(torch.tensor([[5]]), 10, lambda layer, i, v: seen.append(layer))
    assert seen == [0, 1, 2]


def engine(out: Path, *flags: str) -> None:
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "runners.reference",
        "dsa",
        "--trace-enable",
        "--trace-out",
        str(out),
    ]
    cmd += ["--layers", "3", "--index-topk", "256", "--ruler-length", "96", "--limit", "2"]
    cmd += ["--max-new-tokens", "4", "--max-requests-per-file", "1", "--temperature", "0"]
    cmd += ["--kv-block-size", "16", *flags]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=patience(120))
    assert done.returncode == 0, done.stderr


def test_one_new_token_is_prefill_only_and_writes_no_record(tmp_path: Path) -> None:
    engine(tmp_path / "t", "--max-new-tokens", "1")
    lines = [p.read_text() for p in (tmp_path / "t" / "block16").glob("trace_steps_*.jsonl")]
    assert lines and all(text == "" for text in lines)


# -- runs ------------------------------------------------------------------------------------


def test_dsa_smoke_is_trace_ok_and_its_summary_equals_the_recomputation(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = tracedeck(
        "run",
        "dsa_smoke",
        "--out",
        str(out),
        *isolated(tmp_path),
        env=cli_env(home(tmp_path)),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: TRACE_OK (exit 0)" in done.stdout
    assert "summary.json: equal to the statistics recomputed live" in done.stdout
    assert "dsa: following shard trace_steps_2_3.jsonl" in done.stdout  # appeared mid-run
    [trace] = list((tmp_path / "remote").glob("*/artifacts/dsa"))
    code, result = analyze(trace, tmp_path)
    assert code == 0 and result["verdict"] == "TRACE_OK"
    [block] = result["dirs"]
    assert block["records"] == 45 and block["requests"] == 3 and block["layers"] == 3
    assert block["problems"] == [] and block["shards"] == [
        "trace_steps_0_2.jsonl",
        "trace_steps_2_3.jsonl",
    ]
    # The record holds digests only, and a replay folds them into the same totals.
    [local] = run_dirs(out)
    recorded = events(local)
    assert all("selected_token_pos" not in json.dumps(e) for e in recorded)
    book = TraceBook(64, 3)
    for e in recorded:
        if e["type"] == "trace":
            book.apply(event_from_dict(e, event_types()))
    assert book.totals() == {"records": 45, "invalid": 0, "shards": 2, "requests": 3}
    replay = tracedeck("replay", str(local), "--headless", env=cli_env(home(tmp_path)))
    assert replay.stdout.splitlines()[-3:] == done.stdout.splitlines()[-3:]


CANARIES = {
    # inject: (shard, line, request, layer, field) of the first record each one touches
    "block_off_by_one": ("trace_steps_0_1.jsonl", 1, 0, 0, "selected_block_ids"),
    "stale_topk": ("trace_steps_0_1.jsonl", 4, 0, 0, "selected_token_pos"),
    "drop_layer": ("trace_steps_0_1.jsonl", 5, 0, 2, "layer_id"),
    "split_request": ("trace_steps_1_2.jsonl", 1, 0, 0, "request_id"),
    "latency_per_layer": ("trace_steps_0_1.jsonl", 2, 0, 1, "kv_fetch.hbm.latency_us"),
}


@pytest.mark.parametrize("inject", sorted(CANARIES))
def test_each_canary_fails_at_the_first_record_it_touches(inject: str, tmp_path: Path) -> None:
    engine(tmp_path / "t", "--inject", inject)
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1 and result["verdict"] == "TRACE_INVALID"
    first = result["dirs"][0]["first_fail"]
    shard, line, request, layer, field = CANARIES[inject]
    assert (
        Path(first["file"]).name,
        first["line"],
        first["request"],
        first["layer"],
        first["field"],
    ) == (shard, line, request, layer, field)


def test_a_canary_run_is_trace_invalid_live(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = tracedeck(
        "run", "dsa_smoke", "--out", str(out), *isolated(tmp_path),
        "--set", 'matrix.inject=["block_off_by_one"]', env=cli_env(home(tmp_path)), timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "dsa: FIRST INVALID RECORD" in done.stdout and "trace_steps_0_2.jsonl:1" in done.stdout
    assert "RESULT: TRACE_INVALID (exit 1)" in done.stdout


@pytest.mark.ssh
def test_dsa_smoke_over_ssh_is_trace_ok(ssh_home: SshHome, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = tracedeck(
        "run", "dsa_smoke", "--target", ssh_home.server.spec, "--out", str(out),
        *isolated(tmp_path), "--set", f'target.python="{sys.executable}"',
        env=cli_env(ssh_home.path), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: TRACE_OK (exit 0)" in done.stdout
    assert "summary.json: equal to the statistics recomputed live" in done.stdout


# -- analyze on a directory a plain-Python writer made ------------------------------------------------


def test_analyze_judges_a_trace_from_an_independent_writer(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 0, result
    [block] = result["dirs"]
    assert (block["records"], block["requests"], block["layers"], block["invalid"]) == (45, 5, 3, 0)
    assert block["problems"] == []  # the writer's own summary.json agrees with the recomputation
    theirs = json.loads((folder / "summary.json").read_text())
    for name in (
        "unique_blocks",
        "tokens_per_touched_block",
        "offsets",
        "prefix_intersection_ratio",
    ):
        for key in ("count", "min", "p50", "p95", "max"):
            assert math.isclose(block["recomputed"][name][key], theirs[name][key]), (name, key)


def test_records_without_the_optional_keys_are_accepted(tmp_path: Path) -> None:
    write_trace(tmp_path / "t", compact=True)
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 0 and result["dirs"][0]["records"] == 45


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _edit(path: Path, line: int, change) -> None:  # type: ignore[no-untyped-def]
    lines = _lines(path)
    rec = json.loads(lines[line - 1])
    change(rec)
    lines[line - 1] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")


def _first(tmp_path: Path) -> dict:
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1 and result["verdict"] == "TRACE_INVALID", result
    return result["dirs"][0]["first_fail"]


def test_a_truncated_last_line_is_located(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    shard = folder / "trace_steps_0_2.jsonl"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 500])  # the writer was killed mid-line
    first = _first(tmp_path)
    assert Path(first["file"]).name == "trace_steps_0_2.jsonl" and first["line"] == 18
    assert "no newline" in first["found"]


def test_a_non_json_line_is_located(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    shard = folder / "trace_steps_2_4.jsonl"
    lines = _lines(shard)
    lines[4] = lines[4][:-30] + "garbage"
    shard.write_text("\n".join(lines) + "\n")
    first = _first(tmp_path)
    assert (Path(first["file"]).name, first["line"], first["field"]) == (
        "trace_steps_2_4.jsonl",
        5,
        "record",
    )
    assert "not valid JSON" in first["found"]


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("layer_id", lambda r: r.__setitem__("layer_id", "1")),
        ("kv_fetch.hbm.bytes_read", lambda r: r["kv_fetch"]["hbm"].__setitem__("bytes_read", 1.5)),
        ("prefix.prefix_cache_hit", lambda r: r["prefix"].__setitem__("prefix_cache_hit", 0)),
        (
            "selected_token_pos",
            lambda r: r.__setitem__("selected_token_pos", [r["selected_token_pos"]]),
        ),
        ("scores_stats.mean", lambda r: r["scores_stats"].__setitem__("mean", None)),
        ("offset_p50", lambda r: r.__setitem__("offset_p50", r["offset_max"])),
        (
            "prefix.intersection_blocks",
            lambda r: r["prefix"].__setitem__("intersection_blocks", []),
        ),
        ("unique_token_pos_count", lambda r: r.__setitem__("unique_token_pos_count", 1)),
    ],
)
def test_wrong_types_and_values_are_located(field: str, change, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder = write_trace(tmp_path / "t")
    _edit(folder / "trace_steps_2_4.jsonl", 7, change)
    first = _first(tmp_path)
    assert (Path(first["file"]).name, first["line"], first["field"]) == (
        "trace_steps_2_4.jsonl",
        7,
        field,
    )


def test_nan_scores_are_never_a_pass(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    shard = folder / "trace_steps_0_2.jsonl"
    lines = _lines(shard)
    rec = json.loads(lines[2])
    rec["scores_stats"]["max"] = float("nan")
    lines[2] = json.dumps(rec)  # Python writes NaN (not JSON); orjson would write null
    rec["scores_stats"]["max"] = float("nan")
    lines[3] = orjson.dumps(rec).decode()
    shard.write_text("\n".join(lines) + "\n")
    first = _first(tmp_path)
    assert (first["line"], first["field"]) == (3, "record") and "not valid JSON" in first["found"]
    _, result = analyze(tmp_path / "t", tmp_path)
    assert result["dirs"][0]["invalid"] >= 2


def test_a_missing_shard_is_located(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    (folder / "trace_steps_2_4.jsonl").unlink()
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1
    messages = [p["message"] for p in result["dirs"][0]["problems"]]
    assert any(
        "requests 2..3 in no shard file (missing shard) before trace_steps_4_5.jsonl" in m
        for m in messages
    )


def test_a_missing_last_shard_is_caught_by_the_request_count(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    (folder / "trace_steps_4_5.jsonl").unlink()
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1 and any("missing shard" in p["message"] for p in result["dirs"][0]["problems"])


def test_a_missing_summary_json_is_located(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    (folder / "summary.json").unlink()
    code, result = analyze(tmp_path / "t", tmp_path, "--dsa-topk", "32")
    assert code == 1 and result["dirs"][0]["invalid"] == 0
    assert result["dirs"][0]["first_fail"]["message"].endswith(
        "summary.json: summary.json: expected the engine's summary (seed 5.3), written at the end of a run, found missing"
    )


def test_a_wrong_summary_is_trace_invalid_naming_the_field(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    data = json.loads((folder / "summary.json").read_text())
    data["offsets"]["p95"] = 12345
    (folder / "summary.json").write_text(json.dumps(data))
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1 and result["verdict"] == "TRACE_INVALID"
    [p] = result["dirs"][0]["problems"]
    assert p["field"] == "offsets.p95" and p["found"] == "12345"
    assert float(p["expected"]) == result["dirs"][0]["recomputed"]["offsets"]["p95"]


def test_a_record_over_one_mib_is_refused(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    _edit(folder / "trace_steps_0_2.jsonl", 2, lambda r: r.__setitem__("run_name", "x" * (1 << 20)))
    first = _first(tmp_path)
    assert (first["line"], first["field"]) == (2, "record") and "bytes" in first["found"]


def test_a_prefix_hit_without_an_earlier_request_is_caught(tmp_path: Path) -> None:
    folder = write_trace(tmp_path / "t")
    for n in range(1, 10):  # request 2 (trace_steps_2_4) claims a hit no lower request explains
        _edit(
            folder / "trace_steps_2_4.jsonl",
            n,
            lambda r: r["prefix"].__setitem__("prefix_cache_hit", True),
        )
    code, result = analyze(tmp_path / "t", tmp_path)
    assert code == 1
    assert any(p["field"] == "prefix.prefix_cache_hit" for p in result["dirs"][0]["problems"])


def test_not_a_trace_directory_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    done = tracedeck(
        "analyze", str(tmp_path / "empty"), "--kind", "dsa_trace", env=cli_env(home(tmp_path))
    )
    assert done.returncode == 2 and "no block<N>/ directory" in done.stderr


def test_the_shipped_samples_are_the_engines_built_in_ones() -> None:
    from runners.reference.dsa_samples import FILES

    for name, make in FILES.items():
        assert (ROOT / "presets" / "samples" / name).read_text() == make(), name


@pytest.mark.parametrize("preset", ["dsa_sharegpt", "dsa_burstgpt"])
def test_the_sample_workloads_run_trace_ok(preset: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = tracedeck(
        "run",
        preset,
        "--out",
        str(out),
        *isolated(tmp_path),
        env=cli_env(home(tmp_path)),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: TRACE_OK (exit 0)" in done.stdout
    [trace] = [p for p in (tmp_path / "remote").glob("*/artifacts/*") if p.is_dir()]
    summary = json.loads(next(trace.glob("block*/summary.json")).read_text())
    hits = summary["prefix_intersection_ratio"]["count"]
    assert hits > 0
    if preset == "dsa_burstgpt":
        assert summary["serving"]["requests"] == 12 and set(summary["serving"]["latency_ms"]) == {
            "p50",
            "p95",
            "p99",
            "max",
        }
        code, result = analyze(trace, tmp_path)
        assert code == 0 and result["dirs"][0]["problems"] == []


def test_longbench_skips_long_samples_and_says_so(tmp_path: Path) -> None:
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "runners.reference",
        "dsa",
        "--trace-enable",
        "--trace-out",
        str(tmp_path / "t"),
    ]
    cmd += [
        "--workload",
        "longbench",
        "--longbench-json",
        str(ROOT / "presets/samples/dsa_longbench_v2_sample.json"),
    ]
    cmd += [
        "--max-prompt-tokens",
        "400",
        "--layers",
        "2",
        "--index-topk",
        "64",
        "--max-new-tokens",
        "3",
        "--kv-block-size",
        "16",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=patience(120))
    assert done.returncode == 0, done.stderr
    assert "skipped 1 samples over --max-prompt-tokens 400" in done.stdout
    summary = json.loads((tmp_path / "t" / "block16" / "summary.json").read_text())
    assert (
        summary["skipped"] == {"over_max_prompt_tokens": 1} and summary["config"]["requests"] == 2
    )
