"""n-step returns: ``R = sum_{j<m} gamma^j r_{t+j}``, bootstrapped with ``gamma^m`` from the
observation after step ``t+m-1``, or not at all if the episode terminated there.

m is at most n; it stops at the episode's end (termination or truncation), at the newest
written step, and where the next observation of the last step is not known yet.
"""

from __future__ import annotations

import numpy as np


def nstep_extent(valid: np.ndarray, terminated: np.ndarray, next_known: np.ndarray) -> np.ndarray:
    """m per row (0: the anchor yields no transition).

    ``valid[b, j]``: row t+j is a readable transition of the anchor's episode; ``terminated[b,
    j]`` its terminated flag; ``next_known[b, j]``: the observation after row t+j is readable.
    """
    rows, n = valid.shape
    counts = valid.copy()
    counts[:, 1:] &= ~terminated[:, :-1].astype(bool)  # nothing after a terminal step counts
    counts = np.logical_and.accumulate(counts, axis=1)
    m = counts.sum(axis=1)
    last = np.clip(m - 1, 0, n - 1)
    unknown = (m > 0) & ~next_known[np.arange(rows), last]
    return m - unknown.astype(m.dtype)


def nstep_return(rewards: np.ndarray, m: np.ndarray, gamma: float) -> np.ndarray:
    """Discounted sum of the first m rewards of each row, in float64."""
    n = rewards.shape[1]
    weights = gamma ** np.arange(n, dtype=np.float64)
    keep = np.arange(n)[None, :] < m[:, None]
    return (rewards.astype(np.float64) * weights * keep).sum(axis=1)


def nstep_discount(terminated_last: np.ndarray, m: np.ndarray, gamma: float) -> np.ndarray:
    """gamma^m where the last step did not terminate the episode, else 0."""
    return np.where(terminated_last.astype(bool), 0.0, float(gamma) ** m.astype(np.float64))
