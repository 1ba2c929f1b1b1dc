"""Presets: loading, validation errors that name file and key, --set overrides, quoting."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from runners.kinds import load_preset
from runners.launchers.detached import DetachedLauncher
from runners.plan import build_plan, cell_scripts
from runners.presets import (
    PresetError,
    parse_value,
    preset_files,
    resolve_preset,
)
from runners.targets.local import LocalTarget
from runners.templates import render

BASE = """
[preset]
name = "t"
kind = "command"
description = "test"

[engine]
command = "echo {word} {n}"

[matrix]
word = ["a", "b"]
n = [1, 2, 3]
"""


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_cells_are_the_product_in_key_order(tmp_path: Path) -> None:
    preset = load_preset(write(tmp_path, BASE))
    cells = preset.cells()
    assert len(cells) == preset.cell_count() == 6
    assert [c.params for c in cells[:3]] == [
        {"word": "a", "n": 1},
        {"word": "a", "n": 2},
        {"word": "a", "n": 3},
    ]
    assert preset.section("target")["host"] == "local"  # defaults filled


@pytest.mark.parametrize(
    ("text", "key", "words"),
    [
        (BASE + "\n[bogus]\nx = 1\n", "bogus", "unknown section"),
        (BASE.replace('description = "test"', 'descr = "x"'), "preset.descr", "unknown key"),
        (BASE.replace('name = "t"\n', ""), "preset.name", "missing required key"),
        (BASE.replace('kind = "command"', "kind = 3"), "preset.kind", "expected str"),
        (BASE.replace('kind = "command"', 'kind = "nope"'), "preset.kind", "must be one of"),
        (BASE.replace("n = [1, 2, 3]", "n = []"), "matrix.n", "non-empty list"),
        (BASE.replace("n = [1, 2, 3]", "n = 3"), "matrix.n", "non-empty list"),
        (BASE.replace("{word}", "{wrod}"), "engine.command", "unknown placeholder {wrod}"),
        (BASE + '\n[target]\nreconnect_attempts = "5"\n', "target.reconnect_attempts", "int"),
        (BASE + "\n[target]\nconnect_timeout_s = true\n", "target.connect_timeout_s", "got bool"),
        (BASE + '\n[determinism]\nprofile = "fast"\n', "determinism.profile", "one of"),
        (BASE + '\n[determinism]\nenv = { "A-B" = "1" }\n', "determinism.env.A-B", "environment"),
        (BASE.replace("[matrix]", "[matrix]\npython = [1]"), "matrix.python", "built-in"),
    ],
)
def test_bad_presets_name_file_and_key(tmp_path: Path, text: str, key: str, words: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PresetError) as info:
        load_preset(path)
    message = str(info.value)
    assert message.startswith(str(path))
    assert key in message
    assert words in message


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[preset\nname=")
    with pytest.raises(PresetError, match="not valid TOML"):
        load_preset(path)


def test_overrides_use_toml_values(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    preset = load_preset(path, ["matrix.n=[7]", "target.host=gpu1", "target.reconnect_attempts=2"])
    assert preset.matrix["n"] == [7]
    assert preset.section("target")["host"] == "gpu1"
    assert preset.section("target")["reconnect_attempts"] == 2
    assert preset.cell_count() == 2


def test_override_errors_name_the_assignment(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    with pytest.raises(PresetError, match=r"--set matrix.n=5.*matrix.n.*non-empty list"):
        load_preset(path, ["matrix.n=5"])
    with pytest.raises(PresetError, match="target.nope.*unknown key"):
        load_preset(path, ["target.nope=1"])
    with pytest.raises(PresetError, match="key.path=VALUE"):
        load_preset(path, ["matrix"])


def test_parse_value() -> None:
    assert parse_value("[0, 1]") == [0, 1]
    assert parse_value('"x y"') == "x y"
    assert parse_value("1e-3") == 1e-3
    assert parse_value("true") is True
    assert parse_value("gpu-node-7") == "gpu-node-7"


HOSTILE = [
    "x; touch {marker}",
    "$(touch {marker})",
    "`touch {marker}`",
    "a b 'c' \"d\"",
    "line1\nline2; touch {marker}",
    "&& touch {marker} ||",
    "$HOME ${{IFS}}",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_render_passes_values_as_data(tmp_path: Path, template: str) -> None:
    marker = tmp_path / "pwned"
    value = template.format(marker=marker)
    command = render("printf '%s' {v}", {"v": value})
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    assert out.stdout == value
    assert not marker.exists()


def test_hostile_matrix_value_reaches_the_cell_script_as_data(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = BASE.replace('word = ["a", "b"]', f'word = ["x; touch {marker}", "$(touch {marker})"]')
    text = text.replace(
        "[matrix]", f'[determinism]\nenv = {{ W = "{{word}}; touch {marker}" }}\n\n[matrix]'
    )
    preset = load_preset(write(tmp_path, text))
    plan = build_plan(
        preset,
        run_id="r",
        run_dir=str(tmp_path / "run"),
        workdir=str(tmp_path),
        python="python3",
        date="2026-01-01",
        lock=str(tmp_path / "lock"),
    )
    files = {**cell_scripts(plan), **DetachedLauncher(LocalTarget()).files(plan, {})}
    assert any(name.endswith("cmd.sh") for name in files)
    for name, body in files.items():
        if name.endswith("cmd.sh"):
            script = tmp_path / "cmd.sh"
            script.write_text(body)
            out = subprocess.run(["bash", str(script)], capture_output=True, text=True)
            assert out.returncode == 0, out.stderr
    assert not marker.exists()


def test_shipped_presets_all_load() -> None:
    files = preset_files()
    assert {p.stem for p in files} >= {"hello_command"}
    for path in files:
        load_preset(path)


# -- the lock belongs to the host (issue 9 case 10) -------------------------------------------


def test_every_shipped_preset_aimed_at_a_host_takes_the_same_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runners.config import DEFAULT_LOCK, host_lock

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    locks: dict[str, set[str]] = {}
    for path in preset_files():
        target = load_preset(path).section("target")
        locks.setdefault(target["host"], set()).add(host_lock(target["host"], target["lock"]))
    assert locks and all(found == {DEFAULT_LOCK} for found in locks.values()), locks
    config = tmp_path / "tracedeck" / "config.toml"
    config.parent.mkdir()
    config.write_text('[hosts.mi300x]\nlock = "/tmp/gpu0.lock"\n')
    for name in ("b3_67_greta", "b3_12_readout_greta"):
        target = load_preset(resolve_preset(name)).section("target")
        assert host_lock(target["host"], target["lock"]) == "/tmp/gpu0.lock"
    assert host_lock("mi300x", "/tmp/other.lock") == "/tmp/other.lock"  # named on purpose


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[hosts.x]\nlock = 3\n", "hosts.x.lock: must be a non-empty string"),
        ("[hosts.x]\nlokc = '/tmp/l'\n", "hosts.x.lokc: unknown key"),
        ("[host]\n", "host: unknown section"),
        ("[hosts\n", "not valid TOML"),
    ],
)
def test_a_bad_host_config_names_the_file_and_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, words: str
) -> None:
    from runners.config import ConfigError, host_lock

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    config = tmp_path / "tracedeck" / "config.toml"
    config.parent.mkdir()
    config.write_text(text)
    with pytest.raises(ConfigError) as err:
        host_lock("x")
    assert str(config) in str(err.value) and words in str(err.value)


def test_the_greta_presets_pass_only_what_the_seeds_show() -> None:
    """Issue 9 case 9: no invented flags; seed 001's environment; the open flag is a var."""
    b3_67 = load_preset(resolve_preset("b3_67_greta"))
    command = b3_67.section("engine")["command"]
    for invented in ("--seed", "--dtype", "--prompt-len", "--gen-len", "--logits-out"):
        assert f"{invented} " not in command, invented
    for seed_flag in ("--kv-aligned", "--mode", "--model", "--prompt", "--max-tokens", "--greedy"):
        assert seed_flag in command
    assert "{logits_flag}" in command and b3_67.vars["logits_flag"] == "--logits-out"
    assert b3_67.section("engine")["env"]["GRETA_INT4_WEIGHTS"] == "1"
    assert "GRETA_MAX_SEQ_LEN" in b3_67.section("engine")["env"]
    readout = load_preset(resolve_preset("b3_12_readout_greta"))
    assert readout.section("determinism") == {"profile": "none", "env": {}}
    assert set(readout.section("engine")["env"]) == {
        "GRETA_INT4_WEIGHTS",
        "GRETA_MAX_SEQ_LEN",
        "GRETA_TRACE_EMBED_VERIFY",
        "GRETA_EMBED_LAYOUT",
        "GRETA_TRACE_READOUT",
        "GRETA_TRACE_READOUT_OUT",
    }
    assert "--max-tokens 16 --greedy --debug-decode 4" in readout.section("engine")["command"]


