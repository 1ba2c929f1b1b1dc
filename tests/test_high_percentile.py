"""high_percentile: np.percentile's own value, read off the top of the array."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest

import analysis.high_percentile as hp
from analysis.high_percentile import TopValues, high_percentile

SIZES = (1 << 16, (1 << 16) + 1, 100_003, 1 << 20)


def misleading(n: int) -> np.ndarray:
    """Under 1% large values, all where the sample looks: a quarter of the sample is large."""
    values = np.zeros(n, np.float32)
    values[:: 4 * (n // (1 << 15))] = 5.0
    return values


def arrays(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    sampled_only = misleading(n)
    few = np.zeros(n, np.float32)
    few[rng.integers(0, n, 50)] = 1.0
    return {
        "|Δ|-like": np.abs(rng.normal(0, 1e-4, n)).astype(np.float32),
        "ties": np.round(np.abs(rng.normal(0, 3, n))).astype(np.float32),
        "mostly zero": few,
        "sorted": np.sort(np.abs(rng.normal(0, 1, n))).astype(np.float32),
        "sorted down": np.sort(np.abs(rng.normal(0, 1, n)))[::-1].astype(np.float32),
        "sampled only": sampled_only,
        "heavy tail, float64": np.abs(rng.standard_cauchy(n)),
        "signed, subnormal": (rng.normal(0, 1, n) * 1e-40).astype(np.float32),
    }


@pytest.mark.parametrize("n", SIZES)
def test_it_is_numpys_percentile_bit_for_bit(n: int) -> None:
    rng = np.random.default_rng(n)
    for name, values in arrays(rng, n).items():
        for q in (90, 95, 99, 100):
            want = float(np.percentile(values.copy(), q))
            assert high_percentile(values.copy(), q) == want, (name, n, q)


class _NoFullPercentile(ModuleType):
    """numpy, but np.percentile is refused: the top was not enough."""

    def __getattr__(self, name: str) -> Any:
        if name == "percentile":
            raise AssertionError("partitioned the whole array")
        return getattr(np, name)


def test_only_the_top_is_read_when_the_sample_is_fair(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(7)
    values = np.abs(rng.normal(0, 1e-4, 1 << 20)).astype(np.float32)
    want = float(np.percentile(values.copy(), 99))
    monkeypatch.setattr(hp, "np", _NoFullPercentile("numpy"))
    assert high_percentile(values, 99) == want


def test_a_sample_that_misleads_falls_back_to_the_whole_array(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    values = misleading(1 << 20)
    want = float(np.percentile(values.copy(), 99))
    monkeypatch.setattr(hp, "np", _NoFullPercentile("numpy"))
    with pytest.raises(AssertionError, match="partitioned the whole array"):
        high_percentile(values, 99)
    monkeypatch.undo()
    assert high_percentile(values, 99) == want == 0.0


def test_the_lerp_rounds_as_numpys_on_either_side_of_one_half() -> None:
    # The k-th and (k+1)-th smallest set by hand, far apart in magnitude, so that numpy's two
    # lerp forms (a + d t below t = 1/2, b - d (1 - t) from it) round differently.
    rng = np.random.default_rng(3)
    for n in (65_536, 65_551, 70_001, 99_999):
        k = int(np.floor((n - 1) * 0.99))
        for _ in range(40):
            lo, hi = np.sort(rng.uniform(0, 1, 2) * 10.0 ** rng.integers(-6, 3, 2)).astype(
                np.float32
            )
            values = np.zeros(n, np.float32)
            values[k] = lo
            values[k + 1 :] = hi
            rng.shuffle(values)
            assert high_percentile(values.copy(), 99) == float(np.percentile(values, 99)), (
                n,
                lo,
                hi,
            )


def stream(kind: str, rows: int = 40, v: int = 4096) -> list[np.ndarray]:
    rng = np.random.default_rng(len(kind))
    scale = {
        "stationary": np.ones(rows),
        "growing": np.linspace(1, 8, rows),
        "shrinking a little": np.linspace(1, 0.8, rows),
        "shrinking": np.linspace(8, 0.01, rows),
    }
    if kind in scale:
        return [np.abs(rng.normal(0, s * 1e-4, v)).astype(np.float32) for s in scale[kind]]
    zero = np.zeros(v, np.float32)
    noisy = [np.abs(rng.normal(0, 1e-4, v)).astype(np.float32) for _ in range(rows)]
    if kind == "identical":
        return [zero.copy() for _ in range(rows)]
    if kind == "zero, then noise":
        return [zero.copy() for _ in range(8)] + noisy
    if kind == "noise, then zero":
        return noisy[:8] + [zero.copy() for _ in range(rows)]
    if kind == "ties":
        return [np.round(r * 2e4).astype(np.float32) for r in noisy]
    raise AssertionError(kind)


KINDS = ["stationary", "growing", "shrinking a little", "shrinking", "identical",
         "zero, then noise", "noise, then zero", "ties"]  # fmt: skip
# Those whose p99 lies under the threshold the first rows set: only a pass that keeps every
# value can tell it (None), never a wrong value.
UNDER = {"shrinking", "noise, then zero"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("q", [99, 95, 100])
def test_top_values_is_numpys_percentile_or_says_it_cannot(kind: str, q: int) -> None:
    rows = stream(kind)
    tops = TopValues(q, first=4 * 4096)
    scratch = np.empty(4096, np.float32)
    for row in rows:
        scratch[:] = row
        tops.add(scratch)  # the caller reuses its row: what is kept is copied
        scratch[:] = -1.0
    want = float(np.percentile(np.concatenate(rows), q))
    got = tops.percentile()
    if kind in UNDER and q == 99:
        assert got is None
    elif kind in UNDER and q != 100:
        assert got in (None, want), (kind, q)
    else:
        assert got == want, (kind, q)
    kept = sum(part.shape[0] for part in tops.parts)
    if kind in ("stationary", "shrinking a little") and q == 99:
        assert kept < 0.1 * tops.n  # the top, not the stream
    assert tops.below + kept == tops.n


def test_top_values_of_a_short_stream_keeps_everything() -> None:
    rows = stream("stationary", rows=3)
    tops = TopValues(99, first=4 * 4096)
    for row in rows:
        tops.add(row)
    assert tops.threshold is None and tops.below == 0
    assert tops.percentile() == float(np.percentile(np.concatenate(rows), 99))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
@pytest.mark.parametrize(
    "values",
    [
        np.array([1.0, 2.0, np.inf, 3.0], np.float32),  # numpy lerps inf with itself: NaN
        np.full(8, -0.0, np.float32),  # ... and -0.0 with itself: 0.0
        np.array([5.0, 1.0, 4.0, 4.0], np.float64),
    ],
    ids=["inf", "negative zeros", "float64"],
)
def test_the_hundredth_percentile_is_numpys_lerp_of_the_largest_value(values: np.ndarray) -> None:
    want = np.percentile(values, 100)
    got = hp.percentile_from_top(values.copy(), 0, len(values), 100)
    assert got is not None and np.array_equal([got], [want], equal_nan=True)
    assert str(got) == str(want)  # the sign of a zero too
    stream = TopValues(100, first=2)
    for row in np.array_split(values, 3):
        stream.add(row)
    got = stream.percentile()
    assert got is not None and str(got) == str(float(want))


@pytest.mark.parametrize("q", [np.float64(99), np.float32(99.5), np.int64(97), 99.9, 99])
def test_a_numpy_q_is_weighed_as_numpy_weighs_it(q: Any) -> None:
    rng = np.random.default_rng(7)
    values = np.abs(rng.normal(0, 1e-4, 1 << 17)).astype(np.float32)
    want = float(np.percentile(values, q))
    assert high_percentile(values.copy(), q) == want
    stream = TopValues(q, first=1 << 12)
    for row in np.array_split(values, 64):
        stream.add(row)
    assert stream.percentile() in (want, None)
    low = hp.percentile_from_top(values.copy(), 0, len(values), q)
    assert low == want


def test_top_values_of_rows_of_two_dtypes_is_their_joint_percentile() -> None:
    """Float64 rows under the threshold and float32 ones over it: numpy's percentile of them all
    is taken in float64, and so is the stream's."""
    rng = np.random.default_rng(3)
    rows = [
        rng.uniform(0, 1, 64).astype(np.float32),
        rng.uniform(0, 0.01, 64),  # float64, all under the threshold set by the first row
        rng.uniform(0.5, 1, 64).astype(np.float32),
    ]
    for q in (90, 95, 99):
        stream = TopValues(q, first=64)
        for row in rows:
            stream.add(row)
        want = float(np.percentile(np.concatenate(rows), q))
        assert stream.percentile() == want
