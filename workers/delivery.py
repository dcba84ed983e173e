"""Delivery: how filled batches reach the learner, behind one interface for both ways of filling.

``Delivery`` holds what the two share: staging slots -> ``Batch`` (views, torch or JAX arrays,
importance weights), their release, and the device side (``SlotFences``, ``DeviceStage``,
page-locked staging, ``Batch.to``). ``InProcessDelivery`` (``delivery_local.py``) fills one slot
in this process; ``RingDelivery`` (``delivery_ring.py``) takes slots that sampler workers filled.
"""

from __future__ import annotations

import collections
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmbuf import ReplayBuffer
from shmbuf.errors import ClosedError
from shmbuf.priority import importance_weights

from .batch import Batch
from .config import PoolConfig
from .device import (
    Backend,
    DeviceStage,
    JaxViews,
    SlotFences,
    fenced_copy,
    make_backend,
    page_lock,
)
from .selection import Selection
from .staging import INDICES, INFO, LANES, PMIN, PROBS, WEIGHTS
from .supervise import Child


def device_backend(device: Any) -> Backend | None:
    """The runtime for ``device=`` (None without one); raises at once if it is unusable."""
    return make_backend(device) if device is not None else None


@dataclass(frozen=True)
class PoolParts:
    """What a delivery works with; made (and closed) by ``SamplerPool``."""

    buf: ReplayBuffer
    cfg: PoolConfig
    compiled: Any  # shmbuf's compiled plan for (cfg.plan, cfg.fields)
    out_arrays: list[tuple[str, tuple[int, ...], np.dtype]]
    selection: Selection  # how rows are chosen: by workers, or by the learner
    backend: Backend | None


class RecentBatches:
    """The ``(indices array, lanes)`` of the last few weighted batches, so that
    ``update_priorities(batch.indices, ...)`` finds the lanes by the array's identity."""

    def __init__(self, n_lanes: int, keep: int = 8) -> None:
        self.n_lanes = n_lanes
        self.batches: collections.deque[tuple[Any, np.ndarray]] = collections.deque(maxlen=keep)

    def add(self, indices: Any, lanes: np.ndarray) -> None:
        self.batches.append((indices, lanes))

    def clear(self) -> None:
        self.batches.clear()

    def lanes_of(self, indices: Any) -> int | np.ndarray:
        """The lanes of the recent batch whose ``indices`` array this is (0 for a buffer of one
        lane); ``ValueError`` if there is none."""
        if self.n_lanes == 1:
            return 0
        # Newest first: a staging slot's indices array is the same object for every batch that
        # slot carries, and only its latest batch's lanes are the right ones.
        lanes = next((lanes for ref, lanes in reversed(self.batches) if ref is indices), None)
        if lanes is None:
            raise ValueError("pass lanes=batch.lanes: the buffer has several lanes and these "
                             "indices are not the indices array of a recent batch")
        return lanes


