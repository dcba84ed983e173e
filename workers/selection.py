"""Learner-side selection: which rows a batch holds, decided centrally when it must be exact.

``max_times_sampled=k`` and queue mode need every draw counted exactly once, so the learner
(the single writer of the counts, the priority table and the queue cursors) picks the rows and
writes them into the staging slot; a worker only gathers them. Plain uniform and prioritized
sampling need no such bookkeeping and stay entirely in the workers. The pool asks for a batch
only when ``min_size`` and ``samples_per_insert`` allow one (``Delivery.may_select``, through
``Limiter.can_sample``), as workers check before they draw.

- ``CountedSelection``: draws from a ``PriorityTable`` (uniform: every live row 1.0), counts each
  row's deliveries, and retires a row (priority 0) when it reaches ``k``. A row is never
  selected more than ``k`` times, duplicates within a batch included.
- ``QueueSelection``: every row delivered exactly once, oldest first per lane (lanes taken in
  turn). The lane word ``released`` tells writers which rows are safe to overwrite: they wait
  while a lane holds ``capacity`` rows not yet gathered (``Limiter.wait_for_insert``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmbuf import layout as L
from shmbuf.errors import EmptyBufferError
from shmbuf.priority import PriorityTable
from shmbuf.sampling import sumtree

Rows = tuple[np.ndarray, np.ndarray, "np.ndarray | None", float]  # lanes, indices, probs, pmin


def _rank_among_equal(values: np.ndarray) -> np.ndarray:
    """For each position, how many earlier positions hold the same value."""
    order = np.argsort(values, kind="stable")
    v = values[order]
    starts = np.r_[True, v[1:] != v[:-1]] if v.size else np.zeros(0, bool)
    pos = np.arange(v.size)
    run_start = np.maximum.accumulate(np.where(starts, pos, 0))
    rank = np.empty(v.size, np.int64)
    rank[order] = pos - run_start
    return rank


class CountedSelection:
    """Rows drawn from ``table`` (proportionally), each at most ``k`` times in all."""

    def __init__(self, buf: Any, table: PriorityTable, k: int, uniform: bool) -> None:
        self.buf, self.table, self.k = buf, table, int(k)
        self.initial = 1.0 if uniform else None
        self.counts = np.zeros(buf.lanes * buf.capacity, np.int32)  # this process's own memory
        self.rounds = 64

    def sync(self) -> None:
        t = self.table
        before = t.synced.copy()
        if t.sync(self.buf, self.initial):
            C = self.buf.capacity
            for k in np.flatnonzero(t.synced > before):  # reset counts of newly entered rows
                first = max(int(before[k]), int(t.synced[k]) - C)
                idx = np.arange(first, t.synced[k]) % C
                self.counts[k * C + idx] = 0

    def select(self, batch: int, rng: np.random.Generator) -> Rows | None:
        """``batch`` rows, or None if fewer than that can be drawn now (nothing is spent)."""
        self.sync()
        t, C, k = self.table, self.buf.capacity, self.k
        P = t.sums.shape[1] // 2
        taken_l, taken_i, taken_p = [], [], []
        chosen = np.zeros(0, np.int64)  # slots chosen so far in this batch, sorted
        parked = []  # (lanes, leaves, values) zeroed while choosing; restored on failure
        pmin = 1.0
        need = batch
        try:
            for _ in range(self.rounds):
                draw = t.draw(self.buf.windows(), need, rng)
                slots = draw.lanes * C + draw.indices % C
                before = (np.searchsorted(chosen, slots, "right")
                          - np.searchsorted(chosen, slots, "left"))
                ok = self.counts[slots] + before + _rank_among_equal(slots) < k
                chosen = np.sort(np.concatenate([chosen, slots[ok]]))
                # Rows that reach k now: park them so the next rounds cannot draw them again.
                done = np.unique(slots[ok])
                uses = (np.searchsorted(chosen, done, "right")
                        - np.searchsorted(chosen, done, "left"))
                full = done[self.counts[done] + uses >= k]
                if full.size:
                    ln, leaf = full // C, full % C
                    parked.append((ln, leaf, t.sums[ln, P + leaf].copy()))
                    sumtree.update(t.sums, t.mins, ln, leaf, np.zeros(full.size))
                taken_l.append(draw.lanes[ok])
                taken_i.append(draw.indices[ok])
                taken_p.append(draw.probs[ok])
                pmin = min(pmin, draw.pmin)
                need -= int(ok.sum())
                if need == 0:
                    lanes, indices = np.concatenate(taken_l), np.concatenate(taken_i)
                    np.add.at(self.counts, lanes * C + indices % C, 1)
                    return lanes, indices, np.concatenate(taken_p), pmin
        except EmptyBufferError:
            pass
        for ln, leaf, values in reversed(parked):  # nothing was spent: undo the parking
            sumtree.update(t.sums, t.mins, ln, leaf, values)
        return None

    def update(self, lanes: Any, indices: Any, priorities: Any) -> int:
        """``PriorityTable.update`` (checks included), after which the rows already delivered
        ``k`` times are set back to zero: a new priority must not bring a retired row back."""
        applied = self.table.update(lanes, indices, priorities)
        C = self.buf.capacity
        idx = np.asarray(indices, np.int64).reshape(-1)
        ln = np.broadcast_to(np.asarray(lanes, np.int64), idx.shape).reshape(-1)
        slots = ln * C + idx % C
        done = (self.counts[slots] >= self.k) & (self.table.gen[slots] == idx)
        if done.any():
            sumtree.update(self.table.sums, self.table.mins, ln[done], idx[done] % C,
                           np.zeros(int(done.sum())))
        return applied

    def gathered(self, slot: int) -> None:
        pass

    def stale(self, rows: Rows) -> None:
        """Rows overwritten before a worker gathered them: their draws are not spent."""
        lanes, indices = rows[0], rows[1]
        slots = lanes * self.buf.capacity + indices % self.buf.capacity
        # A slot whose new row was entered meanwhile (sync) holds that row's fresh count: the
        # stale draws were not of it, so they give it nothing back.
        same = self.table.gen[slots] == indices
        np.subtract.at(self.counts, slots[same], 1)

    def close(self) -> None:
        pass


class QueueSelection:
    """Each row exactly once, oldest first within a lane; writers wait when a lane is full."""

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.assigned = buf.windows().lo.copy()  # next row to hand out, per lane
        self.inflight: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # slot -> rows
        self.turn = 0
        self.lost = 0
        self._released = buf.storage.lane_words[:, L.LANE_RELEASED, 0]
        self._released[...] = self.assigned
        buf.storage.limiter.set_queue(True)

    def select(self, batch: int, rng: np.random.Generator) -> Rows | None:
        committed = self.buf.committed()
        pending = committed - self.assigned
        if pending.sum() < batch:
            return None
        lanes, indices = [], []
        left = batch
        L_ = self.buf.lanes
        for j in range(L_):  # lanes in turn, each lane's oldest rows first
            k = (self.turn + j) % L_
            take = int(min(pending[k], left))
            if take:
                indices.append(np.arange(self.assigned[k], self.assigned[k] + take))
                lanes.append(np.full(take, k, np.int64))
                self.assigned[k] += take
                left -= take
            if not left:
                break
        self.turn = (self.turn + 1) % L_
        return np.concatenate(lanes), np.concatenate(indices), None, 0.0

    def track(self, slot: int, rows: Rows) -> None:
        self.inflight[slot] = (rows[0], rows[1])

    def gathered(self, slot: int) -> None:
        """The slot's rows are in staging now: writers may overwrite them."""
        self.inflight.pop(slot, None)
        low = self.assigned.copy()
        for lanes, indices in self.inflight.values():
            np.minimum.at(low, lanes, indices)
        self._released[...] = low

    def stale(self, rows: Rows) -> None:
        # Only possible for rows written over just as queue mode began.
        self.lost += int(rows[0].size)

    def close(self) -> None:
        self.buf.storage.limiter.set_queue(False)
