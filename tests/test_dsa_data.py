"""DSA traces as data (issue 26): block-size what-if, export, the KV-tier simulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from patience import patience
from runhelp import ROOT, cli_env, tracedeck

from analysis.dsa_scan import scan_block, trace_info
from analysis.dsa_whatif import compute, record_fields, sorted_positions


def engine(out: Path, block: int, *flags: str) -> Path:
    """The reference engine's DSA trace (3 requests, 2 shards), KV bytes per token set."""
    cmd = [sys.executable, "-m", "runners.reference", "dsa", "--trace-enable"]
    cmd += ["--trace-out", str(out), "--workload", "ruler", "--ruler-length", "300"]
    cmd += ["--limit", "3", "--max-new-tokens", "5", "--layers", "3", "--index-topk", "64"]
    cmd += ["--max-requests-per-file", "2", "--trace-prefix-key-tokens", "40"]
    cmd += ["--temperature", "0", "--seed", "7", "--kv-block-size", str(block), *flags]
    env = {**os.environ, "DS_TRACE_KV_BYTES_PER_TOKEN": "1152"}
    done = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=patience(120), env=env
    )
    assert done.returncode == 0, done.stderr
    return out / f"block{block}"


def records(folder: Path) -> dict[tuple[int, int, int], dict]:
    out = {}
    for shard in sorted(folder.glob("trace_steps_*.jsonl")):
        for line in shard.read_bytes().splitlines():
            rec = orjson.loads(line)
            out[(rec["request_id"], rec["layer_id"], rec["step_idx"])] = rec
    return out


def recorded_fields(rec: dict) -> dict:
    """The B/C/D fields a what-if recomputes, as the engine wrote them."""
    hbm = rec["kv_fetch"]["hbm"]
    p = rec["prefix"]
    return {
        "block_size_tokens": rec["block_size_tokens"],
        "selected_block_ids": rec["selected_block_ids"],
        "unique_blocks": rec["unique_blocks"],
        "total_blocks_in_use": rec["total_blocks_in_use"],
        "touched_block_ratio": rec["touched_block_ratio"],
        "tokens_per_touched_block": rec["tokens_per_touched_block"],
        "kv_fetch.hbm": {k: hbm[k] for k in ("hit_blocks", "bytes_read", "batch_size")},
        "prefix": {
            k: p[k] for k in ("prefix_cached_blocks", "intersection_ratio", "intersection_blocks")
        },
    }


