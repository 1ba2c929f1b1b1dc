"""Readers for the B3.67 runner contract: logits.jsonl.gz and metadata.json (seed section 2.1).

Every defect in a file is an InputError that names the file and line; nothing is skipped.
Logits are parsed straight into float32 rows (the seed's "normalise to float32 before
comparing") while a worker thread inflates the gzip stream, so the pair comparison can
stream both files in lockstep with O(V) memory per side.

Speed, where the host has them (the analyzer is shipped to hosts with numpy alone): ISA-L
inflates (isal, else zlib), and simdjson reads a line's logits straight into a buffer of
doubles with no Python float per value (pysimdjson, else orjson, else json). A line the fast
path does not take (a NaN, a string, a missing key) is read again by the exact path, whose
message names what is wrong; so what is accepted and every error are the same either way.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import struct
import threading
import zlib
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from analysis.json_once import GivenTwice, once

try:
    import orjson

    _loads: Any = orjson.loads
    _JSONError: Any = orjson.JSONDecodeError
except ImportError:  # a host with numpy alone
    _loads, _JSONError = json.loads, ValueError
try:
    from isal import isal_zlib as _inflate_lib
except ImportError:
    _inflate_lib = zlib  # type: ignore[assignment]
try:
    import simdjson
except ImportError:
    simdjson = None

RERUN_HINT = "re-fetch the file, or re-run this side of the pair"


class InputError(ValueError):
    """Bad input, located: str() is 'FILE:LINE: message — what to do'."""

    def __init__(self, file: str | Path, line: int | None, message: str, hint: str) -> None:
        self.file = str(file)
        self.line = line
        self.message = message
        self.hint = hint
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.message} — {self.hint}"

    def __reduce__(self) -> tuple[type[InputError], tuple[str, int | None, str, str]]:
        # Raised in a reading process and handed back whole, message and place intact.
        return InputError, (self.file, self.line, self.message, self.hint)


@dataclass
class LogitsTable:
    """One side of a pair; row i came from line i + 1 of the file."""

    path: str
    token_idx: np.ndarray  # int64 (T,)
    token_id: np.ndarray  # int64 (T,)
    logits: np.ndarray  # float32 (T, V)


@dataclass(slots=True)
class LogitsRow:
    """One parsed line; `logits` is a read-only float32 (V,) array."""

    line: int
    token_idx: int
    token_id: int
    logits: np.ndarray


# ---------------------------------------------------------------- gzip lines

_END = object()
_READ_CHUNK = 1 << 20
_MAX_OUT = 4 << 20  # big inflate calls: the worker waits for the GIL once per call
_QUEUE_DEPTH = 4


class _GzipLines:
    """Inflates a gzip file on a worker thread and hands out (line number, bytes) in order.

    zlib releases the GIL while inflating, so this overlaps with JSON parsing on the caller's
    thread. The stream is only accepted when every gzip member ends with a good CRC and
    length; a truncated stream raises after its last complete line.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name=f"gunzip {path}", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.05)
        self._thread.join()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            self._inflate()
        except InputError as exc:
            self._put(exc)
        except OSError as exc:
            self._put(InputError(self.path, None, f"cannot read the file ({exc})", RERUN_HINT))
        except BaseException as exc:  # a bug here must surface, not hang the reader
            self._put(exc)
        else:
            self._put(_END)

    def _corrupt(self, lineno: int, what: str) -> InputError:
        return InputError(
            self.path,
            None,
            f"corrupt gzip stream after {lineno} complete line(s): {what}",
            RERUN_HINT + " (`gzip -t` shows the same)",
        )

    def _inflate(self) -> None:
        parts: list[memoryview] = []  # the pieces of a line that began in earlier output
        lineno = 0
        members = 0
        fed = False  # bytes given to the current member's decompressor
        inflater = _inflate_lib.decompressobj(31)
        with open(self.path, "rb") as fh:
            while not self._stop.is_set():
                data = fh.read(_READ_CHUNK)
                if not data:
                    break
                while data:
                    fed = True
                    try:
                        out = inflater.decompress(data, _MAX_OUT)
                    except (zlib.error, _inflate_lib.error) as exc:
                        raise self._corrupt(lineno, str(exc)) from None
                    data = inflater.unconsumed_tail
                    if inflater.eof:
                        members += 1
                        data = inflater.unused_data + data
                        inflater = _inflate_lib.decompressobj(31)
                        fed = False
                    # Each byte is copied once, into its line (a join of views, or a slice).
                    start = 0
                    while True:
                        end = out.find(b"\n", start)
                        if end < 0:
                            if start < len(out):
                                parts.append(memoryview(out)[start:])
                            break
                        lineno += 1
                        if parts:
                            parts.append(memoryview(out)[start:end])
                            line = b"".join(parts)
                            parts.clear()
                        else:
                            line = out[start:end]
                        if not self._put((lineno, line)):
                            return
                        start = end + 1
        if self._stop.is_set():
            return
        if members == 0 and not fed:
            raise InputError(self.path, None, "empty file (0 bytes)", RERUN_HINT)
        if fed:
            raise self._corrupt(lineno, "the stream is truncated (no gzip end-of-stream)")
        if parts:
            self._put((lineno + 1, b"".join(parts)))


