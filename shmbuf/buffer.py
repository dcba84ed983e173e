"""``ReplayBuffer``: the user's façade over a ``BufferStorage`` (``storage.py``).

Writers (``writer.py``, ``vector.py``) append to their own lane under ``slots.py``'s protocol;
any process samples with seqlock-checked reads, never waiting on a writer or delivering a torn row.
"""

from __future__ import annotations

import math
import operator
import os
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import layout as L
from . import slots
from ._recycle import Recycler
from .checks import positive_int, timeout_seconds
from .errors import (
    ClosedError,
    LaneBusyError,
    SamplingError,
    SpecMismatchError,
    StaleIndexError,
)
from .limiter import RateLimit
from .sampling import Draw, Windows, draw_uniform
from .sampling.plan import Compiled, Plan, compile_plan
from .spec import Spec
from .storage import BufferStorage
from .writer import Writer

RECYCLE_MIN_BYTES = 64 * 1024  # sample() recycles output arrays at least this large ...
RECYCLE_KEEP = 4  # ... keeping up to this many per (field, batch size)
MAX_RETRIES = 64  # redraw rounds for rows that fail their seqlock check before SamplingError
DEFAULT_INSERT_TIMEOUT = 60.0

RngLike = np.random.Generator | int | None


def _as_rng(rng: RngLike, default: np.random.Generator) -> np.random.Generator:
    if rng is None:
        return default
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(rng)


