"""Staging-ring delivery: sampler worker processes fill shared-memory slots the learner assigns
them; the learner takes ready slots as views, hands them back, and supervises the workers.
"""

from __future__ import annotations

import itertools
import time
import warnings
from typing import Any

import cloudpickle
import numpy as np

from shmbuf.errors import BufferInUseError, ClosedError, Timeout, WorkerDiedError, WorkerError

from .batch import Batch
from .channel import OP_ERROR, OP_HELLO
from .delivery import Delivery, PoolParts
from .device import DeviceStage
from .sampler_proc import SamplerConfig, sampler_main
from .slot_book import SlotBook, SlotRows
from .staging import (
    ASSIGNED,
    ASSIGNED_ROWS,
    HELD,
    LEARNER,
    READY,
    STALE,
    StagingRing,
    slot_arrays,
    write_rows,
)
from .supervise import Child, ChildSet, self_inflicted

Taker: Any  # the compiled common case of next() (setup.py builds it where it can), or None
try:
    from ._take_c import Taker
except ImportError:  # pragma: no cover - depends on the build
    Taker = None

POLL_SLICE = 0.25  # longest single wait, so deaths and timeouts are handled promptly
# While ready slots keep coming (so next() never blocks), look at messages and deaths this often.
CHECK_EVERY_NS = 250_000_000

# Staging rings a device may still be reading when their pool closed: kept mapped until exit.
_IN_FLIGHT_RINGS: list[StagingRing] = []


class _WorkerHandle(Child):
    """The learner's record of one sampler worker (its id and slots survive restarts)."""

    def __init__(self, wid: int, slots: list[int]) -> None:
        super().__init__(wid)
        self.wid = wid
        self.slots = slots  # staging slots this worker fills, fixed for the pool's life
        self.hello = False
        self.startup_failures = 0

    def take_messages(self) -> WorkerError | None:
        """Read this worker's messages (OP_READY only woke the learner: it reads the slot
        states); the error it reported, if any."""
        error = None
        for op, _slot, _gen, text in self.receive():
            if op == OP_HELLO:
                self.hello = True
                self.startup_failures = 0
            elif op == OP_ERROR and error is None:
                error = WorkerError(
                    f"sampler worker {self.wid} (pid {self.proc.pid}) raised; its traceback:\n"
                    f"{text.decode('utf-8', 'replace')}")
        return error

    def restart_refused(self, children: ChildSet[Any], buffer: str, start_method: str
                        ) -> WorkerDiedError | None:
        """This worker's process ended (``children`` retired it): why it must not be restarted
        (it died during start-up twice in a row, or the restart budget is spent), else None."""
        pid, how = self.proc.pid, self.describe_exit()
        if not self.hello and self_inflicted(self.proc.exitcode):
            self.startup_failures += 1
        if self.startup_failures >= 2:
            return WorkerDiedError(
                f"sampler worker {self.wid} (pid {pid}) {how} during start-up, twice in a row; "
                f"not restarting it. Check that the buffer {buffer!r} is reachable and the "
                f"transform imports in a fresh process (start method {start_method!r})")
        if not children.may_restart():
            return WorkerDiedError(
                f"sampler worker {self.wid} (pid {pid}) {how}; {children.budget.exhausted()}. "
                f"Fix the cause, or raise max_restarts_per_minute")
        return None

    def wake(self, slot: int, generation: int) -> None:
        """The process sleeps, or is about to, and ``slot`` was assigned to it: its wake-up
        (the slot's state says what to do; ``slot`` and ``generation`` are not sent, and are
        there for whoever records the wake-ups: the twin tests of ``_take_c`` compare them)."""
        if self.chan is not None:
            try:
                self.chan.wake()
            except OSError:
                pass  # (not expected of an eventfd; a dead worker's sentinel says so anyway)

    def end_if_starting(self) -> None:
        """Kill the process if it has not said HELLO yet: it has nothing to finish. SIGKILL,
        not SIGTERM: a forked child may still run its parent's Python SIGTERM handler, which
        does not end a start-up sleeping in an unpickle (the close then waited 5 s)."""
        if not self.hello and self.alive:
            self.proc.kill()

    def stats(self, batches: int) -> dict[str, Any]:
        return {"id": self.wid, "pid": self.proc.pid if self.proc else None, "alive": self.alive,
                "batches": batches}


