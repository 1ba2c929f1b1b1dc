"""Run kinds are plug-ins: one registry, every kind checked end to end, a kind added from outside."""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from runhelp import ROOT, cli_env, run_dirs, toy_engine, tracedeck
from test_console import LOADED_S, wait_for, wait_for_screen

import console.panels
import runners.kinds
from console.app import create_app
from console.panel import KindPanel
from console.panels import all_panels, panel_for
from console.screens.run import RunScreen
from runners.kinds import all_kinds, load_preset
from runners.presets import PresetError, resolve_preset

KINDS = sorted(all_kinds())
# Kinds whose smoke runs on the torch-free toy engine (tests/engines/toy.py) here: this test checks
# the kind's run, verdict word and panel; the engine's own numbers are checked on torch elsewhere
# (test_equivalence_runs, test_kv_invariance_runs, test_reference_engine). The other kinds' smokes
# (readout, dsa_trace: no toy) run their torch engine.
TOY_KINDS = {"equivalence", "kv_invariance"}


def isolated(tmp_path: Path) -> list[str]:
    return ["--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"']


def wrong_value(expected: object) -> str:
    """A TOML value of a type the schema entry does not take."""
    types = expected if isinstance(expected, tuple) else (expected,)
    return '"not-this-type"' if str not in types else "[1, 2]"


def test_the_registry_lists_the_shipped_kinds_and_no_problems() -> None:
    assert {"command", "equivalence", "readout"} <= set(KINDS)
    assert runners.kinds.problems() == []
    for name, kind in all_kinds().items():
        assert kind.name == name and kind.judge_class is not None
        assert kind.smoke is not None, f"kind {name} names no smoke preset"


@pytest.mark.parametrize("name", KINDS)
def test_a_kinds_own_sections_are_checked_when_the_preset_loads(name: str) -> None:
    kind = all_kinds()[name]
    assert kind.smoke is not None
    path = resolve_preset(kind.smoke[0])
    preset = load_preset(path, list(kind.smoke[1]))
    assert preset.kind == name
    for section, keys in kind.sections.items():
        for key, (expected, _, _) in keys.items():
            with pytest.raises(PresetError) as err:
                load_preset(path, [*kind.smoke[1], f"{section}.{key}={wrong_value(expected)}"])
            assert f"{section}.{key}" in str(err.value) and str(path) in str(err.value)
    # Another kind's section is not this kind's: refused at load, naming the section.
    for other in all_kinds().values():
        for section in set(other.sections) - set(kind.sections):
            key = next(iter(other.sections[section]))
            with pytest.raises(PresetError, match=f"{section}: a section of {other.name} presets"):
                load_preset(path, [*kind.smoke[1], f"{section}.{key}=1"])


@pytest.mark.slow
@pytest.mark.parametrize("name", KINDS)
async def test_each_kind_runs_headless_and_the_console_shows_its_panel(
    name: str, tmp_path: Path
) -> None:
    kind = all_kinds()[name]
    assert kind.smoke is not None
    preset, overrides = kind.smoke
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "out"
    sets = [a for o in overrides for a in ("--set", o)]
    if name in TOY_KINDS:
        sets += toy_engine(preset)
    done = tracedeck(
        "run", preset, "--out", str(out), *sets, *isolated(tmp_path), env=cli_env(home), timeout=400
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"RESULT: {kind.pass_word} (exit 0)" in done.stdout
    [local_dir] = run_dirs(out)

    app = create_app(out_dir=tmp_path / "td", replay_dir=local_dir, speed=0)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await wait_for_screen(pilot, RunScreen)
        await wait_for(pilot, lambda: screen.model.finished is not None, LOADED_S, "the replay")
        assert type(screen.panel) is type(panel_for(name))
        assert screen.panel.is_mounted
        if name in all_panels():
            what = f"the {name} panel to show after a whole run"
            await wait_for(pilot, lambda: screen.panel.display, LOADED_S, what)


# -- a kind added from outside: a module under another kinds package, and its panel ----------------

# The toy kind is docs/KINDS.md's worked example: its files exactly as the page shows them.
EXAMPLE = re.compile(r"<!-- example: (\S+) -->\n```\w*\n(.*?)\n```", re.S)
TOY = {
    name: body + "\n"
    for name, body in EXAMPLE.findall((ROOT / "docs" / "KINDS.md").read_text(encoding="utf-8"))
}
TOY_KIND, TOY_PANEL, TOY_PRESET = (
    TOY["runners/kinds/toy.py"],
    TOY["console/panels/toy.py"],
    TOY["toy.toml"],
)

NO_JUDGE = '''
"""A kind module that forgot its judge."""
from runners.kind import Kind


class BrokenKind(Kind):
    name = "nojudge"


KIND = BrokenKind()
'''


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory with runners/kinds/toy.py and console/panels/toy.py, merged in for the test."""
    plug = tmp_path / "plug"
    (plug / "runners" / "kinds").mkdir(parents=True)
    (plug / "console" / "panels").mkdir(parents=True)
    (plug / "runners" / "kinds" / "toy.py").write_text(textwrap.dedent(TOY_KIND))
    (plug / "console" / "panels" / "toy.py").write_text(textwrap.dedent(TOY_PANEL))
    kinds_dir, panels_dir = str(plug / "runners" / "kinds"), str(plug / "console" / "panels")
    runners.kinds.__path__.append(kinds_dir)
    console.panels.__path__.append(panels_dir)
    runners.kinds.reload()
    console.panels.reload()
    try:
        yield plug
    finally:
        runners.kinds.__path__.remove(kinds_dir)
        console.panels.__path__.remove(panels_dir)
        runners.kinds.reload()
        console.panels.reload()


def plugin_env(home: Path, plug: Path) -> dict[str, str]:
    return cli_env(home, PYTHONPATH=f"{ROOT}:{plug}")


async def test_a_toy_kind_from_outside_runs_headless_and_in_the_console(
    plugin_dir: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    presets = home / ".config" / "tracedeck" / "presets"
    presets.mkdir(parents=True)
    (presets / "toy.toml").write_text(TOY_PRESET)
    env = plugin_env(home, plugin_dir)

    listed = tracedeck("presets", env=env)
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^toy\s+toy\s+2\s", listed.stdout, re.M), listed.stdout

    bad = tracedeck("run", "toy", "--set", "toy.per_cell=0", env=env)
    assert bad.returncode == 2 and "toy.per_cell: must be at least 1" in bad.stderr

    out = tmp_path / "out"
    done = tracedeck("run", "toy", "--out", str(out), *isolated(tmp_path), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "toy lines from cell 0: 1" in done.stdout and "toy lines from cell 1: 1" in done.stdout
    assert "RESULT: TOY_OK (exit 0)" in done.stdout
    [local_dir] = run_dirs(out)

    replay = tracedeck("replay", str(local_dir), "--headless", env=env)
    assert replay.stdout == done.stdout

    assert "toy" in all_kinds() and "toy" in all_panels()
    app = create_app(out_dir=tmp_path / "td", replay_dir=local_dir, speed=0)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await wait_for_screen(pilot, RunScreen)
        await wait_for(pilot, lambda: screen.model.finished is not None, LOADED_S, "the replay")
        assert type(screen.panel).__name__ == "ToyPanel"

        def toys() -> str:
            return str(screen.panel.query_one("#toys").content)

        await wait_for(pilot, lambda: toys() == "toys seen: 2", LOADED_S, "toys seen: 2")
        banner_widget = screen.query_one("#banner")
        await wait_for(pilot, lambda: str(banner_widget.content), LOADED_S, "the banner")
        banner = str(banner_widget.content)
        assert banner.startswith("TOY_OK") and screen.query_one("#banner").has_class("-pass")


def test_a_kind_without_a_judge_is_never_listed(tmp_path: Path) -> None:
    plug = tmp_path / "plug"
    (plug / "runners" / "kinds").mkdir(parents=True)
    (plug / "runners" / "kinds" / "nojudge.py").write_text(textwrap.dedent(NO_JUDGE))
    home = tmp_path / "home"
    presets = home / ".config" / "tracedeck" / "presets"
    presets.mkdir(parents=True)
    (presets / "broken.toml").write_text(
        TOY_PRESET.replace('kind = "toy"', 'kind = "nojudge"').replace("[toy]\nper_cell = 1", "")
    )
    listed = tracedeck("presets", env=plugin_env(home, plug))
    assert listed.returncode == 2
    assert "runners.kinds.nojudge" in listed.stderr and "has no judge" in listed.stderr
    assert "broken.toml: preset.kind: must be one of" in listed.stderr
    assert "nojudge" not in listed.stdout


# -- the core names no kind ---------------------------------------------------------------------


def core_modules() -> Iterator[Path]:
    for folder in ("runners", "console", "analysis"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(("runners/kinds/", "console/panels/", "runners/reference/")):
                continue  # the kinds' own modules; the engine's commands are its own CLI
            yield path


def test_no_core_module_imports_a_kind_or_compares_a_kind_name() -> None:
    names = set(all_kinds())
    kind_modules = {f"runners.kinds.{n}" for n in names} | {f"console.panels.{n}" for n in names}
    compared = re.compile(
        r"(==|!=)\s*['\"]("
        + "|".join(names)
        + r")['\"]|['\"]("
        + "|".join(names)
        + r")['\"]\s*(==|!=)"
    )
    for path in core_modules():
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                imported = {a.name for a in node.names}
            else:
                continue
            assert not imported & kind_modules, f"{path.relative_to(ROOT)} imports a kind module"
        match = compared.search(text)
        assert match is None, f"{path.relative_to(ROOT)} compares a kind name: {match.group(0)}"


def test_every_panel_belongs_to_a_listed_kind() -> None:
    assert set(all_panels()) <= set(all_kinds())
    assert console.panels.problems() == []
    assert isinstance(panel_for("no-such-kind"), KindPanel)
