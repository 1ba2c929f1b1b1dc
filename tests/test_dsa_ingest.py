"""The DSA ingest (issue #11/#12 performance work): every contract check still fires, the fast
path accepts only what the exact path accepts, and a trace judges the same however it is split
into batches, live or rebuilt from its recorded digests."""

from __future__ import annotations

import copy
import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from dsa_writer import record

from analysis.dsa_checks import Context, check_batch, explain
from analysis.dsa_record import read_batch
from analysis.dsa_stream import TraceStream

KEY = hashlib.sha1(b"prefix-0").hexdigest()
FILE = "/t/block16/trace_steps_0_2.jsonl"


def trace(steps: int = 3, layers: int = 3, requests: int = 2, seed: int = 0) -> list[dict]:
    """Records of `requests` requests as the demo writes them (top-32, block 16)."""
    rng = random.Random(seed)
    out = []
    for request in range(requests):
        for s in range(steps):
            latency = 1000 + s
            for layer in range(layers):
                out.append(
                    record(request, layer, 40 + s, 32, 16, 24, request > 0, rng, latency, KEY)
                )
    return out


def lines_of(records: list[dict]) -> list[bytes]:
    return [orjson.dumps(r) for r in records]


# -- every per-record check (analysis.dsa_checks), each broken alone, is the one reported ------


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def change(r: dict) -> None:
        *head, last = path.split(".")
        for k in head:
            r = r[k]
        r[last] = value(r[last]) if callable(value) else value

    return change


def _positions(change: Callable[[list[int]], None], count: bool = False) -> Callable[[dict], None]:
    def apply(r: dict) -> None:
        change(r["selected_token_pos"])
        if count:
            r["unique_token_pos_count"] = len(r["selected_token_pos"])

    return apply


def _new_block_list(r: dict) -> None:
    r["selected_block_ids"] = r["selected_block_ids"][:-1] + [999]
    r["kv_fetch"]["hbm"]["hit_blocks"] = r["selected_block_ids"]


def _dup(p: list[int]) -> None:
    p[0] = p[1]


CHECKS: list[tuple[str, Callable[[dict], None]]] = [
    ("event", _set("event", "dsa_other")),
    ("rank", _set("rank", 1)),
    ("world_size", _set("world_size", 0)),
    ("request_id/layer_id/step_idx", _set("request_id", -1)),
    ("seq_len_current", _set("seq_len_current", 0)),
    ("seq_len_current", _set("seq_len_current", lambda v: v + 1)),
    ("block_size_tokens", _set("block_size_tokens", 64)),
    ("unique_token_pos_count", _set("unique_token_pos_count", lambda v: v + 1)),
    ("selected_token_pos", _positions(lambda p: p.pop(), count=True)),  # fewer than top-k
    ("selected_token_pos", _positions(lambda p: p.__setitem__(0, 41))),  # out of [0, seq)
    ("selected_token_pos", _positions(lambda p: p.__setitem__(0, -1))),
    ("selected_token_pos", _positions(_dup)),
    ("offset_min", _set("offset_min", lambda v: v + 1)),
    ("offset_max", _set("offset_max", lambda v: v - 1)),
    ("offset_p50", _set("offset_p50", lambda v: v + 3)),
    ("total_blocks_in_use", _set("total_blocks_in_use", lambda v: v + 1)),
    ("total_blocks_in_use", _set("total_blocks_in_use", -1)),  # present, so judged
    ("selected_block_ids", _new_block_list),
    ("unique_blocks", _set("unique_blocks", lambda v: v + 1)),
    ("touched_block_ratio", _set("touched_block_ratio", lambda v: v + 0.1)),
    ("tokens_per_touched_block.mean", _set("tokens_per_touched_block.mean", lambda v: v + 1)),
    ("tokens_per_touched_block.p50", _set("tokens_per_touched_block.p50", lambda v: v + 5)),
    ("tokens_per_touched_block.p95", _set("tokens_per_touched_block.p95", lambda v: v + 5)),
    ("kv_fetch.hbm.hit_blocks", _set("kv_fetch.hbm.hit_blocks", lambda v: v[:-1])),
    ("kv_fetch.hbm.batch_size", _set("kv_fetch.hbm.batch_size", lambda v: v + 1)),
    ("kv_fetch.hbm.bytes_read", _set("kv_fetch.hbm.bytes_read", lambda v: v + 1)),
    ("kv_fetch.hbm.latency_us", _set("kv_fetch.hbm.latency_us", -1)),
    ("kv_fetch.hbm.latency_us", _set("kv_fetch.hbm.latency_us", None)),
    ("kv_fetch.local_pool/remote_pool", _set("kv_fetch.local_pool.batch_size", 1)),
    ("prefix.prefix_cached_blocks", _set("prefix.prefix_cached_blocks", -1)),
    ("prefix.prefix_key", _set("prefix.prefix_key", "not-a-sha1")),
    ("prefix.intersection_blocks", _set("prefix.intersection_blocks", [])),
    ("prefix.intersection_ratio", _set("prefix.intersection_ratio", lambda v: v + 0.5)),
    ("scores_stats", _set("scores_stats.min", 100.0)),
    ("scores_topk", _set("scores_topk", [0.5])),
]


