"""Actor priorities (Ape-X): writers give a priority with each row, the learner's priority table
enters the row at it (``ReplayBuffer.create(..., actor_priorities=True)``).

What is proved here:
- rows entered with priorities p are drawn in proportion to ``p ** alpha`` (chi-square at a
  fixed seed, with the power to reject uniform draws), in process and with sampler workers;
  a row entered at priority 0 (eps 0) is never drawn; ``batch.weights`` are
  ``(P_i / P_min) ** -beta`` of those priorities, as for updated ones;
- rows given without a priority enter at the maximum priority, which actor priorities raise;
  a uniform retirement count (``Counted(k, Uniform())``) ignores them;
- ``add_prioritized``, ``extend(..., priorities=)`` and the vector writers (of several envs
  and of one) all publish them, also in a derived-next_obs buffer (whose FINAL rows stay at
  0 and whose next observations stay right); a field called ``priority`` (or ``priorities``)
  is still a field;
- NaN, infinite, negative, non-numeric and wrongly shaped priorities raise
  ``InvalidPriorityError`` and change nothing (committed counts, stamps and the priority
  columns); a buffer without the columns refuses priorities naming the fix;
- a writer SIGKILLed inside a prioritized ``extend`` (exactly between storing the rows'
  priorities and publishing them, and at random moments), under fork, forkserver and spawn:
  its unpublished rows give no priority to the rows a new writer then writes at the same
  indices without one, and the tree's sum is exactly the sum over readable rows of their
  entered priorities ** alpha;
- priorities too large for the tree are clipped at sync and counted in ``stats()``;
- prioritized sequences: a window start enters at its row's actor priority;
- a restore of rows without actor priorities leaves no stale one behind (checkpoints that
  keep them: ``test_persist_priorities.py``); the layout of a buffer without them is the one
  it always had.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest

import shmbuf
from shmbuf import layout as L
from shmbuf.sampling import Plan, sumtree
from shmbuf.segment import Segment
from shmbuf.storage import BufferStorage, field_tuples
from tests import pool_procs as procs
from tests.test_prioritized import chi_square_p
from workers import SamplerPool
from workers.config import Workers
from workers.selection import Counted, Prioritized, Uniform

pytestmark = pytest.mark.timeout(120)

ALPHA = 0.7


PADDED = shmbuf.Spec({**{f.name: (f.shape, f.dtype) for f in procs.SPEC.values()},
                      "pad": ((512,), "uint8")})  # rows slow enough to die inside a copy


def new_buffer(capacity: int, lanes: int = 1, spec: shmbuf.Spec = procs.SPEC, **kw: Any
               ) -> shmbuf.ReplayBuffer:
    return shmbuf.ReplayBuffer.create(spec, capacity=capacity, lanes=lanes,
                                      actor_priorities=True, **kw)


def _pool(buf: shmbuf.ReplayBuffer, batch_size: int, n_workers: int = 0,
          start_method: str | None = None, selection: Any = None, **kw: Any) -> SamplerPool:
    workers = Workers(n_workers, staging=2 * n_workers if n_workers else None,
                      start_method=start_method)
    return SamplerPool(buf, batch_size, selection=selection or Prioritized(alpha=ALPHA, eps=0.0),
                       workers=workers, seed=0, timeout=30, **kw)


def leaves(pool: SamplerPool, lane: int, indices: np.ndarray) -> np.ndarray:
    return pool._table.leaf_values(np.full(len(indices), lane, np.int64), np.asarray(indices))


# --------------------------------------------------------------------------------------------
# Draws and importance weights
# --------------------------------------------------------------------------------------------
def _frequency_case(n_workers: int, start_method: str | None) -> None:
    B, n_batches, C = 256, 120, 24
    rng = np.random.default_rng(123)
    p = rng.uniform(0.05, 4.0, (2, C))
    zero = [(0, 3), (0, 17), (1, 5)]
    for lane, i in zero:
        p[lane, i] = 0.0  # eps = 0: never drawn
    with new_buffer(C, lanes=2) as buf:
        for lane in range(2):
            with buf.writer(lane=lane) as w:
                w.extend(procs.make_batch(lane, np.arange(C)), priorities=p[lane])
        counts = np.zeros((2, C))
        with _pool(buf, B, n_workers, start_method) as pool:
            for _ in range(n_batches):
                batch = pool.next(timeout=30)
                procs.assert_batch_ok(batch, B)
                np.add.at(counts, (batch.lanes, batch.indices), 1)
            stats = pool.stats()
        assert stats["actor_priorities_entered"] == 2 * C
        assert stats["actor_priorities_clipped"] == 0
    assert all(counts[lane, i] == 0 for lane, i in zero), "a zero-priority row was drawn"
    value = (p ** ALPHA).reshape(-1)
    live = value > 0
    drawn = counts.reshape(-1)[live]
    p_value = chi_square_p(drawn, value[live] / value.sum())
    assert p_value > 1e-3, f"draws do not follow the actor priorities (chi-square p={p_value:.2e})"
    assert chi_square_p(drawn, np.full(live.sum(), 1 / live.sum())) < 1e-12  # it has power


def test_rows_are_drawn_in_proportion_to_their_actor_priorities_in_process():
    """30,720 draws over 48 rows whose writers gave random priorities (3 of them zero): the
    counts fit ``p ** alpha`` (chi-square, fixed seed) and the zero rows never come up."""
    _frequency_case(0, None)


def test_rows_are_drawn_in_proportion_to_their_actor_priorities_with_workers(start_method):
    """The same with two sampler workers drawing from the shared tree."""
    _frequency_case(2, start_method)


def test_importance_weights_are_those_of_the_actor_priorities():
    """``batch.weights == (P_i / P_min) ** -beta`` with ``P`` from the priorities the writer
    gave (beta 0.5), batch after batch."""
    C = 40
    p = 0.5 + np.arange(C) % 9 * 0.75
    with new_buffer(C) as buf:
        with buf.writer(lane=0) as w:
            w.extend(procs.make_batch(0, np.arange(C)), priorities=p)
        with _pool(buf, 64, selection=Prioritized(alpha=ALPHA, beta=0.5, eps=0.0)) as pool:
            for _ in range(5):
                batch = pool.next()
                drawn = p[np.asarray(batch.indices)] ** ALPHA
                np.testing.assert_allclose(np.asarray(batch.weights),
                                           (drawn / (p ** ALPHA).min()) ** -0.5, rtol=2e-6)


def test_rows_without_a_priority_enter_at_the_maximum_which_actor_priorities_raise():
    """Rows 0..7 with priorities up to 6, then 4 rows without: at the next sync those enter
    at the largest priority entered so far (6), like rows after an update; a uniform count
    enters every row at 1 whatever its writer gave."""
    with new_buffer(32) as buf:
        with buf.writer(lane=0) as w:
            w.extend(procs.make_batch(0, np.arange(8)), priorities=np.arange(8.0) % 7)
            with _pool(buf, 4) as pool:
                pool.next()
                w.extend(procs.make_batch(0, np.arange(8, 12)))
                pool.next()
                np.testing.assert_allclose(leaves(pool, 0, np.arange(12)),
                                           np.r_[np.arange(8.0) % 7, [6.0] * 4] ** ALPHA)
                assert pool._table.max_priority == 6.0
        with _pool(buf, 4, selection=Counted(2, Uniform())) as pool:
            pool.next()
            assert (leaves(pool, 0, np.arange(12)) <= 1.0).all()
            assert pool.stats()["actor_priorities_entered"] == 0


# --------------------------------------------------------------------------------------------
# Every writer, a field called priority
# --------------------------------------------------------------------------------------------
def test_every_writer_publishes_priorities_and_a_field_named_priority_is_a_field():
    """``add_prioritized`` (compiled writer class or not), ``extend(priorities=)``, a vector
    writer of 3 envs and one of 1 env: each row enters at the priority given with it, and the
    spec's own ``priority`` and ``priorities`` fields hold what was written to them."""
    spec = shmbuf.Spec({"obs": ((2,), "float32"), "priority": ((), "int64"),
                        "priorities": ((), "float32")})
    with shmbuf.ReplayBuffer.create(spec, 16, lanes=5, actor_priorities=True) as buf:

        def row(i: int, n: int | None = None) -> dict[str, Any]:
            if n is None:
                return {"obs": np.full(2, i, np.float32), "priority": 100 + i,
                        "priorities": np.float32(-i)}
            return {"obs": np.full((n, 2), i, np.float32), "priority": np.full(n, 100 + i),
                    "priorities": np.full(n, -i, np.float32)}

        with buf.writer(lane=0) as w:
            assert w.add(**row(0)) == 0  # the field, no actor priority
            assert w.add_prioritized(2.5, **row(1)) == 1
            assert w.extend({k: np.stack([row(2)[k], row(3)[k]]) for k in spec},
                            priorities=[3.0, 4.0]) == range(2, 4)
            assert w.add_prioritized(np.float32(5.0), **row(4)) == 4
        with buf.writer(lanes=[1, 2, 3]) as vw:
            assert vw.add_prioritized(np.array([6.0, 7.0, 8.0]), **row(5, 3)).tolist() == [0, 0, 0]
            assert vw.add(**row(6, 3)).tolist() == [1, 1, 1]
        with buf.writer(lanes=[4]) as one:
            assert one.add_prioritized([9.0], **row(7, 1)).tolist() == [0]
            assert one.add_prioritized(np.array([9.5]), **{k: v[0:1] for k, v in
                                                            row(8, 1).items()}).tolist() == [1]
        got = buf.get(np.arange(5), 0)
        np.testing.assert_array_equal(got["priority"], 100 + np.arange(5))
        np.testing.assert_array_equal(got["priorities"], -np.arange(5, dtype=np.float32))
        np.testing.assert_array_equal(buf.get(np.arange(2), 2)["priority"], [105, 106])
        with _pool(buf, 8, selection=Prioritized(alpha=1.0, eps=0.0)) as pool:
            pool.next()
            # lane 0's first row had none: it enters at the maximum of this first sync (1.0)
            np.testing.assert_array_equal(leaves(pool, 0, np.arange(5)), [1.0, 2.5, 3, 4, 5])
            for lane, p in ((1, 6.0), (2, 7.0), (3, 8.0)):
                np.testing.assert_array_equal(leaves(pool, lane, np.arange(2)), [p, 1.0])
            np.testing.assert_array_equal(leaves(pool, 4, np.arange(2)), [9.0, 9.5])


