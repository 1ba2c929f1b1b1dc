"""DSA trace records as Arrow tables: one row per line of a shard, the seed's nesting kept.

Every line becomes a row, in file order: a record that validates (analysis.dsa_scan: the
validator's parser and per-record checks) has valid = true; one that does not has valid =
false and its reason (field, expected, found), and keeps every value it has; a line that
parsed to no record keeps its text (raw), so nothing is dropped. The record's objects
(tokens_per_touched_block, kv_fetch, prefix, scores_stats) are struct columns and its arrays
list columns, so a row read back from parquet is the JSON record; csv flattens them (dotted
names, arrays as JSON text). shard, line, request_id, layer_id and step_idx locate a row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from analysis.dsa_record import Ragged, _Pool
from analysis.dsa_scan import Scanned, TraceInfo, scan_span

I64, F64, STR, BOOL = pa.int64(), pa.float64(), pa.string(), pa.bool_()
IDS = pa.list_(I64)
POOL = pa.struct(
    [
        ("hit_blocks", IDS),
        ("bytes_read", I64),
        ("read_ops", I64),
        ("latency_us", F64),
        ("batch_size", I64),
    ]
)
SCHEMA = pa.schema(
    [
        ("shard", STR),
        ("line", I64),
        ("valid", BOOL),
        ("invalid_field", STR),
        ("invalid_expected", STR),
        ("invalid_found", STR),
        ("raw", STR),  # only for a line that parsed to no record
        ("event", STR),
        ("run_name", STR),
        ("dataset", STR),
        ("rank", I64),
        ("world_size", I64),
        ("request_id", I64),
        ("layer_id", I64),
        ("step_idx", I64),
        ("seq_len_current", I64),
        ("unique_token_pos_count", I64),
        ("offset_min", I64),
        ("offset_p50", F64),
        ("offset_max", I64),
        ("block_size_tokens", I64),
        ("selected_block_ids", IDS),
        ("unique_blocks", I64),
        ("total_blocks_in_use", I64),  # optional in the record: null when absent
        ("touched_block_ratio", F64),  # optional: null when absent
        ("tokens_per_touched_block", pa.struct([("mean", F64), ("p50", F64), ("p95", F64)])),
        ("kv_fetch", pa.struct([("hbm", POOL), ("local_pool", POOL), ("remote_pool", POOL)])),
        (
            "prefix",
            pa.struct(
                [
                    ("prefix_cache_hit", BOOL),
                    ("prefix_cached_blocks", I64),
                    ("prefix_key", STR),
                    ("intersection_ratio", F64),
                    ("intersection_blocks", IDS),
                ]
            ),
        ),
        ("selected_token_pos", IDS),
        ("scores_stats", pa.struct([("min", F64), ("mean", F64), ("max", F64)])),
        ("scores_topk", pa.list_(F64)),  # optional (--trace-store-scores): null when absent
    ]
)
RECORD_KEYS = [f.name for f in SCHEMA][7:]


def _leaves(t: pa.StructType | pa.Schema, prefix: str = "") -> list[str]:
    """The parquet column paths of a schema's leaves ("kv_fetch.hbm.hit_blocks.list.element")."""
    out = []
    for f in t:
        name = prefix + f.name
        if pa.types.is_struct(f.type):
            out += _leaves(f.type, name + ".")
        else:
            out.append(name + ".list.element" if pa.types.is_list(f.type) else name)
    return out


_INT_LISTS = [
    c for c in _leaves(SCHEMA) if c.endswith(".list.element") and not c.startswith("scores_topk.")
]
# The writer's options, measured on top-2048 records (bench/bench_dsa_data.py): the lists of
# integers (sorted positions and block ids) delta-encoded, which packs them to a few bits a
# value with no dictionary to build, so snappy does as well as zstd on what is left and is
# faster (~16 against ~21 us a record to write; a reader decodes it ~8x faster than the
# dictionary-encoded positions). Min/max statistics for every column but the positions (0 ..
# seq_len in every row group: no use to a reader's filter, and ~2,000 values a row to scan).
PARQUET_OPTIONS: dict[str, Any] = {
    "compression": "snappy",
    "use_dictionary": [c for c in _leaves(SCHEMA) if c not in _INT_LISTS],
    "column_encoding": dict.fromkeys(_INT_LISTS, "DELTA_BINARY_PACKED"),
    "write_statistics": [c for c in _leaves(SCHEMA) if not c.startswith("selected_token_pos.")],
}


