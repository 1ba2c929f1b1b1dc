"""B3.67 analysis: logits/metadata readers, section 8 metrics, verdicts, first_fail, documents."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from analysis.equivalence import (
    EXPECTED_DRIFT,
    FAIL_EQUIV,
    FAIL_GUARDRAIL,
    PASS_EQUIV,
    PASS_GUARDRAIL,
    THRESHOLDS,
    PairResult,
    Unjudged,
    _cosine,
    compare_files,
    compare_pair,
    exit_code_for,
    guardrail_verdict,
    metrics_document,
    summarize,
)
from analysis.logits import InputError, LogitsTable, read_logits, read_metadata
from analysis.report import report_markdown

PAIR_KW: dict[str, Any] = {"dtype": "bf16", "prompt_len": 32, "gen_len": 8}


# ---------------------------------------------------------------- writers (the engine side)


def line_of(idx: int, token_id: int, row: Any) -> str:
    return json.dumps({"token_idx": idx, "token_id": token_id, "logits": [float(x) for x in row]})


def write_lines(path: Path, lines: list[str], newline_at_end: bool = True) -> Path:
    text = "\n".join(lines) + ("\n" if newline_at_end else "")
    with gzip.open(path, "wt") as fh:
        fh.write(text)
    return path


def write_table(path: Path, logits: np.ndarray, ids: list[int] | np.ndarray) -> Path:
    return write_lines(path, [line_of(i, int(ids[i]), row) for i, row in enumerate(logits)])


def pair_data(
    tokens: int = 8, vocab: int = 300, noise: float = 1e-4, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.normal(-1.0, 3.0, (tokens, vocab)).astype(np.float32)
    b = (a + rng.normal(0.0, noise, (tokens, vocab))).astype(np.float32)
    return a, b, np.argmax(a, axis=1)


def table(path: str, logits: np.ndarray, ids: np.ndarray) -> LogitsTable:
    t = logits.shape[0]
    return LogitsTable(path, np.arange(t, dtype=np.int64), np.asarray(ids, np.int64), logits)


def section8(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Seed section 8, applied to float32 tables: whole-pair |Δ|, per-token top-1 and cosine."""
    diffs = np.abs(np.array(a) - np.array(b))
    cos = [
        float(np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y)))
        for x, y in zip(a, b, strict=True)
    ]
    return {
        "max_abs_diff": float(np.max(diffs)),
        "p99_abs_diff": float(np.percentile(diffs, 99)),
        "top1_agreement": float(
            np.mean([float(np.argmax(x) == np.argmax(y)) for x, y in zip(a, b, strict=True)])
        ),
        "cos_sim_mean": float(np.mean(cos)),
    }


def top5(row: np.ndarray) -> list[list[Any]]:
    order = sorted(range(row.shape[0]), key=lambda i: (-float(row[i]), i))[:5]
    return [[i, float(row[i])] for i in order]


# ---------------------------------------------------------------- reading good files


def test_read_logits_round_trips_float32_values(tmp_path: Path) -> None:
    a, _, ids = pair_data(tokens=5, vocab=50)
    path = write_table(tmp_path / "l.jsonl.gz", a, ids)
    t = read_logits(path)
    assert t.path == str(path)
    assert t.logits.dtype == np.float32 and t.logits.shape == (5, 50)
    assert np.array_equal(t.logits, a)
    assert t.token_idx.dtype == np.int64 and t.token_idx.tolist() == [0, 1, 2, 3, 4]
    assert t.token_id.dtype == np.int64 and t.token_id.tolist() == ids.tolist()


def test_read_logits_accepts_ints_extra_keys_spaces_members_and_no_final_newline(
    tmp_path: Path,
) -> None:
    lines = [
        '{"token_idx": 0, "token_id": 2, "logits": [1, -2.5, 3e0], "mode": "prefill \\" x"}',
        '{ "logits" : [ 0.5 , 1.5 , -0.0 ] , "token_id" : 1 , "token_idx" : 1 }',
    ]
    path = tmp_path / "l.jsonl.gz"
    # Two gzip members back to back are one valid gzip file.
    path.write_bytes(gzip.compress((lines[0] + "\n").encode()) + gzip.compress(lines[1].encode()))
    t = read_logits(path)
    assert t.logits.tolist() == [[1.0, -2.5, 3.0], [0.5, 1.5, 0.0]]
    assert t.token_id.tolist() == [2, 1]


def test_read_logits_grows_past_its_first_allocation(tmp_path: Path) -> None:
    a, _, ids = pair_data(tokens=150, vocab=7)
    t = read_logits(write_table(tmp_path / "l.jsonl.gz", a, ids))
    assert np.array_equal(t.logits, a)


# ---------------------------------------------------------------- bad logits files


def expect_error(path: Path, line: int | None, *fragments: str) -> InputError:
    with pytest.raises(InputError) as info:
        read_logits(path)
    err = info.value
    assert err.file == str(path)
    assert err.line == line
    text = str(err)
    prefix = f"{path}:{line}: " if line is not None else f"{path}: "
    assert text.startswith(prefix), text
    assert " — " in text, text  # says what to do
    for fragment in fragments:
        assert fragment in text, text
    return err


GOOD = [line_of(i, 1, [0.5, -1.0, 2.0]) for i in range(4)]


def test_the_fast_and_the_exact_line_readers_agree_value_for_value() -> None:
    """simdjson's buffer of doubles and orjson's floats packed to float32 are the same bits,
    over ordinary, tiny, huge, integer, negative-zero and exponent-form values."""
    from analysis.logits import _LineParser

    rng = np.random.default_rng(3)
    values: list[Any] = [float(x) for x in rng.normal(0, 8, 5000)]
    values += [0, -0.0, 1, -7, 16777217, 3.4e38, -3.4e38, 1e-45, 1e-50, 2.5e-39, 1.5e3]
    raw = json.dumps({"token_idx": 0, "token_id": 2, "logits": values}).encode()
    fast = _LineParser("f")._fast(1, raw)
    assert fast is not None  # the common line takes the fast path
    exact = _LineParser("e")._exact(1, raw)
    assert fast[:2] == exact[:2]
    assert fast[2].dtype == exact[2].dtype == np.float32
    assert fast[2].tobytes() == exact[2].tobytes()
    # Finite values whose float32 sum overflows: still the fast path's, value for value.
    raw = json.dumps({"token_idx": 0, "token_id": 0, "logits": [3.4e38, 3.4e38, 1.0]}).encode()
    fast = _LineParser("f")._fast(1, raw)
    assert fast is not None and fast[2].tobytes() == _LineParser("e")._exact(1, raw)[2].tobytes()
    # Beyond float32: not the fast path's (the exact one names the value).
    raw = json.dumps({"token_idx": 0, "token_id": 0, "logits": [1.0, 1e39]}).encode()
    assert _LineParser("f")._fast(1, raw) is None


