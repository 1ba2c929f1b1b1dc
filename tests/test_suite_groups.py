"""The suite's own scheduling: the tests of a module-scoped fixture (and the Slurm tests) share
one xdist worker, so an expensive fixture (the reference engine's runs, a Slurm cluster) is built
once, not once per worker. conftest.py marks them with xdist_group; xdist reads the marks in its
own pytest_collection_modifyitems, so conftest's must run first (tryfirst). When the decorator
slid onto a helper the marks came too late: test_reference_engine's seven torch runs were built
on three workers of the idle suite (~30 s each)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import conftest
import pytest


@pytest.fixture(scope="module")
def shared() -> int:
    return 1


def test_conftest_marks_the_groups_before_xdist_reads_them(
    shared: int, request: pytest.FixtureRequest
) -> None:
    hook = conftest.pytest_collection_modifyitems
    assert getattr(hook, "pytest_impl", {}).get("tryfirst") is True
    group = request.node.get_closest_marker("xdist_group")  # `shared` is module-scoped
    assert group is not None and group.args == ("test_suite_groups",) and shared == 1
    if getattr(request.config.option, "loadgroup", False):  # under xdist --dist loadgroup
        assert request.node.nodeid.endswith("@test_suite_groups"), request.node.nodeid


def test_a_worker_runs_the_python_of_a_checkout_that_lies_under_tmp() -> None:
    """scripts/own_tmp_python.sh gives each xdist worker a fresh /tmp; a clone made with
    `mktemp -d` lies under /tmp, and its .venv's python was gone in the worker's namespace
    ('exec: /tmp/tmp.X/.venv/bin/python: not found': no test ran). The checkout is bound back."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("the wrapper needs root and unshare(1)")
    repo = Path(__file__).resolve().parent.parent
    fake = Path(tempfile.mkdtemp(prefix="checkout-", dir="/tmp"))  # not under pytest's root
    try:
        (fake / "scripts").mkdir()
        shutil.copy2(repo / "scripts" / "own_tmp_python.sh", fake / "scripts")
        (fake / ".venv" / "bin").mkdir(parents=True)
        # the interpreter itself, not the venv's link to it: this suite's own checkout may lie
        # under /tmp too, and the wrapper binds back only the checkout it is part of
        (fake / ".venv" / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
        (fake / "here").write_text("the checkout\n")
        done = subprocess.run(
            ["bash", str(fake / "scripts" / "own_tmp_python.sh"), str(fake / ".venv/bin/python"),
             "-c", f"print(open({str(fake / 'here')!r}).read(), end='')"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert (done.returncode, done.stdout) == (0, "the checkout\n"), done.stderr
    finally:
        shutil.rmtree(fake)
