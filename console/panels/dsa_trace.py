"""The DSA panel: counters, block-coverage histograms and per-layer bars as records arrive;
`d` opens the detail screen (filters, the current request's heat map, hot blocks, serving).

All aggregation happens in analysis.dsa_live (folded from the trace digests by TraceBook);
the widgets only draw the numbers on the drain tick.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from analysis.dsa_live import LiveAgg
from console.panel import KindPanel
from console.widgets.dsa_charts import ColumnHistogram, HeatMap, LayerBars
from console.widgets.text import clean, plain
from runners.events import Event, RunFinished, RunStarted, TraceBatch
from runners.kinds.dsa_trace import TraceBook

CHARTS = (
    ("touched", "touched_block_ratio", ("0", "1"), 1),
    ("unique_blocks", "unique_blocks", ("1", "8K+"), 1),
    ("offsets", "offsets (log2)", ("0", "2^18"), 1),
    ("tokens_per_block", "tokens/touched block", ("1", "bs"), 1),
    ("prefix", "prefix ∩ ratio", ("0", "1"), 1),
)


class DsaView:
    """The numbers the panel and detail screen draw, merged over the followed trace dirs."""

    def __init__(self, book: TraceBook) -> None:
        self.book = book
        self.filter: tuple[str, int | None] = ("all", None)

    def live(self) -> LiveAgg:
        streams = list(self.book.streams.values())
        return streams[0].live if len(streams) == 1 else _merged([s.live for s in streams])

    def vector(self) -> np.ndarray:
        kind, value = self.filter
        live = self.live()
        if kind == "request":
            return live.vector(request=value)
        if kind == "layer":
            return live.vector(layer=value)
        return live.vector()

    def cycle(self, kind: str) -> None:
        live = self.live()
        options = sorted(live.requests) if kind == "request" else sorted(live.layers)
        if kind == "all" or not options:
            self.filter = ("all", None)
            return
        current = self.filter[1] if self.filter[0] == kind else None
        later = [o for o in options if current is None or o > current]
        self.filter = (kind, later[0] if later else options[0])

    def label(self) -> str:
        kind, value = self.filter
        return "all records" if kind == "all" else f"{kind} {value} only"


def _merged(lives: list[LiveAgg]) -> LiveAgg:
    out = LiveAgg()
    for live in lives:
        out.merge(live)
    return out


def counters(book: TraceBook, rate: float) -> Text:
    t = book.totals()
    last = book.last
    text = Text()
    for label, value, style in (
        ("records ", t["records"], "bold"),
        ("  requests ", t["requests"], ""),
        ("  done ", max(0, t["requests"] - 1), ""),
        ("  now ", f"r{last.get('request', '-')} step {last.get('step', '-')}", "cyan"),
        ("  shards ", t["shards"], ""),
        ("  invalid ", t["invalid"], "bold red" if t["invalid"] else "green"),
        ("  rate ", f"{rate:,.0f} rec/s", ""),
    ):
        text.append(label, style="dim")
        text.append(str(value), style=style)
    return text


def first_fail_text(book: TraceBook) -> Text:
    first = book.first_fail()
    if first is None:
        return Text("no invalid record", style="green")
    text = Text("FIRST INVALID RECORD  ", style="bold red")
    text.append_text(plain(first.get("message", "")))
    return text


class DsaPanel(KindPanel):
    DEFAULT_CSS = """
    DsaPanel { height: auto; max-height: 16; display: none; border-top: solid $primary; }
    DsaPanel.-live { display: block; }
    DsaPanel > #dsa-counters { height: 1; }
    DsaPanel > #dsa-charts { height: 7; }
    DsaPanel > #dsa-first { height: 1; }
    """

    kind = "dsa_trace"

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.book = TraceBook()
        self.view = DsaView(self.book)
        self.finished: RunFinished | None = None
        self.header: Any = None
        self.detail_screen: DsaDetail | None = None
        self._rate = (time.monotonic(), 0, 0.0)  # (when, records then, rate)

    def compose(self) -> ComposeResult:
        yield Static("", id="dsa-counters", markup=False)
        with Horizontal(id="dsa-charts"):
            for key, title, labels, _ in CHARTS:
                yield ColumnHistogram(title, labels, id=f"dsa-h-{key}")
        yield LayerBars("", id="dsa-layers", markup=False)
        yield Static("", id="dsa-first", markup=False)

    def take(self, event: Event) -> bool:
        if isinstance(event, RunStarted):
            self.header = event
            return False
        if isinstance(event, RunFinished):
            self.finished = event
            return True
        return isinstance(event, TraceBatch) and self.book.apply(event)

    def rate(self) -> float:
        when, then, rate = self._rate
        now, records = time.monotonic(), self.book.totals()["records"]
        if now - when >= 1.0:
            rate = (records - then) / (now - when)
            self._rate = (now, records, rate)
        return rate

    def redraw(self) -> None:
        if self.book.streams:
            self.add_class("-live")
        self.query_one("#dsa-counters", Static).update(counters(self.book, self.rate()))
        draw_charts(self, self.view, "dsa-h-")
        layer = self.view.filter[1] if self.view.filter[0] == "layer" else None
        self.query_one("#dsa-layers", LayerBars).show(self.view.live().layer_means(), layer)
        self.query_one("#dsa-first", Static).update(first_fail_text(self.book))
        if self.detail_screen is not None and self.detail_screen.is_mounted:
            self.detail_screen.redraw()

    def status(self) -> str:
        t = self.book.totals()
        if not t["records"]:
            return ""
        return f"dsa: {t['records']} records, {t['requests']} requests, {t['invalid']} invalid (d: details)"

    def detail(self) -> Screen[None]:
        self.detail_screen = DsaDetail(self)
        return self.detail_screen


def draw_charts(host: Any, view: DsaView, prefix: str) -> None:
    vec = view.vector()
    for key, _, _, width in CHARTS:
        host.query_one(f"#{prefix}{key}", ColumnHistogram).show(
            LiveAgg.hist(vec, key).tolist(), width
        )


class DsaDetail(Screen[None]):
    """Histograms under a filter (one request, one layer, all), the current request's layer x
    block heat map with the prefix marked, the hot blocks, serving latency, the first fail."""

    DEFAULT_CSS = """
    DsaDetail > #dd-title { height: 1; padding: 0 1; background: $panel; }
    DsaDetail #dd-charts { height: 8; }
    DsaDetail #dd-bottom { height: auto; }
    DsaDetail #dd-heat { width: 3fr; }
    DsaDetail #dd-side { width: 2fr; padding: 0 1; }
    """

    BINDINGS = [
        Binding("escape", "close", "Back to the run"),
        Binding("r", "filter('request')", "Next request"),
        Binding("l", "filter('layer')", "Next layer"),
        Binding("a", "filter('all')", "All"),
    ]

    def __init__(self, panel: DsaPanel) -> None:
        super().__init__()
        self.panel = panel

    def compose(self) -> ComposeResult:
        yield Static("", id="dd-title", markup=False)
        with VerticalScroll():
            yield Static("", id="dd-counters", markup=False)
            with Horizontal(id="dd-charts"):
                for key, title, labels, _ in CHARTS:
                    yield ColumnHistogram(title, labels, height=5, id=f"dd-h-{key}")
            yield LayerBars("", id="dd-layers", markup=False)
            with Horizontal(id="dd-bottom"):
                yield HeatMap("", id="dd-heat", markup=False)
                yield Static("", id="dd-side", markup=False)
            yield Static("", id="dd-first", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.redraw()

    def redraw(self) -> None:
        panel, view = self.panel, self.panel.view
        title = Text("DSA traces  ", style="bold")
        title.append(clean(getattr(panel.header, "run_id", "") or ""), style="dim")
        title.append(f"  filter: {view.label()}", style="cyan")
        if panel.finished is not None:
            title.append(f"  verdict {clean(panel.finished.verdict)}", style="bold")
        self.query_one("#dd-title", Static).update(title)
        self.query_one("#dd-counters", Static).update(counters(panel.book, panel.rate()))
        draw_charts(self, view, "dd-h-")
        live = view.live()
        layer = view.filter[1] if view.filter[0] == "layer" else None
        self.query_one("#dd-layers", LayerBars).show(live.layer_means(), layer)
        heat = live.heat.tolist()
        name = f"request {live.heat_request}: records touching each (layer, block)"
        self.query_one("#dd-heat", HeatMap).show(heat, live.heat_width, live.heat_prefix, name)
        self.query_one("#dd-side", Static).update(side_text(panel.book, live))
        self.query_one("#dd-first", Static).update(first_fail_text(panel.book))

    def action_filter(self, kind: str) -> None:
        self.panel.view.cycle(kind)
        self.redraw()
        self.panel.redraw()

    def action_close(self) -> None:
        self.panel.detail_screen = None
        self.dismiss(None)


def side_text(book: TraceBook, live: LiveAgg) -> Text:
    text = Text("hot blocks (current request)\n", style="bold")
    text.append(f"{'blocks':>11} {'touches':>8}  prefix\n", style="dim")
    for lo, hi, n, pre in live.hot_blocks(8):
        span = f"{lo}" if lo == hi else f"{lo}-{hi}"
        text.append(f"{span:>11} {n:>8}  {'yes' if pre else 'no'}\n", style="yellow" if pre else "")
    lat = [v for vs in book.latency.values() for v in vs]
    if lat:
        arr = np.sort(np.array(lat))
        pct = {q: float(np.percentile(arr, q)) for q in (50, 95, 99)}
        text.append("\nserving latency_ms (BurstGPT)\n", style="bold")
        text.append(
            f"n={len(arr)} p50={pct[50]:.1f} p95={pct[95]:.1f} p99={pct[99]:.1f} max={arr[-1]:.1f}\n"
        )
    return text


DsaPanel.detail_class = DsaDetail
PANEL = DsaPanel