def _ints_as_text(t: pa.DataType) -> pa.DataType:
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _ints_as_text(f.type)) for f in t])
    return STR if pa.types.is_list(t) and pa.types.is_integer(t.value_type) else t


# The csv's lists of integers are JSON text: record_table(s, json_lists=True) makes them so at
# once (from the lines' own text where it is that text), flat_for_csv flattens the rest.
CSV_SOURCE = pa.schema([pa.field(f.name, _ints_as_text(f.type)) for f in SCHEMA])
TEXT_POOL = _ints_as_text(POOL)


def _as_encoded(text: bytes) -> bool:
    """A JSON array of integers that msgspec would write as this very text: no space, no -0
    (a two-byte search is slow: looked for only where a minus sign is)."""
    if b" " in text or b"\n" in text or b"\t" in text or b"\r" in text:
        return False
    return b"-" not in text or b"-0" not in text


_UNUSED_POOL = _Pool([], 0, 0, None, 0)


def _lists(r: Ragged, rows: list[int] | None = None) -> pa.Array:
    if rows is not None:
        r = Ragged.of([r[i] for i in rows])
    offsets = np.zeros(len(r.lens) + 1, dtype=np.int32)
    np.cumsum(r.lens, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(r.flat, type=I64))


def _pool(pools: list[_Pool], json_lists: bool = False) -> pa.StructArray:
    hits = [p.hit_blocks for p in pools]
    return pa.StructArray.from_arrays(
        [
            pa.array([msgspec.json.encode(h) for h in hits], STR)
            if json_lists
            else pa.array(hits, type=IDS),
            pa.array([p.bytes_read for p in pools], type=I64),
            pa.array([p.read_ops for p in pools], type=I64),
            pa.array([p.latency_us for p in pools], type=F64),
            pa.array([p.batch_size for p in pools], type=I64),
        ],
        fields=list(TEXT_POOL if json_lists else POOL),
    )


def _unused_pool(n: int, json_lists: bool = False) -> pa.StructArray:
    """n unused tiers (the HBM-only demo's all-zero placeholders), without a Python list."""
    zeros = pa.array(np.zeros(n, np.int64))
    if json_lists:
        offsets = pa.py_buffer(np.arange(0, 2 * n + 1, 2, dtype=np.int32))
        empty = pa.Array.from_buffers(STR, n, [None, offsets, pa.py_buffer(b"[]" * n)])
    else:
        empty = pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], I64))
    fields = list(TEXT_POOL if json_lists else POOL)
    return pa.StructArray.from_arrays([empty, zeros, zeros, pa.nulls(n, F64), zeros], fields=fields)


def _json_lists(texts: list[Any], values: Ragged) -> pa.Array:
    """Each row's list of integers as flat_for_csv writes it ("[1,2,3]", msgspec's text): the
    array as its line wrote it (texts[r]) where that is this very text (no space, no -0),
    else encoded from the parsed values (a text of None: the line was read otherwise)."""
    n = len(values)
    if len(texts) != n:
        texts = [None] * n
    whole = b"".join(texts) if None not in texts else None
    if whole is None or not _as_encoded(whole):
        texts = [
            t
            if t is not None and _as_encoded(bytes(t))
            else msgspec.json.encode(values[r].tolist())
            for r, t in enumerate(texts)
        ]
        whole = b"".join(texts)
    # one chunk's text (a few MiB: READ_CHUNK and a line of at most MAX_RECORD_BYTES) fits a
    # string array's 32-bit offsets
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, texts), np.int64, n), out=offsets[1:])
    return pa.Array.from_buffers(STR, n, [None, pa.py_buffer(offsets), pa.py_buffer(whole)])


def record_table(s: Scanned, json_lists: bool = False) -> pa.Table:
    """The chunk's lines as rows of SCHEMA, in line order (json_lists: of CSV_SOURCE, whose
    lists of integers are the JSON text flat_for_csv makes of them)."""
    schema = CSV_SOURCE if json_lists else SCHEMA
    parts = []
    if len(s.batch):
        parts.append(_parsed(s, json_lists))
    if s.bad:
        parts.append(_unparsed(s, schema))
    if not parts:
        return schema.empty_table()
    table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    return table.sort_by("line") if len(parts) > 1 else table