def whatif_fields(folder: Path, size: int) -> dict[tuple[int, int, int], dict]:
    info = trace_info(folder)
    out = {}
    for chunk in scan_block(info):
        b = chunk.batch
        assert chunk.valid.all() and not chunk.bad
        rows = np.flatnonzero(chunk.valid)
        got = compute(info, b, rows, [size])[size]
        for i, r in enumerate(rows.tolist()):
            c = b.col
            ident = (int(c["request"][r]), int(c["layer"][r]), int(c["step"][r]))
            out[ident] = record_fields(got, i)
    return out


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The same run (settings, seed) collected at block sizes 16 and 64."""
    root = tmp_path_factory.mktemp("dsa")
    return {b: engine(root / f"t{b}", b) for b in (16, 64)}


def test_whatif_at_the_recorded_size_equals_every_recorded_field(traces: dict[int, Path]) -> None:
    recorded = records(traces[16])
    got = whatif_fields(traces[16], 16)
    assert len(recorded) == 36 and got.keys() == recorded.keys()
    for ident, rec in recorded.items():
        assert got[ident] == recorded_fields(rec), ident


def test_whatif_at_64_equals_the_trace_collected_at_64(traces: dict[int, Path]) -> None:
    at16, at64 = records(traces[16]), records(traces[64])
    assert at16.keys() == at64.keys()
    for ident, rec in at16.items():  # the premise: the same run selects the same positions
        assert rec["selected_token_pos"] == at64[ident]["selected_token_pos"]
    got = whatif_fields(traces[16], 64)
    for ident, rec in at64.items():
        assert got[ident] == recorded_fields(rec), ident
    # and back down to 16 from the trace at 64: every field but the prefix's, which one block
    # of 64 (a prefix of 1..40 tokens) cannot pin at 16, so it is undetermined, never guessed
    down = whatif_fields(traces[64], 16)
    for ident, rec in at16.items():
        want = recorded_fields(rec)
        undetermined = dict.fromkeys(want["prefix"])
        assert down[ident] == {**want, "prefix": undetermined}, ident


def test_row_percentiles_are_numpys_linear_bit_for_bit() -> None:
    from analysis.dsa_record import Ragged
    from analysis.dsa_whatif import at_block_size

    rng = np.random.default_rng(5)
    rows = [
        np.sort(rng.choice(5000, size=int(rng.integers(1, 300)), replace=False)) for _ in range(200)
    ]
    spos = Ragged.of(rows)
    seq = np.full(len(rows), 5000)
    zero = np.zeros(len(rows), np.int64)
    for b in (1, 3, 16, 64, 100):
        got = at_block_size(spos, seq, b, 0, zero, zero)
        for i, pos in enumerate(rows):
            counts = np.unique(pos // b, return_counts=True)[1]
            assert got.tpb_p50[i] == float(np.percentile(counts, 50))
            assert got.tpb_p95[i] == float(np.percentile(counts, 95))
            assert got.unique_blocks[i] == len(counts)


def test_sorted_positions_sorts_each_row_of_unequal_rows() -> None:
    from analysis.dsa_record import Batch, Ragged

    rows = [np.array([5, 1, 3]), np.array([9, 0]), np.array([2])]
    b = Batch(pos=Ragged.of(rows))
    got = sorted_positions(b, np.array([0, 1, 2]))
    assert [got[i].tolist() for i in range(3)] == [[1, 3, 5], [0, 9], [2]]
    got = sorted_positions(b, np.array([2, 0]))
    assert [got[i].tolist() for i in range(2)] == [[2], [1, 3, 5]]


def test_whatif_cli_prints_the_sizes_side_by_side(traces: dict[int, Path], tmp_path: Path) -> None:
    done = tracedeck(
        "dsa", "whatif", str(traces[16]), "--block-sizes", "4,16,64", env=cli_env(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "every B/C/D field of the 36 records used equals the recomputation" in out
    assert "block 4" in out and "block 64" in out and "histogram" in out
    # prefix at 4 from a 16-token trace with a 40-token key: 33..40 tokens, not one ceil(P / 4)
    assert "prefix undetermined" in out
    done = tracedeck(
        "dsa", "whatif", str(traces[16]), "--block-sizes", "16,64", "--json", env=cli_env(tmp_path)
    )
    result = json.loads(done.stdout)["dirs"][0]
    at64 = json.loads((traces[64] / "summary.json").read_text())
    s64 = result["sizes"][1]
    assert s64["unique_blocks"] == {k: at64["unique_blocks"][k] for k in s64["unique_blocks"]}
    assert s64["tokens_per_touched_block"]["p50"] == at64["tokens_per_touched_block"]["p50"]


def test_whatif_leaves_out_an_invalid_record_and_says_so(
    traces: dict[int, Path], tmp_path: Path
) -> None:
    import shutil

    folder = tmp_path / "block16"
    shutil.copytree(traces[16], folder)
    shard = sorted(folder.glob("trace_steps_*.jsonl"))[0]
    lines = shard.read_bytes().splitlines(keepends=True)
    rec = orjson.loads(lines[2])
    rec["unique_blocks"] += 1
    lines[2] = orjson.dumps(rec) + b"\n"
    shard.write_bytes(b"".join(lines))
    done = tracedeck("dsa", "whatif", str(folder), "--json", env=cli_env(tmp_path))
    result = json.loads(done.stdout)["dirs"][0]
    assert result["invalid"] == 1 and result["used"] == 35
    assert f"{shard}:3: unique_blocks" in result["first_invalid"]


def test_whatif_refuses_a_bad_block_size(traces: dict[int, Path], tmp_path: Path) -> None:
    done = tracedeck(
        "dsa", "whatif", str(traces[16]), "--block-sizes", "4,zero", env=cli_env(tmp_path)
    )
    assert done.returncode == 2 and "'zero' is not a block size" in done.stderr


# -- export --------------------------------------------------------------------------------------

OPTIONAL = ("total_blocks_in_use", "touched_block_ratio", "scores_topk")


def read_back(path: Path) -> list[dict]:
    duckdb = pytest.importorskip("duckdb")
    con = duckdb.connect()
    rel = con.sql(f"select * from read_parquet('{path}') order by shard, line")
    names = rel.columns
    return [dict(zip(names, row, strict=True)) for row in rel.fetchall()]


def as_record(row: dict) -> dict:
    from analysis.dsa_export import RECORD_KEYS

    return {k: row[k] for k in RECORD_KEYS if not (k in OPTIONAL and row[k] is None)}


def test_export_parquet_reads_back_in_duckdb_to_the_same_records(
    traces: dict[int, Path], tmp_path: Path
) -> None:
    out = tmp_path / "t16.parquet"
    done = tracedeck("export", str(traces[16]), "--output", str(out), env=cli_env(tmp_path))
    assert done.returncode == 0, done.stderr
    rows = read_back(out)
    want = []
    for shard in sorted(traces[16].glob("trace_steps_*.jsonl")):
        for n, line in enumerate(shard.read_bytes().splitlines(), start=1):
            want.append((shard.name, n, orjson.loads(line)))
    assert len(rows) == len(want) == 36
    for row, (shard, n, rec) in zip(rows, want, strict=True):
        assert (row["shard"], row["line"], row["valid"]) == (shard, n, True)
        assert row["invalid_field"] is None and row["raw"] is None
        assert as_record(row) == rec
    # the positions are delta-encoded (a reader decodes them ~8x faster than a dictionary's)
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(out).metadata.row_group(0)
    pos = next(
        meta.column(i)
        for i in range(meta.num_columns)
        if meta.column(i).path_in_schema.startswith("selected_token_pos.")
    )
    assert "DELTA_BINARY_PACKED" in pos.encodings and pos.compression == "SNAPPY"


def test_export_marks_invalid_records_and_keeps_them(
    traces: dict[int, Path], tmp_path: Path
) -> None:
    import shutil

    folder = tmp_path / "trace" / "block16"
    shutil.copytree(traces[16], folder)
    shard = sorted(folder.glob("trace_steps_*.jsonl"))[0]
    lines = shard.read_bytes().splitlines(keepends=True)
    rec = orjson.loads(lines[1])
    rec["kv_fetch"]["hbm"]["hit_blocks"] = [0]  # not the selected blocks: HBM-only broken
    lines[1] = orjson.dumps(rec) + b"\n"
    lines[4] = b'{"event": "dsa_topk", "request_id": 0, "layer_id": 1\n'  # no record at all
    shard.write_bytes(b"".join(lines))
    out = tmp_path / "x.parquet"
    done = tracedeck("export", str(folder), "--output", str(out), env=cli_env(tmp_path))
    assert done.returncode == 1, done.stderr  # exported, but not every record is valid
    assert "2 marked invalid" in done.stdout
    rows = read_back(out)
    assert len(rows) == 36  # nothing dropped
    bad = [r for r in rows if not r["valid"]]
    assert [(r["shard"], r["line"]) for r in bad] == [(shard.name, 2), (shard.name, 5)]
    assert bad[0]["invalid_field"] == "kv_fetch.hbm.hit_blocks"
    assert as_record(bad[0]) == rec  # its values as written, the wrong hit list included
    assert bad[1]["invalid_field"] == "record" and "not valid JSON" in bad[1]["invalid_found"]
    assert bad[1]["raw"] == lines[4].decode().rstrip("\n") and bad[1]["request_id"] is None


def test_export_csv_flattens_and_keeps_the_positions(
    traces: dict[int, Path], tmp_path: Path
) -> None:
    duckdb = pytest.importorskip("duckdb")
    out = tmp_path / "t.csv"
    done = tracedeck(
        "export", str(traces[16]), "--format", "csv", "--output", str(out), env=cli_env(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    rel = duckdb.connect().sql(f"select * from read_csv('{out}', all_varchar=true)")
    rows = [dict(zip(rel.columns, r, strict=True)) for r in rel.fetchall()]
    first = orjson.loads(
        sorted(traces[16].glob("trace_steps_*.jsonl"))[0].read_bytes().splitlines()[0]
    )
    assert len(rows) == 36
    assert json.loads(rows[0]["selected_token_pos"]) == first["selected_token_pos"]
    assert int(rows[0]["kv_fetch.hbm.bytes_read"]) == first["kv_fetch"]["hbm"]["bytes_read"]


def test_csv_lists_from_the_lines_text_equal_the_encoded_lists(
    traces: dict[int, Path], tmp_path: Path
) -> None:
    """The csv's lists of integers are the arrays as their line wrote them when that is
    msgspec's text of them; a line written otherwise (spaces, -0) or read by the exact path,
    a hit list of its own and a used tier are encoded: the same table as flat_for_csv's."""
    import shutil

    import msgspec

    from analysis.dsa_export import flat_for_csv, record_table

    folder = tmp_path / "trace" / "block16"
    shutil.copytree(traces[16], folder)
    shard = sorted(folder.glob("trace_steps_*.jsonl"))[0]
    lines = shard.read_bytes().splitlines(keepends=True)
    recs = [orjson.loads(x) for x in lines[:5]]
    lines[0] = json.dumps(recs[0]).encode() + b"\n"  # ", " between the values of every list
    lines[1] = lines[1].replace(b'"selected_token_pos":[', b'"selected_token_pos":[-0,', 1)
    recs[2]["dataset"] = "selected_token_pos"  # the key's name first as a value: the exact path
    lines[2] = orjson.dumps(recs[2]) + b"\n"
    recs[3]["kv_fetch"]["hbm"]["hit_blocks"] = [0, 1]  # not selected_block_ids
    lines[3] = orjson.dumps(recs[3]) + b"\n"
    recs[4]["kv_fetch"]["local_pool"]["hit_blocks"] = [3, 4]  # a tier in use
    lines[4] = orjson.dumps(recs[4]) + b"\n"
    shard.write_bytes(b"".join(lines))
    first = next(scan_block(trace_info(folder))).batch
    assert first.lines[:5] == [1, 2, 3, 4, 5] and first.pos_text[2] is None  # the exact path's
    assert b", " in bytes(first.pos_text[0]) and b"-0," in bytes(first.pos_text[1])
    seen = 0
    for chunk in scan_block(trace_info(folder)):
        fast = flat_for_csv(record_table(chunk, json_lists=True))
        assert fast.equals(flat_for_csv(record_table(chunk)))
        b = chunk.batch
        for r, text in enumerate(fast["selected_token_pos"].to_pylist()):
            assert text == msgspec.json.encode(b.pos[r].tolist()).decode()
            seen += 1
        if chunk.file == shard and b.lines[0] == 1:
            got = fast.slice(0, 5).to_pylist()
            assert got[3]["kv_fetch.hbm.hit_blocks"] == "[0,1]"
            assert got[4]["kv_fetch.local_pool.hit_blocks"] == "[3,4]"
            assert got[0]["selected_block_ids"] == json.dumps(recs[0]["selected_block_ids"]).replace(" ", "")  # fmt: skip
    assert seen == 36
    assert chunk.batch.pos_text and None not in chunk.batch.pos_text  # the usual lines: as written


