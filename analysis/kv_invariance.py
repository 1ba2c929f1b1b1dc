"""03C KV-cache invariance (seed 002): a grid cell's flows compared byte for byte, and the grid.

A cell is one grid point (D, KV, B, GQA, mask, ALiBi, sinks). The engine leaves in its directory
``result.json`` (what it ran: shapes, dtype, flow order, sha256) and ``flows.bin`` (the last
token's attention output [B, H, D] of each flow, flow after flow). A cell is:

- ``BITWISE_EQUAL``: every flow's bytes equal the single-shot flow's (memcmp, no tolerance);
- ``DIFFERS``: some flow's bytes do not; the first differing element (flow pair, batch row,
  head, index), how many elements differ, max |Δ| and max distance in ULPs are named;
- ``PRECONDITION``: the engine refused a call that breaks the deterministic policy (KV length a
  multiple of 256, mask padded to 64) and said which rule and how to fix it;
- ``UNJUDGED``: no verdict, and why (class engine / infra / output / input / not_run, as in
  analysis.equivalence: engine crashed or wrote nothing, artifact not brought home, a result
  that breaks the contract, a tree handed to analyze that is broken, a cell never run).

Global: ``PASS_INVARIANCE`` (exit 0) only when every cell is BITWISE_EQUAL. Otherwise, first
match wins: any DIFFERS -> ``FAIL_INVARIANCE`` (1); any PRECONDITION ->
``PRECONDITION_VIOLATED`` (1); an unjudged cell -> its class's word (ENGINE_ERROR 3,
INFRA_ERROR 3, FAIL_INVARIANCE 1 for output or not_run, INPUT_ERROR 2); no cell -> FAIL_INVARIANCE.

Pure: reads what it is given, writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from analysis.json_once import GivenTwice, once

FORMAT = "tracedeck.kv_invariance/1"
RESULT, FLOWS = "result.json", "flows.bin"
SUMMARY = "kv_invariance_summary.json"
PRECONDITION_MARK = "KV_INVARIANCE_PRECONDITION"
EXIT_PRECONDITION = 4  # the engine's exit code for a precondition abort (runners.reference)
CHUNK_GATE = "RUN_KVCACHE_CHUNK_TESTS"

BITWISE_EQUAL, DIFFERS, PRECONDITION, UNJUDGED = (
    "BITWISE_EQUAL",
    "DIFFERS",
    "PRECONDITION",
    "UNJUDGED",
)
CELL_WORDS = (BITWISE_EQUAL, DIFFERS, PRECONDITION, UNJUDGED)
PASS_INVARIANCE, FAIL_INVARIANCE = "PASS_INVARIANCE", "FAIL_INVARIANCE"
PRECONDITION_VIOLATED = "PRECONDITION_VIOLATED"
ENGINE_ERROR, INFRA_ERROR, INPUT_ERROR = "ENGINE_ERROR", "INFRA_ERROR", "INPUT_ERROR"
VERDICT_EXIT = {
    PASS_INVARIANCE: 0,
    FAIL_INVARIANCE: 1,
    PRECONDITION_VIOLATED: 1,
    INPUT_ERROR: 2,
    ENGINE_ERROR: 3,
    INFRA_ERROR: 3,
}
CLASSES = ("engine", "infra", "output", "not_run", "input")
CLASS_VERDICT = {
    "engine": ENGINE_ERROR,
    "infra": INFRA_ERROR,
    "output": FAIL_INVARIANCE,
    "not_run": FAIL_INVARIANCE,
    "input": INPUT_ERROR,
}

POINT_KEYS = ("d", "kv", "b", "gqa", "mask", "alibi", "sinks")
BASE_FLOWS = ("single", "incremental")
CHUNK_FLOWS = ("chunk8", "chunk33")
KNOWN_FLOWS = (*BASE_FLOWS, *CHUNK_FLOWS, "alone")
REFERENCE_FLOW = "single"
# The seed's deterministic policy: the KV length presented to attention is a multiple of
# FATTN_KQ_STRIDE, and the mask's rows are padded to GGML_KQ_MASK_PAD.
FATTN_KQ_STRIDE, GGML_KQ_MASK_PAD = 256, 64
DETERMINISTIC = "GGML_DETERMINISTIC"
# A cell's dtype parameter (the reference engine's --dtype) -> the dtype its result names.
DTYPE_PARAMS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# dtype name -> (bytes per element, how values are read)
DTYPES: dict[str, tuple[int, str]] = {
    "float32": (4, "f4"),
    "bfloat16": (2, "bf16"),
    "float16": (2, "f2"),
}


class ResultError(ValueError):
    """A result that cannot be judged; str() is 'WHERE: what — what to do'."""

    def __init__(self, where: str, message: str, klass: str = "output") -> None:
        super().__init__(f"{where}: {message}")
        self.klass = klass


# ---------------------------------------------------------------- grid points


def point_of(params: dict[str, Any]) -> dict[str, int]:
    """A grid point from a cell's parameters (or a result's "point"); KeyError when one lacks."""
    return {k: int(params[k]) for k in POINT_KEYS}


def point_label(point: dict[str, Any], source: str = "") -> str:
    if not point:
        return f"{source} (grid point unknown)" if source else "(grid point unknown)"
    text = " ".join(f"{k}={point.get(k)}" for k in POINT_KEYS)
    return f"{source} {text}" if source else text


def point_dir(point: dict[str, Any]) -> str:
    """The directory name the shipped presets give a cell: d64_kv256_b1_gqa1_mask1_alibi0_sinks0."""
    return "_".join(f"{k}{point[k]}" for k in POINT_KEYS)


def required_flows(point: dict[str, Any], chunk_tests: bool) -> list[str]:
    flows = list(BASE_FLOWS)
    if chunk_tests:
        flows += CHUNK_FLOWS
    if int(point["b"]) > 1:
        flows.append("alone")
    return flows


# ---------------------------------------------------------------- one cell's verdict


@dataclass
class CellResult:
    point: dict[str, int]
    verdict: str
    source: str = ""  # "" for the reference engine; a llama.cpp backend name otherwise
    detail: dict[str, Any] = field(default_factory=dict)
    reason: str = ""  # PRECONDITION: the rule's message; UNJUDGED: why
    klass: str = ""  # UNJUDGED: engine | infra | output | not_run | input
    where: str = ""  # the cell's directory (or log) it was judged from

    def to_json(self) -> dict[str, Any]:
        return {
            "point": dict(self.point),
            "source": self.source,
            "verdict": self.verdict,
            "detail": self.detail,
            "reason": self.reason,
            "class": self.klass,
            "where": self.where,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CellResult:
        return cls(
            point=dict(data["point"]),
            verdict=str(data["verdict"]),
            source=str(data.get("source", "")),
            detail=dict(data.get("detail") or {}),
            reason=str(data.get("reason", "")),
            klass=str(data.get("class", "")),
            where=str(data.get("where", "")),
        )


def unjudged(point: dict[str, int], klass: str, why: str, source: str = "") -> CellResult:
    return CellResult(point, UNJUDGED, source=source, reason=why, klass=klass)


def precondition_result(
    point: dict[str, int], record: dict[str, Any], where: str = ""
) -> CellResult:
    """A PRECONDITION verdict from the engine's record (rule, message, fix, where)."""
    return CellResult(
        point,
        PRECONDITION,
        detail={
            "rule": str(record.get("rule", "")),
            "fix": str(record.get("fix", "")),
            "at": str(record.get("where", "")),
        },
        reason=str(record.get("message", "")),
        where=where,
    )


