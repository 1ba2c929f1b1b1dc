"""numpy's linear percentile of a large float array near its top, read off the values above a
sampled threshold instead of a partition of them all (the pair's p99 |Δ|)."""

from __future__ import annotations

import numpy as np

# Below this many values, or for a percentile this low, np.percentile itself is as quick.
_MIN_VALUES = 1 << 16
_MIN_Q = 90
_SAMPLE = 1 << 15


def high_percentile(values: np.ndarray, q: int) -> float:
    """np.percentile(values, q), bit for bit, of a 1-D float array without NaN; it may reorder
    `values` (as overwrite_input=True does).

    numpy's linear method is a lerp of the k-th and (k+1)-th smallest values, k from (n-1) q.
    Both lie among the values at or above any threshold that at least n - k values reach; a
    strided sample's (2q - 100)-th percentile is such a threshold for any array that is not
    ordered against the stride, and when it is not, the whole array is partitioned as before.
    """
    n = values.shape[0]
    if n < _MIN_VALUES or q < _MIN_Q:
        return float(np.percentile(values, q, overwrite_input=True))
    quantile = np.true_divide(q, 100)  # numpy's own steps, in its order, from here on
    virtual = (n - 1) * quantile
    previous = np.floor(virtual)
    if virtual >= n - 1:
        return float(values.max())
    k = int(previous)
    sample = np.array(values[:: n // _SAMPLE])
    rank = int(sample.shape[0] * (2 * quantile - 1))
    threshold = np.partition(sample, rank)[rank]
    keep = values >= threshold
    below = n - int(np.count_nonzero(keep))
    if below > k:
        return float(np.percentile(values, q, overwrite_input=True))
    top = values[keep]
    i = k - below
    top.partition((i, i + 1))
    a, b = top[i : i + 1], top[i + 1 : i + 2]
    t = float(virtual - previous)  # a Python float: numpy's weak promotion keeps a's dtype
    d = b - a
    lerp = np.add(a, d * t)
    np.subtract(b, d * (1 - t), out=lerp, where=t >= 0.5, casting="unsafe", dtype=lerp.dtype)
    return float(lerp[0])
