"""The pure sum / min trees of ``shmbuf.sampling.sumtree``, against NumPy models.

Property tests (hypothesis) with random batches of leaf updates, duplicates included: every
internal node is exactly the sum (and min over positive leaves) of its two children, the root is
the sum of the leaves, a full rebuild from the leaves reproduces what ``update`` built,
``descend`` maps a prefix sum to the leaf ``np.searchsorted`` finds on the cumulative sum, and
``sample`` never returns a zero leaf while some leaf is positive. Floating point can still land a descent on a zero leaf (and a
reader that descends while the learner updates can see a leaf change under it): the last test
checks that ``PriorityTable.draw`` redraws such leaves instead of delivering them.
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

SETTINGS = settings(max_examples=150, deadline=None)


# --------------------------------------------------------------------------------------------
# Models and invariants
# --------------------------------------------------------------------------------------------
def assert_invariants(sums: np.ndarray, mins: np.ndarray, leaves: np.ndarray) -> None:
    """``leaves`` ([lanes, P]) are the trees' leaves and every internal node is exactly what
    its children say; the root equals the leaf sum (to rounding: the tree adds pairwise)."""
    P = sums.shape[1] // 2
    np.testing.assert_array_equal(sums[:, P:], leaves)
    np.testing.assert_array_equal(mins[:, P:], np.where(leaves > 0, leaves, np.inf))
    n = np.arange(1, P)
    np.testing.assert_array_equal(sums[:, n], sums[:, 2 * n] + sums[:, 2 * n + 1])
    np.testing.assert_array_equal(mins[:, n], np.minimum(mins[:, 2 * n], mins[:, 2 * n + 1]))
    for k in range(leaves.shape[0]):
        assert math.isclose(sums[k, 1], math.fsum(leaves[k]), rel_tol=1e-12, abs_tol=0.0)
        positive = leaves[k][leaves[k] > 0]
        assert mins[k, 1] == (positive.min() if positive.size else np.inf)


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
    """Empty (sums, mins) trees, ``[lanes, 2P]`` each."""
    P = sumtree.tree_size(capacity)
    return np.zeros((lanes, 2 * P)), np.full((lanes, 2 * P), np.inf)


def rebuild(sums: np.ndarray, mins: np.ndarray) -> None:
    """The reference for ``update``'s ancestors: every internal node recomputed from the
    leaves, level by level."""
    P = sums.shape[1] // 2
    mins[:, P:] = np.where(sums[:, P:] > 0, sums[:, P:], np.inf)
    n = P
    while n > 1:
        half = n // 2
        sums[:, half:n] = sums[:, n : 2 * n : 2] + sums[:, n + 1 : 2 * n : 2]
        mins[:, half:n] = np.minimum(mins[:, n : 2 * n : 2], mins[:, n + 1 : 2 * n : 2])
        n = half


def build(lanes: int, capacity: int, batches) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sums, mins = new_trees(lanes, capacity)
    model = np.zeros((lanes, sumtree.tree_size(capacity)))
    for ln, leaf, val in batches:
        sumtree.update(sums, mins, ln, leaf, val)
        apply_model(model, ln, leaf, val)
    return sums, mins, model


def lanes_with_leaves(sums: np.ndarray, model: np.ndarray):
    """(lane, root sum, cumulative leaf sums) of each lane with a positive leaf."""
    for k in range(model.shape[0]):
        if sums[k, 1] != 0:
            yield k, sums[k, 1], np.cumsum(model[k])


# --------------------------------------------------------------------------------------------
# Shape
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity, P", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (1000, 1024),
                                         (1 << 20, 1 << 20), ((1 << 20) + 1, 1 << 21)])
def test_tree_size_is_the_next_power_of_two(capacity, P):
    assert sumtree.tree_size(capacity) == P
    sums, mins = new_trees(2, min(capacity, 4096))
    assert sums.shape == mins.shape == (2, 2 * sumtree.tree_size(min(capacity, 4096)))
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
    P = s2.shape[1] // 2
    s2[:, 1:P] = -1.0  # garbage in every internal node (node 0 is unused)
    m2[:, 1:P] = -1.0
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
    assert total == sums[:, 1].sum()
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
            P = table.sums.shape[1] // 2
            # Leaf 3 holds most of the mass in the ancestors, but is zero itself: exactly a
            # reader's view halfway through the learner's update(leaf 3 -> 0).
            sumtree.update(table.sums, table.mins, np.array([0]), np.array([3]),
                           np.array([20.0]))
            table.sums[0, P + 3] = 0.0
            draws = [table.draw(buf.windows(), 256, np.random.default_rng(s)) for s in range(8)]
            idx = np.concatenate([d.indices for d in draws])
            assert 3 not in idx
            assert set(idx.tolist()) == {0, 1, 2, 4, 5, 6, 7}
            for d in draws:  # the probabilities it reports are those of the leaves it kept
                np.testing.assert_allclose(d.probs, 1.0 / table.sums[0, 1])
        finally:
            table.close()