class Delivery:
    """Hands the learner one filled slot at a time as a ``Batch`` and takes it back.

    Subclasses provide ``next(timeout, step)``, ``slot_arrays(slot)``, ``slot_done(slot)`` and
    their teardown; ``step`` is the number of batches delivered so far (for ``beta``).

    Concurrency: learner thread only, except ``wake()`` (from ``close()`` in another thread),
    which only sets ``closing`` and wakes a wait. A slot held by the learner is read by it and by
    device copies it fenced in ``fences``; it goes back to be refilled once they all passed.
    """

    copies_for_jax = False  # JAX gets copies (private, reused memory) rather than views

    def __init__(self, parts: PoolParts) -> None:
        self.buf, self.cfg = parts.buf, parts.cfg
        self.compiled, self.out_arrays = parts.compiled, parts.out_arrays
        self.batch_size = parts.cfg.batch_size
        self.out_fields = [name for name, _, _ in parts.out_arrays]
        self.selection = parts.selection
        self.consumes = parts.selection.consumes  # releases are reported to the selection
        self.held_rows: tuple[Any, Any] = (None, None)  # (lanes, indices) of held, if consumes
        self.weighted = parts.selection.table is not None  # batches carry importance weights
        self.to_device = parts.cfg.output == "torch"  # batches have Batch.to
        # A batch is its slot's views as they are: nothing to compute or wrap in the learner.
        self.plain = not (self.weighted or parts.selection.tags_batches or parts.cfg.output == "jax")
        self.selection_rng = np.random.default_rng(parts.cfg.seed.spawn(1)[0])
        self.closing = False
        self.failure: BaseException | None = None
        self.views: list[dict[str, Any]] = []
        self.batch_views: dict[int, tuple[dict[str, Any], Any, Any, Any]] = {}
        self.gen = [0] * parts.cfg.n_staging
        self.held: Batch | None = None
        self.recent = RecentBatches(parts.buf.lanes)  # update_priorities finds their lanes
        self.fences = SlotFences()  # staging slots still read by device copies or JAX arrays
        self.backend = parts.backend  # device runtime: for device=, and pinned host batches
        self.stage: DeviceStage | None = None
        self.backends: dict[str, Backend] = {}  # Batch.to(device) targets
        self.jax: JaxViews | None = None  # output="jax"
        self.jax_fence: Any = None  # of the held batch's arrays
        self.pinned: Any = None  # (torch, pointer) of a page-locked staging ring
        self.occupancy_sum = 0.0  # ready slots seen by each next(), summed

    # -- the interface ----------------------------------------------------------------------------
    def next(self, timeout: float, step: int) -> Batch:
        raise NotImplementedError

    def take_ready(self, step: int) -> Batch | None:
        """The held batch released and a filled slot held without waiting, if a delivery can."""
        return None

    def slot_arrays(self, slot: int) -> dict[str, np.ndarray]:
        """The NumPy arrays of ``slot`` (fields, indices, lanes, weights, probabilities)."""
        raise NotImplementedError

    def slot_done(self, slot: int) -> None:
        """The learner and every fenced copy are done with ``slot``."""

    @property
    def ready_count(self) -> int:
        return 0

    def workers(self) -> Sequence[Child]:
        """The processes that fill slots, if any."""
        return ()

    def stats(self, batches: int) -> dict[str, Any]:
        """The staging ring's and the workers' part of ``SamplerPool.stats()``."""
        ready = self.ready_count
        return {
            "staging_ready": ready,
            "staging_occupancy": ready / self.cfg.n_staging,
            "mean_staging_occupancy": self.occupancy_sum / max(batches, 1),
            "restarts": self.restarts,
            "workers": [],
        }

    @property
    def restarts(self) -> int:
        return 0

    def selected_pending(self) -> int:
        """Batches of learner-selected rows handed out and not yet gathered."""
        return 0

    def waiting_for(self) -> str:
        """What a ``next()`` that timed out was waiting for, and what to do about it."""
        cfg = self.cfg
        blocked = self.buf.storage.limiter.blocked_reason(self.batch_size, cfg.min_size,
                                                          cfg.limit is not None)
        if blocked is not None:
            return blocked
        if len(self.fences) == cfg.n_staging:
            return (f"all {cfg.n_staging} staging slots are still read by device copies or "
                    f"by arrays of earlier batches (output={cfg.output!r}): drop arrays of old "
                    f"batches (copy what you keep), or raise n_staging")
        alive = sum(1 for w in self.workers() if w.alive)
        return f"{alive} of {cfg.n_workers} workers alive, none has a batch ready"

    def wake(self) -> None:
        """``close()`` from any thread: end the learner's wait with ``ClosedError``."""
        self.closing = True

    def _fail(self, error: BaseException | None) -> None:
        """The first failure is the one ``next()`` raises."""
        if self.failure is None:
            self.failure = error

    def check_open(self) -> None:
        if self.closing:
            raise ClosedError("the SamplerPool is closed")

    # -- slots to batches -------------------------------------------------------------------------
    def may_select(self) -> bool:
        """May the learner select a batch now? ``min_size`` and ``samples_per_insert`` hold back
        learner-selected rows (``max_times_sampled``, the queue) as they hold back workers'
        own draws. Batches selected but not yet gathered count as sampled already: their
        workers add them to the limiter's sample count only once they are gathered."""
        return self.buf.storage.limiter.can_sample(self.batch_size * (1 + self.selected_pending()),
                                                   self.cfg.min_size, self.cfg.limit is not None)

    def take_slot(self, slot: int, step: int) -> dict[str, Any]:
        """The learner takes a ready slot (marked HELD already, where that is recorded): fill
        in its importance weights; its views."""
        if self.weighted:  # importance weights with this batch's beta
            arrays = self.slot_arrays(slot)
            arrays[WEIGHTS][...] = importance_weights(arrays[PROBS], float(arrays[PMIN][0]),
                                                      self.cfg.beta(step))
        return self.views[slot]

    def hold(self, slot: int, step: int) -> Batch:
        """The learner holds ``slot`` (marked HELD already): its batch."""
        info = None
        if not self.plain:  # importance weights to compute, INFO words to read, JAX arrays
            views = self.take_slot(slot, step)
            info = views[INFO].tolist() if self.selection.tags_batches else None
        if self.jax is not None:  # fresh zero-copy arrays, fenced by their lifetime in JAX
            views, fence = self.jax.wrap(
                {**{n: views[n] for n in self.out_fields}, INDICES: views[INDICES],
                 LANES: views[LANES], WEIGHTS: views[WEIGHTS]},
                copy=self.copies_for_jax, host_keys=(INDICES, LANES))
            self.jax_fence = fence
            fields, indices, lanes, weights = ({n: views[n] for n in self.out_fields},
                                               views[INDICES], views[LANES], views[WEIGHTS])
        else:
            fields, indices, lanes, weights = self.batch_views.get(slot) or self.cache_views(slot)
        batch = self.held = Batch(fields, indices, lanes, weights, self.release_batch, slot,
                                  self.gen[slot], self.batch_to if self.to_device else None, info)
        if self.consumes:  # (views of the slot: whole until it is handed out again)
            self.held_rows = (lanes, indices)
        if self.weighted:
            self.recent.add(indices, np.array(lanes))
        return batch

    def cache_views(self, slot: int) -> tuple[dict[str, Any], Any, Any, Any]:
        """``slot``'s (field views, indices, lanes, weights), made once: they never change while
        the delivery is open, and a Batch only reads its dict."""
        views = self.views[slot]
        cached = self.batch_views[slot] = ({n: views[n] for n in self.out_fields}, views[INDICES],
                                           views[LANES], views[WEIGHTS])
        return cached

    def release_batch(self, batch: Batch, on_device: bool = False) -> None:
        """A ``Batch``'s release: the held batch's staging slot goes back to be refilled (or,
        ``on_device``, its device buffer back to ``self.stage``); any other batch was let go
        already (``release_held``) and is ignored."""
        if batch is not self.held:
            return
        self.held = None
        if self.consumes:  # (the queue: its rows are consumed now)
            self.selection.released(*self.held_rows)
        if on_device:
            if self.stage is not None:  # else torn down: the device buffers are gone
                self.stage.give_back(batch.slot)
            return
        if self.pinned is not None and self.backend is not None:
            # A copy the learner issued on its current stream may still be reading the slot.
            self.fences.add(batch.slot, self.backend.record_current())
        if self.jax_fence is not None:
            self.release_jax(batch.slot)
        self.slot_done(batch.slot)

    def release_jax(self, slot: int) -> None:
        """The slot of a released JAX batch waits until JAX has let go of its arrays."""
        if self.jax_fence is not None:
            self.fences.add(slot, self.jax_fence)
            self.jax_fence = None

    def batch_to(self, batch: Batch, device: Any) -> dict[str, Any]:
        """``Batch.to(device)``: fenced copies of a host batch (see ``Batch.to``)."""
        backend = self.backend
        if backend is None or str(backend.device) != str(device):
            backend = self.backends.get(str(device))
            if backend is None:
                backend = self.backends[str(device)] = make_backend(device)
        arrays = {n: batch[n] for n in batch}
        arrays.update(indices=batch.indices, lanes=batch.lanes, weights=batch.weights)
        slot = batch.slot
        return fenced_copy(backend, arrays, lambda fence: self.fences.add(slot, fence),
                           host_keys=("indices", "lanes"))

    # -- device delivery --------------------------------------------------------------------------
    def submit_slot(self, stage: DeviceStage, slot: int, step: int) -> None:
        """Enqueue the copy of ``slot`` to a device buffer of ``stage`` (``self.stage``); fence
        the slot with it."""
        views = self.take_slot(slot, step)
        host = {n: views[n] for n in self.out_fields}
        host[WEIGHTS] = views[WEIGHTS]
        info = views[INFO].tolist() if self.selection.tags_batches else None
        tag = (self.gen[slot], views[INDICES].clone(), views[LANES].clone(), info)
        try:
            self.fences.add(slot, stage.submit(host, tag))
        except BaseException:
            try:  # copies enqueued before the failure may still read the slot
                self.fences.add(slot, stage.backend.record_copy())
            finally:
                self.slot_done(slot)
            raise

    def hold_device(self, stage: DeviceStage) -> Batch:
        """The learner takes the oldest device buffer of ``stage`` (``self.stage``)."""
        index, arrays, (gen, indices, lanes, info) = stage.take()
        batch = Batch({n: arrays[n] for n in self.out_fields}, indices, lanes, arrays[WEIGHTS],
                      self.release_device_batch, index, gen, info=info)
        if self.weighted:
            self.recent.add(indices, lanes.numpy())
        if self.consumes:
            self.held_rows = (lanes, indices)
        self.held = batch
        return batch

    def release_device_batch(self, batch: Batch) -> None:
        """The release of a ``hold_device`` batch: ``release_batch(batch, on_device=True)``."""
        self.release_batch(batch, on_device=True)

    # -- views ------------------------------------------------------------------------------------
    def make_views(self, slots: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
        """Per slot: the learner's views (fields plus the internal arrays)."""
        cfg = self.cfg
        if cfg.output in ("numpy", "jax"):
            if cfg.pin_memory:
                warnings.warn("pin_memory=True only applies to output='torch'", stacklevel=5)
            if cfg.output == "jax":
                self.jax = JaxViews()
            return [dict(s) for s in slots]
        try:
            import torch
        except ImportError:
            raise ImportError(
                "output='torch' needs PyTorch: pip install 'shmbuf[torch]' (or torch)"
            ) from None
        if self.backend is not None:  # device=: pinned staging, a ring of device buffers
            if getattr(self.backend, "cuda", False):
                self.pin(torch)
            arrays = [(n, tuple(slots[0][n].shape), slots[0][n].dtype)
                      for n in [*self.out_fields, WEIGHTS]]
            self.stage = DeviceStage(self.backend, arrays, cfg.device_prefetch)
        elif cfg.pin_memory:
            self.pin(torch)
            if self.pinned is not None:  # releases are fenced on the current CUDA stream
                self.backend = make_backend("cuda")
        return [{k: torch.from_numpy(v) for k, v in s.items()} for s in slots]

    def shared_memory(self) -> tuple[Any, int, int] | None:
        """(mapping, offset, length) of the staging slots if they are shared memory."""
        return None

    def pin(self, torch: Any) -> None:
        """Page-lock the staging ring, if it is shared memory (``device.page_lock``)."""
        self.pinned = page_lock(torch, self.shared_memory())

    # -- teardown ---------------------------------------------------------------------------------
    def release_held(self) -> None:
        """Teardown, first step: invalidate the held batch; fence what may still read it."""
        if self.held is not None:
            if self.consumes:  # a clean close consumes the batch in the learner's hands
                self.selection.released(*self.held_rows)
            if self.pinned is not None and self.backend is not None and self.stage is None:
                # The learner's own async copies of the held batch: wait for them below.
                self.fences.add(self.held.slot, self.backend.record_current())
            self.release_jax(self.held.slot)
            self.held._invalidate()
            self.held = None
        self.recent.clear()  # (JAX) arrays of recent batches may fence their slots

    def stop(self, timeout: float) -> None:
        """Teardown, second step: stop whatever fills slots."""

    def settle(self, deadline: float) -> bool:
        """Teardown, third step: wait (until ``deadline``) for device copies that read staging
        memory; True if they all completed."""
        settled = self.fences.drain(max(0.1, deadline - time.monotonic()))
        if self.stage is not None:
            settled = self.stage.drain(max(0.1, deadline - time.monotonic())) and settled
            self.stage.close()
            self.stage = None
        return settled

    def close(self, settled: bool, timeout: float) -> None:
        """Teardown, last step: unpin and drop the staging memory."""
        if self.pinned is not None:
            torch, ptr = self.pinned
            torch.cuda.cudart().cudaHostUnregister(ptr)
            self.pinned = None
        self.views = []
        self.batch_views.clear()