def test_derived_next_obs_rows_with_priorities():
    """A derived-next_obs buffer (priorities per window start there): rows given with
    priorities enter at them, the episodes' FINAL rows at 0, and every batch's next_obs is
    the obs given with the step, the last step's included."""
    spec = shmbuf.Spec({"obs": ((2,), "float32"), "reward": ((), "float32")})
    with shmbuf.ReplayBuffer.create(spec, 64, next_obs="derived",
                                    actor_priorities=True) as buf:
        with buf.writer(lane=0) as w:
            for episode in range(3):
                base = 10.0 * episode
                for t in range(4):  # one step at a time and a batch of the rest
                    if t < 2:
                        w.add_prioritized(1.0 + t + episode, obs=np.full(2, base + t, "f4"),
                                          next_obs=np.full(2, base + t + 1, "f4"),
                                          reward=np.float32(base + t))
                obs = base + np.arange(2, 4, dtype=np.float32)
                w.extend({"obs": np.repeat(obs[:, None], 2, 1), "reward": obs,
                          "next_obs": np.repeat(obs[:, None] + 1, 2, 1)},
                         priorities=[3.0 + episode, 4.0 + episode])
                w.end_episode()
        with _pool(buf, 32, selection=Prioritized(alpha=1.0, eps=0.0)) as pool:
            for _ in range(10):
                batch = pool.next()
                np.testing.assert_array_equal(batch["next_obs"], batch["obs"] + 1)
                np.testing.assert_array_equal(batch["obs"][:, 0], batch["reward"])
            # 5 rows per episode: 4 steps, then the FINAL row at 0
            expected = np.array([[1.0 + t + e for t in range(4)] + [0.0] for e in range(3)])
            np.testing.assert_array_equal(leaves(pool, 0, np.arange(15)), expected.reshape(-1))


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------
def _shared_state(buf: shmbuf.ReplayBuffer) -> list[np.ndarray]:
    s = buf.storage
    return [s.committed.copy(), s.reserved.copy(), s.stamps.copy(), s.priority.copy(),
            s.priority_row.copy()]