def test_export_keeps_stored_scores(tmp_path: Path) -> None:
    folder = engine(tmp_path / "s", 16, "--trace-store-scores", "--limit", "1")
    out = tmp_path / "s.parquet"
    done = tracedeck("export", str(folder), "--output", str(out), env=cli_env(tmp_path))
    assert done.returncode == 0, done.stderr
    rows = read_back(out)
    recs = [
        orjson.loads(x) for x in next(folder.glob("trace_steps_*.jsonl")).read_bytes().splitlines()
    ]
    assert [as_record(r) for r in rows] == recs and "scores_topk" in recs[0]


# -- the KV-tier simulator -------------------------------------------------------------------------


def brute_lru_hits(accesses: list[tuple], capacity: int) -> int:
    """A plain list LRU: the most recent at the end."""
    cache: list[tuple] = []
    hits = 0
    for block in accesses:
        if block in cache:
            hits += 1
            cache.remove(block)
        elif len(cache) >= capacity:
            cache.pop(0)
        cache.append(block)
    return hits


def block_stream(recs: list[dict]) -> list[tuple]:
    out = []
    for rec in recs:
        pcb, key = rec["prefix"]["prefix_cached_blocks"], rec["prefix"]["prefix_key"]
        for b in rec["selected_block_ids"]:
            owner = key if b < pcb else rec["request_id"]
            out.append((rec["layer_id"], owner, b))
    return out


