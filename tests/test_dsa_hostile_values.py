"""Values a DSA record's JSON can hold that no 64-bit column can: each is an invalid record,
located and counted by every tool that reads the trace, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from dsa_writer import write_trace

from analysis.dsa_scan import trace_info
from analysis.dsa_tiers import tiers_dir
from analysis.dsa_tree import analyze_block, shard_files
from analysis.dsa_whatif import whatif_dir
from console.dsa_data_cli import export_block

BIG, NEG = 2**70, -(10**20)


def _set_raw(path: Path, line: int, key: str, text: str) -> None:
    """Write `key`'s value as this very JSON text (json.dumps would keep a big int too, but a
    negative beyond int64 must be spelled out the same way)."""
    lines = path.read_text().splitlines()
    rec = json.loads(lines[line - 1])
    rec[key] = "@@"
    lines[line - 1] = json.dumps(rec).replace('"@@"', text)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("key", "value"),
    [("request_id", BIG), ("layer_id", BIG), ("step_idx", BIG), ("layer_id", NEG),
     ("seq_len_current", BIG), ("request_id", NEG)],
)  # fmt: skip
def test_an_integer_beyond_64_bits_is_an_invalid_record_everywhere(
    key: str, value: int, tmp_path: Path
) -> None:
    folder = write_trace(tmp_path / "t", requests=4, per_file=2, layers=3, steps=3)
    shard = shard_files(folder)[0]
    _set_raw(shard, 2, key, str(value))
    judged = analyze_block(folder, None, None)
    assert judged["verdict"] == "TRACE_INVALID"
    first = judged["first_fail"]
    assert first["file"].endswith(shard.name) and first["line"] == 2, first
    assert first["field"] == key and str(value) in first["found"], first
    total = judged["records"]

    info = trace_info(folder)
    out = tmp_path / "x.parquet"
    rows, invalid = export_block(info, out, "parquet")
    assert (rows, invalid) == (total, 1)
    table = pq.read_table(out).to_pylist()
    bad = [r for r in table if not r["valid"]]
    assert [(r["shard"], r["line"], r["invalid_field"]) for r in bad] == [(shard.name, 2, key)]
    assert export_block(info, tmp_path / "x.csv", "csv") == (total, 1)

    for got in (whatif_dir(str(folder), [16, 32]), tiers_dir(str(folder), [8], "lru")):
        assert (got["records"], got["used"], got["invalid"]) == (total, total - 1, 1)
        assert got["first_invalid"].startswith(f"{shard}:2: {key}: ")


@pytest.mark.parametrize(
    "line", [b"not json", b'{"request_id": 1}', b'{"latency_ms": "12"}', b"[1, 2]"]
)
def test_a_serving_line_that_is_no_entry_is_a_problem_live_and_in_analyze(
    line: bytes, tmp_path: Path
) -> None:
    """serving.jsonl (BurstGPT latencies, checked against summary.json serving) is read by one
    rule live and in analyze: an entry is an object with a number latency_ms (no request_id
    needed); any other line is counted and named, never skipped, never a traceback."""
    from analysis.dsa_tree import read_summary, trace_verdict
    from runners.kinds.dsa_trace import TraceBook

    folder = write_trace(tmp_path / "t", requests=2, per_file=2)
    good = [b'{"request_id": 0, "latency_ms": 10.5}', b'{"latency_ms": 20.0}']
    serving = folder / "serving.jsonl"
    serving.write_bytes(b"\n".join([good[0], line, good[1]]) + b"\n")
    offline = analyze_block(folder, None, None)
    book = TraceBook()
    for shard in shard_files(folder):
        book.feed(str(shard), shard.read_bytes().splitlines(), 1)
    book.feed(str(serving), serving.read_bytes().splitlines(), 1)
    engine, why = read_summary(folder / "summary.json")
    live = trace_verdict(
        str(folder), book.streams[str(folder)], engine, why, None, book.serving_stats(str(folder))
    )
    assert book.serving_stats(str(folder))["requests"] == 2
    for result in (offline, live):
        assert result["verdict"] == "TRACE_INVALID"
        said = [p for p in result["problems"] if p["field"] == "serving.jsonl"]
        assert len(said) == 1 and f"{serving}:2: " in said[0]["found"], result["problems"]