def _parsed(s: Scanned, json_lists: bool = False) -> pa.Table:
    """The rows that parsed, from the scan's one parse of each line (no second read)."""
    b = s.batch
    c = b.col
    n = len(b)
    invalid = np.flatnonzero(~s.valid).tolist()
    if invalid:
        reason = {r: s.fail(r) for r in invalid}
        reasons = [
            pa.array([reason[r].field if r in reason else None for r in range(n)], STR),
            pa.array([reason[r].expected if r in reason else None for r in range(n)], STR),
            pa.array([reason[r].found if r in reason else None for r in range(n)], STR),
        ]
    else:
        reasons = [pa.nulls(n, STR)] * 3

    def ids(values: Ragged, texts: list[Any]) -> pa.Array:
        return _json_lists(texts, values) if json_lists else _lists(values)

    blocks = ids(b.blocks, b.blocks_text)
    hbm_hits = blocks
    if b.hits:  # a hit list written otherwise than selected_block_ids: its own ids
        own = Ragged.of([b.hits.get(r, b.blocks[r]) for r in range(n)])
        texts = b.blocks_text if len(b.blocks_text) == n else [None] * n
        hbm_hits = ids(own, [None if r in b.hits else t for r, t in enumerate(texts)])
    names = list(zip(*b.names, strict=True)) if n else [[], [], []]
    ratio = c["tbr"]
    hbm = pa.StructArray.from_arrays(
        [
            hbm_hits,
            pa.array(c["bytes"]),
            pa.array(c["hbm_ops"]),
            pa.array(c["latency"], mask=np.isnan(c["latency"])),
            pa.array(c["hbm_batch"]),
        ],
        fields=list(TEXT_POOL if json_lists else POOL),
    )
    if all(loc == _UNUSED_POOL and rem == _UNUSED_POOL for loc, rem in b.pools):
        local = remote = _unused_pool(n, json_lists)
    else:
        local = _pool([loc for loc, _ in b.pools], json_lists)
        remote = _pool([rem for _, rem in b.pools], json_lists)
    if b.scores:
        scores = pa.array(
            [b.scores[r].tolist() if r in b.scores else None for r in range(n)], pa.list_(F64)
        )
    else:
        scores = pa.nulls(n, pa.list_(F64))
    cols: dict[str, Any] = {
        "shard": pa.array([s.file.name] * n, type=STR),
        "line": pa.array(b.lines, type=I64),
        "valid": pa.array(s.valid, type=BOOL),
        "invalid_field": reasons[0],
        "invalid_expected": reasons[1],
        "invalid_found": reasons[2],
        "raw": pa.nulls(n, STR),
        "event": pa.array(b.events, STR),
        "run_name": pa.array(names[0], STR),
        "dataset": pa.array(names[1], STR),
        "rank": pa.array(c["rank"]),
        "world_size": pa.array(c["world"]),
        "request_id": pa.array(c["request"]),
        "layer_id": pa.array(c["layer"]),
        "step_idx": pa.array(c["step"]),
        "seq_len_current": pa.array(c["seq"]),
        "unique_token_pos_count": pa.array(c["count"]),
        "offset_min": pa.array(c["off_min"]),
        "offset_p50": pa.array(c["off_p50"]),
        "offset_max": pa.array(c["off_max"]),
        "block_size_tokens": pa.array(c["bs"]),
        "selected_block_ids": blocks,
        "unique_blocks": pa.array(c["ublocks"]),
        "total_blocks_in_use": pa.array(c["total_blocks"], mask=~c["has_total"]),
        "touched_block_ratio": pa.array(ratio, mask=np.isnan(ratio)),
        "tokens_per_touched_block": pa.StructArray.from_arrays(
            [pa.array(c["tpb_mean"]), pa.array(c["tpb_p50"]), pa.array(c["tpb_p95"])],
            names=["mean", "p50", "p95"],
        ),
        "kv_fetch": pa.StructArray.from_arrays(
            [hbm, local, remote], names=["hbm", "local_pool", "remote_pool"]
        ),
        "prefix": pa.StructArray.from_arrays(
            [
                pa.array(c["hit"].astype(bool)),
                pa.array(c["pcb"]),
                pa.array(names[2], STR),
                pa.array(c["ratio"]),
                ids(b.inter, b.inter_text),
            ],
            names=[
                "prefix_cache_hit",
                "prefix_cached_blocks",
                "prefix_key",
                "intersection_ratio",
                "intersection_blocks",
            ],
        ),
        "selected_token_pos": ids(b.pos, b.pos_text),
        "scores_stats": pa.StructArray.from_arrays(
            [pa.array(c["s_min"]), pa.array(c["s_mean"]), pa.array(c["s_max"])],
            names=["min", "mean", "max"],
        ),
        "scores_topk": scores,
    }
    schema = CSV_SOURCE if json_lists else SCHEMA
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


