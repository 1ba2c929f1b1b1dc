"""analysis.parallel: one side of a B3.67 pair read by a helper process that runs ahead."""

from __future__ import annotations

import gc
import gzip
import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest
from runhelp import wait_for

from analysis import parallel
from analysis.logits import InputError, iter_logits
from analysis.parallel import iter_logits_elsewhere

pytestmark = pytest.mark.e2e  # starts processes: out of the fast tier

# Rows of 50,000 floats: far more than the pipe and the rows the helper may run ahead hold.
T, V = 24, 50_000


def write_side(path: Path, rows: int = T, broken_at: int | None = None) -> np.ndarray:
    rng = np.random.default_rng(5)
    logits = rng.normal(0.0, 3.0, (rows, V)).astype(np.float32)
    with gzip.open(path, "wt", compresslevel=1) as fh:
        for i, row in enumerate(logits):
            key = "token_ix" if i == broken_at else "token_idx"
            fh.write(json.dumps({key: i, "token_id": 1, "logits": row.tolist()}) + "\n")
    return logits


def children() -> set[int]:
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as fh:
            found |= {int(pid) for pid in fh.read().split()}
    return found


def readers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rows of ")]


@pytest.fixture(scope="module")
def good_side(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    side = tmp_path_factory.mktemp("side") / "logits.jsonl.gz"
    return side, write_side(side)


@pytest.fixture(scope="module")
def broken_side(tmp_path_factory: pytest.TempPathFactory) -> Path:
    side = tmp_path_factory.mktemp("side") / "broken.jsonl.gz"
    write_side(side, broken_at=T - 2)
    return side


FORK = pytest.mark.parametrize("fork", [True, False], ids=["forked", "spawned"])


@FORK
def test_the_helper_gives_the_rows_and_errors_of_reading_here(
    good_side: tuple[Path, np.ndarray], broken_side: Path, fork: bool
) -> None:
    side, logits = good_side
    here = [(r.line, r.token_idx, r.token_id, r.logits.tobytes()) for r in iter_logits(side)]
    there = [
        (r.line, r.token_idx, r.token_id, r.logits.tobytes())
        for r in iter_logits_elsewhere(side, fork)
    ]
    assert there == here and len(there) == T
    assert np.frombuffer(there[-1][3], np.float32).tolist() == logits[-1].tolist()
    side = broken_side
    with pytest.raises(InputError) as here_error:
        list(iter_logits(side))
    with pytest.raises(InputError) as there_error:
        list(iter_logits_elsewhere(side, fork))
    assert str(there_error.value) == str(here_error.value)
    assert f"broken.jsonl.gz:{T - 1}" in str(there_error.value)
    assert readers() == []


@FORK
@pytest.mark.parametrize("taken", [0, 1])
def test_stopping_early_ends_the_helper_and_its_reader(
    good_side: tuple[Path, np.ndarray], fork: bool, taken: int
) -> None:
    side = good_side[0]
    before = children()
    rows = iter_logits_elsewhere(side, fork)
    for _ in range(taken):  # none: the other side failed before this one was read
        next(rows)
    # The helper runs ahead until the rows it may hold and the pipe are full; the reader then
    # waits on a full queue. Closing must still end both.
    assert children() - before, "the helper should be running"
    rows.close()
    assert children() == before
    assert readers() == []


@FORK
def test_a_reader_dropped_without_close_ends_its_helper(
    good_side: tuple[Path, np.ndarray], fork: bool
) -> None:
    side = good_side[0]
    before = children()
    rows = iter_logits_elsewhere(side, fork)
    next(rows)
    assert children() - before, "the helper should be running"
    del rows  # no close(): its last reference goes
    gc.collect()
    assert children() == before
    assert readers() == []


def test_a_spawned_helper_that_dies_mid_row_is_an_error_never_a_short_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    side = tmp_path / "logits.jsonl.gz"
    write_side(side, rows=2)
    dies = (
        "import struct, sys; out = sys.stdout.buffer; "
        "out.write(struct.pack('<cQ', b'R', 24 + 4 * 50000) + b'x' * 1000); out.flush(); "
        "sys.stderr.write('killed by the test'); sys.exit(9)"
    )
    monkeypatch.setattr(parallel, "HELPER_COMMAND", [sys.executable, "-c", dies])
    with pytest.raises(RuntimeError, match=r"ended without a word \(exit 9\): killed by the test"):
        list(iter_logits_elsewhere(side, fork=False))
    assert readers() == []


def test_a_forked_helper_that_dies_mid_row_is_an_error_never_a_short_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    side = tmp_path / "logits.jsonl.gz"
    write_side(side, rows=2)

    def dies(path: str, out: BinaryIO | None = None) -> None:  # runs in the forked helper
        assert out is not None
        out.write(struct.pack("<cQ", b"R", 24 + 4 * V) + b"x" * 1000)
        out.flush()
        os._exit(9)

    monkeypatch.setattr(parallel, "serve_side", dies)
    with pytest.raises(RuntimeError, match=r"ended without a word \(exit 9\); out of memory\?"):
        list(iter_logits_elsewhere(side, fork=True))
    assert readers() == []


def test_the_helper_is_forked_only_where_this_process_runs_one_thread(tmp_path: Path) -> None:
    side = tmp_path / "logits.jsonl.gz"
    write_side(side, rows=2)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        rows = iter_logits_elsewhere(side)
        assert rows.helper.popen is not None  # spawned: another thread runs here
        rows.close()
    finally:
        stop.set()
        other.join()


KILLED_JUDGE = """
import sys, time
from analysis.parallel import iter_logits_elsewhere
rows = iter_logits_elsewhere(sys.argv[1], fork=True)
next(rows)
print(rows.helper.pid, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_forked_helper_ends_when_the_judge_is_killed(good_side: tuple[Path, np.ndarray]) -> None:
    """The judge SIGKILLed mid-pair: its helper, blocked on a full pipe, meets the pipe's end
    and exits; nothing is left reading the engine's files."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    judge = subprocess.Popen(
        [sys.executable, "-c", KILLED_JUDGE, str(good_side[0])],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert judge.stdout is not None
    helper = int(judge.stdout.readline())
    assert not gone(helper)
    judge.kill()
    judge.wait()
    judge.stdout.close()
    wait_for(lambda: gone(helper), 30, "the forked helper to end")
