"""Sum and min trees over per-lane leaves with a wide fan-out, vectorised over batches: pure NumPy.

Each lane's tree is one row of a ``[lanes, width]`` float64 array: the leaves first (leaf j is
column j), then each level of parents up to the root (the last column). A node is the sum (min
tree: the smallest positive leaf, +inf for none) of its ``FANOUT`` children, a contiguous block
of the level below: 5 levels for 100k leaves, 6 for 10M, so an update or a descent is a handful
of NumPy calls per level for the whole batch. Parents are always recomputed from their children
(never adjusted by deltas), so sums cannot drift.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

FANOUT = 16  # children per node (a power of two: see block_sums)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@lru_cache(maxsize=None)
def _levels_for_leaves(leaves: int) -> tuple[tuple[int, int], ...]:
    """(offset, size) of each level, leaves first, the root (size 1) last."""
    sizes = [leaves]
    while sizes[-1] > FANOUT:
        sizes.append(_round_up(sizes[-1] // FANOUT, FANOUT))
    sizes.append(1)  # the root, over the top level's <= FANOUT nodes
    offsets = np.concatenate([[0], np.cumsum(sizes[:-1])]).tolist()
    return tuple(zip(offsets, sizes))


def _leaf_count(capacity: int) -> int:
    return _round_up(max(1, int(capacity)), FANOUT)


def tree_width(capacity: int) -> int:
    """Columns of one lane's tree over ``capacity`` leaves (leaves, parents and the root)."""
    offset, _ = _levels_for_leaves(_leaf_count(capacity))[-1]
    return offset + 1


