"""The staging ring: a shared-memory segment of batch-sized slots that workers fill for the learner.

Layout after the common shmbuf header page (see ``shmbuf.layout``):

- pool stats: ``STAGING_STATS_LINES`` 64-byte line(s) of u64 counters (``STAT_*``: batches
  delivered, learner wait ns, worker restarts, worker count, what was reclaimed at the start),
  stored only by the learner (``PoolStats``), read by ``shmbuf top`` from another process.
- slot control: ``CONTROL_LINES`` 64-byte lines per slot, one u64 per line: ``STATE`` (FREE,
  ASSIGNED, FILLING, READY, HELD, ASSIGNED_ROWS, STALE), ``OWNER`` (worker id or -1),
  ``GENERATION`` (a new, larger value every time the slot is handed out or reclaimed: the order
  in which slots were assigned), ``SEQ`` (which batch of its worker it holds); then one line per
  waiter (the learner, then each worker): 1 while that process is about to block or blocked on
  its channel, else 0 (the handshake below).
- per-slot data, each slot starting on a page: every array ``[B, *shape]`` 64-byte aligned, in the
  order of the layout document (fields, then ``_indices``, ``_lanes``, ``_weights``...).

The layout document's ``pool_stats`` entry (``STAGING_STATS_LINES`` and ``STAT_NAMES``, the
counters' names by word) and its ``slot_control`` entry (``CONTROL_LINES``, the state and owner
word indices, ``STATE_NAMES``) let readers that do not import ``workers`` (``shmbuf top``) find
the counters and the slot states.

Concurrency: a slot's words and data are written only by whoever holds the slot, and ownership
moves by the store of its STATE word, the last store of a hand-over (learner -> worker:
ASSIGNED/ASSIGNED_ROWS; worker -> learner: READY/STALE), so no word ever has two writers and a
reader that sees the new state also sees every byte written before it (x86-64 keeps stores in
order, and loads in order). A hand-over costs no system call; only a side about to sleep needs
a wake-up (the learner's to a worker: a write to the channel's eventfd; a worker's to the
learner: an ``OP_READY`` record), by this handshake on its waiting word (written only by its
waiter): the sleeper stores waiting=1, ``full_fence()``, reads the slot states again and blocks
on its channel only if still nothing is there (``sleeping``); the other side stores the slot's
state, ``full_fence()``, reads the waiting word and sends a wake-up only if it is 1
(``wake_needed``). The fences forbid the one reordering x86-64 allows (a later load passing an
earlier store), so at least one side sees the other's store: either the sleeper's second look
finds the state, or the waker sends. A wake-up sent between that look and the block is not lost
either: it waits in the eventfd's count or the socket, and the block (``poll``) returns at
once. An extra one is harmless (the states say what to do; it is read and dropped later), and a
side waits for other reasons (deaths, fences, rows to select, liveness) only with a timeout. A
dead worker's waiting word may stay 1: its restarted process then gets wake-ups it did not
need, until its own ``sleeping`` clears the word. The learner (the owner of this segment)
reclaims a slot from a worker only after that worker's process is gone.

Each side's half is one object: the learner's is ``learner_ring.LearnerRing`` (its hand-outs,
take-ups and reclaims, in Python or compiled), a worker's ``sampler_proc._Worker``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmbuf.errors import ClosedError
from shmbuf.layout import KIND_STAGING, LINE, PAGE, align, encode_layout, header_size
from shmbuf.segment import Segment
from shmbuf.slots import full_fence

FREE, ASSIGNED, FILLING, READY, HELD = range(5)
ASSIGNED_ROWS = 5  # assigned with the rows to gather written into its index arrays
STALE = 6  # a row to gather was overwritten before it was read: nothing delivered
STATE_NAMES = ("free", "assigned", "filling", "ready", "held", "gathering", "stale")  # by value
WORKER_STATES = (ASSIGNED, ASSIGNED_ROWS)  # what a worker takes up
LEARNER = 0  # waiter line of the learner; worker ``w`` has line ``1 + w``

W_STATE, W_OWNER, W_GENERATION, W_SEQ = range(4)
CONTROL_LINES = 4

# The pool stats: u64 words packed in STAGING_STATS_LINES line(s) right after the header page,
# all stored by the learner (the ring's owner) only.
STAT_BATCHES = 0  # batches delivered to the learner
STAT_WAIT_NS = 1  # nanoseconds the learner spent waiting in next(), summed
STAT_RESTARTS = 2  # sampler worker restarts
STAT_WORKERS = 3  # sampler workers alive
STAT_RECLAIMED = 4  # segments of dead learners of the buffer the pool removed at its start
STAT_RECLAIMED_BYTES = 5  # their bytes
STAT_ADOPTED = 6  # 1: the pool took over a dead learner's priority table
STAGING_STATS_LINES = 1
# The words' names by index, as the layout document's ``pool_stats`` lists them.
STAT_NAMES = ("batches", "wait_ns", "restarts", "workers", "reclaimed", "reclaimed_bytes",
              "adopted")

# Arrays every slot carries besides the batch's fields.
INDICES, LANES, WEIGHTS = "_indices", "_lanes", "_weights"
PROBS, PMIN = "_probs", "_pmin"  # prioritized draws: probability of each row, smallest overall
# Learner-chosen batches that say more (epochs): int64 [rows filled (0: all), epoch + 1 (0: no
# epoch), 1 if the batch ends its epoch]; zero for every other batch.
INFO = "_info"


ArraySpec = tuple[str, tuple[int, ...], np.dtype]  # name, shape, dtype


def slot_arrays(fields: list[ArraySpec], batch_size: int,
                index_shape: tuple[int, ...]) -> list[ArraySpec]:
    """Every array a slot carries, shapes with the batch axis: the delivered ``fields`` (shapes
    without it), then which rows the batch holds, their importance weights and probabilities."""
    rows = (batch_size,)
    return [(name, (*rows, *shape), np.dtype(dtype)) for name, shape, dtype in fields] + [
        (INDICES, (*rows, *index_shape), np.dtype(np.int64)), (LANES, rows, np.dtype(np.int64)),
        (WEIGHTS, rows, np.dtype(np.float32)), (PROBS, rows, np.dtype(np.float64)),
        (PMIN, (1,), np.dtype(np.float64)), (INFO, (3,), np.dtype(np.int64)),
    ]


def write_rows(arrays: dict[str, np.ndarray], lanes: np.ndarray, indices: np.ndarray,
               probs: np.ndarray | None, pmin: float, info: np.ndarray | None = None) -> None:
    """Record in a slot's arrays which rows its batch holds (and their probabilities, for
    importance weights, when they were drawn in proportion to priorities; ``INFO`` when
    given)."""
    arrays[INDICES][...] = indices
    arrays[LANES][...] = lanes
    if probs is not None:
        arrays[PROBS][...], arrays[PMIN][0] = probs, pmin
    if info is not None:
        arrays[INFO][...] = info


@dataclass(frozen=True)
class SlotArray:
    name: str
    offset: int  # within the slot
    shape: tuple[int, ...]  # including the batch axis
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class StagingLayout:
    n_slots: int
    header_size: int
    control_offset: int
    waiter_offset: int
    n_waiters: int
    data_offset: int
    slot_stride: int
    arrays: tuple[SlotArray, ...]
    total_size: int
    stats_offset: int = 0  # the pool stats line(s), right after the header

    def word(self, slot: int, word: int) -> int:
        """Index into the segment's int64 word view of ``word`` of ``slot``."""
        return (self.control_offset + (slot * CONTROL_LINES + word) * LINE) // 8

    def waiter_word(self, waiter: int) -> int:
        """Index into the int64 word view of ``waiter``'s waiting word."""
        return (self.waiter_offset + waiter * LINE) // 8

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_stride


