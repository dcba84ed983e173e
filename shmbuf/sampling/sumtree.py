"""Sum and min trees over per-lane leaves with a wide fan-out, vectorised over batches: pure NumPy.

Each lane's tree is one row of a ``[lanes, width]`` float64 array: the leaves first (leaf j is
column j), then each level of parents up to the root (the last column). A node is the sum (min
tree: the smallest positive leaf, +inf for none) of its ``FANOUT`` children, a contiguous block
of the level below: 5 levels for 100k leaves, 6 for 10M. Parents are always recomputed from
their children (never adjusted by deltas), so sums cannot drift.

NumPy's cost is per call, so each step is a handful of calls for the whole batch: ``sample``
finds each draw's node at a small level (<= ``TOP_NODES`` over all lanes) with one cumulative
sum and one ``searchsorted`` (over the draws sorted: a search over random keys mispredicts
most of its branches), then descends the 2-3 levels below by blocks, with one matrix product
giving the prefix sums of every draw's block at once (``np.cumsum`` is a scalar loop);
``update`` recomputes the touched parents level by level as ``[FANOUT, n]`` gathers, and the
small top levels whole from cached index plans.

The walks (``sample``, ``update``, ``fill``, ``fix_top``) are also compiled (``_sumtree_c``,
an optional extension that ``setup.py`` builds where a C compiler is at hand): level by level
over the batch, each pass fetching the block it needs a few draws ahead so that cache misses
overlap, several times faster per batch than the NumPy calls. The trees they leave are bit-identical (the same
halving sums; a min is exact), and a draw finds the same leaf unless it lies within a few ulps
of a boundary between two leaves (the compiled descent halves a block's children instead of
taking its prefix sums). ``SHMBUF_SUMTREE=numpy`` in the environment (read at import, so by
sampler workers too) or ``use_compiled(False)`` runs the NumPy code.
"""

from __future__ import annotations

import os
from functools import lru_cache
from types import ModuleType
from typing import NamedTuple

import numpy as np

_built: ModuleType | None
try:
    from shmbuf.sampling import _sumtree_c as _built
except ImportError:  # no compiler when it was installed: the NumPy code below
    _built = None
_compiled: ModuleType | None = None if os.environ.get("SHMBUF_SUMTREE") == "numpy" else _built

FANOUT = 16  # children per node (a power of two: see block_sums)
TOP_NODES = 4096  # sample() draws from the lowest level this small with one cumulative sum
WHOLE_LEVEL = 4096  # update() recomputes the levels above one this small whole
# Row k: the sum of the children before child k (a block's exclusive prefix sums, and its
# total last) as one matrix product.
_PREFIX = np.tril(np.ones((FANOUT + 1, FANOUT)), -1)
_CHILD = np.arange(FANOUT, dtype=np.int64)[:, None]  # a block's children, as a column
_FANOUT_BITS = FANOUT.bit_length() - 1


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


def compiled() -> bool:
    """Whether the walks run compiled (``_sumtree_c``)."""
    return _compiled is not None


def use_compiled(flag: bool) -> bool:
    """Run the walks compiled (if built) or with NumPy; returns the previous
    setting. For this process only: workers follow ``SHMBUF_SUMTREE``."""
    global _compiled
    before = _compiled is not None
    _compiled = _built if flag else None
    return before


@lru_cache(maxsize=64)
def _geometry(width: int) -> np.ndarray:
    """Per level (leaves first, the root last): its offset, and the largest node a descent may
    pass down into it (``_last_nodes``; 0 for the root). What ``_sumtree_c`` walks."""
    tree_levels = levels(width)
    last = _last_nodes(tree_levels) + [0]
    geometry = np.array([[offset, end] for (offset, _), end in zip(tree_levels, last)], np.int64)
    geometry.flags.writeable = False
    return geometry


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
    leaves = leaves.astype(np.int64, copy=False)
    values = np.asarray(values, np.float64)
    if _compiled is not None and sums.flags.c_contiguous and mins.flags.c_contiguous:
        _compiled.update(sums, mins, width, _geometry(width), None if sums.shape[0] == 1 else
                         np.ascontiguousarray(lanes, np.int64), np.ascontiguousarray(leaves),
                         np.ascontiguousarray(values))
        return
    flat_sums, flat_mins = sums.reshape(-1), mins.reshape(-1)
    if sums.shape[0] == 1:  # one lane: the leaves are the flat positions
        base = flat = leaves  # (base is not read for one lane)
    else:
        base = lanes.astype(np.int64, copy=False) * width  # each draw's lane row, flat
        flat = base + leaves
    flat_sums[flat] = values
    flat_mins[flat] = _positive_or_inf(values)
    _fix_parents(flat_sums, flat_mins, width, base, leaves)


