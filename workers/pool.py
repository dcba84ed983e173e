"""``SamplerPool``: worker processes prefetch batches into a staging ring; the learner takes views.

The learner's cost per batch is a message and a few attribute stores: workers draw indices,
gather rows (validated by the buffer's seqlock) and apply the user's transform inside their own
processes, into shared-memory slots that the learner then reads without copying.
"""

from __future__ import annotations

import collections
import math
import os
import select
import time
import warnings
import weakref
from typing import Any

import cloudpickle
import multiprocess
import numpy as np

from shmbuf import ReplayBuffer
from shmbuf import layout as L
from shmbuf._util import _positive_int, _timeout
from shmbuf.errors import (
    BufferInUseError,
    ClosedError,
    ShmbufError,
    Timeout,
    WorkerDiedError,
    WorkerError,
)
from shmbuf.limiter import RateLimit
from shmbuf.priority import PriorityTable, importance_weights
from shmbuf.sampling.plan import Plan

from .batch import Batch
from .channel import Channel
from .device import DeviceStage, JaxViews, SlotFences, fenced_copy, make_backend
from .sampler_proc import (
    OP_ERROR,
    OP_FILL,
    OP_GATHER,
    OP_HELLO,
    OP_READY,
    OP_STALE,
    OP_STOP,
    SamplerConfig,
    can_sample,
    sampler_main,
)
from .staging import (
    ASSIGNED,
    FREE,
    HELD,
    INDICES,
    LANES,
    PMIN,
    PROBS,
    WEIGHTS,
    W_GENERATION,
    W_OWNER,
    W_STATE,
    StagingRing,
)
from .selection import CountedSelection, QueueSelection
from .supervise import RestartBudget, describe_exit, self_inflicted, stop_process

POLL_SLICE = 0.25  # longest single wait, so deaths and timeouts are handled promptly
_READABLE = select.POLLIN | select.POLLHUP | select.POLLERR

# Learner-side pipe ends and wake-up fds: a forked child (a worker, an actor, anything) must not
# keep them open, or a dead learner's workers would never see end-of-file.
_PARENT_ONLY: weakref.WeakSet[Any] = weakref.WeakSet()


def _close_parent_only_in_child() -> None:
    for obj in list(_PARENT_ONLY):
        try:
            obj._close_in_child()
        except Exception:
            pass


os.register_at_fork(after_in_child=_close_parent_only_in_child)

# Staging rings a device may still be reading when their pool closed: kept mapped until exit.
_IN_FLIGHT_RINGS: list[Any] = []


class _WorkerHandle:
    """The learner's record of one worker slot (a worker id survives restarts)."""

    def __init__(self, wid: int, slots: list[int]) -> None:
        self.wid = wid
        self.slots = slots  # staging slots this worker fills, fixed for the pool's life
        self.proc: Any = None
        self.chan: Channel | None = None
        self.hello = False
        # Told to fill, not reported ready yet; a dict for its order: after a death the lost
        # slots are handed out again in the order they were first assigned.
        self.assigned: dict[int, None] = {}
        self.ready: collections.deque[int] = collections.deque()
        self.startup_failures = 0
        self.batches = 0

    def _close_in_child(self) -> None:
        if self.chan is not None:
            self.chan.close()


