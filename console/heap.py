"""The console's heap policy, set once when an app is up.

What exists then (the app, its screens, the modules: ~100k objects) lives as long as the app;
frozen, it is kept out of the garbage collector's sight, so a full collection walks only what
came since. Measured with the DSA panel at 20,000 records/s: full collections of 50-80 ms, each
a stalled tick, become 6-8 ms.
"""

from __future__ import annotations

import gc


def freeze_startup() -> None:
    gc.collect()
    gc.freeze()


def freeze_screen() -> None:
    """A screen is up (a run screen: its widgets live as long as it does): out of sight too, so
    a full collection while a run streams walks only what came since (each one a stalled frame:
    70-100 ms with the screen's widgets, table caches and model in sight)."""
    gc.freeze()


def thaw_screen() -> None:
    """The screen has gone: what was frozen with it can be collected (its widgets refer to one
    another: only the collector frees them); the app's own objects are frozen again."""
    gc.unfreeze()
    freeze_startup()
