"""Reverb-style rate limiting between writers and samplers, kept in the buffer's segment.

``RateLimit`` is the pure math (Reverb's ``SampleToInsertRatio``): sampling waits until
``min_size`` transitions were inserted; with ``samples_per_insert=(ratio, tolerance)`` the
difference ``inserts * ratio - samples`` must stay within ``min_size * ratio -/+ tolerance``, so
samplers wait when they run ahead and writers wait when they do. ``Limiter`` is the whole
contract over the segment's limiter block: every writer, sampler and pool goes through it.
"""

from __future__ import annotations

import math
import mmap
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from . import layout as L
from . import slots
from .errors import RateLimitTimeout, ShmbufError

if TYPE_CHECKING:
    from .lease import Lease
    from .segment import Segment

_F64 = struct.Struct("<d")
ROOM_CHECK_EVERY = 4096  # rows between heartbeat / rate-limiter refreshes when unlimited


@dataclass(frozen=True)
class RateLimit:
    """When sampling and inserting may proceed.

    Args:
        min_size: transitions that must be inserted before anything is sampled.
        samples_per_insert: average number of times each inserted transition is sampled, or
            None for no ratio (only ``min_size`` applies).
        tolerance: how far (in samples) the ratio may drift either way before one side waits.
            Must be at least the batch size, or samplers could never proceed.
    """

    min_size: int = 1
    samples_per_insert: float | None = None
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        if int(self.min_size) < 1:
            raise ValueError(f"min_size must be >= 1, got {self.min_size}")
        spi = self.samples_per_insert
        if spi is not None and not (math.isfinite(spi) and spi > 0):
            raise ValueError(f"samples_per_insert ratio must be finite and > 0, got {spi}")
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError(f"samples_per_insert tolerance must be >= 0, got {self.tolerance}")

    @property
    def min_diff(self) -> float:
        if self.samples_per_insert is None:
            return -math.inf
        return self.min_size * self.samples_per_insert - self.tolerance

    @property
    def max_diff(self) -> float:
        if self.samples_per_insert is None:
            return math.inf
        return self.min_size * self.samples_per_insert + self.tolerance

    def can_sample(self, inserts: int, samples: int, n: int) -> bool:
        """May ``n`` more rows be sampled? (Reverb's CanSample.)"""
        if inserts < self.min_size:
            return False
        if self.samples_per_insert is None:
            return True
        return inserts * self.samples_per_insert - samples - n >= self.min_diff

    def can_insert(self, inserts: int, samples: int, n: int) -> bool:
        """May ``n`` more rows be inserted? (Reverb's CanInsert.)"""
        if self.samples_per_insert is None or inserts + n <= self.min_size:
            return True
        return (inserts + n) * self.samples_per_insert - samples <= self.max_diff

    def inserts_allowed(self, inserts: int, samples: int) -> int:
        """The largest n for which ``can_insert(inserts, samples, n)`` holds (may be huge)."""
        if self.samples_per_insert is None:
            return 1 << 62
        by_ratio = math.floor((self.max_diff + samples) / self.samples_per_insert) - inserts
        n = max(0, self.min_size - inserts, by_ratio)
        # The division rounds; settle the last row with can_insert's own arithmetic.
        while n > 0 and not self.can_insert(inserts, samples, n):
            n -= 1
        while self.can_insert(inserts, samples, n + 1):
            n += 1
        return n

    def max_insert_chunk(self) -> int:
        """The most rows one call may insert at once and still be sure to get through.

        ``tolerance / samples_per_insert`` rows: samplers that take whole batches of up to
        ``tolerance`` rows can stop anywhere below ``min_diff + batch``, and a chunk crossing
        ``min_size`` starts from no samples at all; a larger chunk could wait for samplers that
        wait for it.
        """
        if self.samples_per_insert is None:
            return 1 << 62
        return max(1, math.floor(self.tolerance / self.samples_per_insert))


