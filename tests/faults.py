"""The fault harness: what every fault scenario checks after it, and ways to cause faults.

Every scenario ends with `assert_run_gone`: no process of the run alive (group or escaped,
zombies aside, and tracedeck's own change notifier), the host lock free: checked, not assumed.
The proxy to cut links lives in sshd.py (CuttableProxy); `small_disk` mounts a tmpfs that fills;
the `impostor` fixture (conftest.py) is a second sshd with a host key nobody trusted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
from runhelp import notifier_alive, run_alive


def record_of(local_dir: Path) -> dict:
    return orjson.loads((local_dir / "run.json").read_bytes())


def lock_free(lock: str) -> bool:
    """Can the host lock be taken right now (nobody holds it)?"""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def run_parts(record: dict) -> tuple[list[str], list[tuple[str, str]]]:
    """The markers (TRACEDECK_RUN_ID) and (host, lock) pairs of a run: one of each on one host;
    one per batch and per host of a fleet run."""
    fleet = (record.get("extra") or {}).get("fleet")
    if not fleet:
        return [record["run_id"]], [("", record["lock"])]
    members = fleet.get("members") or []
    locks = sorted({(m["host"], m["lock"]) for m in members})
    return [m["member"] for m in members], locks


def slurm_jobs(record: dict) -> list[str]:
    """The Slurm job ids a run submitted (its slurm/job_id), if it went to Slurm."""
    remote = record.get("remote_dir") or ""
    path = Path(remote) / "slurm" / "job_id"
    return path.read_text().split() if remote and path.is_file() else []


def assert_run_gone(
    local_dir: Path,
    timeout: float = 15.0,
    lock_free_on: Callable[[str, str], bool] | None = None,
    slurm_env: dict[str, str] | None = None,
) -> None:
    """No process of the run lives and its lock is free; for a fleet run, on every host (the
    lock of a host seen through `lock_free_on(host, lock)`); for a Slurm run, no task of its
    job is left in the queue either (squeue with `slurm_env`)."""
    record = record_of(local_dir)
    markers, locks = run_parts(record)
    jobs = slurm_jobs(record)
    free = lock_free_on or (lambda host, lock: lock_free(lock))

    def queued() -> list[str]:
        if not jobs:
            return []
        out = subprocess.run(
            ["squeue", "-h", "-j", ",".join(jobs), "-o", "%i %T"],
            env={**os.environ, **(slurm_env or {})},
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.split("\n")[:-1]

    def gone() -> bool:
        return (
            not any(run_alive(m) or notifier_alive(m) for m in markers)
            and all(free(h, lock) for h, lock in locks)
            and not queued()
        )

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gone():
            return
        time.sleep(0.1)
    raise AssertionError(
        f"run {record['run_id']}: processes alive={[m for m in markers if run_alive(m)]}, "
        f"notifier alive={[m for m in markers if notifier_alive(m)]}, "
        f"locks free={[(h, lock, free(h, lock)) for h, lock in locks]}, queued={queued()}"
    )


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at path (root only), unmounted after."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def grow_disk(path: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)
