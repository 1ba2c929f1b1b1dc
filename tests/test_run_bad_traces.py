"""Issue 21.5, in a run: a DSA trace with a record nested 200,000 deep, or a 100 MB line, is
TRACE_INVALID with the file and line named, the run record ends (its run_finished event), and
the fault harness finds no process of the run alive and the lock free."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from dsa_writer import write_trace
from faults import assert_run_gone, bad_input
from runhelp import cli_env, run_dirs, tracedeck

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)

DEEP = b"[" * 200_000 + b"]" * 200_000


def deep_record(first: bytes) -> bytes:
    """A real record of the shard with one more key, an array nested 200,000 deep."""
    return first[:-1] + b',"deep":' + DEEP + b"}"


BAD_LINES = {
    "nested 200000 deep": deep_record,
    "a 100 MB line": lambda first: b'{"x":"' + b"x" * (100 << 20) + b'"}',
}


@pytest.mark.parametrize("bad", list(BAD_LINES))
def test_a_bad_dsa_line_in_a_run_is_trace_invalid_and_the_record_ends(
    tmp_path: Path, bad: str
) -> None:
    block = write_trace(tmp_path / "src", topk=32)
    shard = block / "trace_steps_0_2.jsonl"
    data = shard.read_bytes()
    shard.write_bytes(BAD_LINES[bad](data.split(b"\n", 1)[0]) + b"\n" + data)
    preset = tmp_path / "p.toml"
    preset.write_text(f"""
[preset]
name = "dsa_bad"
kind = "dsa_trace"
[target]
runs = "{tmp_path}/remote"
lock = "{tmp_path}/gpu.lock"
[engine]
command = "mkdir -p {{out}}/dsa && cp -r {block} {{out}}/dsa/"
[matrix]
n = [1]
[dsa]
topk = 32
layers = 3
[artifacts]
fetch = ["dsa/block16/summary.json"]
[traces]
follow = ["dsa/block16/trace_steps_*.jsonl"]
""")
    (tmp_path / "home").mkdir()
    done = tracedeck(
        "run",
        str(preset),
        "--target",
        "local",
        "--out",
        str(tmp_path / "out"),
        env=cli_env(tmp_path / "home"),
        timeout=300,
    )
    said = done.stdout + done.stderr
    handled = bad_input(said)
    assert done.returncode == 1, said
    assert "Traceback" not in said
    assert "TRACE_INVALID" in said and "trace_steps_0_2.jsonl:1:" in said, said
    local = run_dirs(tmp_path / "out")[0]
    ends = [
        e
        for e in map(orjson.loads, (local / "events.jsonl").read_bytes().splitlines())
        if e["type"] == "run_finished"
    ]
    assert len(ends) == 1 and ends[0]["verdict"] == "TRACE_INVALID", ends
    assert_run_gone(local)
    handled()
