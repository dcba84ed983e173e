"""The sampler worker process: fills staging slots the learner assigns to it, one batch each.

Protocol with the learner, over this worker's own socketpair (``channel.Channel`` records):
learner -> worker ``FILL(slot, generation)`` (draw and gather a batch), ``GATHER(slot,
generation)`` (gather the rows the learner wrote into the slot's index arrays) or ``STOP``;
worker -> learner ``HELLO`` once set up, ``READY(slot, generation)`` after a slot is completely
written, ``STALE(slot, generation)`` when a row to gather was overwritten first, ``ERROR
(traceback)`` when user code fails. A slot is only ever announced after its last byte is written, so a worker killed
mid-fill can never hand over a half-filled batch.

The worker exits by itself when the learner is gone: its pipe reaches EOF, or the staging
segment's owner lease is free (checked at least every ``LIVENESS_EVERY`` seconds).

"""

from __future__ import annotations

import collections
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import numpy as np

from shmbuf import ReplayBuffer
from shmbuf.errors import EmptyBufferError, SamplingError
from shmbuf.priority import PriorityTable

from .channel import OP_ERROR, OP_HELLO, OP_STOP, Channel
from .staging import (
    FILLING,
    INDICES,
    LANES,
    PMIN,
    PROBS,
    READY,
    W_OWNER,
    W_SEQ,
    W_STATE,
    StagingRing,
)

OP_READY, OP_STALE = 2, 4  # besides channel.OP_HELLO and OP_ERROR
OP_FILL, OP_GATHER = 10, 12  # GATHER: the learner wrote the rows into the slot (and OP_STOP)
LIVENESS_EVERY = 0.5
SAMPLING_ERRORS_BEFORE_REPORT = 10


@dataclass
class SamplerConfig:
    """Everything a worker needs; cloudpickled once in the learner."""

    buffer: str
    staging: str
    batch_size: int
    fields: list[str] | None  # buffer fields to read (None: all)
    out_fields: list[str]  # staging fields (transform output, or ``fields``)
    transform: Any = None
    min_size: int = 1
    rate_limited: bool = False
    plan: Any = None  # shmbuf.sampling.Plan
    priority_table: str | None = None  # workers draw from it (read-only) when set
    extra: dict[str, Any] = field(default_factory=dict)


class LearnerGone(Exception):
    """The learner process is gone: the worker exits quietly."""


