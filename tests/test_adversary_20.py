"""Issue 20, attacked again as a hostile engine or host: each test is one attack on a judge.

Every attack here must end refused, FAIL or an error, never a pass (exit 0, or a pass word in
a file written), and analyze must never rewrite a run's recorded verdict.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from patience import patience
from runhelp import ROOT, cli_env, tracedeck
from test_kv_liars import DATA, judge_log
from test_readout_liars import honest, verdict_of, write

from analysis.equivalence_claims import ClaimError, _checked_metrics
from analysis.kv_invariance import PASS_INVARIANCE, SUMMARY, global_verdict
from analysis.kv_invariance_llamacpp import read_log
from analysis.readout import TraceError, parse_line
from runners.kind import HostJudging
from runners.remote_judge import imports_argv, judge_argv, manifest

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)

# ---------------------------------------------------------------- llama.cpp's log


def cpu_ok() -> list[str]:
    return (DATA / "cpu_ok.log").read_text().splitlines()


def first_cell(lines: list[str]) -> tuple[int, int]:
    """[start, end) of the first cell's [kvci] lines (its single-shot q line to the next one)."""
    opens = [i for i, x in enumerate(lines) if x.startswith("[kvci] q ne=[") and ",1," not in x]
    return opens[0], opens[1]


def test_a_failed_cell_run_again_and_passing_is_no_pass() -> None:
    """The test runs each cell once per backend: a [FAIL] for a cell, then the same cell again
    seen equal, must not turn into BITWISE_EQUAL."""
    lines = cpu_ok()
    a, b = first_cell(lines)
    fail = "[FAIL] KV invariance: backend=CPU D=128 KV=256 gqa=1"
    lied = lines[:b] + [fail] + lines[a:b] + lines[b:]
    word, _, cells = judge_log("\n".join(lied))
    assert word != PASS_INVARIANCE
    assert cells[0].verdict != "BITWISE_EQUAL"


def test_a_cell_seen_twice_is_a_problem_naming_it() -> None:
    lines = cpu_ok()
    a, b = first_cell(lines)
    cells, problems, _ = read_log("\n".join(lines[:b] + lines[a:b] + lines[b:])).results(None)
    assert global_verdict(cells, problems)[0] != PASS_INVARIANCE
    assert any("D=128 KV=256 gqa=1 is run twice" in why for _, why in problems)


# ---------------------------------------------------------------- analyze never rewrites


def fake_run_dir(path: Path, word: str) -> Path:
    path.mkdir(parents=True)
    (path / "run.json").write_text("{}\n")
    (path / SUMMARY).write_text(json.dumps({"global_verdict": word}) + "\n")
    (path / "summary.json").write_text(json.dumps({"global_verdict": word}) + "\n")
    return path


