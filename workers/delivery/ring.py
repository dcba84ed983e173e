"""Staging-ring delivery: sampler worker processes fill shared-memory slots the learner hands
them; the learner takes filled slots (``learner_ring.LearnerRing``: its records and every word it
stores), hands them back with the rows it chose for them (``SlotRows``), and supervises the
workers.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np

from shmbuf.errors import BufferInUseError, ClosedError, Timeout

from ..batch import Batch
from ..channel import OP_ERROR, OP_HELLO
from ..errors import WorkerDiedError, WorkerError
from ..learner_ring import LearnerRing
from ..sampler_proc import SamplerConfig, sampler_main
from ..selection import Rows, Selection
from ..staging import ASSIGNED, ASSIGNED_ROWS, StagingRing, slot_arrays, write_rows
from ..supervise import Child, ChildSet, self_inflicted
from .base import HostDelivery, PoolParts

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

    def wake(self) -> None:
        """The process sleeps, or is about to, and a slot was handed to it: its wake-up (the
        slot's state says what to do)."""
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


class SlotRows:
    """Rows the learner chose for its slots (``Selection.learner_selects``): those each slot out
    with a worker is to gather (kept after a worker death: queue mode still delivers each row
    exactly once), and the slots waiting for rows."""

    def __init__(self, selection: Selection) -> None:
        self.selection = selection
        self.by_slot: dict[int, Rows] = {}
        self.waiting: list[int] = []  # slots with no rows to select yet

    def rows_for(self, slot: int, select: Callable[[], Rows | None]) -> Rows | None:
        """The rows ``slot`` is to gather: those it had, else ``select()``'s; None (and the
        slot waits) if nothing can be selected now."""
        rows = self.by_slot.get(slot)
        if rows is None:
            rows = select()
            if rows is None:
                self.waiting.append(slot)
                return None
            self.by_slot[slot] = rows
        return rows

    def retry(self, assign: Callable[[int], None]) -> None:
        """``assign`` the slots waiting for rows again, until one still finds none."""
        waiting = self.waiting
        for slot in waiting[:]:
            waiting.remove(slot)
            assign(slot)
            if waiting and waiting[-1] == slot:
                break  # still nothing to select; the others would find nothing either

    def stale(self, slot: int) -> bool:
        """``slot``'s rows were overwritten before its worker gathered them; True if the slot
        keeps its place in delivery order (``Selection.stale``)."""
        return self.selection.stale(self.by_slot.pop(slot))

    def done(self, slot: int) -> None:
        """The learner is done with ``slot``'s rows."""
        if self.by_slot:
            self.by_slot.pop(slot, None)


def _sampler_config(delivery: RingDelivery, staging: str) -> SamplerConfig:
    """What every sampler worker of ``delivery`` is started with (its staging ring's name)."""
    cfg, table = delivery.cfg, delivery.selection.draws_from
    return SamplerConfig(
        buffer=delivery.buf.name, staging=staging, batch_size=delivery.batch_size,
        fields=cfg.fields, out_fields=delivery.out_fields, transform=cfg.transform,
        min_size=cfg.min_size, rate_limited=cfg.limit is not None, n_workers=cfg.n_workers,
        plan=delivery.compiled.plan, priority_table=table.name if table is not None else None)


class RingDelivery(HostDelivery):
    """Slot ``s`` belongs to worker ``s % n_workers``; it moves FREE -> ASSIGNED -> (FILLING ->
    READY, the worker's) -> HELD -> back to its worker. ``slots`` (a ``LearnerRing``) keeps
    the learner's records of them and stores every word the learner stores.

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
        self.slots: LearnerRing | None = None  # the learner's half of the ring
        self.rows = SlotRows(parts.selection)  # learner-selected rows, if the learner selects
        self.next_check = 0  # perf_counter_ns of the next look at messages and deaths
        self.n_workers, self.n_staging = parts.cfg.n_workers, parts.cfg.n_staging
        self.selects = parts.selection.learner_selects
        # take_ready delivers plain views (no weights to compute, no rows to choose or enter):
        # the held batch's release is the hand-out, all in LearnerRing.take
        self.quick = not (self.weighted or self.tags or self.selects
                          or parts.selection.enters_rows)

    def start(self) -> None:
        """Create the ring, start the workers, hand every slot out (the pool cleans up a
        half-done start with ``stop`` and ``close``)."""
        cfg, b = self.cfg, self.batch_size
        arrays = slot_arrays(self.out_arrays, b, self.compiled.index_shape)
        ring = self.ring = StagingRing.create(arrays, cfg.n_staging,
                                              {"buffer": self.buf.name, "batch_size": b},
                                              n_workers=cfg.n_workers)
        slots = self.slots = LearnerRing(ring, cfg.n_workers, cfg.ordered, self._wake)
        self.cfg_bytes = cloudpickle.dumps(_sampler_config(self, ring.name))
        self.make_views([ring.slot(s) for s in range(cfg.n_staging)])
        for wid, seed in enumerate(cfg.seed.spawn(self.n_workers)):
            slots_of = list(range(wid, cfg.n_staging, self.n_workers))
            self._start_worker(_WorkerHandle(wid, slots_of), seed, [])
        # Slots in order, so worker s % n_workers gets slot s: the same round-robin that
        # ordered delivery follows, so batches leave in the order they were handed out.
        for slot in range(cfg.n_staging):
            self._assign(slot)
        if self.quick:
            slots.deliver_as(self.templates)

    # -- the interface ----------------------------------------------------------------------------
    def _live_slots(self) -> LearnerRing:
        if self.slots is None:
            raise ClosedError("the SamplerPool is closed")
        return self.slots

    def slot_arrays(self, slot: int) -> dict[str, np.ndarray]:
        ring = self.ring
        if ring is None:
            raise ClosedError("the SamplerPool is closed")
        return ring.slot(slot)

    def generation(self, slot: int) -> int:
        return self._live_slots().generation(slot)

    def workers(self) -> list[_WorkerHandle]:
        return self.children.children

    @property
    def restarts(self) -> int:
        return self.children.restarts

    def wake(self) -> None:
        super().wake()
        self.children.wake()

    def stats(self, batches: int) -> dict[str, Any]:
        slots = self.slots
        filled = slots.filled.tolist() if slots is not None else [0] * self.n_workers
        return {**super().stats(batches),
                "workers": [w.stats(filled[w.wid]) for w in self.workers()]}

    @property
    def ready_count(self) -> int:
        return self.slots.ready_count if self.slots is not None else 0

    def selected_pending(self) -> int:
        return self.slots.out_count if self.slots is not None else 0

    def shared_memory(self) -> tuple[Any, int, int] | None:
        ring = self.ring
        if ring is None:
            raise ClosedError("the SamplerPool is closed")
        offset, length = ring.slot_span()
        return ring.seg.buf, offset, length

    # -- taking slots -----------------------------------------------------------------------------
    def take_ready(self, step: int) -> Batch | None:
        """``next()``'s common case, for a ``quick`` pool: the held slot back to its worker, the
        next ready one held, in one call (``LearnerRing.take``: a learner waking cold from a
        train step pays ~1 us for each frame and object). None if none is ready or anything
        else is due: ``next``."""
        t0 = time.perf_counter_ns()
        if t0 >= self.next_check:  # (for every pool: its next() comes here first)
            self._look_around(t0)
        slots = self.slots
        if not self.quick or self.failure is not None or self.fences.pending or self.closing \
                or slots is None:
            return None
        # The held batch's release (a quick pool's is the hand-out), in the take: a close in
        # another thread finds it released or still held, never holding views unseen.
        batch = self.held = slots.take(self.held, t0)
        self.occupancy_sum += (slots.ready_count + (batch is not None)) / self.n_staging
        return batch

    def ready_slot(self, step: int) -> int | None:
        return self._ready(time.perf_counter_ns())

    def wait_slot(self, step: int, timeout: float) -> int:
        """A filled slot: one that is ready, else waited for (looking at messages, deaths,
        fences and rows to select meanwhile)."""
        t0 = time.perf_counter_ns()
        deadline = t0 + int(timeout * 1e9)
        slots = self._live_slots()
        while True:
            slot = self._ready(t0)
            if slot is not None:
                return slot
            self.rows.retry(self._assign)
            self.selection.enter_new_rows()  # workers may be waiting for rows to enter
            remaining = (deadline - time.perf_counter_ns()) / 1e9
            if remaining <= 0:
                raise Timeout(f"no batch within {timeout}s: {self.waiting_for()}")
            quick = self.rows.waiting or self.selection.table is not None
            # Slots held back by copies in flight come free within microseconds to milliseconds.
            pause = 0.0002 if len(self.fences) else 0.002 if quick else POLL_SLICE
            with slots.sleeping():  # the handshake of ``staging``
                if not self._collect():
                    self._poll(min(remaining, pause))
                    self._collect()
            self.next_check = time.perf_counter_ns() + CHECK_EVERY_NS

    def _ready(self, t0: int) -> int | None:
        """The next slot to deliver, if one is back (the workers' failure raised first, fenced
        slots handed back, messages and deaths looked at when due): HELD, counted as a batch
        delivered after a wait since ``t0``."""
        if time.perf_counter_ns() >= self.next_check:  # (a layer's next() skips take_ready)
            self._look_around(time.perf_counter_ns())
        if self.failure is not None:
            raise self.failure
        self._reap_fences()
        self._collect()
        slots = self._live_slots()
        slot = slots.pop()
        if slot is not None:
            self.occupancy_sum += (slots.ready_count + 1) / self.n_staging
            slots.delivered(time.perf_counter_ns() - t0)
        return slot

    def _look_around(self, now: int) -> None:
        """Messages and deaths (every ``CHECK_EVERY_NS``: ``next()`` polls only when it waits)."""
        self.next_check = now + CHECK_EVERY_NS
        self._poll(0)

    def _collect(self) -> int:
        """Take up the slots workers handed back; those STALE (learner-selected rows were
        overwritten before the gather) go out again, in their place or at the back. How many
        came back."""
        slots = self.slots
        if slots is None:
            return 0
        back = slots.take_up()
        if back and self.selects:
            for slot in slots.stale():
                # replaced in its place (epochs), or a new batch after those handed out before
                self._assign(slot, requeue=not self.rows.stale(slot))
        return back

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

    # -- giving slots back ------------------------------------------------------------------------
    def give_back(self, slot: int) -> None:
        """The learner is done with ``slot``: back to its worker now, or once its fences pass."""
        if self.selects:
            self.rows.done(slot)
        if self.closing or self.slots is None or self.failure is not None:
            return
        if not self.fences.busy(slot):
            self._assign(slot)

    def _reap_fences(self) -> None:
        """Hand back to the workers every slot whose device copies have completed."""
        if not len(self.fences):
            return
        for slot in self.fences.completed(in_order=self.cfg.ordered):
            if not self.closing and self.slots is not None and self.failure is None:
                self._assign(slot)

    def _assign(self, slot: int, requeue: bool = True) -> None:
        """Hand ``slot`` to its worker (ASSIGNED), or with learner-selected rows in it
        (ASSIGNED_ROWS; kept after a worker death: queue mode still delivers each row exactly
        once); ``requeue``: a new place in delivery order, else it keeps its own."""
        slots = self._live_slots()
        state = ASSIGNED
        if self.selects:
            rows = self.rows.rows_for(slot, self._select)
            if rows is None:  # nothing to select now: retried from next()
                slots.free(slot)
                return
            write_rows(slots.ring.slot(slot), *rows)
            state = ASSIGNED_ROWS
        slots.hand_out(slot, state, requeue)

    def _select(self) -> Rows | None:
        """A batch of rows the selection chooses, if one may be selected now."""
        return self.selection.select(self.batch_size, self.selection_rng) \
            if self.may_select() else None

    def _wake(self, worker: int) -> None:
        """``LearnerRing``'s wake-up of a worker that sleeps (its channel's eventfd)."""
        self.children.children[worker].wake()

    # -- workers ----------------------------------------------------------------------------------
    def _start_worker(self, w: _WorkerHandle, seed: np.random.SeedSequence,
                      fill: list[int]) -> None:
        """Start (or restart) worker ``w`` and ask it to fill ``fill`` (in their places)."""
        self.children.start(w, self.cfg_bytes, w.wid, seed)
        self._live_slots().ring.stats.set_restarts(self.children.restarts)
        w.hello = False
        for s in fill:
            self._assign(s, requeue=False)

    def _on_exit(self, w: _WorkerHandle) -> None:
        """A worker process ended: keep what it finished, reclaim the rest, restart or fail."""
        self._fail(w.take_messages())
        self._collect()  # what it finished (READY after its last byte) is delivered
        if self.failure is not None:
            return
        self.children.retire(w)
        # half-filled or never started: nobody writes them any more
        lost = self._live_slots().reclaim(w.slots)
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
        """Drop the ring; if device copies may still read it, keep it mapped."""
        if not settled and self.ring is not None:
            _keep_mapped(self.ring, timeout)
            self.ring = None
        if self.slots is not None:
            self.slots.close()  # (its take and templates refer back here: no cycle left)
            self.slots = None
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