# ---------------------------------------------------------------- line parsing

_KEYS = ("token_idx", "token_id", "logits")


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number with a fraction"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "array"
    return "object"


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _LineParser:
    """Parses one logits line at a time, keeping the state that spans lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.vocab: int | None = None
        self.next_idx = 0
        self._packer: struct.Struct | None = None
        self._simd = simdjson.Parser() if simdjson is not None else None

    def error(self, lineno: int, message: str, hint: str = RERUN_HINT) -> InputError:
        return InputError(self.path, lineno, message, hint)

    def parse(self, lineno: int, raw: bytes) -> tuple[int, int, np.ndarray]:
        fast = self._fast(lineno, raw) if self._simd is not None else None
        return fast if fast is not None else self._exact(lineno, raw)

    def _fast(self, lineno: int, raw: bytes) -> tuple[int, int, np.ndarray] | None:
        """The common line, read by simdjson; None sends the line to the exact path."""
        assert self._simd is not None
        # as_buffer flattens nested arrays: only a line with one "[" is taken here (an object
        # in the array is refused by as_buffer itself); two finds (memchr), where a count
        # looks at every byte of the line
        first = raw.find(b"[")
        if first < 0 or raw.find(b"[", first + 1) >= 0:
            return None
        try:
            doc = self._simd.parse(raw)
            if type(doc) is not simdjson.Object or len(doc) != 3:
                return None
            idx, tid, values = doc.get("token_idx"), doc.get("token_id"), doc.get("logits")
            if type(idx) is not int or type(tid) is not int or type(values) is not simdjson.Array:
                return None
            # Doubles, as orjson would read them, then float32: the same values either way.
            row = np.frombuffer(values.as_buffer(of_type="d"), dtype=np.float64)
        except (ValueError, TypeError, RuntimeError):  # not JSON, or not all numbers: look closer
            return None
        finally:
            doc = values = None  # the parser may be reused only once its proxies are gone
        n = row.shape[0]
        if n == 0 or (self.vocab is not None and n != self.vocab) or idx != self.next_idx:
            return None
        if not 0 <= tid < n:
            return None
        with np.errstate(over="ignore", invalid="ignore"):
            row32 = row.astype(np.float32)
            # A finite sum has no inf or NaN among its terms (one pass, no array of flags); a
            # sum that overflows is looked at value by value.
            if not np.isfinite(np.add.reduce(row32)) and not np.isfinite(row32).all():
                return None
        self.vocab = n
        self.next_idx += 1
        return idx, tid, row32

    def _exact(self, lineno: int, raw: bytes) -> tuple[int, int, np.ndarray]:
        try:
            obj = _loads(raw)
        except _JSONError as exc:
            raise self._bad_json(lineno, raw, exc) from None
        if type(obj) is not dict:
            raise self.error(lineno, f"the line holds a JSON {_json_type(obj)}, not an object")
        twice = _given_twice(raw, len(obj), self._simd)
        if twice is not None:
            raise self.error(
                lineno,
                f"key {twice!r} is given twice: a line that says two things is believed in "
                "neither reading",
            )
        for key in _KEYS:
            if key not in obj:
                raise self.error(lineno, f"missing key '{key}' (each line needs {list(_KEYS)})")
        idx, tid, values = obj["token_idx"], obj["token_id"], obj["logits"]
        for key, value in (("token_idx", idx), ("token_id", tid)):
            if type(value) is not int:
                raise self.error(
                    lineno, f"{key} must be an integer, got {_json_type(value)} {_shown(value)}"
                )
        self._check_order(lineno, idx)
        if type(values) is not list:
            raise self.error(lineno, f"logits must be an array, got {_json_type(values)}")
        if not values:
            raise self.error(lineno, "logits is empty")
        if self.vocab is None:
            self.vocab = len(values)
        elif len(values) != self.vocab:
            raise self.error(
                lineno,
                f"logits has {len(values)} values but line 1 had {self.vocab}: "
                "every line must have the same vocab size",
            )
        if not 0 <= tid < self.vocab:
            raise self.error(lineno, f"token_id {tid} is outside the vocab [0, {self.vocab})")
        row = self._fill(lineno, values)
        self.next_idx += 1
        return idx, tid, row

    def _check_order(self, lineno: int, idx: int) -> None:
        expected = self.next_idx
        if idx == expected:
            return
        hint = "lines must carry token_idx 0, 1, 2, ... in order, one token each; re-run this side"
        if 0 <= idx < expected:
            raise self.error(
                lineno,
                f"duplicate token_idx {idx} (line {idx + 1} already had it); expected {expected}",
                hint,
            )
        if idx > expected:
            missing = f"{expected}" if idx == expected + 1 else f"{expected}..{idx - 1}"
            raise self.error(
                lineno,
                f"token_idx {idx} where {expected} was expected: token {missing} missing "
                "or out of order",
                hint,
            )
        raise self.error(lineno, f"token_idx {idx} is negative; expected {expected}", hint)

    def _fill(self, lineno: int, values: list[Any]) -> np.ndarray:
        # struct packs a list of Python numbers to float32 about twice as fast as numpy's
        # list conversion, and refuses strings, null and arrays where numpy would not.
        packer = self._packer
        if packer is None or packer.size != 4 * len(values):
            packer = self._packer = struct.Struct(f"{len(values)}f")  # native: the fastest
        try:
            row = np.frombuffer(packer.pack(*values), dtype=np.float32)
        except (struct.error, TypeError, ValueError, OverflowError):
            raise self._first_non_number(lineno, values) from None
        for i in np.flatnonzero((row == 0) | (row == 1)).tolist():
            if type(values[i]) is bool:
                raise self.error(lineno, f"logits[{i}] is a boolean, not a number")
        finite = np.isfinite(row)
        if not finite.all():
            i = int(np.flatnonzero(~finite)[0])
            raise self.error(
                lineno,
                f"logits[{i}] = {_shown(values[i])} does not fit in float32 (overflows to Inf)",
                "the engine wrote an out-of-range logit; fix the run, this pair cannot be judged",
            )
        return row

    def _first_non_number(self, lineno: int, values: list[Any]) -> InputError:
        for i, v in enumerate(values):
            if type(v) is not int and type(v) is not float:
                return self.error(lineno, f"logits[{i}] is a {_json_type(v)}, not a number")
            try:
                struct.pack("<f", v)
            except (struct.error, OverflowError):
                return self.error(lineno, f"logits[{i}] = {_shown(v)} does not fit in float32")
        return self.error(lineno, "logits could not be read as numbers")

    def _bad_json(self, lineno: int, raw: bytes, exc: Exception) -> InputError:
        if not raw.strip():
            return self.error(lineno, "empty line (one JSON object per line is required)")
        found: list[str] = []

        def constant(name: str) -> float:
            found.append(name)
            return float(name.replace("Infinity", "inf"))

        try:
            obj = json.loads(raw, parse_constant=constant)
        except (ValueError, RecursionError):
            return self.error(lineno, f"not valid JSON ({exc})")
        hint = "the engine wrote a non-finite value; fix the run, this pair cannot be judged"
        if isinstance(obj, dict):
            values = obj.get("logits")
            if isinstance(values, list):
                for i, v in enumerate(values):
                    if type(v) is float and not math.isfinite(v):
                        word = "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
                        if not found:
                            word += " (a number beyond the float range)"
                        return self.error(lineno, f"logits[{i}] is {word}", hint)
            for key, v in obj.items():
                if type(v) is float and not math.isfinite(v):
                    return self.error(lineno, f"{key} is {v!r}", hint)
        return self.error(lineno, f"not valid JSON ({exc})")


# ---------------------------------------------------------------- public readers


def iter_logits(path: str | Path) -> Generator[LogitsRow, None, None]:
    """Streams the rows of a logits.jsonl.gz file, validating each; O(V) memory.

    The iterator only finishes normally once the whole gzip stream has been verified.
    """
    path = str(path)
    lines = _GzipLines(path)
    parser = _LineParser(path)
    count = 0
    try:
        for lineno, raw in lines:
            idx, tid, row = parser.parse(lineno, raw)
            count += 1
            yield LogitsRow(lineno, idx, tid, row)
    finally:
        lines.close()
    if count == 0:
        raise InputError(path, None, "no token lines: the logits file is empty", RERUN_HINT)


def read_logits(path: str | Path) -> LogitsTable:
    """Reads a whole logits.jsonl.gz into a float32 (T, V) table."""
    path = str(path)
    table: np.ndarray | None = None
    ids: list[int] = []
    for row in iter_logits(path):
        n = len(ids)
        if table is None:
            table = np.empty((64, row.logits.shape[0]), dtype=np.float32)
        elif n == table.shape[0]:
            grown = np.empty((2 * n, table.shape[1]), dtype=np.float32)
            grown[:n] = table
            table = grown
        table[n] = row.logits
        ids.append(row.token_id)
    assert table is not None  # iter_logits raises on an empty file
    t = len(ids)
    logits = table if t == table.shape[0] else table[:t].copy()
    return LogitsTable(
        path=path,
        token_idx=np.arange(t, dtype=np.int64),
        token_id=np.asarray(ids, dtype=np.int64),
        logits=logits,
    )


_METADATA_KEYS: dict[str, type] = {
    "dtype": str,
    "prompt_len": int,
    "gen_len": int,
    "seed": int,
    "kv_aligned": int,
    "mode": str,
}
_MODES = ("prefill", "decode")


def _given_twice(raw: bytes, keys: int, simd: Any) -> str | None:
    """The key an object line gives twice, or None; `keys`: how many its parse kept."""
    if simd is not None:
        try:
            doc = simd.parse(raw)
            fields = len(doc) if type(doc) is simdjson.Object else keys
        except (ValueError, TypeError, RuntimeError):
            fields = keys + 1  # let the exact parse below say which
        finally:
            doc = None
        if fields == keys:
            return None
    try:
        json.loads(raw, object_pairs_hook=once)
    except GivenTwice as exc:
        return str(exc.args[0])
    except (ValueError, RecursionError):
        return None
    return None


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Reads and checks a side's metadata.json (seed section 2.1); returns the whole object."""
    path = str(path)
    hint = "fix metadata.json for this side (seed section 2.1 lists its keys)"
    try:
        with open(path, "rb") as fh:
            text = fh.read()
    except OSError as exc:
        raise InputError(path, None, f"cannot read metadata ({exc})", RERUN_HINT) from None
    try:
        meta = json.loads(text, object_pairs_hook=once)
    except GivenTwice as exc:
        raise InputError(
            path,
            None,
            f"key {exc.args[0]!r} is given twice: metadata that says two things is believed in "
            "neither reading",
            hint,
        ) from None
    except json.JSONDecodeError as exc:
        raise InputError(path, exc.lineno, f"not valid JSON ({exc.msg})", hint) from None
    except UnicodeDecodeError as exc:
        raise InputError(path, None, f"not UTF-8 text ({exc.reason})", hint) from None
    if type(meta) is not dict:
        raise InputError(path, None, f"holds a JSON {_json_type(meta)}, not an object", hint)
    for key, kind in _METADATA_KEYS.items():
        if key not in meta:
            raise InputError(path, None, f"missing key '{key}'", hint)
        value = meta[key]
        if type(value) is not kind:
            want = "an integer" if kind is int else "a string"
            raise InputError(
                path,
                None,
                f"key '{key}' must be {want}, got {_json_type(value)} {_shown(value)}",
                hint,
            )
    for key in ("prompt_len", "gen_len", "seed"):
        if meta[key] < 0:
            raise InputError(path, None, f"key '{key}' is negative ({meta[key]})", hint)
    if meta["kv_aligned"] not in (0, 1):
        raise InputError(
            path, None, f"key 'kv_aligned' must be 0 or 1, got {meta['kv_aligned']}", hint
        )
    if meta["mode"] not in _MODES:
        raise InputError(
            path, None, f"key 'mode' must be 'prefill' or 'decode', got {meta['mode']!r}", hint
        )
    return meta