@pytest.mark.parametrize("how", ["direct", "symlink", "dotdot", "inside"])
def test_analyze_output_naming_another_runs_directory_is_refused(tmp_path: Path, how: str) -> None:
    other = fake_run_dir(tmp_path / "runs" / "other", "FAIL_INVARIANCE")
    before = {p: p.read_bytes() for p in other.rglob("*")}
    log = tmp_path / "test-kvcache-invariance.log"
    log.write_text((DATA / "cpu_ok.log").read_text())
    output = {
        "direct": other,
        "symlink": tmp_path / "link",
        "dotdot": tmp_path / "runs" / "x" / ".." / "other",
        "inside": other / "sub",
    }[how]
    if how == "symlink":
        output.symlink_to(other, target_is_directory=True)
    done = tracedeck("analyze", str(log), "--output", str(output), env=cli_env(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "run's" in done.stderr and "recorded verdict" in done.stderr
    assert {p: p.read_bytes() for p in other.rglob("*")} == before


def test_analyze_of_a_readout_trace_with_output_writes_nothing_into_another_run(
    tmp_path: Path,
) -> None:
    other = fake_run_dir(tmp_path / "other", "NO OK")
    before = {p: p.read_bytes() for p in other.rglob("*")}
    trace = write(tmp_path / "t.jsonl", list(honest()))
    done = tracedeck("analyze", str(trace), "--output", str(other), env=cli_env(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert {p: p.read_bytes() for p in other.rglob("*")} == before


# ---------------------------------------------------------------- readout lines


def test_a_readout_line_with_a_duplicate_key_is_refused_naming_it() -> None:
    """The B3.11 line that hides behind a second tokens_total: the first says 205 (so row 100
    is wrong), the second 101 (so it is right). A line that says two things is not believed."""
    prefill, _ = honest()
    fields = {**prefill, "used_index": 100, "hidden_token_index_used": 100}
    fields.pop("tokens_total")
    for key in ("logical_last_index", "expected_last_index", "token_index", "pos_id"):
        fields[key] = 100
    for key in ("hidden_offset_bytes", "logits_offset_bytes", "seq_len"):
        fields.pop(key, None)
    body = json.dumps(fields)[1:-1]
    raw = '{"tokens_total": 205, ' + body + ', "tokens_total": 101}'
    with pytest.raises(TraceError) as exc:
        parse_line(raw, 3, "t.jsonl")
    assert "t.jsonl:3" in str(exc.value) and "'tokens_total'" in str(exc.value)
    assert "twice" in str(exc.value)


@pytest.mark.parametrize(
    "value",
    ['"204"', "true", "null", "-1", "204.0", "NaN", "Infinity", "99999999999999999999999"],
)
def test_a_readout_tokens_total_that_is_no_count_is_refused(tmp_path: Path, value: str) -> None:
    prefill, decode = honest()
    raw = json.dumps({**prefill, "tokens_total": 0}).replace(
        '"tokens_total": 0', f'"tokens_total": {value}'
    )
    path = tmp_path / "t.jsonl"
    path.write_text(raw + "\n" + json.dumps(decode) + "\n")
    assert verdict_of(path) == "refused"


def test_a_prefill_line_claiming_a_single_token_buffer_for_205_tokens_is_refused(
    tmp_path: Path,
) -> None:
    """B3.11 again, dressed as B3.12: prefill read row 0 of its 205 rows and calls the buffer
    single_token, whose only row is 0. A prefill of seq_len 205 has no single-token buffer."""
    prefill, decode = honest()
    assert prefill["seq_len"] > 1
    prefill.update(
        readout_buffer_kind="single_token",
        used_index=0,
        hidden_token_index_used=0,
        hidden_offset_bytes=0,
    )
    assert verdict_of(write(tmp_path / "t.jsonl", [prefill, decode])) == "refused"


def test_a_decode_line_for_a_prompt_that_never_ran_is_refused(tmp_path: Path) -> None:
    prefill, decode = honest()
    decode["prompt"] = "ghost"
    prefill["prompt"] = "real"
    assert verdict_of(write(tmp_path / "t.jsonl", [prefill, decode])) == "refused"


def test_a_decode_line_with_a_negative_step_is_refused(tmp_path: Path) -> None:
    prefill, decode = honest()
    decode["step"] = -1
    assert verdict_of(write(tmp_path / "t.jsonl", [prefill, decode])) == "refused"


# ---------------------------------------------------------------- a host's metrics document


@pytest.mark.parametrize(
    "value", ["0.001", True, None, math.nan, math.inf, -math.inf, [0.0], {"v": 0.0}]
)
def test_metrics_that_are_not_finite_numbers_are_refused(value: Any) -> None:
    metrics = {
        "max_abs_diff": 0.0,
        "p99_abs_diff": 0.0,
        "top1_agreement": 1.0,
        "cos_sim_mean": 1.0,
    }
    for key in metrics:
        lied = {**metrics, key: value}

        def refuse(what: str) -> ClaimError:
            return ClaimError(what)

        with pytest.raises(ClaimError):
            _checked_metrics(lied, 16, refuse)
    with pytest.raises(ClaimError):
        _checked_metrics({**metrics, "extra": 0.0}, 16, refuse)
    with pytest.raises(ClaimError):
        _checked_metrics({k: v for k, v in metrics.items() if k != "cos_sim_mean"}, 16, refuse)


# ---------------------------------------------------------------- the judge's interpreter


def test_boot_ignores_the_engines_directory_home_and_python_variables(tmp_path: Path) -> None:
    """What a hostile engine can plant as the same user without touching the python install:
    a sitecustomize/usercustomize in its output (the judge's cwd), a usercustomize in HOME's
    user site, PYTHONPATH / PYTHONSTARTUP / PYTHONHOME pointing at them. None of it runs."""
    out, home = tmp_path / "out", tmp_path / "home"
    out.mkdir()
    mark = tmp_path / "ran"
    evil = f"open({str(mark)!r}, 'a').write(__name__ + '\\n')\n"
    for name in ("sitecustomize.py", "usercustomize.py", "json.py", "hashlib.py", "runners.py"):
        (out / name).write_text(evil)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    user_site = home / ".local" / "lib" / ver / "site-packages"
    user_site.mkdir(parents=True)
    (user_site / "usercustomize.py").write_text(evil)
    (user_site / "evil.pth").write_text(f"import os; open({str(mark)!r}, 'a').write('pth\\n')\n")
    spec = HostJudging(modules=(), requires=(), held=lambda _: False, entry="runners.hosted.check")
    hashes = manifest(spec)
    # the judge files as the console ships them
    judge = tmp_path / "judge"
    for rel in hashes:
        (judge / rel).parent.mkdir(parents=True, exist_ok=True)
        (judge / rel).write_bytes((ROOT / rel).read_bytes())
    env = {
        "HOME": str(home),
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(out),
        "PYTHONSTARTUP": str(out / "sitecustomize.py"),
        "PYTHONUSERBASE": str(home / ".local"),
    }
    done = subprocess.run(
        judge_argv(sys.executable, str(judge), hashes, "runners.hosted.check")
        + ["json", "hashlib", "runners.atomic"],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not mark.exists(), mark.read_text()


# ---------------------------------------------------------------- B3.67: an early stop claimed


def cut_short(root: Path, keep: int, **meta: Any) -> Path:
    """A failing kv_aligned=1 pair whose engine cut both files to `keep` lines and wrote
    eos_at_token keep - 1 (and `meta`) into both metadata files."""
    import gzip

    from test_equivalence_tree import write_tree

    root.mkdir(parents=True, exist_ok=True)
    write_tree(root, {1: {0: 0.5}})
    base = root / "runs" / "kv_aligned_1" / "seed_0"
    for mode in ("prefill", "decode"):
        logits = base / mode / "logits.jsonl.gz"
        lines = gzip.decompress(logits.read_bytes()).splitlines(keepends=True)
        logits.write_bytes(gzip.compress(b"".join(lines[:keep])))
        doc = json.loads((base / mode / "metadata.json").read_text())
        doc.update(eos_at_token=keep - 1, **meta)
        (base / mode / "metadata.json").write_text(json.dumps(doc))
    return base


def last_ids(base: Path, keep: int) -> list[int]:
    import gzip

    lines = gzip.decompress((base / "prefill" / "logits.jsonl.gz").read_bytes()).splitlines()
    return [json.loads(x)["token_id"] for x in lines[:keep]]


def rewrite_sides(base: Path, meta: dict[str, Any], row: dict[str, Any] | None = None) -> None:
    import gzip

    for mode in ("prefill", "decode"):
        path = base / mode / "metadata.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **meta}))
        if row is not None:
            logits = base / mode / "logits.jsonl.gz"
            logits.write_bytes(gzip.compress((json.dumps(row) + "\n").encode()))


@pytest.mark.parametrize("lie", ["no eos_token_id", "another id", "chosen before", "not max"])
def test_an_early_stop_claimed_to_hide_a_failure_is_no_pass(tmp_path: Path, lie: str) -> None:
    """Issue 9 let an engine stop early when both metadata files say eos_at_token: a broken
    engine cuts both files short (where its sides still agree) and claims EOS there."""
    import gzip

    from test_equivalence_tree import expect

    root = tmp_path / "tree"
    keep = 2 if lie == "chosen before" else 1
    base = cut_short(root, keep)
    ids = last_ids(base, keep)
    if lie == "another id":
        rewrite_sides(base, {"eos_token_id": ids[-1] + 1})
    elif lie == "chosen before":
        rewrite_sides(base, {"eos_token_id": ids[0]})  # token 0 chose it: it stopped there
    elif lie == "not max":
        row = json.loads(gzip.decompress((base / "prefill" / "logits.jsonl.gz").read_bytes()))
        row["token_id"] = int(np.argmin(row["logits"]))
        rewrite_sides(base, {"eos_token_id": row["token_id"]}, row)
    expect(root, base if lie == "no eos_token_id" else base / "prefill", "eos_token_id")


def test_an_honest_early_stop_is_judged(tmp_path: Path) -> None:
    from test_equivalence_tree import write_tree

    from analysis.equivalence_tree import judge_pair

    write_tree(tmp_path, {1: {0: 1e-4}})
    base = tmp_path / "runs" / "kv_aligned_1" / "seed_0"
    ids = last_ids(base, 3)
    for mode in ("prefill", "decode"):
        import gzip

        logits = base / mode / "logits.jsonl.gz"
        lines = gzip.decompress(logits.read_bytes()).splitlines(keepends=True)
        logits.write_bytes(gzip.compress(b"".join(lines[:3])))
    if ids[2] in ids[:2]:
        pytest.skip("the data chose this id before")
    rewrite_sides(base, {"eos_at_token": 2, "eos_token_id": ids[2]})
    assert judge_pair(tmp_path, 1, 0).verdict == "PASS_EQUIV"


# ---------------------------------------------------------------- a readout run


def test_a_readout_cell_that_wrote_no_prompt_is_no_ok(tmp_path: Path) -> None:
    """Two cells (two prompts); the second cell's engine exits 0 and writes no line. One OK
    row is not a run whose every prompt was judged."""
    from test_readout_liars import engine_preset, run_preset

    preset = engine_preset(tmp_path)
    text = preset.read_text().replace("n = [1]", "n = [1, 2]")
    text = text.replace("command = \"sh -c '", "command = \"sh -c 'test {n} = 2 || ")
    preset.write_text(text)
    done, run_dir = run_preset(tmp_path, preset)
    assert done.returncode == 1 and "RESULT: NO OK (exit 1)" in done.stdout, done.stdout
    assert "cell 2 (n=2) passed but wrote no prefill_last line" in done.stdout
    # and judged again from the run's directory: the same
    again = tracedeck("analyze", str(run_dir), env=cli_env(tmp_path / "home"))
    assert again.returncode == 1, again.stdout + again.stderr
    assert "re-judged from the kept trace: NO OK" in again.stdout


# ---------------------------------------------------------------- a 03C result.json


def test_a_result_json_giving_a_key_twice_is_not_believed(tmp_path: Path) -> None:
    """deterministic false, then true: the first reading is a cell that must not pass, the
    second (json's, the last wins) a pass. A result that says both is believed in neither."""
    from test_kv_invariance_analysis import write_cell
    from test_kv_liars import HONEST, PARAMS, POINT

    from analysis.kv_invariance import BITWISE_EQUAL, UNJUDGED, judge_cell_dir

    folder = write_cell(tmp_path / "c", None, **{**HONEST, "deterministic": True})
    assert judge_cell_dir(folder, POINT, True, {**PARAMS, **POINT}, None).verdict == BITWISE_EQUAL
    path = folder / "result.json"
    text = path.read_text()
    path.write_text('{"deterministic": false, ' + text.lstrip()[1:])
    result = judge_cell_dir(folder, POINT, True, {**PARAMS, **POINT}, None)
    assert result.verdict == UNJUDGED, result
    assert "'deterministic' is given twice (False, then True)" in result.reason


@pytest.mark.parametrize("plant", ["sitecustomize", "pth"])
def test_code_planted_in_the_judging_pythons_venv_never_runs(tmp_path: Path, plant: str) -> None:
    """The engine's user can write the venv of the python that judges on the host: a
    sitecustomize or a .pth line there ran inside the judge under `-I` (site imports both)
    before it could check anything. Started `-I -S`, neither runs, and the venv's packages are
    still found (a judge needs numpy), for the judge, for plan --check's probe, both."""
    venv = tmp_path / "hostpy"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python3*/site-packages")
    mark = tmp_path / "ran"
    code = f"open({str(mark)!r}, 'a').write('ran')"
    if plant == "sitecustomize":
        (site / "sitecustomize.py").write_text(code + "\n")
    else:
        (site / "evil.pth").write_text(f"import os; {code}\n")
    (site / "venvmark.py").write_text("WHERE = 'venv'\n")  # a package only the venv has
    spec = HostJudging(modules=(), requires=(), held=lambda _: False, entry="runners.hosted.check")
    judge = tmp_path / "judge"
    hashes = manifest(spec)
    for rel in hashes:
        (judge / rel).parent.mkdir(parents=True, exist_ok=True)
        (judge / rel).write_bytes((ROOT / rel).read_bytes())
    python = str(venv / "bin" / "python")
    judged = subprocess.run(
        judge_argv(python, str(judge), hashes, "runners.hosted.check") + ["json", "venvmark"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    probe = subprocess.run(
        imports_argv(python, ["venvmark"]), capture_output=True, text=True, timeout=patience(60)
    )
    assert not mark.exists(), "planted code ran inside the judge"
    assert judged.returncode == 0, judged.stdout + judged.stderr
    assert probe.returncode == 0, probe.stderr
    [found] = [json.loads(line) for line in probe.stdout.splitlines()]
    assert found == {"module": "venvmark", "dir": str(site), "writable": os.access(site, os.W_OK)}
    missing = subprocess.run(
        imports_argv(python, ["no_such_module_here"]), capture_output=True, text=True
    )
    assert missing.returncode != 0 and "no_such_module_here" in missing.stderr


# ---------------------------------------------------------------- links in a tree handed to analyze


@pytest.mark.parametrize("link", ["summary.json", "metrics"])
def test_analyze_never_writes_through_a_link_into_another_run(tmp_path: Path, link: str) -> None:
    """A B3.67 tree whose summary.json (or metrics/) is a link into another run's directory:
    analyze writes the tree's documents, never through the link into that run's record."""
    from test_equivalence_tree import write_tree

    other = fake_run_dir(tmp_path / "other", "FAIL_GUARDRAIL")
    (other / "metrics" / "kv_aligned_1").mkdir(parents=True)
    (other / "metrics" / "kv_aligned_1" / "seed_0_metrics.json").write_text('{"recorded": 1}\n')
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    tree = tmp_path / "tree"
    tree.mkdir()
    write_tree(tree, {1: {0: 1e-4}, 0: {0: 0.5}})
    (tree / link).symlink_to(other / link, target_is_directory=link == "metrics")
    done = tracedeck("analyze", str(tree), env=cli_env(tmp_path))
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before, done.stdout
    if link == "metrics":
        assert done.returncode == 2 and "a link out of" in done.stderr, done.stderr


def test_a_log_with_two_exit_lines_is_a_problem() -> None:
    """A crash (exit 134) whose log then says 'exited 0' again: one run writes one exit line."""
    text = (
        (DATA / "cpu_ok.log")
        .read_text()
        .replace("exited 0", "exited 134\n" + "[tracedeck] test-kvcache-invariance exited 0")
    )
    cells, problems, _ = read_log(text).results(None)
    assert global_verdict(cells, problems)[0] != PASS_INVARIANCE
    assert any("2 exit lines" in why for _, why in problems)
