"""The console's heap policy, set once when an app is up.

What exists then (the app, its screens, the modules: ~100k objects) lives as long as the app;
frozen, it is kept out of the garbage collector's sight, so a full collection walks only what
came since. Measured with the DSA panel at 20,000 records/s: full collections of 50-80 ms, each
a stalled tick, become 6-8 ms.
"""

from __future__ import annotations

import gc


def freeze_startup() -> None:
    """The app is up: what exists now is out of sight (any garbage of the start with it: bounded,
    and in sight again when the app goes)."""
    gc.freeze()


def freeze_screen() -> None:
    """A screen is up (a run screen: its widgets live as long as it does): out of sight too, so
    a full collection while a run streams walks only what came since (each one a stalled frame:
    70-100 ms with the screen's widgets, table caches and model in sight)."""
    gc.freeze()


def thaw_screen() -> None:
    """A screen goes and the app goes on: what was frozen with the screens before it can be
    collected (their widgets refer to one another: only the collector frees them); the app's own
    objects are frozen again. The screen going is still referred to while it unmounts (its
    workers, timers, the message being handled), so it is freed one thaw later: at most one
    gone screen is kept."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def thaw_all() -> None:
    """The app is going: everything it froze is in the collector's sight again, for whoever
    goes on in this process (a test, a caller of run_app); no collection now: the app's exit
    would wait for one that walks the whole heap (the process's, not only the app's)."""
    gc.unfreeze()