def test_corrupt_gzip_names_the_file(tmp_path: Path) -> None:
    raw = bytearray(gzip.compress(("\n".join(GOOD) + "\n").encode()))
    raw[20:30] = b"\xff" * 10
    path = tmp_path / "l.jsonl.gz"
    path.write_bytes(bytes(raw))
    expect_error(path, None, "corrupt gzip")


def test_not_gzip_at_all(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl.gz"
    path.write_text("\n".join(GOOD) + "\n")
    expect_error(path, None, "corrupt gzip")


@pytest.mark.parametrize("cut", [1, 4, 8, 40])
def test_truncated_gzip_never_passes(tmp_path: Path, cut: int) -> None:
    raw = gzip.compress(("\n".join(GOOD) + "\n").encode())
    path = tmp_path / "l.jsonl.gz"
    path.write_bytes(raw[:-cut])
    expect_error(path, None, "corrupt gzip", "truncated")


def test_crc_mismatch_is_corrupt(tmp_path: Path) -> None:
    raw = bytearray(gzip.compress(("\n".join(GOOD) + "\n").encode()))
    raw[-8] ^= 0xFF  # the CRC32 in the trailer
    path = tmp_path / "l.jsonl.gz"
    path.write_bytes(bytes(raw))
    expect_error(path, None, "corrupt gzip", "check")


def test_trailing_garbage_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join(GOOD) + "\n").encode()) + b"garbage!")
    expect_error(path, None, "corrupt gzip")


def test_empty_file_and_empty_stream(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl.gz"
    empty.write_bytes(b"")
    expect_error(empty, None, "empty file")
    no_lines = tmp_path / "nolines.jsonl.gz"
    no_lines.write_bytes(gzip.compress(b""))
    expect_error(no_lines, None, "no token lines")


def test_missing_file(tmp_path: Path) -> None:
    expect_error(tmp_path / "absent.jsonl.gz", None, "cannot read")


def bad_line(tmp_path: Path, index: int, text: str, *fragments: str) -> InputError:
    lines = list(GOOD)
    lines[index] = text
    path = write_lines(tmp_path / "l.jsonl.gz", lines)
    return expect_error(path, index + 1, *fragments)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ('{"token_idx": 2, "token_id": 1, "logits": [0.5, -1.0,', ("not valid JSON",)),
        ("[1, 2, 3]", ("JSON array, not an object",)),
        ('{"token_idx": 2, "logits": [0.5, -1.0, 2.0]}', ("missing key 'token_id'",)),
        ('{"token_id": 1, "logits": [0.5, -1.0, 2.0]}', ("missing key 'token_idx'",)),
        ('{"token_idx": 2, "token_id": 1}', ("missing key 'logits'",)),
        (
            '{"token_idx": 2.0, "token_id": 1, "logits": [0.5, 1, 2]}',
            ("token_idx must be an integer",),
        ),
        ('{"token_idx": true, "token_id": 1, "logits": [0.5, 1, 2]}', ("token_idx", "boolean")),
        ('{"token_idx": "2", "token_id": 1, "logits": [0.5, 1, 2]}', ("token_idx", "string")),
        (
            '{"token_idx": 2, "token_id": 1.5, "logits": [0.5, 1, 2]}',
            ("token_id must be an integer",),
        ),
        ('{"token_idx": 2, "token_id": -1, "logits": [0.5, 1, 2]}', ("token_id -1 is outside",)),
        ('{"token_idx": 2, "token_id": 3, "logits": [0.5, 1, 2]}', ("token_id 3 is outside",)),
        ('{"token_idx": 2, "token_id": 1, "logits": {"a": 1}}', ("logits must be an array",)),
        ('{"token_idx": 2, "token_id": 1, "logits": []}', ("logits is empty",)),
        ('{"token_idx": 2, "token_id": 1, "logits": [0.5, "1.0", 2]}', ("logits[1] is a string",)),
        ('{"token_idx": 2, "token_id": 1, "logits": [0.5, 1, true]}', ("logits[2] is a boolean",)),
        ('{"token_idx": 2, "token_id": 1, "logits": [false, 1, 2]}', ("logits[0] is a boolean",)),
        ('{"token_idx": 2, "token_id": 1, "logits": [0.5, null, 2]}', ("logits[1] is a null",)),
        ('{"token_idx": 2, "token_id": 1, "logits": [0.5, [1], 2]}', ("logits[1] is a array",)),
        # (simdjson's buffer would flatten these: a line with a second "[" anywhere is read
        # exactly)
        ('{"token_idx": 2, "token_id": 1, "logits": [[0.5], 1, 2]}', ("logits[0] is a array",)),
        ('{"token_idx": 2, "token_id": 1, "logits": [0.5, 1, [2]]}', ("logits[2] is a array",)),
        (
            '{"token_idx": 2, "token_id": 1, "logits": [0.5, 1, 2, 3]}',
            ("4 values but line 1 had 3",),
        ),
        ('{"token_idx": 2, "token_id": 1, "logits": [0.5, 1]}', ("2 values but line 1 had 3",)),
        ("", ("empty line",)),
    ],
)
def test_malformed_line_names_its_line(
    tmp_path: Path, text: str, fragments: tuple[str, ...]
) -> None:
    bad_line(tmp_path, 2, text, *fragments)


@pytest.mark.parametrize(
    ("value", "position", "word"),
    [("NaN", 1, "NaN"), ("Infinity", 0, "Infinity"), ("-Infinity", 2, "-Infinity")],
)
def test_non_finite_logits_name_line_and_position(
    tmp_path: Path, value: str, position: int, word: str
) -> None:
    values = ["0.5", "-1.0", "2.0"]
    values[position] = value
    text = '{"token_idx": 1, "token_id": 1, "logits": [' + ", ".join(values) + "]}"
    bad_line(tmp_path, 1, text, f"logits[{position}] is {word}")


def test_numbers_beyond_range_are_rejected(tmp_path: Path) -> None:
    # Beyond float64: Python's json reads it as Infinity.
    bad_line(tmp_path, 1, '{"token_idx": 1, "token_id": 1, "logits": [1e400, 1, 2]}', "logits[0]")
    # Finite in float64 but beyond float32.
    bad_line(
        tmp_path,
        3,
        '{"token_idx": 3, "token_id": 1, "logits": [0.5, 1, 1e39]}',
        "logits[2]",
        "float32",
    )


def test_missing_token(tmp_path: Path) -> None:
    lines = [GOOD[0], GOOD[1], line_of(3, 1, [0, 1, 2])]
    err = expect_error(write_lines(tmp_path / "l.jsonl.gz", lines), 3, "token 2 missing")
    assert "token_idx 3 where 2 was expected" in str(err)


