"""The base of a run kind's panel: what the run screen mounts for the run's kind.

A panel folds the events the run screen drains (only its kind's matter to it), keeps what it
needs in UI-free state, and redraws on the drain tick. Its detail screen, if any, opens with
the run screen's `d` key. Panels live in console/panels/<kind>.py (see console.panels).
"""

from __future__ import annotations

from typing import ClassVar

from textual.containers import Vertical
from textual.screen import Screen

from runners.events import Event


class KindPanel(Vertical):
    """A panel that shows nothing: the fallback for a kind without a panel of its own."""

    DEFAULT_CSS = """
    KindPanel { height: auto; }
    """

    kind: ClassVar[str] = ""
    # The detail screen's class (listed on the help screen), when the panel has one.
    detail_class: ClassVar[type[Screen[None]] | None] = None

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._dirty = False

    def fold(self, event: Event) -> None:
        """Take one event into the panel's state (no redraw here)."""
        if self.take(event):
            self._dirty = True

    def take(self, event: Event) -> bool:
        """Fold an event into UI-free state; True when the panel has something new to show."""
        return False

    def show_changes(self, *, finished: bool = False) -> None:
        """Redraw what changed since the last call (the run screen calls this on its tick)."""
        if self._dirty and self.is_mounted:
            self._dirty = False
            self.redraw()

    def redraw(self) -> None:
        """Draw the panel's state."""

    def status(self) -> str:
        """A few words for the banner while the run goes on ('' for none)."""
        return ""

    def has_detail(self) -> bool:
        return self.detail_class is not None

    def detail(self) -> Screen[None] | None:
        """The kind's detail screen, opened with `d` on the run screen."""
        return None
