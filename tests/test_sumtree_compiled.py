"""The compiled sum-tree walks (``shmbuf.sampling._sumtree_c``) against the NumPy ones.

``tests/test_sumtree.py`` runs its invariants and proportionality tests on both; here: the
trees the two leave are bit-identical and the draws land on the same leaves, bad input is
refused with a typed error before anything is stored, a descent through a tree that is torn
(parents that disagree with their children, as a reader can see while the learner updates)
stays in the tree, and ``SHMBUF_SUMTREE=numpy`` switches a process to NumPy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from shmbuf.sampling import sumtree

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sumtree._built is None, reason="_sumtree_c was not built (no compiler)"),
]

SHAPES = [(1, 1), (1, 16), (1, 17), (1, 1000), (1, 100_000), (3, 5000), (4, 70_000),
          (1, 1_000_000)]


@pytest.fixture
def compiled():
    before = sumtree.use_compiled(True)
    yield
    sumtree.use_compiled(before)


def filled(lanes: int, capacity: int, rng: np.random.Generator):
    sums = np.zeros((lanes, sumtree.tree_width(capacity)))
    mins = np.full_like(sums, np.inf)
    for lane in range(lanes):  # a tenth of the leaves zero
        sumtree.fill(sums, mins, lane, 0, rng.random(capacity) * (rng.random(capacity) > 0.1))
    return sums, mins


def walk(flag: bool, fn, *args):
    before = sumtree.use_compiled(flag)
    try:
        return fn(*args)
    finally:
        sumtree.use_compiled(before)


def test_ci_builds_the_compiled_tree():
    """Where ``SHMBUF_REQUIRE_COMPILED`` is set (``.ci/run``), the extension must be in use: a
    failed build would otherwise fall back to NumPy unseen."""
    if not os.environ.get("SHMBUF_REQUIRE_COMPILED"):
        pytest.skip("SHMBUF_REQUIRE_COMPILED is not set")
    assert sumtree.compiled()


@pytest.mark.parametrize("lanes,capacity", SHAPES)
def test_updates_leave_bit_identical_trees_and_draws_the_same_leaves(lanes, capacity):
    rng = np.random.default_rng(capacity + lanes)
    sums, mins = filled(lanes, capacity, rng)
    c_sums, c_mins = sums.copy(), mins.copy()
    for _ in range(20):
        n = int(rng.integers(1, 600))
        lane = rng.integers(0, lanes, n)
        leaf = rng.integers(0, capacity, n)
        leaf[: n // 4] = leaf[0]  # repeats: the last value must win in both
        value = rng.random(n) * (rng.random(n) > 0.2)
        walk(True, sumtree.update, c_sums, c_mins, lane, leaf, value)
        walk(False, sumtree.update, sums, mins, lane, leaf, value)
        np.testing.assert_array_equal(c_sums, sums)
        np.testing.assert_array_equal(c_mins, mins)
        seed = int(rng.integers(1 << 31))
        if not sumtree.roots(sums).sum() > 0:  # (a one-leaf tree set to zero) both refuse
            for flag in (True, False):
                with pytest.raises(ValueError, match="every priority is zero"):
                    walk(flag, sumtree.sample, sums, 512, np.random.default_rng(seed))
            continue
        c_draw = walk(True, sumtree.sample, sums, 512, np.random.default_rng(seed))
        n_draw = walk(False, sumtree.sample, sums, 512, np.random.default_rng(seed))
        np.testing.assert_array_equal(c_draw[0], n_draw[0])  # lanes
        np.testing.assert_array_equal(c_draw[1], n_draw[1])  # leaves
        assert c_draw[2] == n_draw[2]  # the total the probabilities are against
    rebuilt, rebuilt_mins = sums.copy(), mins.copy()
    sumtree.rebuild(rebuilt, rebuilt_mins)
    np.testing.assert_array_equal(rebuilt, c_sums)
    np.testing.assert_array_equal(rebuilt_mins, c_mins)


@pytest.mark.parametrize("lanes,capacity", [(1, 100), (3, 5000), (2, 100_000)])
def test_fills_and_fix_top_leave_bit_identical_trees(lanes, capacity):
    """Runs of new rows (``PriorityTable.sync``): ``fill`` with and without ``top``, then
    ``fix_top``, from either walk, in any mix, leave the same trees."""
    rng = np.random.default_rng(lanes * capacity)
    trees = {flag: filled(lanes, capacity, np.random.default_rng(1)) for flag in (True, False)}
    for round_ in range(30):
        lane, start = int(rng.integers(lanes)), int(rng.integers(capacity))
        values = rng.random(int(rng.integers(0, capacity - start + 1))) * 3
        top = bool(round_ % 3)
        for flag, (sums, mins) in trees.items():
            walk(flag, sumtree.fill, sums, mins, lane, start, values, top)
            if round_ % 5 == 4:
                walk(not flag if round_ % 10 == 9 else flag, sumtree.fix_top, sums, mins)
        if round_ % 5 == 4:
            np.testing.assert_array_equal(trees[True][0], trees[False][0])
            np.testing.assert_array_equal(trees[True][1], trees[False][1])
    sums, mins = trees[True]
    rebuilt, rebuilt_mins = sums.copy(), mins.copy()
    sumtree.rebuild(rebuilt, rebuilt_mins)
    np.testing.assert_array_equal(rebuilt, sums)
    np.testing.assert_array_equal(rebuilt_mins, mins)


@pytest.mark.parametrize("lanes", [1, 3])
def test_bad_input_is_refused_before_anything_is_stored(compiled, lanes):
    rng = np.random.default_rng(7)
    sums, mins = filled(lanes, 1000, rng)
    before, before_mins = sums.copy(), mins.copy()
    leaf_count = sumtree.levels(sums.shape[1])[0][1]
    ok_lanes, ok_leaves, ok_values = np.zeros(3, np.int64), np.array([1, 2, 3]), np.ones(3)
    with pytest.raises(IndexError, match="leaf 1008 of lane 0"):  # a padding column, in range
        sumtree.update(sums, mins, ok_lanes, np.array([1, 2, leaf_count]), ok_values)
    with pytest.raises(IndexError):
        sumtree.update(sums, mins, ok_lanes, np.array([1, -1, 3]), ok_values)
    if lanes > 1:
        with pytest.raises(IndexError, match=f"of lane {lanes}"):
            sumtree.update(sums, mins, np.array([0, lanes, 0]), ok_leaves, ok_values)
    width, geometry = sums.shape[1], sumtree._geometry(sums.shape[1])
    with pytest.raises(ValueError, match="mismatched"):
        sumtree._built.update(sums, mins, width, geometry, None, ok_leaves, np.ones(2))
    with pytest.raises(TypeError, match="leaves must be a C-contiguous int64"):
        sumtree._built.update(sums, mins, width, geometry, None, ok_leaves.astype(np.int32),
                              ok_values)
    with pytest.raises(TypeError, match="values must be a C-contiguous float64"):
        sumtree._built.update(sums, mins, width, geometry, None, ok_leaves,
                              ok_values.astype(np.float32))
    with pytest.raises(ValueError, match="not C-contiguous"):
        sumtree._built.update(sums, mins, width, geometry, None, ok_leaves,
                              np.ones(6)[::2])
    with pytest.raises(ValueError, match="geometry"):
        sumtree._built.update(sums, mins, width, sumtree._geometry(sumtree.tree_width(10**5)),
                              None, ok_leaves, ok_values)
    for row, column, value in [(1, 1, 10**6), (0, 1, leaf_count), (1, 0, 17), (0, 0, 1)]:
        wrong = geometry.copy()  # a walk outside the row: refused before any store
        wrong[row, column] = value
        with pytest.raises(ValueError, match="geometry"):
            sumtree._built.update(sums, mins, width, wrong, None, ok_leaves, ok_values)
        with pytest.raises(ValueError, match="geometry"):
            sumtree._built.sample(sums, width, wrong, np.zeros(2), np.empty(2, np.int64),
                                  np.empty(2, np.int64))
    frozen = sums.copy()
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError, TypeError)):
        sumtree._built.update(frozen, mins, width, geometry, None, ok_leaves, ok_values)
    np.testing.assert_array_equal(sums, before)
    np.testing.assert_array_equal(mins, before_mins)
    with pytest.raises(IndexError, match=f"leaves \\[1000, {leaf_count + 1}\\) of lane 0"):
        sumtree.fill(sums, mins, 0, 1000, np.ones(leaf_count - 999))
    with pytest.raises(IndexError, match=f"of lane {lanes}"):
        sumtree.fill(sums, mins, lanes, 0, np.ones(3))
    np.testing.assert_array_equal(sums, before)
    np.testing.assert_array_equal(mins, before_mins)
    with pytest.raises(ValueError, match="every priority is zero"):
        sumtree.sample(np.zeros_like(sums), 4, rng)


def test_a_descent_through_a_torn_tree_stays_in_the_tree(compiled):
    """Parents that disagree with their children (garbage above, zeros below, whole lanes
    empty) cannot take a descent out of its lane's leaves or into padding."""
    rng = np.random.default_rng(3)
    capacity = 5000
    width = sumtree.tree_width(capacity)
    leaf_count = sumtree.levels(width)[0][1]
    for round_ in range(50):
        sums = rng.random((3, width)) * rng.integers(0, 2, (3, width))  # torn: random nodes
        sums[round_ % 3] = 0.0
        sums[:, -1] = rng.random(3) + 0.1
        lanes, leaves, total = sumtree.sample(sums, 1024, rng)
        assert lanes.min() >= 0 and lanes.max() < 3
        assert leaves.min() >= 0 and leaves.max() < leaf_count
        assert total > 0


def test_draws_stay_in_the_tree_while_another_thread_updates_it(compiled):
    """The walks release the GIL: a draw may run while an update rewrites the nodes under it."""
    rng = np.random.default_rng(5)
    capacity = 100_000
    sums, mins = filled(2, capacity, rng)
    stop = threading.Event()

    def updater() -> None:
        r = np.random.default_rng(6)
        while not stop.is_set():
            sumtree.update(sums, mins, r.integers(0, 2, 4096), r.integers(0, capacity, 4096),
                           r.random(4096) * (r.random(4096) > 0.5))

    thread = threading.Thread(target=updater, daemon=True)
    thread.start()
    try:
        for _ in range(300):
            lanes, leaves, _ = sumtree.sample(sums, 1024, rng)
            assert lanes.min() >= 0 and lanes.max() < 2
            assert leaves.min() >= 0 and leaves.max() < capacity + sumtree.FANOUT
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_environment_switches_a_process_to_numpy():
    code = "from shmbuf.sampling import sumtree; print(sumtree.compiled())"
    for value, expected in [("numpy", "False"), ("", "True")]:
        env = dict(os.environ, SHMBUF_SUMTREE=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=60, check=True)
        assert out.stdout.strip() == expected, (value, out.stderr)
