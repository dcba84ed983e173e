"""``Queue()``: every row delivered exactly once, oldest first per lane, across learner restarts
too; writers wait while a lane is full. The learner selects the rows and workers gather them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shmbuf import ReplayBuffer
from shmbuf.limiter import RateLimit

from .base import Rows, Selection, SelectionSpec, refuse_plans


@dataclass(frozen=True)
class Queue(SelectionSpec):
    """A FIFO over each lane (lanes taken in turn): each transition delivered exactly once, and
    writers wait while a lane holds ``capacity`` rows no learner has released yet. It is its own
    rate limiter (no ``samples_per_insert``). A queue pool opened on a buffer resumes where the
    last one stopped (the consumed cursors live in the buffer).

    Example:
        >>> SamplerPool(buf, 256, selection=Queue())
    """

    ordered = True
    paces_writers = True

    def check(self, compiled: Any, limit: RateLimit | None) -> None:
        refuse_plans("Queue()", compiled)
        if limit is not None:
            raise ValueError(
                "Queue() is its own rate limiter (writers wait while the queue is full): pass "
                "limit=RateLimit(min_size=...) without samples_per_insert")

    def open(self, buf: ReplayBuffer, compiled: Any) -> Selection:
        return QueueSelection(buf)


class QueueSelection(Selection):
    """Each row exactly once, oldest first within a lane; writers wait when a lane is full.

    The lanes' consumed cursors live in the buffer (``Limiter.open_queue``/``consume``): a row
    is consumed when the learner releases its batch (its next ``next()``, ``release()``, or a
    clean ``close()``), and writers wait on the cursors, so a row is never overwritten before a
    learner has finished with it. A new queue pool on the buffer resumes after them: rows staged
    but never released are gathered again, nothing released comes again (the one batch a
    learner held when it was killed does: at least once for that batch).
    """

    learner_selects = True
    rate_limits = True
    consumes = True

    def __init__(self, buf: ReplayBuffer) -> None:
        self.buf = buf
        self.limiter = buf.storage.limiter
        self.assigned = self.limiter.open_queue()  # next row to hand out, per lane
        self.turn = 0

    def select(self, batch_size: int, rng: np.random.Generator) -> Rows | None:
        pending = self.buf.storage.committed - self.assigned
        if pending.sum() < batch_size:
            return None
        lanes, indices = [], []
        left = batch_size
        n_lanes = self.buf.lanes
        for j in range(n_lanes):  # lanes in turn, each lane's oldest rows first
            lane = (self.turn + j) % n_lanes
            take = int(min(pending[lane], left))
            if take:
                indices.append(np.arange(self.assigned[lane], self.assigned[lane] + take))
                lanes.append(np.full(take, lane, np.int64))
                self.assigned[lane] += take
                left -= take
            if not left:
                break
        self.turn = (self.turn + 1) % n_lanes
        return np.concatenate(lanes), np.concatenate(indices), None, 0.0

    def released(self, lanes: Any, indices: Any) -> None:
        """The learner is done with a batch of these rows: writers may overwrite them."""
        if not self.buf.closed:
            self.limiter.consume(lanes, indices)

    def stale(self, rows: Rows) -> bool:
        """Only possible for rows written over just as queue mode began: they are lost."""
        return False

    def close(self) -> None:
        if not self.buf.closed:
            self.limiter.close_queue()


