"""What changed between two recorded runs: verdicts per item, metric deltas, identity, matrix.

Pure: it reads what it is given (each run's record as a RunSide, its items built by the run
kind from the recorded events, analysis/compare_items.py) and never touches files or the UI.
An item is one judged thing of a run: a B3.67 pair, a KV grid cell, a readout prompt, a DSA
trace directory or shard, a command cell. Items are matched by (class, key) across the runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

PASS, DRIFT, FAIL = "pass", "drift", "fail"
EXIT_SAME, EXIT_REGRESSED, EXIT_INCOMPARABLE = 0, 1, 2

# Matrix keys that select a variant of the engine under test (the reference engine's injected
# bug classes): a change there is what a diff is for, not a different experiment.
ENGINE_SWITCHES = frozenset({"inject"})


@dataclass(slots=True)
class Item:
    """One judged thing of a run, with the verdict recomputed from what the run recorded."""

    klass: str  # "pair" | "cell" | "prompt" | "trace" | "shard"
    key: str  # e.g. "kv_aligned=1 seed=0"
    verdict: str  # the kind's word for the item (PASS_EQUIV, DIFFERS, OK, ...) or UNJUDGED
    tone: str  # pass | drift | fail
    metrics: dict[str, Any] = field(default_factory=dict)
    # Metrics past their threshold (names); empty when the item passes or has no thresholds.
    failing: list[str] = field(default_factory=list)
    first_fail: str = ""  # one line: where and how it first failed
    where: str = ""  # the token, line or element of the first failure, to tell if it moved
    # Distributions (name -> [[value, count], ...]) shown overlaid when they shift (DSA).
    hists: dict[str, list[list[float]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "hists": self.hists,
            "class": self.klass,
            "key": self.key,
            "verdict": self.verdict,
            "tone": self.tone,
            "metrics": self.metrics,
            "failing": self.failing,
            "first_fail": self.first_fail,
            "where": self.where,
        }


@dataclass(slots=True)
class RunSide:
    """One run as a diff sees it."""

    run_id: str
    preset: str
    kind: str
    matrix: dict[str, Any]
    verdict: str | None  # None: the run has not finished (or its record has no end)
    tone: str | None
    exit_code: int | None
    items: list[Item]
    identity: dict[str, str] = field(default_factory=dict)  # engine, git commit, flags, host...
    started_at: str = ""
    path: str = ""
    problems: list[str] = field(default_factory=list)  # run-level failures no item carries

    def by_key(self) -> dict[tuple[str, str], Item]:
        return {(i.klass, i.key): i for i in self.items}


@dataclass(slots=True)
class MetricDelta:
    name: str
    a: Any
    b: Any
    crossed: bool = False  # passed its threshold in A, fails it in B

    @property
    def delta(self) -> float | None:
        if _number(self.a) and _number(self.b):
            return float(self.b) - float(self.a)
        return None

    def text(self) -> str:
        d = self.delta
        shift = f" ({d:+.6g})" if d is not None and d != 0 else ""
        mark = "  CROSSED INTO FAILURE" if self.crossed else ""
        return f"{self.name} {_show(self.a)} -> {_show(self.b)}{shift}{mark}"


# How an item changed from A to B, worst first in a diff's listing.
REGRESSED, GONE, FIXED, CHANGED, NEW, SAME = "regressed", "gone", "fixed", "changed", "new", "same"
ORDER = {REGRESSED: 0, GONE: 1, CHANGED: 2, FIXED: 3, NEW: 4, SAME: 5}


@dataclass(slots=True)
class ItemChange:
    klass: str
    key: str
    a: Item | None
    b: Item | None
    change: str
    deltas: list[MetricDelta] = field(default_factory=list)
    first_fail_moved: tuple[str, str] | None = None

    def verdicts(self) -> str:
        return f"{self.a.verdict if self.a else '-'} -> {self.b.verdict if self.b else '-'}"

    def to_json(self) -> dict[str, Any]:
        return {
            "class": self.klass,
            "key": self.key,
            "change": self.change,
            "a": self.a.to_json() if self.a else None,
            "b": self.b.to_json() if self.b else None,
            "deltas": [
                {"metric": d.name, "a": d.a, "b": d.b, "delta": d.delta, "crossed": d.crossed}
                for d in self.deltas
            ],
            "first_fail_moved": list(self.first_fail_moved) if self.first_fail_moved else None,
        }


@dataclass(slots=True)
class RunDiff:
    a: RunSide
    b: RunSide
    incomparable: list[str]  # why the runs cannot be compared; empty when they can
    changes: list[ItemChange]
    identity: list[tuple[str, str, str]]  # (what, A, B) where they differ
    switches: list[tuple[str, Any, Any]]  # engine switches of the matrix that differ
    run_regressed: str = ""  # the run's own verdict went from pass to fail (why)

    @property
    def regressions(self) -> list[ItemChange]:
        return [c for c in self.changes if c.change in (REGRESSED, GONE)]

    @property
    def exit_code(self) -> int:
        if self.incomparable:
            return EXIT_INCOMPARABLE
        if self.regressions or self.run_regressed:
            return EXIT_REGRESSED
        return EXIT_SAME

    @property
    def word(self) -> str:
        return {0: "NO_REGRESSION", 1: "REGRESSION", 2: "INCOMPARABLE"}[self.exit_code]

    def to_json(self) -> dict[str, Any]:
        def side(s: RunSide) -> dict[str, Any]:
            return {
                "run_id": s.run_id,
                "preset": s.preset,
                "kind": s.kind,
                "path": s.path,
                "started_at": s.started_at,
                "verdict": s.verdict,
                "exit_code": s.exit_code,
                "identity": s.identity,
            }

        return {
            "result": self.word,
            "exit_code": self.exit_code,
            "a": side(self.a),
            "b": side(self.b),
            "incomparable": self.incomparable,
            "run_regressed": self.run_regressed,
            "identity": [{"what": w, "a": x, "b": y} for w, x, y in self.identity],
            "engine_switches": [{"key": k, "a": x, "b": y} for k, x, y in self.switches],
            "changes": [c.to_json() for c in self.changes],
        }


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _show(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "-" if v is None else str(v)


def matrix_problems(
    a: dict[str, Any], b: dict[str, Any], allowed: frozenset[str]
) -> tuple[list[str], list[tuple[str, Any, Any]]]:
    """Why two matrices make the runs incomparable, and the engine switches that differ."""
    why: list[str] = []
    switches: list[tuple[str, Any, Any]] = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if va == vb:
            continue
        if key in allowed:
            switches.append((key, va, vb))
        elif key not in a or key not in b:
            why.append(f"matrix key {key!r} is only in run {'A' if key in a else 'B'}")
        else:
            why.append(f"matrix.{key} differs: {_show(va)} (A) vs {_show(vb)} (B)")
    return why, switches


def compare_runs(
    a: RunSide, b: RunSide, allowed: frozenset[str] = ENGINE_SWITCHES, rel_tol: float = 0.0
) -> RunDiff:
    """The diff of run A (before) and run B (after).

    allowed: matrix keys whose difference does not make the runs incomparable (engine
    switches, plus whatever the operator names). rel_tol: metric changes smaller than this,
    relative to A's value, are not listed (0: every change is).
    """
    why: list[str] = []
    if a.kind != b.kind:
        why.append(f"different run kinds: {a.kind} (A) vs {b.kind} (B)")
    if a.preset != b.preset:
        why.append(f"different presets: {a.preset} (A) vs {b.preset} (B)")
    switches: list[tuple[str, Any, Any]] = []
    if not why:  # the matrices of two different presets differ anyway: no need to list it
        matrix_why, switches = matrix_problems(a.matrix, b.matrix, allowed)
        why += matrix_why
    for side, name in ((a, "A"), (b, "B")):
        if side.verdict is None:
            why.append(
                f"run {name} ({side.run_id}) has no recorded end: it is still going or its "
                f"console stopped; attach to it (tracedeck attach {side.path or side.run_id})"
            )
    changes = [] if why else _item_changes(a, b, rel_tol)
    identity = [
        (what, a.identity.get(what, "-"), b.identity.get(what, "-"))
        for what in _ordered_keys(a.identity, b.identity)
        if a.identity.get(what) != b.identity.get(what)
    ]
    run_regressed = ""
    if not why and a.tone in (PASS, DRIFT) and b.tone == FAIL:
        run_regressed = f"the run's verdict went {a.verdict} -> {b.verdict}"
        if b.problems:
            run_regressed += ": " + "; ".join(b.problems[:3])
    changes.sort(key=lambda c: (ORDER[c.change], c.klass, c.key))
    return RunDiff(a, b, why, changes, identity, switches, run_regressed)


def _ordered_keys(*dicts: dict[str, str]) -> list[str]:
    seen: dict[str, None] = {}
    for d in dicts:
        for k in d:
            seen[k] = None
    return list(seen)


def _item_changes(a: RunSide, b: RunSide, rel_tol: float) -> list[ItemChange]:
    ia, ib = a.by_key(), b.by_key()
    out: list[ItemChange] = []
    for key in _ordered_keys(ia, ib):  # type: ignore[arg-type]
        x, y = ia.get(key), ib.get(key)  # type: ignore[call-overload]
        klass, name = key  # type: ignore[misc]
        if x is None:
            out.append(ItemChange(klass, name, None, y, NEW))
            continue
        if y is None:
            # Judged in A, nowhere in B: what passed before is not known to pass now.
            change = GONE if x.tone in (PASS, DRIFT) else CHANGED
            out.append(ItemChange(klass, name, x, None, change))
            continue
        deltas = _deltas(x, y, rel_tol)
        moved = None
        if x.where != y.where and (x.where or y.where):
            moved = (x.where or "-", y.where or "-")
        if x.tone != FAIL and y.tone == FAIL:
            change = REGRESSED
        elif x.tone == FAIL and y.tone != FAIL:
            change = FIXED
        elif x.verdict != y.verdict or deltas or moved:
            change = CHANGED
        else:
            change = SAME
        out.append(ItemChange(klass, name, x, y, change, deltas, moved))
    return out


def _deltas(x: Item, y: Item, rel_tol: float) -> list[MetricDelta]:
    out = []
    for name in _ordered_keys(x.metrics, y.metrics):
        va, vb = x.metrics.get(name), y.metrics.get(name)
        if va == vb:
            continue
        if _number(va) and _number(vb) and rel_tol > 0:
            scale = max(abs(float(va)), 1e-30)
            if abs(float(vb) - float(va)) / scale < rel_tol:
                continue
        crossed = name in y.failing and name not in x.failing
        out.append(MetricDelta(name, va, vb, crossed))
    return out


def overlay(
    a: list[list[float]], b: list[list[float]], bins: int = 8, width: int = 20
) -> list[str]:
    """Two distributions ([[value, count], ...]) as bars side by side: the share of each side's
    count in each value range, A then B."""
    values = [v for v, _ in a] + [v for v, _ in b]
    if not values:
        return []
    lo, hi = min(values), max(values)
    whole = all(float(v).is_integer() for v in values)
    if whole and hi - lo + 1 <= bins:
        edges = [lo + i for i in range(int(hi - lo) + 2)]
    else:
        step = (hi - lo) / bins or 1.0
        edges = [lo + i * step for i in range(bins + 1)]
        edges[-1] = hi + (1 if whole else 1e-12)

    def shares(hist: list[list[float]]) -> list[float]:
        total = sum(c for _, c in hist) or 1
        out = [0.0] * (len(edges) - 1)
        for v, c in hist:
            i = next((k for k in range(len(out)) if v < edges[k + 1]), len(out) - 1)
            out[i] += c / total
        return out

    sa, sb = shares(a), shares(b)
    lines = []
    for k in range(len(edges) - 1):
        if whole and edges[k + 1] - edges[k] == 1:
            label = f"{edges[k]:g}"
        else:
            label = f"{edges[k]:.4g}..{edges[k + 1]:.4g}"
        bar_a = "█" * round(sa[k] * width)
        bar_b = "█" * round(sb[k] * width)
        lines.append(
            f"{label:>14} A {bar_a:<{width}} {sa[k]:6.1%}  B {bar_b:<{width}} {sb[k]:6.1%}"
        )
    return lines


def shift_lines(c: ItemChange) -> list[str]:
    """The distributions of an item that moved from A to B, overlaid."""
    if c.a is None or c.b is None:
        return []
    out = []
    for name in _ordered_keys(c.a.hists, c.b.hists):
        ha, hb = c.a.hists.get(name, []), c.b.hists.get(name, [])
        if ha != hb:
            out.append(f"{name} (share of each run's count, A vs B):")
            out += overlay(ha, hb)
    return out


def diff_lines(d: RunDiff, show_same: bool = False) -> list[str]:
    """The diff as text, regressions first."""
    lines = [
        f"A: {d.a.run_id}  {d.a.preset} ({d.a.kind})  {d.a.started_at}  -> {d.a.verdict}",
        f"B: {d.b.run_id}  {d.b.preset} ({d.b.kind})  {d.b.started_at}  -> {d.b.verdict}",
    ]
    for what, x, y in d.identity:
        lines.append(f"{what}: {x} -> {y}")
    for key, x, y in d.switches:
        lines.append(f"engine switch matrix.{key}: {_show(x)} -> {_show(y)}")
    if d.incomparable:
        lines.append("")
        lines += [f"INCOMPARABLE: {why}" for why in d.incomparable]
        lines.append(f"RESULT: INCOMPARABLE (exit {EXIT_INCOMPARABLE})")
        return lines
    counts: dict[str, int] = {}
    for c in d.changes:
        counts[c.change] = counts.get(c.change, 0) + 1
    lines.append(
        f"{len(d.changes)} item(s) compared: "
        + ", ".join(f"{n} {w}" for w, n in sorted(counts.items(), key=lambda kv: ORDER[kv[0]]))
    )
    if d.run_regressed:
        lines.append(f"REGRESSED run: {d.run_regressed}")
    for c in d.changes:
        if c.change == SAME and not show_same:
            continue
        lines.append(f"{c.change.upper():<9} {c.klass} {c.key}: {c.verdicts()}")
        for delta in c.deltas:
            lines.append(f"    {delta.text()}")
        lines += [f"    {line}" for line in shift_lines(c)]
        if c.first_fail_moved:
            lines.append(
                f"    first fail moved: {c.first_fail_moved[0]} -> {c.first_fail_moved[1]}"
            )
        if c.b is not None and c.b.first_fail and c.change in (REGRESSED, CHANGED):
            lines.append(f"    first fail (B): {c.b.first_fail}")
        if c.change == GONE:
            lines.append("    judged in A, not judged in B (crashed, cut short or left out)")
    lines.append(f"RESULT: {d.word} (exit {d.exit_code})")
    return lines
