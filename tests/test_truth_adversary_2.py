"""A second adversarial round on verdict truth: readout records, replay's item lines, DSA
traces, the console's screens and the CI reports. Each input below made tracedeck show a pass
(or a better word) that the record's own data did not support; each is now named as what the
data says. Recorded runs are real reference-engine runs or the checked-in ones, edited by hand."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from runhelp import cli_env, run_dirs, tracedeck

DATA = Path(__file__).resolve().parent / "data"


def _edit(local: Path, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
    """Rewrite a record's events: change() returns the event (edited in place) or None to drop."""
    path = local / "events.jsonl"
    kept = [change(json.loads(line)) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(e) + "\n" for e in kept if e is not None))


@pytest.fixture(scope="module")
def readout_ok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real reference-engine readout run of two prompts (one cell each) that passed."""
    tmp = tmp_path_factory.mktemp("readout")
    out = tmp / "out"
    (tmp / "home").mkdir()
    done = tracedeck(
        "run", "b3_11_readout", "--out", str(out),
        "--set", f'target.runs="{tmp}/remote"', "--set", f'target.lock="{tmp}/lock"',
        "--set", 'matrix.prompt=["p0_short", "p4_sys"]',
        env=cli_env(tmp / "home"), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "RESULT: OK (exit 0)" in done.stdout, done.stdout
    return run_dirs(out)[0]


def _pass_end(e: dict[str, Any]) -> dict[str, Any]:
    if e["type"] == "run_finished":
        e.update(verdict="OK", exit_code=0)
        e["summary"]["verdict"] = "OK"
        for row in e["summary"].get("prompts", []):
            row["verdict"] = "OK"
    return e


def test_a_legacy_readout_row_word_is_recomputed_from_its_own_numbers(tmp_path: Path) -> None:
    """Runs recorded whole readout rows before digests; each row's verdict word was believed.
    Every row relabelled OK (prefill 4413 vs decode0 9023 kept) and the end made OK: replay
    said RESULT: OK (exit 0) over a table of OK rows, diff said the prompts FIXED."""
    local = tmp_path / "run"
    shutil.copytree(DATA / "legacy_readout_run", local)

    def relabel(e: dict[str, Any]) -> dict[str, Any]:
        if e["type"] == "readout_row":
            e["row"]["verdict"] = "OK"
        return _pass_end(e)

    _edit(local, relabel)
    env = cli_env(tmp_path)
    done = tracedeck("replay", str(local), "--headless", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: OK (contradicted) (exit 1)" in done.stdout
    assert "| p1_len_16 | 4413 | 9023 | 0 | NO OK |" in done.stdout, done.stdout
    assert "(prompt p1_len_16: NO OK)" in done.stderr, done.stderr
    done = tracedeck("diff", str(DATA / "legacy_readout_run"), str(local), env=env)
    assert "FIXED" not in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("how", "word"),
    [("failed_cell", "FAILED"), ("lost_trace", "UNJUDGED")],
)
def test_a_readout_record_short_of_a_cell_is_no_pass(
    tmp_path: Path, readout_ok: Path, how: str, word: str
) -> None:
    """A passing readout run's cell 2 edited to have failed (exit 1), or its trace lines
    deleted from the record, the end left OK (exit 0): the judge requires every cell passed
    and judged, the record's reading (load_side) did not, so replay said OK (exit 0) and the
    final table showed both prompts from the end's own copy."""
    local = tmp_path / "run"
    shutil.copytree(readout_ok, local)

    def change(e: dict[str, Any]) -> dict[str, Any] | None:
        if how == "failed_cell" and e["type"] == "cell_finished" and e["cell"] == 1:
            e.update(state="failed", exit_code=1)
        if how == "lost_trace" and e["type"] == "trace" and e["cell"] == 1:
            return None
        return e

    _edit(local, change)
    done = tracedeck("replay", str(local), "--headless", env=cli_env(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: OK (contradicted) (exit 1)" in done.stdout, done.stdout
    assert f"(cell 2): {word}): not believed" in done.stderr, done.stderr
    if how == "lost_trace":  # the table shows the rows the record's lines hold: one
        assert "| p0_short |" in done.stdout and "| p4_sys |" not in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("name", "etype", "was", "forged", "line"),
    [("equivalence_fail", "pair_verdict", "FAIL_EQUIV", "PASS_EQUIV",
      "verdict kv_aligned=1 seed=1: PASS_EQUIV (contradicted: recomputed FAIL_EQUIV)"),
     ("kv_invariance_run", "kv_cell_verdict", "DIFFERS", "BITWISE_EQUAL",
      "kv d=128 kv=1024 b=8 gqa=2 mask=1 alibi=1 sinks=0: BITWISE_EQUAL (contradicted: single vs "
      "chunk33 differ first")],
)  # fmt: skip
def test_replay_marks_an_item_word_its_own_data_contradicts(
    tmp_path: Path, name: str, etype: str, was: str, forged: str, line: str
) -> None:
    """The failing pair's (cell's) recorded word forged to a pass, its metrics (first
    differing element) kept, the end left a failure: replay checked only the RESULT line, so
    it printed `kv_aligned=1 seed=1: PASS_EQUIV` beside FAIL_GUARDRAIL, pointing the operator
    at the wrong pair. The item's word is now shown with what its recomputation says."""
    local = tmp_path / "run"
    shutil.copytree(DATA / name, local)

    def forge(e: dict[str, Any]) -> dict[str, Any]:
        if e["type"] == etype and e["verdict"] == was:
            e["verdict"] = forged
        return e

    _edit(local, forge)
    done = tracedeck("replay", str(local), "--headless", env=cli_env(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert line in done.stdout, done.stdout
    clean = tracedeck("replay", str(DATA / name), "--headless", env=cli_env(tmp_path))
    assert "contradicted" not in clean.stdout, clean.stdout


def _dsa_run(tmp: Path, inject: str) -> tuple[Path, Path]:
    """A real dsa_smoke run (the reference engine): its local directory and its shards' one."""
    (tmp / "home").mkdir(parents=True)
    done = tracedeck(
        "run", "dsa_smoke", "--out", str(tmp / "out"),
        "--set", f'target.runs="{tmp}/remote"', "--set", f'target.lock="{tmp}/lock"',
        "--set", f'matrix.inject=["{inject}"]', env=cli_env(tmp / "home"), timeout=300,
    )  # fmt: skip
    assert done.returncode == (0 if inject == "none" else 1), done.stdout + done.stderr
    [remote] = (tmp / "remote").glob("*/artifacts/dsa/block16")
    return run_dirs(tmp / "out")[0], remote


def test_analyze_of_a_dsa_run_whose_shards_were_swapped_is_no_pass(tmp_path: Path) -> None:
    """A failed dsa_smoke run (block_off_by_one: 45 of 45 records invalid while it ran); a
    passing run's shards and summary.json put into its directory: `analyze RUN_DIR` judged
    the shards there whole and said RESULT: TRACE_OK (exit 0) beside `invalid: 45` from the
    record. The shards must be the ones the run followed."""
    bad, _ = _dsa_run(tmp_path / "bad", "block_off_by_one")
    [home] = bad.glob("**/block16")
    _, good = _dsa_run(tmp_path / "good", "none")
    for name in [p.name for p in good.glob("trace_steps_*.jsonl")] + ["summary.json"]:
        (home / name).write_bytes((good / name).read_bytes())
    done = tracedeck("analyze", str(bad), "--json", env=cli_env(tmp_path / "bad" / "home"))
    assert done.returncode == 1, done.stdout + done.stderr
    [trace] = json.loads(done.stdout)["traces"]
    assert trace["verdict"] == "TRACE_INVALID", trace
    assert any(p["field"] == "shards" for p in trace["problems"]), trace["problems"]


async def test_the_replay_screen_marks_a_pair_word_its_own_metrics_contradict(
    tmp_path: Path,
) -> None:
    """The console's replay of the same forged record: the pair table showed seed 1's row as
    a green PASS_EQUIV (only the banner was checked). The row now says it is contradicted."""
    from test_console import SIZE, wait_for_banner

    from console.app import create_app
    from console.panels.equivalence import VerdictTable

    local = tmp_path / "run"
    shutil.copytree(DATA / "equivalence_fail", local)

    def forge(e: dict[str, Any]) -> dict[str, Any]:
        if e["type"] == "pair_verdict" and e["verdict"] == "FAIL_EQUIV":
            e["verdict"] = "PASS_EQUIV"
        return e

    _edit(local, forge)
    app = create_app(out_dir=tmp_path / "out", replay_dir=local, speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot, timeout=60)
        rows = {(r[0], r[1]): r[-1] for r in screen.query_one("#verdicts", VerdictTable).contents()}
        assert rows[("1", "1")].startswith("PASS_EQUIV (contradicted: recomputed FAIL_EQUIV"), rows
        assert rows[("1", "0")] == "PASS_EQUIV", rows
