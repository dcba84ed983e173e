"""The pure sum / min trees of ``shmbuf.sampling.sumtree``, against NumPy models.

Property tests (hypothesis) with random batches of leaf updates, duplicates included: every
internal node is exactly the sum (and min over positive leaves) of its children, the root is
the sum of the leaves, a full rebuild from the leaves reproduces what ``update`` built,
``descend`` maps a prefix sum to the leaf ``np.searchsorted`` finds on the cumulative sum, and
``sample`` never returns a zero leaf while some leaf is positive. Floating point can still land a descent on a zero leaf (and a
reader that descends while the learner updates can see a leaf change under it): the last test
checks that ``PriorityTable.draw`` redraws such leaves instead of delivering them. Each test
runs with the compiled walks and with the NumPy ones (``backend``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbuf.priority import PriorityTable
from shmbuf.sampling import sumtree
from tests import pool_procs as procs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True, params=["compiled", "numpy"])
def backend(request):
    """Every test here runs against both ``sample``/``update`` walks: the compiled one (if it
    was built) and the NumPy one."""
    if request.param == "compiled" and sumtree._built is None:
        pytest.skip("the compiled sum tree (_sumtree_c) was not built")
    before = sumtree.use_compiled(request.param == "compiled")
    yield request.param
    sumtree.use_compiled(before)

SETTINGS = settings(max_examples=150, deadline=None)


# --------------------------------------------------------------------------------------------
# Models and invariants
# --------------------------------------------------------------------------------------------
def leaf_count(sums: np.ndarray) -> int:
    return sumtree.levels(sums.shape[1])[0][1]


def children(width: int):
    """(parent column, its children's columns) of every internal node, root included."""
    levels = sumtree.levels(width)
    F = sumtree.FANOUT
    for (offset, size), (parent_offset, parent_size) in zip(levels[:-1], levels[1:]):
        for j in range(parent_size if parent_size > 1 else 1):
            if j * F >= size:  # a padding node: no children below it
                yield parent_offset + j, np.zeros(0, np.int64)
            else:
                yield parent_offset + j, offset + j * F + np.arange(F)


def sum_of(values: np.ndarray) -> np.ndarray:
    """Sum over the last axis in the tree's order: halves added until one is left."""
    if values.shape[-1] == 0:
        return np.zeros(values.shape[:-1])
    while values.shape[-1] > 1:
        values = values[..., : values.shape[-1] // 2] + values[..., values.shape[-1] // 2 :]
    return values[..., 0]


def assert_invariants(sums: np.ndarray, mins: np.ndarray, leaves: np.ndarray) -> None:
    """``leaves`` ([lanes, L]) are the trees' leaves and every internal node is exactly what
    its children say; the root equals the leaf sum (to rounding: the tree adds blockwise)."""
    L = leaf_count(sums)
    np.testing.assert_array_equal(sums[:, :L], leaves)
    np.testing.assert_array_equal(mins[:, :L], np.where(leaves > 0, leaves, np.inf))
    for parent, kids in children(sums.shape[1]):
        np.testing.assert_array_equal(sums[:, parent], sum_of(sums[:, kids]))
        np.testing.assert_array_equal(mins[:, parent], mins[:, kids].min(axis=1, initial=np.inf))
    for k in range(leaves.shape[0]):
        assert math.isclose(sumtree.roots(sums)[k], math.fsum(leaves[k]), rel_tol=1e-12,
                            abs_tol=0.0)
        positive = leaves[k][leaves[k] > 0]
        assert sumtree.roots(mins)[k] == (positive.min() if positive.size else np.inf)


values_float = st.one_of(
    st.just(0.0),
    st.floats(1e-12, 1e6, allow_nan=False, allow_infinity=False),
)
values_int = st.integers(0, 20).map(float)  # exact in float64: prefix sums have no rounding


@st.composite
def update_batches(draw, values=values_float, max_lanes=3, max_capacity=40):
    """(lanes, capacity, [(lanes, leaves, values)]): batches of updates, duplicates likely."""
    lanes = draw(st.integers(1, max_lanes))
    capacity = draw(st.integers(1, max_capacity))
    batches = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(0, 3 * capacity))
        ln = draw(st.lists(st.integers(0, lanes - 1), min_size=n, max_size=n))
        leaf = draw(st.lists(st.integers(0, capacity - 1), min_size=n, max_size=n))
        val = draw(st.lists(values, min_size=n, max_size=n))
        batches.append((np.array(ln, np.int64), np.array(leaf, np.int64), np.array(val)))
    return lanes, capacity, batches


def apply_model(model: np.ndarray, lanes: np.ndarray, leaves: np.ndarray, values: np.ndarray):
    """The reference: one leaf at a time, in order (so the last of duplicates wins)."""
    for k, j, v in zip(lanes.tolist(), leaves.tolist(), values.tolist()):
        model[k, j] = v


def new_trees(lanes: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Empty (sums, mins) trees, ``[lanes, W]`` each."""
    W = sumtree.tree_width(capacity)
    return np.zeros((lanes, W)), np.full((lanes, W), np.inf)


def rebuild(sums: np.ndarray, mins: np.ndarray) -> None:
    """The reference for ``update``'s ancestors: every internal node recomputed from the
    leaves, node by node, level by level (bottom up)."""
    L = leaf_count(sums)
    mins[:, :L] = np.where(sums[:, :L] > 0, sums[:, :L], np.inf)
    for parent, kids in children(sums.shape[1]):
        sums[:, parent] = sum_of(sums[:, kids])
        mins[:, parent] = mins[:, kids].min(axis=1, initial=np.inf)


def build(lanes: int, capacity: int, batches) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sums, mins = new_trees(lanes, capacity)
    model = np.zeros((lanes, leaf_count(sums)))
    for ln, leaf, val in batches:
        sumtree.update(sums, mins, ln, leaf, val)
        apply_model(model, ln, leaf, val)
    return sums, mins, model


def lanes_with_leaves(sums: np.ndarray, model: np.ndarray):
    """(lane, root sum, cumulative leaf sums) of each lane with a positive leaf."""
    for k in range(model.shape[0]):
        if sumtree.roots(sums)[k] != 0:
            yield k, sumtree.roots(sums)[k], np.cumsum(model[k])


# --------------------------------------------------------------------------------------------
# Shape
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [1, 2, 31, 32, 33, 1000, 1024, 1025, 100_000, 1 << 20,
                                      (1 << 20) + 1, 10_000_000])
def test_tree_levels_hold_the_capacity_in_few_levels(capacity):
    """Leaves first (at least ``capacity``), each level a whole number of blocks of FANOUT, the
    top level one block under the root (the last column); ``levels`` recovers the geometry
    from the width alone (what a worker attaching a table knows); 10M rows take 6 levels."""
    F = sumtree.FANOUT
    width = sumtree.tree_width(capacity)
    levels = sumtree.levels(width)
    assert levels[0][0] == 0 and capacity <= levels[0][1] < capacity + F
    assert levels[-1] == (width - 1, 1) and levels[-2][1] == F
    for (offset, size), (next_offset, next_size) in zip(levels[:-1], levels[1:]):
        assert offset + size == next_offset and size % F == 0
        assert next_size == 1 or next_size * F >= size
    assert len(levels) - 1 <= 6
    if capacity <= 4096:
        sums, mins = new_trees(2, capacity)
        assert (sums == 0).all() and (mins == np.inf).all()


# --------------------------------------------------------------------------------------------
# update / rebuild
# --------------------------------------------------------------------------------------------
@SETTINGS
@given(update_batches())
def test_update_keeps_every_node_the_sum_and_min_of_its_children(case):
    """After random batches of updates (duplicate leaves within a batch: the last value wins),
    every internal node equals the sum / min of its children and the root the leaf sum."""
    sums, mins, model = build(*case)
    assert_invariants(sums, mins, model)


@SETTINGS
@given(update_batches())
def test_rebuild_reproduces_the_trees_update_built(case):
    """Recomputing every internal node from the leaves gives bit-identical trees: ``update``
    leaves no stale ancestor behind, whatever the order and overlap of its batches."""
    sums, mins, _ = build(*case)
    s2, m2 = sums.copy(), mins.copy()
    L = leaf_count(s2)
    s2[:, L:] = -1.0  # garbage in every internal node
    m2[:, L:] = -1.0
    rebuild(s2, m2)
    np.testing.assert_array_equal(s2, sums)
    np.testing.assert_array_equal(m2, mins)


def test_update_with_no_leaves_changes_nothing():
    sums, mins = new_trees(2, 8)
    sumtree.update(sums, mins, np.array([0, 1]), np.array([3, 7]), np.array([2.0, 5.0]))
    s, m = sums.copy(), mins.copy()
    empty = np.zeros(0, np.int64)
    sumtree.update(sums, mins, empty, empty, np.zeros(0))
    np.testing.assert_array_equal(sums, s)
    np.testing.assert_array_equal(mins, m)


# --------------------------------------------------------------------------------------------
# descend / sample
# --------------------------------------------------------------------------------------------
@SETTINGS
@given(update_batches(values=values_int), st.integers(0, 2**32 - 1))
def test_descend_finds_the_leaf_whose_prefix_interval_holds_u(case, seed):
    """With integer-valued leaves (exact sums), ``descend(u)`` is the first leaf whose
    cumulative sum exceeds u: ``np.searchsorted(cumsum, u, side="right")``. Zero leaves own
    an empty interval and are never returned. Integer u hit every interval boundary."""
    sums, _, model = build(*case)
    rng = np.random.default_rng(seed)
    for k, total, cum in lanes_with_leaves(sums, model):
        u = np.concatenate([np.arange(int(total)), rng.random(64) * total])  # boundaries too
        got = sumtree.descend(sums, np.full(u.size, k), u)
        np.testing.assert_array_equal(got, np.searchsorted(cum, u, side="right"))
        assert (model[k, got] > 0).all()


@SETTINGS
@given(update_batches(values=values_float), st.integers(0, 2**32 - 1))
def test_descend_agrees_with_searchsorted_away_from_rounding(case, seed):
    """Real-valued leaves: the tree's prefix sums and ``np.cumsum`` round differently, so
    compare only draws that are not within a relative 1e-9 of an interval boundary."""
    sums, _, model = build(*case)
    rng = np.random.default_rng(seed)
    for k, total, cum in lanes_with_leaves(sums, model):
        u = rng.random(256) * total
        near = (np.abs(u[:, None] - cum[None, :]) <= 1e-9 * total).any(axis=1)
        u = u[~near]
        got = sumtree.descend(sums, np.full(u.size, k), u)
        np.testing.assert_array_equal(got, np.searchsorted(cum, u, side="right"))


@SETTINGS
@given(update_batches(values=values_int, max_lanes=4), st.integers(0, 2**32 - 1))
def test_sample_never_returns_a_zero_leaf_while_some_are_positive(case, seed):
    """Across lanes (some of them empty) and within them, ``sample`` only returns leaves with
    a positive value, reports the total of all lanes, and raises when every leaf is zero."""
    sums, _, model = build(*case)
    rng = np.random.default_rng(seed)
    if model.sum() == 0:
        with pytest.raises(ValueError, match="every priority is zero"):
            sumtree.sample(sums, 8, rng)
        return
    lanes, leaves, total = sumtree.sample(sums, 512, rng)
    assert total == sumtree.roots(sums).sum()
    assert (model[lanes, leaves] > 0).all(), "drew a zero leaf"


def test_sample_frequencies_follow_the_leaves_across_lanes():
    """A quick statistical sanity check of the pure sampler (the full chi-square tests of the
    pool are in test_prioritized.py): lane and leaf frequencies within 5 sigma."""
    sums, mins = new_trees(3, 5)
    values = np.array([[1, 2, 0, 3, 4], [0, 0, 0, 0, 0], [10, 0, 0, 0, 5]], float)
    ln, leaf = np.nonzero(np.ones_like(values))
    sumtree.update(sums, mins, ln, leaf, values.reshape(-1))
    n = 200_000
    lanes, leaves, total = sumtree.sample(sums, n, np.random.default_rng(0))
    counts = np.zeros(values.shape)
    np.add.at(counts, (lanes, leaves), 1)
    p = values / total
    sigma = np.sqrt(n * p * (1 - p))
    assert (np.abs(counts - n * p) <= 5 * sigma + 1e-9).all(), (counts, n * p)


def test_a_zero_leaf_reached_by_a_descent_is_redrawn_not_delivered():
    """A worker descends the tree without locks while the learner updates it, leaf first and
    then its ancestors: it can see a leaf already at zero under ancestors that still count it
    (the same happens when rounding carries a descent past its last positive leaf).
    ``PriorityTable.draw`` checks the leaf it lands on and redraws: such a row is never
    delivered, and its neighbours are still drawn."""
    with procs.new_buffer(capacity=8, lanes=1, rows=8) as buf:
        table = PriorityTable.create(buf, alpha=1.0, eps=0.0)
        try:
            table.sync(buf)
            # Leaf 3 holds most of the mass in the ancestors, but is zero itself: exactly a
            # reader's view halfway through the learner's update(leaf 3 -> 0).
            sumtree.update(table.sums, table.mins, np.array([0]), np.array([3]),
                           np.array([20.0]))
            table.sums[0, 3] = 0.0
            draws = [table.draw(buf.windows(), 256, np.random.default_rng(s)) for s in range(8)]
            idx = np.concatenate([d.indices for d in draws])
            assert 3 not in idx
            assert set(idx.tolist()) == {0, 1, 2, 4, 5, 6, 7}
            for d in draws:  # the probabilities it reports are those of the leaves it kept
                np.testing.assert_allclose(d.probs, 1.0 / table.total())
        finally:
            table.close()


# --------------------------------------------------------------------------------------------
# fill (contiguous runs), proportionality at scale
# --------------------------------------------------------------------------------------------
@SETTINGS
@given(update_batches(), st.integers(0, 3), st.data())
def test_fill_builds_what_update_builds(case, lane_seed, data):
    """Entering a contiguous run of leaves with ``fill`` (slices) leaves the trees bit-identical
    to entering the same leaves one by one with ``update``."""
    lanes, capacity, batches = case
    sums, mins, model = build(lanes, capacity, batches)
    lane = lane_seed % lanes
    start = data.draw(st.integers(0, capacity - 1))
    stop = data.draw(st.integers(start, capacity))
    values = np.array(data.draw(st.lists(values_float, min_size=stop - start,
                                         max_size=stop - start)), np.float64)
    s2, m2 = sums.copy(), mins.copy()
    sumtree.fill(sums, mins, lane, start, values)
    sumtree.update(s2, m2, np.full(values.size, lane), np.arange(start, stop), values)
    np.testing.assert_array_equal(sums, s2)
    np.testing.assert_array_equal(mins, m2)
    model[lane, start:stop] = values
    assert_invariants(sums, mins, model)


@pytest.mark.parametrize("capacity", [1000, 100_000])
def test_draws_are_proportional_by_chi_square_and_zeros_never_come_up(capacity):
    """Many draws from a deep wide tree against the brute-force probabilities: Pearson's
    chi-square over 20 equal-probability bins of leaves stays below the 1e-4 tail, and a leaf
    at zero (a third of them) is never drawn."""
    rng = np.random.default_rng(capacity)
    sums, mins = new_trees(2, capacity)
    values = rng.pareto(1.5, (2, capacity)) * (rng.random((2, capacity)) > 1 / 3)
    for lane in range(2):
        sumtree.fill(sums, mins, lane, 0, values[lane])
    flat = values.reshape(-1)
    n = 400_000
    lanes, leaves, total = sumtree.sample(sums, n, rng)
    drawn = lanes * capacity + leaves
    assert (flat[drawn] > 0).all(), "drew a zero leaf"
    assert math.isclose(total, math.fsum(flat), rel_tol=1e-12)
    # 20 bins of (nearly) equal probability over the leaves in order.
    edges = np.searchsorted(np.cumsum(flat) / flat.sum(), np.linspace(0, 1, 21)[1:-1])
    bins = np.searchsorted(edges, drawn, side="right")
    observed = np.bincount(bins, minlength=20)
    p = np.add.reduceat(flat, np.r_[0, edges]) / flat.sum()
    chi2 = float((((observed - n * p) ** 2) / (n * p)).sum())
    assert chi2 < 50.0, (chi2, observed, n * p)  # chi-square(19) upper 1e-4 tail is ~49.5


def test_updates_move_the_draws():
    """After ``update`` moves all the mass onto a few leaves, only they are drawn."""
    sums, mins = new_trees(1, 5000)
    sumtree.fill(sums, mins, 0, 0, np.ones(5000))
    chosen = np.array([3, 1234, 4999])
    sumtree.update(sums, mins, np.zeros(5000, np.int64), np.arange(5000), np.zeros(5000))
    sumtree.update(sums, mins, np.zeros(3, np.int64), chosen, np.array([1.0, 2.0, 1.0]))
    _, leaves, total = sumtree.sample(sums, 40_000, np.random.default_rng(1))
    assert total == 4.0 and set(leaves.tolist()) == set(chosen.tolist())
    assert abs((leaves == 1234).mean() - 0.5) < 0.02
    assert sumtree.roots(mins)[0] == 1.0


def test_a_descent_through_parents_ahead_of_their_children_stays_in_the_tree():
    """A reader racing the learner can see a parent (up to the root) larger than its children
    sum to: the descent is carried past the last real node of a level onto padding. It must
    still end on a leaf of the tree (a zero one, which ``PriorityTable.draw`` redraws), not
    index past a level."""
    for capacity in (64, 1000, 5000):
        sums, mins = new_trees(1, capacity)
        sumtree.fill(sums, mins, 0, 0, np.ones(capacity))
        L = leaf_count(sums)
        sums[0, L:] *= 4.0  # every parent says four times what its children hold
        u = np.linspace(0, sumtree.roots(sums)[0], 257)[:-1]
        leaves = sumtree.descend(sums, np.zeros(u.size, np.int64), u)
        assert ((leaves >= 0) & (leaves < L)).all()
