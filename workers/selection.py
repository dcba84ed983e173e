"""Selection: which rows a batch holds, behind one interface (the ``sampler=`` of ``SamplerPool``).

Workers draw their own rows for ``UniformSelection`` and ``PrioritizedSelection`` (from a
``PriorityTable`` the learner keeps). ``max_times_sampled=k`` and the queue need every draw
counted exactly once, so for ``CountedSelection`` and ``QueueSelection`` the learner (the single
writer of the counts, the priority table and the queue cursors) picks the rows and writes them
into the staging slot; a worker only gathers them. The pool asks for a batch only when
``min_size`` and ``samples_per_insert`` allow one (``Delivery.may_select``), as workers check
before they draw.

- ``CountedSelection``: draws from a ``PriorityTable`` (uniform: every live row 1.0), counts each
  row's deliveries, and retires a row (priority 0) when it reaches ``k``. A row is never
  selected more than ``k`` times, duplicates within a batch included.
- ``QueueSelection``: every row delivered exactly once, oldest first per lane (lanes taken in
  turn), across learner restarts too. The lanes' consumed cursors in the buffer tell writers
  which rows are safe to overwrite: they wait while a lane holds ``capacity`` rows that no
  learner has released yet (``Limiter.wait_for_insert``).
- ``EpochSelection``: epochs over the rows (or a plan's sequence or frame-stack starts) held
  when each epoch begins, each exactly once per epoch in a seeded random order (offline RL,
  behaviour cloning), the last batch of an epoch short, skipped or carried over.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from shmbuf import ReplayBuffer
from shmbuf.errors import EmptyBufferError, SamplingError
from shmbuf.priority import PriorityTable, table_doc
from shmbuf.sampling import Draw, sumtree
from shmbuf.window_priority import WindowPriorityTable

from .config import PoolConfig

# Rows a learner-side selection chose: (lanes, indices, probabilities or None, smallest
# probability overall[, the batch's ``staging.INFO`` words]).
Rows = (tuple[np.ndarray, np.ndarray, "np.ndarray | None", float]
        | tuple[np.ndarray, np.ndarray, "np.ndarray | None", float, np.ndarray])
SELECT_ROUNDS = 64  # draws CountedSelection makes for one batch before it gives up for now


class Selection:
    """How the rows of each batch are chosen; one instance per pool, in the learner.

    ``learner_selects``: the learner chooses rows (``select``) and workers gather them; else the
    workers draw, in proportion to ``draws_from`` when it is set. ``table``: the priorities
    behind the draws, if any; batches then carry importance weights.

    Concurrency: learner thread only. The learner is the only writer of ``table``; workers
    attach it by name and only read it.
    """

    learner_selects: ClassVar[bool] = False
    prioritized = False  # takes new priorities (``update``)
    rate_limits: ClassVar[bool] = False  # paces writers itself: holds the buffer's limiter lock
    tags_batches: ClassVar[bool] = False  # writes ``staging.INFO`` (epochs, short batches)
    enters_rows: ClassVar[bool] = False  # enter_new_rows does something: call it per batch
    consumes: ClassVar[bool] = False  # released does something: call it per released batch
    table: PriorityTable | None = None

    @property
    def draws_from(self) -> PriorityTable | None:
        """The priority table workers draw from (None: uniform draws, or learner-chosen rows)."""
        return None

    def enter_new_rows(self) -> None:
        """Before a batch: rows committed since enter the table workers draw from."""

    def select(self, batch_size: int, rng: np.random.Generator) -> Rows | None:
        """``batch_size`` rows, or None if that many cannot be chosen now (nothing is spent)."""
        raise NotImplementedError(f"{type(self).__name__}: workers draw their own rows")

    def released(self, lanes: Any, indices: Any) -> None:
        """The learner released a batch of these rows; only where ``consumes``."""

    def stale(self, rows: Rows) -> bool:
        """Rows overwritten before a worker gathered them. True: the next ``select`` replaces
        that batch (its slot keeps its place in delivery order); False: the slot gets a new
        batch and goes to the back."""
        return False

    def update(self, lanes: Any, indices: Any, priorities: Any) -> int:
        """New priorities for delivered rows (``SamplerPool.update_priorities``); only where
        ``prioritized``. Returns how many were applied."""
        raise NotImplementedError(f"{type(self).__name__} keeps no priorities")

    def close(self) -> None:
        """Close the table (the pool's teardown). Idempotent."""
        if self.table is not None:
            self.table.close()


class UniformSelection(Selection):
    """Workers draw uniformly (or per the plan: sequences, frame stacks, n-step)."""


class PrioritizedSelection(Selection):
    """Workers draw in proportion to priorities kept by the learner in a shared ``table``."""

    table: PriorityTable
    prioritized = True
    enters_rows = True

    def __init__(self, buf: ReplayBuffer, table: PriorityTable) -> None:
        self.buf, self.table = buf, table

    @property
    def draws_from(self) -> PriorityTable | None:
        return self.table

    def enter_new_rows(self) -> None:
        self.table.sync(self.buf)  # new rows enter at the maximum priority

    def update(self, lanes: Any, indices: Any, priorities: Any) -> int:
        # An update for a row overwritten since it was sampled is dropped (told by the window);
        # rows committed since the last batch are entered first only if one of the updated
        # rows is among them.
        held = self.table.sync_before_update(self.buf, lanes, indices)
        return self.table.update(lanes, indices, priorities, held=held)


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


class EpochSelection(Selection):
    """Epochs: each one a random permutation (from the pool's seeded selection rng) of the
    anchors the buffer holds when it begins (``ReplayBuffer.anchors``: every transition, or
    with a sequence or frame-stack plan every start the plan may draw), cut into batches that
    workers gather in turn. Each batch is tagged (``staging.INFO``) with its epoch, whether it
    ends it, and its rows when fewer than ``batch_size``.

    The ``N % batch_size`` anchors an epoch ends with (``remainder``, from ``drop_last`` and
    ``carry_remainder``): "short", a last batch of just those rows (PyTorch's
    ``drop_last=False``; the slot is filled up with repeats that the ``Batch`` leaves out);
    "drop", skipped (another random few each epoch); "carry", the first rows of the next batch,
    filled up from the next epoch, so every batch is whole and none is left out (epochs then
    meet inside a batch).

    A batch found overwritten before it was gathered (``stale``) is replaced in its place in
    delivery order by a batch of the same epoch with the same ``ends_epoch``: its anchors still
    usable, topped up from the anchors not yet handed out (those of the epoch being handed out
    now; any in "carry" mode). Where that cannot make a batch ("drop" and "carry" need whole
    ones; "short" one row), its anchors are lost to their epoch and the slot takes a new batch
    at the back: an epoch's last batch may then be missing, and ``epoch()`` ends the epoch at
    the first batch of a later one instead. So batches never go back to an earlier epoch.
    """

    learner_selects = True
    tags_batches = True

    def __init__(self, buf: ReplayBuffer, compiled: Any, remainder: str = "drop") -> None:
        self.buf, self.compiled, self.remainder = buf, compiled, remainder
        self.steps = compiled.index_shape[0] if compiled.index_shape else 0  # sequence length
        self.lanes = np.zeros(0, np.int64)  # this epoch's anchors, in delivery order
        self.anchors = np.zeros(0, np.int64)
        self.cursor = 0  # anchors of this epoch handed out so far
        self.epoch = -1  # the epoch begun last (from 0)
        self.redo: Rows | None = None  # a stale batch's replacement, for the next select

    def _begin_epoch(self, found: Draw, rng: np.random.Generator) -> int:
        """Permute ``found`` (the anchors held now) into a new epoch; returns its size."""
        order = rng.permutation(found.lanes.size)
        self.lanes, self.anchors = found.lanes[order], found.indices[order]
        self.cursor, self.epoch = 0, self.epoch + 1
        return int(order.size)

    def _take(self, n: int) -> Draw:
        at, self.cursor = self.cursor, self.cursor + n
        return Draw(self.lanes[at:self.cursor], self.anchors[at:self.cursor])

    def select(self, batch_size: int, rng: np.random.Generator) -> Rows | None:
        if self.redo is not None:  # the slot of a stale batch: its replacement first
            rows, self.redo = self.redo, None
            return rows
        left, mode = self.lanes.size - self.cursor, self.remainder
        if left >= batch_size:
            after = left - batch_size
            ends = after == 0 or (mode == "drop" and after < batch_size)
            return self._rows(batch_size, [self._take(batch_size)], self.epoch, ends)
        if left and mode == "short":
            return self._rows(batch_size, [self._take(left)], self.epoch, True)
        found = self.buf.anchors(self.compiled)
        if found.lanes.size < (batch_size if mode == "drop" else 1):
            return None  # not a batch's worth (drop_last) or nothing at all: nothing is spent
        parts = [self._take(left)] if left and mode == "carry" else []  # else dropped
        epoch, ends = (self.epoch, True) if parts else (self.epoch + 1, False)
        have = left if parts else 0
        while have < batch_size:  # in "carry" mode an epoch smaller than a batch is begun again
            n = self._begin_epoch(found, rng)
            take = min(batch_size - have, n)
            parts.append(self._take(take))
            have += take
            ends = ends or take == n or (mode == "drop" and n - take < batch_size)
            if mode != "carry":
                break
        return self._rows(batch_size, parts, epoch, ends)

    def _rows(self, batch_size: int, parts: list[Draw], epoch: int, ends: bool) -> Rows:
        """The slot's rows: ``parts`` (filled up with repeats if fewer than ``batch_size``),
        sequences as ``[B, T]`` indices, with the batch's ``INFO`` words."""
        lanes = np.concatenate([p.lanes for p in parts])
        anchors = np.concatenate([p.indices for p in parts])
        n = lanes.size
        if n < batch_size:
            repeat = np.arange(batch_size) % n
            lanes, anchors = lanes[repeat], anchors[repeat]
        indices = anchors[:, None] + np.arange(self.steps) if self.steps else anchors
        info = np.array([n if n < batch_size else 0, epoch + 1, int(ends)], np.int64)
        return lanes, indices, None, 0.0, info

    def stale(self, rows: Rows) -> bool:
        """Anchors of an ungathered batch were overwritten: its replacement for the next
        ``select`` (the class docstring says which), if one can be made."""
        assert len(rows) == 5  # this selection's rows carry their INFO words
        batch_size = rows[0].size
        n, epoch, ends = int(rows[4][0]) or batch_size, int(rows[4][1]) - 1, bool(rows[4][2])
        anchors = rows[1][:n, 0] if self.steps else rows[1][:n]
        still = self.buf.anchors(self.compiled, among=Draw(rows[0][:n], anchors))
        parts = [still]
        mode, have = self.remainder, still.lanes.size
        whole = 1 if mode == "short" else batch_size  # rows a batch needs
        if epoch == self.epoch:  # top up from what is not handed out yet, still usable
            left = self.lanes.size - self.cursor
            while have < batch_size and self.cursor < self.lanes.size:
                more = self.buf.anchors(self.compiled, among=self._take(
                    min(batch_size - have, self.lanes.size - self.cursor)))
                parts.append(more)
                have += more.lanes.size
            # took the last of the epoch before the batch that would have ended it was made
            last = batch_size if mode == "drop" else 1
            ends = ends or left >= last > self.lanes.size - self.cursor
        if have < whole:
            return False  # lost to its epoch: the slot takes a new batch, at the back
        self.redo = self._rows(batch_size, parts, epoch, ends)
        return True


SELECTIONS: dict[str, type[Selection]] = {
    "uniform": UniformSelection, "prioritized": PrioritizedSelection, "queue": QueueSelection,
    "epoch": EpochSelection,
}


def selection_kind(cfg: PoolConfig, compiled: Any) -> type[Selection]:
    """The ``Selection`` class for the pool's settings; raises ``ValueError`` on a combination
    that cannot work. Nothing is created: a pool that takes the limiter lock for the queue
    (``rate_limits``) does so before ``open_selection``."""
    name, k = cfg.selection, cfg.max_times_sampled
    if name == "epoch" and k is not None:
        raise ValueError(f"sampler='epoch' delivers each transition once per epoch; drop "
                         f"max_times_sampled={k}")
    kind = CountedSelection if k is not None and name != "queue" else SELECTIONS[name]
    if kind in (UniformSelection, EpochSelection):
        return kind  # (epochs read any plan: ``ReplayBuffer.anchors``)
    planned = not compiled.plan.is_plain or compiled.derived_next_obs
    if planned and kind is not PrioritizedSelection:
        raise ValueError(
            f"sampler={name!r} and max_times_sampled draw single stored transitions; "
            f"sequence, frame-stack and n-step plans (and derived next_obs) sample uniformly "
            f"or with sampler='prioritized'"
        )
    if kind is QueueSelection:
        if k not in (None, 1):
            raise ValueError("sampler='queue' delivers each transition exactly once; drop "
                             f"max_times_sampled={k}")
        if cfg.limit is not None:
            raise ValueError("sampler='queue' is its own rate limiter (writers wait while the "
                             "queue is full): drop samples_per_insert")
    return kind


def _windowed(compiled: Any) -> bool:
    """Whether a prioritized pool over ``compiled`` keeps one priority per window start
    (sequences, frame stacks, n-step, derived next_obs), in a ``WindowPriorityTable``."""
    return not compiled.plan.is_plain or compiled.derived_next_obs


def table_to_adopt(kind: type[Selection], buf: ReplayBuffer, cfg: PoolConfig,
                   compiled: Any) -> dict[str, Any] | None:
    """The layout document of a dead learner's priority table that ``open_selection`` would
    adopt for this pool (same buffer, alpha, eps and plan), or None if it adopts none."""
    if kind is not PrioritizedSelection:
        return None
    plan = WindowPriorityTable.plan_doc(compiled, cfg.priority_eta) if _windowed(compiled) \
        else None
    return table_doc(buf, cfg.alpha, cfg.eps, plan=plan)


def open_selection(kind: type[Selection], buf: ReplayBuffer, cfg: PoolConfig,
                   compiled: Any = None) -> Selection:
    """Create the selection ``selection_kind`` chose, with its priority table if it has one.
    ``compiled``: the pool's compiled plan (epochs hand out its starts)."""
    if kind is UniformSelection:
        return UniformSelection()
    if kind is QueueSelection:
        return QueueSelection(buf)
    if kind is EpochSelection:
        return EpochSelection(buf, compiled or buf.compile(cfg.plan, cfg.fields),
                              cfg.epoch_remainder)
    compiled = compiled or buf.compile(cfg.plan, cfg.fields)  # the pool's own (cached)
    # A prioritized pool takes over the table of a dead learner of the same buffer, alpha and
    # plan, if one was left (its priorities survive a learner restart); a counted pool's counts
    # died with its learner, so it starts a table of its own.
    if kind is PrioritizedSelection and _windowed(compiled):
        # one priority per window start (sequences, frame stacks, n-step, derived next_obs)
        table: PriorityTable = WindowPriorityTable.create_for(
            buf, compiled, cfg.alpha, cfg.eps, cfg.priority_eta, adopt=True)
    else:
        table = PriorityTable.create(buf, cfg.alpha, cfg.eps, adopt=kind is PrioritizedSelection,
                                     counted=kind is CountedSelection)
    try:
        if kind is PrioritizedSelection:
            return PrioritizedSelection(buf, table)
        assert cfg.max_times_sampled is not None
        return CountedSelection(buf, table, cfg.max_times_sampled,
                                uniform=cfg.selection == "uniform")
    except BaseException:
        table.close()
        raise
