"""``ReplayBuffer`` and ``Writer``: transitions in a POSIX shared-memory segment, per-lane rings.

Writers append to their own lane under the stamp protocol of DESIGN.md; any process samples with
vectorised seqlock checks, never waiting on a writer and never delivering a torn row.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import layout as L
from .errors import (
    ClosedError,
    LaneBusyError,
    RateLimitTimeout,
    SamplingError,
    SpecMismatchError,
    StaleIndexError,
)
from .limiter import LimiterBlock, RateLimit
from .sampling import Draw, Windows, draw_uniform
from .segment import Lease, Segment
from .spec import RowChecker, Spec

RECYCLE_MIN_BYTES = 64 * 1024  # sample() recycles output arrays at least this large ...
RECYCLE_KEEP = 4  # ... keeping up to this many per (field, batch size)
MAX_RETRIES = 64  # redraw rounds for rows that fail their seqlock check before SamplingError
ROOM_CHECK_EVERY = 4096  # rows between heartbeat / rate-limiter refreshes when unlimited
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

    def __init__(self, segment: Segment) -> None:
        """Internal: use ``ReplayBuffer.create`` or ``ReplayBuffer.attach``."""
        doc = segment.header.doc
        try:
            self._spec = Spec.from_json(doc["spec"])
            capacity, lanes = int(doc["capacity"]), int(doc["lanes"])
        except (KeyError, TypeError, ValueError) as e:
            segment.close()
            raise SpecMismatchError(f"segment {segment.name!r} has a malformed layout: {e}") from None
        json_len = len(L.encode_layout(doc))
        self._layout = L.buffer_layout(_field_tuples(self._spec), capacity, lanes, json_len)
        if self._layout.total_size != segment.header.total_size:
            segment.close()
            raise SpecMismatchError(
                f"segment {segment.name!r}: layout says {self._layout.total_size} bytes, header "
                f"says {segment.header.total_size}; it was made by an incompatible shmbuf"
            )
        self._seg = segment
        self._closed = False
        self._writers: weakref.WeakSet[Writer] = weakref.WeakSet()
        self._default_rng = np.random.default_rng()
        self._checker: RowChecker | None = None
        self._recycled: dict[tuple[str, int], list[np.ndarray]] = {}
        self._zero_lanes: dict[int, np.ndarray] = {}
        self._lane0_committed = self._layout.lane_word(0, L.LANE_COMMITTED) // 8
        self._lane0_reserved = self._layout.lane_word(0, L.LANE_RESERVED) // 8
        self._map_views()

    def _map_views(self) -> None:
        mm, lay = self._seg.buf, self._layout
        self._q = memoryview(mm).cast("q")
        lanes = np.frombuffer(
            mm, "<i8", count=lay.lanes * L.LANE_LINES * L.WORDS_PER_LINE, offset=lay.lane_offset
        ).reshape(lay.lanes, L.LANE_LINES, L.WORDS_PER_LINE)
        self._lane_words = lanes
        self._committed_v = lanes[:, L.LANE_COMMITTED, 0]
        self._reserved_v = lanes[:, L.LANE_RESERVED, 0]
        self._stamps = np.frombuffer(mm, "<i8", count=lay.slots, offset=lay.stamps_offset)
        self._meta = np.frombuffer(mm, "<i8", count=lay.slots, offset=lay.meta.offset)
        self._cols = {
            c.name: np.frombuffer(
                mm, c.dtype, count=int(np.prod(c.shape, dtype=np.int64)), offset=c.offset
            ).reshape(c.shape)
            for c in lay.columns
        }
        self._limiter = LimiterBlock(self._q, mm, lay)

    def _drop_views(self) -> None:
        self._lane_words = self._committed_v = self._reserved_v = None  # type: ignore[assignment]
        self._stamps = self._meta = None  # type: ignore[assignment]
        self._cols = {}
        self._limiter = None  # type: ignore[assignment]
        if self._q is not None:
            self._q.release()
            self._q = None  # type: ignore[assignment]

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        spec: Spec | Mapping[str, Any],
        capacity: int,
        lanes: int = 1,
        name: str | None = None,
    ) -> ReplayBuffer:
        """Create a buffer in a new segment; this process owns it.

        Args:
            spec: the fields of a transition (a ``Spec`` or a mapping accepted by ``Spec``).
            capacity: transitions per lane; the buffer holds ``capacity * lanes`` in all.
            lanes: independent rings, one writer each (e.g. one per actor or per env).
            name: segment name (``/dev/shm/<name>``); a unique ``shmbuf-buf-...`` by default.

        Raises:
            CapacityError: /dev/shm has too little room (the message says how to give it more).
            SegmentExistsError: ``name`` is taken.
        """
        spec = spec if isinstance(spec, Spec) else Spec(spec)
        capacity, lanes = _positive_int("capacity", capacity), _positive_int("lanes", lanes)
        if lanes > L.MAX_LANES:
            raise ValueError(f"lanes must be <= {L.MAX_LANES}, got {lanes}")
        doc = {"kind": "buffer", "spec": spec.to_json(), "capacity": capacity, "lanes": lanes}
        fields = _field_tuples(spec)

        def size_of(json_len: int) -> int:
            return L.buffer_layout(fields, capacity, lanes, json_len).total_size

        return cls(Segment.create(name, L.KIND_BUFFER, doc, size_of))

    @classmethod
    def attach(cls, name: str, timeout: float = 5.0) -> ReplayBuffer:
        """Map an existing buffer by name, from any process. Never resizes or changes it."""
        return cls(Segment.attach(name, L.KIND_BUFFER, timeout=timeout))

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
        """Each lane's readable logical indices ``[lo, hi)``.

        The writer's claim is loaded before ``committed``: read the other way round, a reader
        descheduled between the two loads pairs an old ``committed`` with a newer claim and sees
        a full lane as empty. Rows claimed after the load are caught by the stamp checks.
        """
        self._check_open()
        reserved = self._reserved_v.copy()  # the writer's claim first ...
        hi = self._committed_v.copy()  # ... then committed, at least as new
        lo = np.minimum(np.maximum(np.maximum(reserved, hi) - self.capacity, 0), hi)
        return Windows(lo, hi)

    def committed(self, lane: int | None = None) -> int | np.ndarray:
        """Transitions ever published to ``lane`` (or to each lane)."""
        self._check_open()
        if lane is None:
            return self._committed_v.copy()
        return int(self._committed_v[self._lane_index(lane)])

    def _lane_index(self, lane: Any) -> int:
        if not isinstance(lane, (int, np.integer)) or not 0 <= lane < self.lanes:
            raise ValueError(f"lane must be an int in [0, {self.lanes}), got {lane!r}")
        return int(lane)

    def writer(
        self,
        lane: int | None = None,
        timeout: float = 5.0,
        insert_timeout: float = DEFAULT_INSERT_TIMEOUT,
    ) -> Writer:
        """Take a lane for writing: ``lane``, or the first free one.

        A lane whose writer died (even by SIGKILL) is free again at once and is taken over: the
        new writer continues at the lane's ``committed`` index and starts a new episode.

        Args:
            lane: the lane to take, or None for any free lane.
            timeout: seconds to wait for a lane to become free.
            insert_timeout: seconds ``add``/``extend`` may wait on the rate limiter.

        Raises:
            LaneBusyError: no lane became free in time.
        """
        self._check_open()
        candidates = [self._lane_index(lane)] if lane is not None else self._lane_order()
        lease = self._seg.lease()
        deadline = time.monotonic() + _timeout("timeout", timeout)
        while True:
            for k in candidates:
                if lease.try_lock(L.lock_lane(k)):
                    w = Writer(self, k, lease, insert_timeout)
                    self._writers.add(w)
                    return w
            if time.monotonic() >= deadline:
                lease.close()
                busy = ", ".join(
                    f"{k} (pid {self._q[self._layout.lane_word(k, L.LANE_WRITER_PID) // 8]})"
                    for k in candidates
                )
                raise LaneBusyError(
                    f"no free lane after {timeout}s: lane(s) {busy} have live writers. Fix: close "
                    f"a writer, or create the buffer with more lanes (it has {self.lanes})"
                )
            time.sleep(0.01)

    def _lane_order(self) -> list[int]:
        # Start the scan at a pid-dependent lane so that concurrent actors rarely collide.
        start = os.getpid() % self.lanes
        return [(start + k) % self.lanes for k in range(self.lanes)]

    def writer_alive(self, lane: int) -> bool:
        """True while some process holds ``lane``'s writer lease."""
        self._check_open()
        return self._seg.probe(L.lock_lane(self._lane_index(lane)))

    # -- reading -------------------------------------------------------------------------------------
    def _gather(
        self, lanes: np.ndarray | None, indices: np.ndarray, out: Mapping[str, np.ndarray]
    ) -> np.ndarray:
        """Copy rows into ``out``; return which rows passed the seqlock check.

        A row is good if its stamp said "holds index i" both before and after the copy.
        """
        C = self.capacity
        slots = indices % C
        if lanes is not None and self.lanes > 1:
            slots += lanes * C
        expected = indices * 2
        expected += 2
        stamps = self._stamps
        before = stamps.take(slots)
        cols = self._cols
        for name, dst in out.items():
            np.take(cols[name], slots, axis=0, out=dst, mode="clip")
        after = stamps.take(slots)
        ok = before == expected
        ok &= after == expected
        return ok

    def _draw_uniform_one_lane(self, batch: int, rng: np.random.Generator) -> Draw:
        """``draw_uniform`` for a one-lane buffer without the per-lane array arithmetic (the
        same draw, about 10 us cheaper: it matters for small rows)."""
        q = self._q
        reserved = q[self._lane0_reserved]  # claim first, then committed (see windows())
        hi = q[self._lane0_committed]
        lo = min(max(max(reserved, hi) - self.capacity, 0), hi)
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
        sampler: Any = draw_uniform,
        max_retries: int = MAX_RETRIES,
    ) -> Draw:
        """Draw a batch into preallocated arrays (``out[field]`` of shape ``[B, *shape]``).

        Only the fields named in ``out`` are gathered. Rows whose stamp changed under the copy
        are redrawn (bounded by ``max_retries`` rounds). Returns the (lanes, indices) delivered.

        Raises:
            EmptyBufferError: nothing to sample.
            SamplingError: rows kept being overwritten while read (capacity too small for the
                write rate).
        """
        self._check_open()
        if not out:
            raise ValueError("sample_into() needs at least one output array")
        batch = next(iter(out.values())).shape[0]
        rng = _as_rng(rng, self._default_rng)
        if sampler is draw_uniform and self.lanes == 1:
            draw = self._draw_uniform_one_lane(batch, rng)
        else:
            draw = sampler(self.windows(), batch, rng)
        ok = self._gather(draw.lanes, draw.indices, out)
        if ok.all():
            return draw
        lanes, indices = draw.lanes.copy(), draw.indices.copy()
        for _ in range(max_retries):
            bad = np.flatnonzero(~ok)
            redraw = sampler(self.windows(), bad.size, rng)
            tmp = {k: np.empty((bad.size, *v.shape[1:]), v.dtype) for k, v in out.items()}
            ok_bad = self._gather(redraw.lanes, redraw.indices, tmp)
            for k, v in out.items():
                v[bad] = tmp[k]
            lanes[bad], indices[bad], ok[bad] = redraw.lanes, redraw.indices, ok_bad
            if ok.all():
                return Draw(lanes, indices)
        raise SamplingError(
            f"{int((~ok).sum())} of {batch} rows were overwritten while being read, "
            f"{max_retries} times in a row: writers lap the readers. Fix: a larger capacity "
            f"(now {self.capacity} per lane) or slower writers"
        )

    def sample(
        self,
        batch_size: int,
        rng: RngLike = None,
        *,
        fields: list[str] | None = None,
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

        Returns:
            field name -> array of shape ``[batch_size, *shape]``, every row checked whole.
        """
        self._check_open()
        batch_size = _positive_int("batch_size", batch_size)
        names = list(self._spec) if fields is None else self._check_fields(fields)
        out = {n: self._output_array(n, batch_size) for n in names}
        self.sample_into(out, rng)
        return out

    def _output_array(self, name: str, rows: int) -> np.ndarray:
        """An array nobody else references: a recycled one if one is free, else a new one."""
        field = self._spec[name]
        shape = (rows, *field.shape)
        if rows * field.row_nbytes < RECYCLE_MIN_BYTES:
            return np.empty(shape, field.dtype)
        free_list = self._recycled.setdefault((name, rows), [])
        for arr in free_list:
            # References: the free list, this loop's variable, getrefcount's argument. Any
            # more (the caller's dict or variable, a view, a tensor) and it is still in use.
            if sys.getrefcount(arr) == 3:
                return arr
        arr = np.empty(shape, field.dtype)
        if len(free_list) < RECYCLE_KEEP:
            free_list.append(arr)
        return arr

    def _check_fields(self, fields: list[str]) -> list[str]:
        unknown = [f for f in fields if f not in self._spec]
        if unknown:
            raise SpecMismatchError(
                f"unknown field(s) {unknown}; the spec has {', '.join(self._spec)}"
            )
        return list(fields)

    def get(self, indices: Any, lanes: Any = 0) -> dict[str, np.ndarray]:
        """Read transitions by logical index (as in ``Batch.indices``) of ``lanes``.

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
        if held.all():
            held = self._gather(ln, idx, out)
        if not held.all():
            b = int(np.flatnonzero(~held)[0])
            k = int(ln[b])
            raise StaleIndexError(
                f"index {int(idx[b])} of lane {k} is not held: the lane holds "
                f"[{int(win.lo[k])}, {int(win.hi[k])}) now"
            )
        return out

    def column(self, name: str) -> np.ndarray:
        """A read-only view of a field's whole column, ``[lanes * capacity, *shape]``.

        Zero-copy and unchecked: rows may be mid-write. Delete the view before ``close()``.
        """
        self._check_open()
        self._check_fields([name])
        view = self._cols[name][:]
        view.flags.writeable = False
        return view

    # -- stats -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """A snapshot: per-lane counters and writer liveness, totals and insert rate."""
        self._check_open()
        hdr = self._seg.header
        win = self.windows()
        now = time.time()
        q, lay = self._q, self._layout
        per_lane = []
        for k in range(self.lanes):
            hb = q[lay.lane_word(k, L.LANE_HEARTBEAT) // 8]
            per_lane.append(
                {
                    "lane": k,
                    "committed": int(win.hi[k]),
                    "size": int(win.hi[k] - win.lo[k]),
                    "writer_alive": self._seg.probe(L.lock_lane(k))
                    or any(w.lane == k and not w.closed for w in self._writers),
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

        save(self, path, overwrite=overwrite, progress=progress)

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

        return load(cls, path, name=name, capacity=capacity, progress=progress)

    def state_dict(self) -> dict[str, Any]:
        """The buffer's contents as plain Python/NumPy objects, for training checkpoints."""
        from .persist import state_dict

        return state_dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this buffer's contents with ``state``; needs every lane free of writers.

        Raises:
            SpecMismatchError: the state's spec or lanes differ from this buffer's.
            LaneBusyError: a lane has a live writer.
        """
        from .persist import load_state_dict

        load_state_dict(self, state)

    def _lock_all_lanes(self, timeout: float = 0.0) -> Lease:
        """Take every lane's writer lease (for restores); raises LaneBusyError if one is busy."""
        lease = self._seg.lease()
        for k in range(self.lanes):
            if not lease.try_lock(L.lock_lane(k)):
                lease.close()
                raise LaneBusyError(
                    f"lane {k} has a live writer (pid "
                    f"{self._q[self._layout.lane_word(k, L.LANE_WRITER_PID) // 8]}); close every "
                    f"writer before restoring the buffer"
                )
        return lease

    def _restore_lane(self, lane: int, first: int, rows: Mapping[str, np.ndarray],
                      meta: np.ndarray, episode: int, episode_start: int,
                      on_copied: Callable[[int], None] | None = None) -> None:
        """Write rows ``first .. first+n`` of ``lane`` (caller holds the lane's lease).

        ``on_copied(nbytes)``, if given, is called after each column copy (progress display).
        """
        C = self.capacity
        n = int(meta.shape[0])
        q, lay = self._q, self._layout
        end = first + n
        base = lane * C
        self._stamps[base : base + C] = 0  # nothing held while we rewrite
        q[lay.lane_word(lane, L.LANE_COMMITTED) // 8] = end
        q[lay.lane_word(lane, L.LANE_RESERVED) // 8] = end + C  # window empty during the copy
        for a, b, off in _ring_segments(first, n, C):
            for name, src in rows.items():
                dst = self._cols[name][base + a : base + b]
                dst[...] = src[off : off + (b - a)]
                if on_copied is not None:
                    on_copied(dst.nbytes)
            self._meta[base + a : base + b] = meta[off : off + (b - a)]
            self._stamps[base + a : base + b] = 2 * (first + off + np.arange(b - a)) + 2
        q[lay.lane_word(lane, L.LANE_EPISODE) // 8] = episode
        q[lay.lane_word(lane, L.LANE_EPISODE_START) // 8] = episode_start
        # The window must start at ``first``: with n < C, ``end - C`` would offer older indices
        # whose slots hold nothing. A writer that takes the lane over fills those slots first.
        q[lay.lane_word(lane, L.LANE_RESERVED) // 8] = max(end, first + C)

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
            self._drop_views()
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


class Writer:
    """Appends transitions to one lane. Get one with ``ReplayBuffer.writer()``.

    Concurrency: this writer is the only process storing its lane's words, slots and rows. For
    index i in slot s it stores ``reserved``, ``stamp[s] = 2i+1``, the row, ``stamp[s] = 2i+2``
    and then ``committed = i+1``; readers never wait for it and it never waits for them (only,
    optionally, for the rate limiter). A writer belongs to the process that opened it: a forked
    child's copy is closed.

    Example:
        >>> with buf.writer() as w:
        ...     w.add(obs=o, action=a, reward=r)
        ...     w.extend({"obs": obs_batch, "action": act_batch, "reward": rew_batch})
        ...     w.end_episode()
    """

    _live: weakref.WeakSet[Writer] = weakref.WeakSet()

    def __init__(self, buf: ReplayBuffer, lane: int, lease: Lease, insert_timeout: float) -> None:
        self._buf = buf
        self.lane = lane
        self._lease = lease
        self.timeout = _timeout("insert_timeout", insert_timeout)
        self._closed_reason: str | None = None
        lay, q = buf._layout, buf._q
        C = lay.capacity
        self._C = C
        self._q = q
        w = lambda word: lay.lane_word(lane, word) // 8  # noqa: E731
        self._w_committed, self._w_reserved = w(L.LANE_COMMITTED), w(L.LANE_RESERVED)
        self._w_episode, self._w_episode_start = w(L.LANE_EPISODE), w(L.LANE_EPISODE_START)
        self._w_heartbeat = w(L.LANE_HEARTBEAT)
        self._stamp0 = lay.stamp(lane * C) // 8
        self._meta0 = (lay.meta.offset // 8) + lane * C
        base = lane * C
        self._cols = [buf._cols[name][base : base + C] for name in buf._spec]
        self._stamps = buf._stamps[base : base + C]
        self._meta = buf._meta[base : base + C]
        if buf._checker is None:
            buf._checker = RowChecker(buf._spec)
        self._check_row = buf._checker.check_row
        self._check_batch = buf._checker.check_batch
        self._limiter = buf._limiter
        self._ramp = self._ramp2 = np.arange(0, dtype=np.int64)
        self._k0 = np.zeros((), np.int64)  # 0-d operands: ufuncs take them faster than ints
        self._one = np.ones((), np.int64)

        # Take the lane over from whoever had it (nobody, a closed writer or a dead one).
        committed, reserved = q[self._w_committed], q[self._w_reserved]
        if reserved > committed + C:
            # The last writer died inside an extend() of more rows than the lane holds: every
            # slot was being rewritten, so nothing below `committed` survives, but the rows we
            # write from `committed` on are whole. Readers' window then starts at `committed`
            # instead of staying empty until we pass the dead writer's claim.
            reserved = committed + C
            q[self._w_reserved] = reserved
        self._next = committed
        self._reserved = max(reserved, committed)
        q[w(L.LANE_EPOCH)] = q[w(L.LANE_EPOCH)] + 1
        q[w(L.LANE_WRITER_PID)] = os.getpid()
        episode, start = q[self._w_episode], q[self._w_episode_start]
        if committed > start:  # the previous writer left an episode open: start a new one
            episode += 1
            start = committed
            q[self._w_episode_start] = start
            q[self._w_episode] = episode
        self.episode = episode
        self._step = committed - start
        self._episode_bits = episode << L.STEP_BITS
        self._room_until = self._next  # check the rate limiter on the first insert
        Writer._live.add(self)

    # -- state -----------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    @property
    def committed(self) -> int:
        """Transitions this lane has published (the next add gets this logical index)."""
        return self._next

    @property
    def step(self) -> int:
        """Steps in the current episode so far."""
        return self._step

    def _raise_closed(self) -> None:
        raise ClosedError(f"writer of lane {self.lane} is closed ({self._closed_reason})")

    # -- hot path ----------------------------------------------------------------------------------------
    def add(self, **fields: Any) -> int:
        """Append one transition; returns its logical index in the lane.

        Every field of the spec must be given. The whole transition is validated before
        anything is written; a bad one raises ``SpecMismatchError`` and changes nothing.
        May wait up to ``self.timeout`` seconds on the rate limiter (``RateLimitTimeout``).
        """
        if self._closed_reason is not None:
            self._raise_closed()
        values = self._check_row(fields)
        i = self._next
        if i >= self._room_until:
            self._make_room(1, self.timeout)
        s = i % self._C
        q = self._q
        if i >= self._reserved:
            self._reserved = i + 1
            q[self._w_reserved] = i + 1
        stamp = self._stamp0 + s
        q[stamp] = 2 * i + 1
        for col, v in zip(self._cols, values):
            col[s] = v
        q[self._meta0 + s] = self._episode_bits | self._step
        q[stamp] = 2 * i + 2
        q[self._w_committed] = i + 1
        self._next = i + 1
        self._step += 1
        return i

    def extend(self, data: Mapping[str, Any], timeout: float | None = None) -> range:
        """Append a batch: ``data[field]`` has shape ``[n, *shape]``, the same n for every field.

        Rows are published together (one ``committed`` store). If n exceeds the lane's capacity,
        only the last ``capacity`` rows are kept, as a ring would; logical indices still advance
        by n. Validated whole first: a bad batch raises and changes nothing. May wait on the rate
        limiter up to ``timeout`` (default ``self.timeout``).

        Returns:
            the logical indices given to the rows.
        """
        if self._closed_reason is not None:
            self._raise_closed()
        n, arrays = self._check_batch(data)
        i0 = self._next
        if n == 0:
            return range(i0, i0)
        if i0 + n > self._room_until:
            self._make_room(n, self.timeout if timeout is None else _timeout("timeout", timeout))
        C = self._C
        keep = min(n, C)
        skip = n - keep
        first = i0 + skip
        end = i0 + n
        q = self._q
        if end > self._reserved:
            self._reserved = end
            q[self._w_reserved] = end
        if self._ramp.shape[0] < keep:
            self._grow_ramp(keep)
        ramp, ramp2, k0, one = self._ramp, self._ramp2, self._k0, self._one
        add = np.add
        stamps, meta = self._stamps, self._meta
        segments = _ring_segments(first, keep, C)
        for a, b, off in segments:  # odd: rows first+off .. being written
            k0[()] = 2 * (first + off) + 1
            add(ramp2[: b - a], k0, stamps[a:b])
        for col, arr in zip(self._cols, arrays):
            if skip == 0 and len(segments) == 1:
                col[segments[0][0] : segments[0][1]] = arr
            else:
                for a, b, off in segments:
                    col[a:b] = arr[skip + off : skip + off + (b - a)]
        for a, b, off in segments:
            k0[()] = self._episode_bits | (self._step + skip + off)
            add(ramp[: b - a], k0, meta[a:b])
            view = stamps[a:b]
            add(view, one, view)  # odd 2i+1 -> even 2i+2: the segment's rows are held
        q[self._w_committed] = end
        self._next = end
        self._step += n
        return range(i0, end)

    def _grow_ramp(self, n: int) -> None:
        size = min(max(n, 2 * self._ramp.shape[0], 1024), self._C)
        self._ramp = np.arange(size, dtype=np.int64)
        self._ramp2 = self._ramp * 2

    def end_episode(self) -> int:
        """Close the current episode; the next transition starts a new one. Returns its id."""
        if self._closed_reason is not None:
            self._raise_closed()
        ended = self.episode
        self.episode += 1
        self._episode_bits = self.episode << L.STEP_BITS
        self._step = 0
        q = self._q
        q[self._w_episode_start] = self._next
        q[self._w_episode] = self.episode
        return ended

    # -- rate limiting -------------------------------------------------------------------------------------
    def _make_room(self, n: int, timeout: float) -> None:
        """Wait until ``n`` more rows may be inserted; refresh the heartbeat."""
        q = self._q
        q[self._w_heartbeat] = time.time_ns()
        lim = self._limiter
        deadline = time.monotonic() + timeout
        pause = 5e-5
        while True:
            _, limit, base, n_samplers = lim.read()
            if limit is None:
                self._room_until = self._next + max(4 * n, ROOM_CHECK_EVERY)
                return
            inserts = lim.total_committed() - base
            samples = lim.samples(n_samplers)
            allowed = limit.inserts_allowed(inserts, samples)
            if allowed >= n:
                share = max(n, min(allowed // self._buf.lanes, ROOM_CHECK_EVERY))
                self._room_until = self._next + share
                return
            if inserts + n > limit.min_size and n > limit.max_insert_chunk():
                raise ValueError(
                    f"extend() of {n} rows can never pass the rate limiter: with "
                    f"samples_per_insert={limit.samples_per_insert} and tolerance "
                    f"{limit.tolerance}, at most {limit.max_insert_chunk()} rows fit at once. "
                    f"Fix: split the batch, or raise the tolerance"
                )
            if not self._buf._seg.probe(L.LOCK_LIMITER):
                # The pool that set the limit died without lifting it: nobody samples any more.
                self._room_until = self._next + n
                return
            if self._closed_reason is not None:
                self._raise_closed()
            now = time.monotonic()
            if now >= deadline:
                raise RateLimitTimeout(
                    f"lane {self.lane}: waited {timeout}s for the rate limiter to allow {n} "
                    f"insert(s) (inserts {inserts}, samples {samples}, samples_per_insert "
                    f"{limit.samples_per_insert}); the samplers are not keeping up. Nothing was "
                    f"written. Fix: a larger timeout, more sampling, or a larger tolerance"
                )
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 2e-3)

    # -- teardown ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the lane (idempotent). The lane's rows stay; another writer may take it."""
        if self._closed_reason is None:
            self._closed_reason = "closed"
            if self._lease.pid == os.getpid():
                self._q[self._w_heartbeat] = time.time_ns()
        self._release()

    def _release(self) -> None:
        self._cols = []
        self._stamps = self._meta = None  # type: ignore[assignment]
        self._lease.close()
        Writer._live.discard(self)

    @classmethod
    def _after_fork_in_child(cls) -> None:
        for w in list(cls._live):
            w._closed_reason = "inherited by a forked child; open a writer in the child instead"
            w._cols = []
        cls._live = weakref.WeakSet()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"next={self._next}"
        return f"<Writer lane={self.lane} {state}>"


os.register_at_fork(after_in_child=Writer._after_fork_in_child)


# -- helpers ------------------------------------------------------------------------------------------------
def _field_tuples(spec: Spec) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    return [(f.name, f.shape, f.dtype) for f in spec.values()]


def _ring_segments(first: int, n: int, C: int) -> list[tuple[int, int, int]]:
    """Contiguous slot ranges [a, b) for logical indices [first, first+n), n <= C, with the
    offset of each range's first row within the n."""
    s0 = first % C
    if s0 + n <= C:
        return [(s0, s0 + n, 0)]
    head = C - s0
    return [(s0, C, 0), (0, n - head, head)]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _timeout(name: str, value: Any) -> float:
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if math.isnan(t) or t < 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
    return t


__all__ = ["ReplayBuffer", "Writer", "RateLimit"]
