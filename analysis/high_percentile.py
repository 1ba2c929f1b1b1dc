"""numpy's linear percentile of many float values near their top, read off the values at or
above a threshold instead of a partition of them all: of one array (high_percentile), or of a
stream of rows that keeps only its top (TopValues: the pair's p99 |Δ| in O(V) memory)."""

from __future__ import annotations

from typing import Any

import numpy as np

# Below this many values, or for a percentile this low, np.percentile itself is as quick.
_MIN_VALUES = 1 << 16
_MIN_Q = 90
_SAMPLE = 1 << 15


def percentile_from_top(top: np.ndarray, below: int, n: int, q: float) -> float | None:
    """np.percentile(values, q) of n values, bit for bit, from `top`, the values at or above a
    threshold (1-D, any order; reordered here), the other `below` values all being under it;
    None when the percentile lies among those (they are needed then).

    numpy's linear method is a lerp of the k-th and (k+1)-th smallest values, k from (n-1) q
    (the largest value with itself from k = n - 1 on): both are in `top` when no more than k
    values are below it. Its steps are taken here in its order, with its types: a q of
    Python's int or float weighs in as a Python float (the values' dtype is kept), any other
    q as the numpy value it is. (A tie of 0.0 and -0.0 may give either sign, as numpy's own
    partition order decides; |Δ| holds no -0.0.)
    """
    quantile = np.true_divide(q, 100)
    virtual = np.asanyarray((n - 1) * quantile)
    if virtual >= n - 1:
        if not top.size:
            return None
        k = -1  # numpy's index of the largest value, which it then lerps with itself
        a = b = top[top.argmax() : top.argmax() + 1]
    else:
        k = int(np.floor(virtual))
        i = k - below
        if i < 0:
            return None
        top.partition((i, i + 1))
        a, b = top[i : i + 1], top[i + 1 : i + 2]
    gamma = np.asanyarray(virtual - np.intp(k), dtype=virtual.dtype)
    t = float(gamma) if type(q) in (int, float) else gamma
    d = b - a
    lerp = np.add(a, d * t)
    np.subtract(b, d * (1 - t), out=lerp, where=t >= 0.5, casting="unsafe", dtype=lerp.dtype)
    return float(lerp[0])


def high_percentile(values: np.ndarray, q: float) -> float:
    """np.percentile(values, q), bit for bit, of a 1-D float array without NaN; it may reorder
    `values` (as overwrite_input=True does).

    A strided sample's (2q - 100)-th percentile is a threshold with the percentile above it
    for any array that is not ordered against the stride; when it is not, the whole array is
    partitioned as before.
    """
    n = values.shape[0]
    if n < _MIN_VALUES or q < _MIN_Q:
        return float(np.percentile(values, q, overwrite_input=True))
    sample = np.array(values[:: n // _SAMPLE])
    rank = min(int(sample.shape[0] * (2 * np.true_divide(q, 100) - 1)), sample.shape[0] - 1)
    keep = values >= np.partition(sample, rank)[rank]
    top = values[keep]
    found = percentile_from_top(top, n - top.shape[0], n, q)
    if found is None:
        return float(np.percentile(values, q, overwrite_input=True))
    return found


class TopValues:
    """The rows of a stream of values (float, without NaN), kept as far as their q-th
    percentile needs: the first `first` values whole, then, from a threshold set by them (their
    (5q - 400)-th percentile: the 95th for q = 99), only the values at or above it, with a
    count of the others. percentile() is np.percentile's value over everything added, or None
    when the stream turned out to hold its percentile under the threshold (values that shrink
    after the first ones): then only a pass that keeps every value can tell it."""

    def __init__(self, q: float, first: int = 1 << 20) -> None:
        self.q = q
        self.first = first
        self.parts: list[np.ndarray] = []
        self.n = 0
        self.below = 0
        self.threshold: np.generic | None = None
        self.dtype: np.dtype[Any] | None = None  # of all the rows together, as concatenated

    def add(self, values: np.ndarray) -> None:
        """Take a 1-D row (copied where kept: the caller may reuse it)."""
        self.n += values.shape[0]
        # rows of another dtype than the kept ones: numpy's percentile of them all is taken in
        # the dtype they make together
        self.dtype = values.dtype if self.dtype is None else np.result_type(self.dtype, values)
        if self.threshold is None:
            self.parts.append(values.copy())
            if self.n >= self.first:
                self._set_threshold()
            return
        kept = values[values >= self.threshold]
        self.below += values.shape[0] - kept.shape[0]
        if kept.shape[0]:
            self.parts.append(kept)

    def _set_threshold(self) -> None:
        seen = np.concatenate(self.parts)
        rank = min(int(seen.shape[0] * max(0.0, 1 - 5 * (1 - self.q / 100))), seen.shape[0] - 1)
        self.threshold = np.partition(seen, rank)[rank]
        kept = seen[seen >= self.threshold]
        self.parts = [kept]
        self.below = seen.shape[0] - kept.shape[0]

    def percentile(self) -> float | None:
        if self.n == 0:
            raise ValueError("no values")
        top = np.concatenate(self.parts).astype(self.dtype, copy=False)
        if self.threshold is None:  # every value is here
            return high_percentile(top, self.q)
        return percentile_from_top(top, self.below, self.n, self.q)