class ExportChunk:
    """The export's work on one chunk (any process): its lines as one table of SCHEMA (csv: of
    CSV_SOURCE, for csv_rows; or, with text, csv_rows of it), its rows, and how many of them
    are invalid."""

    def __init__(self, info: TraceInfo, csv: bool = False, text: bool = False) -> None:
        self.info = info
        self.csv = csv
        self.text = text  # worker processes make the text: the writer then only appends

    def __call__(
        self, path: str, lines: list[bytes], first_line: int, torn: bool
    ) -> tuple[pa.Table | pa.Buffer, int, int]:
        tables, invalid = [], 0
        for s in scan_span(self.info, Path(path), lines, first_line, torn):
            tables.append(record_table(s, json_lists=self.csv))
            invalid += int((~s.valid).sum()) + len(s.bad)
        schema = CSV_SOURCE if self.csv else SCHEMA
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0] if tables else schema.empty_table()  # fmt: skip
        return csv_rows(table) if self.text else table, table.num_rows, invalid


def csv_rows(table: pa.Table) -> pa.Buffer:
    """A chunk's table as header-less csv rows: the chunks' rows joined in order are the
    file's body, so the writer only appends."""
    return csv_text(flat_for_csv(table), header=False)


def csv_text(table: pa.Table, header: bool) -> pa.Buffer:
    """The table as csv, as one csv writer of the whole export writes it (a buffer a file
    writes as it is: no copy into a bytes object)."""
    out = pa.BufferOutputStream()
    pacsv.write_csv(table, out, pacsv.WriteOptions(include_header=header))
    return out.getvalue()


def _unparsed(s: Scanned, schema: pa.Schema = SCHEMA) -> pa.Table:
    """Lines that are no record: their place, reason and text; the id where it was readable."""
    n = len(s.bad)
    cols: dict[str, Any] = {name: pa.nulls(n, schema.field(name).type) for name in schema.names}
    cols["shard"] = pa.array([s.file.name] * n, STR)
    cols["line"] = pa.array([line for line, _, _ in s.bad], I64)
    cols["valid"] = pa.array([False] * n, BOOL)
    cols["invalid_field"] = pa.array([f.field for _, f, _ in s.bad], STR)
    cols["invalid_expected"] = pa.array([f.expected for _, f, _ in s.bad], STR)
    cols["invalid_found"] = pa.array([f.found for _, f, _ in s.bad], STR)
    cols["raw"] = pa.array([s.raw(line).decode("utf-8", "replace") for line, _, _ in s.bad], STR)
    for i, name in enumerate(("request_id", "layer_id", "step_idx")):
        cols[name] = pa.array([ident[i] if ident else None for _, _, ident in s.bad], I64)
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def flat_for_csv(table: pa.Table) -> pa.Table:
    """Structs as dotted columns, lists as JSON text (csv has neither)."""
    flat = table
    while any(pa.types.is_struct(f.type) for f in flat.schema):
        flat = flat.flatten()
    cols = []
    for col in flat.columns:
        if pa.types.is_list(col.type) and pa.types.is_integer(col.type.value_type):
            col = pa.chunked_array([_int_lists_json(a) for a in col.chunks], STR)
        elif pa.types.is_list(col.type) and col.null_count == len(col):
            col = pa.nulls(len(col), STR)
        elif pa.types.is_list(col.type):
            values = col.to_pylist()
            col = pa.array(
                [None if v is None else msgspec.json.encode(v).decode() for v in values], STR
            )
        cols.append(col)
    return pa.Table.from_arrays(cols, names=flat.column_names)


def _int_lists_json(lists: pa.ListArray) -> pa.Array:
    """Each list of integers as its JSON text ("[1,2,3]", msgspec's), null as null; in Arrow's
    kernels (no Python int per value: a record holds thousands)."""
    offsets = lists.offsets
    start = offsets[0].as_py()  # a slice's offsets point into its parent's values
    offsets = pc.subtract(offsets, pa.scalar(start, offsets.type))
    values = lists.values.slice(start, offsets[-1].as_py())
    text = pa.ListArray.from_arrays(offsets, pc.cast(values, STR), mask=lists.is_null())
    return pc.binary_join_element_wise(_OPEN, pc.binary_join(text, _COMMA), _CLOSE, _NOTHING)


# Typed scalars: a Python str becomes one through type inference, which tries to import
# dateutil (absent: ~75 us an attempt, several per call).
_OPEN, _COMMA, _CLOSE, _NOTHING = (pa.scalar(t, STR) for t in ("[", ",", "]", ""))
