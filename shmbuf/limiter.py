"""Reverb-style rate limiting between writers and samplers, kept in the buffer's segment.

``RateLimit`` is the pure math (Reverb's ``SampleToInsertRatio``): sampling waits until
``min_size`` transitions were inserted; with ``samples_per_insert=(ratio, tolerance)`` the
difference ``inserts * ratio - samples`` must stay within ``min_size * ratio -/+ tolerance``, so
samplers wait when they run ahead and writers wait when they do.

``LimiterBlock`` reads and writes that state in shared memory.

Concurrency: the config words are written only by the pool holding ``LOCK_LIMITER`` (it bumps
``generation`` last). Sampler counter j is written only by the process holding sampler slot j.
Inserts are the lanes' ``committed`` counters, each written by its lane's writer. Everyone else
only loads, and nobody waits on a lock a dead process could hold: a limiter whose owner died is
treated as inactive.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from . import layout as L

_F64 = struct.Struct("<d")


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


class LimiterBlock:
    """The limiter region of a replay buffer segment, read through a ``memoryview`` of int64.

    ``words`` is the whole segment cast to int64; ``layout`` the buffer's layout.
    """

    def __init__(self, words: memoryview, mm: object, layout: L.BufferLayout) -> None:
        self._q = words
        self._mm = mm
        self._layout = layout
        self._cfg = layout.limiter_offset // 8
        self._ctr = layout.sampler_counter(0) // 8
        self._committed = [
            layout.lane_word(k, L.LANE_COMMITTED) // 8 for k in range(layout.lanes)
        ]

    def _word(self, w: int) -> int:
        return self._cfg + w * L.WORDS_PER_LINE

    def _f64(self, w: int) -> float:
        return _F64.unpack_from(self._mm, (self._cfg + w * L.WORDS_PER_LINE) * 8)[0]

    def generation(self) -> int:
        return self._q[self._word(L.LIM_GENERATION)]

    def active(self) -> bool:
        return self._q[self._word(L.LIM_ACTIVE)] == 1

    def read(self) -> tuple[int, RateLimit | None, int, int]:
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

    def total_committed(self) -> int:
        q = self._q
        return sum(q[w] for w in self._committed)

    def samples(self, n_samplers: int) -> int:
        q = self._q
        base = self._ctr
        return sum(q[base + j * L.WORDS_PER_LINE] for j in range(n_samplers))

    def counter_index(self, slot: int) -> int:
        """Index into the int64 word view of sampler counter ``slot``."""
        return self._ctr + slot * L.WORDS_PER_LINE

    # -- writes: only the holder of LOCK_LIMITER ----------------------------------------------
    def configure(self, limit: RateLimit, n_samplers: int, credit: int = 0) -> None:
        """Activate ``limit`` for samplers [0, n_samplers); zero their counters.

        Inserts are counted from now, plus ``credit`` for rows already present (a pool started on
        a pre-filled buffer passes ``min(len(buf), min_size)`` so it starts at equilibrium).
        """
        if not 0 < n_samplers <= L.MAX_SAMPLERS:
            raise ValueError(f"n_samplers must be in [1, {L.MAX_SAMPLERS}], got {n_samplers}")
        q = self._q
        for j in range(n_samplers):
            q[self.counter_index(j)] = 0
        spi = limit.samples_per_insert or 0.0
        mm = self._mm
        _F64.pack_into(mm, self._word(L.LIM_SPI) * 8, spi)
        _F64.pack_into(mm, self._word(L.LIM_MIN_DIFF) * 8, limit.min_diff if spi else 0.0)
        _F64.pack_into(mm, self._word(L.LIM_MAX_DIFF) * 8, limit.max_diff if spi else 0.0)
        q[self._word(L.LIM_MIN_SIZE)] = int(limit.min_size)
        q[self._word(L.LIM_INSERTS_BASE)] = self.total_committed() - int(credit)
        q[self._word(L.LIM_N_SAMPLERS)] = n_samplers
        q[self._word(L.LIM_ACTIVE)] = 1
        q[self._word(L.LIM_GENERATION)] = q[self._word(L.LIM_GENERATION)] + 1

    def deactivate(self) -> None:
        q = self._q
        q[self._word(L.LIM_ACTIVE)] = 0
        q[self._word(L.LIM_QUEUE)] = 0
        q[self._word(L.LIM_GENERATION)] = q[self._word(L.LIM_GENERATION)] + 1

    def queue_active(self) -> bool:
        return self._q[self._word(L.LIM_QUEUE)] == 1

    def set_queue(self, on: bool) -> None:
        """Queue mode on or off (the holder of LOCK_LIMITER only): writers then wait while
        their lane holds ``capacity`` rows not yet delivered (``LANE_RELEASED``)."""
        q = self._q
        q[self._word(L.LIM_QUEUE)] = 1 if on else 0
        q[self._word(L.LIM_GENERATION)] = q[self._word(L.LIM_GENERATION)] + 1

