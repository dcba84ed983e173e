"""``ReplayBuffer``: the user's façade over a ``BufferStorage`` (``storage.py``).

Writers (``writer.py``, ``vector.py``) append to their own lane under ``slots.py``'s protocol;
any process samples with seqlock-checked reads (``batches.py``), never waiting on a writer or
delivering a torn row. Every method is the façade's own and delegates in a line or two: reads to
its ``BatchReader`` (``batches.py``), episode records to the storage's ``EpisodeTable``
(``episodes.py``), imitation's ``from_data``/``store`` checks to ``imitation.py``, ``clear`` to
the storage (``storage.clear_lanes``), checkpoints to ``persist/``.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Self, cast, overload

import numpy as np

from . import imitation
from . import layout as L
from .batches import MAX_RETRIES, BatchReader, RngLike, Sampler
from .checks import positive_int, timeout_seconds
from .errors import ClosedError
from .limiter import RateLimit
from .sampling import Draw, Windows, draw_uniform
from .sampling.plan import Compiled, Plan
from .spec import Spec
from .stats import buffer_stats, transitions
from .storage import BufferStorage
from .vector import VectorWriter
from .writer import Writer

DEFAULT_INSERT_TIMEOUT = 60.0


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
               episode_capacity: int | None = None,
               actor_priorities: bool = False) -> ReplayBuffer:
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
            actor_priorities: keep a priority per row that writers give with it
                (``extend(rows, priorities=ps)``, ``add_prioritized(p, **fields)``; Ape-X), which
                a prioritized pool enters in place of the maximum priority. 16 bytes per row.

        Raises:
            CapacityError: /dev/shm has too little room (the message says how to give it more).
            SegmentExistsError: ``name`` is taken.
        """
        return cls(BufferStorage.create(spec, capacity, lanes, name, next_obs, episode_spec,
                                        episode_capacity, actor_priorities))

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
    def actor_priorities(self) -> bool:
        """Whether writers may give a priority with each row (``create(actor_priorities=)``)."""
        return bool(self._layout.priority_columns)

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
        """Rows ever published to ``lane`` (or to each lane): the lane's next logical index.
        With ``next_obs="derived"`` this counts the final-observation row each episode ends
        with too (an index, not a transition count: ``len(buf)`` counts transitions only)."""
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

    # -- reading ---------------------------------------------------------------------------------------
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
                ``sequence_length``, ``stride``, ``cross_episodes``, ``frame_stack``,
                ``frame_lookahead``, ``stack_fields``, ``n_step``, ``gamma`` (and the field
                names they use).

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

    # -- rows the caller chose (epochs): loads only, checked as sample_into's reads are -------------
    def anchors(self, plan: Compiled | None = None, *, among: Draw | None = None) -> Draw:
        """Where a batch row of ``plan`` may start now, each once: every readable transition,
        or with a compiled plan every start ``sample_into(plan=)`` may draw (windows that fit
        the plan's episode rules, stacks that can be rebuilt...), lanes in order and indices
        ascending. With ``among``: those of its anchors that still may. For epochs."""
        self._check_open()
        return self._batches.anchors(plan, among)

    def gather_at(self, out: Mapping[str, np.ndarray], lanes: np.ndarray, indices: np.ndarray,
                  *, plan: Compiled | None = None) -> bool:
        """Read the batch whose rows start at ``(lanes, indices)`` (``anchors``, or the indices
        ``sample_into`` returned: a sequence's ``[B, T]`` too) into ``out``, as ``sample_into``
        would have. Returns False if a row can no longer be read whole (overwritten, or no
        longer a valid start): ``out`` is then partly written and should be discarded."""
        self._check_open()
        return self._batches.gather_at(out, lanes, indices, plan)

    # -- episode records (``EpisodeTable``): loads only; a record is copied between two loads of
    # its stamp, so one being written, overwritten or cleared is never returned ----------------------
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
        return self._storage.episode_table().get(episode_id, self._storage.lane_index(lane))

    def episodes(self, lane: int | None = None) -> dict[str, np.ndarray]:
        """Every episode record held now (one lane, or all), as arrays ordered by lane, id."""
        self._check_open()
        lane = None if lane is None else self._storage.lane_index(lane)
        return self._storage.episode_table().held(lane)

    # -- imitation's Buffer: ``store`` writes through one Writer of lane 0 that the buffer keeps
    # until ``clear`` or ``close``; ``clear`` empties the lanes under LOCK_CLEAR ----------------------
    @classmethod
    def from_data(cls, data: Mapping[str, Any], capacity: int | None = None,
                  truncate_ok: bool = False, **create_kwargs: Any) -> Self:
        """A new one-lane buffer holding ``data`` (field -> ``[n, ...]``), dtypes and shapes
        inferred. ``capacity`` defaults to n (full); with fewer slots than rows, only the last
        ``capacity`` rows are kept if ``truncate_ok``, else ``ValueError``.

        Raises:
            ValueError: ``data`` is empty, its arrays differ in length, or it does not fit.
        """
        arrays, spec, capacity = imitation.checked_data(data, capacity, truncate_ok)
        buf = cast(Self, cls.create(spec, capacity, lanes=1, **create_kwargs))
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
        imitation.check_fits(data, self.capacity, truncate_ok)
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

        Works while writers (of any handle or process) are open: their lanes are emptied up to
        the ``committed`` read during the call (their floor); rows they publish from then on,
        an add that overlaps the call included, count as written after it. Once it returns,
        ``len()``, ``sample()`` and checkpoints see none of the older rows, nor episodes that
        began before it. A pool's batches gathered before it returned may still hold them.

        Raises:
            LaneBusyError: another ``clear()`` or a restore kept going for ``timeout`` s.
        """
        self._check_open()
        timeout = timeout_seconds("timeout", timeout)
        if self._store_writer is not None:
            self._store_writer.close()
            self._store_writer = None
        self._storage.clear(timeout)

    reset = clear

    # -- checkpoints (``persist``): ``save`` and ``state_dict`` read with seqlock checks while
    # writers run; ``load_state_dict`` holds every lane's writer lease while it rewrites ------------
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
    ) -> Self:
        """Create a new buffer (this process owns it) from a directory written by ``save``.

        Logical indices, episode counters and actor priorities (``actor_priorities=True``
        buffers: the new one has them too) are preserved. ``capacity`` may differ from the
        saved one; a smaller one keeps each lane's newest rows.

        Raises:
            CheckpointError: the directory is incomplete, truncated or inconsistent.
        """
        from .persist import load

        buf: Self = load(cls.create, path, name=name, capacity=capacity, progress=progress)
        return buf

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
