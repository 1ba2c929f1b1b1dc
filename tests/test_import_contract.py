"""Imports point one way: console -> runners -> analysis (import-linter contracts in
pyproject.toml), the import graph has no cycle, and headless code loads no textual or torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
from patience import patience

ROOT = Path(__file__).resolve().parent.parent

HEADLESS = [
    "analysis.readout",
    "analysis.equivalence",
    "analysis.logits",
    "analysis.equivalence_tree",
    "runners.run",
    "runners.preview",
    "runners.preflight",
    "runners.presets",
    "runners.kinds",
    "runners.kinds.equivalence",
    "runners.kinds.readout",
    "runners.kinds.command",
    "runners.targets.ssh",
    "console.headless",
    "console.cli",
]


@pytest.mark.parametrize("module", HEADLESS)
def test_headless_modules_load_neither_textual_nor_torch(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "bad = [m for m in ('textual', 'torch') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} pulled in {out.stdout.strip()}"


def lint_imports(*args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    tool = Path(sys.executable).parent / "lint-imports"
    return subprocess.run(
        [str(tool), "--no-cache", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=patience(300),
    )


def test_the_layer_contracts_hold() -> None:
    """pyproject.toml [tool.importlinter]: analysis imports neither runners nor console;
    runners imports neither console nor textual; only the reference engine imports torch."""
    done = lint_imports()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout, done.stdout


def test_the_contracts_catch_imports_that_break_them(tmp_path: Path) -> None:
    """The same contracts on a tree where analysis imports runners, runners imports textual
    and the console imports torch (the reference engine may: that one is let through)."""
    files = {
        "analysis/low.py": "import runners.low\n",
        "runners/low.py": "from textual.app import App\n",
        "runners/reference/engine.py": "import torch\n",
        "console/low.py": "import torch\n",
    }
    for rel, body in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").write_text("")
        path.write_text(body)
    done = lint_imports(str(ROOT / "pyproject.toml"), cwd=tmp_path, PYTHONPATH=str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    for line in (
        "analysis.low -> runners.low",
        "runners.low -> textual (l.1)",
        "console.low -> torch",
    ):
        assert line in done.stdout, done.stdout
    assert "runners.reference.engine -> torch" not in done.stdout
    assert "0 kept, 3 broken" in done.stdout, done.stdout


def import_cycles() -> list[list[str]]:
    """Every set of modules that import each other round (strongly connected, 2 or more),
    over every import statement, those inside functions and under TYPE_CHECKING included."""
    graph = grimp.build_graph("analysis", "runners", "console", cache_dir=None)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        # Tarjan's algorithm without recursion: (module, the modules it imports left to visit)
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, todo = work[-1]
            step = next(todo, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    work.append((step, iter(sorted(graph.find_modules_directly_imported_by(step)))))
                elif step in stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return cycles


def test_the_import_graph_has_no_cycle() -> None:
    """Type-only imports count too: runners.start names the run by runners.run_core's RunCore,
    which neither start nor run is imported by."""
    assert import_cycles() == []


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    """A two-module cycle and a three-module one, in a package of its own."""
    pkg = tmp_path / "analysis"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from analysis import b\n")
    (pkg / "b.py").write_text("def f():\n    from analysis import a\n")
    (pkg / "c.py").write_text("import analysis.d\n")
    (pkg / "d.py").write_text("import analysis.e\n")
    (pkg / "e.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import analysis.c\n"
    )
    for other in ("runners", "console"):
        (tmp_path / other).mkdir()
        (tmp_path / other / "__init__.py").write_text("")
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]); "
        "from test_import_contract import import_cycles; print(json.dumps(import_cycles()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), str(ROOT / "tests")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=patience(120),
    )
    assert done.returncode == 0, done.stderr
    assert sorted(json.loads(done.stdout)) == [
        ["analysis.a", "analysis.b"],
        ["analysis.c", "analysis.d", "analysis.e"],
    ]
