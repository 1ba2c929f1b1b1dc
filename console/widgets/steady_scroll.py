"""Scrolling widgets whose growing content does not re-lay the screen out.

A Log or DataTable that grows sets its virtual (scrollable) size, which Textual treats as a
layout change: the whole screen is arranged again and every widget whose map entry changed is
redrawn whole (profiled on bench/bench_console.py: most of each 50-350 ms repaint while a run
streams). A scroll view's outer size depends on its virtual size only where the CSS sizes it by
its content (`auto`); otherwise only its scrollbars follow, and they ask for a layout themselves
when they appear or go.
"""

from __future__ import annotations

from textual.geometry import Size
from textual.reactive import Reactive


class SteadyScroll:
    """Mix into a ScrollView subclass (before it): a change of the virtual size lays the screen
    out again only when the widget's own size follows its content."""

    virtual_size: Reactive[Size] = Reactive(Size(0, 0), layout=False)

    def watch_virtual_size(self, old: Size, new: Size) -> None:
        widget = self  # type: ignore[var-annotated]
        if not widget.is_mounted:  # type: ignore[attr-defined]
            return
        styles = widget.styles  # type: ignore[attr-defined]
        width_auto = styles.width is not None and styles.width.is_auto
        height_auto = styles.height is not None and styles.height.is_auto
        if (width_auto and old.width != new.width) or (height_auto and old.height != new.height):
            widget.refresh(layout=True)  # type: ignore[attr-defined]
        else:
            widget._scroll_update(new)  # type: ignore[attr-defined]