def test_duplicate_token(tmp_path: Path) -> None:
    lines = [GOOD[0], GOOD[1], GOOD[1]]
    expect_error(write_lines(tmp_path / "l.jsonl.gz", lines), 3, "duplicate token_idx 1")


def test_out_of_order_tokens(tmp_path: Path) -> None:
    lines = [GOOD[0], GOOD[2], GOOD[1]]
    expect_error(write_lines(tmp_path / "l.jsonl.gz", lines), 2, "token_idx 2 where 1")


def test_first_token_must_be_zero(tmp_path: Path) -> None:
    expect_error(write_lines(tmp_path / "l.jsonl.gz", GOOD[1:]), 1, "token 0 missing")


def test_negative_token_idx(tmp_path: Path) -> None:
    bad_line(tmp_path, 0, line_of(-1, 1, [0, 1, 2]), "negative")


def test_blank_line_inside_the_file(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "l.jsonl.gz", [GOOD[0], "", GOOD[1]])
    expect_error(path, 2, "empty line")


def test_error_after_many_good_lines_names_the_right_line(tmp_path: Path) -> None:
    a, _, ids = pair_data(tokens=60, vocab=20)
    lines = [line_of(i, int(ids[i]), a[i]) for i in range(60)]
    lines[47] = lines[47].replace('"logits": [', '"logits": [NaN, ', 1)
    path = write_lines(tmp_path / "l.jsonl.gz", lines)
    expect_error(path, 48, "logits[0] is NaN")


# ---------------------------------------------------------------- metadata


META = {
    "dtype": "bf16",
    "prompt_len": 512,
    "gen_len": 128,
    "seed": 0,
    "kv_aligned": 1,
    "mode": "prefill",
    "timestamp": "2026-02-07T20:00:00Z",
    "git_commit": "abc123def",
}


def test_read_metadata_returns_the_object(tmp_path: Path) -> None:
    path = tmp_path / "metadata.json"
    path.write_text(json.dumps(META))
    assert read_metadata(path) == META


@pytest.mark.parametrize("key", ["dtype", "prompt_len", "gen_len", "seed", "kv_aligned", "mode"])
def test_metadata_missing_key(tmp_path: Path, key: str) -> None:
    path = tmp_path / "metadata.json"
    path.write_text(json.dumps({k: v for k, v in META.items() if k != key}))
    with pytest.raises(InputError) as info:
        read_metadata(path)
    assert str(info.value).startswith(f"{path}: missing key '{key}' — ")


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("dtype", 16, "must be a string"),
        ("prompt_len", "512", "must be an integer"),
        ("gen_len", 128.0, "must be an integer"),
        ("seed", True, "must be an integer"),
        ("kv_aligned", 2, "0 or 1"),
        ("mode", "both", "'prefill' or 'decode'"),
        ("seed", -1, "negative"),
    ],
)
def test_metadata_wrong_type(tmp_path: Path, key: str, value: Any, fragment: str) -> None:
    path = tmp_path / "metadata.json"
    path.write_text(json.dumps({**META, key: value}))
    with pytest.raises(InputError) as info:
        read_metadata(path)
    assert str(info.value).startswith(f"{path}: key '{key}'")
    assert fragment in str(info.value)


def test_metadata_bad_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "metadata.json"
    path.write_text('{\n  "dtype": "bf16",\n  "seed": ,\n}')
    with pytest.raises(InputError) as info:
        read_metadata(path)
    assert info.value.line == 3 and str(info.value).startswith(f"{path}:3: not valid JSON")


def test_metadata_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "metadata.json"
    path.write_text("[1]")
    with pytest.raises(InputError, match="not an object"):
        read_metadata(path)


# ---------------------------------------------------------------- metrics


@pytest.mark.parametrize(("tokens", "vocab", "noise"), [(8, 300, 1e-4), (13, 1001, 0.3), (1, 7, 0)])
def test_metrics_equal_an_independent_section8_computation(
    tmp_path: Path, tokens: int, vocab: int, noise: float
) -> None:
    a, b, ids = pair_data(tokens, vocab, noise, seed=tokens)
    expected = section8(a, b)
    pre = write_table(tmp_path / "p.jsonl.gz", a, ids)
    dec = write_table(tmp_path / "d.jsonl.gz", b, ids)
    streamed = compare_files(pre, dec, seed=0, kv_aligned=1, **PAIR_KW)
    loaded = compare_pair(read_logits(pre), read_logits(dec), seed=0, kv_aligned=1, **PAIR_KW)
    for result in (streamed, loaded):
        assert result.pair_count == tokens
        for key in ("max_abs_diff", "p99_abs_diff", "top1_agreement"):
            assert result.metrics[key] == expected[key], key
        assert result.metrics["cos_sim_mean"] == pytest.approx(expected["cos_sim_mean"], abs=1e-6)


def test_top1_agreement_counts_tokens(tmp_path: Path) -> None:
    a, b, ids = pair_data(tokens=10, vocab=50, noise=0)
    for i in (2, 7):  # flip the winner of two tokens on the decode side
        b[i, ids[i]] = b[i].min() - 1
    result = compare_pair(table("p", a, ids), table("d", b, ids), seed=0, kv_aligned=0, **PAIR_KW)
    assert result.metrics["top1_agreement"] == 0.8


def test_p99_uses_linear_interpolation_over_all_elements() -> None:
    a = np.zeros((2, 50), np.float32)
    b = a.copy()
    b[0, :] = np.arange(50, dtype=np.float32)
    b[1, :] = np.arange(50, 100, dtype=np.float32)
    result = compare_pair(
        table("p", a, [0, 0]), table("d", b, [0, 0]), seed=0, kv_aligned=0, **PAIR_KW
    )
    assert result.metrics["p99_abs_diff"] == pytest.approx(98.01)  # 0.99 * 99
    assert result.metrics["max_abs_diff"] == 99.0


def test_cosine_of_zero_rows_and_of_huge_logits() -> None:
    a = np.zeros((2, 4), np.float32)
    a[1] = [1e30, -1e30, 3e29, 0.0]  # float32 dot products overflow here
    b = a.copy()
    b[1, 3] = 1.0
    result = compare_pair(
        table("p", a, [0, 0]), table("d", b, [0, 0]), seed=0, kv_aligned=0, **PAIR_KW
    )
    assert result.metrics["cos_sim_mean"] == pytest.approx(1.0)


def test_a_difference_beyond_float32_is_an_input_error() -> None:
    a = np.zeros((2, 4), np.float32)
    b = a.copy()
    a[1, 2], b[1, 2] = 3e38, -3e38
    with pytest.raises(InputError, match=r"^p:2: the difference with d:2 overflows float32"):
        compare_pair(table("p", a, [0, 0]), table("d", b, [0, 0]), seed=0, kv_aligned=0, **PAIR_KW)


