"""Sum and min trees over per-lane leaves, vectorised over batches: pure NumPy, no shared memory.

Each lane has a binary tree in a ``[2P]`` float64 array (P = capacity rounded up to a power of
two; ``width`` = 2P): node 1 is the root, node n's children are 2n and 2n+1, leaf j is node
``P + j``. The sum tree holds the sum of its subtree's leaves, the min tree the smallest
positive leaf (+inf for none). Updates set a batch of leaves and recompute their ancestors
level by level, one NumPy call per level: O(log P) calls for the whole batch, O(B log P) work.
"""

from __future__ import annotations

import numpy as np


def tree_size(capacity: int) -> int:
    """P: leaves per lane tree (capacity rounded up to a power of two)."""
    return 1 << max(0, (int(capacity) - 1).bit_length())


def depth(P: int) -> int:
    """Levels below the root of a tree with P leaves."""
    return P.bit_length() - 1


def update(sums: np.ndarray, mins: np.ndarray, lanes: np.ndarray, leaves: np.ndarray,
           values: np.ndarray) -> None:
    """Set ``values`` (>= 0) at ``leaves`` of ``lanes`` and fix every ancestor.

    Where a (lane, leaf) repeats, the last value wins.
    """
    if leaves.size == 0:
        return
    width = sums.shape[1]
    P = width // 2
    flat_sums, flat_mins = sums.reshape(-1), mins.reshape(-1)
    base = lanes.astype(np.int64) * width
    flat_leaves = base + P + leaves.astype(np.int64)
    flat_sums[flat_leaves] = values
    flat_mins[flat_leaves] = np.where(values > 0, values, np.inf)
    # Work per tree level on (lane base, node): sorted and unique once, the parents of a sorted
    # unique set are sorted with duplicates adjacent, so each level dedups in O(n), no sort.
    flat_leaves = np.unique(flat_leaves)
    node, base = flat_leaves % width, flat_leaves - flat_leaves % width
    for _ in range(depth(P)):
        node >>= 1
        keep = np.empty(node.size, bool)
        keep[0] = True
        np.not_equal(node[1:], node[:-1], out=keep[1:])
        keep[1:] |= base[1:] != base[:-1]
        node, base = node[keep], base[keep]
        parent = base + node
        left = base + 2 * node
        flat_sums[parent] = flat_sums[left] + flat_sums[left + 1]
        flat_mins[parent] = np.minimum(flat_mins[left], flat_mins[left + 1])


def descend(sums: np.ndarray, lanes: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Leaves whose prefix-sum interval holds ``u`` (each in ``[0, root sum of its lane)``).

    Proportional sampling: with u uniform, leaf j is found with probability value_j / total.
    """
    width = sums.shape[1]
    P = width // 2
    flat = sums.reshape(-1)
    base = lanes.astype(np.int64) * width
    node = np.ones(u.shape, np.int64)
    u = u.astype(np.float64, copy=True)
    for _ in range(depth(P)):
        left = flat[base + 2 * node]
        right = u >= left
        u -= np.where(right, left, 0.0)
        node = 2 * node + right
    return node - P


def sample(sums: np.ndarray, batch: int, rng: np.random.Generator
           ) -> tuple[np.ndarray, np.ndarray, float]:
    """(lanes, leaves, total): ``batch`` leaves drawn in proportion to their values, across
    lanes in proportion to each lane's total. Raises ValueError if every leaf is zero."""
    roots = sums[:, 1].copy()
    ends = np.cumsum(roots)
    total = float(ends[-1])
    if not total > 0:
        raise ValueError("every priority is zero")
    u = rng.random(batch) * total
    lanes = np.minimum(np.searchsorted(ends, u, side="right"), len(roots) - 1)
    local = u - (ends[lanes] - roots[lanes])
    local = np.minimum(local, np.nextafter(roots[lanes], 0))
    return lanes, descend(sums, lanes, local), total
