"""The sampler worker process: fills staging slots the learner assigns to it, one batch each.

Protocol with the learner, over this worker's own socketpair (``channel.Channel`` records):
learner -> worker ``FILL(slot, generation)`` (draw and gather a batch), ``GATHER(slot,
generation)`` (gather the rows the learner wrote into the slot's index arrays) or ``STOP``;
worker -> learner ``HELLO`` once set up, ``READY(slot, generation)`` after a slot is completely
written, ``STALE(slot, generation)`` when a row to gather was overwritten first, ``ERROR
(traceback)`` when user code fails. A slot is only ever announced after its last byte is
written, so a worker killed mid-fill can never hand over a half-filled batch. What fills a slot
is the ``filler.BatchFiller`` the in-process delivery uses too.

The worker exits by itself when the learner is gone: its pipe reaches EOF, or the staging
segment's owner lease is free (checked at least every ``LIVENESS_EVERY`` seconds).
"""

from __future__ import annotations

import collections
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

from shmbuf import ReplayBuffer
from shmbuf.priority import PriorityTable

from .channel import OP_ERROR, OP_HELLO, OP_STOP, Channel
from .filler import Backoff, BatchFiller
from .staging import FILLING, READY, W_OWNER, W_SEQ, W_STATE, StagingRing

OP_READY, OP_STALE = 2, 4  # besides channel.OP_HELLO and OP_ERROR
OP_FILL, OP_GATHER = 10, 12  # GATHER: the learner wrote the rows into the slot (and OP_STOP)
LIVENESS_EVERY = 0.5


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
    """One sampler process's state: its buffer, ring and filler, and the learner's messages.

    Concurrency: writes only the staging slots the learner handed it (between ``FILL``/``GATHER``
    and ``READY``), and its own limiter counter (sampler slot ``worker_id``).
    """

    def __init__(self, cfg: SamplerConfig, chan: Channel, worker_id: int, seed: Any) -> None:
        self.chan = chan
        self.wid = worker_id
        self.rng = np.random.default_rng(seed)
        self.buf = ReplayBuffer.attach(cfg.buffer)
        self.ring = StagingRing.attach(cfg.staging)
        self.pending: collections.deque[tuple[int, int, int]] = collections.deque()
        self.seq = 0
        self.next_liveness = time.monotonic() + LIVENESS_EVERY
        self.table = PriorityTable.attach(cfg.priority_table) if cfg.priority_table else None
        self.filler = BatchFiller(
            self.buf, self.buf.compile(cfg.plan, cfg.fields),
            [self.ring.slot(s) for s in range(self.ring.n_slots)], cfg.batch_size,
            cfg.out_fields, cfg.transform, cfg.min_size, cfg.rate_limited, worker_id, self.table)

    # -- messages -------------------------------------------------------------------------------
    def _receive(self, timeout: float) -> None:
        """Move messages into ``pending`` (waiting up to ``timeout``); LearnerGone on EOF."""
        if timeout > 0 and not self.chan.wait(timeout):
            return
        messages, eof = self.chan.receive()
        self.pending.extend((op, slot, gen) for op, slot, gen, _ in messages)
        if eof:
            raise LearnerGone

    def _check_learner(self) -> None:
        now = time.monotonic()
        if now >= self.next_liveness:
            self.next_liveness = now + LIVENESS_EVERY
            if not self.ring.seg.owner_alive():
                raise LearnerGone

    def _wait(self, backoff: Backoff) -> None:
        """A fill waits: sleep a little, and give up if the learner is gone or asks us to stop
        (nothing is half-written then)."""
        backoff.sleep()
        self._check_learner()
        self._receive(0)
        if any(op == OP_STOP for op, _, _ in self.pending):
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
            if op in (OP_FILL, OP_GATHER):
                self._fill(slot, gen, given=op == OP_GATHER)

    # -- filling --------------------------------------------------------------------------------
    def _fill(self, slot: int, gen: int, given: bool) -> None:
        """Fill ``slot`` (draw, or gather the rows the learner gave) and announce it."""
        ring, filler = self.ring, self.filler
        if not given:
            filler.wait_until_drawable(self._wait)
        ring.set(slot, W_OWNER, self.wid)
        ring.set(slot, W_STATE, FILLING)
        if not given:
            filler.draw(slot, self.rng, self._wait)
        elif not filler.gather(slot):
            self._send(OP_STALE, slot, gen)
            return
        ring.set(slot, W_SEQ, self.seq)
        self.seq += 1
        ring.set(slot, W_STATE, READY)
        self._send(OP_READY, slot, gen)

    def _send(self, op: int, slot: int, gen: int) -> None:
        try:
            self.chan.send(op, slot, gen)
        except OSError:
            raise LearnerGone from None

    def close(self) -> None:
        self.filler.close()
        closers = [self.ring.close, self.buf.close]
        if self.table is not None:
            closers.insert(0, self.table.close)
        for closer in closers:
            try:
                closer()
            except Exception:
                pass
