"""Builds tracedeck with its shipped presets inside the package (pyproject.toml has the rest).

The presets live in presets/ at the top of the checkout, where operators and tests find them;
a wheel (and `pip install .`) carries them as runners/shipped_presets/, which
runners.presets.shipped_dir() finds when there is no checkout around the package.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PRESETS = HERE / "presets"
PACKAGED = Path("runners") / "shipped_presets"


class BuildWithPresets(build_py):
    """build_py, then presets/ (TOML files and samples) copied into the built package."""

    def run(self) -> None:
        super().run()
        if not PRESETS.is_dir():
            return
        dest = Path(self.build_lib) / PACKAGED
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(PRESETS, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        dest = Path(self.build_lib) / PACKAGED
        outputs += [str(dest / p.relative_to(PRESETS)) for p in PRESETS.rglob("*") if p.is_file()]
        return outputs


setup(cmdclass={"build_py": BuildWithPresets})