# ---------------------------------------------------------------- pairing


def test_token_id_mismatch_names_both_files_and_the_line(tmp_path: Path) -> None:
    a, b, ids = pair_data(tokens=6, vocab=40)
    other = ids.copy()
    other[4] = (other[4] + 1) % 40
    pre = write_table(tmp_path / "p.jsonl.gz", a, ids)
    dec = write_table(tmp_path / "d.jsonl.gz", b, other)
    threads = threading.active_count()
    # kv_aligned=0: ids that no argmax explains are not a pair of one prompt.
    for judge in (
        lambda: compare_files(pre, dec, seed=0, kv_aligned=0, **PAIR_KW),
        lambda: compare_pair(read_logits(pre), read_logits(dec), seed=0, kv_aligned=0, **PAIR_KW),
    ):
        with pytest.raises(InputError) as info:
            judge()
        text = str(info.value)
        assert text.startswith(f"{pre}:5: token_idx 4 has token_id {ids[4]}"), text
        assert f"{dec}:5" in text and "not comparable" in text
    assert threading.active_count() == threads, "a reader thread outlived the failed pair"
    # kv_aligned=1: the modes must write the same tokens; a difference is FAIL_EQUIV there.
    for result in (
        compare_files(pre, dec, seed=0, kv_aligned=1, **PAIR_KW),
        compare_pair(read_logits(pre), read_logits(dec), seed=0, kv_aligned=1, **PAIR_KW),
    ):
        ff = result.first_fail
        assert result.verdict == FAIL_EQUIV and ff is not None
        assert (ff["token_idx"], ff["metric"]) == (4, "token_id")
        assert ff["token_ids"] == {"prefill": int(ids[4]), "decode": int(other[4])}
        assert ff["where"]["decode"].endswith(":5") and result.pair_count == 5


def test_token_count_mismatch(tmp_path: Path) -> None:
    a, b, ids = pair_data(tokens=6, vocab=40)
    pre = write_table(tmp_path / "p.jsonl.gz", a, ids)
    dec = write_table(tmp_path / "d.jsonl.gz", b[:4], ids[:4])
    for first, second in ((pre, dec), (dec, pre)):
        with pytest.raises(InputError) as info:
            compare_files(first, second, seed=0, kv_aligned=1, **PAIR_KW)
        counts = (6, 4) if first == pre else (4, 6)
        assert str(info.value).startswith(
            f"{first}: {counts[0]} tokens here but {counts[1]} in {second}"
        )
    with pytest.raises(InputError, match="6 tokens here but 4"):
        compare_pair(read_logits(pre), read_logits(dec), seed=0, kv_aligned=1, **PAIR_KW)


@pytest.mark.parametrize("workers", [1, 2])
def test_token_counts_after_the_modes_part_ways_are_exact(tmp_path: Path, workers: int) -> None:
    """The sides write different tokens from token 2 (kv_aligned 0: compared no further, still
    read to the end); then one side is a token short: the message counts every token."""
    a, b, ids = pair_data(tokens=8, vocab=30)
    split = (ids[2] + 1) % 30
    b[2, split] = a[2].max() + 1  # decode's greedy pick at token 2 is another token
    other = np.argmax(b, axis=1)
    assert other[2] == split and (other[:2] == ids[:2]).all()
    pre = write_table(tmp_path / "p.jsonl.gz", a, ids)
    dec = write_table(tmp_path / "d.jsonl.gz", b[:7], other[:7])
    kw = {**PAIR_KW, "workers": workers}
    with pytest.raises(InputError) as info:
        compare_files(pre, dec, seed=0, kv_aligned=0, **kw)
    assert str(info.value).startswith(f"{pre}: 8 tokens here but 7 in {dec}")
    with pytest.raises(InputError) as info:
        compare_files(dec, pre, seed=0, kv_aligned=0, **kw)
    assert str(info.value).startswith(f"{dec}: 7 tokens here but 8 in {pre}")


def test_vocab_mismatch_between_sides(tmp_path: Path) -> None:
    a, _, ids = pair_data(tokens=3, vocab=40)
    b, _, _ = pair_data(tokens=3, vocab=41)
    pre = write_table(tmp_path / "p.jsonl.gz", a, ids)
    dec = write_table(tmp_path / "d.jsonl.gz", b, ids)
    with pytest.raises(InputError) as info:
        compare_files(pre, dec, seed=0, kv_aligned=1, **PAIR_KW)
    assert str(info.value).startswith(f"{pre}:1: vocab size 40 here but 41 in {dec}:1")


def test_bad_line_in_one_side_is_reported_during_the_pair(tmp_path: Path) -> None:
    a, b, ids = pair_data(tokens=5, vocab=10)
    pre = write_table(tmp_path / "p.jsonl.gz", a, ids)
    lines = [line_of(i, int(ids[i]), b[i]) for i in range(5)]
    lines[3] = lines[3].replace("[", "[NaN, ", 1)
    dec = write_lines(tmp_path / "d.jsonl.gz", lines)
    with pytest.raises(InputError) as info:
        compare_files(pre, dec, seed=0, kv_aligned=1, **PAIR_KW)
    assert str(info.value).startswith(f"{dec}:4: logits[0] is NaN")


def test_truncated_side_fails_the_pair(tmp_path: Path) -> None:
    a, b, ids = pair_data(tokens=5, vocab=10)
    pre = write_table(tmp_path / "p.jsonl.gz", a, ids)
    dec = write_table(tmp_path / "d.jsonl.gz", b, ids)
    dec.write_bytes(dec.read_bytes()[:-6])
    with pytest.raises(InputError, match="truncated"):
        compare_files(pre, dec, seed=0, kv_aligned=1, **PAIR_KW)


# ---------------------------------------------------------------- verdicts


def judged(
    kv_aligned: int, noise: float, thresholds: dict[str, float] | None = None, seed: int = 0
) -> PairResult:
    a, b, ids = pair_data(tokens=8, vocab=200, noise=noise)
    return compare_pair(
        table("p", a, ids),
        table("d", b, ids),
        seed=seed,
        kv_aligned=kv_aligned,
        thresholds=thresholds,
        **PAIR_KW,
    )


def test_verdicts_follow_section_3_2() -> None:
    assert judged(1, 1e-4).verdict == PASS_EQUIV
    assert judged(1, 1e-2).verdict == FAIL_EQUIV
    drift = judged(0, 1.0)
    assert drift.verdict == EXPECTED_DRIFT and drift.first_fail is None
    assert judged(0, 0.0).verdict == EXPECTED_DRIFT