def _sampler_config(delivery: Delivery, staging: str) -> SamplerConfig:
    """What every sampler worker of ``delivery`` is started with (its staging ring's name)."""
    cfg, table = delivery.cfg, delivery.selection.draws_from
    return SamplerConfig(
        buffer=delivery.buf.name, staging=staging, batch_size=delivery.batch_size,
        fields=cfg.fields, out_fields=delivery.out_fields, transform=cfg.transform,
        min_size=cfg.min_size, rate_limited=cfg.limit is not None, n_workers=cfg.n_workers,
        plan=delivery.compiled.plan, priority_table=table.name if table is not None else None)


class PythonTaker:
    """``take_ready``'s steps in Python, where ``_take_c`` was not built or batches leave in
    order: what ``_take_c.Taker.take`` does, through the delivery's own methods."""

    def __init__(self, delivery: RingDelivery) -> None:
        self.delivery = delivery

    def take(self, words: memoryview, held: Batch | None, t0: int) -> Batch | None:
        """``held`` (unless None or released) released and its slot back to its worker,
        handed-back slots taken up, the first ready slot HELD, counted as a batch delivered
        after waiting since ``t0``, and returned as a batch, if any."""
        d = self.delivery
        if held is not None and not held.released:  # (else its slot was handed out then)
            held._invalidate()
            d._assign(held.slot)
        d._collect()
        slot = d._pop_ready()
        if slot is None:
            return None
        d._live_ring().stats.batch_delivered(time.perf_counter_ns() - t0)
        return d.hold(slot, 0)  # (a quick pool's batches are plain: the step is not read)


def make_taker(delivery: RingDelivery, ring: StagingRing) -> Any:
    """The steps of ``delivery.take_ready`` for a quick pool: compiled (``_take_c.Taker``, on
    the delivery's own records) where it was built and batches may leave as they come."""
    if Taker is None or delivery.cfg.ordered:
        return PythonTaker(delivery)
    book, d = delivery.book, delivery
    return Taker(ring.state_words, ring.generation_words, ring.owner_words, ring.waiter_words,
                 ring.stats.delivered_words, (ASSIGNED, READY, STALE, HELD), book.assigned,
                 book.ready, d.gen, d.filled, d.tickets,
                 lambda owner, slot, gen: d.children.children[owner].wake(slot, gen),
                 Batch, d.batch_views, d.cache_views, d.release_batch,
                 d.batch_to if d.to_device else None)


