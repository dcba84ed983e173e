"""What every delivery shares: the ``Delivery`` interface the pool calls, ``HostDelivery`` (slots
handed out as host batches) and ``DeliveryLayer`` (a wrapper making its own batches of a host
delivery's slots), with the parts a pool gives them (``PoolParts``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmbuf import ReplayBuffer
from shmbuf.errors import ClosedError
from shmbuf.priority import importance_weights

from ..batch import Batch
from ..config import PoolConfig
from ..device import Backend, Fence, SlotFences, fenced_copy, make_backend
from ..selection import Selection
from ..staging import INDICES, INFO, LANES, PMIN, PROBS, WEIGHTS
from ..supervise import Child


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


def _host_copy(array: Any) -> np.ndarray:
    """A NumPy copy of ``array`` (NumPy, a torch tensor on the host, or a JAX array)."""
    as_numpy = getattr(array, "numpy", None)  # (torch: np.array would warn about copy=)
    return np.array(as_numpy() if as_numpy is not None else array)


class Delivery:
    """Hands the learner one batch at a time (``held``) and takes it back.

    ``next(timeout, step)`` is the next batch (the pool has let go of the held one first);
    ``take_ready(step)`` one that needs no wait, or None; ``step`` is the number of batches
    delivered so far (for ``beta``). Whoever makes a batch gives it to the learner with
    ``deliver`` and takes it back with ``let_go`` (its release): the queue's rows are consumed
    then, and ``recent`` keeps the lanes of weighted batches for ``update_priorities``.

    Concurrency: learner thread only, except ``wake()`` (from ``close()`` in another thread),
    which only sets ``closing`` and wakes a wait.
    """

    closing: bool
    ring: Any = None  # the staging ring, if the slots are shared memory

    def __init__(self, parts: PoolParts) -> None:
        self.parts, self.cfg, self.selection = parts, parts.cfg, parts.selection
        self.consumes = parts.selection.consumes  # releases are reported to the selection
        self.weighted = parts.selection.table is not None  # batches carry importance weights
        self.held: Batch | None = None
        self.held_rows: tuple[Any, Any] = (None, None)  # (lanes, indices) of held, if consumes
        self.recent = RecentBatches(parts.buf.lanes)  # update_priorities finds their lanes

    # -- the interface ----------------------------------------------------------------------------
    def start(self) -> None:
        """Create the slots and start whatever fills them."""

    def next(self, timeout: float, step: int) -> Batch:
        raise NotImplementedError

    def take_ready(self, step: int) -> Batch | None:
        """The held batch released and a filled slot held without waiting, if a delivery can."""
        return None

    def workers(self) -> Sequence[Child]:
        """The processes that fill slots, if any."""
        return ()

    def stats(self, batches: int) -> dict[str, Any]:
        """The staging ring's and the workers' part of ``SamplerPool.stats()``."""
        raise NotImplementedError

    def wake(self) -> None:
        """``close()`` from any thread: end the learner's wait with ``ClosedError``."""
        self.closing = True

    # -- the learner's batch ----------------------------------------------------------------------
    def deliver(self, batch: Batch) -> Batch:
        """``batch`` is the learner's now: held, its rows kept for the queue's release and its
        lanes (a copy: the slot is refilled later) for ``update_priorities``."""
        self.held = batch
        if self.consumes:  # (views of the slot: whole until it is handed out again)
            self.held_rows = (batch.lanes, batch.indices)
        if self.weighted:
            self.recent.add(batch.indices, _host_copy(batch.lanes))
        return batch

    def let_go(self, batch: Batch) -> bool:
        """A ``Batch``'s release: True if it was the held batch (now let go of, its rows
        consumed); any other batch was let go of already (``release_held``)."""
        if batch is not self.held:
            return False
        self.held = None
        if self.consumes:  # (the queue: its rows are consumed now)
            self.selection.released(*self.held_rows)
        return True

    # -- teardown: release_held, stop, settle, close ----------------------------------------------
    def release_held(self) -> None:
        """Teardown, first step: invalidate the held batch; fence what may still read it."""
        held = self.held
        if held is not None:
            if self.consumes:  # a clean close consumes the batch in the learner's hands
                self.selection.released(*self.held_rows)
            self.fence_released(held)
            held._invalidate()
            self.held = None
        self.recent.clear()  # (JAX) arrays of recent batches may fence their slots

    def fence_released(self, batch: Batch) -> None:
        """Fence ``batch``'s slot with what may still read it once the learner let go."""

    def stop(self, timeout: float) -> None:
        """Teardown, second step: stop whatever fills slots."""

    def settle(self, deadline: float) -> bool:
        """Teardown, third step: wait (until ``deadline``) for device copies that read staging
        memory; True if they all completed."""
        return True

    def close(self, settled: bool, timeout: float) -> None:
        """Teardown, last step: drop the staging memory (kept mapped unless ``settled``)."""


