"""Staging-ring delivery: sampler worker processes fill shared-memory slots the learner assigns
them; the learner takes ready slots as views, hands them back, and supervises the workers.
"""

from __future__ import annotations

import collections
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
from .sampler_proc import OP_WAKE, SamplerConfig, sampler_main
from .selection import Rows
from .staging import (
    ASSIGNED,
    ASSIGNED_ROWS,
    HELD,
    LEARNER,
    READY,
    StagingRing,
    counts_deliveries,
    slot_arrays,
    write_rows,
)
from .supervise import Child, ChildSet, self_inflicted

POLL_SLICE = 0.25  # longest single wait, so deaths and timeouts are handled promptly
# While ready slots keep coming (so next() never blocks), look at messages and deaths this often.
CHECK_EVERY = 0.25

# Staging rings a device may still be reading when their pool closed: kept mapped until exit.
_IN_FLIGHT_RINGS: list[StagingRing] = []


class _WorkerHandle(Child):
    """The learner's record of one sampler worker (its id and slots survive restarts)."""

    def __init__(self, wid: int, slots: list[int]) -> None:
        super().__init__(wid)
        self.wid = wid
        self.slots = slots  # staging slots this worker fills, fixed for the pool's life
        self.hello = False
        # Told to fill, not reported ready yet; a dict for its order: after a death the lost
        # slots are handed out again in the order they were first assigned.
        self.assigned: dict[int, None] = {}
        self.startup_failures = 0
        self.batches = 0

    def hand_over(self, ring: StagingRing, slot: int, generation: int, state: int) -> None:
        """Assign ``slot`` to this worker (its STATE word stored last); a message wakes the
        process only if it waits (the handshake of ``staging``)."""
        self.assigned[slot] = None
        if ring.assign(slot, self.wid, generation, state):
            try:
                self.send(OP_WAKE, slot, generation)
            except OSError:
                pass  # it died; its sentinel will say so and the slot is reclaimed then

    def end_if_starting(self) -> None:
        """Kill the process if it has not said HELLO yet: it has nothing to finish. SIGKILL,
        not SIGTERM: a forked child may still run its parent's Python SIGTERM handler, which
        does not end a start-up sleeping in an unpickle (the close then waited 5 s)."""
        if not self.hello and self.alive:
            self.proc.kill()

    def stats(self) -> dict[str, Any]:
        return {"id": self.wid, "pid": self.proc.pid if self.proc else None, "alive": self.alive,
                "batches": self.batches}


class ReadySlots:
    """Filled slots as they came; with ``ordered``, taken in the order they were assigned."""

    def __init__(self, ordered: bool) -> None:
        self.ordered = ordered
        self.ready: collections.deque[int] = collections.deque()
        self.order: collections.deque[int] = collections.deque()  # slots in assignment order

    def __len__(self) -> int:
        return len(self.ready)

    def append(self, slot: int) -> None:
        self.ready.append(slot)

    def assigned(self, slot: int) -> None:
        """``slot`` was handed out: with ``ordered``, it is delivered after those before it."""
        if self.ordered:
            self.order.append(slot)

    def unassigned(self, slot: int) -> None:
        """``slot`` went back unfilled: it loses its place."""
        if slot in self.order:
            self.order.remove(slot)

    def pop(self) -> int | None:
        """The next slot to deliver, if it is ready."""
        if self.ordered:  # the oldest assignment first, once it is ready
            if not self.order or self.order[0] not in self.ready:
                return None
            slot = self.order.popleft()
            self.ready.remove(slot)
            return slot
        return self.ready.popleft() if self.ready else None