class RingDelivery(Delivery):
    """Slot ``s`` belongs to worker ``s % n_workers``; it moves FREE -> ASSIGNED -> (FILLING ->
    READY, the worker's) -> HELD -> back to its worker.

    Concurrency: the learner (this process) owns the staging segment and writes a slot's control
    words while it holds the slot; the worker writes them (and the slot's data) between
    ASSIGNED and READY. Hand-overs are STATE word stores, wake-ups only by the handshake of
    ``staging`` (no system call while batches are ready, but a ``poll`` for messages and deaths
    every ``CHECK_EVERY_NS``). A worker that dies mid-fill has its slots reclaimed (generation
    bumped) and is restarted within the budget; a half-filled slot is never READY, so never
    delivered. Workers exit by themselves when the learner dies.
    """

    def __init__(self, parts: PoolParts, ctx: Any) -> None:
        super().__init__(parts)
        self.ctx = ctx
        self.children: ChildSet[_WorkerHandle] = ChildSet(
            ctx, sampler_main, "shmbuf-sampler", parts.cfg.max_restarts_per_minute)
        self.ring: StagingRing | None = None  # None until started, and once closed
        self.rows = SlotRows(parts.selection)  # learner-selected rows, if the learner selects
        self.book = SlotBook(parts.cfg.ordered)
        self.tickets = itertools.count(1)  # generations, one count for all: assignment order
        self.next_check = 0  # perf_counter_ns of the next look at messages and deaths
        self.n_workers, self.n_staging = parts.cfg.n_workers, parts.cfg.n_staging  # (take_ready)
        self.selects = parts.selection.learner_selects
        self.quick = False  # take_ready may deliver: release = hand-out, batch = views
        self.taker: Any = None  # take_ready's steps, for a quick pool (make_taker)
        self.filled = [0] * parts.cfg.n_workers  # batches each worker handed back

    def start(self) -> None:
        """Create the ring, start the workers, hand every slot out (the pool cleans up a
        half-done start with ``stop`` and ``close``)."""
        cfg, b = self.cfg, self.batch_size
        arrays = slot_arrays(self.out_arrays, b, self.compiled.index_shape)
        ring = self.ring = StagingRing.create(arrays, cfg.n_staging,
                                              {"buffer": self.buf.name, "batch_size": b},
                                              n_workers=cfg.n_workers)
        self.cfg_bytes = cloudpickle.dumps(_sampler_config(self, ring.name))
        self.views = self.make_views([ring.slot(s) for s in range(cfg.n_staging)])
        for wid, seed in enumerate(cfg.seed.spawn(self.n_workers)):
            slots = list(range(wid, cfg.n_staging, self.n_workers))
            self._start_worker(_WorkerHandle(wid, slots), seed, [])
        # Slots in order, so worker s % n_workers gets slot s: the same round-robin that
        # ordered delivery follows, so batches leave in the order they were assigned.
        for slot in range(cfg.n_staging):
            self._assign(slot)
        self.quick = self.plain and self.stage is None and self.pinned is None \
            and not self.selects and not self.selection.enters_rows
        if self.quick:
            self.taker = make_taker(self, ring)

    # -- the interface ----------------------------------------------------------------------------
    def _live_ring(self) -> StagingRing:
        if self.ring is None:
            raise ClosedError("the SamplerPool is closed")
        return self.ring

    def slot_arrays(self, slot: int) -> dict[str, np.ndarray]:
        return self._live_ring().slot(slot)

    def workers(self) -> list[_WorkerHandle]:
        return self.children.children

    @property
    def restarts(self) -> int:
        return self.children.restarts

    def wake(self) -> None:
        super().wake()
        self.children.wake()

    def stats(self, batches: int) -> dict[str, Any]:
        return {**super().stats(batches),
                "workers": [w.stats(self.filled[w.wid]) for w in self.workers()]}

    @property
    def ready_count(self) -> int:
        return len(self.book)

    def selected_pending(self) -> int:
        return len(self.book.assigned)

    def shared_memory(self) -> tuple[Any, int, int] | None:
        ring = self._live_ring()
        offset, length = ring.slot_span()
        return ring.seg.buf, offset, length

    # -- taking batches ---------------------------------------------------------------------------
    def take_ready(self, step: int) -> Batch | None:
        """``next()``'s common case, for a ``quick`` pool: the held slot back to its worker, the
        first ready one held, through few frames and objects (a learner waking cold from a train
        step pays ~1 us for each). None if none is ready or anything else is due: ``next``."""
        t0 = time.perf_counter_ns()
        if t0 >= self.next_check:  # (for every pool: its next() comes here first)
            self._look_around(t0)
        ring = self.ring
        if not self.quick or self.failure is not None or self.fences.pending or self.closing \
                or ring is None:
            return None
        # The held batch's release (a quick pool's is the hand-out), in the take: a close in
        # another thread finds it released or still held, never holding views unseen.
        batch = self.held = self.taker.take(ring.words, self.held, t0)
        self.occupancy_sum += (len(self.book.ready) + (batch is not None)) / self.n_staging
        return batch

    def next(self, timeout: float, step: int) -> Batch:
        """The learner's next batch (the held one released, and messages and deaths looked at
        when due, by ``take_ready``): a ready slot, else ``_wait``."""
        t0 = time.perf_counter_ns()
        self._collect()
        self.occupancy_sum += len(self.book.ready) / self.n_staging
        slot = self._pop_ready() if self.failure is None and self.stage is None \
            and not self.fences.pending else None
        batch = self.hold(slot, step) if slot is not None else self._wait(t0, timeout, step)
        ring = self.ring
        if ring is not None:
            ring.stats.batch_delivered(time.perf_counter_ns() - t0)
        return batch

    def _pop_ready(self) -> int | None:
        """The next slot to deliver, if one is ready: HELD until it is handed out again."""
        slot = self.book.pop()
        if slot is not None:
            self._live_ring().set_state(slot, HELD)
        return slot

    def _wait(self, t0: int, timeout: float, step: int) -> Batch:
        """``next()``'s other cases: device copies, and waits (looking at messages and deaths)."""
        deadline = t0 + int(timeout * 1e9)
        while True:
            if self.failure is not None:
                raise self.failure
            self._reap_fences()
            if self.stage is not None:
                self._submit_ready(self.stage, step)
                if len(self.stage):
                    return self.hold_device(self.stage)
            else:
                slot = self._pop_ready()
                if slot is not None:
                    return self.hold(slot, step)
            self.rows.retry(self._assign)
            self.selection.enter_new_rows()  # workers may be waiting for rows to enter
            remaining = (deadline - time.perf_counter_ns()) / 1e9
            if remaining <= 0:
                raise Timeout(f"no batch within {timeout}s: {self.waiting_for()}")
            quick = self.rows.waiting or self.selection.table is not None
            # Slots held back by copies in flight come free within microseconds to milliseconds.
            pause = 0.0002 if len(self.fences) else 0.002 if quick else POLL_SLICE
            with self._live_ring().sleeping(LEARNER):  # the handshake of ``staging``
                if not self._collect():
                    self._poll(min(remaining, pause))
                    self._collect()
            self.next_check = time.perf_counter_ns() + CHECK_EVERY_NS

    def _look_around(self, now: int) -> None:
        """Messages and deaths (every ``CHECK_EVERY_NS``: ``next()`` polls only when it waits)."""
        self.next_check = now + CHECK_EVERY_NS
        self._poll(0)

    def _collect(self) -> int:
        """Take up the slots workers handed back (READY, or STALE: learner-selected rows were
        overwritten before the gather) from their STATE words; how many."""
        ring, book = self.ring, self.book
        if ring is None or not book.assigned:
            return 0
        back = book.handed_back(ring.words, ring.state_words)
        filled, n_workers = self.filled, self.n_workers
        for slot in back:
            if self.selects:
                if ring.state(slot) != READY:  # STALE: its rows were overwritten
                    if self.rows.stale(slot):  # replaced in its place (epochs)
                        self._assign(slot, requeue=False)
                    else:  # a new batch: after those handed out before it
                        self.book.unassigned(slot)
                        self._assign(slot)
                    continue
            book.append(slot)
            filled[slot % n_workers] += 1
        return len(back)

    def _poll(self, timeout: float) -> None:
        """Wait for messages, deaths or a wake-up; handle them."""
        woken, messages, exits = self.children.wait(timeout)
        if woken:
            # Only close() writes the wake pipe, and it may be closing the pipe right now
            # in another thread: do not read it, just report the close.
            self.check_open()
        for w in messages:
            self._fail(w.take_messages())
        self.check_open()  # closed by another thread meanwhile: restart nobody
        for w in exits:
            self._on_exit(w)

    def _submit_ready(self, stage: DeviceStage, step: int) -> None:
        """Copy ready slots to the device while device buffers are free; each slot goes back to
        the workers once its copy has completed."""
        while stage.can_submit():
            slot = self._pop_ready()
            if slot is None:
                return
            self.submit_slot(stage, slot, step)
            self.slot_done(slot)

    # -- giving slots back ------------------------------------------------------------------------
    def slot_done(self, slot: int) -> None:
        """The learner is done with ``slot``: back to its worker now, or once its fences pass."""
        if self.selects:
            self.rows.done(slot)
        if self.closing or self.ring is None or self.failure is not None:
            return
        if not self.fences.busy(slot):
            self._assign(slot)

    def _reap_fences(self) -> None:
        """Hand back to the workers every slot whose device copies have completed."""
        if not len(self.fences):
            return
        for slot in self.fences.completed(in_order=self.cfg.ordered):
            if not self.closing and self.ring is not None and self.failure is None:
                self._assign(slot)

    def _assign(self, slot: int, requeue: bool = True) -> None:
        """Hand ``slot`` to its worker (ASSIGNED), or with learner-selected rows in it
        (ASSIGNED_ROWS; kept after a worker death: queue mode still delivers each row exactly
        once)."""
        ring = self.ring
        assert ring is not None
        state = ASSIGNED
        if self.selects:
            rows = self.rows.rows_for(slot, lambda: self.selection.select(
                self.batch_size, self.selection_rng) if self.may_select() else None)
            if rows is None:  # nothing to select now: retried from next()
                ring.free(slot)
                self.book.unassigned(slot)  # a new place once it has rows again
                return
            write_rows(ring.slot(slot), *rows)
            state = ASSIGNED_ROWS
        generation = self.gen[slot] = next(self.tickets)
        self.book.handed_out(slot, requeue)
        owner = slot % self.n_workers
        if ring.assign(slot, owner, generation, state):  # STATE last; True: it waits (staging)
            self.children.children[owner].wake(slot, generation)

    # -- workers ----------------------------------------------------------------------------------
    def _start_worker(self, w: _WorkerHandle, seed: np.random.SeedSequence,
                      fill: list[int]) -> None:
        """Start (or restart) worker ``w`` and ask it to fill ``fill``."""
        self.children.start(w, self.cfg_bytes, w.wid, seed)
        self._live_ring().stats.set_restarts(self.children.restarts)
        w.hello = False
        for s in fill:
            self._assign(s, requeue=False)

    def _on_exit(self, w: _WorkerHandle) -> None:
        """A worker process ended: keep what it finished, reclaim the rest, restart or fail."""
        self._fail(w.take_messages())
        self._collect()  # what it finished (READY after its last byte) is delivered
        if self.failure is not None:
            return
        ring = self._live_ring()
        self.children.retire(w)
        lost = self.book.lose(w.slots)
        for s in lost:  # half-filled or never started: nobody writes them any more
            self.gen[s] = next(self.tickets)
            ring.free(s, self.gen[s])
        refused = w.restart_refused(self.children, self.buf.name, self.ctx.get_start_method())
        if refused is not None:
            self._fail(refused)
            return
        # Slots it finished stay READY and are delivered; the new process refills the lost ones.
        self._start_worker(w, self.cfg.seed.spawn(1)[0], lost)

    # -- teardown ---------------------------------------------------------------------------------
    def stop(self, timeout: float) -> None:
        """Ask the workers to stop; one still starting (no HELLO) is ended at once, having
        nothing to finish (so a young spawn pool closes promptly)."""
        for w in self.workers():
            self._fail(w.take_messages())
            w.end_if_starting()
        self.children.stop(timeout)

    def close(self, settled: bool, timeout: float) -> None:
        """Unpin and drop the ring; if device copies may still read it, keep it mapped."""
        if not settled and self.ring is not None:
            _keep_mapped(self.ring, timeout)
            self.ring = None
            self.pinned = None  # stays page-locked with its mapping
        self.taker = None  # (its wake-up and records refer back here: no cycle left)
        super().close(settled, timeout)
        if self.ring is not None:
            try:
                self.ring.close()
            except BufferInUseError as e:
                warnings.warn(str(e), ResourceWarning, stacklevel=4)
            self.ring = None
        self.children.close()


def _keep_mapped(ring: StagingRing, timeout: float) -> None:
    """Device copies still read ``ring`` after ``timeout``: unlink its name, keep its memory."""
    warnings.warn(
        f"device copies from staging ring {ring.name!r} were still in flight after "
        f"{timeout}s; its name is removed but its memory stays mapped (and page-locked) "
        f"until this process exits", ResourceWarning, stacklevel=5)
    _IN_FLIGHT_RINGS.append(ring)
    ring.seg.unlink()
