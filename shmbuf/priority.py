"""``PriorityTable``: proportional priorities for a buffer's rows, in shared memory.

Per lane, a float64 sum tree and min tree over the lane's ``capacity`` slots (``sumtree``: wide
fan-out, leaf j at column j, the root last), and per slot the *generation* its priority belongs
to (the logical index of the row it was set for, -1 for none). Layout after the common header
page: ``sums [lanes, W]``, ``mins [lanes, W]`` (f8), ``gen [lanes * capacity]`` (i8), each
64-byte aligned (W = ``sumtree.tree_width(capacity)``).

Concurrency: the process that creates the table (the learner) is the only writer of every word:
it enters new rows at the running maximum priority (``sync``: per lane one or two contiguous
runs, set with slices, so its cost is bounded by the capacity whatever the write rate), or at
the priority their writer gave with them (actor priorities, below), applies ``update`` and
``retire``. Sampler workers ``attach`` and only read: they descend the trees
without locks; a leaf changed under a reader (a zero leaf reached) is redrawn, and every row
delivered has its stamp checked as for any read, so its data is whole. Writers (actors) never
touch the table: a dead actor or worker cannot leave it inconsistent, and nobody waits.

Rows that moved on: a leaf's generation may name a row the buffer no longer holds (writers
overwrote it after the learner's last ``sync``). ``draw`` redraws such leaves. ``draw_held``
(the pool's draws) delivers the slot's *current* occupant instead, with the probability the
leaf was drawn with (leaf value / total): the importance weight is exact for how the row was
drawn, however fast the writers go, and nobody waits for the learner to catch up. The learner's
``update`` for that row applies once ``sync`` has entered it (``update_priorities`` syncs
first); updates for rows overwritten since they were delivered are dropped (generation check).
Only a slot being written at that moment is redrawn. A buffer that stores FINAL rows (derived
``next_obs``: episode-end observations, entered at 0, never transitions) keeps ``draw``'s
redraws, since a slot's occupant could be one.

Actor priorities (Ape-X; a buffer created with ``actor_priorities=True``): a writer may give a
priority with each row (``extend(rows, priorities=ps)``), stored in the row's slot under its
stamps. ``sync`` reads them for the rows it enters, checking the stamps around the copy and the
slot's row tag (``layout.priority_row_tag``), and enters those rows at ``(p + eps) ** alpha`` as
``update`` would (raising the maximum priority likewise); a priority above ``max_allowed`` is
clipped to it and counted (``actor_priorities_clipped``). Rows without one, or whose slot was
rewritten before the sync could read it, enter at the maximum. The writers still never touch the
table: the learner stays its one writer.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from . import layout
from .errors import (
    ClosedError,
    EmptyBufferError,
    InvalidPriorityError,
    SamplingError,
    SegmentExistsError,
    SegmentFormatError,
    SegmentNotFoundError,
)
from .sampling import Draw, Windows, sumtree
from .scan import scan
from .segment import Segment
from .slots import checked_gather

if TYPE_CHECKING:
    from .buffer import ReplayBuffer

DRAW_ROUNDS = 64


class _TableLayout(NamedTuple):
    """Byte offsets of a priority segment's arrays, and its total size."""

    width: int  # columns of one lane's tree
    sums: int
    mins: int
    generations: int
    learner: int  # the learner's words: synced [lanes], judged [lanes], max priority (f8)
    usable: int  # window tables: per slot, whether its start was judged usable (u1)
    total: int


def _table_layout(lanes: int, capacity: int, json_len: int, windows: bool) -> _TableLayout:
    width = sumtree.tree_width(capacity)
    sums = layout.header_size(json_len)
    mins = layout.align(sums + lanes * width * 8)
    generations = layout.align(mins + lanes * width * 8)
    learner = layout.align(generations + lanes * capacity * 8)
    usable = layout.align(learner + (2 * lanes + 1) * 8)
    end = usable + (lanes * capacity if windows else 0)
    return _TableLayout(width, sums, mins, generations, learner, usable,
                        layout.align(end, layout.PAGE))