def test_thresholds_default_to_the_seed_and_can_be_overridden() -> None:
    assert THRESHOLDS == {
        "p99_abs_diff_max": 1e-3,
        "max_abs_diff_max": 5e-3,
        "top1_agreement_min": 0.999,
    }
    assert judged(1, 1e-4).thresholds == THRESHOLDS
    loose = judged(1, 1e-2, {"p99_abs_diff_max": 1.0, "max_abs_diff_max": 1.0})
    assert loose.verdict == PASS_EQUIV
    assert loose.thresholds == {**THRESHOLDS, "p99_abs_diff_max": 1.0, "max_abs_diff_max": 1.0}
    tight = judged(1, 1e-4, {"max_abs_diff_max": 1e-6})
    assert tight.verdict == FAIL_EQUIV and tight.first_fail["metric"] == "max_abs_diff"
    with pytest.raises(ValueError, match="unknown threshold"):
        judged(1, 1e-4, {"p98_abs_diff_max": 1.0})


def test_boundaries_are_inclusive() -> None:
    a = np.zeros((2, 100), np.float32)
    a[:, 0] = 10.0
    b = a.copy()
    b[0, 50] = np.float32(0.5)  # the only |Δ| of token 0
    b[1, 1] = 20.0  # token 1: the argmax moves
    ids = [0, 0]
    pair = table("p", a, ids), table("d", b, ids)
    flat = np.abs(a - b).ravel()
    edge = {
        "max_abs_diff_max": float(flat.max()),
        "p99_abs_diff_max": float(np.percentile(flat, 99)),
        "top1_agreement_min": 0.5,
    }
    result = compare_pair(*pair, seed=0, kv_aligned=1, thresholds=edge, **PAIR_KW)
    assert result.metrics["top1_agreement"] == 0.5
    assert result.verdict == PASS_EQUIV
    below = {**edge, "max_abs_diff_max": float(np.nextafter(np.float32(20.0), np.float32(0)))}
    assert compare_pair(*pair, seed=0, kv_aligned=1, thresholds=below, **PAIR_KW).verdict == (
        FAIL_EQUIV
    )


def test_global_verdict_and_exit_codes() -> None:
    ok, bad, drift = judged(1, 1e-4), judged(1, 1e-2), judged(0, 1.0)

    def word(results: list[PairResult], unjudged: list[Unjudged] | None = None) -> str:
        return guardrail_verdict(results, unjudged or [], THRESHOLDS)[0]

    assert word([ok, ok, drift]) == PASS_GUARDRAIL
    assert word([ok, bad, drift]) == FAIL_GUARDRAIL
    # No kv_aligned=1 pair guards anything: never a pass (issue 9, case 5).
    assert word([drift, drift]) == FAIL_GUARDRAIL
    assert word([]) == FAIL_GUARDRAIL
    crash = Unjudged(1, 2, "engine", "decode side exited 127")
    assert word([ok, drift], [crash]) == "ENGINE_ERROR"
    assert word([ok, bad], [crash]) == FAIL_GUARDRAIL  # a real disagreement is the finding
    assert word([ok], [Unjudged(1, 1, "input", "missing")]) == "INPUT_ERROR"
    assert word([ok], [Unjudged(1, 1, "output", "NaN at f:3")]) == FAIL_GUARDRAIL
    assert word([ok], [Unjudged(1, 1, "infra", "disk full")]) == "INFRA_ERROR"
    loose = guardrail_verdict([ok], [], {**THRESHOLDS, "p99_abs_diff_max": 0.01})
    assert loose[0] == "PASS_GUARDRAIL_LOOSENED" and "0.001 -> 0.01 (10x)" in loose[1]
    assert exit_code_for(PASS_GUARDRAIL) == exit_code_for("PASS_GUARDRAIL_LOOSENED") == 0
    assert exit_code_for(FAIL_GUARDRAIL) == 1
    assert exit_code_for("INPUT_ERROR") == 2
    assert exit_code_for("ENGINE_ERROR") == exit_code_for("INFRA_ERROR") == 3
    for not_global in (PASS_EQUIV, EXPECTED_DRIFT):
        with pytest.raises(ValueError):
            exit_code_for(not_global)


# ---------------------------------------------------------------- first_fail


def test_first_fail_is_the_first_token_whose_argmax_differs(tmp_path: Path) -> None:
    a, b, ids = pair_data(tokens=12, vocab=100, noise=1e-5)
    b[9, 3] += 0.5  # a later token with a large |Δ|
    runner_up = int(np.argsort(a[5])[-2])
    b[5, runner_up] = a[5, ids[5]] + 1e-4  # decode prefers the runner-up at token 5
    pre = write_table(tmp_path / "p.jsonl.gz", a, ids)
    dec = write_table(tmp_path / "d.jsonl.gz", b, ids)
    result = compare_files(pre, dec, seed=4, kv_aligned=1, **PAIR_KW)
    assert result.verdict == FAIL_EQUIV
    ff = result.first_fail
    assert ff is not None
    assert ff["seed"] == 4 and ff["kv_aligned"] == 1
    assert ff["token_idx"] == 5 and ff["token_id"] == int(ids[5])
    assert ff["metric"] == "top1_agreement" and ff["value"] == 0.0
    assert ff["threshold"] == 0.999
    assert ff["top5"] == {"prefill": top5(a[5]), "decode": top5(b[5])}
    assert ff["top5"]["decode"][0][0] == runner_up
    assert ff["where"] == {"prefill": f"{pre}:6", "decode": f"{dec}:6"}
    assert ff["note"] is None


def test_first_fail_on_max_abs_diff_only() -> None:
    a, b, ids = pair_data(tokens=12, vocab=100, noise=1e-5)
    b[7, 11] += 0.01
    b[10, 12] += 0.02
    result = compare_pair(table("p", a, ids), table("d", b, ids), seed=0, kv_aligned=1, **PAIR_KW)
    ff = result.first_fail
    assert ff["token_idx"] == 7 and ff["metric"] == "max_abs_diff"
    assert ff["value"] == float(np.abs(a[7] - b[7]).max()) and ff["threshold"] == 5e-3
    assert ff["where"] == {"prefill": "p:8", "decode": "d:8"}


def test_first_fail_on_a_tokens_own_p99() -> None:
    a, b, ids = pair_data(tokens=12, vocab=1000, noise=1e-5)
    rng = np.random.default_rng(3)
    hit = rng.choice(1000, 30, replace=False)
    hit = hit[hit != ids[4]]
    b[4, hit] += np.float32(0.002)  # 3% of token 4 off by 2e-3: under max, over p99
    b[9, 5] += np.float32(0.01)  # the pair fails (on max) at a later token
    result = compare_pair(table("p", a, ids), table("d", b, ids), seed=0, kv_aligned=1, **PAIR_KW)
    ff = result.first_fail
    assert ff["token_idx"] == 4 and ff["metric"] == "p99_abs_diff"
    assert ff["value"] == float(np.percentile(np.abs(a[4] - b[4]), 99))
    assert ff["threshold"] == 1e-3
    assert ff["tripped"] == ["p99_abs_diff"]