class SamplerPool:
    """Sampler worker processes that keep a ring of ready batches for the learner.

    Args:
        buffer: a ``ReplayBuffer`` or the name of one.
        batch_size: rows per batch.
        n_workers: sampler processes; 0 samples in this process behind the same API.
        n_staging: staging slots (batches in flight); at least ``n_workers + 1``.
        seed: seeds one RNG stream per worker (``SeedSequence(seed).spawn``).
        start_method: "fork", "forkserver" or "spawn" (default: multiprocess's default).
        transform: ``f(batch: dict) -> dict`` applied in the worker before staging; serialised
            with cloudpickle here, so a lambda works under every start method.
        transform_spec: the transform's output as ``{name: (shape_without_batch, dtype)}``; by
            default it is inferred by calling ``transform`` once on a zero batch here.
        fields: buffer fields to sample (all by default).
        min_size: sampling waits until the buffer holds this many transitions.
        samples_per_insert: ``(ratio, tolerance)``, Reverb's SampleToInsertRatio: samplers wait
            when they run ahead, and writers' ``add``/``extend`` wait when actors do.
        timeout: default seconds ``next()`` waits before raising ``Timeout``.
        output: "numpy" (views), "torch" (``torch.from_numpy`` views, no copy) or "jax"
            (zero-copy DLPack imports with workers, copies in-process). A slot is refilled only
            once JAX has let go of its arrays: the learner dropped them and every computation
            dispatched on them (``jax.device_put`` included) has completed, so async dispatch
            needs no ``block_until_ready``; arrays kept past the next batch stay valid and keep
            their slot out of the ring until dropped.
        ordered: deliver batches in fixed round-robin worker order (reproducible with a seed).
        pin_memory: with output="torch" and CUDA, page-lock the staging ring so host-to-device
            copies are asynchronous. A slot is then refilled only after an event recorded on the
            current CUDA stream at its release has passed, so ``batch["obs"].to("cuda",
            non_blocking=True)`` on the current stream is safe without a synchronize; copies
            issued on other streams are the caller's to synchronize (or use ``batch.to()``).
        device: deliver batches on this torch device ("cuda", "cuda:1", or "cpu"): the pool
            copies each ready slot from the page-locked ring on its own CUDA stream, and the
            slot goes back to the workers only once that copy has completed (an event, no
            synchronize). Fields and ``weights`` arrive as device tensors that the learner's
            current stream is made to wait for; ``indices`` and ``lanes`` stay on the host
            (for ``update_priorities``). Device buffers are recycled only after the learner's
            stream has passed its release point. Like host batches, a device batch is valid
            until the next one is taken.
        device_prefetch: batches copied to the device ahead of the learner (with ``device``).
        max_restarts_per_minute: restart budget for dead workers (a rate, not a total).
        sampler: "uniform"; "prioritized" (proportional to priorities from a sum tree in
            shared memory, ``alpha``/``beta``/``eps``; ``batch.weights`` holds the importance
            weights; ``update_priorities`` sets new ones); or "queue" (every transition
            delivered exactly once, oldest first, writers waiting while the queue is full).
        alpha, eps: priorities are stored as ``(p + eps) ** alpha``.
        beta: importance-weight exponent: a number, ``(start, end, n_batches)`` for a linear
            schedule over the batches delivered, or a callable ``f(batches) -> beta``.
        max_times_sampled: retire a transition after it was delivered this many times.
        plan / sequence_length / frame_stack / n_step / ...: episode-aware batches, see
            ``shmbuf.sampling.Plan`` (uniform sampling only).

    Concurrency: the learner (this process) owns the staging segment and assigns each slot to
    one worker at a time; the worker writes the slot and then announces it; only then does the
    learner read it. A worker that dies mid-fill has its slots reclaimed (generation bumped)
    and is restarted within the budget; a half-filled slot is never delivered. Workers exit by
    themselves when the learner dies.

    Example:
        >>> with SamplerPool(buf, batch_size=256, n_workers=2, seed=0) as pool:
        ...     for batch in pool:
        ...         loss = train_step(batch["obs"], batch["action"])
    """

    def __init__(
        self,
        buffer: ReplayBuffer | str,
        batch_size: int,
        n_workers: int | None = None,
        n_staging: int | None = None,
        seed: int | np.random.SeedSequence | None = None,
        start_method: str | None = None,
        transform: Any = None,
        min_size: int = 1,
        samples_per_insert: tuple[float, float] | None = None,
        timeout: float = 60.0,
        output: str = "numpy",
        ordered: bool = False,
        pin_memory: bool = False,
        max_restarts_per_minute: float = 10.0,
        fields: list[str] | None = None,
        transform_spec: dict[str, Any] | None = None,
        plan: Plan | None = None,
        sampler: str = "uniform",
        alpha: float = 0.6,
        beta: Any = 0.4,
        eps: float = 1e-6,
        max_times_sampled: int | None = None,
        device: Any = None,
        device_prefetch: int = 2,
        **plan_kwargs: Any,
    ) -> None:
        self._closed = True  # until construction succeeds
        self._own_buffer = not isinstance(buffer, ReplayBuffer)
        self._buf = ReplayBuffer.attach(buffer) if self._own_buffer else buffer
        self._ring: StagingRing | None = None
        self._limiter_lease: Any = None
        self._workers: list[_WorkerHandle] = []
        self._wake_r = self._wake_w = -1
        self._pinned: Any = None
        self._views: list[dict[str, Any]] = []
        self._local: dict[str, np.ndarray] = {}
        self._held: Batch | None = None
        self._table: PriorityTable | None = None
        self._select: Any = None
        self._opts = dict(sampler=sampler, alpha=alpha, beta=beta, eps=eps,
                          max_times_sampled=max_times_sampled)
        self._fences = SlotFences()  # staging slots still read by device copies
        self._backend: Any = None  # device runtime: for device=, and pinned host batches
        self._stage: DeviceStage | None = None
        self._backends: dict[str, Any] = {}  # Batch.to(device) targets
        self._jax: JaxViews | None = None  # output="jax"
        self._jax_fence: Any = None  # of the held batch's arrays
        try:
            if device is not None:  # fails here, before any process or segment exists
                self._backend = make_backend(device)
                self._device_prefetch = _positive_int("device_prefetch", device_prefetch)
                if output not in ("numpy", "torch"):
                    raise ValueError(f"device= delivers torch tensors; drop output={output!r}")
                output = "torch"
            if plan is None:
                plan = Plan(**plan_kwargs)
            elif plan_kwargs:
                raise ValueError(f"pass either plan= or its options, not both ({plan_kwargs})")
            self._compiled = self._buf.compile(plan, fields)
            self._setup(batch_size, n_workers, n_staging, seed, start_method, transform,
                        min_size, samples_per_insert, timeout, output, ordered, pin_memory,
                        max_restarts_per_minute, fields, transform_spec)
        except BaseException:
            self._teardown(timeout=2.0)
            raise

    # -- construction -------------------------------------------------------------------------
    def _setup(self, batch_size, n_workers, n_staging, seed, start_method, transform, min_size,
               samples_per_insert, timeout, output, ordered, pin_memory, max_restarts,
               fields, transform_spec) -> None:
        buf = self._buf
        self.batch_size = _positive_int("batch_size", batch_size)
        if n_workers is None:
            n_workers = max(1, min(4, (os.cpu_count() or 2) - 1))
        if not isinstance(n_workers, int) or not 0 <= n_workers <= L.MAX_SAMPLERS:
            raise ValueError(f"n_workers must be an int in [0, {L.MAX_SAMPLERS}], got {n_workers!r}")
        self.n_workers = n_workers
        if n_staging is None:
            n_staging = 2 * n_workers + 2 if n_workers else 1
        if not isinstance(n_staging, int) or n_staging < max(1, n_workers + 1):
            raise ValueError(
                f"n_staging must be an int >= n_workers + 1 = {n_workers + 1} (one slot per "
                f"worker plus the one the learner holds), got {n_staging!r}"
            )
        self.n_staging = n_staging
        if output not in ("numpy", "torch", "jax"):
            raise ValueError(f"output must be 'numpy', 'torch' or 'jax', got {output!r}")
        self.output = output
        self.timeout = _seconds("timeout", timeout)
        self.ordered = bool(ordered)
        self.min_size = _positive_int("min_size", min_size)
        self._fields = fields
        self._limit = _rate_limit(samples_per_insert, self.min_size, self.batch_size)
        self._seed = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
        self._budget = RestartBudget(max_restarts)
        self._ctx = multiprocess.get_context(start_method)
        self.start_method = self._ctx.get_start_method()

        self._setup_selection()
        # The transform is serialised here, so an unpicklable one fails at the call site.
        _check_picklable(transform)
        out_arrays = self._output_arrays(transform, transform_spec)
        self._out_fields = [name for name, _, _ in out_arrays]
        cfg = SamplerConfig(
            buffer=buf.name, staging="", batch_size=self.batch_size, fields=self._fields,
            out_fields=self._out_fields, transform=transform, min_size=self.min_size,
            rate_limited=self._limit is not None, plan=self._compiled.plan,
            priority_table=(self._table.name if self._table is not None and self._select is None
                            else None),
        )
        index_shape = (self.batch_size, *self._compiled.index_shape)

        if self._limit is not None:
            self._take_limiter()
        if n_workers == 0:
            self._local = {n: np.empty((self.batch_size, *s), d) for n, s, d in out_arrays}
            self._local_idx = np.zeros(index_shape, np.int64)
            self._local_lanes = np.zeros(self.batch_size, np.int64)
            self._local_w = np.ones(self.batch_size, np.float32)
            self._local_probs = np.zeros(self.batch_size, np.float64)
            self._local_pmin = np.zeros(1, np.float64)
            self._local_scratch = (
                self._compiled.allocate(self.batch_size) if transform is not None else None
            )
            self._transform = transform
            self._rng = np.random.default_rng(self._seed)
        else:
            arrays = [(n, (self.batch_size, *s), d) for n, s, d in out_arrays]
            arrays += [(INDICES, index_shape, np.int64), (LANES, (self.batch_size,), np.int64),
                       (WEIGHTS, (self.batch_size,), np.float32),
                       (PROBS, (self.batch_size,), np.float64), (PMIN, (1,), np.float64)]
            self._ring = StagingRing.create(
                arrays, n_staging, {"buffer": buf.name, "batch_size": self.batch_size})
            for s in range(n_staging):
                self._ring.slot(s)[WEIGHTS][...] = 1.0
            cfg.staging = self._ring.name
            self._cfg_bytes = cloudpickle.dumps(cfg)
        self._gen = [0] * n_staging
        self._slot_rows: dict[int, Any] = {}  # learner-selected rows of each assigned slot
        self._waiting: list[int] = []  # slots with no rows to select yet
        self._sel_rng = np.random.default_rng(self._seed.spawn(1)[0])
        self._recent: collections.deque[tuple[Any, np.ndarray]] = collections.deque(maxlen=8)
        self._views = self._make_views(pin_memory)
        self._ready: collections.deque[tuple[int, int]] = collections.deque()  # (wid, slot)
        self._order: collections.deque[int] = collections.deque()  # slots in assignment order
        self._held: Batch | None = None
        self._failure: BaseException | None = None
        self._wake_r, self._wake_w = os.pipe()
        # One poll set for the life of the pool: worker channels, exit sentinels, the wake pipe.
        self._poller = select.poll()
        self._poller.register(self._wake_r, _READABLE)
        self._fd_owner: dict[int, tuple[str, _WorkerHandle | None]] = {self._wake_r: ("wake", None)}
        _PARENT_ONLY.add(self)
        self._closed = False
        self._started = time.monotonic()
        if self._limiter_lease is None:  # else counted from the limiter's own origin
            self._committed0 = int(buf.committed().sum())
        self._batches = 0
        self._wait_s = 0.0
        self._occupancy_sum = 0.0
        if n_workers:
            for wid in range(n_workers):
                slots = list(range(wid, n_staging, n_workers))
                self._workers.append(_WorkerHandle(wid, slots))
            children = self._seed.spawn(n_workers)
            for w, child in zip(self._workers, children):
                self._start_worker(w, child, [])
            # Slots in order, so worker s % n gets slot s: the same round-robin that ordered
            # delivery follows, so batches leave in the order they were assigned.
            for slot in range(n_staging):
                self._assign(self._workers[slot % n_workers], slot)

    def _setup_selection(self) -> None:
        opts, buf = self._opts, self._buf
        sampler, k = opts["sampler"], opts["max_times_sampled"]
        if sampler not in ("uniform", "prioritized", "queue"):
            raise ValueError(f"sampler must be 'uniform', 'prioritized' or 'queue', got {sampler!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"max_times_sampled must be a positive int, got {k!r}")
        self._beta = _beta_schedule(opts["beta"])
        if sampler == "uniform" and k is None:
            return
        c = self._compiled
        if not c.plan.is_plain or c.derived_next_obs:
            raise ValueError(
                f"sampler={sampler!r} and max_times_sampled draw single stored transitions; "
                f"sequence, frame-stack and n-step plans (and derived next_obs) sample uniformly"
            )
        if sampler == "queue":
            if k not in (None, 1):
                raise ValueError("sampler='queue' delivers each transition exactly once; drop "
                                 f"max_times_sampled={k}")
            if self._limit is not None:
                raise ValueError("sampler='queue' is its own rate limiter (writers wait while the "
                                 "queue is full): drop samples_per_insert")
            self._take_limiter(configure=False)
            self._select = QueueSelection(buf)
            self.ordered = True  # batches leave in the order their rows were taken
            return
        self._table = PriorityTable.create(buf, opts["alpha"], opts["eps"])
        if k is not None:
            self._select = CountedSelection(buf, self._table, k, uniform=(sampler == "uniform"))

    def _output_arrays(self, transform: Any, transform_spec: dict[str, Any] | None):
        base = list(self._compiled.outputs)
        if transform is None:
            return base
        if not callable(transform):
            raise TypeError(f"transform must be callable, got {type(transform).__name__}")
        if transform_spec is not None:
            return [(n, tuple(s), np.dtype(d)) for n, (s, d) in transform_spec.items()]
        example = {n: np.zeros((self.batch_size, *shape), dtype) for n, shape, dtype in base}
        try:
            result = transform(dict(example))
        except Exception as e:
            raise TypeError(
                f"transform {_callable_name(transform)} failed on a zero-filled example batch "
                f"({type(e).__name__}: {e}); fix it, or pass transform_spec= to skip this check"
            ) from e
        result = example if result is None else result
        out = []
        for name, value in result.items():
            arr = np.asarray(value)
            if arr.ndim == 0 or arr.shape[0] != self.batch_size or arr.dtype == object:
                raise TypeError(
                    f"transform {_callable_name(transform)} returned {name!r} with shape "
                    f"{arr.shape} dtype {arr.dtype}; every output must be a numeric array of "
                    f"shape (batch_size={self.batch_size}, ...)"
                )
            out.append((str(name), arr.shape[1:], arr.dtype))
        return out

    def _take_limiter(self, configure: bool = True) -> None:
        buf = self._buf
        lease = buf._seg.lease()
        if not lease.try_lock(L.LOCK_LIMITER):
            lease.close()
            raise ShmbufError(
                f"another SamplerPool already rate-limits buffer {buf.name!r}; only one pool "
                f"may set samples_per_insert or sampler='queue' on a buffer at a time"
            )
        self._limiter_lease = lease
        if not configure:  # queue mode: no ratio; stats count inserts from now
            self._committed0 = int(buf.committed().sum())
            return
        credit = min(len(buf), self._limit.min_size)
        buf._limiter.configure(self._limit, max(1, self.n_workers), credit=credit)
        # stats() counts inserts from the very total the limiter counts from: rows written
        # between here and the end of the constructor count for both, or the reported ratio
        # drifts from the enforced one.
        self._committed0 = buf._limiter.read()[2] + credit

    def _make_views(self, pin_memory: bool) -> list[dict[str, Any]]:
        """Per slot: the learner's views (fields plus the internal arrays)."""
        if self._ring is None:
            slots = [dict(self._local, **{INDICES: self._local_idx, LANES: self._local_lanes,
                                           WEIGHTS: self._local_w})]
        else:
            slots = [self._ring.slot(s) for s in range(self.n_staging)]
        if self.output in ("numpy", "jax"):
            if pin_memory:
                warnings.warn("pin_memory=True only applies to output='torch'", stacklevel=3)
            if self.output == "jax":
                self._jax = JaxViews()
            return [dict(s) for s in slots]
        try:
            import torch
        except ImportError:
            raise ImportError(
                "output='torch' needs PyTorch: pip install 'shmbuf[torch]' (or torch)"
            ) from None
        if self._backend is not None:  # device=: pinned staging, a ring of device buffers
            if getattr(self._backend, "cuda", False):
                self._pin(torch)
            arrays = [(n, tuple(slots[0][n].shape), slots[0][n].dtype)
                      for n in [*self._out_fields, WEIGHTS]]
            self._stage = DeviceStage(self._backend, arrays, self._device_prefetch)
        elif pin_memory:
            self._pin(torch)
            if self._pinned is not None:  # releases are fenced on the current CUDA stream
                self._backend = make_backend("cuda")
        return [{k: torch.from_numpy(v) for k, v in s.items()} for s in slots]

    def _pin(self, torch: Any) -> None:
        if not torch.cuda.is_available():
            warnings.warn("pin_memory=True but CUDA is not available; staging stays pageable",
                          stacklevel=4)
            return
        if self._ring is None:
            return  # in-process batches live in private memory; copies from it are synchronous
        offset, length = self._ring.slot_span()
        ptr = np.frombuffer(self._ring.seg.buf, np.uint8, count=length, offset=offset).ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, length, 0)
        if int(err) != 0:
            warnings.warn(f"cudaHostRegister of the staging ring failed ({err}); staying pageable",
                          stacklevel=4)
            return
        self._pinned = (torch, ptr)

    # -- worker processes -----------------------------------------------------------------------------
    def _start_worker(self, w: _WorkerHandle, seed: np.random.SeedSequence,
                      fill: list[int]) -> None:
        """Start (or restart) worker ``w`` and ask it to fill ``fill``."""
        chan, child_sock = Channel.pair()
        proc = self._ctx.Process(
            target=sampler_main, args=(self._cfg_bytes, child_sock, w.wid, seed),
            name=f"shmbuf-sampler-{w.wid}", daemon=True,
        )
        # Known before the fork, so the at-fork hook closes the learner's end in the child: a
        # forked worker holding it would not see end-of-file when the learner dies.
        w.chan = chan
        try:
            proc.start()
        finally:
            child_sock.close()
        w.proc, w.hello = proc, False
        for fd, kind in ((chan.fd, "msg"), (proc.sentinel, "exit")):
            self._poller.register(fd, _READABLE)
            self._fd_owner[fd] = (kind, w)
        for s in fill:
            self._assign(w, s, requeue=False)

    def _assign(self, w: _WorkerHandle, slot: int, requeue: bool = True) -> None:
        """Hand ``slot`` to ``w``: to sample (``FILL``), or with learner-selected rows written
        into it (``GATHER``). Rows already selected for the slot are kept: after a worker death
        the same rows are gathered again, so queue mode still delivers each exactly once."""
        ring = self._ring
        op = OP_FILL
        if self._select is not None:
            rows = self._slot_rows.get(slot)
            if rows is None:
                rows = (self._select.select(self.batch_size, self._sel_rng)
                        if self._may_select() else None)
                if rows is None:  # nothing to select now: retried from next()
                    ring.set(slot, W_STATE, FREE)
                    ring.set(slot, W_OWNER, -1)
                    self._waiting.append(slot)
                    if slot in self._order:  # it gets a new place once it has rows again
                        self._order.remove(slot)
                    return
                self._slot_rows[slot] = rows
                if isinstance(self._select, QueueSelection):
                    self._select.track(slot, rows)
            v = ring.slot(slot)
            v[LANES][...], v[INDICES][...] = rows[0], rows[1]
            if rows[2] is not None:
                v[PROBS][...], v[PMIN][0] = rows[2], rows[3]
            op = OP_GATHER
        self._gen[slot] += 1
        ring.set(slot, W_GENERATION, self._gen[slot])
        ring.set(slot, W_OWNER, w.wid)
        ring.set(slot, W_STATE, ASSIGNED)
        w.assigned[slot] = None
        if requeue and self.ordered:
            self._order.append(slot)  # (a slot handed out again keeps its place)
        try:
            w.chan.send(op, slot, self._gen[slot])
        except OSError:
            pass  # it died; its sentinel will say so and the slot is reclaimed then

    def _may_select(self) -> bool:
        """May the learner select a batch now? ``min_size`` and ``samples_per_insert`` hold back
        learner-selected rows (``max_times_sampled``, the queue) as they hold back workers'
        own draws. Batches selected but not yet gathered count as sampled already: their
        workers add them to the limiter's sample count only once they are gathered."""
        limiter = self._buf._limiter if self._limit is not None else None
        selected = sum(len(w.assigned) for w in self._workers)
        return can_sample(self._buf, limiter, self.min_size, self.batch_size * (1 + selected))

    def _retry_waiting(self) -> None:
        for slot in self._waiting[:]:
            self._waiting.remove(slot)
            w = self._workers[slot % self.n_workers]
            self._assign(w, slot)
            if self._waiting and self._waiting[-1] == slot:
                break  # still nothing to select; the others would find nothing either

    def _receive(self, w: _WorkerHandle) -> None:
        """Take every message ``w`` has sent (its death, if any, is the sentinel's business)."""
        msgs, _ = w.chan.receive()
        for op, slot, gen, text in msgs:
            if op == OP_READY:
                if slot in w.assigned and gen == self._gen[slot]:
                    w.assigned.pop(slot, None)
                    w.ready.append(slot)
                    self._ready.append((w.wid, slot))
                    w.batches += 1
                    if self._select is not None:
                        self._select.gathered(slot)
            elif op == OP_STALE:  # learner-selected rows were overwritten before the gather
                if slot in w.assigned and gen == self._gen[slot]:
                    w.assigned.pop(slot, None)
                    self._select.stale(self._slot_rows.pop(slot))
                    self._select.gathered(slot)
                    self._assign(w, slot, requeue=False)
            elif op == OP_HELLO:
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
        if self._failure is not None:
            return
        w.proc.join(1.0)
        pid, how = w.proc.pid, describe_exit(w.proc.exitcode)
        for fd in (w.chan.fd, w.proc.sentinel):
            self._poller.unregister(fd)
            self._fd_owner.pop(fd, None)
        w.chan.close()
        lost = list(w.assigned)
        for s in lost:  # half-filled or never started: nobody writes them any more
            self._gen[s] += 1
            self._ring.set(s, W_GENERATION, self._gen[s])
            self._ring.set(s, W_STATE, FREE)
            self._ring.set(s, W_OWNER, -1)
        w.assigned.clear()
        if not w.hello and self_inflicted(w.proc.exitcode):
            w.startup_failures += 1
        if w.startup_failures >= 2:
            self._fail(WorkerDiedError(
                f"sampler worker {w.wid} (pid {pid}) {how} during start-up, twice in a row; not "
                f"restarting it. Check that the buffer {self._buf.name!r} is reachable and the "
                f"transform imports in a fresh process (start method {self.start_method!r})"
            ))
            return
        if not self._budget.try_spend():
            self._fail(WorkerDiedError(
                f"sampler worker {w.wid} (pid {pid}) {how}; restart budget exhausted "
                f"({self._budget.recent()} restarts in the last minute, max "
                f"{self._budget.per_minute:g}/min). Fix the cause, or raise "
                f"max_restarts_per_minute"
            ))
            return
        # Slots it finished stay READY and are delivered; the new process refills the lost ones.
        self._start_worker(w, self._seed.spawn(1)[0], lost)

    def _fail(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error

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
        self._check_open()
        timeout = self.timeout if timeout is None else _seconds("timeout", timeout)
        if self._held is not None:
            self._held.release()
        if self._table is not None and self._select is None:
            self._table.sync(self._buf)  # new rows enter at the maximum priority
        t0 = time.perf_counter()
        try:
            if self._ring is None:
                batch = self._next_in_process(timeout)
            else:
                batch = self._next_from_workers(timeout)
        except Exception:
            if self._closed:  # another thread closed the pool under us: say so, nothing else
                raise ClosedError("the SamplerPool was closed during next()") from None
            raise
        if self._closed:
            batch._invalidate()
            raise ClosedError("the SamplerPool was closed during next()")
        self._wait_s += time.perf_counter() - t0
        self._batches += 1
        return batch

    def _next_from_workers(self, timeout: float) -> Batch:
        deadline = time.monotonic() + timeout
        self._occupancy_sum += len(self._ready) / self.n_staging
        while True:
            if self._failure is not None:
                raise self._failure
            self._reap_fences()
            if self._stage is not None:
                self._submit_ready()
                if len(self._stage):
                    return self._hold_device()
            else:
                slot = self._pop_ready()
                if slot is not None:
                    return self._hold(slot)
            if self._waiting:
                self._retry_waiting()
            if self._table is not None and self._select is None:
                self._table.sync(self._buf)  # workers may be waiting for rows to enter
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Timeout(f"no batch within {timeout}s: {self._waiting_for()}")
            quick = self._waiting or self._table is not None
            # Slots held back by copies in flight come free within microseconds to milliseconds.
            pause = 0.0002 if len(self._fences) else 0.002 if quick else POLL_SLICE
            self._poll(min(remaining, pause))

    def _pop_ready(self) -> int | None:
        if self.ordered:  # the oldest assignment first, once it is ready
            if not self._order:
                return None
            slot = self._order[0]
            w = self._workers[slot % self.n_workers]
            if slot not in w.ready:
                return None
            self._order.popleft()
            w.ready.remove(slot)
            self._ready.remove((w.wid, slot))
            return slot
        if not self._ready:
            return None
        wid, slot = self._ready.popleft()
        self._workers[wid].ready.remove(slot)
        return slot

    def _poll(self, timeout: float) -> None:
        """Wait for messages, deaths or a wake-up; handle them."""
        events = self._poller.poll(max(0, int(timeout * 1000)))
        exits = []
        for fd, _ in events:
            kind, w = self._fd_owner.get(fd, ("gone", None))
            if kind == "wake":
                # Only close() writes the wake pipe, and it may be closing the pipe right now
                # in another thread: do not read it, just report the close.
                self._check_open()
            elif kind == "msg":
                self._receive(w)
            elif kind == "exit":
                exits.append(w)
        self._check_open()  # closed by another thread meanwhile: restart nobody
        for w in exits:
            self._on_exit(w)

    def _take_slot(self, slot: int) -> dict[str, Any]:
        """The learner takes a ready slot: mark it HELD, fill in its importance weights."""
        if self._ring is not None:
            self._ring.set(slot, W_STATE, HELD)
        if self._table is not None:  # importance weights with this batch's beta
            nv = self._ring.slot(slot) if self._ring is not None else self._local_arrays()
            nv[WEIGHTS][...] = importance_weights(nv[PROBS], float(nv[PMIN][0]),
                                                  self._beta(self._batches))
        return self._views[slot]

    def _hold(self, slot: int) -> Batch:
        v = self._take_slot(slot)
        if self._jax is not None:  # fresh zero-copy arrays, fenced by their lifetime in JAX
            v, fence = self._jax.wrap({**{n: v[n] for n in self._out_fields},
                                      INDICES: v[INDICES], LANES: v[LANES], WEIGHTS: v[WEIGHTS]},
                                     copy=self._ring is None, host_keys=(INDICES, LANES))
            self._jax_fence = fence
        batch = Batch(
            {n: v[n] for n in self._out_fields}, v[INDICES], v[LANES], v[WEIGHTS],
            self._release_batch, slot, self._gen[slot],
            to_fn=self._batch_to if self.output == "torch" else None,
        )
        if self._table is not None:
            self._recent.append((v[INDICES], np.array(v[LANES])))
        self._held = batch
        return batch

    def _release_batch(self, batch: Batch) -> None:
        if batch is not self._held:
            return
        self._held = None
        if self._pinned is not None and self._backend is not None:
            # A copy the learner issued on its current stream may still be reading the slot.
            self._fences.add(batch.slot, self._backend.record_current())
        self._release_jax(batch.slot)
        self._slot_done(batch.slot)

    def _release_jax(self, slot: int) -> None:
        """The slot of a released JAX batch waits until JAX has let go of its arrays."""
        if self._jax_fence is not None:
            self._fences.add(slot, self._jax_fence)
            self._jax_fence = None

    def _slot_done(self, slot: int) -> None:
        """The learner is done with ``slot``: back to its worker now, or once its fences pass."""
        self._slot_rows.pop(slot, None)
        if self._closed or self._ring is None or self._failure is not None:
            return
        if not self._fences.busy(slot):
            self._assign(self._workers[slot % self.n_workers], slot)

    def _reap_fences(self) -> None:
        """Hand back to the workers every slot whose device copies have completed."""
        if not len(self._fences):
            return
        for slot in self._fences.completed(in_order=self.ordered):
            if not self._closed and self._ring is not None and self._failure is None:
                self._assign(self._workers[slot % self.n_workers], slot)

    def _batch_to(self, batch: Batch, device: Any) -> dict[str, Any]:
        """``Batch.to(device)``: fenced copies of a host batch (see ``Batch.to``)."""
        backend = self._backend
        if backend is None or str(backend.device) != str(device):
            backend = self._backends.get(str(device))
            if backend is None:
                backend = self._backends[str(device)] = make_backend(device)
        arrays = {n: batch[n] for n in batch}
        arrays.update(indices=batch.indices, lanes=batch.lanes, weights=batch.weights)
        slot = batch.slot
        return fenced_copy(backend, arrays, lambda fence: self._fences.add(slot, fence),
                           host_keys=("indices", "lanes"))

    # -- device delivery ----------------------------------------------------------------------
    def _submit_ready(self) -> None:
        """Copy ready slots to the device while device buffers are free; each slot goes back to
        the workers once its copy has completed."""
        stage = self._stage
        while stage.can_submit():
            slot = self._pop_ready()
            if slot is None:
                return
            self._submit_slot(slot)
            self._slot_done(slot)

    def _submit_slot(self, slot: int) -> None:
        """Enqueue the copy of ``slot`` to a device buffer; fence the slot with it."""
        v = self._take_slot(slot)
        host = {n: v[n] for n in self._out_fields}
        host[WEIGHTS] = v[WEIGHTS]
        tag = (self._gen[slot], v[INDICES].clone(), v[LANES].clone())
        try:
            self._fences.add(slot, self._stage.submit(host, tag))
        except BaseException:
            try:  # copies enqueued before the failure may still read the slot
                self._fences.add(slot, self._stage.backend.record_copy())
            finally:
                self._slot_done(slot)
            raise

    def _hold_device(self) -> Batch:
        d, arrays, (gen, indices, lanes) = self._stage.take()
        batch = Batch({n: arrays[n] for n in self._out_fields}, indices, lanes, arrays[WEIGHTS],
                      self._release_device_batch, d, gen)
        if self._table is not None:
            self._recent.append((indices, lanes.numpy()))
        self._held = batch
        return batch

    def _release_device_batch(self, batch: Batch) -> None:
        if batch is not self._held:
            return
        self._held = None
        self._stage.give_back(batch.slot)  # reused once the learner's stream passes here

    def _next_in_process(self, timeout: float) -> Batch:
        buf = self._buf
        deadline = time.monotonic() + timeout
        pause = 5e-5
        limiter = buf._limiter if self._limit is not None else None
        target = self._local if self._transform is None else self._local_scratch
        self._wait_local_copies(deadline, timeout)
        out = {n: target[n] for n, _, _ in self._compiled.outputs}
        while True:
            rows = None
            if self._select is not None:
                rows = (self._select.select(self.batch_size, self._sel_rng)
                        if self._may_select() else None)
                if rows is not None:
                    if buf._gather(rows[0], rows[1], out).all():
                        self._select.gathered(0)  # in our memory now: writers may reuse slots
                        break
                    self._select.stale(rows)  # overwritten meanwhile: select again
                    continue
            elif can_sample(buf, limiter, self.min_size, self.batch_size):
                break
            now = time.monotonic()
            if now >= deadline:
                raise Timeout(f"no batch within {timeout}s: {self._waiting_for()}")
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 2e-3)
            self._check_open()  # close() from another thread ends the wait
        if rows is not None:
            lanes, indices, probs, pmin = rows
        else:
            sampler = self._table.draw if self._table is not None else None
            draw = (buf.sample_into(out, self._rng, sampler=sampler) if sampler is not None
                    else buf.sample_into(out, self._rng, plan=self._compiled))
            lanes, indices, probs, pmin = draw.lanes, draw.indices, draw.probs, draw.pmin
        if self._transform is not None:
            batch = dict(self._local_scratch)
            result = self._transform(batch)
            result = batch if result is None else result
            for name in self._out_fields:
                np.copyto(self._local[name], np.asarray(result[name]), casting="same_kind")
        self._local_idx[...] = indices
        self._local_lanes[...] = lanes
        if probs is not None:
            self._local_probs[...], self._local_pmin[0] = probs, pmin
        if limiter is not None:
            q = buf._q
            c = limiter.counter_index(0)
            q[c] = q[c] + self.batch_size
        if self._stage is not None:
            self._submit_slot(0)
            return self._hold_device()
        return self._hold(0)

    def _wait_local_copies(self, deadline: float, timeout: float) -> None:
        """In-process batches reuse one set of arrays: gather again only after the copies that
        read the last batch (``device=``, ``Batch.to``) have completed."""
        pause = 5e-5
        while len(self._fences):
            self._fences.completed()
            if not len(self._fences):
                return
            if time.monotonic() >= deadline:
                raise Timeout(f"no batch within {timeout}s: device copies of the previous batch "
                              f"have not completed")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def _local_arrays(self) -> dict[str, np.ndarray]:
        return {WEIGHTS: self._local_w, PROBS: self._local_probs, PMIN: self._local_pmin}

    # -- priorities -------------------------------------------------------------------------------
    def update_priorities(self, indices: Any, priorities: Any, lanes: Any = None) -> int:
        """Set new priorities (e.g. |TD error|) for rows of delivered batches.

        ``indices`` are ``batch.indices``: each carries the logical position (generation) it
        was sampled at, so an update for a row overwritten since is dropped, never applied to
        the new data. ``lanes`` is ``batch.lanes`` (found automatically when ``indices`` is
        the ``batch.indices`` array of one of the last 8 batches, or the buffer has one lane).
        Returns how many priorities were applied.

        Raises:
            InvalidPriorityError: a priority is NaN, infinite or negative (nothing applied).
        """
        self._check_open()
        if self._table is None or self._opts["sampler"] != "prioritized":
            raise ShmbufError(
                "update_priorities() needs a prioritized pool: SamplerPool(..., "
                "sampler='prioritized')"
            )
        if lanes is None:
            if self._buf.lanes == 1:
                lanes = 0
            else:
                # Newest first: a staging slot's indices array is the same object for every
                # batch that slot carries, and only its latest batch's lanes are the right ones.
                lanes = next((ln for ref, ln in reversed(self._recent) if ref is indices),
                             None)
                if lanes is None:
                    raise ValueError(
                        "pass lanes=batch.lanes: the buffer has several lanes and these indices "
                        "are not the indices array of a recent batch"
                    )
        indices, priorities = _host_array(indices), _host_array(priorities)
        lanes = lanes if isinstance(lanes, (int, np.integer)) else _host_array(lanes)
        # Enter rows committed since the last batch first: an update for a row overwritten
        # since it was sampled is then recognised (by its slot's generation) and dropped.
        if self._select is not None:  # max_times_sampled: a retired row stays retired
            self._select.sync()
            return self._select.update(lanes, indices, priorities)
        self._table.sync(self._buf)
        return self._table.update(lanes, indices, priorities)

    def _waiting_for(self) -> str:
        buf = self._buf
        size = len(buf)
        if size < self.min_size:
            return (f"the buffer holds {size} of min_size={self.min_size} transitions; are the "
                    f"actors writing to {buf.name!r}?")
        if self._limit is not None:
            _, limit, base, n = buf._limiter.read()
            if limit is not None:
                inserts = buf._limiter.total_committed() - base
                samples = buf._limiter.samples(n)
                if not limit.can_sample(inserts, samples, self.batch_size):
                    return (f"the rate limiter holds sampling back (inserts {inserts}, samples "
                            f"{samples}, samples_per_insert {limit.samples_per_insert}): actors "
                            f"are not inserting fast enough")
        if len(self._fences) == self.n_staging:
            return (f"all {self.n_staging} staging slots are still read by device copies or "
                    f"by arrays of earlier batches (output={self.output!r}): drop arrays of old "
                    f"batches (copy what you keep), or raise n_staging")
        alive = sum(1 for w in self._workers if w.proc is not None and w.proc.is_alive())
        return f"{alive} of {self.n_workers} workers alive, none has a batch ready"

    # -- stats ------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Batches/s, actual samples per insert, staging occupancy, learner wait, restarts."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        inserts = int(self._buf.committed().sum()) - self._committed0
        samples = self._batches * self.batch_size
        if self._limit is not None and not self._closed:
            _, limit, base, n = self._buf._limiter.read()
            if limit is not None:
                samples = self._buf._limiter.samples(n)
        return {
            "batches": self._batches,
            "batches_per_s": self._batches / elapsed,
            "samples_per_insert": samples / inserts if inserts > 0 else math.inf,
            "inserts_per_s": inserts / elapsed,
            "staging_ready": len(self._ready),
            "staging_occupancy": len(self._ready) / self.n_staging,
            "mean_staging_occupancy": self._occupancy_sum / max(self._batches, 1),
            "learner_wait_s": self._wait_s,
            "learner_wait_frac": self._wait_s / elapsed,
            "restarts": self._budget.total,
            "priority_updates_dropped": (self._table.updates_dropped
                                         if self._table is not None else 0),
            "elapsed_s": elapsed,
            "workers": [
                {"id": w.wid, "pid": w.proc.pid if w.proc else None,
                 "alive": bool(w.proc is not None and w.proc.is_alive()), "batches": w.batches}
                for w in self._workers
            ],
        }

    @property
    def buffer(self) -> ReplayBuffer:
        return self._buf

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None]

    @property
    def staging_name(self) -> str | None:
        return self._ring.name if self._ring is not None else None

    # -- teardown -------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the SamplerPool is closed")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers (gracefully, then firmly), lift the rate limit and free the staging
        ring. Wakes a thread blocked in ``next()``. Idempotent."""
        timeout = _timeout("timeout", timeout)
        if self._closed:
            return
        self._closed = True
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        self._teardown(timeout)

    def _teardown(self, timeout: float) -> None:
        if getattr(self, "_held", None) is not None:
            if self._pinned is not None and self._backend is not None and self._stage is None:
                # The learner's own async copies of the held batch: wait for them below.
                self._fences.add(self._held.slot, self._backend.record_current())
            self._release_jax(self._held.slot)
            self._held._invalidate()
            self._held = None
        if getattr(self, "_recent", None):
            self._recent.clear()  # (JAX) arrays of recent batches may fence their slots
        for w in self._workers:
            if w.chan is not None and not w.chan.closed:
                try:
                    w.chan.send(OP_STOP)
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for w in self._workers:
            if w.proc is not None:
                stop_process(w.proc, max(0.1, deadline - time.monotonic()))
            if w.chan is not None:
                w.chan.close()
        self._workers = []
        if self._select is not None and not self._buf.closed:
            self._select.close()
        self._select = None
        if self._table is not None:
            self._table.close()
            self._table = None
        if self._limiter_lease is not None:
            if not self._buf.closed:
                self._buf._limiter.deactivate()
            self._limiter_lease.close()
            self._limiter_lease = None
        # Device copies may still read the ring: unmapping (or unpinning) it under a DMA would
        # hand the device freed memory. Wait for them, within the timeout.
        settled = self._fences.drain(max(0.1, deadline - time.monotonic()))
        if self._stage is not None:
            settled = self._stage.drain(max(0.1, deadline - time.monotonic())) and settled
            self._stage.close()
            self._stage = None
        if not settled and self._ring is not None:
            warnings.warn(
                f"device copies from staging ring {self._ring.name!r} were still in flight after "
                f"{timeout}s; its name is removed but its memory stays mapped (and page-locked) "
                f"until this process exits", ResourceWarning, stacklevel=3)
            _IN_FLIGHT_RINGS.append(self._ring)
            self._ring.seg.unlink()
            self._ring = None
            self._pinned = None
        if self._pinned is not None:
            torch, ptr = self._pinned
            torch.cuda.cudart().cudaHostUnregister(ptr)
            self._pinned = None
        self._views = []
        self._local = {}
        if self._ring is not None:
            try:
                self._ring.close()
            except BufferInUseError as e:
                warnings.warn(str(e), ResourceWarning, stacklevel=3)
            self._ring = None
        if self._own_buffer and not self._buf.closed:
            try:
                self._buf.close()
            except BufferInUseError as e:
                warnings.warn(str(e), ResourceWarning, stacklevel=3)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        _PARENT_ONLY.discard(self)

    def _close_in_child(self) -> None:
        for w in self._workers:
            w._close_in_child()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1
        self._workers = []
        self._closed = True

    def __enter__(self) -> SamplerPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close(timeout=1.0)
            except Exception:
                pass


# -- argument helpers ---------------------------------------------------------------------------------------
def _seconds(name: str, value: Any) -> float:
    return _timeout(name, value, positive=True)


def _rate_limit(samples_per_insert: Any, min_size: int, batch_size: int) -> RateLimit | None:
    if samples_per_insert is None:
        return None
    try:
        ratio, tolerance = samples_per_insert
        ratio, tolerance = float(ratio), float(tolerance)
    except (TypeError, ValueError):
        raise ValueError(
            f"samples_per_insert must be (ratio, tolerance), e.g. (8.0, 1024), got "
            f"{samples_per_insert!r}"
        ) from None
    if tolerance < batch_size:
        raise ValueError(
            f"samples_per_insert tolerance {tolerance:g} is smaller than batch_size "
            f"{batch_size}: samplers could never take a whole batch. Fix: a tolerance of at "
            f"least a few batches, e.g. ({ratio:g}, {4 * batch_size})"
        )
    if tolerance < ratio:
        raise ValueError(
            f"samples_per_insert tolerance {tolerance:g} is smaller than samples_per_insert "
            f"{ratio:g}: one insert moves the balance by {ratio:g} samples, so writers and "
            f"samplers could end up waiting for each other (Reverb refuses this too). Fix: a "
            f"tolerance of at least the ratio, e.g. ({ratio:g}, {max(ratio, 4 * batch_size):g})"
        )
    return RateLimit(min_size, ratio, tolerance)


def _beta_schedule(beta: Any) -> Any:
    """beta as a function of batches delivered: a number, (start, end, n) linear, a callable."""
    if callable(beta):
        return beta
    if isinstance(beta, (tuple, list)):
        start, end, n = beta
        if n <= 0:
            raise ValueError(f"beta schedule (start, end, n_batches) needs n_batches > 0, got {n}")
        return lambda step: start + (end - start) * min(1.0, step / n)
    b = float(beta)
    if not 0 <= b <= 1:
        raise ValueError(f"beta must be in [0, 1] (or a schedule), got {beta!r}")
    return lambda step: b


def _host_array(value: Any) -> Any:
    """NumPy for priority updates: torch tensors (also on a device) come to the host."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu().numpy()
    return value


def _callable_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _check_picklable(fn: Any) -> None:
    if fn is None:
        return
    try:
        cloudpickle.dumps(fn)
    except Exception as e:
        raise TypeError(
            f"transform {_callable_name(fn)} cannot be serialised for the worker processes "
            f"({type(e).__name__}: {e}). Fix: avoid capturing unpicklable objects (locks, open "
            f"files, sockets) in it; create them inside the function instead"
        ) from e
