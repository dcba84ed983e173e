"""``Writer``: appends transitions to one lane of a replay buffer under the stamp protocol."""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import layout as L
from . import slots
from .checks import ring_segments, timeout_seconds
from .errors import ClosedError
from .segment import Lease

if TYPE_CHECKING:
    from .storage import BufferStorage

class Writer:
    """Appends transitions to one lane. Get one with ``ReplayBuffer.writer()``.

    Concurrency: this writer is the only process storing its lane's words, slots, rows and
    episode records. For index i in slot s it stores, through ``slots``, ``reserved``,
    ``stamp[s] = 2i+1``, the row, ``stamp[s] = 2i+2`` and then ``committed = i+1``; readers never
    wait for it and it never waits for them (only, optionally, for the rate limiter). A writer
    belongs to the process that opened it: a forked child's copy is closed.

    With ``next_obs="derived"`` buffers, ``add`` still takes ``next_obs`` but stores only ``obs``;
    the next observation is the next row's ``obs``, and ``end_episode`` stores the episode's true
    final observation as one extra row (flagged FINAL, never sampled as a transition). Call
    ``end_episode`` at every episode end there, or the last step is never sampled.

    Example:
        >>> with buf.writer() as w:
        ...     w.add(obs=o, action=a, reward=r)
        ...     w.extend({"obs": obs_batch, "action": act_batch, "reward": rew_batch})
        ...     w.end_episode(truncated=False, **{"return": 21.0})
    """

    _live: weakref.WeakSet[Writer] = weakref.WeakSet()

    def __init__(self, storage: BufferStorage, lane: int, lease: Lease,
                 insert_timeout: float) -> None:
        self._storage = storage
        self.lane = lane
        self._lease = lease
        self.timeout = timeout_seconds("insert_timeout", insert_timeout)
        self._closed_reason: str | None = None
        # Optional: a blocking add/extend gives up (ClosedError) once this returns true; an
        # ActorContext sets it so that stopping an actor also ends a wait on the rate limiter.
        self.stop_when: Callable[[], bool] | None = None
        lay, q = storage.layout, storage.words
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
        self._cols = [storage.columns[name][base : base + C] for name in storage.spec]
        self._stamps = storage.stamps[base : base + C]
        self._meta = storage.meta[base : base + C]
        checker = storage.input_checker()
        self._check_row = checker.check_row
        self._check_batch = checker.check_batch
        self._derived = storage.derived_next_obs
        if self._derived:
            obs = storage.spec["obs"]
            self._pending = np.zeros(obs.shape, obs.dtype)  # the last step's next_obs
            self._obs_col = list(storage.spec).index("obs")
        self._limiter = storage.limiter
        self._ramp = self._ramp2 = np.arange(0, dtype=np.int64)
        self._k0 = np.zeros((), np.int64)  # 0-d operand: ufuncs take it faster than an int

        # Take the lane over from whoever had it (nobody, a closed writer or a dead one).
        committed, reserved = slots.take_over(q, self._w_committed, self._w_reserved, C)
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
        # A pool that starts (or changes) a rate limit bumps its generation: room granted
        # before that is void, so a writer that was already running obeys the limit at once.
        self._w_lim_gen = self._limiter.generation_index
        self._lim_gen = -1
        Writer._live.add(self)

    # -- state -----------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    @property
    def committed(self) -> int:
        """Rows this lane has published (the next add gets this logical index)."""
        return self._next

    @property
    def step(self) -> int:
        """Steps in the current episode so far."""
        return self._step

    def _raise_closed(self) -> None:
        raise ClosedError(f"writer of lane {self.lane} is closed ({self._closed_reason})")

    def _check_open(self) -> None:
        """Called while waiting (rate limiter): closed, or asked to stop by ``stop_when``."""
        if self._closed_reason is not None:
            self._raise_closed()
        if self.stop_when is not None and self.stop_when():
            raise ClosedError(f"writer of lane {self.lane}: stopped while waiting for room")

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
        if i >= self._room_until or self._q[self._w_lim_gen] != self._lim_gen:
            self._make_room(1, self.timeout)
        s = i % self._C
        q = self._q
        # INLINE COPY of slots.claim + slots.write_row (a call costs ~5% of a mujoco add). It
        # omits store_fence(), a no-op on the only CPUs check_platform admits; tests/test_slots.py
        # pins this copy to slots.py and fails once store_fence() gets a body.
        if i >= self._reserved:
            self._reserved = i + 1
            q[self._w_reserved] = i + 1
        stamp = self._stamp0 + s
        q[stamp] = 2 * i + 1
        for col, v in zip(self._cols, values):  # (a derived next_obs, last, is not stored)
            col[s] = v
        q[self._meta0 + s] = self._episode_bits | (self._step & L.STEP_MASK)
        q[stamp] = 2 * i + 2
        q[self._w_committed] = i + 1
        # END OF INLINE COPY
        self._next = i + 1
        self._step += 1
        if self._derived:
            self._pending[...] = values[-1]
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
        if i0 + n > self._room_until or self._q[self._w_lim_gen] != self._lim_gen:
            self._make_room(n, self.timeout if timeout is None else timeout_seconds("timeout", timeout))
        C = self._C
        keep = min(n, C)
        skip = n - keep
        first = i0 + skip
        end = i0 + n
        q = self._q
        if end > self._reserved:
            self._reserved = end
            slots.claim(q, self._w_reserved, end)
        if self._ramp.shape[0] < keep:
            self._grow_ramp(keep)
        ramp, k0 = self._ramp, self._k0
        add = np.add
        stamps, meta = self._stamps, self._meta
        segments = ring_segments(first, keep, C)
        slots.mark_ring_writing(stamps, segments, first, self._ramp2, k0)
        for col, arr in zip(self._cols, arrays):
            if skip == 0 and len(segments) == 1:
                col[segments[0][0] : segments[0][1]] = arr
            else:
                for a, b, off in segments:
                    col[a:b] = arr[skip + off : skip + off + (b - a)]
        for a, b, off in segments:
            k0[()] = self._episode_bits | ((self._step + skip + off) & L.STEP_MASK)
            add(ramp[: b - a], k0, meta[a:b])
        slots.mark_ring_held(stamps, segments)
        slots.publish(q, self._w_committed, end)
        self._next = end
        self._step += n
        if self._derived:
            self._pending[...] = arrays[-1][-1]
        return range(i0, end)

    def _grow_ramp(self, n: int) -> None:
        size = min(max(n, 2 * self._ramp.shape[0], 1024), self._C)
        self._ramp = np.arange(size, dtype=np.int64)
        self._ramp2 = self._ramp * 2

    # -- episodes ------------------------------------------------------------------------------------------
    def end_episode(self, truncated: bool = False, **episode_data: Any) -> int:
        """Close the current episode; the next transition starts a new one. Returns its id.

        The episode's record (first index, length, ``truncated``, ``episode_data``) becomes
        readable with ``buffer.episode(id, lane)``. An episode with no steps is not recorded and
        its id is not used up. Episode data is validated before anything is written.

        Args:
            truncated: True if the episode was cut short (time limit), False if it terminated.
            **episode_data: values for the fields of the buffer's episode spec (missing ones are
                zero), e.g. ``end_episode(**{"return": 21.0, "seed": 7})``.
        """
        if self._closed_reason is not None:
            self._raise_closed()
        table = self._storage.episodes
        values = table.check(episode_data) if table is not None else None
        if values is None and episode_data:
            self._storage.refuse_episode_data(episode_data)
        ended = self.episode
        length = self._step
        if length == 0:
            return ended
        start = self._next - length
        if self._derived:
            self._write_final_row()
        if table is not None:
            table.write(self.lane, ended, start, length, bool(truncated), values)
        self.episode += 1
        self._episode_bits = self.episode << L.STEP_BITS
        self._step = 0
        q = self._q
        q[self._w_episode_start] = self._next
        q[self._w_episode] = self.episode
        return ended

    def _write_final_row(self) -> None:
        """One FINAL row holding the episode's last next_obs, the rest of the row zero."""
        i = self._next
        if i >= self._room_until or self._q[self._w_lim_gen] != self._lim_gen:
            self._make_room(1, self.timeout)
        s = i % self._C
        q = self._q
        if i >= self._reserved:
            self._reserved = i + 1
            slots.claim(q, self._w_reserved, i + 1)
        values = [self._pending if k == self._obs_col else 0 for k in range(len(self._cols))]
        meta = self._episode_bits | L.FLAG_FINAL | (self._step & L.STEP_MASK)
        slots.write_row(q, self._stamp0 + s, self._meta0 + s, self._w_committed, i, self._cols, s,
                        values, meta)
        self._next = i + 1

    # -- rate limiting -------------------------------------------------------------------------------------
    def _make_room(self, n: int, timeout: float) -> None:
        """Wait until ``n`` more rows may be inserted; refresh the heartbeat."""
        self._q[self._w_heartbeat] = time.time_ns()
        room, self._lim_gen = self._limiter.wait_for_insert(n, timeout, self._check_open,
                                                            f"lane {self.lane}", [self.lane])
        self._room_until = self._next + room

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
