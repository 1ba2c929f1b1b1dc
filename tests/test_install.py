"""`pip install .` into a fresh venv, used outside the checkout: the presets come with the
package (runners/shipped_presets) and the smoke preset runs, shipping the installed engine.

Offline: the venv sees this suite's packages (torch, textual, setuptools, pip) and builds
without isolation or an index. Slow-marked (a build, a venv and a run: about 20 s)."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from patience import patience
from runhelp import ROOT

SOURCES = ("pyproject.toml", "setup.py", "README.md", "console", "runners", "analysis", "presets")


def venv_with_suite_packages(where: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(where)],
        check=True,
    )
    python = where / "bin" / "python"
    if sys.prefix != sys.base_prefix:
        # The suite itself runs in a venv: --system-site-packages sees the base interpreter's
        # packages only, so name this venv's site-packages too (a path: its .pth files, the
        # editable tracedeck among them, stay out).
        purelib = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        Path(purelib, "_suite_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return where / "bin"


@pytest.mark.slow
def test_pip_install_outside_the_checkout_lists_and_runs_the_smoke(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: the build's files stay out of the checkout
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "shipped_presets", "*.egg-info")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=ignore)
        else:
            shutil.copy2(source, src / name)
    bin_dir = venv_with_suite_packages(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=str(tmp_path / "home"), TRACEDECK_HOME=str(tmp_path / "td"))
    (tmp_path / "home").mkdir()
    install = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-deps",
         "--no-build-isolation", "--no-index", str(src)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=patience(300),
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    elsewhere = tmp_path / "elsewhere"  # no checkout here, nor above
    elsewhere.mkdir()
    tracedeck = str(bin_dir / "tracedeck")

    listed = subprocess.run(
        [tracedeck, "presets"],
        capture_output=True,
        text=True,
        env=env,
        cwd=elsewhere,
        timeout=patience(60),
    )
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines()[1:]]
    assert {"b3_67_smoke", "hello_command", "dsa_smoke", "kv_invariance_smoke"} <= set(names)
    where = subprocess.run(
        [str(bin_dir / "python"), "-c",
         "import runners.presets as p; print(p.SHIPPED_DIR); import console; print(console.__file__)"],
        capture_output=True, text=True, env=env, cwd=elsewhere, timeout=patience(60),
    )  # fmt: skip
    shipped, console_file = where.stdout.split()
    assert shipped.startswith(str(tmp_path / "venv")) and shipped.endswith(
        "runners/shipped_presets"
    )
    assert console_file.startswith(str(tmp_path / "venv"))

    run = subprocess.run(
        [tracedeck, "run", "b3_67_smoke", "--set", "matrix.seed=[0]",
         "--set", f'target.runs="{tmp_path}/remote"', "--set", f'target.lock="{tmp_path}/lock"'],
        capture_output=True, text=True, env=env, cwd=elsewhere, timeout=patience(300),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "RESULT: PASS_GUARDRAIL (exit 0)" in run.stdout
    [record] = list((tmp_path / "td" / "runs").glob("**/run.json"))
    remote = Path(json.loads(record.read_text())["remote_dir"])
    shipped_engine = remote / "pkg" / "runners" / "reference" / "equivalence.py"
    installed_engine = Path(console_file).parent.parent / "runners" / "reference" / "equivalence.py"
    assert shipped_engine.read_bytes() == installed_engine.read_bytes()
