"""03C end to end: the smoke grid on the real torch engine locally and over the real sshd, the
canaries, engines that crash or lie, analyze on the fetched tree, and llama.cpp's test mapped
onto the grid (a stand-in binary prints the test's captured output)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from runhelp import TOY_ENGINE, cli_env, events, run_dirs, tracedeck
from sshd import SshHome

from analysis.kv_invariance import SUMMARY, judge_cell_dir, point_dir

DATA = Path(__file__).resolve().parent / "data"
SMOKE_POINTS = [
    {"d": 64, "kv": 256, "b": b, "gqa": 2, "mask": m, "alibi": 1, "sinks": 1}
    for b in (1, 8)
    for m in (1, 0)
]
ONE_CELL = ["--set", "matrix.b=[1]", "--set", "matrix.mask=[1]"]


def isolated(tmp_path: Path) -> list[str]:
    return ["--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"']


def run(tmp_path: Path, *args: str, preset: str = "kv_invariance_smoke", **kw: object):  # noqa: ANN201
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    out = tmp_path / "out"
    done = tracedeck(
        "run", preset, "--out", str(out), *isolated(tmp_path), *args, env=cli_env(home), timeout=300
    )
    dirs = run_dirs(out)
    return done, (dirs[-1] if dirs else None), home


def verdicts(local_dir: Path) -> dict[str, str]:
    return {
        point_dir(e["point"]): e["verdict"]
        for e in events(local_dir)
        if e["type"] == "kv_cell_verdict"
    }


def squeezed(text: str) -> str:
    """Text with runs of spaces made one (the grid's columns, whatever their width)."""
    return "\n".join(" ".join(line.split()) for line in text.splitlines())


def check_smoke_passes(local_dir: Path, stdout: str) -> None:
    assert "RESULT: PASS_INVARIANCE (exit 0)" in stdout
    assert verdicts(local_dir) == {point_dir(p): "BITWISE_EQUAL" for p in SMOKE_POINTS}
    for p in SMOKE_POINTS:
        for name in ("result.json", "flows.bin"):
            assert (local_dir / "kv_invariance" / point_dir(p) / name).is_file()
    summary = json.loads((local_dir / SUMMARY).read_text())
    assert summary["global_verdict"] == "PASS_INVARIANCE"
    assert summary["counts"]["BITWISE_EQUAL"] == 4
    # the grid, as the headless output prints it
    assert "D=64 KV=256 = = = =" in squeezed(stdout)
    # a verdict arrives while later cells still run
    evts = events(local_dir)
    first = next(i for i, e in enumerate(evts) if e["type"] == "kv_cell_verdict")
    last_start = max(i for i, e in enumerate(evts) if e["type"] == "cell_started")
    assert first < last_start


def test_smoke_passes_locally_and_analyze_rejudges_the_tree(tmp_path: Path) -> None:
    done, local_dir, home = run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert local_dir is not None
    check_smoke_passes(local_dir, done.stdout)
    recorded = (local_dir / SUMMARY).read_bytes()
    again = tracedeck("analyze", str(local_dir), "--json", env=cli_env(home))
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout)
    assert summary["global_verdict"] == "PASS_INVARIANCE" and len(summary["cells"]) == 4
    # the run's own summary stays as the run wrote it (issue 20 item 14); analyze's goes beside
    assert (local_dir / SUMMARY).read_bytes() == recorded
    (wrote,) = summary["wrote"]
    assert Path(wrote).parent.name.startswith(local_dir.name + ".analyze-")
    assert json.loads(Path(wrote).read_text())["global_verdict"] == "PASS_INVARIANCE"
    replay = tracedeck("replay", str(local_dir), "--headless", env=cli_env(home))
    assert replay.returncode == 0 and replay.stdout == done.stdout


