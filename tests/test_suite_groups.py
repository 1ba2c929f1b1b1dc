"""The suite's own scheduling: the tests of a module-scoped fixture (and the Slurm tests) share
one xdist worker, so an expensive fixture (the reference engine's runs, a Slurm cluster) is built
once, not once per worker. conftest.py marks them with xdist_group; xdist reads the marks in its
own pytest_collection_modifyitems, so conftest's must run first (tryfirst). When the decorator
slid onto a helper the marks came too late: test_reference_engine's seven torch runs were built
on three workers of the idle suite (~30 s each)."""

from __future__ import annotations

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