def table_doc(buf: ReplayBuffer, alpha: float, eps: float, *, counted: bool = False,
              plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """The layout document of a priority table of ``buf`` (as its header will read it back):
    a dead learner's table whose document equals a new pool's is that pool's to adopt."""
    doc = {"kind": "priorities", "buffer": buf.name, "lanes": buf.lanes,
           "capacity": buf.capacity, "alpha": float(alpha), "eps": float(eps),
           "final_rows": bool(buf.storage.derived_next_obs), "counted": bool(counted),
           "plan": plan}
    decoded: dict[str, Any] = json.loads(layout.encode_layout(doc))
    return decoded


class PriorityTable:
    """Priorities of one buffer's rows. ``create`` in the learner, ``attach`` in workers.

    Priorities are stored as ``(p + eps) ** alpha``; draws are proportional to them. Every sum
    stays finite: a stored value is at most ``float64 max / (2 * lanes * capacity)``, so even a
    table full of rows entered at the largest priority (``sync``) sums to at most half the
    float64 range; ``update`` refuses priorities above ``max_allowed``.

    The learner's own state (rows entered so far, the largest priority) lives in the segment
    too, where workers never read it: a learner killed and restarted on the same buffer adopts
    its predecessor's table (``create`` with ``adopt=True``) and goes on from its priorities,
    as Reverb keeps them on its server.
    """

    adopted = False  # this table was a dead learner's (``create(..., adopt=True)``)

    def __init__(self, segment: Segment) -> None:
        doc = segment.header.doc
        self.segment = segment
        self.lanes, self.capacity = int(doc["lanes"]), int(doc["capacity"])
        self.alpha, self.eps = float(doc["alpha"]), float(doc["eps"])
        # The buffer stores FINAL rows (derived next_obs), which no draw may deliver.
        self.final_rows = bool(doc.get("final_rows", True))
        self.max_allowed = _max_priority(self.alpha, self.eps, self.lanes * self.capacity)
        windows = doc.get("plan") is not None
        offsets = _table_layout(self.lanes, self.capacity, len(layout.encode_layout(doc)),
                                windows)
        memory = segment.buf
        if memory is None:
            raise ClosedError(f"priority table {segment.name!r} is closed")
        if offsets.total != segment.header.total_size:
            raise SegmentFormatError(
                f"priority table {segment.name!r} is {segment.header.total_size} bytes, but "
                f"its layout ({self.lanes} lanes of {self.capacity}) needs {offsets.total}: "
                f"truncated or tampered")
        nodes, lanes = offsets.width, self.lanes
        self.sums = np.frombuffer(memory, "<f8", lanes * nodes, offsets.sums).reshape(lanes, nodes)
        self.mins = np.frombuffer(memory, "<f8", lanes * nodes, offsets.mins).reshape(lanes, nodes)
        # per slot: the logical index of the row its priority was set for (-1: none)
        self.gen = np.frombuffer(memory, "<i8", lanes * self.capacity, offsets.generations)
        # The learner's state (only the learner reads or writes it): per lane, rows below
        # ``synced`` were entered, starts below ``judged`` valued (window tables); the largest
        # priority set so far; per slot, whether a window start was judged usable.
        self.synced = np.frombuffer(memory, "<i8", lanes, offsets.learner)
        self.judged = np.frombuffer(memory, "<i8", lanes, offsets.learner + 8 * lanes)
        self._max = np.frombuffer(memory, "<f8", 1, offsets.learner + 16 * lanes)
        self.usable = np.frombuffer(memory, np.bool_, lanes * self.capacity if windows else 0,
                                    offsets.usable)
        self.updates_dropped = 0  # (this learner's own counts)
        self.actor_priorities_entered = 0  # rows entered at the priority their writer gave
        self.actor_priorities_clipped = 0  # of them, above ``max_allowed``: entered at it

    @property
    def max_priority(self) -> float:
        """The largest priority set so far (new rows enter at it)."""
        return float(self._max[0])

    @max_priority.setter
    def max_priority(self, value: float) -> None:
        self._max[0] = value

    @classmethod
    def create(cls, buf: ReplayBuffer, alpha: float = 0.6, eps: float = 1e-6, *,
               counted: bool = False, plan: dict[str, Any] | None = None,
               adopt: bool = False) -> PriorityTable:
        """A new table for ``buf``'s learner (``counted``: a ``Counted(k)`` pool's, whose
        counts live in its learner's memory; ``plan``: a window table's plan). With ``adopt``,
        a table a dead learner left with the same document is taken over instead, if one is
        there (an atomic claim of its owner lease: of two pools opening at once, one adopts
        it); its trees are rebuilt from their leaves (a death mid-update may have left a
        parent stale). A counted table is never adopted."""
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be finite and >= 0, got {alpha!r}")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
        doc = table_doc(buf, alpha, eps, counted=counted, plan=plan)
        if adopt and not counted:
            for info in scan():
                if (info.header is None or info.alive or info.header.kind != layout.KIND_PRIORITY
                        or info.header.doc != doc):
                    continue
                try:
                    table = cls(Segment.adopt(info.name, layout.KIND_PRIORITY))
                except (SegmentExistsError, SegmentNotFoundError, SegmentFormatError):
                    continue  # another learner took it first, or it is gone
                sumtree.rebuild(table.sums, table.mins)
                table.adopted = True
                return table
        windows = plan is not None
        segment = Segment.create(None, layout.KIND_PRIORITY, doc,
                                 lambda n: _table_layout(buf.lanes, buf.capacity, n,
                                                         windows).total)
        table = cls(segment)
        table.mins[...] = np.inf
        table.gen[...] = -1
        table.max_priority = 1.0
        # Rows already in the buffer enter at the initial maximum priority on the first sync.
        table.synced[...] = buf.windows().lo
        table.judged[...] = table.synced
        return table

    @classmethod
    def attach(cls, name: str) -> PriorityTable:
        return cls(Segment.attach(name, layout.KIND_PRIORITY))

    @property
    def name(self) -> str:
        return self.segment.name

    def total(self) -> float:
        """The sum of every stored priority (0: nothing can be drawn)."""
        return float(sumtree.roots(self.sums).sum())

    def smallest(self) -> float:
        """The smallest stored positive value over all lanes (inf while none is stored)."""
        return float(sumtree.roots(self.mins).min())

    def leaf_values(self, lanes: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """The stored values of the slots of rows ``(lanes, indices)`` (whoever holds them)."""
        return self.sums[lanes, indices % self.capacity]

    def _value(self, priorities: Any) -> Any:
        """The stored value ``(p + eps) ** alpha`` of priorities."""
        return (priorities + self.eps) ** self.alpha

    # -- learner side: the only writer -------------------------------------------------------------
    def sync(self, buf: ReplayBuffer, initial: float | None = None) -> int:
        """Enter rows committed since the last sync at the priority their writer gave with
        them, or else at the maximum priority (``initial`` if given, e.g. 1.0 for uniform
        tables, for every row); FINAL rows (not transitions) at zero."""
        committed = buf.committed()
        assert isinstance(committed, np.ndarray)  # no lane given: one count per lane
        if not (committed > self.synced).any():
            return 0
        capacity, meta = self.capacity, buf.storage.meta
        value = self._value(self.max_priority) if initial is None else initial
        entered = 0
        for lane, (done, now) in enumerate(zip(self.synced.tolist(), committed.tolist())):
            if now <= done:
                continue
            # per lane and contiguous run of slots, not per row
            start, stop = max(done, now - capacity), now
            entered += stop - start
            while start < stop:  # at most two runs: the ring wraps once
                slot = start % capacity
                end = min(stop, start + capacity - slot)
                run = slice(lane * capacity + slot, lane * capacity + slot + end - start)
                # generation first: a reader that sees it finds the new row
                self.gen[run] = np.arange(start, end, dtype=np.int64)
                values = np.full(end - start, value)
                if initial is None:
                    self._enter_actor_priorities(values, buf, lane, start, end)
                if self.final_rows:
                    values[(meta[run] & layout.FLAG_FINAL) != 0] = 0.0
                sumtree.fill(self.sums, self.mins, lane, slot, values, top=False)
                start = end
        sumtree.fix_top(self.sums, self.mins)  # once for every run
        np.maximum(self.synced, committed, out=self.synced)  # (the lanes with new rows)
        return entered

    def actor_priorities(self, buf: ReplayBuffer, lane: int, first: int, stop: int
                         ) -> np.ndarray | None:
        """The priorities writers gave with rows ``first .. stop - 1`` of ``lane`` (NaN where
        a row has none, or its slot was being rewritten while they were read: its stamps said
        so); None where the buffer keeps no actor priorities. Read under the rows' stamps
        (``slots.checked_gather``), so a priority is never one of a row that was not published,
        nor of another row of the slot (its row tag)."""
        storage = buf.storage
        if storage.priority is None or storage.priority_row is None:
            return None
        index = np.arange(first, stop, dtype=np.int64)
        slot = lane * self.capacity + index % self.capacity
        got = {"p": np.empty(index.size, np.float64), "row": np.empty(index.size, np.int64)}
        whole = checked_gather(storage.stamps, slot, index,
                               {"p": storage.priority, "row": storage.priority_row}, got,
                               storage.meta)
        whole &= got["row"] == layout.priority_row_tag(index)
        return np.where(whole, got["p"], np.nan)

    def actor_values(self, priorities: np.ndarray) -> np.ndarray:
        """The stored values of actor ``priorities`` (NaN stays NaN: none given), each
        clipped to ``max_allowed`` (counted in ``actor_priorities_clipped``); the maximum
        priority rises to the largest, as for ``update``."""
        given = ~np.isnan(priorities)
        n = int(np.count_nonzero(given))
        if not n:
            return priorities
        high = float(priorities[given].max())
        if high > self.max_allowed:
            over = priorities > self.max_allowed  # (NaN compares false)
            self.actor_priorities_clipped += int(np.count_nonzero(over))
            priorities = np.where(over, self.max_allowed, priorities)
            high = self.max_allowed
        self.actor_priorities_entered += n
        self.max_priority = max(self.max_priority, high)
        return self._value(priorities)  # type: ignore[no-any-return]

    def _enter_actor_priorities(self, values: np.ndarray, buf: ReplayBuffer, lane: int,
                                first: int, stop: int, usable: np.ndarray | None = None
                                ) -> None:
        """Where rows ``first .. stop - 1`` of ``lane`` (``usable`` ones, if given) carry an
        actor priority, put its stored value in ``values`` (learner side, in ``sync``)."""
        priorities = self.actor_priorities(buf, lane, first, stop)
        if priorities is None:
            return
        if usable is not None:
            priorities[~usable] = np.nan
        entered = self.actor_values(priorities)
        given = ~np.isnan(entered)
        values[given] = entered[given]

    def sync_before_update(self, buf: ReplayBuffer, lanes: Any, indices: Any
                           ) -> np.ndarray | None:
        """Ready an ``update`` of rows ``(lanes, indices)``; returns which of them are still
        held (None: all, or input ``update`` will judge), for ``update(..., held=)``.

        ``sync`` runs first only if one of the rows is not entered yet (a slot's occupant that
        ``draw_held`` delivered): the update must find it. A row overwritten since it was drawn
        is told by the window instead (its index is below ``lo``) and dropped; entering the
        writers' new rows here would change nothing the update does, and the next ``sync``
        (``next()``) enters them. Under fast writers this spares a second ``sync`` per batch.
        Odd input just syncs."""
        index = self._update_rows(indices)
        if index is None or not index.size or index.dtype.kind not in "iu":
            self.sync(buf)
            return None
        if isinstance(lanes, (int, np.integer)) and 0 <= int(lanes) < self.lanes:
            lane: Any = int(lanes)
        elif (isinstance(lanes, np.ndarray) and lanes.shape == index.shape
              and lanes.dtype.kind in "iu" and lanes.size and 0 <= int(lanes.min())
              and int(lanes.max()) < self.lanes):
            lane = lanes
        else:
            self.sync(buf)
            return None
        windows = buf.windows()
        if not (index < np.minimum(windows.hi, self._entered_below())[lane]).all():
            self.sync(buf)
            windows = buf.windows()
        held = index >= np.maximum(windows.lo, 0)[lane]
        return None if held.all() else held

    def _update_rows(self, indices: Any) -> np.ndarray | None:
        """The rows an ``update`` of ``indices`` sets (None: not an array it takes)."""
        return indices if isinstance(indices, np.ndarray) and indices.ndim == 1 else None

    def _entered_below(self) -> np.ndarray:
        """Per lane: rows below it have their values in the table (learner side)."""
        return self.synced

    def update(self, lanes: np.ndarray, indices: np.ndarray, priorities: Any, *,
               held: np.ndarray | None = None) -> int:
        """Set new priorities for rows sampled at ``(lanes, indices)``; rows overwritten since
        are skipped (by their slot's generation, and where ``held``, from
        ``sync_before_update``, is false). Returns how many were applied.

        Raises:
            InvalidPriorityError: a priority is NaN, infinite, negative or above
                ``max_allowed``, where a sum of the tree could overflow (nothing is applied).
        """
        values = np.asarray(priorities, np.float64).reshape(-1)
        indices = np.asarray(indices, np.int64).reshape(-1)
        lanes = _lanes_like(lanes, indices)
        if values.shape != indices.shape:
            raise ValueError(f"{values.size} priorities for {indices.size} indices")
        if not values.size:
            return 0
        # One pass of min/max for the usual case; the failing check says what is wrong.
        low, high = float(values.min()), float(values.max())
        if not (low >= 0 and high <= self.max_allowed and high < math.inf):
            self._refuse(values, lanes, indices)
        if not (0 <= int(lanes.min()) and int(lanes.max()) < self.lanes):
            raise ValueError(f"lanes must be in [0, {self.lanes})")
        if int(indices.min()) < 0:  # -1 is the generation of a slot never written
            position = int(np.flatnonzero(indices < 0)[0])
            raise ValueError(
                f"index {int(indices[position])} at position {position} is not a row: indices "
                f"are the logical positions in batch.indices (>= 0); nothing was updated"
            )
        leaves = indices % self.capacity
        current = self.gen[leaves if self.lanes == 1 else lanes * self.capacity + leaves] == indices
        if held is not None:
            current &= held.reshape(-1)
        applied = int(np.count_nonzero(current))
        if applied < current.size:  # rows overwritten since they were sampled: dropped
            self.updates_dropped += current.size - applied
            lanes, leaves, values = lanes[current], leaves[current], values[current]
            if not applied:
                return 0
            high = float(values.max())
        sumtree.update(self.sums, self.mins, lanes, leaves, self._value(values))
        self.max_priority = max(self.max_priority, high)
        return applied

    def _refuse(self, values: np.ndarray, lanes: np.ndarray, indices: np.ndarray) -> None:
        """Raise ``InvalidPriorityError`` for the first priority ``update`` must not apply."""
        bad = ~np.isfinite(values) | (values < 0)
        if bad.any():
            raise _invalid_priority(
                values, lanes, indices, bad, "is not allowed: priorities must be finite and >= 0 "
                f"({int(bad.sum())} bad of {values.size}); nothing was updated")
        raise _invalid_priority(
            values, lanes, indices, values > self.max_allowed,
            f"is too large: with alpha={self.alpha} and {self.lanes * self.capacity} rows "
            f"the sum tree could overflow to inf. Priorities must be at most "
            f"{self.max_allowed!r}; nothing was updated. Fix: rescale or clip them (e.g. "
            f"clip TD errors)")

    def retire(self, lanes: np.ndarray, indices: np.ndarray) -> None:
        """Priority zero: the rows are never drawn again (unless overwritten and re-entered).
        Rows overwritten since ``(lanes, indices)`` were sampled are left alone."""
        slots = lanes * self.capacity + indices % self.capacity
        current = self.gen[slots] == indices
        sumtree.update(self.sums, self.mins, lanes[current], indices[current] % self.capacity,
                       np.zeros(int(current.sum())))

    # -- anyone: read-only draws -------------------------------------------------------------------
    def draw(self, windows: Windows, batch: int, rng: np.random.Generator) -> Draw:
        """``batch`` rows drawn in proportion to their priorities, each a row the buffer holds
        (by its generation); with their probabilities and the smallest probability. A leaf
        whose row was overwritten is redrawn."""
        return self._draw(windows, batch, rng, occupants=False)

    def draw_held(self, windows: Windows, batch: int, rng: np.random.Generator) -> Draw:
        """``draw``, except that a leaf whose row was overwritten by one not entered yet
        delivers the slot's current occupant, with the probability the leaf was drawn with
        (see the module docstring). Not for a buffer that stores FINAL rows (``draw`` there)."""
        return self._draw(windows, batch, rng, occupants=not self.final_rows)

    def _draw(self, windows: Windows, batch: int, rng: np.random.Generator,
              occupants: bool) -> Draw:
        lanes, indices, probs, total, held = self._draw_once(windows, batch, rng, occupants)
        if held:  # the usual case: every leaf drawn holds a row the buffer holds
            return Draw(lanes, indices, probs, self._pmin(total, probs))
        todo = np.flatnonzero(probs <= 0)
        for _ in range(DRAW_ROUNDS - 1):
            again = self._draw_once(windows, todo.size, rng, occupants)
            ok = again[2] > 0
            done = todo[ok]
            lanes[done], indices[done], probs[done] = again[0][ok], again[1][ok], again[2][ok]
            todo = todo[~ok]
            if not todo.size:
                return Draw(lanes, indices, probs, self._pmin(total, probs))
        raise SamplingError(
            f"{todo.size} of {batch} prioritized draws kept landing on rows no longer held: "
            f"the learner's priority table lags the writers (it syncs in next())"
        )

    def _draw_once(self, windows: Windows, batch: int, rng: np.random.Generator,
                   occupants: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, bool]:
        """(lanes, indices, probabilities, total, whether every probability is positive) of
        ``batch`` leaves drawn once; the probability is 0 where the leaf is zero or its row is
        not held (with ``occupants``: where its slot's current occupant is not held either)."""
        try:
            lanes, leaves, total = sumtree.sample(self.sums, batch, rng)
        except ValueError:
            raise EmptyBufferError(
                "no row has a positive priority: nothing written yet (or every row retired)"
            ) from None
        np.minimum(leaves, self.capacity - 1, out=leaves)
        if self.lanes == 1:  # one lane: leaves are the slots, and the window two numbers
            value = self.sums[0].take(leaves)
            generation = self.gen.take(leaves)
            lo, hi = int(windows.lo[0]), int(windows.hi[0])
            if batch and int(generation.min()) >= lo and int(generation.max()) < hi:
                value /= total
                return lanes, generation, value, total, bool(value.min() > 0)
        else:
            value = self.sums.reshape(-1)[lanes * self.sums.shape[1] + leaves]
            generation = self.gen[lanes * self.capacity + leaves]
        lo, hi = windows.lo[lanes], windows.hi[lanes]
        held = (generation >= lo) & (generation < hi)
        if occupants and not held.all():
            moved = np.flatnonzero(~held)
            newest = hi[moved] - 1  # the occupant: the newest index in the slot's ring position
            generation[moved] = newest - (newest - leaves[moved]) % self.capacity
            held[moved] = generation[moved] >= lo[moved]
        value[~held] = 0.0
        value /= total
        return lanes, generation, value, total, bool(value.min() > 0) if batch else True

    def _pmin(self, total: float, probs: np.ndarray) -> float:
        """The smallest probability of any row (of those drawn, if the tree's is larger)."""
        smallest = float(self.mins[0, -1]) if self.lanes == 1 else self.smallest()
        return min(smallest / total, float(probs.min()))

    def close(self) -> None:
        # Drop the views of the mapping so that it can be closed (idempotent).
        self.sums = self.mins = np.empty((self.lanes, 0))
        self.gen = self.synced = self.judged = np.empty(0, np.int64)
        self._max = np.ones(1)
        self.usable = np.empty(0, np.bool_)
        self.segment.close()


def _lanes_like(lanes: Any, indices: np.ndarray) -> np.ndarray:
    """``lanes`` (one lane, or one per index) as an int64 array shaped like ``indices``."""
    if isinstance(lanes, np.ndarray) and lanes.dtype == np.int64 and lanes.size == indices.size:
        return lanes.reshape(-1)
    if isinstance(lanes, (int, np.integer)):
        return np.full(indices.size, lanes, np.int64)
    return np.broadcast_to(np.asarray(lanes, np.int64), indices.shape).reshape(-1)


def _invalid_priority(values: np.ndarray, lanes: np.ndarray, indices: np.ndarray,
                      bad: np.ndarray, why: str) -> InvalidPriorityError:
    """The error naming the first ``bad`` priority, its position and its row."""
    position = int(np.flatnonzero(bad)[0])
    return InvalidPriorityError(
        f"priority {float(values[position])!r} at position {position} (index "
        f"{int(indices[position])} of lane {int(lanes[position])}) {why}"
    )


def _max_priority(alpha: float, eps: float, rows: int) -> float:
    """The largest priority p whose stored value ``(p + eps) ** alpha`` keeps a sum over
    ``rows`` such values within half the float64 range (inf if every finite p does)."""
    if alpha == 0:
        return math.inf
    value = float(np.finfo(np.float64).max) / (2 * rows)
    try:
        return value ** (1.0 / alpha) - eps
    except OverflowError:
        return math.inf


def importance_weights(probs: np.ndarray, pmin: float, beta: float) -> np.ndarray:
    """``w_i = (N P_i)^-beta / max_j (N P_j)^-beta = (P_i / P_min)^-beta`` (at most 1)."""
    if pmin <= 0:
        return np.ones_like(probs)
    return (probs / pmin) ** (-beta)