class HostDelivery(Delivery):
    """Filled staging slots as host batches: each slot's views (NumPy, or torch with
    ``Batch.to``), importance weights computed per batch where the selection keeps priorities,
    a learner-chosen batch's ``INFO`` words read (epochs, short batches).

    Layers use its slot face: ``ready_slot`` / ``wait_slot`` (a filled slot, now the
    learner's), ``host_arrays`` (its views, weights filled in), ``fence`` (something still
    reads it) and ``give_back`` (refill it once every fence passed). Subclasses provide
    ``ready_slot``, ``wait_slot``, ``give_back`` and ``slot_arrays`` (and ``generation``,
    ``shared_memory`` where they have them).

    Concurrency: learner thread only (see ``Delivery``). A slot the learner let go of is refilled
    only once every fence added for it has passed (``SlotFences``).
    """

    copies_for_jax = False  # JAX gets copies (private, reused memory) rather than views

    def __init__(self, parts: PoolParts) -> None:
        super().__init__(parts)
        self.buf, self.compiled, self.out_arrays = parts.buf, parts.compiled, parts.out_arrays
        self.batch_size = parts.cfg.batch_size
        self.out_fields = [name for name, _, _ in parts.out_arrays]
        self.tags = parts.selection.tags_batches  # batches say their epoch (INFO words)
        self.selection_rng = np.random.default_rng(parts.cfg.seed.spawn(1)[0])
        self.closing = False
        self.failure: BaseException | None = None
        self.views: list[dict[str, Any]] = []  # per slot: every array, NumPy or torch
        self.templates: list[Batch] = []  # per slot: the views, release and to of its batches
        self.fences = SlotFences()  # staging slots still read by device copies or JAX arrays
        self.backends: dict[str, Backend] = {}  # Batch.to(device) targets
        self.occupancy_sum = 0.0  # ready slots seen by each next(), summed

    # -- the slot face ----------------------------------------------------------------------------
    def ready_slot(self, step: int) -> int | None:
        """A filled slot, now the learner's, if one is ready without waiting."""
        raise NotImplementedError

    def wait_slot(self, step: int, timeout: float) -> int:
        """A filled slot, now the learner's, waited for up to ``timeout`` s (``Timeout``)."""
        raise NotImplementedError

    def give_back(self, slot: int) -> None:
        """The learner is done with ``slot``: refilled once every fence on it passed."""
        raise NotImplementedError

    def slot_arrays(self, slot: int) -> dict[str, np.ndarray]:
        """The NumPy arrays of ``slot`` (fields, indices, lanes, weights, probabilities)."""
        raise NotImplementedError

    def generation(self, slot: int) -> int:
        """``slot``'s generation (the batch's ``generation``)."""
        return 0

    def shared_memory(self) -> tuple[Any, int, int] | None:
        """(mapping, offset, length) of the staging slots if they are shared memory."""
        return None

    def host_arrays(self, slot: int, step: int) -> tuple[dict[str, Any], list[int] | None]:
        """``slot``'s views with this batch's importance weights filled in (``beta`` at
        ``step``), and its ``INFO`` words where batches are tagged."""
        if self.weighted:
            arrays = self.slot_arrays(slot)
            arrays[WEIGHTS][...] = importance_weights(arrays[PROBS], float(arrays[PMIN][0]),
                                                      self.cfg.beta(step))
        views = self.views[slot]
        return views, views[INFO].tolist() if self.tags else None

    def fence(self, slot: int, fence: Fence) -> None:
        self.fences.add(slot, fence)

    # -- host batches -----------------------------------------------------------------------------
    def next(self, timeout: float, step: int) -> Batch:
        return self.deliver(self.batch_of(self.wait_slot(step, timeout), step,
                                          self.release_batch))

    def batch_of(self, slot: int, step: int, release_fn: Any) -> Batch:
        """``slot``'s batch of views, let go of by ``release_fn``."""
        _, info = self.host_arrays(slot, step)
        return self.templates[slot]._renewed(self.generation(slot), release_fn, info)

    def release_batch(self, batch: Batch) -> None:
        """A host batch's release: its slot back to be refilled, if it was the held batch."""
        if self.let_go(batch):
            self.give_back(batch.slot)

    def batch_to(self, batch: Batch, device: Any) -> dict[str, Any]:
        """``Batch.to(device)``: fenced copies of a host batch (see ``Batch.to``)."""
        backend = self.backends.get(str(device))
        if backend is None:
            backend = self.backends[str(device)] = make_backend(device)
        arrays = {n: batch[n] for n in batch}
        arrays.update(indices=batch.indices, lanes=batch.lanes, weights=batch.weights)
        slot = batch.slot
        return fenced_copy(backend, arrays, lambda fence: self.fences.add(slot, fence),
                           host_keys=("indices", "lanes"))

    def make_views(self, slots: list[dict[str, np.ndarray]]) -> None:
        """Per slot: the learner's views (fields plus the internal arrays: torch tensors with
        output="torch") and its batch template."""
        to_fn = None
        if self.cfg.output == "torch":
            try:
                import torch
            except ImportError:
                raise ImportError(
                    "output='torch' needs PyTorch: pip install 'shmbuf[torch]' (or torch)"
                ) from None
            self.views = [{k: torch.from_numpy(v) for k, v in s.items()} for s in slots]
            to_fn = self.batch_to
        else:
            self.views = [dict(s) for s in slots]
        self.templates = [Batch({n: v[n] for n in self.out_fields}, v[INDICES], v[LANES],
                                v[WEIGHTS], self.release_batch, slot, 0, to_fn)
                          for slot, v in enumerate(self.views)]

    # -- what the pool reports --------------------------------------------------------------------
    @property
    def ready_count(self) -> int:
        return 0

    @property
    def restarts(self) -> int:
        return 0

    def selected_pending(self) -> int:
        """Batches of learner-selected rows handed out and not yet gathered."""
        return 0

    def stats(self, batches: int) -> dict[str, Any]:
        ready = self.ready_count
        return {
            "staging_ready": ready,
            "staging_occupancy": ready / self.cfg.n_staging,
            "mean_staging_occupancy": self.occupancy_sum / max(batches, 1),
            "restarts": self.restarts,
            "workers": [],
        }

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

    def may_select(self) -> bool:
        """May the learner select a batch now? ``min_size`` and ``samples_per_insert`` hold back
        learner-selected rows (``max_times_sampled``, the queue) as they hold back workers'
        own draws. Batches selected but not yet gathered count as sampled already: their
        workers add them to the limiter's sample count only once they are gathered."""
        return self.buf.storage.limiter.can_sample(self.batch_size * (1 + self.selected_pending()),
                                                   self.cfg.min_size, self.cfg.limit is not None)

    def _fail(self, error: BaseException | None) -> None:
        """The first failure is the one ``next()`` raises."""
        if self.failure is None:
            self.failure = error

    def check_open(self) -> None:
        if self.closing:
            raise ClosedError("the SamplerPool is closed")

    # -- teardown ---------------------------------------------------------------------------------
    def settle(self, deadline: float) -> bool:
        return self.fences.drain(max(0.1, deadline - time.monotonic()))

    def close(self, settled: bool, timeout: float) -> None:
        self.views = []
        self.templates = []


