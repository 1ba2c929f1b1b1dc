"""Imports point one way: console -> runners -> analysis; headless code loads no textual or torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

HEADLESS = [
    "analysis.readout",
    "analysis.equivalence",
    "analysis.logits",
    "analysis.equivalence_tree",
    "runners.run",
    "runners.dryrun",
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


def test_analysis_imports_neither_runners_nor_console() -> None:
    for path in (ROOT / "analysis").glob("*.py"):
        text = path.read_text()
        for banned in ("import runners", "from runners", "import console", "from console"):
            assert banned not in text, f"{path.name} has {banned!r}"


def test_runners_never_import_textual_or_console() -> None:
    for path in (ROOT / "runners").rglob("*.py"):
        text = path.read_text()
        for banned in ("textual", "from console", "import console"):
            assert banned not in text, f"{path.relative_to(ROOT)} mentions {banned!r}"


def test_only_the_reference_engine_imports_torch() -> None:
    for folder in ("analysis", "runners", "console"):
        for path in (ROOT / folder).rglob("*.py"):
            if "reference" in path.parts:
                continue
            text = path.read_text()
            assert "import torch" not in text, f"{path.relative_to(ROOT)} imports torch"