def _fix_parents(flat_sums: np.ndarray, flat_mins: np.ndarray, width: int, base: np.ndarray,
                 node: np.ndarray) -> None:
    """Recompute the ancestors of level-0 nodes ``node`` of the lane rows at flat ``base``.

    Per level, each touched parent's block of children is gathered (``_windows``) and
    transposed into a ``[FANOUT, n]`` array, a block per column, so that the halving sums and
    the min run over whole rows. Duplicates are kept: a
    parent touched twice is written twice with the same value, which is cheaper than finding
    the distinct ones. Once a level is small (``WHOLE_LEVEL`` nodes over all lanes), the levels
    above it are recomputed whole.
    """
    tree_levels = levels(width)
    lanes = flat_sums.size // width
    sum_windows, min_windows = _windows(flat_sums), _windows(flat_mins)
    for level, ((offset, size), (parent_offset, _)) in enumerate(
            zip(tree_levels[:-1], tree_levels[1:])):
        if size * lanes <= WHOLE_LEVEL:
            _fix_whole_levels(flat_sums.reshape(lanes, width), flat_mins.reshape(lanes, width),
                              level)
            return
        node = node >> _FANOUT_BITS
        first = node << _FANOUT_BITS  # each parent's first child, flat
        first += offset
        target = node + parent_offset
        if lanes > 1:
            first += base
            target += base
        # Transposed copies ([FANOUT, n], a block per column): the halving sums and the min
        # then run over whole rows, several times faster than along short rows.
        children = np.ascontiguousarray(sum_windows[first].T)
        flat_sums[target] = block_sums(children.T)
        if level == 0:  # the min tree's leaves are the sum tree's positive ones
            flat_mins[target] = _positive_or_inf(children).min(axis=0)
        else:
            flat_mins[target] = np.ascontiguousarray(min_windows[first].T).min(axis=0)