def tiers_json(folder: Path, tmp_path: Path, *flags: str) -> dict:
    done = tracedeck("dsa", "tiers", str(folder), "--json", *flags, env=cli_env(tmp_path))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["dirs"][0]


def test_lru_hit_ratio_equals_a_brute_force_lru_and_the_curve_is_monotone(
    traces: dict[int, Path], tmp_path: Path
) -> None:
    recs = []
    for shard in sorted(
        traces[16].glob("trace_steps_*.jsonl"), key=lambda p: int(p.name.split("_")[2])
    ):
        recs += [orjson.loads(x) for x in shard.read_bytes().splitlines()]
    stream = block_stream(recs)
    caps = [1, 8, 19, 40, 64, 100, 200, 400]
    got = tiers_json(traces[16], tmp_path, "--hbm-blocks", ",".join(map(str, caps)))
    assert got["order"].startswith("trace order") and got["used"] == 36
    ratios = []
    for cap, tier in zip(caps, got["tiers"], strict=True):
        hits = brute_lru_hits(stream, cap)
        assert tier["hbm_blocks"] == cap and tier["accesses"] == len(stream)
        assert tier["hbm"]["hit_blocks"] == hits, cap
        assert tier["remote_pool"]["hit_blocks"] == len(stream) - hits
        assert tier["remote_pool"]["bytes_read"] == (len(stream) - hits) * 16 * 1152
        ratios.append(tier["hit_ratio"])
    assert ratios == sorted(ratios) and ratios[0] < ratios[-1]
    sweep = tiers_json(traces[16], tmp_path, "--hbm-blocks", "512", "--sweep")
    curve = [t["hit_ratio"] for t in sweep["tiers"]]
    assert [t["hbm_blocks"] for t in sweep["tiers"]] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert curve == sorted(curve)


