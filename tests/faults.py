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
from collections.abc import Iterator
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


def assert_run_gone(local_dir: Path, timeout: float = 15.0) -> None:
    """No process of the run lives and its lock is free (the host is this machine)."""
    record = record_of(local_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run_id = record["run_id"]
        if not run_alive(run_id) and not notifier_alive(run_id) and lock_free(record["lock"]):
            return
        time.sleep(0.1)
    raise AssertionError(
        f"run {record['run_id']}: processes alive={run_alive(record['run_id'])}, notifier "
        f"alive={notifier_alive(record['run_id'])}, lock {record['lock']} "
        f"free={lock_free(record['lock'])}"
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
