"""Widgets whose changing content does not lay the screen out again.

A Log or DataTable that grows sets its virtual (scrollable) size, which Textual treats as a
layout change: the whole screen is arranged again and every widget whose map entry changed is
redrawn whole (profiled on bench/bench_console.py: most of each 50-350 ms repaint while a run
streams). A scroll view's outer size depends on its virtual size only where the CSS sizes it by
its content (`auto`); otherwise only its scrollbars follow, and they ask for a layout themselves
when they appear or go. A Static's update lays the screen out too, unless told its size stays:
SteadyStatic tells it so whenever the new text has the shape of the old (as many lines, as
wide). A Footer rebuilds its keys (tens of ms, each key's styles worked out again) whenever
Textual asks, several times while a run streams even though it offers the same keys:
SteadyFooter rebuilds only when what it offers has changed.
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.geometry import Size
from textual.reactive import Reactive
from textual.widgets import Footer, Static


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


class SteadyStatic(Static):
    """A Static whose `show_text` lays the screen out again only when the text's shape (its
    line count and widest line, what an auto-sized Static's size follows) changes."""

    _shape: tuple[int, int] | None = None

    def show_text(self, text: Text) -> None:
        lines = text.plain.split("\n")
        widest = max(cell_len(line) for line in lines)
        width = self.styles.width
        # A Static as wide as its container is as tall as its lines, unless one wraps.
        wraps = not text.no_wrap and self.styles.text_wrap != "nowrap"
        if (width is not None and width.is_auto) or (wraps and widest > self.content_size.width):
            shape = (len(lines), widest)
        else:
            shape = (len(lines), -1)
        self.update(text, layout=shape != self._shape)
        self._shape = shape


class SteadyFooter(Footer):
    """A Footer that recomposes only when the keys it would show differ from those it shows."""

    _shown: tuple[object, ...] | None = None

    def _offer(self) -> tuple[object, ...]:
        """Everything Footer.compose draws from."""
        app = self.app
        keys = tuple(
            (
                binding.key,
                app.get_key_display(binding),
                binding.description,
                binding.action,
                enabled,
                tooltip,
                binding.tooltip,
                repr(binding.group),
            )
            for (_, binding, enabled, tooltip) in self.screen.active_bindings.values()
            if binding.show
        )
        return (
            self._bindings_ready,
            self.show_command_palette,
            app.ENABLE_COMMAND_PALETTE,
            app.COMMAND_PALETTE_BINDING,
            keys,
        )

    async def recompose(self) -> None:
        if not self.is_attached:
            return await super().recompose()
        offer = self._offer()
        if offer == self._shown:
            return None
        self._shown = offer
        return await super().recompose()
