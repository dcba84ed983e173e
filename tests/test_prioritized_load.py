"""Prioritized replay under writers in other processes that lap the ring while the learner
samples and updates in-process: the learner never raises, every batch is whole, updates of
rows overwritten since are dropped, and entering new rows costs slices, not a per-row walk.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

import shmbuf
from shmbuf.priority import PriorityTable
from shmbuf.sampling import sumtree
from tests import pool_procs as procs
from workers import ActorGroup, SamplerPool
from workers.selection import Counted, Prioritized, Uniform

pytestmark = pytest.mark.timeout(180)


def test_the_learner_never_raises_while_writers_lap_the_ring(start_method):
    """Two writer processes add 32-row chunks flat out into small lanes (each laps its 512 rows
    many times a second) while the learner takes batches and sends new priorities: no
    exception, every row whole, and some updates dropped (their rows moved on)."""
    with procs.new_buffer(capacity=512, lanes=2) as buf, \
         ActorGroup(functools.partial(procs.lane_writer, chunk=32), 2, buf,
                    start_method=start_method) as group, \
         SamplerPool(buf, selection=Prioritized(), workers=0, batch_size=64, seed=0,
                     timeout=30) as pool:
        start = buf.committed().copy()
        deadline = time.monotonic() + 30
        while (buf.committed() - start < 4 * 512).any():  # both writers lapping
            assert time.monotonic() < deadline, "writers did not start"
            group.poll()
            time.sleep(0.01)
        rng = np.random.default_rng(0)
        applied = sent = 0
        t_end = time.monotonic() + 3.0
        batches = 0
        while time.monotonic() < t_end or batches < 50:
            batch = pool.next(timeout=30)
            procs.assert_batch_ok(batch, 64)
            applied += pool.update_priorities(batch.indices, rng.exponential(1.0, 64))
            sent += 64
            batches += 1
        lapped = buf.committed() - start
        group.stop(timeout=10)
    assert (lapped > 8 * 512).all(), lapped
    assert 0 < applied <= sent


@pytest.mark.parametrize("of", [Uniform(), Prioritized()], ids=["uniform", "prioritized"])
def test_a_counted_pool_whose_rows_are_lapped_right_after_its_sync_selects_again(
        monkeypatch, of):
    """``Counted(2, of)``: a writer laps the whole lane between the learner's table sync and
    its draw (as when the learner is descheduled or SIGSTOPped there, which the chaos stress
    found): every entered row moved on. ``next()`` syncs again and delivers a batch of rows
    the buffer holds; it used to raise ``SamplingError``."""
    from workers import selection

    sync = selection.CountedSelection.sync
    with procs.new_buffer(capacity=64, lanes=1) as buf, buf.writer(lane=0) as w, \
         SamplerPool(buf, batch_size=16, selection=Counted(2, of), workers=0, seed=0) as pool:
        lapped = []

        def sync_then_lap(self) -> None:
            sync(self)
            if not lapped:  # once: the writer laps the lane before the draw
                w.extend(procs.make_batch(0, np.arange(w.committed, w.committed + 64)))
                lapped.append(w.committed)
        monkeypatch.setattr(selection.CountedSelection, "sync", sync_then_lap)
        batch = pool.next(timeout=10)
        procs.assert_batch_ok(batch, 16)
        assert lapped and (np.asarray(batch.indices) >= lapped[0] - 64).all()


def test_sync_enters_a_lapped_lane_as_slices_with_the_generations_of_the_rows_held():
    """A lane that wrote 10x its capacity since the last sync: ``sync`` enters exactly the rows
    held (one or two runs of slots), at the maximum priority, with their generations; the trees
    equal a full rebuild, and entering them is not a walk over every row written."""
    with procs.new_buffer(capacity=1000, lanes=2, rows=10) as buf:
        table = PriorityTable.create(buf, alpha=1.0, eps=0.0)
        try:
            table.sync(buf)
            table.update(np.zeros(10, np.int64), np.arange(10), np.full(10, 5.0))
            procs.fill(buf, 10_337, lanes=[0])  # laps lane 0 ten times, ends mid-ring
            entered = table.sync(buf)
            assert entered == 1000  # the rows held now, not the 10,337 written
            w = buf.windows()
            held = np.arange(w.lo[0], w.hi[0])
            np.testing.assert_array_equal(table.gen[held % 1000], held)
            np.testing.assert_array_equal(table.leaf_values(np.zeros(1000, np.int64), held), 5.0)
            np.testing.assert_array_equal(table.sums[1, :10], 1.0)  # lane 1 untouched
            sums, mins = table.sums.copy(), table.mins.copy()
            sumtree.rebuild(sums, mins)
            np.testing.assert_array_equal(sums, table.sums)
            np.testing.assert_array_equal(mins, table.mins)
            # An update for a row overwritten since it was drawn is dropped.
            assert table.update(np.zeros(1, np.int64), np.array([3]), np.array([9.0])) == 0
        finally:
            table.close()


def test_a_leaf_whose_row_moved_on_delivers_the_slots_occupant_with_the_leafs_probability():
    """Rows overwritten after the last sync: ``draw`` redraws their leaves (it never returns
    them), ``draw_held`` delivers each slot's current occupant with the probability its leaf
    was drawn with (the old row's value / total), so the importance weight is exact for how it
    was drawn. The learner's update for such a row applies once sync has entered it."""
    with procs.new_buffer(capacity=16, lanes=1) as buf:
        table = PriorityTable.create(buf, alpha=1.0, eps=0.0)
        try:
            table.sync(buf)
            old = np.arange(16)
            table.update(np.zeros(16, np.int64), old, np.where(old < 8, 1.0, 3.0))
            procs.fill(buf, 8)  # rows 16..23 overwrite rows 0..7; the table still has 0..7
            rng = np.random.default_rng(0)
            exact = table.draw(buf.windows(), 4000, rng)
            assert (exact.indices >= 8).all() and (exact.indices < 16).all()
            held = table.draw_held(buf.windows(), 4000, rng)
            assert held.probs is not None
            assert ((held.indices >= 8) & (held.indices < 24)).all()
            moved = held.indices >= 16
            assert 0.1 < moved.mean() < 0.4  # the old leaves' share: 8 / (8 + 24)
            np.testing.assert_array_equal(held.probs, np.where(moved, 1.0, 3.0) / 32.0)
            assert held.pmin == 1.0 / 32.0
            assert table.update(np.zeros(1, np.int64), np.array([20]), np.array([2.0])) == 0
            table.sync(buf)  # row 20 enters, then its update applies
            assert table.update(np.zeros(1, np.int64), np.array([20]), np.array([2.0])) == 1
            np.testing.assert_array_equal(table.leaf_values(np.zeros(1, np.int64), np.array([20])), 2.0)
        finally:
            table.close()


def test_draw_held_redraws_in_a_buffer_that_stores_final_rows():
    """With derived next_obs a slot's occupant may be an episode's FINAL row (not a
    transition): there ``draw_held`` redraws moved leaves as ``draw`` does."""
    spec = shmbuf.Spec({"obs": ((2,), "float32")})
    with shmbuf.ReplayBuffer.create(spec, capacity=16, lanes=1, next_obs="derived") as buf:
        obs = np.zeros((7, 2), np.float32)
        with buf.writer(lane=0) as w:
            w.extend({"obs": obs, "next_obs": obs + 1})
            w.end_episode(truncated=False)  # a FINAL row after the 7 transitions
        table = PriorityTable.create(buf)
        try:
            assert table.final_rows
            table.sync(buf)
            with buf.writer(lane=0) as w:  # laps the ring: the rows the table knows are gone
                for _ in range(3):
                    w.extend({"obs": obs, "next_obs": obs + 1})
                    w.end_episode(truncated=False)
            with pytest.raises(shmbuf.SamplingError):
                table.draw_held(buf.windows(), 8, np.random.default_rng(0))
        finally:
            table.close()


@pytest.mark.parametrize("lanes", [1, 2])
def test_an_update_syncs_only_when_a_row_it_sets_is_not_entered(lanes):
    """``update_priorities`` enters new rows first only when it must (a row it sets is not
    entered yet): rows entered and still held are updated without entering the writers' new
    rows (nothing of theirs changes); a row overwritten since it was drawn is told by the
    window and its update dropped, with nothing entered either."""
    with procs.new_buffer(capacity=100, lanes=lanes, rows=60) as buf, \
         SamplerPool(buf, selection=Prioritized(), workers=0, batch_size=8, seed=0,
                     timeout=10) as pool:
        table = pool._table
        assert table is not None
        batch = pool.next()
        indices, batch_lanes = np.array(batch.indices), np.array(batch.lanes)
        procs.fill(buf, 10)  # new rows, none overwriting the batch's
        synced = table.synced.copy()
        assert pool.update_priorities(indices, np.full(8, 2.0), lanes=batch_lanes) == 8
        np.testing.assert_array_equal(table.synced, synced)  # no sync was needed
        np.testing.assert_array_equal(table.leaf_values(batch_lanes, indices),
                                      table._value(np.full(8, 2.0)))
        procs.fill(buf, 100)  # laps every lane: the batch's rows are gone
        dropped, leaves = table.updates_dropped, table.sums.copy()
        assert pool.update_priorities(indices, np.full(8, 3.0), lanes=batch_lanes) == 0
        assert table.updates_dropped == dropped + 8
        # told by the window, without entering the new rows: nothing in the table changed
        np.testing.assert_array_equal(table.synced, synced)
        np.testing.assert_array_equal(table.sums, leaves)
        pool.next()  # enters them
        np.testing.assert_array_equal(table.synced, buf.committed())
        # A row committed but not entered yet is entered by the update's sync, then set.
        procs.fill(buf, 1)
        newest = np.asarray(buf.committed()) - 1
        assert pool.update_priorities(newest, np.full(lanes, 4.0),
                                      lanes=np.arange(lanes)) == lanes
        np.testing.assert_array_equal(table.leaf_values(np.arange(lanes), newest),
                                      table._value(np.full(lanes, 4.0)))