class ReplayBuffer:
    """A replay buffer in POSIX shared memory, shared by any number of processes.

    The creator owns the segment and unlinks it on ``close()``, at exit and on SIGTERM. Any
    process can ``attach`` by name (or receive the buffer pickled: it re-attaches), write through
    a lane ``writer()`` and ``sample``.

    Concurrency: each lane has one writer at a time (an OFD lock). Only that writer stores its
    lane's words and slots; readers load ``committed``, draw indices in the lane's window and
    check each row's stamp before and after copying it, redrawing rows that changed. A writer
    that dies (even by SIGKILL) releases its lane; the next ``writer()`` takes it over, and any
    row it left half-written is never delivered.

    Example:
        >>> spec = Spec(obs=((4,), "float32"), action=((), "int64"))
        >>> with ReplayBuffer.create(spec, capacity=1000, lanes=2) as buf:
        ...     with buf.writer() as w:
        ...         w.add(obs=np.zeros(4, np.float32), action=1)
        ...     batch = buf.sample(8)
    """

    def __init__(self, storage: BufferStorage) -> None:
        """Internal: use ``ReplayBuffer.create`` or ``ReplayBuffer.attach``."""
        self._storage = storage
        self._seg = storage.segment
        self._spec = storage.spec
        self._layout = storage.layout
        self.derived_next_obs = storage.derived_next_obs
        self._gather = storage.gather  # bound once: sample() calls it per batch
        self._words = storage.words
        self._closed = False
        self._writers: weakref.WeakSet[Any] = weakref.WeakSet()  # Writers, VectorWriters
        self._default_rng = np.random.default_rng()
        self._compiled: dict[Any, Compiled] = {}
        self._readers: dict[int, Any] = {}
        self._store_writer: Writer | None = None
        self._recycled: dict[tuple[str, tuple[int, ...], str], Recycler] = {}
        self._zero_lanes: dict[int, np.ndarray] = {}
        self._lane0_committed = storage.word_index(0, L.LANE_COMMITTED)
        self._lane0_reserved = storage.word_index(0, L.LANE_RESERVED)

    @property
    def storage(self) -> BufferStorage:
        """The segment and its named views (internal, for writers, readers and ``workers``)."""
        return self._storage

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        spec: Spec | Mapping[str, Any],
        capacity: int,
        lanes: int = 1,
        name: str | None = None,
        *,
        next_obs: str = "stored",
        episode_spec: Spec | Mapping[str, Any] | None = None,
        episode_capacity: int | None = None,
    ) -> ReplayBuffer:
        """Create a buffer in a new segment; this process owns it.

        Args:
            spec: the fields of a transition (a ``Spec`` or a mapping accepted by ``Spec``).
            capacity: rows per lane; the buffer holds ``capacity * lanes`` in all.
            lanes: independent rings, one writer each (e.g. one per actor or per env).
            name: segment name (``/dev/shm/<name>``); a unique ``shmbuf-buf-...`` by default.
            next_obs: "stored" (the spec's own ``next_obs`` field, if any) or "derived": store
                ``obs`` once and read ``next_obs`` from the next step of the same episode, the
                episode's true final observation being kept in one extra row per episode
                (halves the memory of image observations). The spec must have ``obs`` and no
                ``next_obs``; writers still pass ``next_obs`` to ``add``.
            episode_spec: per-episode fields (return, seed, ...) that ``end_episode(**data)``
                stores, readable by episode id.
            episode_capacity: episode records kept per lane (default ``capacity // 8``, at
                least 64): older records are overwritten.

        Raises:
            CapacityError: /dev/shm has too little room (the message says how to give it more).
            SegmentExistsError: ``name`` is taken.
        """
        return cls(BufferStorage.create(spec, capacity, lanes, name, next_obs, episode_spec,
                                        episode_capacity))

    @classmethod
    def attach(cls, name: str, timeout: float = 5.0) -> ReplayBuffer:
        """Map an existing buffer by name, from any process. Never resizes or changes it."""
        return cls(BufferStorage.attach(name, timeout))

    def __reduce__(self) -> tuple[Any, ...]:
        self._check_open()
        return (ReplayBuffer.attach, (self.name,))

    # -- properties --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._seg.name

    @property
    def spec(self) -> Spec:
        return self._spec

    @property
    def capacity(self) -> int:
        """Transitions per lane."""
        return self._layout.capacity

    @property
    def lanes(self) -> int:
        return self._layout.lanes

    @property
    def is_owner(self) -> bool:
        return self._seg.owner and self._seg.pid == os.getpid()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nbytes(self) -> int:
        return self._layout.total_size

    def __len__(self) -> int:
        """Transitions readable now, over all lanes."""
        return self.windows().total

    @property
    def is_full(self) -> bool:
        return bool((self.windows().sizes >= self.capacity).all())

    def __repr__(self) -> str:
        if self._closed:
            return f"<ReplayBuffer {self.name!r} closed>"
        return (
            f"<ReplayBuffer {self.name!r} {len(self)}/{self.capacity * self.lanes} "
            f"lanes={self.lanes} {self._spec!r}>"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"replay buffer {self.name!r} is closed; attach again to use it")

    # -- lanes and writers ---------------------------------------------------------------------------
    def windows(self) -> Windows:
        """Each lane's readable logical indices ``[lo, hi)`` (``slots.read_windows``: the
        writer's claim is loaded before ``committed``)."""
        self._check_open()
        return self._storage.windows()

    def committed(self, lane: int | None = None) -> int | np.ndarray:
        """Transitions ever published to ``lane`` (or to each lane)."""
        self._check_open()
        if lane is None:
            return self._storage.committed.copy()
        return int(self._storage.committed[self._lane_index(lane)])

    def _lane_index(self, lane: Any) -> int:
        if not isinstance(lane, (int, np.integer)) or not 0 <= lane < self.lanes:
            raise ValueError(f"lane must be an int in [0, {self.lanes}), got {lane!r}")
        return int(lane)

    def writer(
        self,
        lane: int | None = None,
        timeout: float = 5.0,
        insert_timeout: float = DEFAULT_INSERT_TIMEOUT,
        *,
        num_envs: int | None = None,
        lanes: list[int] | None = None,
    ) -> Any:
        """Take a lane for writing: ``lane``, or the first free one.

        A lane whose writer died (even by SIGKILL) is free again at once and is taken over: the
        new writer continues at the lane's ``committed`` index and starts a new episode.

        With ``num_envs=N`` returns a ``VectorWriter`` over N lanes (``lanes``, or free ones):
        ``add`` takes ``[N, ...]`` arrays, one row per environment, each to its own lane.

        Args:
            lane: the lane to take, or None for any free lane.
            timeout: seconds to wait for a lane to become free.
            insert_timeout: seconds ``add``/``extend`` may wait on the rate limiter.

        Raises:
            LaneBusyError: no lane became free in time.
            ValueError: a bad argument (checked before any lane is taken).
        """
        self._check_open()
        # Every argument is checked before a lease exists: a refused call holds no lane, not
        # even while its exception (whose traceback keeps the frames alive) is still around.
        wait = timeout_seconds("timeout", timeout)
        timeout_seconds("insert_timeout", insert_timeout)
        if num_envs is not None or lanes is not None:
            return self._vector_writer(num_envs, lanes, timeout, insert_timeout)
        candidates = [self._lane_index(lane)] if lane is not None else self._lane_order()
        lease = self._seg.lease()
        deadline = time.monotonic() + wait
        while True:
            for k in candidates:
                if lease.try_lock(L.lock_lane(k)):
                    try:
                        w = Writer(self._storage, k, lease, insert_timeout)
                    except BaseException:
                        lease.close()  # releases the lane now, not when the traceback dies
                        raise
                    self._writers.add(w)
                    return w
            if time.monotonic() >= deadline:
                lease.close()
                busy = ", ".join(
                    f"{k} (pid {self._storage.writer_pid(k)})"
                    for k in candidates
                )
                raise LaneBusyError(
                    f"no free lane after {timeout}s: lane(s) {busy} have live writers. Fix: close "
                    f"a writer, or create the buffer with more lanes (it has {self.lanes})"
                )
            time.sleep(0.01)

    def _vector_writer(self, num_envs: int | None, lanes: list[int] | None, timeout: float,
                       insert_timeout: float) -> Any:
        from .vector import VectorWriter

        if lanes is None:
            num_envs = positive_int("num_envs", num_envs)
            if num_envs > self.lanes:
                raise ValueError(
                    f"num_envs={num_envs} needs as many lanes, the buffer has {self.lanes}. Fix: "
                    f"create it with lanes >= num_envs"
                )
        else:
            lanes = [self._lane_index(k) for k in lanes]
            if not lanes or len(set(lanes)) != len(lanes):
                raise ValueError(
                    f"lanes must list distinct lanes, at least one, got {lanes!r}: each env "
                    f"writes its own lane"
                )
            if num_envs is not None and num_envs != len(lanes):
                raise ValueError(f"num_envs={num_envs} but {len(lanes)} lanes were given")
        writers: list[Writer] = []
        try:
            if lanes is not None:
                for k in lanes:
                    writers.append(self.writer(lane=k, timeout=timeout,
                                               insert_timeout=insert_timeout))
            else:
                for _ in range(num_envs):
                    writers.append(self.writer(timeout=timeout, insert_timeout=insert_timeout))
            vw = VectorWriter(self._storage, sorted(writers, key=lambda w: w.lane) if lanes is None
                              else writers)
        except BaseException:  # every lane taken so far is released before this propagates
            for w in writers:
                w.close()
            raise
        self._writers.add(vw)  # closed with the buffer, like plain writers
        return vw

    def _lane_order(self) -> list[int]:
        # Start the scan at a pid-dependent lane so that concurrent actors rarely collide.
        start = os.getpid() % self.lanes
        return [(start + k) % self.lanes for k in range(self.lanes)]

    def writer_alive(self, lane: int) -> bool:
        """True while some process holds ``lane``'s writer lease."""
        self._check_open()
        return self._seg.probe(L.lock_lane(self._lane_index(lane)))

    # -- reading -------------------------------------------------------------------------------------
    def _draw_uniform_one_lane(self, batch: int, rng: np.random.Generator) -> Draw:
        """``draw_uniform`` for a one-lane buffer without the per-lane array arithmetic (the
        same draw, about 10 us cheaper: it matters for small rows)."""
        lo, hi = slots.read_window(self._words, self._lane0_reserved, self._lane0_committed,
                                   self.capacity)
        if hi <= lo:
            return draw_uniform(Windows(np.array([lo]), np.array([hi])), batch, rng)  # raises
        zeros = self._zero_lanes.get(batch)
        if zeros is None:
            zeros = self._zero_lanes[batch] = np.zeros(batch, np.int64)
            zeros.flags.writeable = False
        return Draw(zeros, rng.integers(lo, hi, size=batch, dtype=np.int64))

    def sample_into(
        self,
        out: Mapping[str, np.ndarray],
        rng: RngLike = None,
        *,
        plan: Compiled | None = None,
        sampler: Any = draw_uniform,
        max_retries: int = MAX_RETRIES,
    ) -> Draw:
        """Draw a batch into preallocated arrays.

        Without ``plan``: uniform transitions, ``out[field]`` of shape ``[B, *shape]`` for the
        fields to read. With a compiled plan (``buf.compile(...)``): every array of
        ``plan.outputs``. Rows whose stamp changed under the copy are redrawn (bounded by
        ``max_retries`` rounds). Returns the (lanes, indices) delivered.

        Raises:
            EmptyBufferError: nothing to sample.
            SamplingError: rows kept being overwritten while read (capacity too small for the
                write rate), or the plan finds no usable rows.
        """
        self._check_open()
        if not out:
            raise ValueError("sample_into() needs at least one output array")
        rng = _as_rng(rng, self._default_rng)
        if plan is not None and not (plan.plan.is_plain and not plan.derived_next_obs):
            return self._reader(plan).read_into(out, rng, max_retries)
        batch = next(iter(out.values())).shape[0]
        if sampler is draw_uniform and self.lanes == 1:
            draw = self._draw_uniform_one_lane(batch, rng)
        else:
            draw = sampler(self.windows(), batch, rng)
        ok = self._gather(draw.lanes, draw.indices, out)
        if ok.all():
            return draw
        lanes, indices = draw.lanes.copy(), draw.indices.copy()
        probs, pmin = (None if draw.probs is None else draw.probs.copy()), draw.pmin
        for _ in range(max_retries):
            bad = np.flatnonzero(~ok)
            redraw = sampler(self.windows(), bad.size, rng)
            tmp = {k: np.empty((bad.size, *v.shape[1:]), v.dtype) for k, v in out.items()}
            ok_bad = self._gather(redraw.lanes, redraw.indices, tmp)
            for k, v in out.items():
                v[bad] = tmp[k]
            lanes[bad], indices[bad], ok[bad] = redraw.lanes, redraw.indices, ok_bad
            if probs is not None:
                probs[bad] = redraw.probs
                pmin = min(pmin, redraw.pmin)
            if ok.all():
                return Draw(lanes, indices, probs, pmin)
        raise SamplingError(
            f"{int((~ok).sum())} of {batch} rows were overwritten while being read, "
            f"{max_retries} times in a row: writers lap the readers. Fix: a larger capacity "
            f"(now {self.capacity} per lane) or slower writers"
        )

    def compile(self, plan: Plan | None = None, fields: list[str] | None = None,
                **plan_kwargs: Any) -> Compiled:
        """Check a sampling plan (or ``Plan(**plan_kwargs)``) against this buffer; the result
        names the arrays a batch holds (``.outputs``) and is what ``sample_into(plan=)`` takes."""
        plan = Plan(**plan_kwargs) if plan is None else plan
        key = (plan, None if fields is None else tuple(fields))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = compile_plan(
                plan, self._spec, self.derived_next_obs, fields)
        return compiled

    def _reader(self, compiled: Compiled) -> Any:
        from .reader import PlanReader

        reader = self._readers.get(id(compiled))
        if reader is None or reader.compiled is not compiled:
            reader = self._readers[id(compiled)] = PlanReader(self._storage, compiled)
        return reader

    def sample(
        self,
        batch_size: int,
        rng: RngLike = None,
        *,
        fields: list[str] | None = None,
        **plan: Any,
    ) -> dict[str, np.ndarray]:
        """Sample ``batch_size`` transitions uniformly (with replacement) into new arrays.

        The arrays are the caller's: nothing else references them. Large ones (>= 64 KiB) are
        recycled by later calls once the caller has dropped every reference to them (the array,
        views of it, tensors made from it), which spares the page faults of fresh memory
        (about 3x on Atari batches).

        Args:
            batch_size: rows to draw.
            rng: a ``numpy.random.Generator`` (advanced in place), a seed, or None.
            fields: a subset of fields to read (all by default).
            **plan: episode-aware sampling, as ``shmbuf.sampling.Plan`` takes it:
                ``sequence_length``, ``cross_episodes``, ``frame_stack``, ``frame_lookahead``,
                ``stack_fields``, ``n_step``, ``gamma`` (and the field names they use).

        Returns:
            field name -> array of shape ``[batch_size, *shape]`` (``[batch_size, T, ...]`` for
            sequences), every row checked whole; plans add ``mask`` / ``<field>_mask`` /
            ``discount`` / ``steps`` arrays.
        """
        self._check_open()
        batch_size = positive_int("batch_size", batch_size)
        if plan or self.derived_next_obs:
            compiled = self.compile(Plan(**plan), fields)
            out = {n: self._output_array(n, (batch_size, *s), d) for n, s, d in compiled.outputs}
            self.sample_into(out, rng, plan=compiled)
            return out
        names = list(self._spec) if fields is None else self._check_fields(fields)
        out = {n: self._output_array(n, (batch_size, *self._spec[n].shape), self._spec[n].dtype)
               for n in names}
        self.sample_into(out, rng)
        return out

    def _output_array(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An array nobody else references: in the memory of a dropped one if there is one
        (``Recycler``: decided by a weakref, never by reference counts), else new."""
        if math.prod(shape) * dtype.itemsize < RECYCLE_MIN_BYTES:
            return np.empty(shape, dtype)
        key = (name, shape, dtype.str)
        recycler = self._recycled.get(key)
        if recycler is None:
            recycler = self._recycled[key] = Recycler(shape, dtype, RECYCLE_KEEP)
        return recycler.take()

    def _check_fields(self, fields: list[str]) -> list[str]:
        unknown = [f for f in fields if f not in self._spec]
        if unknown:
            raise SpecMismatchError(
                f"unknown field(s) {unknown}; the spec has {', '.join(self._spec)}"
            )
        return list(fields)

    def get(self, indices: Any, lanes: Any = 0, *, with_episode: bool = False
            ) -> dict[str, np.ndarray]:
        """Read rows by logical index (as in ``Batch.indices``) of ``lanes``.

        With ``with_episode=True`` the result also has ``_episode`` (episode id in the lane),
        ``_step`` (step in the episode) and ``_final`` (the row is an episode's final
        observation, in derived-next_obs buffers).

        Raises:
            StaleIndexError: an index is not held now (overwritten, or not yet written).
        """
        self._check_open()
        idx = np.atleast_1d(np.asarray(indices, dtype=np.int64))
        ln = np.broadcast_to(np.asarray(lanes, dtype=np.int64), idx.shape).copy()
        if ((ln < 0) | (ln >= self.lanes)).any():
            raise ValueError(f"lanes must be in [0, {self.lanes}), got {np.unique(ln)}")
        win = self.windows()
        held = (idx >= win.lo[ln]) & (idx < win.hi[ln])
        out = {n: np.empty((idx.size, *f.shape), f.dtype) for n, f in self._spec.items()}
        meta = np.empty(idx.size, np.int64)
        if held.all():
            held = self._gather(ln, idx, out, meta_out=meta)
        if not held.all():
            b = int(np.flatnonzero(~held)[0])
            k = int(ln[b])
            raise StaleIndexError(
                f"index {int(idx[b])} of lane {k} is not held: the lane holds "
                f"[{int(win.lo[k])}, {int(win.hi[k])}) now"
            )
        if with_episode:
            out["_episode"] = meta >> L.STEP_BITS
            out["_step"] = meta & L.STEP_MASK
            out["_final"] = (meta & L.FLAG_FINAL) != 0
        return out

    # -- episodes ----------------------------------------------------------------------------------
    @property
    def episode_spec(self) -> Spec | None:
        return self._storage.episode_spec

    def episode(self, episode_id: int, lane: int = 0) -> dict[str, Any]:
        """The record of a finished episode of ``lane``: ``start`` (logical index of its first
        step), ``length``, ``truncated`` and the episode-spec fields.

        Raises:
            StaleIndexError: not finished yet, older than the lane's ``episode_capacity``, or
                emptied by ``clear()``.
            ValueError: a negative id. TypeError: an id that is not an integer.
        """
        self._check_open()
        try:
            episode_id = operator.index(episode_id)
        except TypeError:
            raise TypeError(
                f"episode id must be an int, got {type(episode_id).__name__} {episode_id!r}"
            ) from None
        return self._storage.episodes.get(episode_id, self._lane_index(lane))

    def episodes(self, lane: int | None = None) -> dict[str, np.ndarray]:
        """Every episode record held now (one lane, or all), as arrays ordered by lane, id."""
        self._check_open()
        return self._storage.episodes.held(None if lane is None else self._lane_index(lane))

    # -- familiar surfaces (imitation's Buffer) -------------------------------------------------------
    @classmethod
    def from_data(cls, data: Mapping[str, Any], capacity: int | None = None,
                  truncate_ok: bool = False, **create_kwargs: Any) -> ReplayBuffer:
        """A new one-lane buffer holding ``data`` (field -> ``[n, ...]``), dtypes and shapes
        inferred. ``capacity`` defaults to n (full); with fewer slots than rows, only the last
        ``capacity`` rows are kept if ``truncate_ok``, else ``ValueError``.

        Raises:
            ValueError: ``data`` is empty, its arrays differ in length, or it does not fit.
        """
        arrays = {k: np.asarray(v) for k, v in data.items()}
        n = _check_data(arrays)
        capacity = n if capacity is None else positive_int("capacity", capacity)
        if n > capacity and not truncate_ok:
            raise ValueError(
                f"data has {n} rows but capacity is {capacity}: pass truncate_ok=True to keep "
                f"the last {capacity}, or a larger capacity"
            )
        spec = Spec({k: (v.shape[1:], v.dtype) for k, v in arrays.items()})
        buf = cls.create(spec, capacity, lanes=1, **create_kwargs)
        try:
            buf.store(arrays, truncate_ok=truncate_ok)
        except BaseException:
            buf.close()
            raise
        return buf

    def store(self, data: Mapping[str, Any], truncate_ok: bool = False) -> None:
        """Append rows (field -> ``[n, ...]``) to lane 0 in FIFO order, as imitation's
        ``Buffer.store``. Keeps an internal writer on lane 0 until ``close()``.

        Raises:
            ValueError: ``data`` is empty, its arrays differ in length, or n > capacity without
                ``truncate_ok`` (then only the last ``capacity`` rows are stored).
        """
        self._check_open()
        n = _check_data(data)
        if n > self.capacity and not truncate_ok:
            raise ValueError(
                f"{n} rows exceed the capacity {self.capacity}: pass truncate_ok=True to store "
                f"only the last {self.capacity}"
            )
        if self._store_writer is None or self._store_writer.closed:
            self._store_writer = self.writer(lane=0)
        self._store_writer.extend(data)

    def size(self) -> int:
        """Rows readable now (imitation's ``Buffer.size()``); same as ``len(buf)``."""
        return len(self)

    def clear(self, timeout: float = 5.0) -> None:
        """Empty every lane, and drop the records of the episodes those rows held. Logical
        indices and episode ids keep growing (old ones are never reused), so indices,
        priorities and episode ids taken before are simply stale afterwards.

        Raises:
            LaneBusyError: a lane keeps a live writer (of any handle) for ``timeout`` s.
        """
        self._check_open()
        timeout = timeout_seconds("timeout", timeout)
        if self._store_writer is not None:
            self._store_writer.close()
            self._store_writer = None
        lease = self._storage.lock_all_lanes(timeout, "clearing the buffer")
        try:
            for k in range(self.lanes):
                self._storage.empty_lane(k)
        finally:
            lease.close()

    reset = clear

    def column(self, name: str) -> np.ndarray:
        """A read-only view of a field's whole column, ``[lanes * capacity, *shape]``.

        Zero-copy and unchecked: rows may be mid-write. Delete the view before ``close()``.
        """
        self._check_open()
        self._check_fields([name])
        view = self._storage.columns[name][:]
        view.flags.writeable = False
        return view

    # -- stats -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """A snapshot: per-lane counters and writer liveness, totals and insert rate."""
        self._check_open()
        hdr = self._seg.header
        win = self.windows()
        now = time.time()
        q, lay = self._storage.words, self._layout
        per_lane = []
        for k in range(self.lanes):
            hb = q[lay.lane_word(k, L.LANE_HEARTBEAT) // 8]
            per_lane.append(
                {
                    "lane": k,
                    "committed": int(win.hi[k]),
                    "size": int(win.hi[k] - win.lo[k]),
                    "writer_alive": self._seg.probe(L.lock_lane(k)),  # this process's too
                    "writer_pid": q[lay.lane_word(k, L.LANE_WRITER_PID) // 8],
                    "epoch": q[lay.lane_word(k, L.LANE_EPOCH) // 8],
                    "episode": q[lay.lane_word(k, L.LANE_EPISODE) // 8],
                    "last_write_age_s": (now - hb / 1e9) if hb else None,
                }
            )
        total = int(win.hi.sum())
        elapsed = max(now - hdr.created, 1e-9)
        return {
            "name": self.name,
            "owner_pid": hdr.owner_pid,
            "owner_alive": self._seg.owner_alive(),
            "capacity": self.capacity,
            "lanes": self.lanes,
            "size": win.total,
            "committed": total,
            "inserts_per_s": total / elapsed,
            "age_s": elapsed,
            "nbytes": self.nbytes,
            "per_lane": per_lane,
        }

    # -- persistence (implemented in persist.py) ----------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False,
             progress: bool | None = None) -> None:
        """Write the buffer to a directory: ``manifest.json`` plus one ``.npy`` per field.

        Rows are stored per lane, oldest first; each ``.npy`` opens with plain
        ``numpy.load(path, mmap_mode="r")``. Safe while writers run: it saves the rows that
        were still intact at the end of the copy. Shows progress on large buffers.
        """
        from .persist import save

        self._check_open()
        save(self._storage, path, overwrite=overwrite, progress=progress)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        capacity: int | None = None,
        progress: bool | None = None,
    ) -> ReplayBuffer:
        """Create a new buffer (this process owns it) from a directory written by ``save``.

        Logical indices and episode counters are preserved. ``capacity`` may differ from the
        saved one; a smaller one keeps each lane's newest rows.

        Raises:
            CheckpointError: the directory is incomplete, truncated or inconsistent.
        """
        from .persist import load

        return load(cls.create, path, name=name, capacity=capacity, progress=progress)

    def state_dict(self) -> dict[str, Any]:
        """The buffer's contents as plain Python/NumPy objects, for training checkpoints."""
        from .persist import state_dict

        self._check_open()
        return state_dict(self._storage)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this buffer's contents with ``state``; needs every lane free of writers.

        Raises:
            SpecMismatchError: the state's spec or lanes differ from this buffer's.
            LaneBusyError: a lane has a live writer.
        """
        from .persist import load_state_dict

        self._check_open()
        load_state_dict(self._storage, state)

    # -- teardown --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close this handle; the owner also unlinks the segment. Idempotent.

        Open writers of this handle are closed first (releasing their lanes).

        Raises:
            BufferInUseError: arrays from ``column()`` still view the memory; everything else is
                done and the memory is unmapped once they are freed.
        """
        if not self._closed:
            self._closed = True
            for w in list(self._writers):
                w.close()
            self._readers = {}
            self._gather = self._words = None  # type: ignore[assignment]
            self._storage.drop_views()
            self._recycled.clear()
        self._seg.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # do not mask the exception already in flight
            warnings.warn(f"while closing {self.name!r}: {e}", RuntimeWarning, stacklevel=2)

    def __del__(self) -> None:
        # Last resort only: an owner dropped without close() still unlinks its name.
        seg = getattr(self, "_seg", None)
        if seg is not None and seg.owner and seg.pid == os.getpid():
            seg.unlink()


# -- helpers ------------------------------------------------------------------------------------------------
def _check_data(data: Mapping[str, Any]) -> int:
    """Rows in ``data`` (imitation's checks): ValueError if empty or of unequal lengths."""
    if not data:
        raise ValueError("data is empty: pass a mapping of field name -> array")
    lengths = {k: len(v) for k, v in data.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"data arrays differ in the length of their first axis: {lengths}")
    n = next(iter(lengths.values()))
    if n == 0:
        raise ValueError("data is empty: every array has 0 rows")
    return n


__all__ = ["ReplayBuffer", "Writer", "RateLimit"]