BAD = [float("nan"), float("inf"), float("-inf"), -1.0, -1e-300]


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("how", ["extend", "add_prioritized", "vector", "one_env"])
def test_bad_priorities_raise_and_change_nothing(bad, how):
    with new_buffer(16, lanes=3) as buf:
        with buf.writer(lane=0) as w:
            w.extend(procs.make_batch(0, np.arange(5)), priorities=np.ones(5))
        before = _shared_state(buf)
        with pytest.raises(shmbuf.InvalidPriorityError) as info:
            if how in ("extend", "add_prioritized"):
                with buf.writer(lane=0) as w:
                    if how == "extend":
                        w.extend(procs.make_batch(0, np.arange(5, 9)),
                                 priorities=[1.0, 2.0, bad, 3.0])
                    else:
                        w.add_prioritized(bad, **procs.make_row(0, 5))
            else:
                lanes = [1, 2] if how == "vector" else [1]
                with buf.writer(lanes=lanes) as vw:
                    rows = {k: np.stack([procs.make_row(k_, 0)[k] for k_ in lanes])
                            for k in procs.FIELDS}
                    vw.add_prioritized(np.r_[[2.0] * (len(lanes) - 1), bad], **rows)
        msg = str(info.value)
        assert repr(float(bad)) in msg and "nothing was written" in msg and "Fix" in msg, msg
        if how == "extend":
            assert "position 2" in msg, msg
        for a, b in zip(before, _shared_state(buf)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("priorities", [np.ones(3), np.ones(5), np.ones((4, 1)), 1.0,
                                        ["a", "b", "c", "d"], np.ones(4, complex)])
def test_priorities_of_the_wrong_shape_or_kind_raise_and_change_nothing(priorities):
    with new_buffer(16) as buf:
        before = _shared_state(buf)
        with buf.writer(lane=0) as w, pytest.raises(shmbuf.InvalidPriorityError) as info:
            w.extend(procs.make_batch(0, np.arange(4)), priorities=priorities)
        assert "nothing was written" in str(info.value).lower() or "Nothing" in str(info.value)
        with buf.writer(lane=0) as w, pytest.raises(shmbuf.InvalidPriorityError):
            w.add_prioritized(np.ones(1), **procs.make_row(0, 0))  # one row: one number
        for a, b in zip(before, _shared_state(buf)):
            np.testing.assert_array_equal(a, b)


def test_a_buffer_without_actor_priorities_refuses_them_naming_the_fix():
    with procs.new_buffer(capacity=8, lanes=2, rows=0) as buf:
        assert not buf.actor_priorities and buf.storage.priority is None
        with buf.writer(lane=0) as w:
            with pytest.raises(shmbuf.SpecMismatchError, match="actor_priorities=True"):
                w.extend(procs.make_batch(0, np.arange(2)), priorities=[1.0, 2.0])
            with pytest.raises(shmbuf.SpecMismatchError, match="actor_priorities=True"):
                w.add_prioritized(1.0, **procs.make_row(0, 0))
            assert w.committed == 0
            w.extend(procs.make_batch(0, np.arange(2)))  # and without them, as ever
        with buf.writer(lanes=[1]) as one, \
                pytest.raises(shmbuf.SpecMismatchError, match="actor_priorities=True"):
            one.add_prioritized([1.0], **{k: v[None] for k, v in procs.make_row(1, 0).items()})


# --------------------------------------------------------------------------------------------
# A writer killed inside a prioritized extend
# --------------------------------------------------------------------------------------------
PEAK = 500.0  # the first row's priority: rows without one enter at it (the running maximum)


def actor_priority(index: np.ndarray) -> np.ndarray:
    """What the killed writers give row ``index``: never PEAK, never 1 (the initial maximum)."""
    return 2.0 + (np.asarray(index) * 7) % 97


def die_before_publishing(buf: shmbuf.ReplayBuffer, conn: Any, first: int, n: int) -> None:
    """Child: a prioritized extend of ``n`` rows at ``first`` that dies (SIGKILL) right after
    storing the rows and their priorities, before their stamps turn even and ``committed``
    moves: the worst moment for its priorities. Through NumPy's store, whose steps can be
    hooked (the compiled one stores the same columns in the same order:
    ``test_priorities_store_the_same_bytes_through_the_compiled_and_the_numpy_store``)."""
    from shmbuf import slots, store

    store.CompiledStore = store.CompiledAdd = None
    w = buf.writer(lane=0, timeout=10)
    assert not w._store.compiled
    conn.send(("ready", w.committed))

    def die(*args: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    slots.mark_ring_held = die  # store.NumpyLaneStore.put_many calls it next
    index = np.arange(first, first + n)
    w.extend(procs.make_batch(0, index), priorities=actor_priority(index))
    conn.send(("survived", w.committed))


def extend_with_priorities_until_killed(buf: shmbuf.ReplayBuffer, conn: Any, seed: int,
                                        budget: int) -> None:
    """Child: prioritized extends of 1..600 rows of ``PADDED`` on lane 0, flat out (the rows made
    beforehand, so nearly all its time is spent inside ``extend``), until ``budget`` rows are
    written (so the ring never laps); then it waits to be killed.

    It dies at a random moment (a timer of a few milliseconds: ``SIGALRM``, whose default
    action ends the process where it stands, inside a NumPy copy or between two stores, as
    SIGKILL would; a child descheduled meanwhile dies where it was stopped)."""
    rng = np.random.default_rng(seed)
    w = buf.writer(lane=0, timeout=10)
    first = w.committed
    rows = procs.make_batch(0, np.arange(first, first + budget))
    rows["pad"] = np.full((budget, 512), 7, np.uint8)
    priorities = actor_priority(np.arange(first, first + budget))
    conn.send(("ready", first))
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, float(rng.uniform(2e-4, 6e-3)))
    at = 0
    while at < budget:
        n = min(int(rng.integers(1, 600)), budget - at)
        w.extend({k: v[at:at + n] for k, v in rows.items()}, priorities=priorities[at:at + n])
        at += n
    time.sleep(600)


def _stop(child: Any) -> None:
    """Kill ``child`` if it still runs, and reap it."""
    if child.exitcode is None:
        child.kill()
    child.join(30)


def _check_tree(pool: SamplerPool, buf: shmbuf.ReplayBuffer, entered: np.ndarray) -> None:
    """After a sync: every readable row's leaf is its entered priority ** alpha, every other
    slot's leaf 0, the parents are the sums of their children and the root sum is the sum
    over readable rows (no slot is ever rewritten here: the buffer never laps)."""
    table = pool._table
    lo, hi = int(buf.windows().lo[0]), int(buf.windows().hi[0])
    index = np.arange(lo, hi)
    value = entered[index] ** ALPHA
    got = leaves(pool, 0, index)
    wrong = np.flatnonzero(got != value)
    assert not wrong.size, (f"rows {index[wrong][:8].tolist()} hold {got[wrong][:8].tolist()}, "
                            f"not {value[wrong][:8].tolist()}")
    rest = np.ones(buf.capacity, bool)
    rest[index % buf.capacity] = False
    assert (table.sums[0, : buf.capacity][rest] == 0).all(), "a slot never published has a value"
    sums, mins = table.sums.copy(), table.mins.copy()
    sumtree.rebuild(sums, mins)
    np.testing.assert_array_equal(sums, table.sums)
    np.testing.assert_allclose(table.total(), value.sum(), rtol=1e-12)


def _take_over_and_write_plain(buf: shmbuf.ReplayBuffer, entered: np.ndarray, k: int) -> int:
    """A new writer takes lane 0 over and writes ``k`` rows without priorities at the indices
    the dead writer had claimed: they must enter at the running maximum, PEAK."""
    with buf.writer(lane=0, timeout=5) as w:
        first = w.committed
        rows = procs.make_batch(0, np.arange(first, first + k))
        if "pad" in buf.spec:
            rows["pad"] = np.zeros((k, 512), np.uint8)
        w.extend(rows)
    entered[first:first + k] = PEAK
    return first


@pytest.mark.timeout(180)
def test_a_writer_killed_between_storing_and_publishing_leaves_no_priority(mp):
    """The writer dies after storing 300 rows and their priorities, before publishing them.
    Its priorities are there (the test would fail without the fix: the tags name those very
    rows), yet the rows a new writer writes at those indices without priorities enter at the
    maximum, and the tree sums exactly the readable rows' priorities."""
    C = 4096
    entered = np.zeros(C)
    with new_buffer(C) as buf, _pool(buf, 16) as pool:
        with buf.writer(lane=0) as w:
            w.add_prioritized(PEAK, **procs.make_row(0, 0))
            w.extend(procs.make_batch(0, np.arange(1, 100)),
                     priorities=actor_priority(np.arange(1, 100)))
        entered[0], entered[1:100] = PEAK, actor_priority(np.arange(1, 100))
        pool.next()
        parent, child_end = mp.Pipe(duplex=False)
        child = mp.Process(target=die_before_publishing, args=(buf, child_end, 100, 300))
        child.start()
        child_end.close()
        try:
            assert parent.poll(60), "the writer child never started"
            assert parent.recv() == ("ready", 100)
            child.join(60)
            assert child.exitcode == -signal.SIGKILL, child.exitcode
        finally:
            _stop(child)
            parent.close()
        assert int(buf.committed(0)) == 100 and int(buf.storage.reserved[0]) == 400
        tags = buf.storage.priority_row[100:400].copy()  # (no view outlives the buffer)
        np.testing.assert_array_equal(tags, L.priority_row_tag(np.arange(100, 400)))
        pool.next()  # nothing new is published: nothing enters
        _check_tree(pool, buf, entered)
        _take_over_and_write_plain(buf, entered, 120)  # fewer rows than the dead one claimed
        pool.next()
        _check_tree(pool, buf, entered)  # rows 100..219 at PEAK, not the dead one's priorities
        # and the claimed rows past them name no row either, for the writes still to come
        tags = buf.storage.priority_row[220:400].copy()
        assert not (tags == L.priority_row_tag(np.arange(220, 400))).any()
        assert pool.stats()["actor_priorities_entered"] == 100


@pytest.mark.timeout(120)
def test_a_writer_killed_inside_an_extend_longer_than_the_ring_leaves_no_priority(mp):
    """The dead writer's extend of 150 rows into a ring of 64 stored (and tagged) only its
    last 64, indices 96..159, more than a lap past ``committed`` (10), where the take-over
    trims the claim. A new writer writes indices 10..159 without priorities: each of them
    enters at the maximum, none at the dead writer's priority of the same index."""
    C = 64
    with new_buffer(C) as buf, _pool(buf, 8, selection=Prioritized(alpha=1.0, eps=0.0)) as pool:
        with buf.writer(lane=0) as w:
            w.extend(procs.make_batch(0, np.arange(10)), priorities=np.full(10, 3.0))
        pool.next()  # the maximum is 3 from here on
        parent, child_end = mp.Pipe(duplex=False)
        child = mp.Process(target=die_before_publishing, args=(buf, child_end, 10, 150))
        child.start()
        child_end.close()
        try:
            assert parent.poll(60), "the writer child never started"
            assert parent.recv() == ("ready", 10)
            child.join(60)
            assert child.exitcode == -signal.SIGKILL, child.exitcode
        finally:
            _stop(child)
            parent.close()
        assert int(buf.committed(0)) == 10 and int(buf.storage.reserved[0]) == 160
        tags = buf.storage.priority_row.copy()  # the dead one's: rows 96..159, by slot
        np.testing.assert_array_equal(np.sort(tags), L.priority_row_tag(np.arange(96, 160)))
        with buf.writer(lane=0) as w:
            for first in range(10, 160, 50):
                w.extend(procs.make_batch(0, np.arange(first, first + 50)))
        pool.next()
        assert pool._table.max_priority == 3.0
        np.testing.assert_array_equal(leaves(pool, 0, np.arange(96, 160)), np.full(64, 3.0))
        assert pool.stats()["actor_priorities_entered"] == 10  # rows 0..9, none since


@pytest.mark.timeout(480)
def test_writers_killed_at_random_moments_of_prioritized_extends(mp):
    """Eight times or more: a writer extending with priorities flat out dies at a random moment
    (``extend_with_priorities_until_killed``; SIGKILL if it wrote its whole budget first),
    while the learner syncs every other time; a new writer writes a few rows without
    priorities; after each, the tree holds exactly the priorities of the rows the lane
    publishes (``_check_tree``)."""
    C, budget = 1 << 16, 3000  # 40 MB: twenty children's budgets never lap it
    rng = np.random.default_rng(29)
    entered = np.zeros(C)
    mid_extend = 0  # deaths that left rows claimed but unpublished
    with new_buffer(C, spec=PADDED) as buf, _pool(buf, 16) as pool:
        with buf.writer(lane=0) as w:
            w.add_prioritized(PEAK, **procs.make_row(0, 0), pad=np.zeros(512, np.uint8))
        entered[0] = PEAK
        for it in range(20):  # eight rounds, more until a death lands inside an extend
            if it >= 8 and mid_extend:
                break
            parent, child_end = mp.Pipe(duplex=False)
            child = mp.Process(target=extend_with_priorities_until_killed,
                               args=(buf, child_end, 100 + it, budget))
            child.start()
            child_end.close()
            try:
                assert parent.poll(60), "the writer child never started"
                first = parent.recv()[1]
                deadline = time.monotonic() + 60
                while child.is_alive() and int(buf.committed(0)) < first + budget:
                    if it % 2:
                        pool.next()  # syncs while the child writes
                    else:
                        time.sleep(0.001)
                    assert time.monotonic() < deadline, "the writer child stopped writing"
                child.kill()
                child.join(30)
                assert child.exitcode in (-signal.SIGKILL, -signal.SIGALRM), child.exitcode
            finally:
                _stop(child)
                parent.close()
            committed = int(buf.committed(0))
            mid_extend += int(buf.storage.reserved[0]) > committed
            entered[first:committed] = actor_priority(np.arange(first, committed))
            pool.next()
            _check_tree(pool, buf, entered)
            _take_over_and_write_plain(buf, entered, int(rng.integers(1, 50)))
            pool.next()
            _check_tree(pool, buf, entered)
    print(f"{mid_extend} of the kills landed inside an extend")
    assert mid_extend >= 1, "too few deaths inside an extend for the test to prove anything"


# --------------------------------------------------------------------------------------------
# Clipping, sequences
# --------------------------------------------------------------------------------------------
def test_priorities_too_large_for_the_tree_are_clipped_at_sync_and_counted():
    """alpha 1 over 32 rows: priorities above ``max_allowed`` (about 2.8e306) enter at it,
    counted in ``stats()["actor_priorities_clipped"]``; the sums stay finite."""
    with new_buffer(16, lanes=2) as buf:
        p = np.r_[1.0, 1e307, 1.7e308, 2.0, np.ones(12)]
        with buf.writer(lane=0) as w:
            w.extend(procs.make_batch(0, np.arange(16)), priorities=p)
        with _pool(buf, 8, selection=Prioritized(alpha=1.0, eps=0.0)) as pool:
            pool.next()
            table = pool._table
            assert 1e306 < table.max_allowed < 1e307
            assert pool.stats()["actor_priorities_clipped"] == 2
            np.testing.assert_array_equal(leaves(pool, 0, np.arange(4)),
                                          [1.0, table.max_allowed, table.max_allowed, 2.0])
            assert np.isfinite(table.total()) and table.max_priority == table.max_allowed


def test_a_window_start_enters_at_its_rows_actor_priority():
    """Sequences of 4 over episodes of 13 steps: every start whose window stays in its
    episode enters at the priority given with its row, the others at 0, and draws follow."""
    from tests.test_prioritized_sequences import EPISODE, assert_windows_ok, strict_starts

    n = EPISODE * 8
    p = 1.0 + np.arange(n) % 5
    with new_buffer(256) as buf:
        with buf.writer(lane=0) as w:
            for first in range(0, n, EPISODE):
                index = np.arange(first, first + EPISODE)
                w.extend(procs.make_batch(0, index), priorities=p[index])
                w.end_episode()
        with _pool(buf, 32, selection=Prioritized(alpha=1.0, eps=0.0),
                   plan=Plan(sequence_length=4)) as pool:
            counts = np.zeros(n)
            for _ in range(300):
                batch = pool.next()
                assert_windows_ok(batch, 4)
                np.add.at(counts, np.asarray(batch.indices)[:, 0], 1)
            starts = strict_starts(n, 4)
            expected = np.zeros(n)
            expected[starts] = p[starts]
            np.testing.assert_array_equal(leaves(pool, 0, np.arange(n)), expected)
    assert counts[expected == 0].sum() == 0
    assert chi_square_p(counts[starts], p[starts] / p[starts].sum()) > 1e-3
    assert chi_square_p(counts[starts], np.full(starts.size, 1 / starts.size)) < 1e-6


# --------------------------------------------------------------------------------------------
# Layout and checkpoints
# --------------------------------------------------------------------------------------------
def test_layout_with_and_without_actor_priorities():
    """A buffer without them has the layout (and document) it always had; one with them two
    more columns, seen by every process that attaches; a malformed flag is refused."""
    with procs.new_buffer(capacity=64, lanes=2, rows=0) as plain, new_buffer(64, 2) as prio:
        assert "actor_priorities" not in plain.storage.segment.header.doc
        assert prio.storage.segment.header.doc["actor_priorities"] is True
        fields = field_tuples(procs.SPEC)
        old = L.buffer_layout(fields, 64, 2, len(L.encode_layout(plain.storage.segment.header.doc)),
                              [], plain.storage.layout.episode_capacity)
        assert plain.storage.layout == old and old.priority_columns == ()
        names = [c.name for c in prio.storage.layout.priority_columns]
        assert names == ["_priority", "_priority_row"]
        other = shmbuf.ReplayBuffer.attach(prio.name)
        try:
            assert other.actor_priorities and other.storage.priority.shape == (128,)
        finally:
            other.close()
    doc = {"kind": "buffer", "spec": procs.SPEC.to_json(), "capacity": 8, "lanes": 1,
           "next_obs": "stored", "episode_capacity": 64, "episode_spec": [],
           "actor_priorities": "yes"}
    seg = Segment.create(None, L.KIND_BUFFER, doc, lambda n: L.buffer_layout(
        field_tuples(procs.SPEC), 8, 1, n, [], 64).total_size)
    try:
        with pytest.raises(shmbuf.SegmentFormatError, match="actor_priorities"):
            BufferStorage(seg)
    finally:
        seg.close()


def test_a_restore_leaves_no_stale_actor_priority():
    """``load_state_dict`` of a buffer's own state without its priorities (as one saved
    before checkpoints kept them) rewrites rows 0..9 at the very slots and indices that held
    their priorities, and those rows then enter at the maximum, not at the priorities of
    before."""
    with new_buffer(32) as buf:
        with buf.writer(lane=0) as w:
            w.extend(procs.make_batch(0, np.arange(10)), priorities=np.full(10, 7.0))
        state = buf.state_dict()
        del state["actor_priorities"], state["priorities"]
        assert (buf.storage.priority_row[:10] == np.arange(1, 11)).all()
        buf.load_state_dict(state)
        np.testing.assert_array_equal(buf.windows().hi, [10])
        with _pool(buf, 4, selection=Prioritized(alpha=1.0, eps=0.0)) as pool:
            pool.next()
            np.testing.assert_array_equal(leaves(pool, 0, np.arange(10)), np.ones(10))


# --------------------------------------------------------------------------------------------
# The compiled store and NumPy's store the same bytes
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(__import__("shmbuf.store").store.CompiledStore is None,
                    reason="_add_c was not built")
def test_priorities_store_the_same_bytes_through_the_compiled_and_the_numpy_store(monkeypatch):
    """Single rows and batches (crossing the ring's end, longer than the ring, of a derived
    buffer with its FINAL rows) with and without priorities: the compiled store (the
    prioritized one takes the priority columns as two more columns) and NumPy's leave the
    same rows, priorities, tags, meta words, stamps and claims."""
    from tests.test_add_compiled import segment_bytes, twin_buffers

    spec = shmbuf.Spec(obs=((2, 3), "float32"), action=((), "int64"), reward=((), "float32"))
    rng = np.random.default_rng(7)
    with twin_buffers(spec, monkeypatch, capacity=16, next_obs="derived",
                      actor_priorities=True) as (a, b, wa, wb):

        def same() -> None:
            assert segment_bytes(a) == segment_bytes(b)
            for name in ("priority", "priority_row"):
                assert getattr(a.storage, name).tobytes() == getattr(b.storage, name).tobytes()

        for n in (3, 5, 15, 16, 17, 40, 1, 9):
            batch = {"obs": rng.random((n, 2, 3), np.float32), "action": rng.integers(0, 9, n),
                     "reward": rng.random(n), "next_obs": rng.random((n, 2, 3), np.float32)}
            ps = rng.uniform(0, 3, n) if n % 2 else list(rng.uniform(0, 3, n))
            assert wa.extend(batch, priorities=ps) == wb.extend(batch, priorities=ps)
            same()
            row = {k: v[0] for k, v in batch.items()}
            assert wa.add_prioritized(float(n), **row) == wb.add_prioritized(float(n), **row)
            same()
            assert wa.add(**row) == wb.add(**row)
            same()
            if n == 5:
                assert wa.end_episode() == wb.end_episode()
                same()
        assert wa._prioritized_store.compiled and not wb._prioritized_store.compiled
