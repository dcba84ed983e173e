"""``VectorWriter``: one writer for ``num_envs`` lanes at once (a vectorized environment).

Each ``add`` takes arrays with a leading ``num_envs`` axis and writes row e to lane ``lanes[e]``,
the equivalent of a group of per-env buffers in one shared-memory buffer. Writes are vectorised
across lanes: each protocol step (claims, odd stamps, rows, meta, even stamps, ``committed``) is
one NumPy store over all lanes, in the same order a single-lane ``Writer`` uses.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from . import layout as L
from .checks import positive_int
from .errors import SpecMismatchError
from .rowcheck import RowChecker
from .spec import Spec
from .store import LanesStore, add_method, compiled_for, forget_priorities, lanes_store
from .writer import LaneWriter, Writer, checked_priorities

if TYPE_CHECKING:
    from .storage import BufferStorage


class VectorWriter(LaneWriter):
    """Writes one transition per environment per ``add`` into ``num_envs`` lanes.

    Get one with ``buffer.writer(num_envs=N)``. Concurrency as ``LaneWriter``: it holds every
    one of its lanes' writer leases (through the ``Writer`` of each), so it is the only process
    storing to them. A forked child's copy is closed (its ``add`` raises ``ClosedError``).

    Example:
        >>> with buf.writer(num_envs=8) as w:
        ...     w.add(obs=obs, action=actions, reward=rewards)   # each [8, ...]
        ...     w.add_prioritized(td_errors, obs=obs, action=actions, reward=rewards)  # [8]
        ...     w.end_episode(terminated | truncated, truncated=truncated)
    """

    _kind = "vector writer"

    def __init__(self, storage: BufferStorage, writers: list[Writer]) -> None:
        lanes = [w.lane for w in writers]
        super().__init__(storage, lanes, writers[0].timeout, f"lanes {lanes}")
        self._writers = writers  # holding the leases; their own state is not used any more
        self.lanes = self._lane_ids
        self.num_envs = self._width
        self._room_until, self._lim_gen = 0, -1  # check the rate limiter on the first insert
        self._take_lane_state(storage, writers)
        self._rows = 0  # rows written (all lanes): what room is measured in
        self._episode_checker = (
            RowChecker(storage.episode_spec, batch_op="end_episode")
            if storage.episode_spec is not None
            else None
        )

    def _take_lane_state(self, storage: BufferStorage, writers: list[Writer]) -> None:
        """Each lane's next index, episode and step, from the writer that took it over, and
        the store of a row in each lane."""
        self._store = lanes_store(storage, self.lanes, [w._store for w in writers])
        self._next = np.array([w._next for w in writers], np.int64)
        self.episode = np.array([w.episode for w in writers], np.int64)
        self._step = np.array([w._step for w in writers], np.int64)

    @classmethod
    def open(cls, storage: BufferStorage, num_envs: int | None, lanes: list[int] | None,
             timeout: float, insert_timeout: float) -> VectorWriter:
        """A vector writer of ``lanes``, or of ``num_envs`` free lanes, each taken within
        ``timeout`` s (``Writer.open``); every lane taken is released again if one fails."""
        if lanes is None:
            num_envs = positive_int("num_envs", num_envs)
            if num_envs > storage.lanes:
                raise ValueError(
                    f"num_envs={num_envs} needs as many lanes, the buffer has {storage.lanes}. "
                    f"Fix: create it with lanes >= num_envs"
                )
            wanted: list[int | None] = [None] * num_envs  # any free lanes
        else:
            lanes = [storage.lane_index(k) for k in lanes]
            if not lanes or len(set(lanes)) != len(lanes):
                raise ValueError(
                    f"lanes must list distinct lanes, at least one, got {lanes!r}: each env "
                    f"writes its own lane"
                )
            if num_envs is not None and num_envs != len(lanes):
                raise ValueError(f"num_envs={num_envs} but {len(lanes)} lanes were given")
            wanted = list(lanes)
        writers: list[Writer] = []
        try:
            for k in wanted:
                writers.append(Writer.open(storage, k, timeout, insert_timeout))
            if lanes is None:
                writers.sort(key=lambda w: w.lane)
            return (one_env_class(storage.input_checker())
                    if len(writers) == 1 and cls is VectorWriter else cls)(storage, writers)
        except BaseException:  # every lane taken so far is released before this propagates
            for w in writers:
                w.close()
            raise

    @property
    def committed(self) -> np.ndarray:
        return self._next.copy()

    def _room_position(self) -> int:
        return self._rows

    # -- writing ---------------------------------------------------------------------------------
    def add(self, /, **fields: Any) -> np.ndarray:
        """Append one transition per env (every field ``[num_envs, ...]``); returns the logical
        index each got in its lane. Validated whole before anything is written."""
        return self._put_rows(self._env_rows_of(fields, "add()"), None)

    def add_prioritized(self, priorities: Any, /, **fields: Any) -> np.ndarray:
        """``add`` with each env's row priority (``[num_envs]`` floats; an
        ``actor_priorities`` buffer), published with the rows: a prioritized pool enters them
        at it instead of at its maximum priority (Ape-X). Positional first, so a field may be
        called ``priority``. NaN, infinite or negative priorities, or not one per env, raise
        ``InvalidPriorityError`` and nothing is written."""
        arrays = self._env_rows_of(fields, "add_prioritized()")
        p = checked_priorities(self._storage, priorities, self.num_envs, "add_prioritized()")
        return self._put_rows(arrays, p)

    def _env_rows_of(self, fields: dict[str, Any], what: str) -> Sequence[Any]:
        """``fields`` checked as one row per env (the writer open), else the typed error."""
        if self._closed_reason is not None:
            self._raise_closed()
        n, arrays = self._check_batch(fields)
        if n != self.num_envs:
            raise SpecMismatchError(
                f"{what}: fields have {n} rows but this writer has num_envs={self.num_envs}: "
                f"pass one row per environment"
            )
        return arrays

    def _put_rows(self, arrays: Sequence[Any], priorities: np.ndarray | None) -> np.ndarray:
        """Store one checked row per env (with its priority, unless None); their indices."""
        n = self.num_envs
        self._ensure_room(self._rows, n)
        index = self._next
        meta = (self.episode << L.STEP_BITS) | (self._step & L.STEP_MASK)
        if priorities is None:
            self._store.put(index, meta, arrays)
        else:
            if self._prioritized_store is None:
                self._prioritized_store = LanesStore(self._storage, self.lanes,
                                                     with_priorities=True)
            k = self._nstored  # (a derived buffer's next_obs follows: not stored)
            try:
                self._prioritized_store.put(
                    index, meta, [*arrays[:k], priorities, L.priority_row_tag(index)])
            except BaseException:
                forget_priorities(self._storage, self.lanes, index, index + 1)
                raise
        self._next = index + 1
        self._step += 1
        self._rows += n
        if self._derived:
            self._pending[...] = arrays[-1]
        return index

    def end_episode(self, env_mask: Any, truncated: Any = False, **episode_data: Any) -> np.ndarray:
        """End the episodes of the envs where ``env_mask`` is true.

        ``truncated`` and each episode-data value are per env (``[num_envs]``) or one value for
        all. Envs with no steps in their episode are skipped. Returns each env's ended episode
        id, -1 where nothing ended.
        """
        if self._closed_reason is not None:
            self._raise_closed()
        mask = self._per_env("env_mask", np.asarray(env_mask, bool), (self.num_envs,))
        mask = mask & (self._step > 0)
        trunc = self._per_env("truncated", np.asarray(truncated, bool), (self.num_envs,))
        values = self._episode_values(episode_data)
        ended = np.where(mask, self.episode, -1)
        if not mask.any():
            return ended
        envs = np.flatnonzero(mask)
        records = None if values is None else [[v[e] for v in values] for e in envs]
        self._next[envs] = self._finish_episodes(
            self.lanes[envs], self.episode[envs], self._step[envs], self._next[envs], trunc[envs],
            records, self._pending[envs] if self._derived else None)
        if self._derived:
            self._rows += envs.size  # their FINAL rows
        self.episode[envs] += 1
        self._step[envs] = 0
        return ended

    def _episode_values(self, data: Mapping[str, Any]) -> Sequence[np.ndarray] | None:
        if not data:
            return None
        checker, spec = self._episode_checker, self._storage.episode_spec
        if checker is None or spec is None:
            self._storage.refuse_episode_data(data)
        full = {n: np.zeros((self.num_envs, *f.shape), f.dtype) for n, f in spec.items()}
        for name, value in data.items():
            if name not in full:
                raise SpecMismatchError(
                    f"end_episode(): unknown episode field {name!r}; the episode spec has "
                    f"{', '.join(spec)}"
                )
            full[name] = self._per_env(name, np.asarray(value), full[name].shape)
        return checker.check_batch(
            {k: np.ascontiguousarray(v) for k, v in full.items()})[1]

    def _per_env(self, name: str, value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """``value`` broadcast to ``shape`` (``[num_envs, ...]``), or SpecMismatchError."""
        if value.shape == shape:  # (as given, mostly: broadcast_to takes microseconds)
            return value
        try:
            return np.broadcast_to(value, shape)
        except ValueError:
            raise SpecMismatchError(
                f"end_episode(): {name} has shape {value.shape}; expected one value per env "
                f"{shape} (num_envs={self.num_envs}) or one value for all envs"
            ) from None

    # -- teardown ---------------------------------------------------------------------------------------
    def _release_lanes(self) -> None:
        for w in self._writers:
            w.close()

    def __repr__(self) -> str:
        return f"<VectorWriter lanes={self.lanes.tolist()}{' closed' if self.closed else ''}>"


_first_row = itemgetter(0)
_ONE_INDEX = np.zeros(1, np.int64)
_ONE_INDEX.flags.writeable = False


class OneEnvVectorWriter(VectorWriter):
    """A ``VectorWriter`` of one env: its lane's ``Writer`` keeps the lane's state and store, and
    ``add`` (made per spec by ``one_env_class``) stores into that lane as ``Writer.add`` does,
    compiled where ``_add_c`` was built.

    Concurrency: as ``VectorWriter``; the lane's ``Writer`` holds the lease and is closed with it.
    """

    _env_rows: RowChecker  # the spec with shapes [1, *shape]: its fast path (one_env_class)

    def _take_lane_state(self, storage: BufferStorage, writers: list[Writer]) -> None:
        self._lane = writers[0]  # keeps it: see the properties below
        self._store = self._lane._store  # the compiled add finds it here

    @property
    def _next(self) -> np.ndarray:  # type: ignore[override]
        return np.array([self._lane._next], np.int64)

    @property
    def episode(self) -> np.ndarray:  # type: ignore[override]
        return np.array([self._lane.episode], np.int64)

    @property
    def _step(self) -> np.ndarray:  # type: ignore[override]
        return np.array([self._lane._step], np.int64)

    def add(self, /, **fields: Any) -> np.ndarray:
        """Append one transition per env (every field ``[num_envs, ...]``); returns the logical
        index each got in its lane. Validated whole before anything is written."""
        arrays: Sequence[Any] | None = (self._env_rows.fast_row(fields)
                                        if self._closed_reason is None else None)
        if arrays is None:
            arrays = self._env_rows_of(fields, "add()")
        lane, rows = self._lane, list(map(_first_row, arrays))
        i = lane._store.append(rows)
        if i is None:  # wait for room as this writer would
            lane.timeout, lane.stop_when = self.timeout, self.stop_when
            i = lane._append(rows)
        index = _ONE_INDEX.copy()  # (faster than np.zeros)
        index[0] = i
        return index

    def end_episode(self, env_mask: Any, truncated: Any = False, **episode_data: Any) -> np.ndarray:
        if self._closed_reason is not None:
            self._raise_closed()
        mask = self._per_env("env_mask", np.asarray(env_mask, bool), (1,))
        trunc = self._per_env("truncated", np.asarray(truncated, bool), (1,))
        values = self._episode_values(episode_data)
        if not mask[0] or self._lane._step == 0:
            return np.array([-1], np.int64)
        spec = self._storage.episode_spec
        data = {} if values is None or spec is None else {
            name: v[0] for name, v in zip(spec, values)}
        return np.array([self._lane.end_episode(truncated=bool(trunc[0]), **data)], np.int64)

    def add_prioritized(self, priorities: Any, /, **fields: Any) -> np.ndarray:
        arrays: Sequence[Any] | None = (self._env_rows.fast_row(fields)
                                        if self._closed_reason is None else None)
        if arrays is None:
            arrays = self._env_rows_of(fields, "add_prioritized()")
        p = checked_priorities(self._storage, priorities, 1, "add_prioritized()")
        lane = self._lane
        lane.timeout, lane.stop_when = self.timeout, self.stop_when
        index = _ONE_INDEX.copy()
        index[0] = lane._append_prioritized(list(map(_first_row, arrays)), p[0])
        return index

    end_episode.__doc__ = VectorWriter.end_episode.__doc__
    add_prioritized.__doc__ = VectorWriter.add_prioritized.__doc__


_one_env_classes: weakref.WeakKeyDictionary[RowChecker, dict[bool, type[VectorWriter]]] = (
    weakref.WeakKeyDictionary())


def one_env_class(checker: RowChecker) -> type[VectorWriter]:
    """The class of a one-env vector writer of ``checker``'s spec: ``OneEnvVectorWriter`` with
    its ``add`` from ``store.add_method`` (the fields in its signature, compiled where that is
    built)."""
    classes = _one_env_classes.setdefault(checker, {})
    compiled = compiled_for(checker)
    if compiled not in classes:
        add = add_method(OneEnvVectorWriter.add, checker, one_env=True)
        env_rows = RowChecker(Spec({f.name: ((1, *f.shape), f.dtype) for f in checker.fields}))
        classes[compiled] = type("VectorWriter", (OneEnvVectorWriter,), {
            "add": add, "_env_rows": env_rows, "__module__": __name__,
            "__qualname__": "VectorWriter", "__doc__": VectorWriter.__doc__})
    return classes[compiled]
