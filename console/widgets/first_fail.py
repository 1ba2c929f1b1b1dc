"""The first failing pair in detail: token, failing metric, both sides' top-5, where to look."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from console.widgets.text import clean, number, plain

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