@pytest.mark.parametrize(("field", "change"), CHECKS, ids=[f"{i}-{f}" for i, (f, _) in enumerate(CHECKS)])  # fmt: skip
def test_each_record_check_fires_alone_with_its_field(field: str, change: Callable) -> None:
    rec = copy.deepcopy(trace()[4])
    change(rec)
    batch = read_batch([orjson.dumps(record_ok := trace()[3]), orjson.dumps(rec)], 7)
    assert not batch.bad and len(batch) == 2 and record_ok
    derived = check_batch(batch, Context(topk=32, block_size=16, bytes_per_token=1152))
    assert derived.code[0] == 0  # the untouched neighbour in the same batch stays valid
    assert derived.code[1] != 0
    fail = explain(derived, 1)
    assert fail.field == field, fail
    assert fail.expected and fail.found


# -- the fast path accepts only what the exact one accepts -----------------------------------


def _text_edit(old: bytes, new: bytes) -> Callable[[bytes], bytes]:
    def edit(line: bytes) -> bytes:
        assert old in line
        return line.replace(old, new, 1)

    return edit


def _positions_text(make: Callable[[list[int]], str]) -> Callable[[bytes], bytes]:
    def edit(line: bytes) -> bytes:
        rec = json.loads(line)
        text = json.dumps(rec)
        old = json.dumps(rec["selected_token_pos"])
        return text.replace(old, make(rec["selected_token_pos"]), 1).encode()

    return edit


def _move_positions_into_prefix(line: bytes) -> bytes:
    rec = json.loads(line)
    rec["prefix"]["selected_token_pos"] = rec.pop("selected_token_pos")
    return orjson.dumps(rec)


def _positions_first(line: bytes) -> bytes:
    rec = json.loads(line)
    return orjson.dumps({"selected_token_pos": rec.pop("selected_token_pos"), **rec})


def _block_ids(value: str) -> Callable[[bytes], bytes]:
    def edit(line: bytes) -> bytes:
        rec = json.loads(line)
        text = orjson.dumps(rec).decode()
        old = '"selected_block_ids":' + json.dumps(rec["selected_block_ids"]).replace(" ", "")
        assert old in text
        return text.replace(old, '"selected_block_ids":' + value, 1).encode()

    return edit


BAD_LINES: list[tuple[str, Callable[[bytes], bytes], str]] = [
    # positions: a nested array anywhere (pysimdjson would flatten it), a float, a string
    (
        "nested first",
        _positions_text(lambda p: json.dumps([[p[0]], *p[1:]])),
        "selected_token_pos",
    ),  # fmt: skip
    (
        "nested later",
        _positions_text(lambda p: json.dumps([p[0], [p[1]], *p[2:]])),
        "selected_token_pos",
    ),  # fmt: skip
    ("float", _positions_text(lambda p: json.dumps([p[0] + 0.5, *p[1:]])), "selected_token_pos"),
    ("1.0", _positions_text(lambda p: "[1.0, " + json.dumps(p[1:])[1:]), "selected_token_pos"),
    (
        "string ]",
        _positions_text(lambda p: '["]", ' + json.dumps(p[1:])[1:]),
        "selected_token_pos",
    ),  # fmt: skip
    ("beyond int64", _positions_text(lambda p: json.dumps([2**63, *p[1:]])), "selected_token_pos"),
    ("only inside prefix", _move_positions_into_prefix, "selected_token_pos"),
    # the id lists the fast path keeps raw
    ("ids nested", _block_ids("[[0],1,2]"), "selected_block_ids"),
    ("ids float", _block_ids("[0,1.5,2]"), "selected_block_ids"),
    ("ids object", _block_ids('{"a":1}'), "selected_block_ids"),
    ("ids beyond int64", _block_ids("[0,1,18446744073709551615]"), "selected_block_ids"),
    (
        "hits float",
        _text_edit(b'"hit_blocks":[0,', b'"hit_blocks":[0.5,'),
        "kv_fetch.hbm.hit_blocks",
    ),  # fmt: skip
    (
        "inter string",
        _text_edit(b'"intersection_blocks":[', b'"intersection_blocks":["x",'),
        "prefix.intersection_blocks",
    ),  # fmt: skip
    # scalars
    ("int beyond int64", _text_edit(b'"rank":0', b'"rank":9223372036854775808'), "rank"),
    ("bool for int", _text_edit(b'"rank":0', b'"rank":false'), "rank"),
    (
        "int for bool",
        _text_edit(b'"prefix_cache_hit":false', b'"prefix_cache_hit":0'),
        "prefix.prefix_cache_hit",
    ),  # fmt: skip
    ("missing key", _text_edit(b'"unique_blocks":', b'"unique_blockz":'), "unique_blocks"),
]


