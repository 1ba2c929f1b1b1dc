"""How many processes may judge at once on this machine: bounded by its cores and its memory."""

from __future__ import annotations

import os

# What one judging process may hold at its peak: numpy, two rows and the pair's |Δ| buffer
# (T x V float32: 66 MB for 128 tokens of a 128256 vocab), with room to spare.
PER_WORKER_BYTES = 512 << 20


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where there is no such file."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def judge_workers(wanted: int | None = None) -> int:
    """`wanted` (the operator's --workers) or, by default, as many as the cores and the
    available memory allow; never fewer than 1."""
    if wanted is not None:
        return max(1, wanted)
    memory = available_memory()
    by_memory = cores() if memory is None else memory // PER_WORKER_BYTES
    return max(1, min(cores(), by_memory))


def dsa_workers(wanted: int | None = None) -> int:
    """`wanted` (the operator's --workers) or 1 for DSA reading: 2 workers have not beaten 1
    on the 2-core machine the benches run on, with the second core free or not
    (bench_dsa_analyze: 4,133 vs 6,148 records/s at control x1.88; 7,344 vs 7,949 at x0.87;
    bench_dsa_data's validator 5,074 vs 6,394 at x2.04), so more processes are the operator's
    choice until they gain."""
    return 1 if wanted is None else max(1, wanted)
