"""The DSA panel: counters, block-coverage histograms and per-layer bars as records arrive;
`d` opens the detail screen (filters, the current request's heat map, hot blocks, serving).

All aggregation happens in analysis.dsa_live (folded from the trace digests by TraceBook);
the widgets only draw the numbers on the drain tick.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any

import numpy as np
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Log, Static

from analysis.dsa_live import HIST, LiveAgg
from console.heap import freeze_startup, thaw_all
from console.panel import KindPanel
from console.widgets.dsa_charts import ColumnHistogram, HeatMap, LayerBars
from console.widgets.dsa_data_tabs import DsaDataTabs
from console.widgets.steady import SteadyStatic
from console.widgets.text import clean, plain
from runners.events import Event, RunFinished, RunStarted, TraceBatch
from runners.kinds.dsa_trace import DsaPrinter, TraceBook

RATE_S = 2.0
MIN_RATE_S = 0.5
CHARTS_EVERY_S = 0.25
# (bins, title, axis labels, cells per bin); a title and its n= fit the panel's fifth of 120
CHARTS = (
    ("touched", "touched ratio", ("0", "1"), 1),
    ("unique_blocks", "unique blocks", ("0", "4K+"), 1),
    ("offsets", "offsets", ("0", "128K+"), 1),
    ("tokens_per_block", "tokens/block", ("1", "bs"), 1),
    ("prefix", "prefix ∩ ratio", ("0", "1"), 1),
)
# What a chart's x axis is: its unit and how its bins are laid out (analysis.dsa_live's HIST).
# What the panel draws in turns while records stream in: its histograms, then the layer bars.
CHART_PARTS = (*(key for key, _, _, _ in CHARTS), "layers")
SCALES = {
    "touched": "ratio",
    "unique_blocks": "log2 blocks",
    "offsets": "log2 pos",
    "tokens_per_block": "tokens",
    "prefix": "ratio",
}


def _short(n: float) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{int(n // size)}{unit}"
    return f"{n:g}"


def bin_edges(key: str, index: int) -> tuple[str, str]:
    """The low and high edge of one histogram bin, as the x axis labels them."""
    last = HIST[key] - 1
    if key in ("touched", "prefix"):
        return f"{index * 0.05:.2g}", f"{(index + 1) * 0.05:.2g}"
    if key in ("unique_blocks", "offsets"):  # bin 0 is 0; bin k holds [2^(k-1), 2^k)
        low = "0" if index == 0 else _short(1 << (index - 1))
        high = (
            "1"
            if index == 0
            else f"{_short(1 << (index - 1))}+"
            if index == last
            else (f"<{_short(1 << index)}")
        )
        return low, high
    # tokens_per_block: 16 bins over 1..bs
    return ("1" if index == 0 else f"{index}/16bs"), (
        "bs" if index == last else f"{index + 1}/16bs"
    )


def trimmed(key: str, values: list[float]) -> tuple[list[float], tuple[str, str] | None]:
    """The bins from the first to the last that hold a record (the axis scaled to the data: a
    small run's 64 blocks are not one column at the left of 1..4K+), with their edges; all
    bins and the chart's own labels while nothing is there."""
    held = [i for i, v in enumerate(values) if v]
    if not held:
        return values, None
    lo, hi = held[0], held[-1]
    return values[lo : hi + 1], (bin_edges(key, lo)[0], bin_edges(key, hi)[1])


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


def counters(book: TraceBook, rate: float | None, finished: bool = False) -> Text:
    """Records, requests and how many of them are done (all once the run ended: the last
    request is only "going on" while the run is), the newest record, the rate."""
    t = book.totals()
    last = book.last
    text = Text()
    done = t["requests"] if finished else max(0, t["requests"] - 1)
    shown_rate = "—" if rate is None else f"{rate:,.0f} rec/s"
    for label, value, style in (
        ("records ", t["records"], "bold"),
        ("  requests ", t["requests"], ""),
        ("  done ", done, ""),
        ("  now ", f"r{last.get('request', '-')} step {last.get('step', '-')}", "cyan"),
        ("  shards ", t["shards"], ""),
        ("  invalid ", t["invalid"], "bold red" if t["invalid"] else "green"),
        ("  rate ", shown_rate, ""),
    ):
        text.append(label, style="dim")
        text.append(str(value), style=style)
    return text


def first_fail_text(book: TraceBook, short: bool = False) -> Text:
    """The first invalid record: in full (detail screen), or on one line where it was, which
    record and the field first (panel; the message's path is shortened to the file name)."""
    first = book.first_fail()
    if first is None:
        return Text("no invalid record", style="green")
    text = Text("FIRST INVALID RECORD  ", style="bold red")
    if not short:
        text.append_text(plain(first.get("message", "")))
        return text
    where = str(first.get("file", "")).rsplit("/", 1)[-1]
    if first.get("line"):
        where += f":{first['line']}"
    text.append(clean(where), style="bold")
    if first.get("request") is not None:
        text.append(f"  request {first['request']} layer {first['layer']} step {first['step']}")
    text.append(f"  {clean(str(first.get('field', '')))}: ", style="bold")
    text.append(f"expected {clean(str(first.get('expected', '')))}, found ")
    text.append(clean(str(first.get("found", ""))))
    text.no_wrap = True
    text.overflow = "ellipsis"
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
        self._seen: deque[tuple[float, int]] = deque()  # (event time, records), last RATE_S
        self._charts_at = 0.0  # when the detail screen was last drawn (monotonic)
        self._folded = 0  # trace batches folded, and how many the charts were last behind
        self._charted = 0
        self._stale: dict[str, None] = {}  # charts not yet drawn from the newest batches
        self._charts_shown = False

    def compose(self) -> ComposeResult:
        yield SteadyStatic("", id="dsa-counters", markup=False)
        with Horizontal(id="dsa-charts"):
            for key, title, labels, _ in CHARTS:
                yield ColumnHistogram(title, labels, id=f"dsa-h-{key}")
        yield LayerBars("", id="dsa-layers", markup=False)
        yield SteadyStatic("", id="dsa-first", markup=False)

    def take(self, event: Event) -> bool:
        if isinstance(event, RunStarted):
            self.header = event
            return False
        if isinstance(event, RunFinished):
            self.finished = event
            return True
        if not (isinstance(event, TraceBatch) and self.book.apply(event)):
            return False
        self._folded += 1
        seen = self._seen
        seen.append((event.t, self.book.totals()["records"]))
        while len(seen) > 2 and seen[1][0] <= event.t - RATE_S:
            seen.popleft()
        return True

    def rate(self) -> float | None:
        """Records per second of the trace, over the last RATE_S seconds of its events' own
        times (so a replay shows the rate the run had); None while less than MIN_RATE_S is
        measured (a new shard's backlog arrives within a millisecond: that is no rate)."""
        seen = self._seen
        if self.finished is not None:
            return None
        if len(seen) < 2 or seen[-1][0] - seen[0][0] < MIN_RATE_S:
            return None
        return (seen[-1][1] - seen[0][1]) / (seen[-1][0] - seen[0][0])

    def redraw(self) -> None:
        """Counters on every tick; the charts one at a time while records stream in (each
        redraw of one makes thousands of render objects: all of them in one tick at 20,000
        records/s cost the screen its ticks), all at once when the run has finished; the
        detail screen at most CHARTS_EVERY_S apart. The last state is always drawn."""
        if self.book.streams:
            self.add_class("-live")
        self.query_one("#dsa-counters", SteadyStatic).show_text(
            counters(self.book, self.rate(), self.finished is not None)
        )
        self.query_one("#dsa-first", SteadyStatic).show_text(first_fail_text(self.book, short=True))
        if self._folded != self._charted:  # records came: every chart is behind
            self._charted = self._folded
            self._stale = dict.fromkeys(CHART_PARTS)
        if self.finished is not None or not self._charts_shown:
            # the first time all at once: their first draw sizes them (a layout, shared with
            # the panel's own appearing), later draws keep their size
            self._charts_shown = True
            self.draw_charts()
        elif self._stale:
            self.draw_charts(next(iter(self._stale)))
        if self._stale:
            self._dirty = True  # the next tick draws the next chart
        now = time.monotonic()
        if self.detail_screen is not None and self.detail_screen.is_mounted:
            if now - self._charts_at >= CHARTS_EVERY_S or self.finished is not None:
                self._charts_at = now
                self.detail_screen.redraw()
            else:
                self._dirty = True

    def draw_charts(self, part: str | None = None) -> None:
        """Draw one chart (a CHARTS key, or "layers"), or all of them."""
        parts = CHART_PARTS if part is None else (part,)
        for name in parts:
            self._stale.pop(name, None)
        keys = [key for key in parts if key != "layers"]
        if keys:
            draw_charts(self, self.view, "dsa-h-", keys)
        if "layers" in parts:
            layer = self.view.filter[1] if self.view.filter[0] == "layer" else None
            self.query_one("#dsa-layers", LayerBars).show(self.view.live().layer_means(), layer)

    def status(self) -> str:
        t = self.book.totals()
        if not t["records"]:
            return ""
        return f"dsa: {t['records']} records, {t['requests']} requests, {t['invalid']} invalid (d: details)"

    def detail(self) -> Screen[None]:
        self.detail_screen = DsaDetail(self)
        return self.detail_screen


def draw_charts(host: Any, view: DsaView, prefix: str, keys: list[str] | None = None) -> None:
    vec = view.vector()
    for key, _, _, width in CHARTS:
        if keys is not None and key not in keys:
            continue
        values, labels = trimmed(key, LiveAgg.hist(vec, key).tolist())
        # fewer bins are drawn wider, so a few bins still read as a chart
        wide = max(width, 20 // max(1, len(values)))
        host.query_one(f"#{prefix}{key}", ColumnHistogram).show(values, wide, labels, SCALES[key])


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
            yield DsaDataTabs(lambda: list(self.panel.book.streams), self.panel.book.topk)
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
        self.query_one("#dd-counters", Static).update(
            counters(panel.book, panel.rate(), panel.finished is not None)
        )
        draw_charts(self, view, "dd-h-")
        live = view.live()
        layer = view.filter[1] if view.filter[0] == "layer" else None
        self.query_one("#dd-layers", LayerBars).show(live.layer_means(), layer)
        heat, name, first = heat_for(view.filter, live)
        self.query_one("#dd-heat", HeatMap).show(
            heat, live.heat_width, live.heat_prefix, name, first
        )
        self.query_one("#dd-side", Static).update(side_text(panel.book, live))
        self.query_one("#dd-first", Static).update(first_fail_text(panel.book))

    def action_filter(self, kind: str) -> None:
        self.panel.view.cycle(kind)
        self.redraw()
        self.panel.draw_charts()

    def action_close(self) -> None:
        self.panel.detail_screen = None
        self.dismiss(None)


def heat_for(chosen: tuple[str, int | None], live: LiveAgg) -> tuple[list[list[int]], str, int]:
    """The heat map's rows, title and first layer under the filter: a layer filter keeps that
    layer's row; a request filter names a request whose map is not kept rather than showing
    another one's (only the newest request's map is kept)."""
    heat = live.heat.tolist()
    request = live.heat_request
    kind, value = chosen
    if kind == "request" and value != request:
        return [], f"request {value}: no heat map kept (only the newest, request {request})", 0
    if kind == "layer" and value is not None:
        rows = heat[value : value + 1]
        return rows, f"request {request}, layer {value}: records touching each block", value
    return heat, f"request {request}: records touching each (layer, block)", 0


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


# -- tracedeck watch DIR on a terminal ------------------------------------------------------------

WATCH_BYTES = 1 << 20  # a batch of ~100 records of 2048 positions: ~10 ms to judge
WATCH_BUDGET_S = 0.035  # per tick, digests are folded for at most this long


class DsaWatchScreen(Screen[None]):
    """The DSA panel over a trace directory another process writes (`tracedeck watch DIR`).

    The directory is followed and judged in a worker thread (the same watch_dir as the headless
    command); the screen drains its TraceBatch events into the panel on a 15 Hz tick."""

    DEFAULT_CSS = """
    DsaWatchScreen > #watch-title { height: 1; padding: 0 1; background: $panel; }
    DsaWatchScreen > #watch-log { height: 1fr; border-top: solid $primary; }
    """

    BINDINGS = [
        Binding("q", "quit_watch", "Quit"),
        Binding("escape", "quit_watch", "Quit", show=False),
        Binding("d", "details", "Details"),
    ]

    def __init__(
        self,
        spec: str,
        idle_s: float = 0.0,
        topk: int | None = None,
        layers: int | None = None,
        max_bytes: int = WATCH_BYTES,
    ) -> None:
        super().__init__()
        self.spec, self.idle_s, self.dsa_topk, self.dsa_layers = spec, idle_s, topk, layers
        self.max_bytes = max_bytes
        self.buffer: deque[Any] = deque()
        self.panel = DsaPanel(id="kind-panel")
        self.outcome: tuple[str, int] | None = None  # (verdict or error, exit code) at the end
        self.ticks: list[tuple[float, float]] = []  # (start, end) of each drain, for the bench
        self.record_ticks = False
        self._stop = threading.Event()
        self._shards: set[str] = set()
        self._first_shown = False

    def compose(self) -> ComposeResult:
        yield Static("", id="watch-title", markup=False)
        yield self.panel
        yield Log(id="watch-log", highlight=False)
        yield Footer()

    def on_mount(self) -> None:
        self.panel.add_class("-live")
        self._title()
        self.set_interval(1 / 15, self.drain)
        self.run_worker(self._follow, thread=True, group="watch", exit_on_error=False)

    def _follow(self) -> None:
        """The worker thread: follow and judge until idle, an error, or the operator quits.

        (A judging process of its own was tried: on 2 cores shared with the writer it kept the
        screen no better, bench/bench_dsa_console.py --mode watch|backlog.)"""
        from runners.exits import EXIT_FAIL, EXIT_INFRA, EXIT_PASS, EXIT_USAGE
        from runners.kinds.dsa_trace import TRACE_OK, watch_dir

        try:
            result = asyncio.run(
                watch_dir(
                    self.spec,
                    self.buffer.append,
                    self.idle_s,
                    topk=self.dsa_topk,
                    layers=self.dsa_layers,
                    max_bytes=self.max_bytes,
                    stop=self._stop.is_set,
                    say=lambda text: self.buffer.append(("note", text, 0)),
                    note=lambda text: self.buffer.append(("note", text, 0)),
                )
            )
        except (ValueError, FileNotFoundError) as exc:
            self.buffer.append(("error", str(exc), EXIT_USAGE))
            return
        except Exception as exc:  # a connection lost, a target that fails: shown, not raised
            self.buffer.append(("error", f"{type(exc).__name__}: {exc}", EXIT_INFRA))
            return
        if not self._stop.is_set():
            code = EXIT_PASS if result["verdict"] == TRACE_OK else EXIT_FAIL
            self.buffer.append(
                RunFinished(verdict=result["verdict"], exit_code=code, summary=result)
            )

    def drain(self) -> None:
        started = time.perf_counter()
        deadline = started + WATCH_BUDGET_S
        log = self.query_one("#watch-log", Log)
        buffer = self.buffer
        while buffer and time.perf_counter() < deadline:
            item = buffer.popleft()
            if isinstance(item, tuple):
                what, message, code = item
                if what == "note":  # e.g. waiting for the directory to appear
                    log.write_line(f"tracedeck: {clean(message)}")
                    continue
                self.outcome = (f"stopped: {message}", code)
                log.write_line(f"tracedeck: {clean(message)}")
                continue
            self.panel.fold(item)
            if isinstance(item, TraceBatch):
                self._note(item, log)
            elif isinstance(item, RunFinished):
                self.outcome = (f"{item.verdict} (exit {item.exit_code})", item.exit_code)
                for line in DsaPrinter().final(item):
                    log.write_line(clean(line))
                log.write_line(f"RESULT: {clean(item.verdict)}")
        self.panel.show_changes()
        self._title()
        if self.record_ticks:
            self.ticks.append((started, time.perf_counter()))

    def _note(self, event: TraceBatch, log: Log) -> None:
        name = event.file.rsplit("/", 1)[-1]
        if event.file not in self._shards and event.file.endswith(".jsonl"):
            self._shards.add(event.file)
            log.write_line(f"following {clean(name)}")
        first = self.panel.book.first_fail()
        if first is not None and not self._first_shown:
            self._first_shown = True
            log.write_line(f"FIRST INVALID RECORD {clean(first.get('message', ''))}")

    def _title(self) -> None:
        text = Text("tracedeck watch ", style="bold")
        text.append(clean(self.spec))
        if self.outcome is None:
            text.append("  following (q: quit, d: details)", style="cyan")
        else:
            word, code = self.outcome
            text.append(f"  {clean(word)}", style="bold green" if code == 0 else "bold red")
        self.query_one("#watch-title", Static).update(text)

    def action_details(self) -> None:
        self.app.push_screen(self.panel.detail())

    def action_quit_watch(self) -> None:
        self._stop.set()
        code = self.outcome[1] if self.outcome is not None else 0
        self.app.exit(code, return_code=code)


class DsaWatchApp(App[int]):
    """`tracedeck watch DIR` on a terminal."""

    TITLE = "tracedeck watch"
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, screen: DsaWatchScreen) -> None:
        super().__init__()
        self.watch_screen = screen

    def on_mount(self) -> None:
        freeze_startup()
        self.push_screen(self.watch_screen)

    def on_unmount(self) -> None:
        thaw_all()


def watch(args: Any) -> int:
    """The console view of `tracedeck watch` (console.cli opens it on a terminal): the exit
    code is the verdict's once the watch ended (--idle), 2 or 3 after an error, else 0."""
    screen = DsaWatchScreen(
        args.dir, args.idle, topk=getattr(args, "dsa_topk", None), layers=args.dsa_layers
    )
    app = DsaWatchApp(screen)
    app.run()
    return app.return_code or 0