def test_lru_at_another_block_size_replays_the_recomputed_blocks(
    traces: dict[int, Path], tmp_path: Path
) -> None:
    recs = []
    for shard in sorted(
        traces[64].glob("trace_steps_*.jsonl"), key=lambda p: int(p.name.split("_")[2])
    ):
        recs += [orjson.loads(x) for x in shard.read_bytes().splitlines()]
    stream = block_stream(recs)  # the trace collected at 64
    got = tiers_json(traces[16], tmp_path, "--hbm-blocks", "3,6,12", "--block-size", "64")
    for tier in got["tiers"]:
        assert tier["hbm"]["hit_blocks"] == brute_lru_hits(stream, tier["hbm_blocks"])


def test_burstgpt_accesses_replay_in_the_engines_batch_order(tmp_path: Path) -> None:
    out = tmp_path / "b"
    csv = tmp_path / "burst.csv"  # BurstGPT's columns; arrivals in two bursts, short answers
    rows = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    for i, (t, n) in enumerate([(0, 40), (0, 60), (0, 50), (0, 70), (0, 45), (9, 55), (9, 65)]):
        rows.append(f"{t},ChatGPT,{n},{2 + i % 2},{n + 2 + i % 2},Conversation log")
    csv.write_text("\n".join(rows) + "\n")
    cmd = [sys.executable, "-m", "runners.reference", "dsa", "--trace-enable"]
    cmd += ["--trace-out", str(out), "--workload", "burstgpt", "--burstgpt-csv", str(csv)]
    cmd += ["--batch-size", "4", "--limit", "12", "--max-prompt-tokens", "512", "--layers", "2"]
    cmd += ["--max-seq-len", "256"]
    cmd += ["--index-topk", "32", "--kv-block-size", "16", "--temperature", "0"]
    cmd += ["--max-requests-per-file", "3"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=patience(120))
    assert done.returncode == 0, done.stderr
    folder = out / "block16"
    served = {}
    for line in (folder / "serving.jsonl").read_text().splitlines():
        s = json.loads(line)
        served[s["request_id"]] = s["end_ms"]
    recs = []
    for shard in folder.glob("trace_steps_*.jsonl"):
        recs += [orjson.loads(x) for x in shard.read_bytes().splitlines()]
    # batches of 4 over shards of 3: a batch's requests interleave across two shard files
    recs.sort(
        key=lambda r: (served[r["request_id"]], r["step_idx"], r["layer_id"], r["request_id"])
    )
    stream = block_stream(recs)
    got = tiers_json(folder, tmp_path, "--hbm-blocks", "4,16,64")
    assert got["order"].startswith("BurstGPT batch order")
    for tier in got["tiers"]:
        hits = brute_lru_hits(stream, tier["hbm_blocks"])
        assert tier["hbm"]["hit_blocks"] == hits, tier["hbm_blocks"]
    from analysis.dsa_tiers import Skipped, replay_order

    order = [
        (a.request, a.step, a.layer) for a in replay_order(trace_info(folder), None, Skipped())
    ]
    assert order == [(r["request_id"], r["step_idx"], r["layer_id"]) for r in recs]
    # and that is not the file order on this trace
    by_file = []
    for shard in sorted(
        folder.glob("trace_steps_*.jsonl"), key=lambda p: int(p.name.split("_")[2])
    ):
        by_file += [orjson.loads(x) for x in shard.read_bytes().splitlines()]
    assert by_file != recs