def test_first_fail_on_p99_with_the_fewest_values_that_can_trip_it() -> None:
    # vocab 150: a token's p99 is 0.49 * s[147] + 0.51 * s[148], so two values of 2.5e-3
    # give about 1.3e-3 (> 1e-3) while the max, 2.5e-3, stays under 5e-3.
    a, b, ids = pair_data(tokens=8, vocab=150, noise=1e-6)
    cols = [c for c in (10, 20, 30) if c != ids[2]][:2]
    b[2, cols] = a[2, cols] + np.float32(2.5e-3)
    b[6, 5 if ids[6] != 5 else 6] += np.float32(0.01)
    result = compare_pair(table("p", a, ids), table("d", b, ids), seed=0, kv_aligned=1, **PAIR_KW)
    ff = result.first_fail
    assert (ff["token_idx"], ff["metric"], ff["tripped"]) == (2, "p99_abs_diff", ["p99_abs_diff"])
    assert ff["value"] == float(np.percentile(np.abs(a[2] - b[2]), 99)) > 1e-3


def test_first_fail_when_only_the_aggregate_fails() -> None:
    # vocab 150: a token's p99 sits halfway between its 148th and 149th smallest |Δ|, so two
    # values of 1.5e-3 per token give a token p99 of about 7.7e-4 (passes), while over the whole
    # pair 1.33% of the values are 1.5e-3, so the pair's p99 is 1.5e-3 (fails).
    a, b, ids = pair_data(tokens=20, vocab=150, noise=1e-6)
    for i in range(20):
        cols = [c for c in (10, 20, 30) if c != ids[i]][:2]
        b[i, cols] = a[i, cols] + np.float32(1.5e-3)
        if i == 13:
            b[i, cols[1]] = a[i, cols[1]] + np.float32(2e-3)
    diffs = np.abs(a - b)
    assert all(np.percentile(d, 99) <= 1e-3 for d in diffs)
    assert diffs.max() <= 5e-3 and np.percentile(diffs, 99) > 1e-3
    result = compare_pair(table("p", a, ids), table("d", b, ids), seed=0, kv_aligned=1, **PAIR_KW)
    assert result.verdict == FAIL_EQUIV
    ff = result.first_fail
    assert ff["token_idx"] == 13  # the token with the largest |Δ|
    assert ff["metric"] == "p99_abs_diff" and ff["value"] == result.metrics["p99_abs_diff"]
    assert "no single token" in ff["note"] and "largest" in ff["note"]
    assert ff["top5"]["prefill"] == top5(a[13])


def test_no_first_fail_for_passing_or_drifting_pairs() -> None:
    assert judged(1, 1e-4).first_fail is None
    assert judged(0, 1.0).first_fail is None


def test_top5_breaks_ties_by_lower_token_id() -> None:
    a = np.zeros((1, 10), np.float32)
    a[0, [8, 2, 6]] = 1.0
    b = a.copy()
    b[0, 0] = 2.0
    result = compare_pair(table("p", a, [8]), table("d", b, [8]), seed=0, kv_aligned=1, **PAIR_KW)
    assert result.first_fail["top5"]["prefill"] == [
        [2, 1.0],
        [6, 1.0],
        [8, 1.0],
        [0, 0.0],
        [1, 0.0],
    ]
    assert result.first_fail["top5"]["decode"][0] == [0, 2.0]


# ---------------------------------------------------------------- documents


def test_metrics_document_has_exactly_the_section_2_2_shape() -> None:
    result = judged(1, 1e-2)
    doc = metrics_document(result, "2026-02-07T20:01:00Z")
    assert list(doc)[:11] == [
        "seed",
        "dtype",
        "prompt_len",
        "gen_len",
        "kv_aligned",
        "pair_count",
        "metrics",
        "verdict",
        "thresholds",
        "first_fail",
        "timestamp",
    ]
    # beyond section 2.2, after its keys: line counts and the precision context
    assert list(doc)[11:] == ["tokens", "precision"]
    assert doc["tokens"] == {"prefill": 8, "decode": 8}
    assert list(doc["metrics"]) == [
        "max_abs_diff",
        "p99_abs_diff",
        "top1_agreement",
        "cos_sim_mean",
    ]
    assert doc["verdict"] == FAIL_EQUIV and doc["first_fail"] == result.first_fail
    assert doc["thresholds"] == THRESHOLDS and doc["timestamp"] == "2026-02-07T20:01:00Z"
    assert (doc["dtype"], doc["prompt_len"], doc["gen_len"], doc["pair_count"]) == (
        "bf16",
        32,
        8,
        8,
    )
    json.dumps(doc, allow_nan=False)


def test_summary_has_the_section_2_3_shape_and_flat_counts() -> None:
    ok, bad, drift = judged(1, 1e-4), judged(1, 1e-2, seed=1), judged(0, 1.0)
    matrix = {
        "kv_aligned": [0, 1],
        "dtype": ["bf16"],
        "prompt_len": [32],
        "gen_len": [8],
        "seeds": [0, 1],
    }
    summary = summarize([ok, bad, drift], matrix, None, "2026-02-07")
    assert list(summary)[:11] == [
        "benchmark",
        "date",
        "config_matrix",
        "total_runs",
        "pass_equiv",
        "fail_equiv",
        "expected_drift",
        "results",
        "first_fail",
        "global_verdict",
        "threshold_config",
    ]
    assert list(summary)[11:] == ["unjudged", "diverged", "thresholds_loosened", "reason"]
    assert summary["unjudged"] == [] and summary["thresholds_loosened"] == {}
    assert summary["benchmark"] == "B3.67" and summary["date"] == "2026-02-07"
    assert summary["config_matrix"] == matrix
    assert (
        summary["total_runs"],
        summary["pass_equiv"],
        summary["fail_equiv"],
        summary["expected_drift"],
    ) == (3, 1, 1, 1)
    k1, k0 = summary["results"]["kv_aligned_1"], summary["results"]["kv_aligned_0"]
    assert (k1["total_runs"], k1["pass_equiv"], k1["fail_equiv"]) == (2, 1, 1)
    assert (k0["total_runs"], k0["expected_drift"]) == (1, 1)
    mean = (ok.metrics["max_abs_diff"] + bad.metrics["max_abs_diff"]) / 2
    assert k1["metrics_summary"]["max_abs_diff_mean"] == pytest.approx(mean)
    assert k0["metrics_summary"]["p99_abs_diff_mean"] == drift.metrics["p99_abs_diff"]
    assert summary["first_fail"] == bad.first_fail and summary["first_fail"]["seed"] == 1
    assert summary["global_verdict"] == FAIL_GUARDRAIL
    assert summary["threshold_config"] == THRESHOLDS
    json.dumps(summary, allow_nan=False)