@lru_cache(maxsize=None)
def levels(width: int) -> tuple[tuple[int, int], ...]:
    """The levels of the tree whose rows are ``width`` columns wide (see ``tree_width``)."""
    lo, hi = 1, max(1, width // FANOUT + 1)  # width grows with the leaf blocks: bisect them
    while lo < hi:
        mid = (lo + hi) // 2
        if tree_width(mid * FANOUT) < width:
            lo = mid + 1
        else:
            hi = mid
    found = _levels_for_leaves(lo * FANOUT)
    if found[-1][0] + 1 != width:
        raise ValueError(f"no sum tree is {width} columns wide")
    return found


def roots(tree: np.ndarray) -> np.ndarray:
    """Each lane's root: its total (sum tree) or its smallest positive leaf (min tree)."""
    return tree[:, -1]


def _blocks(tree: np.ndarray, offset: int, size: int) -> np.ndarray:
    """The level at ``offset`` as a ``[lanes, size // FANOUT, FANOUT]`` view of ``tree``."""
    if size == 1:  # the root's children are the top level (one block): never asked for
        raise ValueError("the root has no block")
    # Splitting the last axis of a row slice is always expressible in strides: a view.
    return tree[:, offset:offset + size].reshape(tree.shape[0], size // FANOUT, FANOUT)


def block_sums(blocks: np.ndarray) -> np.ndarray:
    """Sums over the last axis (FANOUT, a power of two) in one fixed order, halving: NumPy's
    ``sum`` may add in another order for another shape, and a parent must come out bit-equal
    however many blocks are recomputed together."""
    while blocks.shape[-1] > 1:
        half = blocks.shape[-1] // 2
        blocks = blocks[..., :half] + blocks[..., half:]
    return blocks[..., 0]


def _positive_or_inf(values: np.ndarray) -> np.ndarray:
    return np.where(values > 0, values, np.inf)


def update(sums: np.ndarray, mins: np.ndarray, lanes: np.ndarray, leaves: np.ndarray,
           values: np.ndarray) -> None:
    """Set ``values`` (>= 0) at ``leaves`` of ``lanes`` and recompute every ancestor from its
    children. Where a (lane, leaf) repeats, the last value wins."""
    if leaves.size == 0:
        return
    width = sums.shape[1]
    lanes = lanes.astype(np.int64, copy=False)
    flat = lanes * width + leaves.astype(np.int64, copy=False)
    values = np.asarray(values, np.float64)
    sums.reshape(-1)[flat] = values
    mins.reshape(-1)[flat] = _positive_or_inf(values)
    key = np.unique(flat)  # sorted: parents of sorted nodes stay sorted, dups adjacent
    lane, node = key // width, key % width
    _fix_parents(sums, mins, lane, node)


def _fix_parents(sums: np.ndarray, mins: np.ndarray, lane: np.ndarray, node: np.ndarray) -> None:
    """Recompute the ancestors of the sorted, unique (lane, level-0 node) pairs."""
    tree_levels = levels(sums.shape[1])
    flat_sums, flat_mins = sums.reshape(-1), mins.reshape(-1)
    width = sums.shape[1]
    for (offset, size), (parent_offset, _) in zip(tree_levels[:-1], tree_levels[1:]):
        node = node // FANOUT
        keep = np.empty(node.size, bool)
        keep[0] = True
        np.not_equal(node[1:], node[:-1], out=keep[1:])
        keep[1:] |= lane[1:] != lane[:-1]
        node, lane = node[keep], lane[keep]
        target = lane * width + parent_offset + node
        flat_sums[target] = block_sums(_blocks(sums, offset, size)[lane, node])
        flat_mins[target] = _blocks(mins, offset, size)[lane, node].min(axis=1)


def fill(sums: np.ndarray, mins: np.ndarray, lane: int, start: int, values: np.ndarray) -> None:
    """Set leaves ``[start, start + len(values))`` of ``lane`` and recompute their ancestors:
    slices only, so entering a contiguous run of new rows costs a memset, not a per-row walk."""
    stop = start + values.size
    if stop <= start:
        return
    sums[lane, start:stop] = values
    mins[lane, start:stop] = _positive_or_inf(values)
    tree_levels = levels(sums.shape[1])
    for (offset, size), (parent_offset, _) in zip(tree_levels[:-1], tree_levels[1:]):
        start, stop = start // FANOUT, (stop - 1) // FANOUT + 1
        sums[lane, parent_offset + start:parent_offset + stop] = (
            block_sums(_blocks(sums, offset, size)[lane, start:stop]))
        mins[lane, parent_offset + start:parent_offset + stop] = (
            _blocks(mins, offset, size)[lane, start:stop].min(axis=1))


def rebuild(sums: np.ndarray, mins: np.ndarray) -> None:
    """Recompute every parent (and the min tree's leaves) from the sum tree's leaves."""
    tree_levels = levels(sums.shape[1])
    leaves = tree_levels[0][1]
    mins[:, :leaves] = _positive_or_inf(sums[:, :leaves])
    for (offset, size), (parent_offset, parent_size) in zip(tree_levels[:-1], tree_levels[1:]):
        n = size // FANOUT
        sums[:, parent_offset:parent_offset + n] = block_sums(_blocks(sums, offset, size))
        mins[:, parent_offset:parent_offset + n] = _blocks(mins, offset, size).min(axis=2)
        if parent_size > n:  # padding nodes of a level: no leaves below them
            sums[:, parent_offset + n:parent_offset + parent_size] = 0.0
            mins[:, parent_offset + n:parent_offset + parent_size] = np.inf


def descend(sums: np.ndarray, lanes: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Leaves whose prefix-sum interval holds ``u`` (each in ``[0, root sum of its lane)``).

    Proportional sampling: with u uniform, leaf j is found with probability value_j / total.
    Per level, each draw takes its node's block of children and the first child whose
    cumulative sum exceeds what is left of u. The running sum rounds at the scale of the blocks
    before it (a few ulps of the batch's block sums): a draw carried onto a zero leaf that way is
    redrawn by ``PriorityTable.draw``.
    """
    tree_levels = levels(sums.shape[1])
    lanes = lanes.astype(np.int64, copy=False)
    u = u.astype(np.float64, copy=True)
    node = np.zeros(u.shape, np.int64)
    starts = np.arange(u.size, dtype=np.int64) * FANOUT
    running = np.zeros(u.size * FANOUT + 1)  # [0, running sums of every draw's block]
    # The largest node each level may pass down: a block of the level below, or a leaf.
    last = [tree_levels[0][1] - 1] + [size // FANOUT - 1 for _, size in tree_levels[:-2]]
    for (offset, size), limit in zip(reversed(tree_levels[:-1]), reversed(last)):
        # One flat running sum over every draw's block of children (``np.cumsum(axis=1)``
        # pays a call per row); a draw's prefix sums are its stretch minus what came before.
        np.cumsum(_blocks(sums, offset, size)[lanes, node], out=running[1:])
        before = running[starts]
        child = np.searchsorted(running[1:], u + before, side="right") - starts
        np.minimum(np.maximum(child, 0, out=child), FANOUT - 1, out=child)
        u -= running[starts + child] - before
        # A reader racing the learner's update (a parent ahead of its children) can be carried
        # onto a padding node: stay inside the tree, on a zero leaf that the caller redraws.
        node = np.minimum(node * FANOUT + child, limit)
    return node


def sample(sums: np.ndarray, batch: int, rng: np.random.Generator
           ) -> tuple[np.ndarray, np.ndarray, float]:
    """(lanes, leaves, total): ``batch`` leaves drawn in proportion to their values, across
    lanes in proportion to each lane's total. Raises ValueError if every leaf is zero."""
    lane_totals = roots(sums).copy()
    ends = np.cumsum(lane_totals)
    total = float(ends[-1])
    if not total > 0:
        raise ValueError("every priority is zero")
    u = rng.random(batch) * total
    lanes = np.minimum(np.searchsorted(ends, u, side="right"), len(lane_totals) - 1)
    local = u - (ends[lanes] - lane_totals[lanes])
    local = np.minimum(local, np.nextafter(lane_totals[lanes], 0))
    return lanes, descend(sums, lanes, local), total
