"""The per-slot seqlock of docs/design.md ("The per-slot seqlock") and its only writer: claims, stamps, ``committed``,
the checked reads that trust a row only if its stamp held it before and after the copy, the
fences, and the CPU check that says where the fences may be no-ops.

Words, as ``layout`` encodes them: a slot's stamp is 0 (never written), ``2i+1`` (index i being
written) or ``2i+2`` (holds index i), plus, in bits ``VERSION_SHIFT`` up, the slot's *rewrite
version*: 0 for every ring write, counted up by each in-place rewrite of the index it holds
(``mark_rewriting``), so a rewrite never brings a slot back to a stamp a reader loaded before it
(the ABA a seqlock must not have). Readers compare the stamp's index bits with ``2i+2`` and the
whole stamp before and after the copy (``holds``). Row indices stay below ``MAX_ROW_INDEX``; a
lane's ``reserved`` is its writer's claim (indices
``[committed, reserved)`` are being written) and ``committed`` the count of published indices.
Episode records use the same stamps with the episode id for i. Functions here take the word
views they store to as arguments: a ``memoryview`` cast to ``"q"`` indexed by word (the writer's
scalar path) or int64 NumPy views indexed by ints, slices or index arrays (vectorised paths).

Concurrency: only the holder of a lane's writer lease (its ``Writer``/``VectorWriter``, or
``clear``/restores holding every lease) calls the writing functions for that lane, except
``set_floor``, called by the holder of ``LOCK_CLEAR``; the reading
functions are for anyone and never wait. The one copy of a write path outside this module is
its compiled twin in C, ``_add_c.c`` (the compiled lane store of ``store.py``: ``write_row``
and the ring steps of ``put_many``, where it was built), held to this module's stores byte for
byte by tests/test_add_compiled.py.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from .errors import UnsupportedPlatformError

compiled_fence: Callable[[], None] | None
try:  # the optional compiled helpers (setup.py): mfence for full_fence
    from ._stream_c import full_fence as compiled_fence
except ImportError:  # built without a compiler
    compiled_fence = None

Words = Any  # memoryview("q") indexed by word offset, or an int64 ndarray (ints, slices, arrays)
Segments = Sequence[tuple[int, int, int]]  # ring segments (a, b, off) from checks.ring_segments
T = TypeVar("T")

ALLOW_ARCH_ENV = "SHMBUF_UNSAFE_ALLOW_ARCH"

# A row stamp's layout (int64): bits 0-47 hold 2i+1 / 2i+2, bits 48-62 the rewrite version.
VERSION_SHIFT = 48
INDEX_BITS = (1 << VERSION_SHIFT) - 1  # the stamp's 2i+1 / 2i+2
VERSION_MASK = (1 << (63 - VERSION_SHIFT)) - 1  # 15 bits: wraps after 32768 rewrites of a slot
MAX_ROW_INDEX = (1 << (VERSION_SHIFT - 1)) - 2  # the largest row index whose 2i+2 fits the bits
_TSO_MACHINES = frozenset({"x86_64", "amd64"})


# --------------------------------------------------------------------------------------------
# Fences and the CPU check
# --------------------------------------------------------------------------------------------
def store_fence() -> None:
    """Order every store before this call before every store after it (to other CPUs).

    Called between a row's payload and the stamp/``committed`` stores that publish it, and
    between an odd stamp and the payload it guards. A no-op: ``check_platform`` admits only
    x86-64, whose TSO order keeps stores in program order. On aarch64 a release/store barrier
    (``dmb ishst``, e.g. ``__atomic_thread_fence(__ATOMIC_RELEASE)`` through a tiny C helper)
    would go here, with ``load_fence`` below (``_add_c.c`` already orders its stores with that
    fence, a compiler barrier on x86-64).
    """


def load_fence() -> None:
    """Order loads before this call before loads after it: the reader's half of
    ``store_fence``. A no-op on x86-64 (loads are not reordered with loads); on aarch64
    ``dmb ishld`` would go here."""


_FENCE_LOCK = threading.Lock()


def _new_fence_lock() -> None:
    """A child forked while another thread was inside ``full_fence`` gets a free lock."""
    global _FENCE_LOCK
    _FENCE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_fence_lock)


def locked_fence() -> None:
    """Order every store before this call before every load after it (a StoreLoad barrier),
    the one order x86-64 does not keep by itself: the "set my flag, then look at yours" of a
    sleep/wake-up handshake (the staging ring's waiting words) needs it on both sides.

    Taking an uncontended lock is an atomic read-modify-write (``lock cmpxchg`` in glibc's
    ``sem_wait``/``pthread_mutex_lock``, which CPython's ``Lock`` uses), a full barrier on x86-64
    (the platforms ``platform_supported`` accepts). About 0.2-0.7 us from Python when warm, and
    a few microseconds more on a core that just woke up: ``full_fence`` is ``_stream_c``'s
    ``mfence`` where that extension was built, and this where it was not.
    """
    with _FENCE_LOCK:
        pass


full_fence: Callable[[], None] = locked_fence if compiled_fence is None else compiled_fence


def platform_supported(machine: str, pointer_bits: int) -> bool:
    """True where the stamp protocol is safe with the fences above being no-ops: 64-bit x86
    (TSO: stores are not reordered with stores, nor loads with loads, and aligned 8-byte
    accesses are atomic)."""
    return machine.lower() in _TSO_MACHINES and pointer_bits == 64


def check_platform() -> None:
    """Refuse to create or attach a segment where the seqlock would be unsafe.

    The writer's payload, stamp and ``committed`` stores are plain stores that x86-64 keeps in
    order; on weaker machines (aarch64, POWER, RISC-V) a reader could see a stamp before the
    row it guards. Until ``store_fence``/``load_fence`` have bodies there,
    ``SHMBUF_UNSAFE_ALLOW_ARCH=1`` lets experiments run anyway, at the risk of torn rows.
    """
    machine = platform.machine()
    bits = 64 if sys.maxsize > 2**32 else 32
    if platform_supported(machine, bits) or os.environ.get(ALLOW_ARCH_ENV) == "1":
        return
    raise UnsupportedPlatformError(
        f"shmbuf's shared-memory protocol relies on x86-64 store ordering; this is "
        f"{machine or 'an unknown machine'} ({bits}-bit Python), where rows could be read torn. "
        f"Fix: run on 64-bit x86, or set {ALLOW_ARCH_ENV}=1 to experiment at your own risk"
    )


# --------------------------------------------------------------------------------------------
# Writing (the lane's lease holder only)
# --------------------------------------------------------------------------------------------
def claim(words: Words, at: Any, end: Any) -> None:
    """Publish the writer's claim ``reserved = end``: indices below ``end`` are being written.
    Stored before the odd stamps, so readers keep out of the slots about to be overwritten."""
    words[at] = end


def take_over(words: Words, committed_at: int, reserved_at: int, capacity: int
              ) -> tuple[int, int]:
    """A new writer takes a lane over from whoever had it (nobody, a closed or a dead writer);
    returns the lane's (committed, reserved).

    A writer that died inside an ``extend`` of more rows than the lane holds left a claim
    more than a lap ahead: every slot was being rewritten, so nothing below ``committed``
    survives, but the rows written from ``committed`` on are whole. The claim is trimmed to
    ``committed + capacity`` so readers' window starts at ``committed`` instead of staying
    empty until the new writer passes the dead one's claim. Slots left odd stay odd until the
    new writer restamps them (stamps derive from the index, so rewriting index ``committed``
    is idempotent).
    """
    committed, reserved = words[committed_at], words[reserved_at]
    if reserved > committed + capacity:
        reserved = committed + capacity
        words[reserved_at] = reserved
    return committed, reserved


def mark_writing(stamps: Words, at: Any, index: Any) -> None:
    """Stamp slot(s) ``at`` odd (``2*index+1``: being written), then fence so the payload
    stores that follow land after it."""
    stamps[at] = 2 * index + 1
    store_fence()


def mark_held(stamps: Words, at: Any, index: Any) -> None:
    """Fence after the payload, then stamp slot(s) ``at`` even (``2*index+2``: holds index)."""
    store_fence()
    stamps[at] = 2 * index + 2


def mark_rewriting(stamps: np.ndarray, at: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Before rewriting slots ``at`` (distinct) in place, each holding logical index ``index``:
    stamp them odd (``2i+1``) at their next rewrite version, then fence; return the stamps
    ``mark_rewritten`` publishes once the payload is stored.

    The version (bits ``VERSION_SHIFT`` up) counts the slot's rewrites, so the held stamp
    differs from every stamp a reader can have loaded before the rewrite began: a copy that
    spans the rewrite fails ``holds`` (its two loads differ) and is retried or redrawn. It
    wraps after 32768 rewrites of one slot: a reader would have to stay inside one copy of
    one row, its process stopped, through exactly a multiple of that many rewrites of it.
    Only the lane's writer lease holder rewrites, and only indices inside the lane's window:
    ``reserved`` and ``committed`` do not move.
    """
    version = (stamps[at] >> VERSION_SHIFT) + 1
    version &= VERSION_MASK
    held = version << VERSION_SHIFT
    held |= 2 * index + 2
    stamps[at] = held - 1
    store_fence()
    return held


def mark_rewritten(stamps: np.ndarray, at: np.ndarray, held: np.ndarray) -> None:
    """Fence after a rewrite's payload, then stamp slots ``at`` ``held`` (from
    ``mark_rewriting``): they hold their index again, at the new version."""
    store_fence()
    stamps[at] = held


def rewrite_rows(stamps: np.ndarray, at: np.ndarray, index: np.ndarray,
                 columns: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
    """The whole protocol of an in-place rewrite of rows ``index`` at slots ``at`` (distinct;
    ``values[f][j]`` is row j of column ``columns[f]``): versioned odd stamps, the rows, the
    versioned even stamps. The ``_meta`` words (episode, step) are left as they were."""
    held = mark_rewriting(stamps, at, index)
    for column, value in zip(columns, values):
        column[at] = value
    mark_rewritten(stamps, at, held)


def publish(words: Words, committed_at: Any, committed: Any) -> None:
    """Store ``committed`` (after the rows' even stamps): readers' windows now reach it."""
    words[committed_at] = committed


def write_row(words: Words, at: tuple[int, int, int, int, int], index: int,
              columns: Sequence[np.ndarray], values: Sequence[Any], meta: int) -> None:
    """The whole protocol for one row of one lane: the claim (``reserved = index + 1`` unless
    it is already past), odd stamp, every column's value, the ``_meta`` word, even stamp,
    ``committed = index + 1``.

    ``words`` is the segment as ``memoryview("q")``; ``at`` the lane's word offsets in it
    (first stamp, first ``_meta`` word, ``committed``, ``reserved``) and its capacity;
    ``columns`` are the lane's column views (a value of any strides stores as NumPy assigns
    it). Also publishes an episode's FINAL row (``meta`` with ``FLAG_FINAL``). The NumPy
    store's ``put`` (``store.NumpyLaneStore``); ``_add_c.c``'s ``store_row`` is the compiled
    store's, held to it byte for byte by tests/test_add_compiled.py.
    """
    stamp0, meta0, committed_at, reserved_at, capacity = at
    slot = index % capacity
    if index >= words[reserved_at]:
        words[reserved_at] = index + 1  # the claim
    words[stamp0 + slot] = 2 * index + 1
    store_fence()
    for column, value in zip(columns, values):
        column[slot] = value
    words[meta0 + slot] = meta
    store_fence()
    words[stamp0 + slot] = 2 * index + 2
    words[committed_at] = index + 1


def mark_ring_writing(stamps: np.ndarray, segments: Segments, first: int,
                      even_ramp: np.ndarray, scratch: np.ndarray) -> None:
    """Stamp indices ``first ..`` odd over ring ``segments`` of a lane's stamp view, then fence.

    ``even_ramp`` is ``2 * arange(>= longest segment)`` and ``scratch`` a 0-d int64 array, both
    the caller's (reused, so a large extend allocates nothing here).
    """
    add = np.add
    for a, b, off in segments:
        scratch[()] = 2 * (first + off) + 1
        add(even_ramp[: b - a], scratch, stamps[a:b])
    store_fence()


_ONE = np.ones((), np.int64)
_ONE.flags.writeable = False


def mark_ring_held(stamps: np.ndarray, segments: Segments) -> None:
    """Fence, then turn the odd stamps of ``mark_ring_writing`` even (``2i+1 -> 2i+2``)."""
    store_fence()
    add = np.add
    for a, b, _ in segments:
        view = stamps[a:b]
        add(view, _ONE, view)


def empty_lane(words: Words, committed_at: int, reserved_at: int, capacity: int) -> None:
    """Empty a lane's window without touching its rows: ``reserved = committed + capacity``, so
    ``lo = reserved - capacity = committed = hi``. Its writer's next row is readable again."""
    words[reserved_at] = words[committed_at] + capacity


def begin_restore(stamps: np.ndarray, words: Words, committed_at: int, reserved_at: int,
                  end: int, capacity: int) -> None:
    """Before rewriting a whole lane (``stamps`` is the lane's stamp view): nothing held, the
    lane committed up to ``end`` and its window empty while the rows are copied in."""
    stamps[:] = 0
    words[committed_at] = end
    words[reserved_at] = end + capacity
    store_fence()


def finish_restore(stamps: np.ndarray, segments: Segments, first: int, words: Words,
                   reserved_at: int, end: int, capacity: int) -> None:
    """After a restore's rows ``first .. end`` were copied into ring ``segments``: stamp them
    held, then open the window at ``first``. With fewer than ``capacity`` rows, ``end - C``
    would offer older indices whose slots hold nothing; a writer that takes the lane over
    fills those slots first."""
    store_fence()
    for a, b, off in segments:
        stamps[a:b] = 2 * (first + off + np.arange(b - a)) + 2
    words[reserved_at] = max(end, first + capacity)


def set_floor(words: Words, at: Any, index: Any) -> None:
    """Store lane floor(s) ``at`` (``layout.CLEARED_BELOW_WORD``): readers never read an index
    below ``index`` again. Only the holder of ``LOCK_CLEAR`` calls it: ``clear()`` with
    ``index = committed`` for a lane whose live writer it cannot lease (the writer goes on at
    ``committed``, untouched: its rows count as written after the clear), restores with 0.
    A floor only ever stays at or below its lane's ``committed``, so it never hides a row the
    writer publishes later."""
    words[at] = index


def clear_stamps(stamps: np.ndarray, at: Any = slice(None)) -> None:
    """Stamp slots or records ``at`` never-written (0): nothing there is held any more."""
    stamps[at] = 0


# --------------------------------------------------------------------------------------------
# Reading (anyone; never waits)
# --------------------------------------------------------------------------------------------
def read_windows(reserved: Any, committed: Any, capacity: int, cleared_below: Any = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Each lane's readable logical indices ``[lo, hi)`` from its ``reserved``, ``committed``
    and ``cleared_below`` (floor) word views.

    The writer's claim is loaded before ``committed``: read the other way round, a reader
    descheduled between the two loads pairs an old ``committed`` with a newer claim and sees a
    full lane as empty. Rows claimed after the loads are caught by the stamp checks. The floor
    (``set_floor``) is loaded last and takes the place of 0 as the lowest start, so it costs
    nothing extra; a floor newer than ``hi`` empties the window (``lo`` is clipped to ``hi``).
    """
    claimed = reserved.copy()  # the writer's claim first ...
    load_fence()
    hi = committed.copy()  # ... then committed, at least as new
    lo = np.minimum(np.maximum(np.maximum(claimed, hi) - capacity, cleared_below), hi)
    return lo, hi


def read_window(words: Words, reserved_at: int, committed_at: int, capacity: int,
                cleared_below_at: int | None = None) -> tuple[int, int]:
    """``read_windows`` for one lane, from word offsets (no array arithmetic); no
    ``cleared_below_at``: a floor of 0."""
    claimed = words[reserved_at]
    load_fence()
    hi = words[committed_at]
    floor = 0 if cleared_below_at is None else words[cleared_below_at]
    return min(max(max(claimed, hi) - capacity, floor), hi), hi


def load_stamps(stamps: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The stamps of ``slots`` (any shape), loaded before the rows they guard are copied."""
    before = stamps.take(slots)
    load_fence()
    return before


def reload_stamps(stamps: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The stamps of ``slots`` loaded again after the copy (compare with ``load_stamps``)."""
    load_fence()
    return stamps.take(slots)


def held_stamps(indices: np.ndarray) -> np.ndarray:
    """The stamps ``2i+2`` that say "holds index i", as a new array."""
    expected = indices * 2
    expected += 2
    return expected


def holds(before: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Where a row stamp loaded before a copy says "holds index i" (``indices``), at any
    rewrite version (compare it with the stamp loaded after: ``overwritten_since``)."""
    index_bits = before & INDEX_BITS
    return index_bits == held_stamps(indices)


def held_whole(before: np.ndarray, after: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Where both loads of a stamp said "holds index i" (``expected`` from ``held_stamps``):
    the rows copied between them are whole."""
    ok = before == expected
    ok &= after == expected
    return ok


def held_records(stamps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which stamps say "held", and the index (episode id, logical index) each holds there."""
    held = (stamps > 0) & (stamps % 2 == 0)
    return held, stamps // 2 - 1


def copy_held_records(stamps: np.ndarray, copy: Callable[[], T]) -> tuple[np.ndarray, np.ndarray, T]:
    """Run ``copy()`` (it copies what ``stamps`` guard, e.g. every episode record) between two
    loads of all ``stamps``; return (positions held whole, the index each holds, the copy)."""
    before = stamps.copy()
    load_fence()
    copied = copy()
    load_fence()
    held, indices = held_records(before)
    rows = np.flatnonzero(held & (before == stamps))
    return rows, indices[rows], copied


def checked_gather(stamps: np.ndarray, slots: np.ndarray, indices: np.ndarray,
                   columns: dict[str, np.ndarray], out: Any, meta: np.ndarray,
                   meta_out: np.ndarray | None = None) -> np.ndarray:
    """Copy rows ``slots`` of ``columns`` into ``out`` (name -> array) and ``meta[slots]`` into
    ``meta_out``; return which rows are whole: their stamp said "holds ``indices``" (index
    bits) before the copy and was the same stamp after it (a rewrite in place changes the
    version). One flat function: it is on every sample's path.

    ``slots`` must be in range (the copies use ``mode="clip"``, which skips the temporary that
    ``mode="raise"`` makes).
    """
    expected = indices * 2
    expected += 2
    before = stamps.take(slots)
    load_fence()
    for name, dst in out.items():
        np.take(columns[name], slots, axis=0, out=dst, mode="clip")
    if meta_out is not None:
        np.take(meta, slots, out=meta_out, mode="clip")
    load_fence()
    after = stamps.take(slots)
    ok = after == before
    before &= INDEX_BITS
    ok &= before == expected
    return ok


def overwritten_since(before: np.ndarray, after: np.ndarray, held: np.ndarray) -> np.ndarray:
    """Where a slot ``held`` at the first load (``load_stamps``) has another stamp at the
    second (``reload_stamps``): what was copied from it in between may be torn."""
    return held & (after != before)


def load_run(stamps: np.ndarray, segments: Segments, base: int) -> np.ndarray:
    """The stamps of a run of a lane's indices at slots ``base + segments``, loaded before the
    copy of their rows (pass them to ``still_held_run``)."""
    before = np.concatenate([stamps[base + a : base + b] for a, b, _ in segments])
    load_fence()
    return before


def still_held_run(stamps: np.ndarray, segments: Segments, base: int, first: int, end: int,
                   before: np.ndarray | None = None) -> np.ndarray:
    """For indices ``first .. end`` of a lane at slots ``base + segments``: which ones held
    their index all through the copy (their stamp, ``before`` from ``load_run``, the same
    after it). Without ``before``, only rows never rewritten in place count (version 0): the
    indices were in the window when the copy began, so a ring write since changed the stamp."""
    load_fence()
    after = np.concatenate([stamps[base + a : base + b] for a, b, _ in segments])
    expected = np.arange(2 * first + 2, 2 * end + 2, 2, dtype=np.int64)
    if before is None:
        return after == expected
    ok = after == before
    ok &= (before & INDEX_BITS) == expected
    return ok