class Limiter:
    """The rate limiter of one buffer, over its segment's limiter block (``layout.LIM_*``).

    Writers call ``wait_for_insert`` before they publish rows; samplers ask ``can_sample``
    before they draw (once per batch, on every sampling path: worker draws, learner-selected
    rows, in-process) and ``record_samples`` once the batch is gathered; the pool that drives
    the limit ``take``s it, then ``configure``s it (a ratio) or ``open_queue``s it (queue mode:
    ``consume`` as the learner releases batches, ``close_queue`` at a clean close), and
    ``deactivate``s it; it reads ``blocked_reason`` and ``stats`` (a holder whose counts are
    kept elsewhere sets them with ``set_counts``).

    The queue outlives its learner: the lanes' consumed cursors (``LANE_CONSUMED``) stay in the
    segment, writers go on waiting on them while no learner holds the lock, and the next
    ``open_queue`` resumes after them. A ratio limit whose holder died is void at once.

    Concurrency (who writes which word; everyone else only loads):

    - the config lines (``LIM_SPI``, ``LIM_MIN_DIFF``, ``LIM_MAX_DIFF``, ``LIM_MIN_SIZE``,
      ``LIM_INSERTS_BASE``, ``LIM_N_SAMPLERS``, ``LIM_ACTIVE``, ``LIM_QUEUE``,
      ``LIM_GENERATION``): only the process holding ``LOCK_LIMITER`` (``take``), through
      ``configure``, ``set_counts``, ``open_queue``, ``close_queue`` and ``deactivate``; each
      bumps ``LIM_GENERATION`` last, so a writer that sees the generation it read before may
      keep the room it was granted;
    - sampler counter j (``layout.sampler_counter(j)``): only the process holding sampler slot
      j of the limiting pool (worker j, or the in-process pool as sampler 0), through
      ``record_samples``; ``configure`` zeroes them before it activates the limit; a holder of
      ``LOCK_LIMITER`` whose samples are counted elsewhere (a ``ReplayCluster`` host) is
      sampler 0's holder and sets it, with ``LIM_INSERTS_BASE``, through ``set_counts``;
    - inserts are the lanes' ``committed`` words, each stored by its lane's writer (``slots``);
      the lanes' consumed cursors (``LANE_CONSUMED``): only the holder of ``LOCK_LIMITER``, through
      ``open_queue`` and ``consume`` (a queue pool's learner, as it releases batches);
      a lane's floor (``CLEARED_BELOW_WORD``) by ``clear()``: rows below it are neither held
      (``_size``) nor waiting for delivery.

    Nobody waits on a lock a dead process could hold: a writer that finds no room probes
    ``LOCK_LIMITER``, and a ratio whose pool died is treated as lifted. A queue is not: its
    writers wait (up to their timeout) for the next learner, which resumes where the dead one
    stopped, so no row is lost. Samplers that check concurrently may each take one batch past
    the limit (Reverb serialises them; we do not).
    """

    def __init__(self, segment: Segment, mm: mmap.mmap, layout: L.BufferLayout,
                 words: memoryview, committed: np.ndarray, reserved: np.ndarray,
                 consumed: np.ndarray, cleared_below: np.ndarray) -> None:
        self._segment = segment
        self._mm = mm  # the segment's mapping (f64 words); closing it is the segment's business
        self._q = words
        self._capacity = layout.capacity
        self._lanes = layout.lanes
        self._committed_v, self._reserved_v, self._consumed_v = committed, reserved, consumed
        self._floor_v = cleared_below
        self._cfg = layout.limiter_offset // 8
        self._ctr = layout.sampler_counter(0) // 8
        self._committed = [
            layout.lane_word(k, L.LANE_COMMITTED) // 8 for k in range(layout.lanes)
        ]
        self.generation_index = self._word(L.LIM_GENERATION)
        """Index in the segment's int64 words of the generation: writers compare it to the
        generation ``wait_for_insert`` returned before each insert."""

    def drop_views(self) -> None:
        """Let go of the segment's memory (the storage is closing); the limiter is unusable."""
        self._q = self._committed_v = self._reserved_v = self._consumed_v = None  # type: ignore[assignment]
        self._floor_v = None  # type: ignore[assignment]

    # -- reading the block ------------------------------------------------------------------------
    def _word(self, w: int) -> int:
        return self._cfg + w * L.WORDS_PER_LINE

    def _f64(self, w: int) -> float:
        value: float = _F64.unpack_from(self._mm, (self._cfg + w * L.WORDS_PER_LINE) * 8)[0]
        return value

    def _read(self) -> tuple[int, RateLimit | None, int, int]:
        """(generation, limit or None if inactive, inserts_base, n_samplers)."""
        q = self._q
        gen = q[self._word(L.LIM_GENERATION)]
        if q[self._word(L.LIM_ACTIVE)] != 1:
            return gen, None, 0, 0
        spi = self._f64(L.LIM_SPI)
        min_size = q[self._word(L.LIM_MIN_SIZE)]
        tol = 0.0
        if spi > 0:
            tol = (self._f64(L.LIM_MAX_DIFF) - self._f64(L.LIM_MIN_DIFF)) / 2
        limit = RateLimit(int(min_size), spi if spi > 0 else None, max(0.0, tol))
        return gen, limit, q[self._word(L.LIM_INSERTS_BASE)], q[self._word(L.LIM_N_SAMPLERS)]

    def _total_committed(self) -> int:
        q = self._q
        return sum(q[w] for w in self._committed)

    def _samples(self, n_samplers: int) -> int:
        q = self._q
        base = self._ctr
        return sum(q[base + j * L.WORDS_PER_LINE] for j in range(n_samplers))

    def _queue_active(self) -> bool:
        return self._q[self._word(L.LIM_QUEUE)] == 1

    def _unconsumed(self, lanes: Any) -> np.ndarray:
        """Per lane of ``lanes``: rows committed and not yet consumed by a queue's learner. Rows
        below a lane's floor were cleared: they wait for nobody. (A cursor past ``committed``,
        left by a lane emptied for a restore, counts as all consumed.)"""
        committed = self._committed_v[lanes]
        done = np.maximum(self._consumed_v[lanes], self._floor_v[lanes])
        return committed - np.minimum(done, committed)

    def _size(self) -> int:
        """Rows readable now, over all lanes (``BufferStorage.windows().total``)."""
        lo, hi = slots.read_windows(self._reserved_v, self._committed_v, self._capacity,
                                    self._floor_v)
        return int((hi - lo).sum())

    # -- writers ---------------------------------------------------------------------------------
    def wait_for_insert(self, n: int, timeout: float, check_open: Callable[[], None], who: str,
                        lanes: Any) -> tuple[int, int]:
        """Wait until ``n`` more rows may be inserted into each of ``lanes``; return (rows
        allowed per lane before the next check, the generation read).

        Two limits apply when a pool sets them: the samples-per-insert ratio, and queue mode (a
        lane may hold at most ``capacity`` rows not yet consumed). The ratio is lifted at once
        if the pool that set it dies; the queue holds until the next queue pool resumes it (or
        a pool closes it cleanly). ``check_open`` is called while waiting (it raises to end the
        wait: a closed or stopped writer).

        Raises:
            RateLimitTimeout: not within ``timeout`` (nothing was written).
            ValueError: ``n`` rows can never fit.
        """
        deadline = time.monotonic() + timeout
        pause = 5e-5
        capacity = self._capacity
        while True:
            gen, limit, base, n_samplers = self._read()
            queue = self._queue_active()
            if limit is None and not queue:
                return max(4 * n, ROOM_CHECK_EVERY), gen
            room, why = 1 << 62, ""  # rows the limits allow now
            if queue:
                if n > capacity:
                    raise ValueError(
                        f"{n} rows at once can never fit a queue of {capacity} rows per lane. "
                        f"Fix: split the batch"
                    )
                undelivered = self._unconsumed(lanes)
                room = min(room, int(capacity - undelivered.max()))
                why = f"the queue is full ({int(undelivered.max())} rows not yet consumed)"
            if limit is not None:
                inserts = self._total_committed() - base
                samples = self._samples(n_samplers)
                allowed = limit.inserts_allowed(inserts, samples)
                if allowed < n and inserts + n > limit.min_size and n > limit.max_insert_chunk():
                    raise ValueError(
                        f"{n} rows at once can never pass the rate limiter: with "
                        f"samples_per_insert={limit.samples_per_insert} and tolerance "
                        f"{limit.tolerance}, at most {limit.max_insert_chunk()} rows fit at "
                        f"once. Fix: split the batch, or raise the tolerance"
                    )
                # Share the headroom with the other lanes' writers: the ratio then holds to
                # within about one insert per writer without any cross-process lock.
                room = min(room, max(allowed // self._lanes, min(allowed, n)))
                if allowed < n:
                    why = (f"inserts {inserts}, samples {samples}, samples_per_insert "
                           f"{limit.samples_per_insert}: the samplers are not keeping up")
            if room >= n:
                return min(room, max(n, ROOM_CHECK_EVERY)), gen
            if not queue and not self._segment.probe(L.LOCK_LIMITER):
                # The pool that set the ratio died without lifting it: nobody samples any more,
                # so the limit is void, as if lifted. Grant a whole check interval (not just
                # ``n``, which would send every later row through this probe); a pool that
                # limits the buffer again bumps the generation, which writers notice at once.
                # (A queue holds: its next learner resumes at the consumed cursors.)
                return max(4 * n, ROOM_CHECK_EVERY), gen
            check_open()
            now = time.monotonic()
            if now >= deadline:
                fix = ("a larger timeout, or a learner that takes batches faster (with no "
                       "learner, open a queue pool: it resumes the queue; closing one cleanly "
                       "ends queue mode)" if queue else
                       "a larger timeout, more sampling, or a larger samples_per_insert "
                       "tolerance")
                raise RateLimitTimeout(
                    f"{who}: waited {timeout}s for room for {n} row(s): {why}. Nothing was "
                    f"written. Fix: {fix}"
                )
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 2e-3)

    # -- samplers --------------------------------------------------------------------------------
    def can_sample(self, batch_size: int, min_size: int, limited: bool = True) -> bool:
        """May a batch of ``batch_size`` rows be drawn now? The active limit's verdict when
        ``limited`` (the caller's pool drives the limiter), else: the buffer holds ``min_size``
        rows."""
        if limited:
            _, limit, base, n_samplers = self._read()
            if limit is not None:
                inserts = self._total_committed() - base
                return limit.can_sample(inserts, self._samples(n_samplers), batch_size)
        return self._size() >= min_size

    def record_samples(self, sampler: int, n: int) -> None:
        """Count ``n`` rows sampled by sampler slot ``sampler`` (its holder only)."""
        q, at = self._q, self._ctr + sampler * L.WORDS_PER_LINE
        q[at] = q[at] + n

    def blocked_reason(self, batch_size: int, min_size: int, limited: bool = True) -> str | None:
        """Why ``can_sample`` says no (too few rows, or the ratio), and what to do; None if it
        does not."""
        size = self._size()
        if size < min_size:
            return (f"the buffer holds {size} of min_size={min_size} transitions; are the "
                    f"actors writing to {self._segment.name!r}?")
        if limited:
            _, limit, base, n_samplers = self._read()
            if limit is not None:
                inserts = self._total_committed() - base
                samples = self._samples(n_samplers)
                if not limit.can_sample(inserts, samples, batch_size):
                    return (f"the rate limiter holds sampling back (inserts {inserts}, samples "
                            f"{samples}, samples_per_insert {limit.samples_per_insert}): "
                            f"actors are not inserting fast enough")
        return None

    def stats(self) -> dict[str, Any]:
        """A snapshot: ``generation``, ``active``, ``queue``; while active also ``min_size``,
        ``samples_per_insert``, ``tolerance``, ``n_samplers``, and the ``inserts`` and
        ``samples`` the limit counts."""
        gen, limit, base, n_samplers = self._read()
        out: dict[str, Any] = {"generation": gen, "active": limit is not None,
                               "queue": self._queue_active()}
        if limit is not None:
            out.update(min_size=limit.min_size, samples_per_insert=limit.samples_per_insert,
                       tolerance=limit.tolerance, n_samplers=n_samplers,
                       inserts=self._total_committed() - base, samples=self._samples(n_samplers))
        return out

    # -- the pool that drives it (holds LOCK_LIMITER) ---------------------------------------------
    def take(self) -> Lease:
        """Take ``LOCK_LIMITER``: the returned lease makes this process the limiter's only
        writer until it is closed (or the process dies, which lifts the limits).

        Raises:
            ShmbufError: another pool holds it.
        """
        lease = self._segment.lease()
        if not lease.try_lock(L.LOCK_LIMITER):
            lease.close()
            raise ShmbufError(
                f"another SamplerPool already rate-limits buffer {self._segment.name!r}; only "
                f"one pool may set a RateLimit ratio or selection=Queue() on a buffer at a time"
            )
        return lease

    def configure(self, limit: RateLimit, n_samplers: int, credit: int = 0) -> int:
        """Activate ``limit`` for samplers [0, n_samplers); zero their counters.

        Inserts are counted from now, plus ``credit`` for rows already present (a pool started on
        a pre-filled buffer passes ``min(len(buf), min_size)`` so it starts at equilibrium).

        Returns:
            the total of the lanes' ``committed`` counters the inserts are counted from.
        """
        if not 0 < n_samplers <= L.MAX_SAMPLERS:
            raise ValueError(f"n_samplers must be in [1, {L.MAX_SAMPLERS}], got {n_samplers}")
        q = self._q
        for j in range(n_samplers):
            q[self._ctr + j * L.WORDS_PER_LINE] = 0
        spi = limit.samples_per_insert or 0.0
        mm = self._mm
        _F64.pack_into(mm, self._word(L.LIM_SPI) * 8, spi)
        _F64.pack_into(mm, self._word(L.LIM_MIN_DIFF) * 8, limit.min_diff if spi else 0.0)
        _F64.pack_into(mm, self._word(L.LIM_MAX_DIFF) * 8, limit.max_diff if spi else 0.0)
        q[self._word(L.LIM_MIN_SIZE)] = int(limit.min_size)
        origin = self._total_committed()
        q[self._word(L.LIM_INSERTS_BASE)] = origin - int(credit)
        q[self._word(L.LIM_N_SAMPLERS)] = n_samplers
        q[self._word(L.LIM_ACTIVE)] = 1
        q[self._word(L.LIM_QUEUE)] = 0  # a dead queue learner's queue ends: a ratio replaces it
        q[self._word(L.LIM_GENERATION)] = q[self._word(L.LIM_GENERATION)] + 1
        return origin

    def set_counts(self, inserts_elsewhere: int, samples: int) -> None:
        """Count inserts as this buffer's committed rows (all ever) plus ``inserts_elsewhere``,
        and ``samples`` rows as sampled (a limit configured for one sampler): for a limit whose
        counts are kept elsewhere, e.g. a ``ReplayCluster`` node holding its writers to the
        cluster-wide counts the learner reports. Bumps the generation: writers recheck the
        room granted before, which may have shrunk."""
        q = self._q
        q[self._word(L.LIM_INSERTS_BASE)] = -int(inserts_elsewhere)
        q[self._ctr] = int(samples)  # second: a reader between the two stores is held stricter
        q[self._word(L.LIM_GENERATION)] = q[self._word(L.LIM_GENERATION)] + 1

    def deactivate(self) -> None:
        """Lift every limit (ratio and queue)."""
        q = self._q
        q[self._word(L.LIM_ACTIVE)] = 0
        q[self._word(L.LIM_QUEUE)] = 0
        q[self._word(L.LIM_GENERATION)] = q[self._word(L.LIM_GENERATION)] + 1

    def open_queue(self) -> np.ndarray:
        """Queue mode on (holder of ``LOCK_LIMITER`` only): writers wait while a lane holds
        ``capacity`` rows not yet consumed. Returns per lane the first row to deliver: the
        consumed cursor a queue left (a learner's, dead or closed), or the oldest row held if
        writers have overwritten rows past it since (the queue was closed meanwhile)."""
        lo, hi = slots.read_windows(self._reserved_v, self._committed_v, self._capacity,
                                    self._floor_v)
        first = np.clip(self._consumed_v, lo, hi).astype(np.int64)
        self._consumed_v[...] = first
        q = self._q
        q[self._word(L.LIM_QUEUE)] = 1
        q[self._word(L.LIM_GENERATION)] = q[self._word(L.LIM_GENERATION)] + 1
        return first

    def consume(self, lanes: Any, indices: Any) -> None:
        """Rows ``(lanes, indices)`` were consumed (their batch released; holder only): each
        lane's cursor moves past the last of them. Batches leave a queue in order and each
        lane's rows in order, so every earlier row of the lane was consumed before them."""
        ends = np.asarray(indices, np.int64).reshape(-1) + 1
        np.maximum.at(self._consumed_v, np.asarray(lanes, np.int64).reshape(-1), ends)

    def consumed(self) -> np.ndarray:
        """A copy of the lanes' consumed cursors (rows below were consumed by a queue)."""
        return self._consumed_v.copy()

    def close_queue(self) -> None:
        """Queue mode off at a clean close (holder only): writers go on; the cursors stay, and
        a later queue resumes after them (rows writers overwrite meanwhile are skipped)."""
        q = self._q
        q[self._word(L.LIM_QUEUE)] = 0
        q[self._word(L.LIM_GENERATION)] = q[self._word(L.LIM_GENERATION)] + 1