class RingDelivery(Delivery):
    """Slot ``s`` belongs to worker ``s % n_workers``; it moves FREE -> ASSIGNED -> (FILLING ->
    READY, the worker's) -> HELD -> back to its worker.

    Concurrency: the learner (this process) owns the staging segment and writes a slot's control
    words while it holds the slot; the worker writes them (and the slot's data) between
    ASSIGNED and READY. Hand-overs are STATE word stores, wake-ups only by the handshake of
    ``staging`` (no system call while batches are ready, but a ``poll`` for messages and deaths
    every ``CHECK_EVERY`` s). A worker that dies mid-fill has its slots reclaimed (generation
    bumped) and is restarted within the budget; a half-filled slot is never READY, so never
    delivered. Workers exit by themselves when the learner dies.
    """

    def __init__(self, parts: PoolParts, ctx: Any) -> None:
        super().__init__(parts)
        self.ctx = ctx
        self.children: ChildSet[_WorkerHandle] = ChildSet(
            ctx, sampler_main, "shmbuf-sampler", parts.cfg.max_restarts_per_minute)
        self.ring: StagingRing | None = None  # None until started, and once closed
        self.slot_rows: dict[int, Rows] = {}  # learner-selected rows of each assigned slot
        self.waiting: list[int] = []  # slots with no rows to select yet
        self.ready = ReadySlots(parts.cfg.ordered)
        self.tickets = itertools.count(1)  # generations, one count for all: assignment order
        self.next_check = 0.0  # monotonic time of the next look at messages and deaths

    def start(self) -> None:
        """Create the ring, start the workers, hand every slot out (the pool cleans up a
        half-done start with ``stop`` and ``close``)."""
        cfg, b = self.cfg, self.batch_size
        arrays = slot_arrays(self.out_arrays, b, self.compiled.index_shape)
        ring = self.ring = StagingRing.create(arrays, cfg.n_staging,
                                              {"buffer": self.buf.name, "batch_size": b},
                                              n_workers=cfg.n_workers)
        worker_cfg = SamplerConfig(
            buffer=self.buf.name, staging=ring.name, batch_size=b, fields=cfg.fields,
            out_fields=self.out_fields, transform=cfg.transform, min_size=cfg.min_size,
            rate_limited=cfg.limit is not None, n_workers=cfg.n_workers, plan=self.compiled.plan,
            priority_table=table.name if (table := self.selection.draws_from) else None,
        )
        self.cfg_bytes = cloudpickle.dumps(worker_cfg)
        self.views = self.make_views([ring.slot(s) for s in range(cfg.n_staging)])
        n_workers = cfg.n_workers
        for wid, seed in enumerate(cfg.seed.spawn(n_workers)):
            slots = list(range(wid, cfg.n_staging, n_workers))
            self._start_worker(_WorkerHandle(wid, slots), seed, [])
        # Slots in order, so worker s % n_workers gets slot s: the same round-robin that
        # ordered delivery follows, so batches leave in the order they were assigned.
        for slot in range(cfg.n_staging):
            self._assign(self._worker_of(slot), slot)

    # -- the interface ----------------------------------------------------------------------------
    def _live_ring(self) -> StagingRing:
        if self.ring is None:
            raise ClosedError("the SamplerPool is closed")
        return self.ring

    def slot_arrays(self, slot: int) -> dict[str, np.ndarray]:
        return self._live_ring().slot(slot)

    def mark_held(self, slot: int) -> None:
        self._live_ring().set_state(slot, HELD)

    def workers(self) -> list[_WorkerHandle]:
        return self.children.children

    def _worker_of(self, slot: int) -> _WorkerHandle:
        return self.children.children[slot % self.cfg.n_workers]

    @property
    def restarts(self) -> int:
        return self.children.restarts

    def wake(self) -> None:
        super().wake()
        self.children.wake()

    def stats(self, batches: int) -> dict[str, Any]:
        return {**super().stats(batches), "workers": [w.stats() for w in self.workers()]}

    @property
    def ready_count(self) -> int:
        return len(self.ready)

    def selected_pending(self) -> int:
        return sum(len(w.assigned) for w in self.workers())

    def shared_memory(self) -> tuple[Any, int, int] | None:
        ring = self._live_ring()
        offset, length = ring.slot_span()
        return ring.seg.buf, offset, length

    # -- taking batches ---------------------------------------------------------------------------
    @counts_deliveries
    def next(self, timeout: float, step: int) -> Batch:
        now = time.monotonic()
        deadline = now + timeout
        self._collect()
        self.occupancy_sum += len(self.ready) / self.cfg.n_staging
        if now >= self.next_check:  # ready slots kept coming: still notice deaths and errors
            self.next_check = now + CHECK_EVERY
            self._poll(0)
        while True:
            if self.failure is not None:
                raise self.failure
            self._reap_fences()
            if self.stage is not None:
                self._submit_ready(self.stage, step)
                if len(self.stage):
                    return self.hold_device(self.stage)
            else:
                slot = self.ready.pop()
                if slot is not None:
                    return self.hold(slot, step)
            if self.waiting:
                self._retry_waiting()
            self.selection.enter_new_rows()  # workers may be waiting for rows to enter
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Timeout(f"no batch within {timeout}s: {self.waiting_for()}")
            quick = self.waiting or self.selection.table is not None
            # Slots held back by copies in flight come free within microseconds to milliseconds.
            pause = 0.0002 if len(self.fences) else 0.002 if quick else POLL_SLICE
            with self._live_ring().sleeping(LEARNER):  # the handshake of ``staging``
                if not self._collect():
                    self._poll(min(remaining, pause))
                    self._collect()
            self.next_check = time.monotonic() + CHECK_EVERY

    def _collect(self) -> int:
        """Take up the slots workers handed back (READY, or STALE: learner-selected rows were
        overwritten before the gather) from their STATE words; how many."""
        ring, found = self.ring, 0
        for w in self.children.children if ring is not None else ():
            for slot in ring.handed_back(w.assigned) if w.assigned else ():  # type: ignore[union-attr]
                found += 1
                del w.assigned[slot]
                if ring.state(slot) == READY:  # type: ignore[union-attr]
                    self.ready.append(slot)
                    w.batches += 1
                    self.selection.gathered(slot)
                else:
                    self.selection.stale(self.slot_rows.pop(slot))
                    self.selection.gathered(slot)
                    self._assign(w, slot, requeue=False)
        return found

    def _poll(self, timeout: float) -> None:
        """Wait for messages, deaths or a wake-up; handle them."""
        woken, messages, exits = self.children.wait(timeout)
        if woken:
            # Only close() writes the wake pipe, and it may be closing the pipe right now
            # in another thread: do not read it, just report the close.
            self.check_open()
        for w in messages:
            self._receive(w)
        self.check_open()  # closed by another thread meanwhile: restart nobody
        for w in exits:
            self._on_exit(w)

    def _submit_ready(self, stage: DeviceStage, step: int) -> None:
        """Copy ready slots to the device while device buffers are free; each slot goes back to
        the workers once its copy has completed."""
        while stage.can_submit():
            slot = self.ready.pop()
            if slot is None:
                return
            self.submit_slot(stage, slot, step)
            self.slot_done(slot)

    # -- giving slots back ------------------------------------------------------------------------
    def slot_done(self, slot: int) -> None:
        """The learner is done with ``slot``: back to its worker now, or once its fences pass."""
        self.slot_rows.pop(slot, None)
        if self.closing or self.ring is None or self.failure is not None:
            return
        if not self.fences.busy(slot):
            self._assign(self._worker_of(slot), slot)

    def _reap_fences(self) -> None:
        """Hand back to the workers every slot whose device copies have completed."""
        if not len(self.fences):
            return
        for slot in self.fences.completed(in_order=self.cfg.ordered):
            if not self.closing and self.ring is not None and self.failure is None:
                self._assign(self._worker_of(slot), slot)

    def _assign(self, w: _WorkerHandle, slot: int, requeue: bool = True) -> None:
        """Hand ``slot`` to ``w`` (ASSIGNED), or with learner-selected rows in it (ASSIGNED_ROWS;
        kept after a worker death: queue mode still delivers each row exactly once)."""
        ring = self.ring
        assert ring is not None
        state = ASSIGNED
        if self.selection.learner_selects:
            rows = self.slot_rows.get(slot)
            if rows is None:
                rows = (self.selection.select(self.batch_size, self.selection_rng)
                        if self.may_select() else None)
                if rows is None:  # nothing to select now: retried from next()
                    ring.free(slot)
                    self.waiting.append(slot)
                    self.ready.unassigned(slot)  # a new place once it has rows again
                    return
                self.slot_rows[slot] = rows
                self.selection.track(slot, rows)
            write_rows(ring.slot(slot), *rows)
            state = ASSIGNED_ROWS
        self.gen[slot] = next(self.tickets)
        if requeue:
            self.ready.assigned(slot)  # (a slot handed out again keeps its place)
        w.hand_over(ring, slot, self.gen[slot], state)

    def _retry_waiting(self) -> None:
        for slot in self.waiting[:]:
            self.waiting.remove(slot)
            self._assign(self._worker_of(slot), slot)
            if self.waiting and self.waiting[-1] == slot:
                break  # still nothing to select; the others would find nothing either

    # -- workers ----------------------------------------------------------------------------------
    def _start_worker(self, w: _WorkerHandle, seed: np.random.SeedSequence,
                      fill: list[int]) -> None:
        """Start (or restart) worker ``w`` and ask it to fill ``fill``."""
        self.children.start(w, self.cfg_bytes, w.wid, seed)
        w.hello = False
        for s in fill:
            self._assign(w, s, requeue=False)

    def _receive(self, w: _WorkerHandle) -> None:
        """Take ``w``'s messages (OP_READY only woke us: ``_collect`` reads the states)."""
        for op, _slot, _gen, text in w.receive():
            if op == OP_HELLO:
                w.hello = True
                w.startup_failures = 0
            elif op == OP_ERROR:
                self._fail(WorkerError(
                    f"sampler worker {w.wid} (pid {w.proc.pid}) raised; its traceback:\n"
                    f"{text.decode('utf-8', 'replace')}"
                ))

    def _on_exit(self, w: _WorkerHandle) -> None:
        """A worker process ended: keep what it finished, reclaim the rest, restart or fail."""
        self._receive(w)
        self._collect()  # what it finished (READY after its last byte) is delivered
        if self.failure is not None:
            return
        children, ring = self.children, self._live_ring()
        children.retire(w)
        pid, how = w.proc.pid, w.describe_exit()
        lost = list(w.assigned)
        for s in lost:  # half-filled or never started: nobody writes them any more
            self.gen[s] = next(self.tickets)
            ring.free(s, self.gen[s])
        w.assigned.clear()
        if not w.hello and self_inflicted(w.proc.exitcode):
            w.startup_failures += 1
        if w.startup_failures >= 2:
            self._fail(WorkerDiedError(
                f"sampler worker {w.wid} (pid {pid}) {how} during start-up, twice in a row; not "
                f"restarting it. Check that the buffer {self.buf.name!r} is reachable and the "
                f"transform imports in a fresh process (start method "
                f"{self.ctx.get_start_method()!r})"
            ))
            return
        if not children.may_restart():
            self._fail(WorkerDiedError(
                f"sampler worker {w.wid} (pid {pid}) {how}; {children.budget.exhausted()}. Fix "
                f"the cause, or raise max_restarts_per_minute"
            ))
            return
        # Slots it finished stay READY and are delivered; the new process refills the lost ones.
        self._start_worker(w, self.cfg.seed.spawn(1)[0], lost)

    def _fail(self, error: BaseException) -> None:
        if self.failure is None:
            self.failure = error

    # -- teardown ---------------------------------------------------------------------------------
    def stop(self, timeout: float) -> None:
        """Ask the workers to stop. One still starting (no HELLO) has nothing to finish: it is
        terminated at once rather than waited for (so a young spawn pool closes promptly)."""
        for w in self.workers():
            self._receive(w)
            w.end_if_starting()
        self.children.stop(timeout)

    def close(self, settled: bool, timeout: float) -> None:
        """Unpin and drop the ring; if device copies may still read it, keep it mapped."""
        if not settled and self.ring is not None:
            _keep_mapped(self.ring, timeout)
            self.ring = None
            self.pinned = None  # stays page-locked with its mapping
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
