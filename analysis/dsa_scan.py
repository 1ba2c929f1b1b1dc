"""A DSA trace's records read batch by batch, each one judged against the per-record contract.

The data tools (export, block-size what-if, the KV-tier simulator) read a trace through this:
the same parser (analysis.dsa_record) and per-record checks (analysis.dsa_checks) as the
validator, in bounded chunks, so a record they use is one the validator accepts on its own.
What only the whole stream can judge (layer order, shards, prefix hits across requests) is
`tracedeck analyze`'s; these tools say so instead of repeating it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from analysis.dsa_checks import Context, Derived, check_batch, explain
from analysis.dsa_lines import READ_CHUNK, complete_lines
from analysis.dsa_record import MAX_LINE, Batch, Fail, read_batch, torn_fail
from analysis.dsa_stream import DEFAULT_TOPK, dir_block_size, row_runs
from analysis.dsa_tree import block_dirs, read_summary, shard_files
from analysis.regular_file import open_regular


@dataclass
class TraceInfo:
    """What a block directory says about its trace beyond the records (summary.json,
    serving.jsonl); every value says where it came from."""

    folder: Path
    block_size: int | None
    topk: int
    topk_from: str
    bytes_per_token: int | None
    prefix_key_tokens: int | None  # K: a request's prefix is its first min(K, prompt) tokens
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # serving.jsonl
    arrival_ms: dict[int, float] = field(default_factory=dict)
    end_ms: dict[int, float] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


def trace_info(folder: Path, topk: int | None = None) -> TraceInfo:
    summary, why = read_summary(folder / "summary.json")
    if why not in ("", "missing"):  # its settings would be guessed silently: said instead
        raise ValueError(
            f"{folder / 'summary.json'}: {why}; the trace's top-k, block size and KV bytes per "
            "token are read from it: fix it, or move it out of the block directory (and give "
            "--topk)"
        )
    config = summary.get("config") if isinstance(summary.get("config"), dict) else {}
    assert isinstance(config, dict)
    k_top = topk or _int(config.get("index_topk"))
    info = TraceInfo(
        folder=folder,
        block_size=_int(config.get("kv_block_size_tokens")) or dir_block_size(f"{folder}/x"),
        topk=k_top or DEFAULT_TOPK,
        topk_from=(
            "--topk"
            if topk
            else "summary.json config.index_topk"
            if k_top
            else f"the seed's production top-{DEFAULT_TOPK} (no summary.json config.index_topk)"
        ),
        bytes_per_token=_int(config.get("kv_bytes_per_token"), zero=True),
        prefix_key_tokens=_int(config.get("trace_prefix_key_tokens")),
        summary=summary,
    )
    serving = folder / "serving.jsonl"
    if serving.is_file():
        with open_regular(serving) as fh:  # a line at a time; lines end at a newline only
            for n, entry in _entries(fh, serving):
                try:
                    rid = int(entry["request_id"])
                    info.arrival_ms[rid] = float(entry["arrival_ms"])
                    info.end_ms[rid] = float(entry["end_ms"])
                    if "prompt_tokens" in entry:
                        info.prompt_tokens[rid] = int(entry["prompt_tokens"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{serving}:{n}: not a serving entry ({exc})") from None
    return info


def _entries(fh: Any, path: Path) -> Iterator[tuple[int, Any]]:
    """serving.jsonl's entries with their line numbers; a line that is no JSON (or no UTF-8)
    is a ValueError naming its file and line."""
    for n, line in enumerate(fh, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{path}:{n}: not a serving entry ({exc})") from None
        yield n, entry


@dataclass
class Scanned:
    """One chunk of one shard: its parsed rows, which are valid, and why the others are not."""

    file: Path
    lines: list[bytes]  # the chunk's raw lines (lines[i] is line first_line + i)
    first_line: int
    batch: Batch
    derived: Derived
    valid: np.ndarray  # per batch row
    bad: list[tuple[int, Fail, tuple[int, int, int] | None]]  # lines that parsed to no record

    def fail(self, row: int) -> Fail:
        return explain(self.derived, row)

    def raw(self, line: int) -> bytes:
        """A line's text, up to MAX_LINE bytes (where a read of it stops, whichever read)."""
        return bytes(self.lines[line - self.first_line][:MAX_LINE])


def scan_block(info: TraceInfo, chunk: int = READ_CHUNK) -> Iterator[Scanned]:
    """Every shard of a block directory, in request order, as judged chunks."""
    for path in shard_files(info.folder):
        yield from scan_file(info, path, chunk)


def scan_file(info: TraceInfo, path: Path, chunk: int = READ_CHUNK) -> Iterator[Scanned]:
    for line_no, lines, torn in complete_lines(path, chunk):
        yield from scan_span(info, path, lines, line_no, torn)


def known(info: TraceInfo) -> bool:
    """The trace's block size and KV bytes per token are known: a chunk is judged alone."""
    return info.block_size is not None and info.bytes_per_token is not None


def scan_span(
    info: TraceInfo, path: Path, lines: list[bytes], line_no: int, torn: bool
) -> Iterator[Scanned]:
    """One chunk of complete_lines (or chunk_spans), judged; info learns what it did not know."""
    if not torn:
        yield from _judge(info, path, lines, line_no)
    else:
        # a torn last line: a record that is none, named like the validator does
        fail = torn_fail(len(lines[0]))
        empty = read_batch([], line_no)
        d = check_batch(empty, Context(info.topk, info.block_size or 1, info.bytes_per_token))
        yield Scanned(path, lines, line_no, empty, d, np.ones(0, bool), [(line_no, fail, None)])


def _judge(info: TraceInfo, path: Path, lines: list[bytes], first: int) -> Iterator[Scanned]:
    batch = read_batch(lines, first)
    n = len(batch)
    if info.block_size is None and n:
        info.block_size = int(batch.col["bs"][0])
    bs = info.block_size or 1
    if info.bytes_per_token is None and n:
        info.bytes_per_token = learn_bytes(batch.col, bs)
    ctx = Context(info.topk, bs, info.bytes_per_token)
    bad = list(batch.bad)
    for r0, r1 in row_runs(batch, bs):
        sub = batch if (r0, r1) == (0, n) else batch.sub(r0, r1)
        d = check_batch(sub, ctx)
        # the unreadable lines go with the run whose lines surround them (all with the last)
        last = r1 == n
        hi = sub.lines[-1] if sub.lines and not last else None
        mine = [b for b in bad if hi is None or b[0] <= hi]
        bad = [b for b in bad if b not in mine]
        yield Scanned(path, lines, first, sub, d, d.code == 0, mine)
    if n == 0:
        d = check_batch(batch, ctx)
        yield Scanned(path, lines, first, batch, d, np.ones(0, bool), bad)


def learn_bytes(c: dict[str, np.ndarray], bs: int) -> int | None:
    """KV bytes per token from the first record that shows it (bytes_read / (blocks x size))."""
    for ub, nbytes in zip(c["ublocks"], c["bytes"], strict=True):
        if ub > 0 and nbytes >= 0:
            per = int(ub) * bs
            return int(nbytes // per) if nbytes % per == 0 else None
    return None


def trace_folders(root: Path) -> list[Path]:
    """The block<N>/ directories of a --trace-out directory (or the one given)."""
    return block_dirs(Path(root))


def _int(value: Any, zero: bool = False) -> int | None:
    """A summary.json count or size as a number (None: absent, or no such number: a value past
    2**53 is no block size, top-k or byte count, and no 64-bit column holds its products)."""
    ok = (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (value >= 0 if zero else value > 0)
        and value <= 1 << 53
    )
    return value if ok else None
