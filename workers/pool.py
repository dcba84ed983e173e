"""``SamplerPool``: worker processes prefetch batches into a staging ring; the learner takes views.

The learner's cost per batch is a message and a few attribute stores: workers draw indices,
gather rows (validated by the buffer's seqlock) and apply the user's transform inside their own
processes, into shared-memory slots that the learner then reads without copying. This module is
the façade: settings (``config.PoolConfig``), selection and rate limit, and one ``Delivery``.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import multiprocess
import numpy as np

from shmbuf import ReplayBuffer
from shmbuf.checks import timeout_seconds
from shmbuf.errors import BufferInUseError, ClosedError, ShmbufError
from shmbuf.limiter import RateLimit
from shmbuf.priority import PriorityTable
from shmbuf.reclaim import Reclaimed, remove_dead_segments, serves_buffer
from shmbuf.sampling.plan import Plan
from shmbuf.segment import Lease
from shmbuf.window_priority import WindowPriorityTable

from .batch import Batch
from .config import Device, Output, PoolConfig, Transform, Workers, legacy_options
from .delivery import Delivery, PoolParts, device_backend
from .delivery.layers import layered
from .delivery.local import InProcessDelivery
from .delivery.ring import RingDelivery
from .device import Backend
from .epochs import EpochIteration
from .selection import Selection, SelectionSpec, UniformSelection
from .supervise import forget, parent_only

_SECONDS = (float, int)  # timeouts that need no more than a range check


class SamplerPool(EpochIteration):
    """Sampler worker processes that keep a ring of ready batches for the learner.

    Args:
        buffer: a ``ReplayBuffer`` or the name of one.
        batch_size: rows per batch.
        selection: which rows a batch holds (``workers.selection``): ``Uniform()`` (the
            default), ``Prioritized(alpha, beta, eps, eta)`` (``batch.weights`` holds the
            importance weights; ``update_priorities`` sets new priorities), ``Counted(k, of)``
            (each row at most ``k`` times), ``Queue()`` (each row exactly once, oldest first,
            writers waiting while it is full) or ``Epoch(drop_last, carry_remainder)`` (every
            row once per epoch: ``epoch()``); the names "uniform", "prioritized", "queue" and
            "epoch" are short for their defaults.
        limit: ``shmbuf.RateLimit(min_size, samples_per_insert, tolerance)``: sampling waits
            until ``min_size`` rows were inserted; with a ratio, samplers wait when they run
            ahead and writers' ``add``/``extend`` wait when actors do (Reverb's
            SampleToInsertRatio).
        plan: episode-aware batches (``shmbuf.sampling.Plan``: sequences, frame stacks,
            n-step returns).
        workers: sampler processes, a number or ``Workers(n, staging, start_method,
            max_restarts_per_minute, ordered)``; 0 samples in this process behind the same API.
        output: "numpy" (views), "torch" (``torch.from_numpy`` views, no copy), "jax", or
            ``Output(kind, pin_memory=...)`` (see ``workers.config.Output``).
        device: deliver batches on this torch device ("cuda", "cuda:1", "cpu") or
            ``Device(device, prefetch)``: each ready slot is copied from the page-locked ring on
            the pool's own CUDA stream, and goes back to the workers once that copy completed
            (an event, no synchronize). Fields and ``weights`` are device tensors the learner's
            current stream waits for; ``indices`` and ``lanes`` stay on the host. A device batch
            is valid until the next one is taken, as a host batch is.
        transform: ``f(batch: dict) -> dict`` applied in the workers before staging, or
            ``Transform(f, spec)``; serialised here with cloudpickle (a lambda works).
        fields: buffer fields to sample (all by default).
        seed: seeds one RNG stream per worker (``SeedSequence(seed).spawn``).
        timeout: default seconds ``next()`` waits before raising ``Timeout``.

    The keywords of earlier releases (``n_workers=``, ``sampler=``, ``alpha=``,
    ``min_size=``, ``samples_per_insert=``, ``sequence_length=``...) still work for one release:
    they build these objects, with a ``DeprecationWarning`` that shows the new form; an option
    the chosen strategy does not take is an ``OptionError``.

    Concurrency: the learner (this process) owns the staging segment and assigns each slot to
    one worker at a time; the worker writes the slot and then announces it; only then does the
    learner read it. A worker that dies mid-fill has its slots reclaimed (generation bumped)
    and is restarted within the budget; a half-filled slot is never delivered. Workers exit by
    themselves when the learner dies.

    Example:
        >>> with SamplerPool(buf, 256, selection=Prioritized(alpha=0.6), workers=2,
        ...                  limit=RateLimit(min_size=1000), seed=0) as pool:
        ...     for batch in pool:
        ...         loss = train_step(batch["obs"], batch["action"], batch.weights)
    """

    def __init__(
        self,
        buffer: ReplayBuffer | str,
        batch_size: int,
        *,
        selection: SelectionSpec | str | None = None,
        limit: RateLimit | None = None,
        plan: Plan | None = None,
        workers: Workers | int | None = None,
        output: Output | str = "numpy",
        device: Device | Any = None,
        transform: Transform | Any = None,
        fields: list[str] | None = None,
        seed: int | np.random.SeedSequence | None = None,
        timeout: float = 60.0,
        **deprecated: Any,
    ) -> None:
        self._closed = True  # until construction succeeds
        self._own_buffer = False
        self._delivery: Delivery | None = None
        self._pending: Batch | None = None
        self._reclaimed = Reclaimed()
        self._selection: Selection = UniformSelection()
        chosen = legacy_options(deprecated, dict(
            selection=selection, limit=limit, plan=plan, workers=workers, output=output,
            device=device, transform=transform))
        # (all arguments checked before the buffer is attached or anything else is made)
        cfg = self._config = PoolConfig.make(batch_size, fields=fields, seed=seed,
                                             timeout=timeout, **chosen)
        self._own_buffer = not isinstance(buffer, ReplayBuffer)
        self._buf = buffer if isinstance(buffer, ReplayBuffer) else ReplayBuffer.attach(buffer)
        self._limit = LimiterHold(self._buf)  # the rate limiter's lock, if the pool takes it
        try:
            self.batch_size, self.n_workers, self.n_staging = (
                cfg.batch_size, cfg.n_workers, cfg.n_staging)
            self.output, self.timeout, self.ordered, self.min_size = (
                cfg.output, cfg.timeout, cfg.ordered, cfg.min_size)
            backend = device_backend(cfg.device)  # before any process or segment exists
            self._open(cfg, backend)
        except BaseException:
            self._teardown(timeout=2.0)
            raise

    # -- construction -------------------------------------------------------------------------
    def _open(self, cfg: PoolConfig, backend: Backend | None) -> None:
        buf = self._buf
        ctx = multiprocess.get_context(cfg.start_method)
        self.start_method = ctx.get_start_method()
        compiled = buf.compile(cfg.plan, cfg.fields)
        spec = cfg.selection
        spec.check(compiled, cfg.limit)
        if cfg.limit is not None or spec.paces_writers:
            self._limit.take(cfg)
        # What earlier pools on this buffer left when their learner died (staging rings,
        # priority tables), removed before this pool sizes its own; a dead prioritized
        # learner's table that fits this pool is adopted instead (``spec.open``).
        adopt = spec.table_to_adopt(buf, compiled)
        self._reclaimed = remove_dead_segments(
            lambda info: serves_buffer(info, buf.name)
            and (info.header is None or info.header.doc != adopt))
        self._selection = spec.open(buf, compiled)
        parts = PoolParts(buf, cfg, compiled, cfg.output_arrays(compiled), self._selection,
                          backend)
        host = RingDelivery(parts, ctx) if cfg.n_workers else InProcessDelivery(parts)
        delivery = self._delivery = layered(host, parts)  # device copies, JAX arrays, pinning
        parent_only(self)
        self._limit.count_inserts_from_now()
        self._started = time.monotonic()
        self._batches, self._wait_s = 0, 0.0
        delivery.start()
        ring = getattr(delivery, "ring", None)
        if ring is not None:  # what ``shmbuf top`` shows of the reclaim
            ring.stats.set_reclaimed(len(self._reclaimed), self._reclaimed.nbytes,
                                     self._selection.table is not None
                                     and self._selection.table.adopted)
        self._closed = False

    @property
    def _table(self) -> PriorityTable | None:
        """The priorities behind the draws, if any (tests read it)."""
        return self._selection.table

    # -- learner side ------------------------------------------------------------------------------------
    def __iter__(self) -> SamplerPool:
        return self

    def __next__(self) -> Batch:
        return self.next()

    def next(self, timeout: float | None = None) -> Batch:
        """The next ready batch; the previous one is released.

        Raises:
            Timeout: no batch within ``timeout`` (default: the pool's); the message says what
                the pool is waiting for.
            WorkerDiedError: a worker died and the restart budget is exhausted.
            WorkerError: user code (the transform) raised in a worker.
            ClosedError: the pool is closed (also raised in a thread waiting here when another
                thread closes the pool).
        """
        if self._closed:  # (_check_open's, without its frame: a frame costs ~1 us cold)
            raise ClosedError("the SamplerPool is closed")
        pending = self._pending
        if pending is not None:  # taken by epoch(), which ended its epoch before it
            self._pending = None
            return pending
        if timeout is None:
            timeout = self.timeout
        elif not (type(timeout) in _SECONDS and 0 < timeout < math.inf):
            # (the common case is checked inline: the full check, a call that tests an ABC,
            # cost 8-12 us when the learner comes back cold from a train step)
            timeout = timeout_seconds("timeout", timeout, positive=True)
        delivery = self._delivery
        assert delivery is not None  # set by the constructor, and the pool is open
        try:
            batch = delivery.take_ready(self._batches)  # the common case: nothing to wait for
            if batch is None:
                if delivery.held is not None:
                    delivery.held.release()
                if self._selection.enters_rows:
                    self._selection.enter_new_rows()
                t0 = time.perf_counter()
                batch = delivery.next(timeout, self._batches)
                self._wait_s += time.perf_counter() - t0
        except Exception:
            if self._closed:  # another thread closed the pool under us: say so, nothing else
                raise ClosedError("the SamplerPool was closed during next()") from None
            raise
        if self._closed:
            batch._invalidate()
            raise ClosedError("the SamplerPool was closed during next()")
        self._batches += 1
        return batch

    # -- priorities -------------------------------------------------------------------------------
    def update_priorities(self, indices: Any, priorities: Any, lanes: Any = None,
                          mask: Any = None) -> int:
        """Set new priorities (e.g. |TD error|) for rows of delivered batches; returns how many
        were applied. ``indices`` are ``batch.indices``: each carries the logical position
        (generation) it was sampled at, so an update for a row overwritten since is dropped,
        never applied to the new data. ``lanes`` is ``batch.lanes`` (found automatically when
        ``indices`` is the ``batch.indices`` array of one of the last 8 batches, or the buffer
        has one lane). Sequences take ``[B, T]`` priorities, reduced per window over its steps
        (those ``mask`` keeps: ``mask=batch["mask"]`` with ``cross_episodes=True``).

        Raises:
            InvalidPriorityError: a priority is NaN, infinite or negative (nothing applied).
        """
        self._check_open()
        if not self._selection.prioritized:
            raise ShmbufError("update_priorities() needs a prioritized pool: SamplerPool(..., "
                              "selection=Prioritized(alpha=...)) (workers.selection)")
        lanes, indices, priorities = _host_update(self._delivery, lanes, indices, priorities)
        priorities = _window_priorities(self._selection.table, lanes, indices, priorities, mask)
        return self._selection.update(lanes, indices, priorities)

    # -- stats ------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Batches/s, actual samples per insert, staging occupancy, learner wait, restarts."""
        delivery = self._delivery
        assert delivery is not None  # set by the constructor
        elapsed = max(time.monotonic() - self._started, 1e-9)
        inserts = self._limit.inserts()
        samples = self._limit.samples() if not self._closed else None
        if samples is None:
            samples = self._batches * self.batch_size
        table = self._selection.table
        return {
            "batches": self._batches,
            "batches_per_s": self._batches / elapsed,
            "samples_per_insert": samples / inserts if inserts > 0 else math.inf,
            "inserts_per_s": inserts / elapsed,
            "learner_wait_s": self._wait_s,
            "learner_wait_frac": self._wait_s / elapsed,
            "priority_updates_dropped": table.updates_dropped if table is not None else 0,
            # rows entered at the priority their writer gave (actor priorities), and of them
            # those above what the tree can sum, entered clipped
            "actor_priorities_entered": table.actor_priorities_entered if table is not None else 0,
            "actor_priorities_clipped": table.actor_priorities_clipped if table is not None else 0,
            # what this pool removed at its start that dead learners of the buffer had left,
            # and whether it took over a dead learner's priorities
            "reclaimed_segments": len(self._reclaimed),
            "reclaimed_bytes": self._reclaimed.nbytes,
            "adopted_priorities": table is not None and table.adopted,
            "elapsed_s": elapsed,
            **delivery.stats(self._batches),  # staging occupancy, restarts, workers
        }

    @property
    def buffer(self) -> ReplayBuffer:
        return self._buf

    @property
    def worker_pids(self) -> list[int]:
        workers = self._delivery.workers() if self._delivery is not None else []
        return [w.proc.pid for w in workers if w.proc is not None]

    @property
    def staging_name(self) -> str | None:
        ring = getattr(self._delivery, "ring", None)
        return ring.name if ring is not None else None

    # -- teardown -------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the SamplerPool is closed")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers (gracefully, then firmly), lift the rate limit and free the staging
        ring. Wakes a thread blocked in ``next()``. Idempotent.

        With ``selection=Queue()``, the batch in the learner's hands counts as consumed (the next
        queue pool on the buffer starts after it), unless the pool's ``with`` block is left by
        an exception: then it comes again, as after a crash."""
        timeout = timeout_seconds("timeout", timeout)
        if self._closed:
            return
        self._closed = True
        if self._delivery is not None:
            self._delivery.wake()
        self._teardown(timeout)

    def _teardown(self, timeout: float) -> None:
        delivery = self._delivery
        deadline = time.monotonic() + timeout
        if delivery is not None:
            delivery.closing = True
            delivery.release_held()
            delivery.stop(timeout)
        self._selection.close()
        self._limit.release()
        if delivery is not None:
            # Device copies may still read the staging memory: unmapping (or unpinning) it
            # under a DMA would hand the device freed memory. Wait for them, within the timeout.
            delivery.close(delivery.settle(deadline), timeout)
        if self._own_buffer and not self._buf.closed:
            try:
                self._buf.close()
            except BufferInUseError as e:
                warnings.warn(str(e), ResourceWarning, stacklevel=3)
        forget(self)

    def _close_in_child(self) -> None:
        """In a forked child: this copy is closed (it must never tear down the learner's ring,
        limiter or workers; the delivery's channel ends are closed by their ``ChildSet``)."""
        self._closed = True

    def __enter__(self) -> SamplerPool:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None and self._delivery is not None:
            self._delivery.consumes = False  # the batch in hand was not finished with
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close(timeout=1.0)
            except Exception:
                pass


class LimiterHold:
    """A pool's hold on its buffer's rate limiter (``LOCK_LIMITER``), and the pool's insert count.

    Concurrency: only the holder of ``LOCK_LIMITER`` writes the limiter's configuration; the
    lock is a lease on the buffer's segment, so a pool that dies lets it go with its process.
    """

    def __init__(self, buf: ReplayBuffer) -> None:
        self.buf = buf
        self.lease: Lease | None = None
        self.configured = False
        self.inserts_origin = 0  # stats count inserts from here

    def count_inserts_from_now(self) -> None:
        """Without the lock, the pool counts inserts from its start (with it, from the
        limiter's own origin)."""
        if self.lease is None:
            self.inserts_origin = self._total_committed()

    def take(self, cfg: PoolConfig) -> None:
        """Take the lock (``ShmbufError`` if another pool holds it); with
        ``samples_per_insert``, configure the limiter for this pool."""
        buf = self.buf
        self.lease = buf.storage.limiter.take()
        self.inserts_origin = self._total_committed()
        if cfg.limit is None:  # the queue: no ratio; stats count inserts from now
            return
        credit = min(len(buf), cfg.limit.min_size)
        # stats() counts inserts from the very total the limiter counts from: rows written
        # between here and the end of the constructor count for both, or the reported ratio
        # drifts from the enforced one.
        self.inserts_origin = buf.storage.limiter.configure(cfg.limit, max(1, cfg.n_workers),
                                                            credit=credit)
        self.configured = True

    def _total_committed(self) -> int:
        return int(self.buf.committed().sum())  # ClosedError once the buffer is closed

    def inserts(self) -> int:
        return self._total_committed() - self.inserts_origin

    def samples(self) -> int | None:
        """Rows the limiter counted as sampled (None when it counts none)."""
        if not self.configured:
            return None
        limiter = self.buf.storage.limiter.stats()
        return limiter["samples"] if limiter["active"] else None

    def release(self) -> None:
        """Lift the limit and let the lock go. Idempotent."""
        if self.lease is not None:
            if not self.buf.closed:
                self.buf.storage.limiter.deactivate()
            self.lease.close()
            self.lease = None


def _host_update(delivery: Delivery | None, lanes: Any, indices: Any, priorities: Any
                 ) -> tuple[Any, Any, Any]:
    """``update_priorities``' arguments as host arrays, ``lanes`` found from ``delivery``'s
    recent batches when not given."""
    if lanes is None and delivery is not None:
        lanes = delivery.recent.lanes_of(indices)
    lanes = lanes if isinstance(lanes, (int, np.integer)) else _host_array(lanes)
    return lanes, _host_array(indices), _host_array(priorities)


def _window_priorities(table: PriorityTable | None, lanes: Any, indices: Any, priorities: Any,
                       mask: Any) -> Any:
    """``priorities`` as they are without a ``mask``; with one, a priority per window from
    ``[B, T]`` ones over the steps it keeps (the selection then takes them as ``[B]``), or
    ``ValueError`` unless the batches are sequences."""
    if mask is None:
        return priorities
    if not isinstance(table, WindowPriorityTable):
        raise ValueError("mask= selects the steps of sequences' [B, T] priorities: this "
                         "pool's batches are not sequences (sequence_length=T)")
    return table.window_priorities(lanes, indices, priorities, _host_array(mask))


def _host_array(value: Any) -> Any:
    """NumPy for priority updates: torch tensors (also on a device) come to the host."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu().numpy()
    return value