def test_summary_first_fail_follows_the_order_given() -> None:
    passing, first, second = judged(1, 1e-4, seed=1), judged(1, 1e-2, seed=2), judged(1, 1e-2)
    summary = summarize([passing, first, second], {}, None, "d")
    assert summary["first_fail"] == first.first_fail and summary["first_fail"]["seed"] == 2
    assert summarize([second, first], {}, None, "d")["first_fail"]["seed"] == 0


def test_report_shows_verdicts_results_and_the_first_failure() -> None:
    ok, bad, drift = judged(1, 1e-4), judged(1, 1e-2), judged(0, 1.0)
    summary = summarize([ok, bad, drift], {"kv_aligned": [1, 0]}, None, "2026-02-07")
    text = report_markdown(summary, [ok, bad, drift])
    for heading in (
        "## Objective",
        "## Method",
        "## Matrix",
        "## Results",
        "## First failure",
        "## How to read the verdicts",
    ):
        assert heading in text
    assert "**Global verdict: FAIL_GUARDRAIL**" in text
    # Issue 20: the float32 normalisation is said where the method is, with what it can flip.
    method = text.split("## Method")[1].split("## Matrix")[0]
    assert "normalised to float32 before they are compared (seed section 4)" in method
    assert "one float32 step of a threshold may get the other verdict" in method
    for word in (PASS_EQUIV, FAIL_EQUIV, EXPECTED_DRIFT, PASS_GUARDRAIL, FAIL_GUARDRAIL):
        assert word in text
    ff = bad.first_fail
    assert f"token_idx {ff['token_idx']}, token_id {ff['token_id']}" in text
    assert f"`{ff['metric']}`" in text and ff["where"]["decode"] in text
    assert f"| 1 | {ff['top5']['prefill'][0][0]} |" in text
    clean = report_markdown(summarize([ok, drift], {}, None, "d"), [ok, drift])
    assert "there is no first failure" in clean and "PASS_GUARDRAIL**" in clean


def test_greedy_divergence_compares_up_to_the_split_then_stops() -> None:
    """Drift flips an argmax: each side follows its own token; later tokens are not compared."""
    from analysis.equivalence import compare_pair, metrics_document
    from analysis.logits import LogitsTable

    rng = np.random.default_rng(7)
    t, v = 6, 50
    a = rng.normal(size=(t, v)).astype(np.float32)
    b = a.copy()
    b[3] += 0.01
    b[3, int(np.argsort(a[3])[-2])] = a[3].max() + 1.0  # decode's argmax moves at token 3
    ids_a = a.argmax(axis=1)
    ids_b = b.argmax(axis=1)
    b[4:] = rng.normal(size=(t - 4, v))  # a different prefix from here on
    ids_b[4:] = b[4:].argmax(axis=1)
    idx = np.arange(t)
    pre = LogitsTable("p.gz", idx, ids_a.astype(np.int64), a)
    dec = LogitsTable("d.gz", idx, ids_b.astype(np.int64), b)
    kw = dict(seed=0, dtype="bf16", prompt_len=8, gen_len=t)
    drift = compare_pair(pre, dec, kv_aligned=0, **kw)
    assert drift.verdict == "EXPECTED_DRIFT"
    assert drift.pair_count == 4 and drift.diverged_at_token == 3
    assert drift.metrics["top1_agreement"] == 0.75
    assert metrics_document(drift, "t")["diverged_at_token"] == 3
    aligned = compare_pair(pre, dec, kv_aligned=1, **kw)
    assert aligned.verdict == "FAIL_EQUIV"
    assert aligned.first_fail is not None and aligned.first_fail["token_idx"] == 3
    assert aligned.first_fail["tripped"][0] == "token_id"


def test_token_ids_that_no_argmax_explains_are_not_a_pair() -> None:
    from analysis.equivalence import compare_pair
    from analysis.logits import InputError, LogitsTable

    a = np.zeros((2, 5), dtype=np.float32)
    a[:, 1] = 1.0
    idx = np.arange(2)
    pre = LogitsTable("p.gz", idx, np.array([1, 1]), a)
    dec = LogitsTable("d.gz", idx, np.array([1, 4]), a.copy())  # 4 is no argmax: another run
    with pytest.raises(InputError, match="d.gz:2: the pair is not comparable"):
        compare_pair(pre, dec, kv_aligned=0, seed=0, dtype="bf16", prompt_len=1, gen_len=2)


def test_an_exact_tie_broken_differently_is_fail_equiv_not_a_one_token_pass() -> None:
    """Issue 9 case 3: kv_aligned=1 must not pass on token 0 when the sides pick other ids."""
    v, t = 10, 4
    a = np.zeros((t, v), np.float32)
    a[:, 3] = a[:, 7] = 5.0  # token 0's top logit is an exact tie between ids 3 and 7
    rng = np.random.default_rng(0)
    garbage = rng.normal(size=(t - 1, v)).astype(np.float32)
    b = a.copy()
    b[1:] = garbage  # after the split the decode side follows another prefix
    ids_a = np.array([3, 3, 3, 3])
    ids_b = np.array([7, *garbage.argmax(axis=1)])
    result = compare_pair(
        table("p", a, ids_a), table("d", b, ids_b), seed=0, kv_aligned=1, **PAIR_KW
    )
    assert result.verdict == FAIL_EQUIV
    assert result.first_fail["metric"] == "token_id" and result.first_fail["token_idx"] == 0
    assert result.pair_count == 1 and result.diverged_at_token == 0
    drift = compare_pair(
        table("p", a, ids_a), table("d", b, ids_b), seed=0, kv_aligned=0, **PAIR_KW
    )
    assert drift.verdict == EXPECTED_DRIFT and drift.diverged_at_token == 0


def test_precision_context_names_the_rounding_steps_of_max_abs_diff() -> None:
    a = np.zeros((2, 8), np.float32)
    a[:, 0] = 3.0
    b = a.copy()
    b[1, 0] = 3.0 + 2 * 2.0**-6  # two bf16 steps at |logit| in [2, 4): 1 ULP is 0.015625
    ids = [0, 0]
    result = compare_pair(table("p", a, ids), table("d", b, ids), seed=0, kv_aligned=1, **PAIR_KW)
    p = result.precision
    assert p is not None and p["ulp"] == 0.015625 and p["max_abs_diff_ulps"] == 2.0
    assert p["max_abs_diff_at"] == {"token_idx": 1, "vocab_index": 0}
    assert p["max_rel_diff"] == pytest.approx(2 * 2.0**-6 / (3.0 + 2 * 2.0**-6))
    assert result.verdict == FAIL_EQUIV  # the context never changes the verdict


