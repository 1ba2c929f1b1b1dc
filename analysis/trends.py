"""Trends of a preset's runs: per item, the last N verdicts and headline metrics, and drift (a
metric that got worse run after run over the last K runs while the item still passes).

Pure: it reads RunSides (analysis.run_compare), oldest first, and returns what to show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from analysis.run_compare import DRIFT, FAIL, PASS, RunSide

# The metrics a trend shows per item class, and which way is worse.
HEADLINE: dict[str, tuple[str, ...]] = {
    "pair": ("max_abs_diff", "p99_abs_diff", "top1_agreement", "cos_sim_mean"),
    "cell": ("max_ulp", "differing", "max_abs_diff"),
    "prompt": ("prefill_last_gap", "decode0_gap"),
    "trace": ("invalid", "unique_blocks.p50", "prefix_intersection_ratio.mean"),
}
WORSE_HIGHER = frozenset({"max_abs_diff", "p99_abs_diff", "max_ulp", "differing", "invalid"})
# A smaller top-1 gap is a readout closer to flipping its token: worse.
WORSE_LOWER = frozenset({"top1_agreement", "cos_sim_mean", "prefill_last_gap", "decode0_gap"})
BARS = "▁▂▃▄▅▆▇█"
TONE_MARKS = {PASS: "✓", DRIFT: "~", FAIL: "✗"}


@dataclass(slots=True)
class MetricTrend:
    name: str
    values: list[float | None]  # one per run, oldest first (None: the run did not have it)
    spark: str
    drifting: bool = False  # worse in each of the last K runs, while the item still passes

    def to_json(self) -> dict[str, Any]:
        return {
            "metric": self.name,
            "values": self.values,
            "spark": self.spark,
            "drifting_worse": self.drifting,
        }


@dataclass(slots=True)
class ItemTrend:
    klass: str
    key: str
    verdicts: list[str | None]  # per run; None: the item was not in that run
    tones: str  # one mark per run: ✓ pass, ~ drift, ✗ fail, · absent
    metrics: list[MetricTrend] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "class": self.klass,
            "key": self.key,
            "verdicts": self.verdicts,
            "tones": self.tones,
            "metrics": [m.to_json() for m in self.metrics],
            "notes": self.notes,
        }


@dataclass(slots=True)
class Trends:
    preset: str
    runs: list[dict[str, Any]]  # run_id, started_at, verdict, tone, engine, oldest first
    items: list[ItemTrend]

    @property
    def drifting(self) -> list[str]:
        return [n for i in self.items for n in i.notes]

    def to_json(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "runs": self.runs,
            "items": [i.to_json() for i in self.items],
            "drifting_worse": self.drifting,
        }


def spark(values: list[float | None]) -> str:
    """One bar per value scaled between the series' min and max; a gap for a missing value."""
    nums = [v for v in values if v is not None]
    if not nums:
        return " " * len(values)
    lo, hi = min(nums), max(nums)
    out = []
    for v in values:
        if v is None:
            out.append("·")
        elif hi == lo:
            out.append(BARS[0])
        else:
            out.append(BARS[round((v - lo) / (hi - lo) * (len(BARS) - 1))])
    return "".join(out)


def _value(v: Any) -> float | None:
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def drifting(values: list[float | None], name: str, k: int) -> bool:
    """Worse at each step over the last k runs (k - 1 steps), all of them present."""
    if k < 2 or len(values) < k or name not in WORSE_HIGHER | WORSE_LOWER:
        return False
    tail = values[-k:]
    if any(v is None for v in tail):
        return False
    sign = 1 if name in WORSE_HIGHER else -1
    return all(sign * (b - a) > 0 for a, b in zip(tail, tail[1:], strict=False))  # type: ignore[operator]


def trends(sides: list[RunSide], k: int = 3) -> Trends:
    """The trends of runs of one preset, oldest first; k: runs a drift must span."""
    keys: dict[tuple[str, str], None] = {}
    for side in sides:
        for item in side.items:
            keys[(item.klass, item.key)] = None
    maps = [s.by_key() for s in sides]
    items = []
    for klass, key in keys:
        got = [m.get((klass, key)) for m in maps]
        verdicts = [i.verdict if i else None for i in got]
        tones = "".join(TONE_MARKS.get(i.tone, "?") if i else "·" for i in got)
        trend = ItemTrend(klass, key, verdicts, tones)
        for name in HEADLINE.get(klass, ()):
            values = [_value(i.metrics.get(name)) if i else None for i in got]
            if all(v is None for v in values):
                continue
            latest = got[-1]
            still_passing = latest is not None and latest.tone in (PASS, DRIFT)
            drift = still_passing and drifting(values, name, k)
            trend.metrics.append(MetricTrend(name, values, spark(values), drift))
            if drift:
                shown = " -> ".join(f"{v:.6g}" for v in values[-k:] if v is not None)
                trend.notes.append(
                    f"{klass} {key}: {name} drifting worse over {k} runs while still passing "
                    f"({shown})"
                )
        items.append(trend)
    runs = [
        {
            "run_id": s.run_id,
            "started_at": s.started_at,
            "verdict": s.verdict,
            "tone": s.tone,
            "engine": s.identity.get("engine git_commit") or s.identity.get("engine version"),
        }
        for s in sides
    ]
    return Trends(sides[-1].preset if sides else "", runs, items)


def trend_lines(t: Trends) -> list[str]:
    """The trends as text: the runs, then per item its verdict marks and metric sparklines."""
    lines = [f"{t.preset}: last {len(t.runs)} run(s), oldest first"]
    for n, r in enumerate(t.runs, 1):
        engine = f"  engine {r['engine']}" if r.get("engine") else ""
        lines.append(f"  {n:>2}. {r['started_at']}  {r['run_id']}  {r['verdict']}{engine}")
    for item in t.items:
        lines.append(f"{item.tones}  {item.klass} {item.key}")
        for m in item.metrics:
            last = next((v for v in reversed(m.values) if v is not None), None)
            mark = "  DRIFTING WORSE" if m.drifting else ""
            lines.append(f"    {m.spark}  {m.name} (latest {last:.6g}){mark}")
    for note in t.drifting:
        lines.append(f"DRIFT: {note}")
    return lines
