"""Every canary of every shipped preset fails under that preset (issue 20).

A preset whose matrix has an `inject` axis runs the reference engine, whose `--inject` choices
are its canaries: each one must turn that preset's run into a failed verdict (exit 1). The
canaries are read from the engine's own flags, so a new one is tested the day it is added.

A run fails when any of its cells fails, so a failing run over a part of the preset's own
cells proves the whole preset fails: every axis is cut to its first value (the preset's own
value, nothing else changed) except `mode`, the two sides of a B3.67 pair.
"""

from __future__ import annotations

import argparse
import importlib
import re
import tomllib
from pathlib import Path

import pytest
from runhelp import ROOT, cli_env, tracedeck

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)

PAIRED = {"mode"}


def engine_canaries(command: str) -> list[str]:
    """The --inject choices (but "none") of the reference command a preset runs."""
    found = re.search(r"-m runners\.reference (\w+)", command)
    assert found, command
    module = importlib.import_module(f"runners.reference.{found.group(1)}")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    [choices] = [a.choices for a in parser._actions if a.dest == "inject"]
    return [c for c in choices if c != "none"]


def shipped() -> list[tuple[str, str, list[str]]]:
    """(preset, canary, the --set cut) for every canary of every shipped preset."""
    out = []
    for path in sorted((ROOT / "presets").glob("*.toml")):
        data = tomllib.loads(path.read_text())
        matrix = data.get("matrix", {})
        if "inject" not in matrix:
            continue
        assert matrix["inject"] == ["none"], f"{path.name}: ships with a canary on"
        cut = []
        for axis, values in matrix.items():
            if axis != "inject" and axis not in PAIRED and len(values) > 1:
                cut += ["--set", f"matrix.{axis}=[{_toml(values[0])}]"]
        canaries = engine_canaries(data["engine"]["command"])
        assert canaries, f"{path.name}: an inject axis but no canary"
        out += [(path.stem, canary, cut) for canary in canaries]
    return out


def _toml(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


CASES = shipped()


def test_every_engine_with_canaries_has_a_preset_that_runs_them() -> None:
    presets = {p for p, _, _ in CASES}
    assert {"dsa_smoke", "kv_invariance_smoke", "b3_67_smoke", "b3_11_readout"} <= presets
    assert {c for p, c, _ in CASES if p == "dsa_smoke"} >= {"stale_topk", "block_off_by_one"}


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "canary", "cut"), CASES, ids=[f"{p}-{c}" for p, c, _ in CASES])
def test_each_shipped_canary_fails_under_its_preset(
    preset: str, canary: str, cut: list[str], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    done = tracedeck(
        "run", preset, "--out", str(tmp_path / "out"),
        "--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"',
        "--set", f'matrix.inject=["{canary}"]', *cut,
        env=cli_env(home), timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, f"{preset} --inject {canary}:\n{done.stdout}{done.stderr}"
    assert re.search(r"RESULT: .+ \(exit 1\)", done.stdout), done.stdout[-2000:]