@pytest.mark.ssh
def test_smoke_passes_over_ssh(ssh_home: SshHome, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = tracedeck(
        "run",
        "kv_invariance_smoke",
        "--target",
        ssh_home.server.spec,
        "--out",
        str(out),
        "--set",
        f'target.python="{sys.executable}"',
        *isolated(tmp_path),
        env=cli_env(ssh_home.path),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [local_dir] = run_dirs(out)
    check_smoke_passes(local_dir, done.stdout)
    fetched = [e for e in events(local_dir) if e["type"] == "artifact"]
    assert len(fetched) == 8 and all(len(e["sha256"]) == 64 for e in fetched)


def test_split_reduction_fails_every_cell_at_a_named_element(tmp_path: Path) -> None:
    done, local_dir, _ = run(
        tmp_path,
        "--set",
        'matrix.inject=["split_reduction"]',
        "--set",
        "matrix.b=[1, 8]",
        *ONE_CELL[2:],
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: FAIL_INVARIANCE (exit 1)" in done.stdout
    assert local_dir is not None and set(verdicts(local_dir).values()) == {"DIFFERS"}
    assert "  first difference: single vs incremental at batch 0 head " in done.stdout
    assert "first fail: d=64 kv=256 b=1 gqa=2 mask=1 alibi=1 sinks=1: single vs incremental" in (
        done.stdout
    )


def test_unpadded_kv_aborts_every_cell_as_a_precondition_with_its_fix(tmp_path: Path) -> None:
    done, local_dir, home = run(
        tmp_path, "--set", 'matrix.inject=["unpadded_kv"]', "--set", "matrix.b=[1]"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: PRECONDITION_VIOLATED (exit 1)" in done.stdout
    assert local_dir is not None and set(verdicts(local_dir).values()) == {"PRECONDITION"}
    assert (
        "PRECONDITION (kv_stride_256): the KV length presented to attention is 237" in done.stdout
    )
    assert "  fix: pad the KV view to 256" in done.stdout
    # the judge kept the abort's result at home, so analyze judges the same tree the same way
    again = tracedeck("analyze", str(local_dir), env=cli_env(home))
    assert again.returncode == 1 and "global verdict: PRECONDITION_VIOLATED" in again.stdout


def test_mask_unpadded_fails_exactly_the_cells_with_a_mask(tmp_path: Path) -> None:
    done, local_dir, _ = run(
        tmp_path, "--set", 'matrix.inject=["mask_unpadded"]', "--set", "matrix.b=[1]"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert local_dir is not None
    got = verdicts(local_dir)
    assert got == {
        point_dir({**SMOKE_POINTS[0]}): "PRECONDITION",
        point_dir({**SMOKE_POINTS[1]}): "BITWISE_EQUAL",
    }
    assert "PRECONDITION (mask_pad_64)" in done.stdout


def test_deterministic_mode_off_is_a_precondition(tmp_path: Path) -> None:
    done, local_dir, _ = run(tmp_path, "--set", 'determinism.env.GGML_DETERMINISTIC="0"', *ONE_CELL)
    assert done.returncode == 1 and "RESULT: PRECONDITION_VIOLATED (exit 1)" in done.stdout
    assert "enable deterministic mode (GGML_DETERMINISTIC=1)" in done.stdout


CELL_DIR = "{out}/kv_invariance/d{d}_kv{kv}_b{b}_gqa{gqa}_mask{mask}_alibi{alibi}_sinks{sinks}"


def fake_engine(script: str) -> list[str]:
    """--set engine.command running `script` (sh) with the cell's result directory as $1."""
    command = f"sh -c '{script}' fake {CELL_DIR}"
    return ["--set", f"engine.command={json.dumps(command)}", *ONE_CELL]


def test_an_engine_killed_mid_cell_is_an_engine_error(tmp_path: Path) -> None:
    done, local_dir, _ = run(tmp_path, *fake_engine('mkdir -p "$1"; kill -KILL $$'))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "RESULT: ENGINE_ERROR (exit 3)" in done.stdout
    assert "UNJUDGED (engine): cell 1 (" in done.stdout and "exit 137" in done.stdout


def test_an_engine_that_exits_0_without_a_result_is_never_a_pass(tmp_path: Path) -> None:
    done, local_dir, _ = run(tmp_path, *fake_engine("exit 0"))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "RESULT: ENGINE_ERROR (exit 3)" in done.stdout
    assert "exited 0 but kv_invariance/d64_kv256_b1_gqa2_mask1_alibi1_sinks1/result.json" in (
        done.stdout
    )


def test_an_engine_exiting_4_without_its_record_is_an_engine_error(tmp_path: Path) -> None:
    done, _, _ = run(tmp_path, *fake_engine("exit 4"))
    assert done.returncode == 3 and "printed no KV_INVARIANCE_PRECONDITION record" in done.stdout


def test_a_truncated_result_from_the_engine_fails_located(tmp_path: Path) -> None:
    # the real engine, then its flows.bin cut short before tracedeck fetches it
    real = (
        f"{sys.executable} -m runners.reference kv_invariance --d 64 --kv 256 --gqa 2 --alibi 1 "
        '--sinks 1 --out "$1" && head -c 100 "$1/flows.bin" > "$1/t" && mv "$1/t" "$1/flows.bin"'
    )
    done, _, _ = run(tmp_path, *fake_engine(real))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: FAIL_INVARIANCE (exit 1)" in done.stdout
    assert "UNJUDGED (output)" in done.stdout and "flows.bin: 100 bytes; result.json promises" in (
        done.stdout
    )


def test_analyze_refuses_a_tree_with_nothing_to_judge(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    done = tracedeck(
        "analyze", str(tmp_path / "empty"), "--kind", "kv_invariance", env=cli_env(tmp_path)
    )
    assert done.returncode == 2 and "no kv_invariance result.json" in done.stdout


def test_analyze_a_hand_broken_tree(tmp_path: Path) -> None:
    done, local_dir, home = run(tmp_path, "--set", "matrix.b=[1]")
    assert done.returncode == 0 and local_dir is not None
    tree = tmp_path / "copy"
    shutil.copytree(local_dir / "kv_invariance", tree / "kv_invariance")
    cell = tree / "kv_invariance" / point_dir(SMOKE_POINTS[1])
    data = bytearray((cell / "flows.bin").read_bytes())
    data[-1] ^= 0x01  # the last element of the last flow, one bit
    (cell / "flows.bin").write_bytes(bytes(data))
    meta = json.loads((cell / "result.json").read_text())
    meta.pop("flows_sha256")
    (cell / "result.json").write_text(json.dumps(meta))
    broken = tree / "kv_invariance" / point_dir(SMOKE_POINTS[0]) / "result.json"
    broken.write_text(broken.read_text()[:40])  # cut short: not JSON any more
    got = tracedeck("analyze", str(tree), env=cli_env(home))
    assert got.returncode == 1, got.stdout + got.stderr
    assert "d=64 kv=256 b=1 gqa=2 mask=0 alibi=1 sinks=1: DIFFERS" in got.stdout
    assert "first difference: single vs chunk33 at batch 0 head 3 index 63" in got.stdout
    assert (
        f"d=64 kv=256 b=1 gqa=2 mask=1 alibi=1 sinks=1: UNJUDGED (output): {broken}: not valid JSON"
        in got.stdout
    )


# -- llama.cpp's test --------------------------------------------------------------------------


def llamacpp_build(tmp_path: Path, log: str, rc: int) -> list[str]:
    """--set options for a build directory whose bin/test-kvcache-invariance prints a captured
    log (without the preset's exit line: the shipped command appends its own) and exits rc."""
    text = (DATA / "kv_invariance_llamacpp" / log).read_text()
    captured = tmp_path / log
    captured.write_text(
        "".join(x + "\n" for x in text.splitlines() if not x.startswith("[tracedeck]"))
    )
    build = tmp_path / "build"
    (build / "bin").mkdir(parents=True)
    binary = build / "bin" / "test-kvcache-invariance"
    binary.write_text(f"#!/bin/sh\ncat {captured}\nexit {rc}\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return ["--set", "engine.setup=[]", "--set", f'vars.build_dir="{build}"']


def test_llamacpp_preset_maps_a_failing_backend_onto_the_grid(tmp_path: Path) -> None:
    args = llamacpp_build(tmp_path, "rocm_fail.log", 1)
    done, local_dir, home = run(tmp_path, *args, preset="kv_invariance_llamacpp")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: FAIL_INVARIANCE (exit 1)" in done.stdout
    assert "kv ROCm0 d=128 kv=1024 b=1 gqa=2 mask=1 alibi=0 sinks=0: DIFFERS" in done.stdout
    assert "  reported: [FAIL] KV invariance: backend=ROCm0 D=128 KV=1024 gqa=2" in done.stdout
    assert "ROCm0 D=128 KV=1024 = X" in squeezed(done.stdout)
    assert "note: backend Vulkan0 was skipped" in done.stdout
    assert local_dir is not None
    digests = [e for e in events(local_dir) if e["type"] == "trace" and e.get("digest")]
    assert digests and sum(len(e["digest"]["llamacpp"]) for e in digests) < 40
    # the log came home (the command keeps the cell's exit 0), so analyze judges it again
    again = tracedeck("analyze", str(local_dir), env=cli_env(home))
    assert again.returncode == 1 and "global verdict: FAIL_INVARIANCE" in again.stdout


def test_llamacpp_preset_passes_when_every_backend_passes(tmp_path: Path) -> None:
    args = llamacpp_build(tmp_path, "cpu_ok.log", 0)
    done, _, _ = run(tmp_path, *args, preset="kv_invariance_llamacpp")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: PASS_INVARIANCE (exit 0)" in done.stdout
    again = tmp_path / "again"
    again.mkdir()
    required = run(
        again,
        *args,
        "--set",
        'kv_invariance.require_backends=["ROCm0"]',
        preset="kv_invariance_llamacpp",
    )[0]
    assert required.returncode == 3
    assert "required backend ROCm0 did not run (seen: CPU)" in required.stdout


def test_llamacpp_build_failure_is_an_engine_error(tmp_path: Path) -> None:
    done, _, _ = run(
        tmp_path,
        "--set",
        "engine.setup=[\"sh -c 'echo cmake: no such source >&2; exit 1'\"]",
        preset="kv_invariance_llamacpp",
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "RESULT: ENGINE_ERROR (exit 3)" in done.stdout
    assert "setup step failed" in done.stdout


# -- presets refused at load, located ----------------------------------------------------------

SMOKE = Path(__file__).resolve().parent.parent / "presets" / "kv_invariance_smoke.toml"
LLAMACPP = SMOKE.with_name("kv_invariance_llamacpp.toml")

REFUSED = [
    (SMOKE, ("alibi = [1]\n", ""), ["vars.alibi=1"], "matrix.alibi: a grid point needs this key"),
    (SMOKE, ("", ""), ["matrix.mask=[2]"], "matrix.mask[0]: must be 0 or 1"),
    (SMOKE, ("", ""), ["matrix.d=[64.5]"], "matrix.d[0]: must be an integer >= 0"),
    (
        SMOKE,
        ("d{d}_kv{kv}_b", "d{d}_b"),
        ["matrix.kv=[256, 1024]"],
        "cells that differ in kv would share",
    ),
    (
        SMOKE,
        ("--out {out}/kv_invariance/", "--out {out}/elsewhere/"),
        [],
        "engine.command: the engine must write where the results are fetched from",
    ),
    (SMOKE, ("", ""), ['artifacts.fetch=["a/result.json"]'], "artifacts.fetch: must name"),
    (SMOKE, ("", ""), ['kv_invariance.source="guess"'], "kv_invariance.source: must be one of"),
    (SMOKE, ("", ""), ['kv_invariance.require_backends=["CPU"]'], 'only for source = "llamacpp"'),
    (LLAMACPP, ("", ""), ["traces.follow=[]"], "traces.follow: name the test's output file"),
    (LLAMACPP, ("", ""), ['matrix.test=["a", "b"]'], "matrix.test: a llama.cpp preset runs"),
]


@pytest.mark.parametrize(("path", "edit", "sets", "message"), REFUSED)
def test_a_bad_preset_is_refused_naming_its_key(
    tmp_path: Path, path: Path, edit: tuple[str, str], sets: list[str], message: str
) -> None:
    from runners.kinds import load_preset
    from runners.presets import PresetError

    text = path.read_text()
    if edit[0]:
        assert edit[0] in text
        text = text.replace(edit[0], edit[1])
    bad = tmp_path / path.name
    bad.write_text(text)
    with pytest.raises(PresetError) as err:
        load_preset(bad, sets)
    assert message in str(err.value) and str(bad) in str(err.value)


def test_the_shipped_presets_load_with_the_grid_they_promise() -> None:
    from runners.kinds import load_preset

    full = load_preset(SMOKE.with_name("kv_invariance.toml"))
    assert full.cell_count() == 96
    assert {k: full.matrix[k] for k in ("d", "kv", "b", "gqa", "mask", "alibi", "sinks")} == {
        "d": [64, 128, 256],
        "kv": [256, 1024],
        "b": [1, 8],
        "gqa": [1, 2],
        "mask": [1, 0],
        "alibi": [0, 1],
        "sinks": [0],
    }
    env = full.section("determinism")["env"]
    assert env == {"GGML_DETERMINISTIC": "1", "RUN_KVCACHE_CHUNK_TESTS": "1"}
    smoke = load_preset(SMOKE)
    assert smoke.cell_count() == 4 and smoke.matrix["sinks"] == [1]
    llama = load_preset(LLAMACPP)
    assert llama.section("kv_invariance")["source"] == "llamacpp"
    assert "-DGGML_DETERMINISTIC=ON" in llama.section("engine")["setup"][0]
    assert llama.section("determinism")["env"]["RUN_KVCACHE_CHUNK_TESTS"] == "1"


def test_attach_judges_the_cells_a_dead_console_left_unjudged(tmp_path: Path) -> None:
    done, local_dir, home = run(tmp_path)
    assert done.returncode == 0 and local_dir is not None
    # the console died right after cell 3 ended: its artifacts and the later verdicts are lost
    record = local_dir / "events.jsonl"
    kept = []
    for line in record.read_text().splitlines():
        kept.append(line)
        event = json.loads(line)
        if event["type"] == "cell_finished" and event["cell"] == 2:
            break
    record.write_text("\n".join(kept) + "\n")
    judged_before = [json.loads(x)["cell"] for x in kept if '"kv_cell_verdict"' in x]
    assert judged_before == [0, 1]
    again = tracedeck("attach", str(local_dir), env=cli_env(home), timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "RESULT: PASS_INVARIANCE (exit 0)" in again.stdout
    cells = [e["cell"] for e in events(local_dir) if e["type"] == "kv_cell_verdict"]
    assert sorted(cells) == [0, 1, 2, 3]  # each cell judged once, none twice


# -- the toy engine the orchestration tests run instead of torch ------------------------------


def test_the_toy_engine_s_cells_are_judged_as_the_contract_says(tmp_path: Path) -> None:
    """tests/engines/toy.py kv_invariance (test_diff and test_kinds run 03C on it): a clean cell
    is BITWISE_EQUAL, split_reduction DIFFERS in the multi-step flows only, and a cell that would
    abort on a precondition is refused (exit 2), nothing written."""
    point = {"d": 64, "kv": 256, "b": 8, "gqa": 2, "mask": 1, "alibi": 1, "sinks": 1}
    env = {**os.environ, "GGML_DETERMINISTIC": "1", "RUN_KVCACHE_CHUNK_TESTS": "1"}

    def toy(name: str, *extra: str, env: dict[str, str] = env) -> int:
        args = [a for k, v in point.items() for a in (f"--{k}", str(v))]
        argv = [sys.executable, str(TOY_ENGINE), "kv_invariance", *args, "--heads", "4"]
        argv += ["--out", str(tmp_path / name), *extra]
        return subprocess.run(argv, env=env, capture_output=True, check=False).returncode

    def judged(name: str) -> tuple[str, dict]:  # type: ignore[type-arg]
        cell = judge_cell_dir(
            tmp_path / name, point, True, {"heads": 4, "dtype": "fp32"}, deterministic=True
        )
        return cell.verdict, cell.detail

    assert toy("clean") == 0
    verdict, detail = judged("clean")
    assert verdict == "BITWISE_EQUAL", detail
    assert detail["flows"] == ["single", "incremental", "chunk8", "chunk33", "alone"]
    assert toy("split", "--inject", "split_reduction") == 0
    verdict, detail = judged("split")
    assert verdict == "DIFFERS" and detail["max_ulp"] == 1, detail
    assert [p["flows"][1] for p in detail["pairs"]] == ["incremental", "chunk8", "chunk33"]
    assert toy("unpadded", "--inject", "unpadded_kv") == 2
    assert toy("no-determinism", env={**env, "GGML_DETERMINISTIC": "0"}) == 2
    assert not (tmp_path / "unpadded").exists() and not (tmp_path / "no-determinism").exists()
