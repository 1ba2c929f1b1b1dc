"""Where a machine's CPU went over a stretch of a bench: per process (read from /proc, Linux) and
the machine's busy time in all, so that a bench can say what its parties used of the cores."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Proc:
    ppid: int
    cmd: str
    cpu: float  # user + system seconds of all its threads


def _proc(pid: str) -> Proc | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None  # gone meanwhile
    fields = text[text.rindex(")") + 2 :].split()  # the name, in parentheses, may hold spaces
    cmd = raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()
    return Proc(int(fields[1]), cmd, (int(fields[11]) + int(fields[12])) / TICK)


def processes() -> dict[int, Proc]:
    """Every process living now."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (got := _proc(entry)) is not None:
            out[int(entry)] = got
    return out


def machine_busy() -> float:
    """CPU seconds the machine's cores have been busy (all of them, since boot)."""
    with open("/proc/stat") as fh:
        values = [int(v) for v in fh.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / TICK  # less idle and iowait


def descends(procs: dict[int, Proc], pid: int, root: int) -> bool:
    seen = 0
    while pid in procs and seen < 64:
        if pid == root:
            return True
        pid, seen = procs[pid].ppid, seen + 1
    return pid == root


class Stretch:
    """CPU used between start() and stop(): by each process living at stop (all of it for a
    process that started meanwhile) and by the machine."""

    def start(self) -> None:
        self.before, self.busy0 = processes(), machine_busy()

    def stop(self) -> None:
        self.after, self.busy = processes(), machine_busy() - self.busy0

    def used(self, pid: int) -> float:
        now = self.after[pid].cpu if pid in self.after else 0.0
        return now - (self.before[pid].cpu if pid in self.before else 0.0)

    def used_by(self, match: str, under: int | None = None) -> float:
        """CPU of the processes whose command line holds `match` (and, given `under`, that
        descend from that pid)."""
        return sum(
            self.used(pid)
            for pid, p in self.after.items()
            if match in p.cmd and (under is None or descends(self.after, pid, under))
        )
