"""Writing artifacts: JSON lines (orjson when present), gzip logits, atomic renames, metadata."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import subprocess
from pathlib import Path
from typing import IO, Any

import numpy as np

from runners.atomic import write_atomic

try:
    import orjson
except ImportError:  # the engine host may lack orjson; json gives the same round trip, slower
    orjson = None

# Environment that shapes determinism, recorded in metadata when set.
DETERMINISM_ENV = (
    "HIP_LAUNCH_BLOCKING",
    "AMD_SERIALIZE_KERNEL",
    "HSA_ENABLE_SDMA",
    "CUDA_LAUNCH_BLOCKING",
    "CUBLAS_WORKSPACE_CONFIG",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
)
DETERMINISM_PREFIXES = ("GRETA_", "GGML_")


def dumps(obj: Any) -> bytes:
    """One JSON document as bytes; numpy float32 arrays keep their exact float32 values."""
    if orjson is not None:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(obj, default=_json_default, separators=(",", ":")).encode()


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        # float32 -> Python float is exact, and repr round-trips, so parsing back as float32
        # gives the same bits
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot serialise {type(value).__name__}")


def utc_timestamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def git_commit() -> str:
    """GIT_COMMIT from the environment, else HEAD of the tracedeck checkout this package sits in,
    else "unknown" (a shipped copy is in no checkout of ours: its runner passes GIT_COMMIT)."""
    env = os.environ.get("GIT_COMMIT", "").strip()
    if env:
        return env
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists() or not (root / "runners" / "reference").is_dir():
        return "unknown"
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=root,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def determinism_env() -> dict[str, str]:
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if k in DETERMINISM_ENV or k.startswith(DETERMINISM_PREFIXES)
    }


class GzipJsonl:
    """Writes ``name.part`` line by line; ``commit()`` renames it to ``name``."""

    def __init__(self, path: Path, level: int = 1) -> None:
        self.path = path
        self.part = path.with_name(path.name + ".part")
        self._fh: IO[bytes] = gzip.open(self.part, "wb", compresslevel=level)  # noqa: SIM115

    def write(self, obj: Any) -> None:
        self._fh.write(dumps(obj) + b"\n")

    def commit(self) -> None:
        self._fh.close()
        os.replace(self.part, self.path)

    def abort(self) -> None:
        self._fh.close()
        self.part.unlink(missing_ok=True)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2).encode() + b"\n")


class TraceAppender:
    """Appends one JSON object per line to a shared trace file, each line one write, unbuffered,
    so a follower (or another run appending to the same file) never sees half a line."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh: IO[bytes] = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self.lines = 0

    def write(self, obj: Any) -> None:
        self._fh.write(dumps(obj) + b"\n")
        self.lines += 1

    def close(self) -> None:
        self._fh.close()
