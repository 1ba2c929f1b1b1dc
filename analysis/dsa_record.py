"""Seed 004 section 5.2 dsa_topk records, parsed a batch at a time and judged column by column.

Parsing: pysimdjson when installed (its arrays come out as int64 buffers, no Python int per
position), else orjson; both feed the same columns. Keys and types are checked as each record
is read; everything else is checked on whole columns with numpy (CHECKS, in order: a record's
verdict is its first failing check), so a batch of 2048-position records costs a handful of
vector passes, not a Python loop per position.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import orjson

try:  # the fast parser; without it the same checks run on orjson's dicts
    import simdjson
except ImportError:  # pragma: no cover - depends on the install
    simdjson = None

MAX_RECORD_BYTES = 1 << 20  # a 2048-position record is ~11 KB; with scores_topk ~50 KB
MAX_SEQ = 1 << 22  # no DSA model has a longer context; bounds the per-batch work
SHA1 = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True, slots=True)
class Fail:
    """Why one record is invalid: the field, what the contract expects, what was found."""

    field: str
    expected: str
    found: str


class RecordError(Exception):
    def __init__(self, fail: Fail) -> None:
        super().__init__(f"{fail.field}: expected {fail.expected}, found {fail.found}")
        self.fail = fail


INT, NUM, STR, BOOL, INTS, NUM_OR_NULL = "int", "number", "string", "bool", "ints", "num|null"
POOL = {
    "hit_blocks": INTS,
    "bytes_read": INT,
    "read_ops": INT,
    "latency_us": NUM_OR_NULL,
    "batch_size": INT,
}
# The 5.2 record. Optional (3.2 keys the 5.2 example omits; derived when absent):
# total_blocks_in_use, touched_block_ratio; and scores_topk (--trace-store-scores).
SCHEMA: dict[str, Any] = {
    "event": STR,
    "run_name": STR,
    "dataset": STR,
    "rank": INT,
    "world_size": INT,
    "request_id": INT,
    "layer_id": INT,
    "step_idx": INT,
    "seq_len_current": INT,
    "unique_token_pos_count": INT,
    "offset_min": INT,
    "offset_p50": NUM,
    "offset_max": INT,
    "block_size_tokens": INT,
    "selected_block_ids": INTS,
    "unique_blocks": INT,
    "tokens_per_touched_block": {"mean": NUM, "p50": NUM, "p95": NUM},
    "kv_fetch": {"hbm": POOL, "local_pool": POOL, "remote_pool": POOL},
    "prefix": {
        "prefix_cache_hit": BOOL,
        "prefix_cached_blocks": INT,
        "prefix_key": STR,
        "intersection_ratio": NUM,
        "intersection_blocks": INTS,
    },
    "selected_token_pos": INTS,
    "scores_stats": {"min": NUM, "mean": NUM, "max": NUM},
}
OPTIONAL = {"total_blocks_in_use": INT, "touched_block_ratio": NUM, "scores_topk": "numbers"}


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"bool {value}"
    if isinstance(value, int | float):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"string {shown!r}"
    if isinstance(value, list):
        return f"array of {len(value)}"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _kind_ok(kind: str, value: Any) -> bool:
    t = type(value)
    if kind == INT:
        return t is int
    if kind == NUM:
        return t is int or (t is float and math.isfinite(value))
    if kind == NUM_OR_NULL:
        return value is None or t is int or (t is float and math.isfinite(value))
    if kind == STR:
        return t is str
    if kind == BOOL:
        return t is bool
    if kind == INTS:
        return t is list and all(type(x) is int for x in value)
    if kind == "numbers":
        return t is list and all(type(x) in (int, float) and math.isfinite(x) for x in value)
    return False


def schema_fail(obj: Any, schema: dict[str, Any] | None = None, path: str = "") -> Fail | None:
    """The first key or type that breaks the 5.2 schema in a parsed record (None: all fine)."""
    if schema is None:
        if not isinstance(obj, dict):
            return Fail("record", "a JSON object", type_name(obj))
        for key, kind in OPTIONAL.items():
            if key in obj and not _kind_ok(kind, obj[key]):
                return Fail(key, _expect(kind), type_name(obj[key]))
        schema = SCHEMA
    for key, kind in schema.items():
        name = f"{path}{key}"
        if not isinstance(obj, dict) or key not in obj:
            return Fail(name, "present (seed 004 5.2)", "missing")
        value = obj[key]
        if isinstance(kind, dict):
            if not isinstance(value, dict):
                return Fail(name, "an object", type_name(value))
            fail = schema_fail(value, kind, name + ".")
            if fail is not None:
                return fail
        elif not _kind_ok(kind, value):
            return Fail(name, _expect(kind), type_name(value))
    return None


def _expect(kind: str) -> str:
    return {
        INTS: "an array of integers",
        "numbers": "an array of finite numbers",
        NUM: "a finite number",
        NUM_OR_NULL: "a finite number or null",
    }.get(kind, f"a{'n' if kind == INT else ''} {kind}")


# -- reading a batch ---------------------------------------------------------------------------


class _Pool(msgspec.Struct):
    hit_blocks: list[int]
    bytes_read: int
    read_ops: int
    latency_us: float | None
    batch_size: int


class _KV(msgspec.Struct):
    hbm: _Pool
    local_pool: _Pool
    remote_pool: _Pool


class _TPB(msgspec.Struct):
    mean: float
    p50: float
    p95: float


class _Prefix(msgspec.Struct):
    prefix_cache_hit: bool
    prefix_cached_blocks: int
    prefix_key: str
    intersection_ratio: float
    intersection_blocks: list[int]


class _Scores(msgspec.Struct):
    min: float
    mean: float
    max: float


class _Rest(msgspec.Struct):
    """A record without selected_token_pos (parsed apart, straight into int64)."""

    event: str
    run_name: str
    dataset: str
    rank: int
    world_size: int
    request_id: int
    layer_id: int
    step_idx: int
    seq_len_current: int
    unique_token_pos_count: int
    offset_min: int
    offset_p50: float
    offset_max: int
    block_size_tokens: int
    selected_block_ids: list[int]
    unique_blocks: int
    tokens_per_touched_block: _TPB
    kv_fetch: _KV
    prefix: _Prefix
    scores_stats: _Scores
    total_blocks_in_use: int | msgspec.UnsetType = msgspec.UNSET
    touched_block_ratio: float | msgspec.UnsetType = msgspec.UNSET
    scores_topk: list[float] | msgspec.UnsetType = msgspec.UNSET


_REST = msgspec.json.Decoder(_Rest)
_INTS = msgspec.json.Decoder(list[int])
KEY = b'"selected_token_pos"'
_WS = b" \t\r\n"

# Scalar columns, in the order _row() returns them.
COLS = (
    "request", "layer", "step", "seq", "count", "off_min", "off_p50", "off_max", "bs",
    "ublocks", "total_blocks", "tbr", "tpb_mean", "tpb_p50", "tpb_p95", "bytes", "latency",
    "hbm_batch", "pcb", "hit", "ratio", "s_min", "s_mean", "s_max", "rank", "world", "pools_ok",
    "hits_eq", "event_ok",
)  # fmt: skip
_NAN = float("nan")


@dataclass
class Batch:
    """The records of a batch that parsed with the right keys and types, as columns."""

    lines: list[int] = field(default_factory=list)
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    names: list[tuple[str, str, str]] = field(default_factory=list)  # run_name, dataset, key
    pos: list[np.ndarray] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)
    inter: list[list[int]] = field(default_factory=list)
    scores: dict[int, np.ndarray] = field(default_factory=dict)  # row -> scores_topk
    bad: list[tuple[int, Fail, tuple[int, int, int] | None]] = field(default_factory=list)
    col: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def columns(self) -> None:
        if self.rows:
            for name, values in zip(COLS, zip(*self.rows, strict=True), strict=True):
                self.col[name] = np.array(values)

    def sub(self, r0: int, r1: int) -> Batch:
        """Rows r0..r1-1 as a batch of their own (columns sliced, no copy of positions)."""
        out = Batch(
            lines=self.lines[r0:r1],
            rows=self.rows[r0:r1],
            names=self.names[r0:r1],
            pos=self.pos[r0:r1],
            blocks=self.blocks[r0:r1],
            inter=self.inter[r0:r1],
            scores={r - r0: v for r, v in self.scores.items() if r0 <= r < r1},
        )
        out.col = {k: v[r0:r1] for k, v in self.col.items()}
        return out


def split_positions(raw: bytes) -> tuple[bytes, bytes] | None:
    """(the selected_token_pos array, the record without it), or None when not simply cut."""
    i = raw.find(KEY)
    if i < 0:
        return None
    j = i + len(KEY)
    while j < len(raw) and raw[j] in _WS:
        j += 1
    if j >= len(raw) or raw[j] != 58:  # ":"
        return None
    j += 1
    while j < len(raw) and raw[j] in _WS:
        j += 1
    k = raw.find(b"]", j)
    if j >= len(raw) or raw[j] != 91 or k < 0:  # "["
        return None
    h = i - 1
    while h >= 0 and raw[h] in _WS:
        h -= 1
    if h >= 0 and raw[h] == 44:  # "," before the key
        rest = raw[:h] + raw[k + 1 :]
        return (raw[j : k + 1], rest) if rest.find(KEY) < 0 else None
    if h >= 0 and raw[h] == 123:  # "{": the first key; drop the comma after the array
        t = k + 1
        while t < len(raw) and raw[t] in _WS:
            t += 1
        rest = raw[:i] + raw[t + 1 :] if t < len(raw) and raw[t] == 44 else raw[:i] + raw[k + 1 :]
        return (raw[j : k + 1], rest) if rest.find(KEY) < 0 else None
    return None


def _positions(data: bytes, parser: Any) -> np.ndarray:
    if parser is None:
        return np.array(_INTS.decode(data), dtype=np.int64)
    doc = parser.parse(data)
    try:
        if type(doc) is not simdjson.Array:
            raise TypeError
        out = np.frombuffer(doc.as_buffer(of_type="i"), dtype=np.int64)
        if len(out) != len(doc) or (len(doc) and type(doc[0]) is not int):
            raise TypeError  # nested arrays flatten in as_buffer: refuse them
        return out
    finally:
        del doc


def _row(r: _Rest) -> tuple[Any, ...]:
    tpb, hbm, pre, ss = r.tokens_per_touched_block, r.kv_fetch.hbm, r.prefix, r.scores_stats
    loc, rem = r.kv_fetch.local_pool, r.kv_fetch.remote_pool
    total, tbr = r.total_blocks_in_use, r.touched_block_ratio
    return (
        r.request_id, r.layer_id, r.step_idx, r.seq_len_current, r.unique_token_pos_count,
        r.offset_min, r.offset_p50, r.offset_max, r.block_size_tokens, r.unique_blocks,
        -1 if total is msgspec.UNSET else total, _NAN if tbr is msgspec.UNSET else tbr,
        tpb.mean, tpb.p50, tpb.p95, hbm.bytes_read,
        _NAN if hbm.latency_us is None else hbm.latency_us, hbm.batch_size,
        pre.prefix_cached_blocks, pre.prefix_cache_hit, pre.intersection_ratio, ss.min, ss.mean,
        ss.max, r.rank, r.world_size,
        loc.batch_size == len(loc.hit_blocks) and rem.batch_size == len(rem.hit_blocks),
        hbm.hit_blocks == r.selected_block_ids, r.event == "dsa_topk",
    )  # fmt: skip


def read_batch(lines: list[bytes], first_line: int) -> Batch:
    """Parse lines (numbered from first_line) into a Batch; bad ones go to Batch.bad."""
    batch = Batch()
    parser = simdjson.Parser() if simdjson is not None else None
    for n, raw in enumerate(lines, start=first_line):
        if len(raw) > MAX_RECORD_BYTES:
            fail = Fail("record", f"at most {MAX_RECORD_BYTES} bytes", f"{len(raw)} bytes")
            batch.bad.append((n, fail, None))
            continue
        parts = split_positions(raw)
        try:
            if parts is None:
                raise ValueError
            rest = _REST.decode(parts[1])
            pos = _positions(parts[0], parser)
        except (TypeError, ValueError, msgspec.DecodeError):
            slow = _slow(n, raw)
            if isinstance(slow, tuple):
                batch.bad.append(slow)
                continue
            rest, pos = slow
        if rest.scores_topk is not msgspec.UNSET:
            batch.scores[len(batch.rows)] = np.asarray(rest.scores_topk, dtype=np.float64)
        batch.lines.append(n)
        batch.rows.append(_row(rest))
        batch.names.append((rest.run_name, rest.dataset, rest.prefix.prefix_key))
        batch.pos.append(pos)
        batch.blocks.append(rest.selected_block_ids)
        batch.inter.append(rest.prefix.intersection_blocks)
    batch.columns()
    return batch


def _slow(
    n: int, raw: bytes
) -> tuple[_Rest, np.ndarray] | tuple[int, Fail, tuple[int, int, int] | None]:
    """The exact path for a line the fast one refused: its record, or why it is none."""
    if not raw.strip():
        return n, Fail("record", "a dsa_topk JSON object", "an empty line"), None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return n, Fail("record", "one JSON object per line", f"not valid JSON ({exc})"), None
    fail = schema_fail(obj)
    if fail is None:
        try:
            pos = np.array(obj.pop("selected_token_pos"), dtype=np.int64)
            return msgspec.convert(obj, _Rest), pos
        except (msgspec.ValidationError, OverflowError, ValueError) as exc:
            fail = Fail("record", "values that fit 64-bit integers and floats", str(exc))
    ident = None
    if isinstance(obj, dict):
        parts = [obj.get(k) for k in ("request_id", "layer_id", "step_idx")]
        if all(type(p) is int for p in parts):
            ident = (parts[0], parts[1], parts[2])
    return n, fail, ident