def test_lfu_and_prefix_pinned_policies() -> None:
    from analysis.dsa_tiers import Tier

    lfu = Tier(2, "lfu")
    assert [lfu.access(x) for x in "aabca"] == [False, True, False, False, True]  # c evicts b
    assert lfu.access("b") is False and lfu.access("a") is True
    pinned = Tier(2, "prefix-pinned")
    assert pinned.access("p", prefix=True) is False
    assert [pinned.access(x) for x in "xyz"] == [False, False, False]
    assert pinned.access("p", prefix=True) is True  # never evicted while others can go
    lru = Tier(2, "lru")
    assert [lru.access(x) for x in "pxyzp"] == [False, False, False, False, False]


def test_tiers_refuses_bad_options(traces: dict[int, Path], tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    done = tracedeck("dsa", "tiers", str(traces[16]), "--hbm-blocks", "x", env=env)
    assert done.returncode == 2 and "--hbm-blocks" in done.stderr
    done = tracedeck(
        "dsa", "tiers", str(traces[16]), "--hbm-blocks", "4", "--bandwidth-gbs", "0", env=env
    )
    assert done.returncode == 2 and "--bandwidth-gbs" in done.stderr


def test_block_counts_from_the_occupancy_equal_the_sorted_positions_path(
    traces: dict[int, Path],
) -> None:
    from dataclasses import fields

    from analysis.dsa_record import Ragged

    sizes = [1, 2, 4, 8, 16, 32, 48, 64, 128, 256]
    for folder in traces.values():
        info = trace_info(folder)
        for chunk in scan_block(info):
            rows = np.flatnonzero(chunk.valid)
            fast = compute(info, chunk.batch, rows, sizes, chunk.derived)
            slow = compute(info, chunk.batch, rows, sizes)
            for b in sizes:
                for f in fields(fast[b]):
                    value, other = getattr(fast[b], f.name), getattr(slow[b], f.name)
                    if isinstance(value, Ragged):
                        np.testing.assert_array_equal(value.lens, other.lens)
                        value, other = value.flat, other.flat
                    np.testing.assert_array_equal(value, other, err_msg=f"{folder} {b} {f.name}")


def test_whatif_summaries_from_the_row_histograms_equal_the_per_block_path(
    traces: dict[int, Path],
) -> None:
    """What the what-if keeps of each size, read off the rows' histograms of positions per
    block (summary_counted), is the per-block path's (Summary.of(compute(...))) exactly."""
    from dataclasses import fields

    from analysis.dsa_whatif import Summary, _inputs, summary_counted

    sizes = [1, 2, 4, 8, 16, 32, 48, 64, 128, 256]
    for folder in traces.values():
        info = trace_info(folder)
        for chunk in scan_block(info):
            rows = np.flatnonzero(chunk.valid)
            seq, bpt, plo, phi = _inputs(info, chunk.batch, rows)
            slow = compute(info, chunk.batch, rows, sizes)
            shared: dict = {}  # the finest size's byte codes, kept for the sizes it divides
            for b in sizes:
                for fine, cache in ((None, None), (1, shared)):
                    fast = summary_counted(chunk.derived, b, seq, bpt, plo, phi, fine, cache)
                    if fast is None:  # 48 at 64 (neither divides the other)
                        assert b == 48 and info.block_size == 64
                        continue
                    want = Summary.of(slow[b])
                    for f in fields(want):
                        value, other = getattr(fast, f.name), getattr(want, f.name)
                        if f.name == "tpb":  # the same histogram, trailing zeros aside
                            value, other = np.trim_zeros(value, "b"), np.trim_zeros(other, "b")
                        why = f"{folder} {b} {fine} {f.name}"
                        np.testing.assert_array_equal(value, other, err_msg=why)


def test_median_is_the_linear_percentiles_half_bit_for_bit() -> None:
    from analysis.dsa_whatif import Q50, _median, _percentiles

    rng = np.random.default_rng(0)
    for _ in range(50):
        n = rng.integers(0, 30, 40)
        rows = [np.sort(rng.integers(1, 9, k)) for k in n]

        def kth(k: np.ndarray, rows: list = rows, n: np.ndarray = n) -> np.ndarray:
            return np.array([rows[r][k[r]] if n[r] else 1 for r in range(len(n))])

        got = _median(kth, n)
        (same,) = _percentiles(kth, n, (Q50,))
        want = np.array([np.percentile(v, 50) if len(v) else np.nan for v in rows])
        np.testing.assert_array_equal(got, same)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("digits", [3, 6])
def test_whatif_at_the_recorded_size_reads_ratios_as_written_like_the_validator(
    digits: int, tmp_path: Path
) -> None:
    """A trace that writes its ratios and means to a few decimals (as seed 004's example record
    does: 0.068 for 16/234) is TRACE_OK to analyze; what-if at its size says every recorded
    field equals the recomputation; a ratio that is off is still an invalid record."""
    from dsa_writer import write_trace

    from analysis.dsa_tree import analyze_block, shard_files
    from analysis.dsa_whatif import whatif_dir

    folder = write_trace(tmp_path / "t", requests=4, steps=4)
    keys = ("touched_block_ratio",)
    for shard in shard_files(folder):
        recs = [json.loads(line) for line in shard.read_text().splitlines()]
        for r in recs:
            for k in keys:
                r[k] = round(r[k], digits)
            r["prefix"]["intersection_ratio"] = round(r["prefix"]["intersection_ratio"], digits)
            r["tokens_per_touched_block"]["mean"] = round(r["tokens_per_touched_block"]["mean"], digits)  # fmt: skip
        shard.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert analyze_block(folder, None, None)["verdict"] == "TRACE_OK"
    got = whatif_dir(str(folder), [16])
    assert got["recorded_differ"] == 0 and got["recorded_equal"] == got["used"] > 0
    shard = shard_files(folder)[0]
    lines = shard.read_text().splitlines()
    rec = json.loads(lines[2])
    rec["touched_block_ratio"] = round(rec["touched_block_ratio"] + 10 ** -(digits - 1), digits)
    lines[2] = json.dumps(rec)
    shard.write_text("\n".join(lines) + "\n")
    got = whatif_dir(str(folder), [16])  # the validator's checks take it out first
    assert got["invalid"] == 1 and ":3: touched_block_ratio: " in got["first_invalid"]


@pytest.mark.parametrize("rows", [3, 700])  # 700 x 129 bins: past what uint16 keys can number
def test_row_bincount_is_each_rows_own_histogram(rows: int) -> None:
    from analysis.dsa_whatif import row_bincount

    rng = np.random.default_rng(rows)
    lens = rng.integers(0, 40, rows)
    values = rng.integers(0, 129, int(lens.sum()))
    got = row_bincount(values, lens, 129)
    at = np.concatenate([[0], np.cumsum(lens)])
    want = np.stack([np.bincount(values[at[r] : at[r + 1]], minlength=129) for r in range(rows)])
    np.testing.assert_array_equal(got, want)


def test_row_percentiles_are_numpys_for_every_row_empty_ones_nan() -> None:
    """_row_percentiles (each row's histogram, one running count of all rows, one search) is
    np.percentile of each row's counts, bit for bit; a row with no count is NaN and moves no
    other row's answer."""
    from analysis.dsa_whatif import Q50, Q95, _row_percentiles

    rng = np.random.default_rng(7)
    for b in (1, 4, 64, 128):
        n = rng.integers(0, 12, 300)
        n[:3] = 0  # empty rows first, and among the others
        n[rng.integers(0, 300, 20)] = 0
        counts = rng.integers(1, b + 1, int(n.sum()))
        p50, p95 = _row_percentiles(counts, n, b)
        at = np.concatenate([[0], np.cumsum(n)])
        for r in range(len(n)):
            row = counts[at[r] : at[r + 1]]
            want = (np.percentile(row, Q50 * 100), np.percentile(row, Q95 * 100)) if len(row) else (np.nan, np.nan)  # fmt: skip
            np.testing.assert_array_equal([p50[r], p95[r]], want, err_msg=f"b {b} row {r}")
