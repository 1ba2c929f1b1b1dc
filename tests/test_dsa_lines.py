"""DSA chunks read in place (Lines) and the faster folds: the same lines, rows and votes as the
plain definitions they replace."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import orjson
import pytest
from dsa_writer import record

from analysis.dsa_checks import Context, check_batch
from analysis.dsa_lines import chunk_spans, complete_lines
from analysis.dsa_record import Batch, Lines, Ragged, read_batch
from analysis.dsa_stream import VOTE_KEYS, fingerprints, tally, tally_rows

KEY = "a" * 40


def _chunks_by_definition(data: bytes, chunk: int) -> list[tuple[int, list[bytes], bool]]:
    """Chunk k: the lines up to the last newline before byte (k + 1) x chunk; a last line
    with no newline alone at the end, torn."""
    out, line_no, start = [], 1, 0
    for end in range(chunk, len(data) + chunk, chunk):
        cut = data.rfind(b"\n", start, min(end, len(data)))
        if cut < start:
            continue
        lines = data[start:cut].split(b"\n")
        out.append((line_no, lines, False))
        line_no += len(lines)
        start = cut + 1
    if start < len(data):
        out.append((line_no, [data[start:]], True))
    return out


def test_complete_lines_are_the_defined_chunks(tmp_path: Path) -> None:
    rng = random.Random(3)
    path = tmp_path / "f.jsonl"
    for _ in range(400):
        parts = [b"r" * rng.choice([0, 1, 2, 5, 9, 30]) for _ in range(rng.randint(0, 10))]
        data = b"\n".join(parts) + (b"\n" if rng.random() < 0.6 else b"")
        path.write_bytes(data)
        for chunk in (1, 2, 3, 5, 8, 64):
            want = _chunks_by_definition(data, chunk)
            got = [(n, list(lines), torn) for n, lines, torn in complete_lines(path, chunk)]
            assert got == want, (data, chunk)
            spans = [(n, o, s, t) for o, s, n, t in chunk_spans(path, chunk)]
            assert [(n, t) for n, _, _, t in spans] == [(n, t) for n, _, t in want]


@pytest.mark.parametrize("head", [None, b"", b"head"])
def test_lines_index_like_the_list_they_stand_for(head: bytes | None) -> None:
    rng = random.Random(5)
    for _ in range(300):
        data = b"\n".join(b"x" * rng.randrange(4) for _ in range(rng.randint(1, 6)))
        end = rng.randrange(len(data) + 1)
        start = rng.randrange(end + 2)
        lines = Lines(data, start, end, head)
        want = ([head] if head is not None else []) + (
            data[start:end].split(b"\n") if start <= end else []
        )
        assert list(lines) == want and len(lines) == len(want) and lines == want
        assert [lines[i] for i in range(-len(want), len(want))] == want + want
        assert lines[1:] == want[1:]
        with pytest.raises(IndexError):
            lines[len(want)]


def _record_lines() -> list[bytes]:
    """Valid records, then lines the fast path must refuse or fail exactly as before."""
    rng = random.Random(0)
    recs = [record(0, layer, 40, 32, 16, 24, False, rng, 1000, KEY) for layer in range(3)]
    good = [orjson.dumps(r) for r in recs]
    spaced = good[1].replace(b'"selected_token_pos":', b' "selected_token_pos" : ')
    nested = good[2].replace(b'"selected_token_pos":[', b'"selected_token_pos":[[1],', 1)
    return [
        good[0],
        b"",
        spaced,
        b"not json",
        nested,
        good[2][:-40],
        good[1].replace(b'"rank":0', b'"rank":1'),
        good[0],
    ]


def _rows(b: Batch) -> tuple:
    return (
        b.lines,
        b.names,
        [(n, f, i) for n, f, i in b.bad],
        [r.tolist() for r in b.pos.rows()],
        [r.tolist() for r in b.blocks.rows()],
        [r.tolist() for r in b.inter.rows()],
        {k: v.tolist() for k, v in b.col.items()},
    )


def test_read_batch_reads_lines_in_place_as_it_reads_a_list() -> None:
    lines = _record_lines()
    data = b"junk\n" + b"\n".join(lines) + b"\ntail"
    start = len(b"junk\n")
    in_place = Lines(data, start, len(data) - len(b"\ntail"))
    assert list(in_place) == lines
    got, want = read_batch(in_place, 7), read_batch(lines, 7)
    assert _rows(got) == _rows(want)
    assert len(want.bad) == 4 and len(want) == 4  # the test means something
    ctx = Context(topk=32, block_size=16, bytes_per_token=1152)
    assert check_batch(got, ctx).code.tolist() == check_batch(want, ctx).code.tolist()
    # a head line (the line across two reads) reads like any other
    headed = Lines(data, start + len(lines[0]) + 1, len(data) - len(b"\ntail"), head=lines[0])
    assert _rows(read_batch(headed, 7)) == _rows(want)


def test_tally_rows_is_a_tally_per_row() -> None:
    rng = random.Random(9)
    for _ in range(200):
        kinds = rng.choice([2, 5, VOTE_KEYS + 10])
        values = [str(rng.randrange(kinds)) for _ in range(rng.randint(0, 150))]
        before = {str(k): [1, "f", 0, 0, 0, 0] for k in range(rng.choice([0, VOTE_KEYS]))}
        one, bulk = {k: [*v] for k, v in before.items()}, {k: [*v] for k, v in before.items()}
        line = rng.choice([-5, 5])

        def at(r: int) -> list:
            return ["f", line + r, 1, r % 3, r // 3]  # noqa: B023

        for r, v in enumerate(values):
            tally(one, v, 1, at(r))
        tally_rows(bulk, values, at)
        assert bulk == one and list(bulk) == list(one)


def test_fingerprints_of_a_matrix_are_the_row_sums_fingerprints() -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        n, width = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        big = bool(rng.random() < 0.4)  # sums that wrap around 64 bits
        lo, hi = (-(2**62), 2**62) if big else (0, 100)
        rows = [rng.integers(lo, hi, size=width) for _ in range(n)]
        same = Ragged.of(rows)
        ragged = Ragged.of([*rows, np.arange(width + 1)])  # a row of another length
        assert fingerprints(same).tolist() == fingerprints(ragged).tolist()[:n]
