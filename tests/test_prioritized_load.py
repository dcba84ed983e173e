"""Prioritized replay under writers in other processes that lap the ring while the learner
samples and updates in-process: the learner never raises, every batch is whole, updates of
rows overwritten since are dropped, and entering new rows costs slices, not a per-row walk.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

from shmbuf.priority import PriorityTable
from shmbuf.sampling import sumtree
from tests import pool_procs as procs
from workers import ActorGroup, SamplerPool

pytestmark = pytest.mark.timeout(180)


def test_the_learner_never_raises_while_writers_lap_the_ring(start_method):
    """Two writer processes add 32-row chunks flat out into small lanes (each laps its 512 rows
    many times a second) while the learner takes batches and sends new priorities: no
    exception, every row whole, and some updates dropped (their rows moved on)."""
    with procs.new_buffer(capacity=512, lanes=2) as buf, \
         ActorGroup(functools.partial(procs.lane_writer, chunk=32), 2, buf,
                    start_method=start_method) as group, \
         SamplerPool(buf, n_workers=0, batch_size=64, sampler="prioritized", seed=0,
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
