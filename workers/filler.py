"""``BatchFiller``: fills one staging slot with a batch: draw (or gather the rows the learner chose),
apply the user's transform, record which rows it holds, and count the samples with the buffer's
rate limiter. The one filler of both ways of filling: sampler workers (``sampler_proc``) and the
in-process delivery (``delivery.local``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from shmbuf import ReplayBuffer
from shmbuf.errors import EmptyBufferError, SamplingError
from shmbuf.priority import PriorityTable
from shmbuf.sampling import Draw

from .staging import INDICES, LANES, write_rows

SAMPLING_ERRORS_BEFORE_REPORT = 10  # uniform draws whose rows kept being overwritten


class Backoff:
    """Sleeps that double from ``first`` up to ``most`` seconds: cheap polls while a wait is short,
    little CPU while it is long."""

    def __init__(self, first: float = 5e-5, most: float = 2e-3) -> None:
        self.pause, self.most = first, most

    def sleep(self, at_most: float = float("inf")) -> None:
        time.sleep(max(0.0, min(self.pause, at_most)))
        self.pause = min(2 * self.pause, self.most)


# Called while a fill waits (for rows, the rate limiter, or priorities to enter): sleeps with the
# given backoff, and raises to give the fill up (the learner is gone, a timeout, a close).
Wait = Callable[[Backoff], None]


class BatchFiller:
    """Fills the slots ``slots`` (each a dict of the slot's arrays, ``staging.slot_arrays``).

    Rows are drawn uniformly (or per the compiled plan), or in proportion to ``table`` when one is
    given, or gathered from the rows already written into the slot's index arrays (learner-chosen
    rows). Without a transform they are gathered straight into the slot; with one, into private
    scratch arrays that the transform reads.

    Concurrency: one filler per sampling process, which holds sampler slot ``sampler`` of the
    limiter: it writes the staging slot it was handed (and nothing else of the ring) and, when
    ``rate_limited``, its own sample counter. ``table`` is only read.
    """

    def __init__(self, buf: ReplayBuffer, compiled: Any, slots: list[dict[str, np.ndarray]],
                 batch_size: int, out_fields: list[str], transform: Any = None,
                 min_size: int = 1, rate_limited: bool = False, sampler: int = 0,
                 table: PriorityTable | None = None) -> None:
        self.buf, self.compiled, self.slots = buf, compiled, slots
        self.batch_size, self.out_fields, self.transform = batch_size, out_fields, transform
        self.min_size, self.rate_limited, self.sampler = min_size, rate_limited, sampler
        self.table = table
        self.limiter = buf.storage.limiter
        names = [name for name, _, _ in compiled.outputs]
        self.scratch: dict[str, np.ndarray] = (
            compiled.allocate(batch_size) if transform is not None else {})
        # Where rows are gathered, per slot: the slot itself, or the scratch arrays.
        self.targets = [{name: slot[name] for name in names} if transform is None
                        else self.scratch for slot in slots]

    def can_draw(self) -> bool:
        """May a batch be drawn now (``min_size``, the rate limiter, priorities entered)?"""
        if self.table is not None and not self.table.total() > 0:
            return False  # the learner has not entered any row's priority yet
        return self.limiter.can_sample(self.batch_size, self.min_size, self.rate_limited)

    def wait_until_drawable(self, wait: Wait) -> None:
        """Return once ``can_draw``; ``wait`` sleeps in between (and may raise to give up)."""
        if self.can_draw():  # the usual case: no backoff to make
            return
        backoff = Backoff()
        while not self.can_draw():
            wait(backoff)

    def draw(self, slot: int, rng: np.random.Generator, wait: Wait) -> None:
        """Fill ``slot`` with a batch drawn now (after ``wait_until_drawable``); ``wait`` sleeps
        while prioritized draws find only rows the learner has not entered yet."""
        draw = self._sample(self.targets[slot], rng, wait)
        write_rows(self.slots[slot], draw.lanes, draw.indices, draw.probs, draw.pmin)
        self._finish(slot)

    def gather(self, slot: int) -> bool:
        """Fill ``slot`` with the rows written into its index arrays; False (nothing counted)
        if one was overwritten before it was read."""
        arrays = self.slots[slot]
        lanes, indices = arrays[LANES].copy(), arrays[INDICES].copy()
        if not self.buf.gather_at(self.targets[slot], lanes, indices, plan=self.compiled):
            return False
        self._finish(slot)
        return True

    def _sample(self, target: dict[str, np.ndarray], rng: np.random.Generator, wait: Wait) -> Draw:
        if self.table is not None:
            return self._sample_prioritized(self.table, target, rng, wait)
        errors = 0
        while True:
            try:
                return self.buf.sample_into(target, rng, plan=self.compiled)
            except (SamplingError, EmptyBufferError):  # rows overwritten, or a clear()
                errors += 1
                if errors == SAMPLING_ERRORS_BEFORE_REPORT:
                    raise  # reported
            # A clear() since wait_until_drawable looked: wait for rows again (the usual retry
            # of overwritten rows does not wait; an empty buffer that still looks drawable
            # fails again at once and is reported).
            self.wait_until_drawable(wait)

    def _sample_prioritized(self, table: PriorityTable, target: dict[str, np.ndarray],
                            rng: np.random.Generator, wait: Wait) -> Draw:
        # A leaf whose row was overwritten by one the learner has not entered yet delivers the
        # slot's current occupant (``draw_held``); only leaves of slots being written right now
        # are redrawn. Should every draw keep landing there (or nothing be entered yet), that
        # is "not ready yet", not an error: wait for the learner's next sync.
        backoff = Backoff(1e-4, 5e-3)
        while True:
            try:
                return self.buf.sample_into(target, rng, plan=self.compiled,
                                            sampler=table.draw_held)
            except (SamplingError, EmptyBufferError):
                wait(backoff)

    def _finish(self, slot: int) -> None:
        """Transform the gathered rows into the slot; count the samples."""
        if self.transform is not None:
            self._transform(self.slots[slot])
        if self.rate_limited:
            self.limiter.record_samples(self.sampler, self.batch_size)

    def _transform(self, arrays: dict[str, np.ndarray]) -> None:
        batch = dict(self.scratch)
        result = self.transform(batch)
        result = batch if result is None else result
        for name in self.out_fields:
            value = np.asarray(result[name])
            dst = arrays[name]
            if value.shape != dst.shape:
                raise ValueError(
                    f"transform returned {name!r} with shape {value.shape}, but its first "
                    f"result had {dst.shape}: a transform must keep shapes and dtypes fixed"
                )
            np.copyto(dst, value, casting="same_kind")

    def close(self) -> None:
        """Drop the views of the slots (before their memory is unmapped)."""
        self.slots, self.targets, self.scratch = [], [], {}
