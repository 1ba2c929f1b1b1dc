"""The B3.67 panel: per-seed verdicts filling in as pairs are judged, and the first failure."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static

from analysis.equivalence import FAIL_EQUIV
from console.panel import KindPanel
from console.widgets.live_table import LiveTable
from console.widgets.text import TONE_STYLES, clean, number, plain
from runners.events import Event, RunFinished, RunStarted
from runners.kinds.equivalence import KIND, PAIR_KEYS, PairUnjudged, PairVerdict

METRICS = ("max_abs_diff", "p99_abs_diff", "top1_agreement", "cos_sim_mean")


class EquivalenceView:
    """UI-free: the pairs judged so far, and the first failure worth showing."""

    def __init__(self) -> None:
        self.verdicts: dict[tuple[int, int], PairVerdict | PairUnjudged] = {}
        self.changed: dict[tuple[int, int], None] = {}
        self.first_fail: dict[str, Any] | None = None
        self.first_fail_verdict: str | None = None
        self.first_fail_changed = False
        self.planned = 0  # the pairs the run's cells make (its plan), 0 before it is known

    def take(self, event: Event) -> bool:
        if isinstance(event, RunStarted):
            pairs = {
                (str(p["kv_aligned"]), str(p["seed"]))
                for cell in event.cells
                if isinstance(p := cell.get("params"), dict) and set(PAIR_KEYS) <= set(p)
            }
            self.planned = len(pairs)
            return False
        if isinstance(event, PairUnjudged):
            key = (event.kv_aligned, event.seed)
            self.verdicts[key] = event
            self.changed[key] = None
            return True
        if isinstance(event, PairVerdict):
            key = (event.kv_aligned, event.seed)
            self.verdicts[key] = event
            self.changed[key] = None
            # The first failing pair wins; a drift pair's detail is kept only until a real failure.
            if event.first_fail and (
                self.first_fail is None
                or (self.first_fail_verdict != FAIL_EQUIV and event.verdict == FAIL_EQUIV)
            ):
                self.first_fail = dict(event.first_fail)
                self.first_fail.setdefault("seed", event.seed)
                self.first_fail.setdefault("kv_aligned", event.kv_aligned)
                self.first_fail_verdict = event.verdict
                self.first_fail_changed = True
            return True
        if isinstance(event, RunFinished):
            ff = event.summary.get("first_fail") if isinstance(event.summary, dict) else None
            if isinstance(ff, dict) and self.first_fail_verdict != FAIL_EQUIV:
                self.first_fail = dict(ff)
                self.first_fail_verdict = FAIL_EQUIV
                self.first_fail_changed = True
                return True
        return False


def _compared(metrics: dict[str, Any]) -> str:
    """Tokens compared, and where the modes parted ways when they did."""
    count = number(metrics.get("pair_count"))
    split = metrics.get("diverged_at_token")
    return count if split is None else f"{count} (split at {split})"


def row_key(key: tuple[int, int]) -> str:
    return f"kv{key[0]}-seed{key[1]}"


class VerdictTable(LiveTable):
    """One row per (kv_aligned, seed) pair; the verdict word coloured by what it means."""

    COLUMNS = (
        ("kv_aligned", "kv_aligned"),
        ("seed", "seed"),
        *((name, name) for name in METRICS),
        ("pairs", "pair_count"),
        ("ULP / rel", "precision"),
        ("verdict", "verdict"),
    )

    DEFAULT_CSS = """
    VerdictTable { height: auto; max-height: 11; }
    """

    def reserve(self, rows: int) -> None:
        """Take the height of `rows` rows at once (capped by max-height): the rows that come
        in later fill it without moving the widgets below (a move redraws the whole screen)."""
        height = rows + 1  # the header
        if rows and self.styles.height != height:  # type: ignore[comparison-overlap]
            self.styles.height = height

    def cells(self, row: PairVerdict | PairUnjudged) -> tuple[Text, ...]:
        key = (Text(str(row.kv_aligned), justify="right"), Text(str(row.seed), justify="right"))
        if isinstance(row, PairUnjudged):
            blank = [Text("—", justify="right", style="dim") for _ in range(len(METRICS) + 2)]
            return (*key, *blank, plain(f"NOT JUDGED ({row.kind}): {row.reason}", "bold red"))
        metrics = [Text(number(row.metrics.get(name)), justify="right") for name in METRICS]
        p = row.precision or {}
        ulps = p.get("max_abs_diff_ulps")
        precision = f"{number(ulps)} / {number(p.get('max_rel_diff'))}" if p else "—"
        return (
            *key,
            *metrics,
            Text(_compared(row.metrics), justify="right"),
            Text(precision, justify="right"),
            plain(row.verdict, TONE_STYLES[KIND.tone(row.verdict)]),
        )

    def show(self, view: EquivalenceView, changed: list[tuple[int, int]]) -> None:
        with self.updating():
            for key in changed:
                self.upsert(row_key(key), self.cells(view.verdicts[key]))


SIDES = ("prefill", "decode")


def _top5(entries: Any) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, list | tuple) and len(entry) >= 2:
            out.append((clean(entry[0]), number(entry[1])))
        else:
            out.append((clean(entry), ""))
    return out


def _comparison(metric: str) -> str:
    return "must be >=" if metric.endswith("_min") or metric == "top1_agreement" else "must be <="


def render_first_fail(ff: dict[str, Any], verdict: str | None) -> Group:
    """The panel's content; every value from the trace is shown literally (no markup)."""
    metric = clean(ff.get("metric", "?"))
    title = Text.assemble(
        ("kv_aligned=", "dim"),
        clean(ff.get("kv_aligned", "?")),
        ("  seed=", "dim"),
        clean(ff.get("seed", "?")),
        ("  token_idx=", "dim"),
        clean(ff.get("token_idx", "?")),
        ("  token_id=", "dim"),
        clean(ff.get("token_id", "?")),
        ("  ", ""),
        (clean(verdict or ""), "bold red" if verdict == "FAIL_EQUIV" else "bold yellow"),
    )
    if metric == "token_id":
        ids = ff.get("token_ids") if isinstance(ff.get("token_ids"), dict) else {}
        failing = Text.assemble(
            ("token_id", "bold"),
            ": the modes wrote different tokens: prefill ",
            (clean(ids.get("prefill", "?")), "bold"),
            ", decode ",
            (clean(ids.get("decode", "?")), "bold red"),
            (" (kv_aligned=1 must produce the same tokens)", "dim"),
        )
    else:
        failing = Text.assemble(
            (metric, "bold"),
            " = ",
            (number(ff.get("value")), "bold red"),
            ("  threshold ", "dim"),
            number(ff.get("threshold")),
            (f" ({_comparison(metric)})", "dim"),
        )
    top5 = ff.get("top5") if isinstance(ff.get("top5"), dict) else {}
    sides = {side: _top5(top5.get(side)) for side in SIDES}
    table = Table(box=None, padding=(0, 2, 0, 0), show_edge=False, header_style="bold")
    table.add_column("rank", justify="right")
    for side in SIDES:
        table.add_column(f"{side} id", justify="right")
        table.add_column(f"{side} logit", justify="right")
    for rank in range(max(len(sides["prefill"]), len(sides["decode"]), 0)):
        row: list[Text] = [Text(str(rank + 1))]
        pre = sides["prefill"][rank] if rank < len(sides["prefill"]) else ("", "")
        dec = sides["decode"][rank] if rank < len(sides["decode"]) else ("", "")
        differ = pre[0] != dec[0]
        for side_id, logit in (pre, dec):
            row.append(Text(side_id, style="bold red" if differ else ""))
            row.append(Text(logit))
        table.add_row(*row)
    parts: list[Any] = [title, failing, table]
    where = ff.get("where") if isinstance(ff.get("where"), dict) else {}
    for side in SIDES:
        if where.get(side):
            parts.append(Text.assemble((f"{side:>7}: ", "dim"), plain(where[side])))
    if ff.get("note"):
        parts.append(Text.assemble(("note: ", "dim"), plain(ff["note"])))
    return Group(*parts)


