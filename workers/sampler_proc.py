"""The sampler worker process: fills staging slots the learner assigns to it, one batch each.

Protocol with the learner: work moves through the slots' STATE words (``staging``): the learner
stores ASSIGNED (draw a batch) or ASSIGNED_ROWS (gather the rows it wrote into the slot), the
worker FILLING, then READY once the slot is completely written (STALE when a row to gather was
overwritten first). A slot is only ever marked READY after its last byte is written, so a worker
killed mid-fill can never hand over a half-filled batch. The channel (``channel.Channel``)
only wakes a side that sleeps, when the waiting word says so (learner -> worker by its wake-up
eventfd, worker -> learner by an ``OP_READY`` record), and carries ``HELLO``, ``ERROR
(traceback)`` and ``STOP``. What fills a slot is the ``filler.BatchFiller`` the in-process
delivery uses too.

The worker exits by itself when the learner is gone: its pipe reaches EOF, or the staging
segment's owner lease is free (checked at least every ``LIVENESS_EVERY`` seconds).
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

from shmbuf import ReplayBuffer
from shmbuf.priority import PriorityTable

from .channel import OP_ERROR, OP_HELLO, OP_STOP, Channel, ChildEnd
from .filler import Backoff, BatchFiller
from .staging import (
    ASSIGNED_ROWS,
    FILLING,
    LEARNER,
    READY,
    STALE,
    W_OWNER,
    W_SEQ,
    WORKER_STATES,
    StagingRing,
)

OP_READY = 2  # worker -> learner: a slot changed state (besides channel.OP_HELLO and OP_ERROR)
LIVENESS_EVERY = 0.5
# With nothing to fill, a worker first naps (sleeps doubling from NAP_FIRST to NAP_MOST seconds,
# each followed by a look at its slots' states) for this long before it blocks on its channel: a
# slot handed back within the nap costs the learner no wake-up message.
NAP_BEFORE_BLOCKING = 0.05
NAP_FIRST, NAP_MOST = 5e-5, 1e-3


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
    n_workers: int = 1  # worker ``w`` fills slots ``w, w + n_workers, ...``
    plan: Any = None  # shmbuf.sampling.Plan
    priority_table: str | None = None  # workers draw from it (read-only) when set


class LearnerGone(Exception):
    """The learner process is gone: the worker exits quietly."""


def sampler_main(end: ChildEnd, cfg_bytes: bytes, worker_id: int, seed: Any) -> None:
    """Entry point of a sampler worker process (any start method)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the learner's; it stops us
    run_as_batch()
    chan = end.channel()
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