COSINE_PROBE = """
import json, sys
import numpy as np
from analysis.equivalence import _cosine
rng = np.random.default_rng(5)
out = []
for n in (8192, 32000, 129280):
    a = (rng.standard_normal(n) * 4).astype(np.float32)
    b = (a + rng.standard_normal(n).astype(np.float32) * 0.05).astype(np.float32)
    out.append(_cosine(a, b).hex())
print(json.dumps(out))
"""


def test_cosine_is_the_same_whichever_blas_kernel_the_machine_picks() -> None:
    """A fleet host and the console judge the same rows to the same digits: OpenBLAS picks its
    dot kernel by CPU (OPENBLAS_CORETYPE forces one), and each sums in its own order. The old
    np.dot cosine differed in its last digits between Haswell and Prescott kernels."""
    root = Path(__file__).resolve().parent.parent
    said = set()
    for core in ("Haswell", "Prescott", "Sandybridge"):
        env = {**os.environ, "OPENBLAS_CORETYPE": core, "PYTHONPATH": str(root)}
        done = subprocess.run(
            [sys.executable, "-c", COSINE_PROBE], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        said.add(done.stdout.strip())
    assert len(said) == 1, said


def test_cosine_is_the_seeds_float64_cosine() -> None:
    """Within float64 rounding of the seed's formula (np.array of the rows, dot / norms)."""
    rng = np.random.default_rng(9)
    a = (rng.standard_normal(32000) * 4).astype(np.float32)
    b = (a + rng.standard_normal(32000).astype(np.float32) * 0.05).astype(np.float32)
    exact = math.fsum(float(x) * float(y) for x, y in zip(a, b, strict=True)) / (
        math.sqrt(math.fsum(float(x) ** 2 for x in a))
        * math.sqrt(math.fsum(float(y) ** 2 for y in b))
    )
    assert _cosine(a, b) == pytest.approx(exact, rel=1e-14, abs=0)
    assert _cosine(np.zeros(4, np.float32), np.zeros(4, np.float32)) == 1.0
    assert _cosine(np.zeros(4, np.float32), np.ones(4, np.float32)) == 0.0


def test_relative_diff_and_cosine_are_the_plain_formulas_bit_for_bit() -> None:
    """The judge computes in reused buffers; its numbers are the plain numpy formulas' own,
    including rows with 0 on both sides (0 / 0 counts as equal), 0 on one side, subnormals."""
    rng = np.random.default_rng(11)
    t, v = 6, 4096
    a = rng.normal(0.0, 3.0, (t, v)).astype(np.float32)
    a += np.where(a < 0, -0.5, 0.5).astype(np.float32)  # no sign flips below: rel Δ << 1
    b = (a + rng.normal(0.0, 1e-3, (t, v))).astype(np.float32)
    a[1, :100] = b[1, :100] = 0.0  # both zero: a NaN for a bare division, in the row...
    a[1, 200], b[1, 200] = 1.0, -1.0  # ...that holds the largest relative Δ (2)
    a[2, 5] = 0.0  # zero on one side only: a relative Δ of 1
    a[3, :50] = b[3, :50] = 1e-40  # subnormal, equal
    b[3, 50] = 3e-41
    a[4] = b[4] = 0.0  # a whole row of zeros on both sides
    ids = np.argmax(a, axis=1)
    result = compare_pair(table("p", a, ids), table("d", b, ids), seed=0, kv_aligned=0, **PAIR_KW)
    best, best_at, cosines = 0.0, None, []
    for i in range(t):
        diff = np.abs(a[i] - b[i])
        scale = np.maximum(np.abs(a[i]), np.abs(b[i]))
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(scale > 0, diff / scale, 0.0)
        if float(rel.max()) > best:
            best, best_at = float(rel.max()), (i, int(np.argmax(rel)))
        a64, b64 = a[i].astype(np.float64), b[i].astype(np.float64)
        norms = math.sqrt(np.add.reduce(a64 * a64)) * math.sqrt(np.add.reduce(b64 * b64))
        cosines.append(1.0 if norms == 0 else float(np.add.reduce(a64 * b64) / norms))
    p = result.precision
    assert p is not None
    assert (p["max_rel_diff"], p["max_rel_diff_at"]) == (
        best,
        {"token_idx": best_at[0], "vocab_index": best_at[1]},
    )
    assert best == 2.0 and best_at == (1, 200)
    assert result.metrics["cos_sim_mean"] == float(np.mean(np.asarray(cosines, np.float64)))


@pytest.mark.parametrize(
    ("shape", "readings"),
    [("steady", 1), ("growing", 1), ("shrinking", 2), ("identical", 1), ("zero, then noise", 1)],
)
def test_a_streamed_pairs_p99_is_numpys_whether_or_not_its_top_was_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: str, readings: int
) -> None:
    """compare_files keeps only the top of the |Δ| past its first values; a pair whose later
    tokens differ far less than its first is read again keeping every |Δ|. Either way its p99
    is np.percentile's over every |Δ|, and the other metrics are those of a loaded pair."""
    import analysis.equivalence as equivalence

    t, v = 40, 512
    monkeypatch.setattr(equivalence, "_TOP_FIRST", 4 * v)  # the threshold after 4 tokens
    rng = np.random.default_rng(8)
    a = rng.normal(-1.0, 3.0, (t, v)).astype(np.float32)
    scale = {
        "steady": np.full(t, 1e-4),
        "growing": np.linspace(1e-5, 1e-3, t),
        "shrinking": np.linspace(1e-3, 1e-6, t),
        "identical": np.zeros(t),
        "zero, then noise": np.r_[np.zeros(6), np.full(t - 6, 1e-4)],
    }[shape]
    b = (a + rng.normal(0.0, 1.0, (t, v)) * scale[:, None]).astype(np.float32)
    ids = np.argmax(a, axis=1)
    pre, dec = (
        write_table(tmp_path / "p.jsonl.gz", a, ids),
        write_table(tmp_path / "d.jsonl.gz", b, ids),
    )
    passes = []
    real = equivalence._judge_rows
    monkeypatch.setattr(
        equivalence,
        "_judge_rows",
        lambda judge, *rest: (passes.append(judge.keep_all), real(judge, *rest)),
    )
    streamed = compare_files(pre, dec, seed=0, kv_aligned=0, **PAIR_KW)
    assert passes == [False, True][:readings]
    loaded = compare_pair(table("p", a, ids), table("d", b, ids), seed=0, kv_aligned=0, **PAIR_KW)
    assert streamed.metrics["p99_abs_diff"] == float(np.percentile(np.abs(a - b), 99))
    assert streamed.metrics == loaded.metrics
