"""B3.67 end to end: the shipped smoke preset on the real torch engine, locally and over SSH
(attach's catching up, an orchestration test, on the torch-free toy engine)."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from runhelp import cli_env, events, run_dirs, toy_engine, tracedeck
from sshd import SshHome


def seed_layout(seeds: tuple[int, ...] = (0, 1, 2)) -> list[str]:
    return [
        "config.json",
        "summary.json",
        "B3_67_EQUIVALENCE_GUARDRAIL.md",
        *(
            f"runs/kv_aligned_{k}/seed_{s}/{m}/{f}"
            for k in (0, 1)
            for s in seeds
            for m in ("prefill", "decode")
            for f in ("logits.jsonl.gz", "metadata.json")
        ),
        *(f"metrics/kv_aligned_{k}/seed_{s}_metrics.json" for k in (0, 1) for s in seeds),
    ]


SEED_LAYOUT = seed_layout()


def isolated(tmp_path: Path) -> list[str]:
    return ["--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"']


def check_smoke_passes(
    local_dir: Path, stdout: str, logits_home: bool = True, seeds: tuple[int, ...] = (0, 1, 2)
) -> None:
    assert "RESULT: PASS_GUARDRAIL (exit 0)" in stdout
    for rel in seed_layout(seeds):
        if logits_home or not rel.endswith("logits.jsonl.gz"):
            assert (local_dir / rel).is_file(), rel
    summary = json.loads((local_dir / "summary.json").read_text())
    assert summary["global_verdict"] == "PASS_GUARDRAIL"
    assert summary["results"]["kv_aligned_1"]["pass_equiv"] == len(seeds)
    assert summary["results"]["kv_aligned_0"]["expected_drift"] == len(seeds)
    verdicts = [e for e in events(local_dir) if e["type"] == "pair_verdict"]
    assert [(v["kv_aligned"], v["seed"]) for v in verdicts] == [
        (k, s) for k in (1, 0) for s in seeds
    ]
    # Verdicts arrive while later cells still run, not all at the end.
    evts = events(local_dir)
    first_verdict = next(i for i, e in enumerate(evts) if e["type"] == "pair_verdict")
    last_start = max(i for i, e in enumerate(evts) if e["type"] == "cell_started")
    assert first_verdict < last_start


def test_smoke_preset_passes_on_the_local_target(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "out"
    done = tracedeck(
        "run", "b3_67_smoke", "--out", str(out), *isolated(tmp_path), env=cli_env(home), timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [local_dir] = run_dirs(out)
    assert local_dir.parent.name.count("-") == 2 and local_dir.name == "b3_67"  # <out>/DATE/b3_67
    check_smoke_passes(local_dir, done.stdout)

    again = tracedeck("analyze", str(local_dir), "--json", env=cli_env(home))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["global_verdict"] == "PASS_GUARDRAIL"


@pytest.mark.ssh
def test_smoke_preset_passes_over_ssh(ssh_home: SshHome, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = tracedeck(
        "run",
        "b3_67_smoke",
        "--target",
        ssh_home.server.spec,
        "--out",
        str(out),
        "--set",
        f'target.python="{sys.executable}"',
        # One seed: the shipped matrix whole runs on the local target above; here the link is
        # what is under test (4 torch cells, not 12).
        "--set",
        "matrix.seed=[0]",
        *isolated(tmp_path),
        env=cli_env(ssh_home.path),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [local_dir] = run_dirs(out)
    # Judged on the host (tests/test_host_judging.py): the logits stay there.
    check_smoke_passes(local_dir, done.stdout, logits_home=False, seeds=(0,))
    fetched = [e for e in events(local_dir) if e["type"] == "artifact"]
    assert len(fetched) == 4 and all(len(e["sha256"]) == 64 for e in fetched)
    assert len([e for e in events(local_dir) if e["type"] == "artifact_held"]) == 4


@pytest.mark.parametrize("inject", ["readout_offset", "split_kv"])
def test_injected_bug_fails_at_the_token_it_first_touches(tmp_path: Path, inject: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "out"
    done = tracedeck(
        "run",
        "b3_67_smoke",
        "--out",
        str(out),
        *isolated(tmp_path),
        "--set",
        f'matrix.inject=["{inject}"]',
        "--set",
        "matrix.seed=[0, 1]",
        "--set",
        "matrix.kv_aligned=[1]",
        env=cli_env(home),
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: FAIL_GUARDRAIL (exit 1)" in done.stdout
    [local_dir] = run_dirs(out)
    meta = json.loads((local_dir / "runs/kv_aligned_1/seed_0/decode/metadata.json").read_text())
    touched = meta["inject_first_token"]
    assert isinstance(touched, int) and touched > 0
    summary = json.loads((local_dir / "summary.json").read_text())
    ff = summary["first_fail"]
    assert summary["global_verdict"] == "FAIL_GUARDRAIL"
    assert (ff["seed"], ff["kv_aligned"], ff["token_idx"]) == (0, 1, touched)
    assert len(ff["top5"]["prefill"]) == 5 and len(ff["top5"]["decode"]) == 5
    assert ff["where"]["decode"].endswith(f"decode/logits.jsonl.gz:{touched + 1}")
    report = (local_dir / "B3_67_EQUIVALENCE_GUARDRAIL.md").read_text()
    assert "FAIL_GUARDRAIL" in report


def write_side(path: Path, logits: np.ndarray, meta: dict) -> None:
    """Another program under the same contract: plain json + gzip, nothing from tracedeck."""
    path.mkdir(parents=True)
    with gzip.open(path / "logits.jsonl.gz", "wt") as fh:
        for i, row in enumerate(logits):
            fh.write(
                json.dumps(
                    {
                        "token_idx": i,
                        "token_id": int(np.argmax(row)),
                        "logits": [float(x) for x in row],
                    }
                )
                + "\n"
            )
    (path / "metadata.json").write_text(json.dumps(meta))


def test_analyze_judges_a_tree_from_another_program(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    tree = tmp_path / "tree"
    expected = {}
    for kv in (1, 0):
        for seed in (0, 1):
            a = rng.normal(size=(8, 300)).astype(np.float32)
            noise = 1e-4 if kv == 1 and seed == 0 else (3e-3 if kv == 1 else 0.05)
            b = (a + rng.normal(scale=noise, size=a.shape)).astype(np.float32)
            b[:, :] = np.where(np.argmax(b, 1)[:, None] == np.argmax(a, 1)[:, None], b, a)
            for mode, logits in (("prefill", a), ("decode", b)):
                meta = {
                    "dtype": "bf16",
                    "prompt_len": 16,
                    "gen_len": 8,
                    "seed": seed,
                    "kv_aligned": kv,
                    "mode": mode,
                    "timestamp": "2026-02-07T20:00:00Z",
                }
                write_side(tree / f"runs/kv_aligned_{kv}/seed_{seed}/{mode}", logits, meta)
            d = np.abs(a - b).ravel()  # section 8, independently
            expected[(kv, seed)] = (float(d.max()), float(np.percentile(d, 99)))
    home = tmp_path / "home"
    home.mkdir()
    done = tracedeck("analyze", str(tree), env=cli_env(home))
    assert done.returncode == 1, done.stdout + done.stderr  # kv1 seed1 drifts past 5e-3
    summary = json.loads((tree / "summary.json").read_text())
    assert summary["global_verdict"] == "FAIL_GUARDRAIL"
    assert (summary["first_fail"]["kv_aligned"], summary["first_fail"]["seed"]) == (1, 1)
    for (kv, seed), (mx, p99) in expected.items():
        doc = json.loads((tree / f"metrics/kv_aligned_{kv}/seed_{seed}_metrics.json").read_text())
        assert doc["metrics"]["max_abs_diff"] == pytest.approx(mx, rel=1e-6)
        assert doc["metrics"]["p99_abs_diff"] == pytest.approx(p99, rel=1e-5)
        want = {(1, 0): "PASS_EQUIV", (1, 1): "FAIL_EQUIV"}.get((kv, seed), "EXPECTED_DRIFT")
        assert doc["verdict"] == want


def test_analyze_reports_bad_input_with_its_location(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    a = np.zeros((3, 10), dtype=np.float32)
    meta = {
        "dtype": "bf16",
        "prompt_len": 4,
        "gen_len": 3,
        "seed": 0,
        "kv_aligned": 1,
        "mode": "prefill",
        "timestamp": "t",
    }
    write_side(tree / "runs/kv_aligned_1/seed_0/prefill", a, meta)
    write_side(tree / "runs/kv_aligned_1/seed_0/decode", a, {**meta, "mode": "decode"})
    bad = tree / "runs/kv_aligned_1/seed_0/decode/logits.jsonl.gz"
    bad.write_bytes(bad.read_bytes()[:-12])  # a truncated gzip
    home = tmp_path / "home"
    home.mkdir()
    done = tracedeck("analyze", str(tree), "--seeds", "0", env=cli_env(home))
    assert done.returncode == 2
    assert str(bad) in done.stderr
    # The summary on disk says the same as the exit code: not judged, where, and why.
    summary = json.loads((tree / "summary.json").read_text())
    assert summary["global_verdict"] == "INPUT_ERROR"
    whys = {u["pair"]: u["why"] for u in summary["unjudged"]}
    assert str(bad) in whys["kv_aligned_1/seed_0"] and "corrupt gzip" in whys["kv_aligned_1/seed_0"]


def test_attach_fetches_artifacts_a_killed_console_never_brought_home(tmp_path: Path) -> None:
    """Console gone between cell_finished and the artifact download: attach catches up. What is
    tested is attach's catching up, so the cells run on the toy engine (no torch)."""
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "out"
    first = tracedeck(
        "run",
        "b3_67_smoke",
        "--out",
        str(out),
        *isolated(tmp_path),
        "--set",
        "matrix.seed=[0]",
        "--set",
        "matrix.kv_aligned=[1]",
        *toy_engine("b3_67_smoke"),
        env=cli_env(home),
        timeout=300,
    )
    assert first.returncode == 0, first.stdout + first.stderr
    [local_dir] = run_dirs(out)
    fetched = {e["path"]: e["sha256"] for e in events(local_dir) if e["type"] == "artifact"}
    assert len(fetched) == 4
    # Cut the record back to the moment after the last cell finished, before any download.
    kept = []
    for line in (local_dir / "events.jsonl").read_text().splitlines(keepends=True):
        if json.loads(line)["type"] in ("artifact", "pair_verdict", "run_finished"):
            continue
        kept.append(line)
    (local_dir / "events.jsonl").write_text("".join(kept))
    for rel in ("runs", "metrics", "summary.json", "config.json"):
        target = local_dir / rel
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()

    attach = tracedeck("attach", str(local_dir), env=cli_env(home), timeout=120)
    assert attach.returncode == 0, attach.stdout + attach.stderr
    assert "RESULT: PASS_GUARDRAIL (exit 0)" in attach.stdout
    again = {e["path"]: e["sha256"] for e in events(local_dir) if e["type"] == "artifact"}
    assert again == fetched  # the same bytes, brought home exactly once more
    assert (
        json.loads((local_dir / "summary.json").read_text())["global_verdict"] == "PASS_GUARDRAIL"
    )
