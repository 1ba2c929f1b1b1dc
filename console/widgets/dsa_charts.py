"""Small block-character charts for the DSA panel: column histograms, per-layer bars, a heat map.

Each widget only draws numbers it is handed (no aggregation here) into one Rich Text; a redraw
is a few hundred characters, so redrawing on every drain tick costs well under a millisecond.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from console.widgets.steady import SteadyStatic

BLOCKS = " ▁▂▃▄▅▆▇█"
SHADES = " ░▒▓█"


def columns(values: Sequence[float], height: int, style: str = "cyan") -> Text:
    """Vertical bars, one column per value, `height` rows of eighth-blocks, scaled to the max."""
    top = max(values, default=0) or 1
    levels = [round(v / top * height * 8) for v in values]
    text = Text()
    for row in range(height, 0, -1):
        floor = (row - 1) * 8
        line = "".join(BLOCKS[max(0, min(8, lv - floor))] for lv in levels)
        text.append(line + "\n", style=style)
    return text


class ColumnHistogram(SteadyStatic):
    """A titled histogram: bins as columns (each bin `width` cells wide), axis labels below."""

    DEFAULT_CSS = """
    ColumnHistogram {
        width: 1fr; height: auto; padding: 0 1 0 0; text-wrap: nowrap; text-overflow: ellipsis;
    }
    """

    def __init__(
        self, title: str, labels: tuple[str, str], *, height: int = 4, id: str | None = None
    ) -> None:
        super().__init__("", id=id, markup=False)
        self.title = title
        self.labels = labels
        self.rows = height

    def show(
        self,
        values: Sequence[float],
        width: int = 1,
        labels: tuple[str, str] | None = None,
        scale: str = "",
    ) -> None:
        """`labels` (the first bin's low edge, the last's high edge) and `scale` (e.g. "log2")
        say what the x axis shows when the caller cut it to the bins that hold data."""
        room = self.content_region.width
        if labels is not None and room > 0:
            # fewer bins than the room (an axis cut to the data) are drawn wider
            width = max(width, room // max(1, len(values)))
        wide = [v for v in values for _ in range(width)]
        total = int(sum(values))
        top = int(max(values, default=0))
        text = Text(f"{self.title}", style="bold")
        text.append(f"  n={total}\n", style="dim")
        # the y scale: the tallest bar's count (bars are scaled to it)
        text.append(f"tallest {top}" + (f", {scale}" if scale else "") + "\n", style="dim")
        text.append_text(columns(wide, self.rows))
        left, right = labels if labels is not None else self.labels
        pad = max(1, len(wide) - len(left) - len(right))
        text.append(f"{left}{' ' * pad}{right}", style="dim")
        text.no_wrap = True
        text.overflow = "ellipsis"
        self.show_text(text)


class LayerBars(SteadyStatic):
    """One bar per layer (mean touched_block_ratio), 61 layers fit in 120 columns."""

    DEFAULT_CSS = """
    LayerBars { height: auto; }
    """

    def show(self, means: Sequence[float], selected: int | None = None) -> None:
        text = Text("mean touched_block_ratio per layer ", style="bold")
        text.append(f"(0..1, {len(means)} layers)\n", style="dim")
        bars = columns([max(0.0, min(1.0, m)) for m in means] + [1.0], 3)
        # drop the scale column (the 1.0 that fixes the scale) from every row
        lines = bars.plain.split("\n")
        for row in lines[:-1]:
            row = row[:-1]
            # one span per run of a style (a span per character made this chart cost more to
            # draw than the rest of the panel)
            if selected is not None and 0 <= selected < len(row):
                text.append(row[:selected], style="green")
                text.append(row[selected], style="bold yellow")
                text.append(row[selected + 1 :], style="green")
            else:
                text.append(row, style="green")
            text.append("\n")
        ticks = "".join(str(i // 10) if i % 10 == 0 else " " for i in range(len(means)))
        text.append(ticks, style="dim")
        self.show_text(text)


class HeatMap(SteadyStatic):
    """Layers down, block columns across: touch counts in shades; the prefix region underlined."""

    DEFAULT_CSS = """
    HeatMap { height: auto; }
    """

    def show(
        self,
        heat: Sequence[Sequence[int]],
        width: int,
        prefix_blocks: int,
        title: str,
        first_layer: int = 0,
    ) -> None:
        """`heat` rows are layers from `first_layer` on (one row: a layer filter)."""
        text = Text(title + "\n", style="bold")
        top = max((max(row, default=0) for row in heat), default=0) or 1
        prefix_cols = -(-prefix_blocks // max(width, 1))
        step = max(1, -(-len(heat) // 16))  # at most 16 rows: layers grouped
        for start in range(0, len(heat), step):
            group = heat[start : start + step]
            cells = [
                max(r[c] for r in group) if c < min(len(r) for r in group) else 0
                for c in range(max(len(r) for r in group))
            ]
            text.append(f"L{first_layer + start:>3} ", style="dim")
            for c, v in enumerate(cells):
                ch = SHADES[min(4, -(-v * 4 // top))] if v else "·"
                text.append(ch, style="magenta underline" if c < prefix_cols else "magenta")
            text.append("\n")
        top_text = f"\n     darkest shade: {top} records" if heat else ""
        text.append(
            f"     block columns of {width} block(s); underlined: prefix ({prefix_blocks} "
            f"blocks){top_text}",
            style="dim",
        )
        self.show_text(text)