def parse_precondition_line(line: str) -> dict[str, Any] | None:
    """The engine's stdout record of a precondition abort, or None for any other line."""
    if not line.startswith(PRECONDITION_MARK + " "):
        return None
    try:
        record = json.loads(line[len(PRECONDITION_MARK) + 1 :])
    except ValueError:
        return None
    if not isinstance(record, dict) or not all(
        isinstance(record.get(k), str) and record.get(k) for k in ("rule", "message", "fix")
    ):
        return None
    return record


# ---------------------------------------------------------------- reading a cell's files


def read_meta(cell_dir: Path) -> dict[str, Any]:
    where = str(cell_dir / RESULT)
    try:
        raw = (cell_dir / RESULT).read_bytes()
    except FileNotFoundError:
        raise ResultError(
            where, "no result.json: the engine wrote no result for this cell", "engine"
        ) from None
    try:
        meta = json.loads(raw, object_pairs_hook=once)
    except GivenTwice as exc:
        raise ResultError(
            where,
            f"key {exc.args[0]!r} is given twice ({exc.args[1]!r}, then {exc.args[2]!r}): a "
            "result that says two things is believed in neither reading",
        ) from None
    except ValueError as exc:
        raise ResultError(
            where, f"not valid JSON ({exc}); the engine wrote a broken result"
        ) from None
    if not isinstance(meta, dict):
        raise ResultError(where, "not a JSON object")
    if meta.get("format") != FORMAT:
        raise ResultError(where, f"format is {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


# what each of a point's values may be: the flags 0 or 1, the sizes at least 1
FLAGS = ("mask", "alibi", "sinks")


def check_point(meta: dict[str, Any], expect: dict[str, int] | None, where: str) -> dict[str, int]:
    """The result's point, each value an integer as the grid has it (never coerced: 256.9,
    "256" or true is no point), the sizes at least 1 and the flags 0 or 1; it must be the
    cell's (expect) when that is known."""
    got = meta.get("point")
    ok = isinstance(got, dict) and all(
        type(got.get(k)) is int and (got[k] in (0, 1) if k in FLAGS else got[k] >= 1)
        for k in POINT_KEYS
    )
    if not ok:
        raise ResultError(
            where,
            f"'point' must hold {', '.join(POINT_KEYS)} as integers ({', '.join(FLAGS)} 0 or 1, "
            f"the others at least 1); got {got!r}",
        )
    point = {k: got[k] for k in POINT_KEYS}
    if expect is not None and point != expect:
        raise ResultError(
            where,
            f"the result is for {point_label(point)}, but this cell is {point_label(expect)}",
        )
    return point


def load_flows(
    cell_dir: Path, meta: dict[str, Any], point: dict[str, int], chunk_tests: bool | None
) -> tuple[dict[str, bytes], str, tuple[int, int, int]]:
    """Every flow's bytes, checked against result.json; (flows, dtype name, shape)."""
    where = str(cell_dir / RESULT)
    dtype = meta.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ResultError(where, f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    shape = meta.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
    ):
        raise ResultError(where, f"'shape' must be [B, H, D] of positive integers; got {shape!r}")
    if shape[0] != point["b"] or shape[2] != point["d"]:
        raise ResultError(
            where, f"shape {shape} does not fit b={point['b']} d={point['d']} (want [B, H, D])"
        )
    flows = meta.get("flows")
    if (
        not isinstance(flows, list)
        or not flows
        or not all(isinstance(f, str) for f in flows)
        or len(set(flows)) != len(flows)
    ):
        raise ResultError(where, f"'flows' must be a list of distinct flow names; got {flows!r}")
    unknown = [f for f in flows if f not in KNOWN_FLOWS]
    if unknown:
        raise ResultError(where, f"unknown flow(s) {unknown}; known: {', '.join(KNOWN_FLOWS)}")
    engine_chunks = meta.get("chunk_tests")
    if chunk_tests is not None and engine_chunks is not None and bool(engine_chunks) != chunk_tests:
        raise ResultError(
            where,
            f"{CHUNK_GATE} is {'1' if chunk_tests else 'unset'} for this cell but the engine ran "
            f"{'without' if chunk_tests else 'with'} the chunked flows",
        )
    gate = chunk_tests if chunk_tests is not None else bool(engine_chunks)
    missing = [f for f in required_flows(point, gate) if f not in flows]
    if missing:
        raise ResultError(where, f"flow(s) {', '.join(missing)} missing: the cell needs them")
    size, _ = DTYPES[dtype]
    per_flow = shape[0] * shape[1] * shape[2] * size
    if meta.get("flow_bytes") != per_flow:
        raise ResultError(
            where,
            f"flow_bytes is {meta.get('flow_bytes')!r}; shape {shape} of {dtype} is {per_flow}",
        )
    order = meta.get("byte_order", "little")
    if order not in ("little", "big"):
        raise ResultError(where, f"byte_order {order!r} is neither little nor big")
    bin_path = cell_dir / FLOWS
    try:
        payload = bin_path.read_bytes()
    except FileNotFoundError:
        raise ResultError(
            str(bin_path), "missing: result.json names flows but flows.bin is not here"
        ) from None
    if len(payload) != per_flow * len(flows):
        raise ResultError(
            str(bin_path),
            f"{len(payload)} bytes; result.json promises {len(flows)} flows x {per_flow} bytes "
            f"= {per_flow * len(flows)} (truncated or from another run)",
        )
    sha = meta.get("flows_sha256")
    if sha is not None and hashlib.sha256(payload).hexdigest() != sha:
        raise ResultError(str(bin_path), "sha256 differs from result.json's flows_sha256")
    out = {f: payload[i * per_flow : (i + 1) * per_flow] for i, f in enumerate(flows)}
    if order == "big":
        out = {f: _swap(b, size) for f, b in out.items()}
    return out, dtype, (shape[0], shape[1], shape[2])


def _swap(data: bytes, size: int) -> bytes:
    return np.frombuffer(data, dtype=f">u{size}").astype(f"<u{size}").tobytes()


def values(data: bytes, dtype: str) -> np.ndarray:
    """Little-endian raw bytes as float64 values (bf16 widened exactly)."""
    if dtype == "bfloat16":
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return np.frombuffer(data, dtype="<f4" if dtype == "float32" else "<f2").astype(np.float64)


def ordered(data: bytes, dtype: str) -> np.ndarray:
    """Raw bits as integers in the order of the values they encode (-0 and +0 both 0)."""
    size = DTYPES[dtype][0]
    bits = np.frombuffer(data, dtype=f"<i{size}").astype(np.int64)
    magnitude = bits & ((1 << (8 * size - 1)) - 1)
    return np.where(bits < 0, -magnitude, magnitude)


def _unravel(flat: int, shape: tuple[int, int, int]) -> tuple[int, int, int]:
    b, rest = divmod(flat, shape[1] * shape[2])
    h, i = divmod(rest, shape[2])
    return int(b), int(h), int(i)


def check_finite(
    flows: dict[str, bytes], dtype: str, shape: tuple[int, int, int], where: str
) -> None:
    for name, data in flows.items():
        vals = values(data, dtype)
        bad = np.flatnonzero(~np.isfinite(vals))
        if bad.size:
            b, h, i = _unravel(int(bad[0]), shape)
            raise ResultError(
                where,
                f"flow {name} holds {vals[bad[0]]} at batch {b} head {h} index {i} "
                f"({bad.size} non-finite value(s)): an output that is not a number cannot pass",
            )


def compare(
    ref: bytes, other: bytes, dtype: str, shape: tuple[int, int, int]
) -> dict[str, Any] | None:
    """None when the bytes are equal; else the first differing element and the spread."""
    if ref == other:
        return None
    size = DTYPES[dtype][0]
    a_bits = np.frombuffer(ref, dtype=f"<u{size}")
    b_bits = np.frombuffer(other, dtype=f"<u{size}")
    differ = np.flatnonzero(a_bits != b_bits)
    a, b = values(ref, dtype), values(other, dtype)
    ulps = np.abs(ordered(ref, dtype) - ordered(other, dtype))
    first = int(differ[0])
    batch, head, index = _unravel(first, shape)
    return {
        "first": {
            "batch": batch,
            "head": head,
            "index": index,
            "values": [float(a[first]), float(b[first])],
            "abs_diff": float(abs(a[first] - b[first])),
            "ulp": int(ulps[first]),
        },
        "differing": int(differ.size),
        "max_abs_diff": float(np.max(np.abs(a[differ] - b[differ]))),
        "max_ulp": int(np.max(ulps[differ])),
    }


def judge_flows(
    point: dict[str, int], flows: dict[str, bytes], dtype: str, shape: tuple[int, int, int]
) -> CellResult:
    """Every flow against the single-shot flow, byte for byte."""
    if REFERENCE_FLOW not in flows:
        raise ValueError("the single-shot flow is the reference and must be present")
    ref = flows[REFERENCE_FLOW]
    pairs: list[dict[str, Any]] = []
    for name, data in flows.items():
        if name == REFERENCE_FLOW:
            continue
        diff = compare(ref, data, dtype, shape)
        if diff is not None:
            pairs.append({"flows": [REFERENCE_FLOW, name], **diff})
    elements = shape[0] * shape[1] * shape[2]
    detail: dict[str, Any] = {
        "flows": list(flows),
        "dtype": dtype,
        "shape": list(shape),
        "elements": elements,
    }
    if not pairs:
        return CellResult(point, BITWISE_EQUAL, detail=detail)
    first = pairs[0]
    detail.update(
        {
            "first": {"flows": first["flows"], **first["first"]},
            "pairs": [{k: v for k, v in p.items() if k != "first"} for p in pairs],
            "differing": max(p["differing"] for p in pairs),
            "max_abs_diff": max(p["max_abs_diff"] for p in pairs),
            "max_ulp": max(p["max_ulp"] for p in pairs),
        }
    )
    return CellResult(point, DIFFERS, detail=detail)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_done_claims(
    meta: dict[str, Any],
    point: dict[str, int],
    shape: tuple[int, int, int],
    dtype: str,
    params: dict[str, Any] | None,
    deterministic: bool | None,
    where: str,
) -> None:
    """A DONE result's preconditions and shape, derived from the bytes and the cell's
    parameters, never taken from the engine: a claim that contradicts them is an error.

    - KV length: the point's kv is the KV the last token sees; the policy presents a multiple of
      256, so a DONE at a kv that is not one is a run that should have aborted;
    - mask: without a mask the last token attends to every cell of its view, so every cell must
      be a written token (positions == kv); with one, no more than kv; the mask's row padding
      is the seed's 64 and the KV stride 256 wherever the result names them;
    - heads: H is what the bytes hold (flows.bin's size over flows x B x D x the dtype's size,
      which shape and flow_bytes must already match); H must be a whole number of KV-head
      groups (a multiple of gqa), and equal the cell's `heads` and the result's heads/kv_heads;
    - dtype and deterministic mode: as the cell ran them.
    """
    kv, gqa = point["kv"], point["gqa"]
    if kv % FATTN_KQ_STRIDE:
        raise ResultError(
            where,
            f"status DONE at kv={kv}, which is not a multiple of FATTN_KQ_STRIDE "
            f"({FATTN_KQ_STRIDE}): the deterministic policy cannot hold there, so the engine "
            "must abort with PRECONDITION; a DONE here is not believed",
        )
    policy = meta.get("policy")
    if policy is not None and not isinstance(policy, dict):
        raise ResultError(where, f"'policy' must be an object; got {policy!r}")
    policy = policy or {}
    for key, want in (("kv_stride", FATTN_KQ_STRIDE), ("mask_pad", GGML_KQ_MASK_PAD)):
        if key in policy and policy[key] != want:
            raise ResultError(
                where, f"policy.{key} is {policy[key]!r}; the seed's policy is {want}"
            )
    # (pad_mask says nothing about a cell without a mask: no mask was built)
    for key in ("pad_kv", "pad_mask") if point["mask"] else ("pad_kv",):
        if key in policy and policy[key] is not True:
            raise ResultError(
                where,
                f"status DONE with policy.{key} {policy[key]!r}: a run that did not pad cannot "
                "satisfy the policy, so it must abort with PRECONDITION",
            )
    positions = meta.get("positions")
    if positions is not None:
        p = _int(positions)
        if p is None or p < 1 or p > kv:
            raise ResultError(where, f"positions {positions!r} is not a token count in 1..kv={kv}")
        if not point["mask"] and p != kv:
            raise ResultError(
                where,
                f"positions {p} with the mask off and kv={kv}: without a mask the last token "
                f"attends to all {kv} cells of its view, so {kv - p} of them were never written",
            )
    heads = shape[1]
    if heads % gqa:
        raise ResultError(
            where,
            f"the bytes hold H={heads} heads, not a multiple of gqa={gqa} (query heads per KV "
            "head): the result hides or invents heads",
        )
    for key, want in (("heads", heads), ("kv_heads", heads // gqa)):
        if key in meta and meta[key] != want:
            raise ResultError(where, f"{key} is {meta[key]!r}; the bytes hold {want}")
    params = params or {}
    planned = _int(params.get("heads"))
    if "heads" in params and planned != heads:
        raise ResultError(
            where, f"the bytes hold H={heads} heads; the cell ran --heads {params['heads']}"
        )
    ran = DTYPE_PARAMS.get(str(params.get("dtype")), params.get("dtype"))
    if "dtype" in params and ran != dtype:
        raise ResultError(where, f"dtype {dtype}; the cell ran --dtype {params['dtype']}")
    said = meta.get("deterministic")
    if deterministic is not None and said is not None and bool(said) != deterministic:
        raise ResultError(
            where,
            f"the result says deterministic={said!r}, but the cell ran with {DETERMINISTIC}"
            f"={'1' if deterministic else 'unset'}",
        )
    if said is not None and said is not True:
        raise ResultError(
            where,
            f"the result says deterministic={said!r}: only true says the cell ran in "
            f"deterministic mode ({DETERMINISTIC}=1), the only mode the seed's invariance holds in",
        )
    if deterministic is False:
        raise ResultError(
            where,
            f"status DONE without deterministic mode ({DETERMINISTIC}=1): the seed's "
            "invariance holds under it only",
        )


def judge_cell_dir(
    cell_dir: Path,
    expect: dict[str, int] | None = None,
    chunk_tests: bool | None = None,
    params: dict[str, Any] | None = None,
    deterministic: bool | None = None,
) -> CellResult:
    """A cell's verdict from its directory; a result that cannot be judged is UNJUDGED, located.

    expect: the grid point the cell was planned as (None: take the result's own).
    chunk_tests: whether the cell ran with RUN_KVCACHE_CHUNK_TESTS=1 (None: the result says).
    params: the cell's parameters (heads, dtype), deterministic: whether it ran with
    GGML_DETERMINISTIC=1 (None: unknown, e.g. a tree handed to analyze).
    """
    where = str(cell_dir / RESULT)
    named = parse_point_dir(cell_dir.name)  # a directory named for a point holds that point
    fallback = expect or named or {}
    try:
        meta = read_meta(cell_dir)
        point = fallback = check_point(meta, expect or named, where)
        status = meta.get("status")
        if status == "PRECONDITION":
            record = {k: meta.get(k) for k in ("rule", "message", "fix", "where")}
            if not all(
                isinstance(record[k], str) and record[k] for k in ("rule", "message", "fix")
            ):
                raise ResultError(
                    where, "a PRECONDITION result must name its rule, message and fix"
                )
            return precondition_result(point, record, str(cell_dir))
        if status != "DONE":
            raise ResultError(where, f"status {status!r} is neither DONE nor PRECONDITION")
        flows, dtype, shape = load_flows(cell_dir, meta, point, chunk_tests)
        check_done_claims(meta, point, shape, dtype, params, deterministic, where)
        check_finite(flows, dtype, shape, str(cell_dir / FLOWS))
        result = judge_flows(point, flows, dtype, shape)
    except ResultError as exc:
        return CellResult(fallback, UNJUDGED, reason=str(exc), klass=exc.klass, where=str(cell_dir))
    result.where = str(cell_dir)
    return result


def once_per_point(cells: list[CellResult]) -> list[CellResult]:
    """The cells with each grid point (of one source) judged once: a second cell holding a
    point already judged is UNJUDGED, naming both (a point counted twice is no more coverage,
    and a copy of one cell's result under another's name says nothing of that other)."""
    first: dict[tuple[Any, ...], str] = {}
    out = []
    for c in cells:
        key = (c.source, *(c.point.get(k) for k in POINT_KEYS))
        if c.verdict == UNJUDGED or not all(k in c.point for k in POINT_KEYS):
            out.append(c)
        elif key in first:
            why = f"{point_label(c.point)} is judged twice: here and in {first[key]}; one cell a point"
            out.append(
                CellResult(c.point, UNJUDGED, c.source, reason=why, klass="output", where=c.where)
            )
        else:
            first[key] = c.where
            out.append(c)
    return out


def find_cells(root: Path) -> list[Path]:
    """Directories under root that hold a kv_invariance cell, in path order: a result.json of
    this format, or one that cannot be read beside a flows.bin or in a directory named like a
    grid point (a broken cell is judged UNJUDGED, never skipped)."""
    out = []
    for path in sorted(root.rglob(RESULT)):
        try:
            meta = json.loads(path.read_bytes())
        except (OSError, ValueError):
            meta = None
        ours = isinstance(meta, dict) and meta.get("format") == FORMAT
        if ours or (path.parent / FLOWS).exists() or parse_point_dir(path.parent.name):
            out.append(path.parent)
    return out


def parse_point_dir(name: str) -> dict[str, int] | None:
    """The grid point a directory named by point_dir() stands for, else None."""
    parts = name.split("_")
    if len(parts) != len(POINT_KEYS):
        return None
    point = {}
    for key, part in zip(POINT_KEYS, parts, strict=True):
        if not part.startswith(key) or not part[len(key) :].isdigit():
            return None
        point[key] = int(part[len(key) :])
    return point


# ---------------------------------------------------------------- the run


# The seed's acceptance grid (seed 002, criterion 1): D x KV x B x GQA x mask x ALiBi, sinks
# off: 96 points. The sinks-on smoke cells come on top ("96+").
SEED_AXES: dict[str, tuple[int, ...]] = {
    "d": (64, 128, 256),
    "kv": (256, 1024),
    "b": (1, 8),
    "gqa": (1, 2),
    "mask": (0, 1),
    "alibi": (0, 1),
    "sinks": (0,),
}
SEED_POINTS = math.prod(len(v) for v in SEED_AXES.values())


def coverage(cells: list[CellResult]) -> dict[str, Any]:
    """What the cells judged BITWISE_EQUAL cover of the seed's grid: how many of its points,
    which axis values and flows never were, so a pass says what it covered."""
    equal = [
        c for c in cells if c.verdict == BITWISE_EQUAL and all(k in c.point for k in POINT_KEYS)
    ]
    points = {tuple(int(c.point[k]) for k in POINT_KEYS) for c in equal}
    seed = {p for p in points if all(v in SEED_AXES[k] for k, v in zip(POINT_KEYS, p, strict=True))}
    missing = {
        k: [v for v in SEED_AXES[k] if all(p[i] != v for p in seed)]
        for i, k in enumerate(POINT_KEYS)
    }
    flows = sorted({f for c in equal for f in c.detail.get("flows") or []})
    return {
        "seed_points": SEED_POINTS,
        "covered": len(seed),
        "outside_seed_grid": len(points - seed),
        "never_covered": {k: v for k, v in missing.items() if v},
        "flows": flows,
        "flows_never_compared": [f for f in (*BASE_FLOWS, *CHUNK_FLOWS) if f not in flows],
    }


def coverage_text(cov: dict[str, Any]) -> str:
    text = f"they cover {cov['covered']} of the seed's {cov['seed_points']} grid points"
    gaps = [f"{k} {'/'.join(str(v) for v in vs)}" for k, vs in cov["never_covered"].items()]
    if gaps:
        text += f" (never covered: {', '.join(gaps)})"
    if cov["outside_seed_grid"]:
        text += f", plus {cov['outside_seed_grid']} point(s) outside it"
    if cov["flows_never_compared"]:
        text += f"; flows never compared: {', '.join(cov['flows_never_compared'])}"
    return text


def global_verdict(
    cells: list[CellResult], problems: list[tuple[str, str]] | None = None
) -> tuple[str, str]:
    """The run's word and why. problems: (class, why) the grid cells do not carry."""
    problems = list(problems or [])
    differs = [c for c in cells if c.verdict == DIFFERS]
    if differs:
        return FAIL_INVARIANCE, f"{len(differs)} cell(s) not bitwise equal: " + _names(differs)
    pre = [c for c in cells if c.verdict == PRECONDITION]
    if pre:
        rules = sorted({c.detail.get("rule", "?") for c in pre})
        return PRECONDITION_VIOLATED, (
            f"{len(pre)} cell(s) violate the deterministic policy ({', '.join(rules)}): "
            + _names(pre)
        )
    missing = [
        (c.klass or "engine", f"{point_label(c.point, c.source)}: {c.reason}")
        for c in cells
        if c.verdict == UNJUDGED
    ]
    missing += problems
    if missing:
        worst = min(missing, key=lambda m: CLASSES.index(m[0]) if m[0] in CLASSES else 0)
        return CLASS_VERDICT.get(worst[0], ENGINE_ERROR), f"not judged: {worst[1]}" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        )
    if not cells:
        return FAIL_INVARIANCE, "no cell was judged: nothing shows invariance"
    return PASS_INVARIANCE, (
        f"all {len(cells)} cell(s) bitwise equal; " + coverage_text(coverage(cells))
    )


def _names(cells: list[CellResult], limit: int = 2) -> str:
    names = [point_label(c.point, c.source) for c in cells[:limit]]
    more = f" and {len(cells) - limit} more" if len(cells) > limit else ""
    return "; ".join(names) + more


def first_fail(cells: list[CellResult]) -> dict[str, Any] | None:
    for c in cells:
        if c.verdict == DIFFERS:
            return {"point": c.point, "source": c.source, **c.detail.get("first", {})}
    return None


def summarize(
    cells: list[CellResult],
    date: str,
    problems: list[tuple[str, str]] | None = None,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    word, reason = global_verdict(cells, problems)
    counts = {w: sum(c.verdict == w for c in cells) for w in CELL_WORDS}
    return {
        "benchmark": "03C KV-cache invariance",
        "date": date,
        "global_verdict": word,
        "reason": reason,
        "counts": counts,
        "first_fail": first_fail(cells),
        "coverage": coverage(cells),
        "cells": [c.to_json() for c in cells],
        "problems": [{"class": k, "why": w} for k, w in problems or []],
        "notes": list(notes or []),
    }


# ---------------------------------------------------------------- the grid (panel and headless)


FEATURES = ("mask", "alibi", "sinks")
SYMBOL = {BITWISE_EQUAL: "=", DIFFERS: "X", PRECONDITION: "P", UNJUDGED: "?"}


def row_key(point: dict[str, Any], source: str = "") -> tuple[str, int, int]:
    return (source, int(point["d"]), int(point["kv"]))


def col_key(point: dict[str, Any]) -> tuple[int, int, int, int, int]:
    return (
        int(point["gqa"]),
        int(point["b"]),
        int(point["mask"]),
        int(point["alibi"]),
        int(point["sinks"]),
    )


def row_label(key: tuple[str, int, int]) -> str:
    source, d, kv = key
    return f"{source + ' ' if source else ''}D={d} KV={kv}"


def feature_tag(col: tuple[int, int, int, int, int]) -> str:
    return "".join(t if on else "-" for t, on in zip(("m", "a", "s"), col[2:], strict=True))


def col_label(col: tuple[int, int, int, int, int]) -> tuple[str, str]:
    """Two header lines: 'g1 b8' and the features, 'mas' with '-' for each one off."""
    return f"g{col[0]} b{col[1]}", feature_tag(col)


@dataclass
class Grid:
    """Cells keyed by (row, column) in the order they were planned or first seen."""

    rows: list[tuple[str, int, int]] = field(default_factory=list)
    cols: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    cells: dict[tuple[Any, Any], CellResult | None] = field(default_factory=dict)

    def place(self, point: dict[str, Any], source: str = "") -> tuple[Any, Any]:
        r, c = row_key(point, source), col_key(point)
        if r not in self.rows:
            self.rows.append(r)
        if c not in self.cols:
            self.cols.append(c)
        self.cells.setdefault((r, c), None)
        return (r, c)

    def put(self, result: CellResult) -> tuple[Any, Any]:
        key = self.place(result.point, result.source)
        self.cells[key] = result
        return key

    def sorted(self) -> Grid:
        return Grid(sorted(self.rows), sorted(self.cols), dict(self.cells))

    def text(self) -> list[str]:
        """The grid as text: '=' equal, 'X' differs, 'P' precondition, '?' unjudged, '-' not
        run, '.' not judged yet."""
        if not self.rows:
            return []
        width = max(len(row_label(r)) for r in self.rows)
        heads = [col_label(c) for c in self.cols]
        lines = [
            " " * width + " " + " ".join(f"{h[0]:^5}" for h in heads),
            " " * width + " " + " ".join(f"{h[1]:^5}" for h in heads),
        ]
        for r in self.rows:
            marks = []
            for c in self.cols:
                cell = self.cells.get((r, c), "absent")
                if cell == "absent":
                    marks.append(" ")
                elif cell is None:
                    marks.append(".")
                else:
                    marks.append(mark(cell))
            lines.append(f"{row_label(r):<{width}} " + " ".join(f"{m:^5}" for m in marks))
        return lines


def mark(cell: CellResult) -> str:
    """A cell's one-character mark; '-' for a cell its engine never ran (not a failure of its
    own: the one before it failed, or the engine stopped)."""
    if cell.verdict == UNJUDGED and cell.klass == "not_run":
        return "-"
    return SYMBOL.get(cell.verdict, "?")


def grid_of(cells: list[CellResult]) -> Grid:
    """The grid of the cells that name a grid point (a cell whose point is unknown is in the
    counts and the verdict, not in the grid)."""
    grid = Grid()
    for c in cells:
        if all(k in c.point for k in POINT_KEYS):
            grid.put(c)
    return grid.sorted()


def describe(c: CellResult) -> list[str]:
    """A cell's verdict in words, as the headless output and the analyze command print it."""
    head = f"{point_label(c.point, c.source)}: {c.verdict}"
    d = c.detail
    if c.verdict == BITWISE_EQUAL:
        flows = d.get("flows") or []
        return [head + (f" ({len(flows)} flows: {', '.join(flows)})" if flows else "")]
    if c.verdict == DIFFERS:
        lines = [head]
        ff = d.get("first") or {}
        if ff.get("flows") and ff.get("batch") is not None:
            vals = ff.get("values") or [math.nan, math.nan]
            lines.append(
                f"  first difference: {ff['flows'][0]} vs {ff['flows'][1]} at batch "
                f"{ff.get('batch')} head {ff.get('head')} index {ff.get('index')}: "
                f"{vals[0]:.9g} vs {vals[1]:.9g} ({ff.get('ulp')} ULP)"
            )
        for p in d.get("pairs") or []:
            lines.append(
                f"  {p['flows'][0]} vs {p['flows'][1]}: {p['differing']} of {d.get('elements')} "
                f"elements differ, max |Δ| {p['max_abs_diff']:.3g}, max {p['max_ulp']} ULP"
            )
        if d.get("reported"):
            lines.append(f"  reported: {d['reported']}")
        return lines
    if c.verdict == PRECONDITION:
        lines = [f"{head} ({d.get('rule', '?')}): {c.reason}"]
        if d.get("at"):
            lines.append(f"  at: {d['at']}")
        lines.append(f"  fix: {d.get('fix', '')}")
        return lines
    return [f"{head} ({c.klass}): {c.reason}"]