@pytest.mark.parametrize(("name", "edit", "field"), BAD_LINES, ids=[b[0] for b in BAD_LINES])
def test_a_bad_value_the_fast_path_skips_is_named_exactly(name: str, edit: Callable, field: str) -> None:  # fmt: skip
    lines = lines_of(trace())
    lines[4] = edit(lines[4])
    stream = TraceStream(topk=32)
    stream.feed(FILE, lines, 1)
    first = stream.first
    assert first is not None, name
    assert (first["line"], first["field"]) == (5, field), first
    assert (first["request"], first["layer"], first["step"]) == (0, 1, 41), first


def test_the_cut_handles_key_order_and_whitespace() -> None:
    records = trace()
    lines = [
        _positions_first(orjson.dumps(records[0])),
        json.dumps(records[1], indent=None, separators=(" , ", " :  ")).encode(),
        json.dumps(records[2]).encode(),
    ] + lines_of(records[3:])
    stream = TraceStream(topk=32)
    stream.feed(FILE, lines, 1)
    assert stream.invalid == 0, stream.first
    dup = orjson.dumps(records[0])[:-1] + b',"selected_token_pos":[1]}'  # the key twice
    again = TraceStream(topk=32)
    again.feed(FILE, [dup], 1)
    assert again.invalid == 1  # orjson keeps the last value: one position, not 32


# -- batches, splits, digests ----------------------------------------------------------------


def _broken_trace() -> list[bytes]:
    records = trace(steps=4, layers=3, requests=2)
    records[5]["offset_p50"] += 3  # a value check fails in the middle of a step
    lines = lines_of(records)
    lines[13] = lines[13][:-40] + b"}"  # not JSON: the next layer is then missing one before it
    nested = _positions_text(lambda p: json.dumps([[p[0]], *p[1:]]))
    lines[18] = nested(lines[18])  # unreadable first layer of a step: the next ones still pass
    return lines


def _state(stream: TraceStream) -> Any:
    live = stream.live
    return (
        stream.records,
        stream.invalid,
        stream.first,
        json.dumps(stream.summary.summary(), sort_keys=True),
        live.all.tolist(),
        {k: v.tolist() for k, v in live.layers.items()},
        {k: v.tolist() for k, v in live.requests.items()},
        live.heat.tolist(),
        {r: st.state() for r, st in stream.reqs.items()},
        stream.finish(),
    )


@pytest.mark.parametrize("seed", range(4))
def test_any_split_into_batches_judges_the_same(seed: int) -> None:
    lines = _broken_trace()
    whole = TraceStream(topk=32)
    whole.feed(FILE, lines, 1)
    assert whole.invalid == 4 and whole.first["line"] == 6
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(lines)), 5))
    split = TraceStream(topk=32)
    at = 0
    for cut in [*cuts, len(lines)]:
        split.feed(FILE, lines[at:cut], at + 1)
        at = cut
    assert _state(split) == _state(whole)


def test_digests_rebuild_the_live_state_exactly() -> None:
    lines = _broken_trace() + lines_of(trace(steps=2, requests=1, seed=3))[:0]
    live = TraceStream(topk=32)
    digests = [live.feed(FILE, lines[i : i + 7], i + 1) for i in range(0, len(lines), 7)]
    replayed = TraceStream(topk=32)
    for d in digests:
        replayed.apply(FILE, json.loads(json.dumps(d)))  # as recorded in events.jsonl
    assert _state(replayed) == _state(live)


def test_a_real_size_batch_is_checked_and_digested_compactly() -> None:
    from runners.reference.dsa_trace import PrefixCacheAnalyzer, TraceConfig, build_record

    cfg = TraceConfig(out=None, run_name="r", dataset="ruler", layers=61, bytes_per_token=1152)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    info = PrefixCacheAnalyzer(256, 64).request(list(range(300)))
    lines = []
    for step in range(2):
        for layer in range(61):
            seq = 3744 + step
            pos = rng.choice(seq, size=2048, replace=False)
            rec = build_record(cfg, 0, layer, seq - 1, pos, rng.standard_normal(2048), info)
            rec["kv_fetch"]["hbm"]["latency_us"] = 400000 + step
            lines.append(orjson.dumps(rec))
    stream = TraceStream(topk=2048, layers=61)
    digest = stream.feed("/t/block64/trace_steps_0_1.jsonl", lines, 1)
    assert stream.invalid == 0, stream.first
    assert len(orjson.dumps(digest)) < 20_000  # ~12 KB for 122 records of ~11 KB each
    assert stream.summary.records == 122 and int(stream.live.all[-2]) == 122


def test_digests_recorded_before_the_dense_aggregates_still_apply() -> None:
    """tests/data/dsa_digests_before_dense.json: digests the first DSA judge recorded (summary
    lists, live bins as zlib(uint32) of every column) with what that judge computed from them."""
    data = json.loads(
        (Path(__file__).parent / "data" / "dsa_digests_before_dense.json").read_text()
    )
    stream = TraceStream(topk=32)
    for digest in data["digests"]:
        stream.apply(data["file"], digest)
    assert stream.records == data["records"]
    assert stream.summary.summary() == data["summary"]
    assert stream.live.all.tolist() == data["all"] and stream.live.heat.tolist() == data["heat"]