def run_as_batch() -> None:
    """Put this process under ``SCHED_BATCH``: the same CPU share as before (nice is kept), but
    its wake-ups never preempt the task running where it wakes. A worker wakes often (each nap,
    each slot handed to it), and the scheduler may place it on the learner's CPU: under the
    default policy it then took that CPU for the rest of its time slice (milliseconds) in the
    middle of the learner's ``next()`` or the actor's ``add()``. Where the policy cannot be
    set (not Linux, or refused), the worker runs as it was started."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass


class _Worker:
    """One sampler process's state: its buffer, ring and filler, and the learner's messages.

    Concurrency: writes only the staging slots the learner handed it (between ASSIGNED and
    READY/STALE), its own waiting word, and its own limiter counter (sampler slot
    ``worker_id``). It blocks, and wakes the learner, by the handshake of ``staging``.
    """

    def __init__(self, cfg: SamplerConfig, chan: Channel, worker_id: int, seed: Any) -> None:
        self.chan = chan
        self.wid = worker_id
        self.rng = np.random.default_rng(seed)
        self.buf = ReplayBuffer.attach(cfg.buffer)
        self.ring = StagingRing.attach(cfg.staging)
        self.my_slots = list(range(worker_id, self.ring.n_slots, cfg.n_workers))
        self.waiter = 1 + worker_id
        self.seq = 0
        self.next_liveness = time.monotonic() + LIVENESS_EVERY
        self.table = PriorityTable.attach(cfg.priority_table) if cfg.priority_table else None
        self.filler = BatchFiller(
            self.buf, self.buf.compile(cfg.plan, cfg.fields),
            [self.ring.slot(s) for s in range(self.ring.n_slots)], cfg.batch_size,
            cfg.out_fields, cfg.transform, cfg.min_size, cfg.rate_limited, worker_id, self.table)

    # -- messages -------------------------------------------------------------------------------
    def _stop_asked(self, timeout: float = 0.0) -> bool:
        """Read the learner's messages (waiting up to ``timeout`` for one): True if it asked us
        to stop. Wake-ups carry nothing (the slots' states say what to do). LearnerGone on EOF,
        or when the learner's liveness check fails."""
        if timeout <= 0 or self.chan.wait(timeout):
            messages, eof = self.chan.receive()
            if eof:
                raise LearnerGone
            if any(op == OP_STOP for op, _, _, _ in messages):
                return True
        now = time.monotonic()
        if now >= self.next_liveness:
            self.next_liveness = now + LIVENESS_EVERY
            if not self.ring.seg.owner_alive():
                raise LearnerGone
        return False

    def _wait(self, backoff: Backoff) -> None:
        """A fill waits: sleep a little, and give up if the learner is gone or asks us to stop
        (nothing is half-written then)."""
        backoff.sleep()
        if self._stop_asked():
            raise LearnerGone

    def run(self) -> None:
        while True:
            slot = self._assigned_slot()
            if slot is not None:
                self._fill(slot, given=self.ring.state(slot) == ASSIGNED_ROWS)
            elif self._idle():
                return

    def _assigned_slot(self) -> int | None:
        """The slot the learner assigned first among those waiting for this worker, if any."""
        ring, best, best_gen = self.ring, None, 0
        for slot in self.my_slots:
            if ring.state(slot) in WORKER_STATES:
                gen = ring.generation(slot)
                if best is None or gen < best_gen:
                    best, best_gen = slot, gen
        return best

    def _idle(self) -> bool:
        """Nothing to fill: nap a little (``NAP_BEFORE_BLOCKING``), then block on the channel
        until the learner assigns a slot, asks us to stop (True), or a liveness check is due."""
        backoff = Backoff(NAP_FIRST, NAP_MOST)
        nap_until = time.monotonic() + NAP_BEFORE_BLOCKING
        while time.monotonic() < nap_until:
            if self._stop_asked():
                return True
            backoff.sleep()
            if self._assigned_slot() is not None:
                return False
        with self.ring.sleeping(self.waiter):  # the handshake of ``staging``
            if self._assigned_slot() is not None:
                return False
            return self._stop_asked(LIVENESS_EVERY)

    # -- filling --------------------------------------------------------------------------------
    def _fill(self, slot: int, given: bool) -> None:
        """Fill ``slot`` (draw, or gather the rows the learner gave) and mark it READY."""
        ring, filler = self.ring, self.filler
        if not given:
            filler.wait_until_drawable(self._wait)
        ring.set(slot, W_OWNER, self.wid)
        ring.set_state(slot, FILLING)
        if not given:
            filler.draw(slot, self.rng, self._wait)
        elif not filler.gather(slot):
            self._hand_back(slot, STALE)
            return
        ring.set(slot, W_SEQ, self.seq)
        self.seq += 1
        self._hand_back(slot, READY)

    def _hand_back(self, slot: int, state: int) -> None:
        """Store ``slot``'s final ``state`` (after every byte of it); wake the learner if it
        waits (its ``next()`` otherwise finds the state by itself)."""
        ring = self.ring
        ring.set_state(slot, state)
        if ring.wake_needed(LEARNER):
            self._send(OP_READY, slot, ring.generation(slot))

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
