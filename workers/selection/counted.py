"""``Counted(k)``: every row delivered at most ``k`` times in all, then retired. The learner
selects the rows (it is the single writer of the counts) and workers gather them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmbuf import ReplayBuffer
from shmbuf.errors import EmptyBufferError, SamplingError
from shmbuf.limiter import RateLimit
from shmbuf.priority import PriorityTable
from shmbuf.sampling import sumtree

from .base import Rows, Selection, SelectionSpec, refuse_plans
from .prioritized import Prioritized
from .uniform import Uniform

SELECT_ROUNDS = 64  # draws CountedSelection makes for one batch before it gives up for now


@dataclass(frozen=True)
class Counted(SelectionSpec):
    """Rows drawn as ``of`` draws them (``Uniform()`` or ``Prioritized(...)``), each delivered
    at most ``k`` times, duplicates within a batch included; a row that reached ``k`` is never
    drawn again. The counts live in the learner's memory: a restarted learner counts from zero.

    Example:
        >>> SamplerPool(buf, 256, selection=Counted(4, Prioritized(alpha=0.6)))
    """

    k: int
    of: Uniform | Prioritized = field(default_factory=Uniform)

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, (int, np.integer)) or self.k < 1:
            raise ValueError(f"Counted(k={self.k!r}): k must be a positive int (how many times "
                             f"a row may be delivered)")
        if not isinstance(self.of, (Uniform, Prioritized)):
            raise TypeError(f"Counted(of={self.of!r}): counts rows drawn by Uniform() or "
                            f"Prioritized(...)")

    def check(self, compiled: Any, limit: RateLimit | None) -> None:
        refuse_plans(f"Counted({self.k})", compiled)

    def beta_at(self, step: int) -> float:
        return self.of.beta_at(step)

    def open(self, buf: ReplayBuffer, compiled: Any) -> Selection:
        spec = self.of if isinstance(self.of, Prioritized) else Prioritized()
        table = spec.open_table(buf, compiled, counted=True)
        try:
            return CountedSelection(buf, table, int(self.k), uniform=isinstance(self.of, Uniform))
        except BaseException:
            table.close()
            raise


def _rank_among_equal(values: np.ndarray) -> np.ndarray:
    """For each position, how many earlier positions hold the same value."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.r_[True, ordered[1:] != ordered[:-1]] if ordered.size else np.zeros(0, bool)
    position = np.arange(ordered.size)
    run_start = np.maximum.accumulate(np.where(starts, position, 0))
    rank = np.empty(ordered.size, np.int64)
    rank[order] = position - run_start
    return rank


def _uses(chosen: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """How often each of ``slots`` occurs in the sorted array ``chosen``."""
    return np.searchsorted(chosen, slots, "right") - np.searchsorted(chosen, slots, "left")


class CountedSelection(Selection):
    """Rows drawn from ``table`` (proportionally), each at most ``k`` times in all."""

    learner_selects = True
    table: PriorityTable

    def __init__(self, buf: ReplayBuffer, table: PriorityTable, k: int, uniform: bool) -> None:
        self.buf, self.table, self.max_times = buf, table, int(k)
        self.prioritized = not uniform
        self.initial = None if self.prioritized else 1.0  # priority of a new row
        self.counts = np.zeros(buf.lanes * buf.capacity, np.int32)  # this process's own memory

    def sync(self) -> None:
        """Enter new rows into the table and reset their slots' counts."""
        table = self.table
        before = table.synced.copy()
        if table.sync(self.buf, self.initial):
            capacity = self.buf.capacity
            for lane in np.flatnonzero(table.synced > before):
                first = max(int(before[lane]), int(table.synced[lane]) - capacity)
                slots = np.arange(first, table.synced[lane]) % capacity
                self.counts[lane * capacity + slots] = 0

    def select(self, batch_size: int, rng: np.random.Generator) -> Rows | None:
        self.sync()
        table, capacity, k = self.table, self.buf.capacity, self.max_times
        taken_lanes, taken_indices, taken_probs = [], [], []
        chosen = np.zeros(0, np.int64)  # slots chosen so far in this batch, sorted
        parked = []  # (lanes, leaves, values) zeroed while choosing; restored on failure
        pmin = 1.0
        need = batch_size
        try:
            for _ in range(SELECT_ROUNDS):
                draw = table.draw(self.buf.windows(), need, rng)
                assert draw.probs is not None  # a table's draws carry their probabilities
                slots = draw.lanes * capacity + draw.indices % capacity
                ok = self.counts[slots] + _uses(chosen, slots) + _rank_among_equal(slots) < k
                chosen = np.sort(np.concatenate([chosen, slots[ok]]))
                # Rows that reach k now: park them so the next rounds cannot draw them again.
                done = np.unique(slots[ok])
                full = done[self.counts[done] + _uses(chosen, done) >= k]
                if full.size:
                    lane, leaf = full // capacity, full % capacity
                    parked.append((lane, leaf, table.sums[lane, leaf].copy()))
                    sumtree.update(table.sums, table.mins, lane, leaf, np.zeros(full.size))
                taken_lanes.append(draw.lanes[ok])
                taken_indices.append(draw.indices[ok])
                taken_probs.append(draw.probs[ok])
                pmin = min(pmin, draw.pmin)
                need -= int(ok.sum())
                if need == 0:
                    lanes, indices = np.concatenate(taken_lanes), np.concatenate(taken_indices)
                    np.add.at(self.counts, lanes * capacity + indices % capacity, 1)
                    return lanes, indices, np.concatenate(taken_probs), pmin
        except (EmptyBufferError, SamplingError):
            # (SamplingError: writers lapped the rows entered at this select's sync, e.g. while
            # the learner was descheduled; the next select syncs again)
            pass
        for lane, leaf, values in reversed(parked):  # nothing was spent: undo the parking
            sumtree.update(table.sums, table.mins, lane, leaf, values)
        return None

    def update(self, lanes: Any, indices: Any, priorities: Any) -> int:
        """``PriorityTable.update`` (checks included), after which the rows already delivered
        ``k`` times are set back to zero: a new priority must not bring a retired row back."""
        self.sync()  # as PrioritizedSelection.update: rows overwritten since are recognised
        applied = self.table.update(lanes, indices, priorities)
        capacity = self.buf.capacity
        index = np.asarray(indices, np.int64).reshape(-1)
        lane = np.broadcast_to(np.asarray(lanes, np.int64), index.shape).reshape(-1)
        done = self.counts[lane * capacity + index % capacity] >= self.max_times
        if done.any():  # rows overwritten since they were sampled are left alone
            self.table.retire(lane[done], index[done])
        return applied

    def stale(self, rows: Rows) -> bool:
        """Rows overwritten before a worker gathered them: their draws are not spent."""
        lanes, indices = rows[0], rows[1]
        slots = lanes * self.buf.capacity + indices % self.buf.capacity
        # A slot whose new row was entered meanwhile (sync) holds that row's fresh count: the
        # stale draws were not of it, so they give it nothing back.
        same = self.table.gen[slots] == indices
        np.subtract.at(self.counts, slots[same], 1)
        return False


