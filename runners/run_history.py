"""A preset's recorded runs, oldest first, read back for trends (analysis.trends)."""

from __future__ import annotations

from pathlib import Path

from analysis.run_compare import RunSide
from runners.record import RunRecord, local_runs
from runners.run_view import load_side


def preset_runs(
    out_dir: Path, preset: str, target: str | None = None, last: int = 10
) -> tuple[list[RunSide], list[str]]:
    """The last `last` finished runs of `preset` (on `target` when given) under out_dir, oldest
    first, and why any run of it, or any record that cannot be read, was left out."""
    found: list[tuple[str, str, Path]] = []
    skipped: list[str] = []
    for local in local_runs(out_dir):
        try:
            record = RunRecord.load(local)
        except (OSError, ValueError, TypeError) as exc:  # whose run it is cannot be known
            skipped.append(f"{local}: left out: its record cannot be read ({exc})")
            continue
        if record.preset != preset or (target is not None and record.target != target):
            continue
        found.append((record.started_at, record.run_id, local))
    found.sort()
    sides: list[RunSide] = []
    for _, run_id, local in reversed(found):
        if len(sides) == last:
            break
        try:
            side = load_side(local)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            skipped.append(f"{run_id}: left out: {exc}")
            continue
        if side.verdict is None:
            skipped.append(f"{run_id}: left out: not finished")
            continue
        sides.append(side)
    return list(reversed(sides)), skipped