def staging_layout(arrays: list[tuple[str, tuple[int, ...], Any]], n_slots: int,
                   json_len: int, n_waiters: int = 1) -> StagingLayout:
    """Pure layout math for a ring of ``n_slots`` slots holding ``arrays`` (shapes with batch),
    and ``n_waiters`` waiting words (the learner and its workers)."""
    header = header_size(json_len)
    control = header + STAGING_STATS_LINES * LINE
    waiters = control + n_slots * CONTROL_LINES * LINE
    data = align(waiters + n_waiters * LINE, PAGE)
    offset = 0
    out = []
    for name, shape, dtype in arrays:
        arr = SlotArray(name, offset, tuple(shape), np.dtype(dtype))
        out.append(arr)
        offset = align(offset + arr.nbytes)
    stride = align(max(offset, 1), PAGE)
    return StagingLayout(n_slots, header, control, waiters, n_waiters, data, stride, tuple(out),
                         data + n_slots * stride, stats_offset=header)


class PoolStats:
    """The pool counters in a staging ring's stats line (``STAT_*``).

    Concurrency: only the learner (the ring's owner) stores these words, each an aligned u64
    store; readers (``shmbuf top``) may see one word updated before another.
    """

    def __init__(self, words: memoryview, stats_offset: int) -> None:
        self._words = words
        self._base = stats_offset // 8
        # (the learner's records name these words: the compiled take counts in them too)
        self.delivered_words = (self._base + STAT_BATCHES, self._base + STAT_WAIT_NS)

    def set_workers(self, n: int) -> None:
        self._words[self._base + STAT_WORKERS] = n

    def set_restarts(self, n: int) -> None:
        self._words[self._base + STAT_RESTARTS] = n

    def set_reclaimed(self, segments: int, nbytes: int, adopted: bool) -> None:
        """What the pool reclaimed at its start from dead learners of its buffer."""
        q, base = self._words, self._base
        q[base + STAT_RECLAIMED], q[base + STAT_RECLAIMED_BYTES] = segments, nbytes
        q[base + STAT_ADOPTED] = int(adopted)

    def batch_delivered(self, wait_ns: int) -> None:
        """One more batch reached the learner after it waited ``wait_ns``."""
        q, (batches, waited) = self._words, self.delivered_words
        q[batches] += 1
        q[waited] += wait_ns


