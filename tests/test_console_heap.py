"""The console's heap policy (console/heap.py): a run screen's objects are out of the collector's
sight while it is up, and an app that ends leaves nothing frozen behind."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
from test_console import DATA, SIZE, home, out_dir, wait_for, wait_for_banner  # noqa: F401

from console.app import create_app

pytestmark = pytest.mark.e2e


async def test_a_run_screen_is_frozen_while_up_and_an_ended_app_leaves_nothing_frozen(
    home: Path,  # noqa: F811
) -> None:
    gc.unfreeze()  # whatever froze before this test is not this test's to judge
    app = create_app(out_dir=out_dir(home), replay_dir=DATA / "hello_command_run", speed=0)
    async with app.run_test(size=SIZE) as pilot:
        screen = await wait_for_banner(pilot)
        await wait_for(pilot, lambda: gc.get_freeze_count() > 0, 10, "the run screen frozen")
        gone = weakref.ref(screen)
        del screen
    # the app's objects, the run screen's among them, are the collector's again: a process that
    # goes on (this test's, a caller of run_app) gets their memory back
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None
