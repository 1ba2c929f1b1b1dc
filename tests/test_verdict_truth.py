"""Issue 9: every file a B3.67 run writes carries the verdict its exit code says; no path reads
as a pass by accident (crashes, engines that never ran, missing or broken output, loosening)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runhelp import cli_env, events, run_dirs, tracedeck

from analysis.equivalence import VERDICT_EXIT
from runners.kinds import load_preset
from runners.presets import PresetError, resolve_preset

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)

SMALL = ["matrix.seed=[0]", "matrix.prompt_len=[16]", "matrix.gen_len=[4]", "matrix.vocab=[512]"]
SIDE = "runs/kv_aligned_{kv_aligned}/seed_{seed}/{mode}"


def smoke_command() -> str:
    return load_preset(resolve_preset("b3_67_smoke")).section("engine")["command"]


def run(tmp_path: Path, *sets: str, extra: tuple[str, ...] = ()) -> tuple[int, str, Path | None]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    out = tmp_path / "out"
    args = [a for s in [*SMALL, *sets] for a in ("--set", s)]
    done = tracedeck(
        "run",
        "b3_67_smoke",
        "--out",
        str(out),
        "--set",
        f'target.runs="{tmp_path}/remote"',
        "--set",
        f'target.lock="{tmp_path}/lock"',
        *args,
        *extra,
        env=cli_env(home),
        timeout=300,
    )
    dirs = run_dirs(out)
    return done.returncode, done.stdout + done.stderr, dirs[0] if dirs else None


def assert_every_file_agrees(local: Path, code: int) -> dict:
    """summary.json, the report, the metrics files and the last event all say one verdict."""
    summary = json.loads((local / "summary.json").read_text())
    word = summary["global_verdict"]
    assert VERDICT_EXIT[word] == code, (word, code)
    final = [e for e in events(local) if e["type"] == "run_finished"]
    assert len(final) == 1
    assert final[0]["verdict"] == word and final[0]["exit_code"] == code
    assert final[0]["summary"]["global_verdict"] == word
    report = (local / "B3_67_EQUIVALENCE_GUARDRAIL.md").read_text()
    assert f"**Global verdict: {word}**" in report
    judged = {
        (e["kv_aligned"], e["seed"]): e["verdict"]
        for e in events(local)
        if e["type"] == "pair_verdict"
    }
    for (kv, seed), verdict in judged.items():
        doc = json.loads((local / f"metrics/kv_aligned_{kv}/seed_{seed}_metrics.json").read_text())
        assert doc["verdict"] == verdict
    for u in summary["unjudged"]:
        assert u["pair"] in report and u["why"]
    return summary


@pytest.mark.slow
def test_a_clean_run_passes_and_every_file_says_so(tmp_path: Path) -> None:
    code, text, local = run(tmp_path)
    assert code == 0, text
    assert local is not None
    summary = assert_every_file_agrees(local, 0)
    assert summary["global_verdict"] == "PASS_GUARDRAIL" and summary["unjudged"] == []


@pytest.mark.slow
def test_a_crashed_side_is_an_engine_error_in_every_file(tmp_path: Path) -> None:
    crash = (
        'engine.command="if [ {mode} = decode ] && [ {kv_aligned} = 1 ]; then '
        "echo boom-from-engine >&2; exit 7; fi; " + smoke_command() + '"'
    )
    code, text, local = run(tmp_path, crash)
    assert code == 3, text
    assert local is not None
    summary = assert_every_file_agrees(local, 3)
    assert summary["global_verdict"] == "ENGINE_ERROR"
    [u] = summary["unjudged"]
    assert u["pair"] == "kv_aligned_1/seed_0" and u["class"] == "engine"
    assert "exit 7" in u["why"] and "boom-from-engine" in u["why"]
    assert "RESULT: ENGINE_ERROR (exit 3)" in text


@pytest.mark.slow
def test_an_engine_that_never_ran_is_an_engine_error_and_analyze_says_so(tmp_path: Path) -> None:
    code, text, local = run(tmp_path, 'engine.command="/nonexistent/greta_infer --mode {mode}"')
    assert code == 3, text
    assert "RESULT: ENGINE_ERROR (exit 3)" in text and "never started (exit 127)" in text
    assert local is not None
    summary = assert_every_file_agrees(local, 3)
    assert len(summary["unjudged"]) == 2 and {u["class"] for u in summary["unjudged"]} == {"engine"}
    home = tmp_path / "home"
    again = tracedeck("analyze", str(local), env=cli_env(home))
    assert again.returncode == 3, again.stdout + again.stderr
    assert "exit 127" in again.stderr and "no runs/ directory" in again.stderr


@pytest.mark.slow
def test_output_the_engine_never_wrote_is_not_a_pass(tmp_path: Path) -> None:
    fetch = (
        f'artifacts.fetch=["{SIDE}/logits.jsonl.gz", "{SIDE}/metadata.json", "{SIDE}/extra.bin"]'
    )
    code, text, local = run(tmp_path, fetch)
    assert code == 3, text
    assert local is not None
    summary = assert_every_file_agrees(local, 3)
    assert {u["class"] for u in summary["unjudged"]} == {"engine"}
    assert all(
        "extra.bin" in u["why"] and "did not write it" in u["why"] for u in summary["unjudged"]
    )


@pytest.mark.slow
def test_broken_output_fails_the_guardrail_in_every_file(tmp_path: Path) -> None:
    broken = (
        'engine.command="' + smoke_command() + " && if [ {mode} = decode ] && "
        "[ {kv_aligned} = 1 ]; then printf garbage >> {out}/" + SIDE + '/logits.jsonl.gz; fi"'
    )
    code, text, local = run(tmp_path, broken)
    assert local is not None
    summary = assert_every_file_agrees(local, code)
    assert code == 1 and summary["global_verdict"] == "FAIL_GUARDRAIL", text
    [u] = summary["unjudged"]
    assert u["class"] == "output" and "corrupt gzip" in u["why"]


@pytest.mark.slow
def test_looser_thresholds_need_the_flag_and_then_every_file_says_so(tmp_path: Path) -> None:
    loose = "thresholds.max_abs_diff_max=0.5"
    code, text, local = run(tmp_path, loose)
    assert code == 2 and local is None, text
    assert "thresholds.max_abs_diff_max: looser than the seed's guardrail" in text
    assert "--loose-thresholds" in text
    code, text, local = run(tmp_path, loose, extra=("--loose-thresholds",))
    assert code == 0, text
    assert local is not None
    summary = assert_every_file_agrees(local, 0)
    assert summary["global_verdict"] == "PASS_GUARDRAIL_LOOSENED"
    assert summary["thresholds_loosened"]["max_abs_diff_max"]["factor"] == 100.0
    assert "THRESHOLDS LOOSENED: max_abs_diff_max 0.005 -> 0.5 (100x)" in text
    report = (local / "B3_67_EQUIVALENCE_GUARDRAIL.md").read_text()
    assert "Thresholds loosened by the operator" in report


@pytest.mark.parametrize(
    ("assignment", "words"),
    [
        ("thresholds.p99_abs_diff_max=nan", "finite number >= 0"),
        ("thresholds.max_abs_diff_max=inf", "finite number >= 0"),
        ("thresholds.max_abs_diff_max=-1", "finite number >= 0"),
        ("thresholds.top1_agreement_min=1.5", "at most 1"),
        ("thresholds.top1_agreement_min=0.5", "looser than the seed's"),
        ("matrix.kv_aligned=[0]", "guards nothing"),
    ],
)
def test_thresholds_and_matrix_that_cannot_guard_are_refused_at_load(
    assignment: str, words: str
) -> None:
    with pytest.raises(PresetError) as err:
        load_preset(resolve_preset("b3_67_smoke"), [assignment])
    assert words in str(err.value) and "b3_67_smoke.toml" in str(err.value)
    assert "(--set " in str(err.value)


def test_stricter_thresholds_are_welcome() -> None:
    preset = load_preset(resolve_preset("b3_67_smoke"), ["thresholds.max_abs_diff_max=1e-6"])
    assert preset.section("thresholds")["max_abs_diff_max"] == 1e-6