class StagingRing:
    """A mapped staging segment: slot views and control words, and both halves of the wake-up
    handshake (``sleeping``, ``wake_needed``).

    Create it in the learner (``create``), attach in workers (``attach``). Which words the
    learner stores, and when, is ``LearnerRing``'s business.
    """

    def __init__(self, segment: Segment) -> None:
        doc = segment.header.doc
        arrays = [(a["name"], tuple(a["shape"]), a["dtype"]) for a in doc["arrays"]]
        self.layout = staging_layout(arrays, int(doc["n_slots"]), len(encode_layout(doc)),
                                     int(doc.get("n_waiters", 1)))
        self.seg = segment
        mm = segment.buf
        if mm is None:
            raise ClosedError(f"staging segment {segment.name!r} is closed")
        self.words = memoryview(mm).cast("q")
        self.stats = PoolStats(self.words, self.layout.stats_offset)
        # Word indices of each slot's STATE and GENERATION and of each waiting word, for the
        # per-batch reads and stores.
        lay = self.layout
        self.state_words = [lay.word(s, W_STATE) for s in range(lay.n_slots)]
        self.generation_words = [lay.word(s, W_GENERATION) for s in range(lay.n_slots)]
        self.waiter_words = [lay.waiter_word(w) for w in range(lay.n_waiters)]
        self._slots: list[dict[str, np.ndarray]] = []
        for s in range(self.layout.n_slots):
            base = self.layout.slot_offset(s)
            self._slots.append(
                {
                    a.name: np.frombuffer(
                        mm, a.dtype, count=int(np.prod(a.shape, dtype=np.int64)),
                        offset=base + a.offset,
                    ).reshape(a.shape)
                    for a in self.layout.arrays
                }
            )

    @classmethod
    def create(cls, arrays: list[ArraySpec], n_slots: int, meta: dict[str, Any],
               n_workers: int = 0) -> StagingRing:
        """A new ring of ``n_slots`` slots of ``arrays`` (``slot_arrays``) filled by
        ``n_workers`` workers, with waiting words for the learner and each worker; weights
        start at 1."""
        doc = {
            "kind": "staging",
            "n_slots": n_slots,
            "n_waiters": 1 + n_workers,
            "pool_stats": {"lines": STAGING_STATS_LINES, "words": list(STAT_NAMES)},
            "slot_control": {"lines": CONTROL_LINES, "state": W_STATE, "owner": W_OWNER,
                             "states": list(STATE_NAMES)},
            "arrays": [
                {"name": n, "shape": list(shape), "dtype": np.dtype(dt).str}
                for n, shape, dt in arrays
            ],
            **meta,
        }

        def size_of(json_len: int) -> int:
            return staging_layout(arrays, n_slots, json_len, 1 + n_workers).total_size

        ring = cls(Segment.create(None, KIND_STAGING, doc, size_of))
        for s in range(n_slots):
            ring.set(s, W_OWNER, -1)
            ring.slot(s)[WEIGHTS][...] = 1.0
        ring.stats.set_workers(n_workers)
        return ring

    @classmethod
    def attach(cls, name: str) -> StagingRing:
        return cls(Segment.attach(name, KIND_STAGING))

    @property
    def name(self) -> str:
        return self.seg.name

    @property
    def n_slots(self) -> int:
        return self.layout.n_slots

    def slot(self, slot: int) -> dict[str, np.ndarray]:
        """Every array of ``slot`` (fields and the internal ``_indices``/``_lanes``/...)."""
        return self._slots[slot]

    def get(self, slot: int, word: int) -> int:
        return self.words[self.layout.word(slot, word)]

    def set(self, slot: int, word: int, value: int) -> None:
        self.words[self.layout.word(slot, word)] = value

    def state(self, slot: int) -> int:
        return self.words[self.state_words[slot]]

    def set_state(self, slot: int, state: int) -> None:
        self.words[self.state_words[slot]] = state

    def generation(self, slot: int) -> int:
        return self.words[self.generation_words[slot]]

    def waiting(self, waiter: int) -> bool:
        """Is ``waiter`` (``LEARNER``, or ``1 + worker id``) about to block, or blocked?"""
        return bool(self.words[self.waiter_words[waiter]])

    def set_waiting(self, waiter: int, waiting: bool) -> None:
        self.words[self.waiter_words[waiter]] = int(waiting)

    @contextlib.contextmanager
    def sleeping(self, waiter: int) -> Iterator[None]:
        """The sleeper's half of the wake-up handshake: inside, ``waiter``'s waiting word is 1
        and fenced, so look at the slot states once more, then block if still nothing."""
        self.set_waiting(waiter, True)
        full_fence()  # the other side then sees "waiting", or this one sees its store
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):  # closed meanwhile by another thread
                self.set_waiting(waiter, False)

    def wake_needed(self, waiter: int) -> bool:
        """The waker's half, after storing a slot's state: does ``waiter`` sleep (or is about
        to) and need a message?"""
        full_fence()
        return bool(self.words[self.waiter_words[waiter]])

    def slot_span(self) -> tuple[int, int]:
        """(byte offset, length) of all slot data, e.g. to pin it for async GPU copies."""
        return self.layout.data_offset, self.layout.n_slots * self.layout.slot_stride

    def close(self) -> None:
        """Drop this process's views and unmap; the owner also unlinks. Idempotent."""
        self._slots = []
        self.words.release()  # idempotent; a word read after close raises ValueError
        self.seg.close()