def sampler_main(sock: Any, cfg_bytes: bytes, worker_id: int, seed: Any) -> None:
    """Entry point of a sampler worker process (any start method)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the learner's; it stops us
    chan = Channel(sock)
    worker = None
    try:
        worker = _Worker(cloudpickle.loads(cfg_bytes), chan, worker_id, seed)
        chan.send(OP_HELLO, worker_id)
        worker.run()
    except LearnerGone:
        pass
    except BaseException:
        try:
            chan.send_text(OP_ERROR, traceback.format_exc())
        except OSError:
            pass
    finally:
        if worker is not None:
            worker.close()
        chan.close()


class _Worker:
    def __init__(self, cfg: SamplerConfig, chan: Channel, worker_id: int, seed: Any) -> None:
        self.cfg = cfg
        self.chan = chan
        self.wid = worker_id
        self.rng = np.random.default_rng(seed)
        self.buf = ReplayBuffer.attach(cfg.buffer)
        self.ring = StagingRing.attach(cfg.staging)
        self.batch_size = cfg.batch_size
        self.pending: collections.deque[tuple[int, int, int]] = collections.deque()
        self.seq = 0
        self.next_liveness = time.monotonic() + LIVENESS_EVERY
        self.limiter = self.buf.storage.limiter
        self.table = PriorityTable.attach(cfg.priority_table) if cfg.priority_table else None
        self.transform = cfg.transform
        self.compiled = self.buf.compile(cfg.plan, cfg.fields)
        names = [n for n, _, _ in self.compiled.outputs]
        self.scratch = self.compiled.allocate(cfg.batch_size) if self.transform is not None else None
        # Without a transform, rows are gathered straight into each slot's views.
        self.targets = (
            [{n: self.ring.slot(s)[n] for n in names} for s in range(self.ring.n_slots)]
            if self.transform is None
            else []
        )

    # -- messages -------------------------------------------------------------------------------
    def _receive(self, timeout: float) -> None:
        """Move messages into ``pending`` (waiting up to ``timeout``); LearnerGone on EOF."""
        if timeout > 0 and not self.chan.wait(timeout):
            return
        msgs, eof = self.chan.receive()
        self.pending.extend((op, a, b) for op, a, b, _ in msgs)
        if eof:
            raise LearnerGone

    def _check_learner(self) -> None:
        now = time.monotonic()
        if now >= self.next_liveness:
            self.next_liveness = now + LIVENESS_EVERY
            if not self.ring.seg.owner_alive():
                raise LearnerGone

    def run(self) -> None:
        while True:
            if not self.pending:
                self._receive(LIVENESS_EVERY)
                self._check_learner()
                continue
            op, slot, gen = self.pending.popleft()
            if op == OP_STOP:
                return
            if op == OP_FILL:
                self._fill(slot, gen)
            elif op == OP_GATHER:
                self._fill(slot, gen, given=True)

    # -- filling --------------------------------------------------------------------------------
    def _ready_to_sample(self) -> bool:
        if self.table is not None and not self.table.sums[:, 1].sum() > 0:
            return False  # the learner has not entered any row's priority yet
        return self.limiter.can_sample(self.batch_size, self.cfg.min_size, self.cfg.rate_limited)

    def _wait_can_sample(self) -> None:
        pause = 5e-5
        while not self._ready_to_sample():
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
            self._check_learner()
            self._receive(0)
            if any(op == OP_STOP for op, _, _ in self.pending):
                raise LearnerGone  # asked to stop while waiting: nothing half-written

    def _fill(self, slot: int, gen: int, given: bool = False) -> None:
        if not given:
            self._wait_can_sample()
        ring = self.ring
        ring.set(slot, W_OWNER, self.wid)
        ring.set(slot, W_STATE, FILLING)
        views = ring.slot(slot)
        if given:
            if not self._gather_given(slot, views):
                try:
                    self.chan.send(OP_STALE, slot, gen)
                except OSError:
                    raise LearnerGone from None
                return
        else:
            draw = self._sample(slot, views)
            views[INDICES][...] = draw.indices
            views[LANES][...] = draw.lanes
            if draw.probs is not None:
                views[PROBS][...], views[PMIN][0] = draw.probs, draw.pmin
        if self.cfg.rate_limited:
            self.limiter.record_samples(self.wid, self.batch_size)
        ring.set(slot, W_SEQ, self.seq)
        self.seq += 1
        ring.set(slot, W_STATE, READY)
        try:
            self.chan.send(OP_READY, slot, gen)
        except OSError:
            raise LearnerGone from None

    def _gather_given(self, slot: int, views: dict[str, np.ndarray]) -> bool:
        """Gather the rows the learner chose; False if one was overwritten first."""
        target = self.targets[slot] if self.transform is None else self.scratch
        if not self.buf.storage.gather(views[LANES].copy(), views[INDICES].copy(), target).all():
            return False
        self._apply_transform(views)
        return True

    def _sample(self, slot: int, views: dict[str, np.ndarray]) -> Any:
        target = self.targets[slot] if self.transform is None else self.scratch
        if self.table is not None:
            draw = self._sample_prioritized(target)
        else:
            for attempt in range(SAMPLING_ERRORS_BEFORE_REPORT):
                try:
                    draw = self.buf.sample_into(target, self.rng, plan=self.compiled)
                    break
                except SamplingError:
                    if attempt == SAMPLING_ERRORS_BEFORE_REPORT - 1:
                        raise
        self._apply_transform(views)
        return draw

    def _sample_prioritized(self, target: dict[str, np.ndarray]) -> Any:
        """Draw from the learner's priority table. When writers lap the buffer faster than the
        learner enters their rows, the table's leaves point at overwritten rows for a while:
        that is "not ready yet", not an error, so wait for the learner's next sync."""
        pause = 1e-4
        while True:
            try:
                return self.buf.sample_into(target, self.rng, sampler=self.table.draw)
            except (SamplingError, EmptyBufferError):
                time.sleep(pause)
                pause = min(pause * 2, 5e-3)
                self._check_learner()
                self._receive(0)
                if any(op == OP_STOP for op, _, _ in self.pending):
                    raise LearnerGone from None

    def _apply_transform(self, views: dict[str, np.ndarray]) -> None:
        if self.transform is not None:
            batch = dict(self.scratch)
            result = self.transform(batch)
            result = batch if result is None else result
            for name in self.cfg.out_fields:
                value = np.asarray(result[name])
                dst = views[name]
                if value.shape != dst.shape:
                    raise ValueError(
                        f"transform returned {name!r} with shape {value.shape}, but its first "
                        f"result had {dst.shape}: a transform must keep shapes and dtypes fixed"
                    )
                np.copyto(dst, value, casting="same_kind")

    def close(self) -> None:
        self.targets = []
        self.scratch = None
        closers = [self.ring.close, self.buf.close]
        if self.table is not None:
            closers.insert(0, self.table.close)
        for closer in closers:
            try:
                closer()
            except Exception:
                pass
