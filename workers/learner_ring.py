"""The learner's half of the staging ring: which slots are out with which worker, which are back
and in what order they leave, and every word the learner stores in the ring (``LearnerRing``).

Its records are one int64 array that it owns (``LearnerRing.records``), laid out as follows,
so that the compiled common case of ``next()`` (``workers/_take_c.c``) reads and writes the very
same memory (it checks ``RECORD_FIELDS`` and ``STATUSES`` against its own at construction):

- a header of ``len(RECORD_FIELDS)`` words, in that order: the slot and worker counts, whether
  slots leave in assignment order, the last ticket handed out, the STATE values the learner
  stores and compares (``staging``), the word indices (into the ring's int64 words) of the stats
  line's batches and wait words, and where each column below starts in the records;
- per slot (one column of ``n_slots`` words each): the word indices of its STATE, OWNER and
  GENERATION words; its STATUS (``STATUSES``: with the learner, out with its worker, back and
  ready, back stale); its PLACE in delivery order (the ticket it was queued at);
- WAITER_AT: the word indices of the ``1 + n_workers`` waiting words (the learner's first);
- FILLED: per worker, the batches it handed back.

Tickets are one count for all (``generation`` words and places): a slot handed out again with
``requeue=False`` (after its worker died, or a stale batch replaced) keeps its place. The next
slot to leave is the one with the smallest place among those back and ready; with ``ordered``,
among every slot queued (out or back), and only once it is back.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from shmbuf.slots import full_fence

from .batch import Batch
from .staging import (
    ASSIGNED,
    FREE,
    HELD,
    LEARNER,
    READY,
    STALE,
    W_GENERATION,
    W_OWNER,
    W_STATE,
    StagingRing,
)

RECORD_FIELDS = (
    "n_slots", "n_workers", "ordered", "ticket",
    "assigned", "ready", "stale", "held",  # STATE values
    "batches_at", "wait_at",  # word indices of the stats line's batches and wait words
    # where each column starts in the records
    "state_at", "owner_at", "generation_at", "status", "place", "waiter_at", "filled",
)
H = {name: i for i, name in enumerate(RECORD_FIELDS)}  # header word of each field
TICKET = H["ticket"]
STATUSES = ("with_learner", "out", "back", "back_stale")
WITH_LEARNER, OUT, BACK, BACK_STALE = range(4)  # a slot's STATUS (by value)


def compiled_taker(module: Any, env: Mapping[str, str]) -> Any:
    """``module.Taker`` (``workers._take_c``, or None where it was not built) if its records
    are these (``RECORD_FIELDS``, ``STATUSES``) and ``env`` does not say
    ``SHMBUF_TAKE=python``; else None: ``LearnerRing._take`` runs."""
    if module is None or env.get("SHMBUF_TAKE") == "python":
        return None
    if (getattr(module, "RECORD_FIELDS", None), getattr(module, "STATUSES", None)) \
            != (RECORD_FIELDS, STATUSES):
        return None  # (a build of another layout: tests/test_take_compiled.py says so)
    return module.Taker


try:
    from . import _take_c
except ImportError:  # pragma: no cover - depends on the build
    _take_c = None  # type: ignore[assignment]
Taker: Any = compiled_taker(_take_c, os.environ)  # the compiled take, or None


class LearnerRing:
    """The learner's half of a ``StagingRing``: hands slots out (``hand_out``), takes up those
    workers handed back (``take_up``), says which slot leaves next (``pop``), reclaims a dead
    worker's (``reclaim``), and blocks by the waiting-word handshake (``sleeping``).

    ``take(held, t0)`` is the common case of ``next()`` in one call: compiled where
    ``_take_c`` was built (``SHMBUF_TAKE=python`` opts out), else ``_take`` here, same effects.

    Concurrency: learner thread only. It writes a slot's control words only while the learner
    holds the slot, STATE last (``staging``), and a worker's hand-back is seen by the STATE
    word alone; it wakes a worker (``wake(worker)``) only if that worker's waiting word says it
    sleeps. Its records are this process's memory.

    Example:
        >>> slots = LearnerRing(ring, n_workers=2, ordered=False, wake=print)
        >>> slots.hand_out(0)  # worker 0 fills slot 0
        >>> slots.take_up(); slots.pop()  # 0 once its worker stored READY, else None
    """

    def __init__(self, ring: StagingRing, n_workers: int, ordered: bool,
                 wake: Callable[[int], Any]) -> None:
        n, lay = ring.n_slots, ring.layout
        self.ring, self.n_slots, self.n_workers, self.ordered = ring, n, n_workers, ordered
        self.wake = wake  # wake(worker): it sleeps, or is about to, and was handed a slot
        columns = {"state_at": n, "owner_at": n, "generation_at": n, "status": n, "place": n,
                   "waiter_at": 1 + n_workers, "filled": n_workers}
        self.records = np.zeros(len(RECORD_FIELDS) + sum(columns.values()), np.int64)
        rec, at = self.records, len(RECORD_FIELDS)
        rec[:H["state_at"]] = (n, n_workers, ordered, 0, ASSIGNED, READY, STALE, HELD,
                               *ring.stats.delivered_words)
        views = {}
        for name, size in columns.items():
            rec[H[name]] = at
            views[name] = rec[at:at + size]
            at += size
        views["state_at"][:] = [lay.word(s, W_STATE) for s in range(n)]
        views["owner_at"][:] = [lay.word(s, W_OWNER) for s in range(n)]
        views["generation_at"][:] = [lay.word(s, W_GENERATION) for s in range(n)]
        views["waiter_at"][:] = [lay.waiter_word(w) for w in range(1 + n_workers)]
        # Memoryviews of the header and columns: item access gives Python ints at list speed.
        self._header = rec.data[:len(RECORD_FIELDS)]
        self.state_at, self.owner_at, self.generation_at, self.status, self.place, \
            self.waiter_at, self.filled = (views[name].data for name in columns)
        self.templates: list[Batch] = []
        self.take: Callable[[Batch | None, int], Batch | None] = self._not_taking

    # -- the slots' words -------------------------------------------------------------------------
    def hand_out(self, slot: int, state: int = ASSIGNED, requeue: bool = True) -> None:
        """Hand ``slot`` to its worker (``slot % n_workers``): a new ticket for its generation
        (and its place, with ``requeue``: else it keeps its place), OWNER, then ``state``
        (ASSIGNED, or ASSIGNED_ROWS with the rows written into it) stored last; then the waker's
        half of the handshake: ``wake(worker)`` if it sleeps or is about to."""
        words, header = self.ring.words, self._header
        ticket = header[TICKET] = header[TICKET] + 1
        if requeue:
            self.place[slot] = ticket
        self.status[slot] = OUT
        worker = slot % self.n_workers
        words[self.generation_at[slot]] = ticket
        words[self.owner_at[slot]] = worker
        words[self.state_at[slot]] = state
        full_fence()  # the worker then sees the state, or this sees it waiting
        if words[self.waiter_at[1 + worker]]:
            self.wake(worker)

    def take_up(self) -> int:
        """Slots out whose worker handed them back (STATE READY, or STALE: learner-chosen rows
        were overwritten before the gather) are back (``pop``, ``stale``); how many."""
        words, status, state_at, filled = self.ring.words, self.status, self.state_at, self.filled
        back = 0
        for slot in range(self.n_slots):  # (slots, never rows: a handful)
            if status[slot] == OUT:
                state = words[state_at[slot]]
                if state == READY:
                    status[slot] = BACK
                    filled[slot % self.n_workers] += 1
                    back += 1
                elif state == STALE:
                    status[slot] = BACK_STALE
                    back += 1
        return back

    def pop(self) -> int | None:
        """The next slot to deliver, if it is back and ready: now HELD (the learner's)."""
        status, place, ordered = self.status, self.place, self.ordered
        best, best_place = -1, 0
        for slot in range(self.n_slots):
            s = status[slot]
            if s == BACK or (ordered and s != WITH_LEARNER):
                if best < 0 or place[slot] < best_place:
                    best, best_place = slot, place[slot]
        if best < 0 or status[best] != BACK:
            return None
        status[best] = WITH_LEARNER
        self.ring.words[self.state_at[best]] = HELD
        return best

    def stale(self) -> list[int]:
        """The slots back STALE, in the order of their places; now the learner's, to hand out
        again (with ``requeue=False`` to keep their place)."""
        status = self.status
        out = sorted((s for s in range(self.n_slots) if status[s] == BACK_STALE),
                     key=self.place.__getitem__)
        for slot in out:
            status[slot] = WITH_LEARNER
        return out

    def free(self, slot: int) -> None:
        """``slot`` stays with the learner, FREE (nothing to hand out now); it takes a new place
        when it is handed out again."""
        self._free(slot)

    def reclaim(self, slots: list[int]) -> list[int]:
        """Those of ``slots`` (a dead worker's) still out, in the order they were handed out:
        FREE with a new generation (nobody writes them any more), and the learner's, keeping
        their places for when they are handed out again with ``requeue=False``."""
        words, gen_at = self.ring.words, self.generation_at
        lost = sorted((s for s in slots if self.status[s] == OUT), key=lambda s: words[gen_at[s]])
        for slot in lost:
            words[gen_at[slot]] = self._header[TICKET] = self._header[TICKET] + 1
            self._free(slot)
        return lost

    def _free(self, slot: int) -> None:
        self.status[slot] = WITH_LEARNER
        words = self.ring.words
        words[self.state_at[slot]] = FREE
        words[self.owner_at[slot]] = -1

    def sleeping(self) -> contextlib.AbstractContextManager[None]:
        """The learner's half of the handshake (``StagingRing.sleeping``): inside, look at the
        slots once more (``take_up``), then block on the channels if still nothing came."""
        return self.ring.sleeping(LEARNER)

    def generation(self, slot: int) -> int:
        return self.ring.words[self.generation_at[slot]]

    def delivered(self, wait_ns: int) -> None:
        """One more batch reached the learner after it waited ``wait_ns`` (the stats line)."""
        self.ring.stats.batch_delivered(wait_ns)

    @property
    def ready_count(self) -> int:
        """Slots back and ready, not yet delivered."""
        return self.status.tolist().count(BACK)

    @property
    def out_count(self) -> int:
        """Slots out with their workers, not yet taken up."""
        return self.status.tolist().count(OUT)

    # -- the common case of next() ----------------------------------------------------------------
    def deliver_as(self, templates: list[Batch]) -> None:
        """Enable ``take``: the batch of slot ``s`` is ``templates[s]``'s views, release and
        ``to`` calls, with the slot's generation."""
        self.templates = list(templates)  # (the compiled take reads this very list)
        self.take = self._take if Taker is None else \
            Taker(self.ring.words, self.records, self.templates, self.wake).take

    def _take(self, held: Batch | None, t0: int) -> Batch | None:
        """``held`` (unless None or released) let go of and its slot handed back, slots taken
        up, the next one HELD, counted as delivered after waiting since ``t0``
        (``time.perf_counter_ns``) and returned as a batch (None if none is ready)."""
        if held is not None and not held.released:  # (else its slot was handed out then)
            held._invalidate()
            self.hand_out(held.slot)
        self.take_up()
        slot = self.pop()
        if slot is None:
            return None
        self.delivered(time.perf_counter_ns() - t0)
        return self.templates[slot]._renewed(self.generation(slot))

    def _not_taking(self, held: Batch | None, t0: int) -> Batch | None:
        raise RuntimeError("LearnerRing.take needs deliver_as(templates) first")

    def close(self) -> None:
        """Drop the batch templates (emptied: a take made before, compiled or not, holds no
        views of the ring after this) and the take (they refer back to the delivery)."""
        self.templates.clear()
        self.take = self._not_taking
