"""``ReplayBuffer``: the user's façade over a ``BufferStorage`` (``storage.py``).

Writers (``writer.py``, ``vector.py``) append to their own lane under ``slots.py``'s protocol;
any process samples with seqlock-checked reads (``batches.py``), never waiting on a writer or
delivering a torn row. Three surfaces are mixed in: episode records (``records.py``), imitation's
``from_data``/``store``/``clear`` (``fill.py``) and checkpoints (``checkpoint.py``).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, overload

import numpy as np

from . import layout as L
from .batches import MAX_RETRIES, AnchorSurface, BatchReader, RngLike, Sampler
from .checkpoint import CheckpointSurface
from .checks import positive_int, timeout_seconds
from .errors import ClosedError
from .fill import ImitationSurface
from .limiter import RateLimit
from .records import EpisodeSurface
from .sampling import Draw, Windows, draw_uniform
from .sampling.plan import Compiled, Plan
from .spec import Spec
from .stats import buffer_stats, transitions
from .storage import BufferStorage
from .vector import VectorWriter
from .writer import Writer

DEFAULT_INSERT_TIMEOUT = 60.0


class ReplayBuffer(EpisodeSurface, ImitationSurface, CheckpointSurface, AnchorSurface):
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
        self._batches = BatchReader(storage)
        self._closed = False
        self._writers: weakref.WeakSet[Writer | VectorWriter] = weakref.WeakSet()
        self._store_writer: Writer | None = None

    @property
    def storage(self) -> BufferStorage:
        """The segment and its named views (internal, for writers, readers and ``workers``)."""
        return self._storage

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def create(cls, spec: Spec | Mapping[str, Any], capacity: int, lanes: int = 1,
               name: str | None = None, *, next_obs: str = "stored",
               episode_spec: Spec | Mapping[str, Any] | None = None,
               episode_capacity: int | None = None) -> ReplayBuffer:
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
        """Transitions readable now, over all lanes; never internal rows (the final-observation
        row each episode keeps with ``next_obs="derived"`` is not counted)."""
        self._check_open()
        return transitions(self._storage)

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

    @overload
    def committed(self, lane: int) -> int: ...
    @overload
    def committed(self, lane: None = None) -> np.ndarray: ...

    def committed(self, lane: int | None = None) -> int | np.ndarray:
        """Transitions ever published to ``lane`` (or to each lane)."""
        self._check_open()
        if lane is None:
            return self._storage.committed.copy()
        return int(self._storage.committed[self._storage.lane_index(lane)])

    def writer(self, lane: int | None = None, timeout: float = 5.0,
               insert_timeout: float = DEFAULT_INSERT_TIMEOUT, *, num_envs: int | None = None,
               lanes: list[int] | None = None) -> Any:
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
        w: Writer | VectorWriter = (
            VectorWriter.open(self._storage, num_envs, lanes, wait, insert_timeout)
            if num_envs is not None or lanes is not None
            else Writer.open(self._storage, lane, wait, insert_timeout))
        self._writers.add(w)  # closed with the buffer
        return w

    def writer_alive(self, lane: int) -> bool:
        """True while some process holds ``lane``'s writer lease."""
        self._check_open()
        return self._seg.probe(L.lock_lane(self._storage.lane_index(lane)))

    # -- reading (and EpisodeSurface: episode records) -----------------------------------------------
    def sample_into(self, out: Mapping[str, np.ndarray], rng: RngLike = None, *,
                    plan: Compiled | None = None, sampler: Sampler = draw_uniform,
                    max_retries: int = MAX_RETRIES) -> Draw:
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
        return self._batches.sample_into(out, rng, plan, sampler, max_retries)

    def compile(self, plan: Plan | None = None, fields: list[str] | None = None,
                **plan_kwargs: Any) -> Compiled:
        """Check a sampling plan (or ``Plan(**plan_kwargs)``) against this buffer; the result
        names the arrays a batch holds (``.outputs``) and is what ``sample_into(plan=)`` takes."""
        return self._batches.compile(plan, fields, **plan_kwargs)

    def sample(self, batch_size: int, rng: RngLike = None, *, fields: list[str] | None = None,
               **plan: Any) -> dict[str, np.ndarray]:
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
        return self._batches.sample(positive_int("batch_size", batch_size), rng, fields, plan)

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
        return self._batches.get(indices, lanes, with_episode)

    def column(self, name: str) -> np.ndarray:
        """A read-only view of a field's whole column, ``[lanes * capacity, *shape]``.

        Zero-copy and unchecked: rows may be mid-write. Delete the view before ``close()``.
        """
        self._check_open()
        self._batches.check_fields([name])
        view = self._storage.columns[name][:]
        view.flags.writeable = False
        return view

    def stats(self) -> dict[str, Any]:
        """A snapshot: per-lane counters and writer liveness, totals and insert rate."""
        self._check_open()
        return buffer_stats(self._storage)

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
            self._batches.close()
            self._storage.drop_views()
        self._seg.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except Exception as e:
            if exc_type is None:
                raise
            # do not mask the exception already in flight
            warnings.warn(f"while closing {self.name!r}: {e}", RuntimeWarning, stacklevel=2)

    def __del__(self) -> None:
        # Last resort only: an owner dropped without close() still unlinks its name.
        seg = getattr(self, "_seg", None)
        if seg is not None and seg.owner and seg.pid == os.getpid():
            seg.unlink()


__all__ = ["ReplayBuffer", "Writer", "RateLimit"]
