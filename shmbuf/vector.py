"""``VectorWriter``: one writer for ``num_envs`` lanes at once (a vectorized environment).

Each ``add`` takes arrays with a leading ``num_envs`` axis and writes row e to lane ``lanes[e]``,
the equivalent of a group of per-env buffers in one shared-memory buffer. Writes are vectorised
across lanes: each protocol step (claims, odd stamps, rows, meta, even stamps, ``committed``) is
one NumPy store over all lanes, in the same order a single-lane ``Writer`` uses.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from . import layout as L
from . import slots
from .errors import ClosedError, SpecMismatchError
from .spec import RowChecker
from .writer import Writer

if TYPE_CHECKING:
    from .storage import BufferStorage


class VectorWriter:
    """Writes one transition per environment per ``add`` into ``num_envs`` lanes.

    Get one with ``buffer.writer(num_envs=N)``. Concurrency as ``Writer``: it holds every one of
    its lanes' writer leases, so it is the only process storing to them. It belongs to the
    process that opened it: a forked child's copy is closed (its ``add`` raises ``ClosedError``).

    Example:
        >>> with buf.writer(num_envs=8) as w:
        ...     w.add(obs=obs, action=actions, reward=rewards)   # each [8, ...]
        ...     w.end_episode(terminated | truncated, truncated=truncated)
    """

    _live: weakref.WeakSet[VectorWriter] = weakref.WeakSet()

    def __init__(self, storage: BufferStorage, writers: list[Writer]) -> None:
        self._storage = storage
        self._writers = writers  # holding the leases; their own state is not used any more
        self.lanes = np.array([w.lane for w in writers], np.int64)
        self.num_envs = len(writers)
        self.timeout = writers[0].timeout
        C = storage.capacity
        self._C = C
        self._base = self.lanes * C
        self._next = np.array([w._next for w in writers], np.int64)
        self._reserved = np.array([w._reserved for w in writers], np.int64)
        self.episode = np.array([w.episode for w in writers], np.int64)
        self._step = np.array([w._step for w in writers], np.int64)
        words = storage.lane_words
        self._committed_v, self._reserved_v = storage.committed, storage.reserved
        self._episode_v = words[:, L.LANE_EPISODE, 0]
        self._episode_start_v = words[:, L.LANE_EPISODE_START, 0]
        self._heartbeat_v = words[:, L.LANE_HEARTBEAT, 0]
        self._cols = [storage.columns[name] for name in storage.spec]
        self._stamps, self._meta = storage.stamps, storage.meta
        self._words = storage.words
        self._check_batch = storage.input_checker().check_batch
        self._derived = storage.derived_next_obs
        if self._derived:
            obs = storage.spec["obs"]
            self._pending = np.zeros((self.num_envs, *obs.shape), obs.dtype)
            self._obs_col = list(storage.spec).index("obs")
        self._rows = 0  # rows written, for rate-limit bookkeeping
        self._room_until = 0
        self._limiter = storage.limiter
        self._lim_word = self._limiter.generation_index
        self._lim_gen = -1
        self._episode_checker = (
            RowChecker(storage.episode_spec, batch_op="end_episode")
            if storage.episode_spec is not None
            else None
        )
        self._closed = False
        self._closed_reason = "closed"
        VectorWriter._live.add(self)

    # -- writing ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(
                f"vector writer of lanes {self.lanes.tolist()} is closed ({self._closed_reason})"
            )

    def _make_room(self, n: int) -> None:
        self._heartbeat_v[self.lanes] = time.time_ns()
        room, self._lim_gen = self._limiter.wait_for_insert(
            n // self.num_envs or 1, self.timeout, self._check_open,
            f"lanes {self.lanes.tolist()}", self.lanes)
        room *= self.num_envs
        self._room_until = self._rows + room

    def _put(self, slot_ids: np.ndarray, index: np.ndarray, lanes: np.ndarray, rows: list[Any],
             meta: np.ndarray) -> None:
        """The stamp protocol for one row per lane, every step vectorised over the lanes."""
        slots.claim(self._reserved_v, lanes, np.maximum(self._reserved_v[lanes], index + 1))
        slots.mark_writing(self._stamps, slot_ids, index)
        for col, values in zip(self._cols, rows):
            col[slot_ids] = values
        self._meta[slot_ids] = meta
        slots.mark_held(self._stamps, slot_ids, index)
        slots.publish(self._committed_v, lanes, index + 1)

    def add(self, **fields: Any) -> np.ndarray:
        """Append one transition per env (every field ``[num_envs, ...]``); returns the logical
        index each got in its lane. Validated whole before anything is written."""
        self._check_open()
        n, arrays = self._check_batch(fields)
        if n != self.num_envs:
            raise SpecMismatchError(
                f"add(): fields have {n} rows but this writer has num_envs={self.num_envs}: pass "
                f"one row per environment"
            )
        if self._rows + n > self._room_until or self._words[self._lim_word] != self._lim_gen:
            self._make_room(n)
        index = self._next
        meta = (self.episode << L.STEP_BITS) | (self._step & L.STEP_MASK)
        self._put(self._base + index % self._C, index, self.lanes, arrays, meta)
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
        self._check_open()
        mask = self._per_env("env_mask", np.asarray(env_mask, bool), (self.num_envs,))
        mask = mask & (self._step > 0)
        trunc = self._per_env("truncated", np.asarray(truncated, bool), (self.num_envs,))
        values = self._episode_values(episode_data)
        ended = np.where(mask, self.episode, -1)
        if not mask.any():
            return ended
        envs = np.flatnonzero(mask)
        starts = self._next[envs] - self._step[envs]
        if self._derived:
            self._write_final_rows(envs)
        table = self._storage.episodes
        if table is not None:
            for j, e in enumerate(envs):  # one record per finished episode, not per step
                row = [v[e] for v in values] if values is not None else table.check({})
                table.write(int(self.lanes[e]), int(self.episode[e]), int(starts[j]),
                            int(self._step[e]), bool(trunc[e]), row)
        self.episode[envs] += 1
        self._step[envs] = 0
        self._episode_start_v[self.lanes[envs]] = self._next[envs]
        self._episode_v[self.lanes[envs]] = self.episode[envs]
        return ended

    def _episode_values(self, data: Mapping[str, Any]) -> list[np.ndarray] | None:
        if not data:
            return None
        if self._episode_checker is None:
            self._storage.refuse_episode_data(data)
        spec = self._storage.episode_spec
        full = {n: np.zeros((self.num_envs, *f.shape), f.dtype) for n, f in spec.items()}
        for name, value in data.items():
            if name not in full:
                raise SpecMismatchError(
                    f"end_episode(): unknown episode field {name!r}; the episode spec has "
                    f"{', '.join(spec)}"
                )
            full[name] = self._per_env(name, np.asarray(value), full[name].shape)
        return self._episode_checker.check_batch(
            {k: np.ascontiguousarray(v) for k, v in full.items()})[1]

    def _per_env(self, name: str, value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """``value`` broadcast to ``shape`` (``[num_envs, ...]``), or SpecMismatchError."""
        try:
            return np.broadcast_to(value, shape)
        except ValueError:
            raise SpecMismatchError(
                f"end_episode(): {name} has shape {value.shape}; expected one value per env "
                f"{shape} (num_envs={self.num_envs}) or one value for all envs"
            ) from None

    def _write_final_rows(self, envs: np.ndarray) -> None:
        n = envs.size
        if self._rows + n > self._room_until or self._words[self._lim_word] != self._lim_gen:
            self._make_room(n)
        index = self._next[envs]
        lanes = self.lanes[envs]
        rows = [self._pending[envs] if k == self._obs_col else 0 for k in range(len(self._cols))]
        meta = (self.episode[envs] << L.STEP_BITS) | L.FLAG_FINAL | (self._step[envs] & L.STEP_MASK)
        self._put(self._base[envs] + index % self._C, index, lanes, rows, meta)
        self._next[envs] = index + 1
        self._rows += n

    @property
    def committed(self) -> np.ndarray:
        return self._next.copy()

    # -- teardown ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release every lane (idempotent)."""
        if not self._closed:
            self._closed = True
            self._drop_views()
            for w in self._writers:
                w.close()
        VectorWriter._live.discard(self)

    def _drop_views(self) -> None:
        """Drop every view of the segment, so the buffer can unmap it."""
        self._cols = []
        self._stamps = self._meta = self._words = None  # type: ignore[assignment]
        self._committed_v = self._reserved_v = None  # type: ignore[assignment]
        self._episode_v = self._episode_start_v = self._heartbeat_v = None  # type: ignore[assignment]

    @classmethod
    def _after_fork_in_child(cls) -> None:
        """The parent keeps writing these lanes: a child's copy must never store to them (one
        writer per lane is what the seqlock relies on). Its ``Writer``s close themselves."""
        for vw in list(cls._live):
            if not vw._closed:
                vw._closed = True
                vw._closed_reason = ("inherited by a forked child; open a writer in the child "
                                     "instead")
                vw._drop_views()
        cls._live = weakref.WeakSet()

    def __enter__(self) -> VectorWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<VectorWriter lanes={self.lanes.tolist()}{' closed' if self._closed else ''}>"


os.register_at_fork(after_in_child=VectorWriter._after_fork_in_child)