class FirstFailPanel(Static):
    """Hidden until a pair fails; then shows the first failure the run met."""

    DEFAULT_CSS = """
    FirstFailPanel {
        border: round $error;
        border-title-color: $error;
        padding: 0 1;
        height: auto;
        max-height: 14;
        display: none;
    }
    FirstFailPanel.-shown { display: block; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)
        self.border_title = "first fail"
        self.first_fail: dict[str, Any] | None = None

    def show(self, first_fail: dict[str, Any] | None, verdict: str | None) -> None:
        self.first_fail = first_fail
        self.set_class(first_fail is not None, "-shown")
        if first_fail is not None:
            self.update(render_first_fail(first_fail, verdict))


class EquivalencePanel(KindPanel):
    """Hidden until the first pair is judged; the first-fail box shows once a pair fails."""

    DEFAULT_CSS = """
    EquivalencePanel { height: auto; display: none; }
    EquivalencePanel.-pairs { display: block; }
    EquivalencePanel > .section-title { text-style: bold; color: $accent; padding: 0 1; }
    """

    kind = "equivalence"

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view = EquivalenceView()

    def compose(self) -> ComposeResult:
        yield Static("per-seed verdicts", classes="section-title", markup=False)
        yield VerdictTable(id="verdicts")
        yield FirstFailPanel(id="first-fail")

    def take(self, event: Event) -> bool:
        return self.view.take(event)

    def redraw(self) -> None:
        view = self.view
        if view.changed:
            changed, view.changed = list(view.changed), {}
            self.add_class("-pairs")
            table = self.query_one("#verdicts", VerdictTable)
            table.reserve(max(view.planned, len(view.verdicts)))
            table.show(view, changed)
        if view.first_fail_changed:
            view.first_fail_changed = False
            self.add_class("-pairs")
            self.query_one("#first-fail", FirstFailPanel).show(
                view.first_fail, view.first_fail_verdict
            )


PANEL = EquivalencePanel