@lru_cache(maxsize=64)
def _whole_levels(width: int, lanes: int, first: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per level above level ``first``, bottom up: the flat positions of every real parent's
    children as a ``[FANOUT, parents]`` array (a block per column), and of the parents."""
    tree_levels = levels(width)
    plan = []
    for (offset, size), (parent_offset, _) in list(
            zip(tree_levels[:-1], tree_levels[1:]))[first:]:
        n = size // FANOUT
        lane_base = np.repeat(np.arange(lanes, dtype=np.int64) * width, n)
        node = np.tile(np.arange(n, dtype=np.int64), lanes)
        children = (lane_base + offset + node * FANOUT)[None, :] + _CHILD
        parents = lane_base + parent_offset + node
        children.flags.writeable = parents.flags.writeable = False
        plan.append((children, parents))
    return plan


def _windows(flat: np.ndarray) -> np.ndarray:
    """Row i of the result is ``flat[i:i + FANOUT]`` (a view): fancy-indexing it with a
    block's first position gathers the block."""
    return np.ndarray((flat.size - FANOUT + 1, FANOUT), flat.dtype, flat, 0,
                      (flat.itemsize, flat.itemsize))


def fill(sums: np.ndarray, mins: np.ndarray, lane: int, start: int, values: np.ndarray,
         top: bool = True) -> None:
    """Set leaves ``[start, start + len(values))`` of ``lane`` and recompute their ancestors:
    slices only, so entering a contiguous run of new rows costs a memset, not a per-row walk.
    With ``top=False`` the small top levels (``WHOLE_LEVEL``) are left to one ``fix_top``
    call after several runs."""
    stop = start + values.size
    if stop <= start:
        return
    if _compiled is not None and sums.flags.c_contiguous and mins.flags.c_contiguous:
        # (up to the root whatever ``top`` says: the run's ancestors there are a few nodes)
        _compiled.fill(sums, mins, sums.shape[1], _geometry(sums.shape[1]), lane, start,
                       np.ascontiguousarray(values, np.float64))
        return
    sums[lane, start:stop] = values
    mins[lane, start:stop] = _positive_or_inf(values)
    tree_levels = levels(sums.shape[1])
    for level, ((offset, size), (parent_offset, _)) in enumerate(
            zip(tree_levels[:-1], tree_levels[1:])):
        if size * sums.shape[0] <= WHOLE_LEVEL:
            if top:
                _fix_whole_levels(sums, mins, level)
            return
        start, stop = start // FANOUT, (stop - 1) // FANOUT + 1
        # Column-major copies: the halving sums and the min then run along the blocks (a
        # block's children are only FANOUT apart), several times faster for long runs.
        sums[lane, parent_offset + start:parent_offset + stop] = block_sums(
            np.asfortranarray(_blocks(sums, offset, size)[lane, start:stop]))
        mins[lane, parent_offset + start:parent_offset + stop] = np.asfortranarray(
            _blocks(mins, offset, size)[lane, start:stop]).min(axis=1)


def fix_top(sums: np.ndarray, mins: np.ndarray) -> None:
    """Recompute the small top levels of every lane (after ``fill(..., top=False)`` runs)."""
    level = _first_small_level(sums.shape[1], sums.shape[0])
    if level is None:
        return
    if _compiled is not None and sums.flags.c_contiguous and mins.flags.c_contiguous:
        _compiled.rebuild_above(sums, mins, sums.shape[1], _geometry(sums.shape[1]), level)
    else:
        _fix_whole_levels(sums, mins, level)


@lru_cache(maxsize=64)
def _first_small_level(width: int, lanes: int) -> int | None:
    """The lowest level of at most ``WHOLE_LEVEL`` nodes over all lanes (None: none is)."""
    for level, (_, size) in enumerate(levels(width)[:-1]):
        if size * lanes <= WHOLE_LEVEL:
            return level
    return None


def _fix_whole_levels(sums: np.ndarray, mins: np.ndarray, first: int) -> None:
    """Every parent above level ``first`` (a small one), from cached index plans."""
    flat_sums, flat_mins = sums.reshape(-1), mins.reshape(-1)
    for children, target in _whole_levels(sums.shape[1], sums.shape[0], first):
        flat_sums[target] = block_sums(flat_sums.take(children).T)
        flat_mins[target] = flat_mins.take(children).min(axis=0)


def rebuild(sums: np.ndarray, mins: np.ndarray) -> None:
    """Recompute every parent (and the min tree's leaves) from the sum tree's leaves."""
    leaves = levels(sums.shape[1])[0][1]
    mins[:, :leaves] = _positive_or_inf(sums[:, :leaves])
    _rebuild_from(sums, mins, 0, padding=True)


def _rebuild_from(sums: np.ndarray, mins: np.ndarray, first: int, padding: bool) -> None:
    """Recompute every parent above level ``first`` from its children, with slices (and the
    padding nodes, which stay 0 and inf once set, if ``padding``)."""
    tree_levels = levels(sums.shape[1])
    for (offset, size), (parent_offset, parent_size) in list(
            zip(tree_levels[:-1], tree_levels[1:]))[first:]:
        n = size // FANOUT
        sums[:, parent_offset:parent_offset + n] = block_sums(_blocks(sums, offset, size))
        mins[:, parent_offset:parent_offset + n] = _blocks(mins, offset, size).min(axis=2)
        if padding and parent_size > n:  # padding nodes of a level: no leaves below them
            sums[:, parent_offset + n:parent_offset + parent_size] = 0.0
            mins[:, parent_offset + n:parent_offset + parent_size] = np.inf


def _top_level(tree_levels: tuple[tuple[int, int], ...], lanes: int) -> int:
    """The lowest level small enough (``TOP_NODES`` nodes over all lanes) for ``sample`` to
    draw its node with one cumulative sum: the top level of the tree (a block) at most."""
    for level, (_, size) in enumerate(tree_levels[:-1]):
        if size * lanes <= TOP_NODES:
            return level
    return len(tree_levels) - 2


def _last_nodes(tree_levels: tuple[tuple[int, int], ...]) -> list[int]:
    """Per level, the largest node a descent may pass down: a block of the level below, or
    a leaf."""
    return [tree_levels[0][1] - 1] + [size // FANOUT - 1 for _, size in tree_levels[:-2]]


class _Descent(NamedTuple):
    """What ``sample`` needs of a tree's geometry, worked out once per (width, lanes)."""

    levels: tuple[tuple[int, int], ...]
    top: int  # the level the draws start from (``_top_level``)
    last: list[int]  # ``_last_nodes``


@lru_cache(maxsize=64)
def _descent(width: int, lanes: int) -> _Descent:
    tree_levels = levels(width)
    return _Descent(tree_levels, _top_level(tree_levels, lanes), _last_nodes(tree_levels))


def _descend_below(flat_sums: np.ndarray, tree_levels: tuple[tuple[int, int], ...], top: int,
                   base: np.ndarray | int, node: np.ndarray, u: np.ndarray,
                   last: list[int] | None = None) -> np.ndarray:
    """Leaves reached from nodes ``node`` of level ``top`` (of the lane rows at flat ``base``),
    ``u`` (modified) being what is left of each draw within its node.

    Per level, each draw's block of children is gathered (``_windows``); one matrix product
    gives every prefix sum of every block (row k: the children before child k), and the child
    is the number of inclusive prefix sums <= u (zero children own no interval). Prefix sums
    round differently from the halving sums of the parents (a few ulps): a draw carried past
    the last child takes it, possibly a zero leaf that ``PriorityTable.draw`` redraws.
    """
    last = _last_nodes(tree_levels) if last is None else last
    if top < len(last):  # (the root has no sibling to clamp to)
        node = np.minimum(node, last[top])
    columns = np.arange(node.size, dtype=np.int64)
    windows = _windows(flat_sums)
    for level in range(top - 1, -1, -1):
        first = node * FANOUT
        first += tree_levels[level][0] if isinstance(base, int) else base + tree_levels[level][0]
        prefix = _PREFIX @ windows[first].T  # [FANOUT + 1, n]
        child = (prefix[1:FANOUT] <= u).view(np.uint8).sum(axis=0, dtype=np.int64)
        node *= FANOUT
        node += child
        child *= node.size
        child += columns
        u -= prefix.reshape(-1)[child]
        np.minimum(node, last[level], out=node)
    return node


def descend(sums: np.ndarray, lanes: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Leaves whose prefix-sum interval holds ``u`` (each in ``[0, root sum of its lane)``).

    Proportional sampling: with u uniform, leaf j is found with probability value_j / total.
    Per level, each draw takes its node's block of children and the first child whose
    cumulative sum exceeds what is left of u (``_descend_below``, from the root).
    """
    tree_levels = levels(sums.shape[1])
    lanes = lanes.astype(np.int64, copy=False)
    u = u.astype(np.float64, copy=True)
    return _descend_below(sums.reshape(-1), tree_levels, len(tree_levels) - 1,
                          lanes * sums.shape[1], np.zeros(u.shape, np.int64), u)


def sample(sums: np.ndarray, batch: int, rng: np.random.Generator
           ) -> tuple[np.ndarray, np.ndarray, float]:
    """(lanes, leaves, total): ``batch`` leaves drawn in proportion to their values, across
    lanes in proportion to each lane's total. Raises ValueError if every leaf is zero.

    The draws start at a small level (``_top_level``) of every lane at once: one cumulative
    sum over its nodes, lane after lane, and one ``searchsorted`` find each draw's lane and
    node; ``_descend_below`` takes them to the leaves. The draws go down in the order of their
    ``u`` (searches over sorted keys mispredict fewer branches, and gathers walk memory forward)
    and are put back in the order drawn at the end: the same leaves as one draw at a time.
    """
    lanes_count, width = sums.shape
    if _compiled is not None and sums.flags.c_contiguous:
        lanes, leaves = np.empty(batch, np.int64), np.empty(batch, np.int64)
        drawn = _compiled.sample(sums, width, _geometry(width), rng.random(batch), lanes, leaves)
        total = drawn if lanes_count == 1 else float(roots(sums).sum())
        return lanes, leaves, total if total > 0 else drawn
    tree_levels, top, last = _descent(width, lanes_count)
    offset, size = tree_levels[top]
    cum = np.empty(lanes_count * size + 1)
    cum[0] = 0.0
    np.cumsum(sums[:, offset:offset + size], out=cum[1:])
    drawn = float(cum[-1])
    if not drawn > 0:
        raise ValueError("every priority is zero")
    drawn_u = rng.random(batch)
    order = drawn_u.argsort()
    u = drawn_u[order]
    u *= drawn
    if batch and u[-1] >= drawn:  # (sorted: only the last ones can round up to the total)
        np.minimum(u, np.nextafter(drawn, 0), out=u)
    position = cum.searchsorted(u, side="right")  # cum[position - 1] <= u < cum[position]
    position -= 1
    if batch and position[-1] >= lanes_count * size:
        np.minimum(position, lanes_count * size - 1, out=position)
    u -= cum[position]
    leaves = np.empty(batch, np.int64)
    lanes = np.zeros(batch, np.int64)
    if lanes_count == 1:
        leaves[order] = _descend_below(sums.reshape(-1), tree_levels, top, 0, position, u, last)
    else:
        lane = position // size
        position -= lane * size
        lanes[order] = lane
        leaves[order] = _descend_below(sums.reshape(-1), tree_levels, top, lane * width,
                                       position, u, last)
    # Probabilities are against the roots, as ``PriorityTable.total`` reports them. Read after
    # the level the draws started from, they can be zero while the learner updates the tree
    # under a worker's draw: then against that level's mass, which the draws were made from.
    total = float(roots(sums).sum())
    return lanes, leaves, total if total > 0 else drawn
