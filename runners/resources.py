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


def dsa_workers(wanted: int | None = None, *, answers_heavy: bool = False) -> int:
    """`wanted` (the operator's --workers) or, by default, judge_workers(): parsing and checking
    the records, most of a DSA read, runs in the workers (bench_dsa_data, 100k records on 2
    cores: analyze 1.74x and what-if 1.79x the one-process rate, each in one run).

    answers_heavy: this process's work on the workers' answers is most of it (a parquet
    export encodes and compresses every record here; the tier replay runs here, in order), and
    moving those answers between processes costs more than the workers save (same run: parquet
    0.94x vs 1.08x, tiers 0.64x vs 0.75x the one-process validator; csv, whose text the workers
    make, 1.16x vs 0.95x): 1 by default."""
    if wanted is not None:
        return max(1, wanted)
    return 1 if answers_heavy else judge_workers()