class DeliveryLayer(Delivery):
    """A delivery over a ``HostDelivery`` (``host``): it takes the host's slots, makes batches
    of its own of them, and gives each slot back once it has fenced what still reads it
    (``fence_released``); the slots, workers, stats and teardown are the host's.

    Concurrency: learner thread only (see ``Delivery``); ``closing`` is the host's.
    """

    def __init__(self, host: HostDelivery) -> None:
        super().__init__(host.parts)
        self.host = host

    @property  # type: ignore[override]
    def closing(self) -> bool:
        return self.host.closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self.host.closing = value

    @property  # type: ignore[override]
    def ring(self) -> Any:
        return self.host.ring

    @property
    def fences(self) -> SlotFences:
        return self.host.fences

    def start(self) -> None:
        self.host.start()

    def release_batch(self, batch: Batch) -> None:
        """A batch's release: its slot fenced and back to the host, if it was the held one."""
        if self.let_go(batch):
            self.fence_released(batch)
            self.host.give_back(batch.slot)

    def workers(self) -> Sequence[Child]:
        return self.host.workers()

    def stats(self, batches: int) -> dict[str, Any]:
        return self.host.stats(batches)

    def wake(self) -> None:
        self.host.wake()

    def release_held(self) -> None:
        super().release_held()
        self.host.release_held()

    def stop(self, timeout: float) -> None:
        self.host.stop(timeout)

    def settle(self, deadline: float) -> bool:
        return self.host.settle(deadline)

    def close(self, settled: bool, timeout: float) -> None:
        self.host.close(settled, timeout)