# -- the lock belongs to the host the run goes to (issue 21 item 7) ---------------------------

ELSEWHERE = 'host = "gpu-elsewhere"\n'


def _host_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    config = tmp_path / "xdg" / "tracedeck" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(text)


def test_a_preset_lock_speaks_for_its_own_host_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runners.config import DEFAULT_LOCK, run_lock
    from runners.kinds import load_preset

    _host_config(tmp_path, monkeypatch, '[hosts.gpu-b]\nlock = "/tmp/gpu-b.lock"\n')
    path = tmp_path / "p.toml"
    path.write_text(
        '[preset]\nname = "p"\nkind = "command"\ndescription = "d"\n\n'
        f'[target]\n{ELSEWHERE}lock = "/tmp/elsewhere.lock"\n\n'
        '[engine]\ncommand = "true"\n\n[matrix]\nn = [1]\n'
    )
    preset = load_preset(path)
    assert run_lock("gpu-elsewhere", preset) == "/tmp/elsewhere.lock"  # its own host
    assert run_lock("gpu-b", preset) == "/tmp/gpu-b.lock"  # --target gpu-b: gpu-b's lock
    assert run_lock("gpu-c", preset) == DEFAULT_LOCK  # a host with no lock configured
    # One host of a fleet: the preset's lock holds when the fleet is the preset's own target.
    assert run_lock("gpu-b", preset, "gpu-b,gpu-c") == "/tmp/gpu-b.lock"
    assert run_lock("gpu-b", preset, "gpu-elsewhere") == "/tmp/elsewhere.lock"
    # --set target.lock is the operator's choice for this run, wherever it goes.
    chosen = load_preset(path, ['target.lock="/tmp/chosen.lock"'])
    assert run_lock("gpu-b", chosen) == "/tmp/chosen.lock"
    # --set target.host makes that host the preset's own.
    moved = load_preset(path, ['target.host="gpu-b"'])
    assert run_lock("gpu-b", moved) == "/tmp/elsewhere.lock"


def test_a_run_sent_to_another_host_takes_that_hosts_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runhelp import LINES_PRESET, cli_env, events, run_dirs, tracedeck

    local_lock = tmp_path / "local.lock"
    _host_config(tmp_path, monkeypatch, f'[hosts.local]\nlock = "{local_lock}"\n')
    preset = tmp_path / "lines.toml"
    text = LINES_PRESET.format(
        runs=tmp_path / "runs", lock=tmp_path / "elsewhere.lock", attempts=1, lines=1, pause=0
    )
    preset.write_text(text.replace("[target]\n", f"[target]\n{ELSEWHERE}"))
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home, XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    plan = tracedeck("plan", str(preset), "--target", "local", env=env)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert str(local_lock) in plan.stdout and "gpu-elsewhere, not this one" in plan.stdout
    done = tracedeck(
        "run", str(preset), "--target", "local", "--out", str(tmp_path / "out"), env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [run_dir] = run_dirs(tmp_path / "out")
    [acquired] = [e for e in events(run_dir) if e["type"] == "lock_acquired"]
    assert acquired["lock"] == str(local_lock)
