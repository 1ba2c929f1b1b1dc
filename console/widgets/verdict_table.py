"""Per-seed equivalence verdicts (B3.67 metrics), one row per (kv_aligned, seed) pair."""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text

from console.run_model import RunModel, verdict_tone
from console.widgets.live_table import LiveTable
from console.widgets.text import TONE_STYLES, number, plain
from runners.events import PairVerdict

METRICS = ("max_abs_diff", "p99_abs_diff", "top1_agreement", "cos_sim_mean")
COLUMNS = (
    ("kv_aligned", "kv_aligned"),
    ("seed", "seed"),
    *((name, name) for name in METRICS),
    ("pairs", "pair_count"),
    ("verdict", "verdict"),
)


def row_key(key: tuple[int, int]) -> str:
    return f"kv{key[0]}-seed{key[1]}"


class VerdictTable(LiveTable):
    COLUMNS = COLUMNS

    """Fills as PairVerdict events arrive; the verdict word is coloured by what it means."""

    DEFAULT_CSS = """
    VerdictTable { height: 1fr; }
    """

    def cells(self, row: PairVerdict) -> tuple[Text, ...]:
        metrics = [Text(number(row.metrics.get(name)), justify="right") for name in METRICS]
        return (
            Text(str(row.kv_aligned), justify="right"),
            Text(str(row.seed), justify="right"),
            *metrics,
            Text(number(row.metrics.get("pair_count")), justify="right"),
            plain(row.verdict, TONE_STYLES[verdict_tone(row.verdict)]),
        )

    def show(self, model: RunModel, changed: Iterable[tuple[int, int]]) -> None:
        for key in changed:
            values = self.cells(model.verdicts[key])
            name = row_key(key)
            self.upsert(name, values)
