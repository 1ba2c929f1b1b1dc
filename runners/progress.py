"""Progress of long work as Progress events: measured here, drawn by whoever shows them.

A Meter turns "so much done" into throttled Progress events with a rate (over the work so
far) and an ETA (when the total is known). progress_text() words one event the same way for
the console and a headless terminal; ProgressLines decides when a plain log (CI, not a TTY)
gets a line.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from runners.events import Progress

EVERY_S = 0.25  # at most this often per piece of work
# A rate needs this long measured: what the first read found (a shard's backlog) is not a rate.
MIN_RATE_S = 0.5
PLAIN_EVERY_S = 5.0  # a line in a plain log (not a TTY) at most this often per piece of work

Sink = Callable[[Progress], None]


class Meter:
    """One piece of work: update(done) as it goes, finish() at its end."""

    def __init__(
        self,
        what: str,
        label: str,
        unit: str,
        sink: Sink | None,
        total: float | None = None,
        cell: int = -2,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.label, self.unit, self.total, self.cell = what, label, unit, total, cell
        self.sink = sink
        self.every_s = every_s
        self.clock = clock
        self.start = clock()
        self.last = -1e18
        self.done = 0.0
        self.first: tuple[float, float] | None = None  # (time, done) at the first update

    def update(self, done: float, total: float | None = None) -> None:
        self.done = done
        if total:  # 0: not known
            self.total = total
        now = self.clock()
        if self.first is None:
            self.first = (now, done)
        if self.sink is not None and now - self.last >= self.every_s:
            self.last = now
            self.sink(self._event(now, finished=False))

    def finish(self) -> None:
        if self.sink is not None:
            self.sink(self._event(self.clock(), finished=True))

    def _event(self, now: float, finished: bool) -> Progress:
        # Measured from the first update: a follow's first read brings a whole shard's backlog
        # in a millisecond (3,192,168 records/s), and that is no rate of the run.
        since, base = self.first if self.first is not None else (self.start, 0.0)
        took = now - since
        rate = (self.done - base) / took if took >= MIN_RATE_S and self.done > base else None
        eta = None
        if rate and self.total and not finished:
            eta = max(0.0, (self.total - self.done) / rate)
        return Progress(
            what=self.what,
            label=self.label,
            done=self.done,
            total=self.total,
            unit=self.unit,
            rate=rate,
            eta_s=eta,
            finished=finished,
            cell=self.cell,
        )


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _amount(n: float, unit: str) -> str:
    return _bytes(n) if unit == "bytes" else f"{n:,.0f}"


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_text(p: Progress) -> str:
    """`fetch runs/.../logits.jsonl.gz: 12.3 MiB of 143.0 MiB (9%), 35.1 MiB/s, ETA 4s`."""
    unit = "" if p.unit == "bytes" else f" {p.unit}"
    if p.total:
        pct = min(100.0, 100.0 * p.done / p.total)
        amount = f"{_amount(p.done, p.unit)} of {_amount(p.total, p.unit)}{unit} ({pct:.0f}%)"
    else:
        amount = f"{_amount(p.done, p.unit)}{unit}"
    parts = [f"{p.what} {p.label}: {amount}"]
    if p.rate:
        rate = _bytes(p.rate) if p.unit == "bytes" else f"{p.rate:,.1f} {p.unit}"
        parts.append(f"{rate}/s")
    if p.finished:
        parts.append("done")
    elif p.eta_s is not None:
        parts.append(f"ETA {_duration(p.eta_s)}")
    return ", ".join(parts)


class ProgressLines:
    """When a plain log gets a progress line: the first of a piece of work, then every
    PLAIN_EVERY_S; the last one only when earlier ones were shown (short work stays silent)."""

    def __init__(self, every_s: float = PLAIN_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self.shown: dict[tuple[str, str], float] = {}
        self.first: dict[tuple[str, str], float] = {}

    def wants(self, p: Progress) -> bool:
        key = (p.what, p.label)
        now = self.clock()
        if p.finished:
            self.first.pop(key, None)
            return self.shown.pop(key, None) is not None
        start = self.first.setdefault(key, now)
        last = self.shown.get(key)
        if last is None:
            if now - start < min(1.0, self.every_s):
                return False  # work shorter than a second says nothing in a plain log
            self.shown[key] = now
            return True
        if now - last >= self.every_s:
            self.shown[key] = now
            return True
        return False
