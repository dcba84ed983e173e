"""Lane writers: ``LaneWriter``, the core every lane writer shares, and ``Writer`` (one lane).

``VectorWriter`` (``vector.py``, one lane per env) is the other writer on the same core. Every
store to a lane's seqlock words goes through ``slots``, or its compiled twin for ``Writer.add``
(``_add_c.c``, through ``addcompile.row_put``).
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from . import layout as L
from . import slots
from .addcompile import compiled_add, puts_rows, row_put, stream_rows, streams
from .checks import ring_segments, timeout_seconds
from .errors import ClosedError, SpecMismatchError
from .lease import Lease
from .rowcheck import _MISSING, RowChecker

if TYPE_CHECKING:
    from .storage import BufferStorage

Lanes = Any  # one lane (an int) or an int64 array of lanes, with state arrays to match


class LaneWriter:
    """The core of a lane writer, over one lane (``Writer``) or several (``VectorWriter``).

    It keeps what both need, once: room under the rate limiter (``_make_room``,
    ``_ensure_room``); the stamp protocol for one row in each of several lanes (``_put_rows``:
    a vector add, the FINAL rows of ``next_obs="derived"`` buffers); the end of episodes
    (``_finish_episodes``: FINAL rows, records, the lane words that open the next episode);
    and the life cycle (``close``, a forked child's copy closed, the context manager).
    Subclasses keep their lanes' positions (next index, step, episode id), scalars in
    ``Writer``, arrays in ``VectorWriter``, and measure room in rows of their own count
    (``_room_position``).

    Concurrency: a lane writer holds the writer lease of each of its lanes, so it is the only
    process storing their lane words, slots, rows and episode records (through ``slots``);
    readers never wait for it and it never waits for them (only, optionally, for the rate
    limiter). It belongs to the process that opened it: a forked child's copy is closed (its
    calls raise ``ClosedError``), because one writer per lane is what the seqlock relies on.
    """

    _live: weakref.WeakSet[LaneWriter] = weakref.WeakSet()
    _kind = "writer"  # for messages: "<kind> of <who> is closed"

    def __init__(self, storage: BufferStorage, lanes: Sequence[int], timeout: float,
                 who: str) -> None:
        self._storage = storage
        self.timeout = timeout
        self._who = who  # "lane 3", "lanes [0, 1]"
        self._closed_reason: str | None = None
        # Optional: a blocking add/extend gives up (ClosedError) once this returns true; an
        # ActorContext sets it so that stopping an actor also ends a wait on the rate limiter.
        self.stop_when: Callable[[], bool] | None = None
        self._lane_ids = np.array(lanes, np.int64)
        self._width = len(lanes)
        self._capacity = storage.capacity
        self._words = storage.words
        self._limiter = storage.limiter
        # A pool that starts (or changes) a rate limit bumps its generation: room granted
        # before that is void, so a writer that was already running obeys the limit at once.
        self._w_lim_gen = self._limiter.generation_index
        self._lim_gen = -1
        self._room_until = 0  # check the rate limiter on the first insert
        # Views over every lane (a subclass may keep narrower ones for its hot path).
        self._columns = [storage.columns[name] for name in storage.spec]
        self._slot_stamps, self._slot_meta = storage.stamps, storage.meta
        self._committed_v, self._reserved_v = storage.committed, storage.reserved
        words = storage.lane_words
        self._episode_v = words[:, L.LANE_EPISODE, 0]
        self._episode_start_v = words[:, L.LANE_EPISODE_START, 0]
        self._heartbeat_v = words[:, L.LANE_HEARTBEAT, 0]
        checker = self._checker = storage.input_checker()
        self._field_names = checker.names
        # extend's store per field: streamed for large rows (None: NumPy's)
        self._row_stores = [stream_rows if streams(f) else None for f in checker.fields]
        self._check_row, self._check_batch = checker.check_row, checker.check_batch
        self._put: Callable[..., Any] | None = None  # the compiled add's store (row_put)
        self._derived = storage.derived_next_obs
        if self._derived:  # each lane's last next_obs, for its episode's FINAL row
            obs = storage.spec["obs"]
            self._pending = np.zeros((self._width, *obs.shape), obs.dtype)
            self._obs_col = list(storage.spec).index("obs")
        LaneWriter._live.add(self)

    # -- state -------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    def _raise_closed(self) -> None:
        raise ClosedError(f"{self._kind} of {self._who} is closed ({self._closed_reason})")

    def _check_open(self) -> None:
        """Called while waiting (rate limiter): closed, or asked to stop by ``stop_when``."""
        if self._closed_reason is not None:
            self._raise_closed()
        if self.stop_when is not None and self.stop_when():
            raise ClosedError(f"{self._kind} of {self._who}: stopped while waiting for room")

    # -- rate limiting -----------------------------------------------------------------------------
    def _room_position(self) -> int:
        """Rows written so far, in the count ``_room_until`` is measured in."""
        raise NotImplementedError

    def _ensure_room(self, at: int, n: int, timeout: float | None = None) -> None:
        """Make room for ``n`` more rows (over all lanes) at room position ``at``, waiting on
        the rate limiter only when the room granted before is used up or void."""
        if at + n > self._room_until or self._words[self._w_lim_gen] != self._lim_gen:
            self._make_room(n, at, timeout)

    def _make_room(self, n: int, at: int, timeout: float | None = None) -> None:
        """Wait until ``n`` more rows (over all lanes: ``n / width`` per lane, at least one)
        may be inserted, up to ``timeout`` (default ``self.timeout``); refresh the heartbeats."""
        wait = self.timeout if timeout is None else timeout_seconds("timeout", timeout)
        self._heartbeat_v[self._lane_ids] = time.time_ns()  # (a refused timeout stores nothing)
        room, self._lim_gen = self._limiter.wait_for_insert(
            n // self._width or 1, wait, self._check_open, self._who, self._lane_ids)
        self._room_until = at + room * self._width

    # -- add's slow path -------------------------------------------------------------------------
    def _add_checked(self, extra: dict[str, Any], given: tuple[Any, ...],
                     one_env: bool = False) -> list[Any]:
        """The compiled ``add``'s slow path: the closed check, then the full checker on what
        was given (``_MISSING`` for a field not given); returns the values to store."""
        if self._closed_reason is not None:
            self._raise_closed()
        fields = {name: v for name, v in zip(self._field_names, given) if v is not _MISSING}
        fields.update(extra)
        if not one_env:
            values = self._check_row(fields)
            if self._put is not None:  # the compiled store takes only each field's own dtype
                values = [np.asarray(v, f.dtype, order="C")  # (0-d stays 0-d)
                          for v, f in zip(values, self._checker.fields)]
            return values
        n, arrays = self._check_batch(fields)
        if n != 1:
            raise SpecMismatchError(
                f"add(): fields have {n} rows but this writer has num_envs=1: pass one row per "
                f"environment"
            )
        return [a[0] for a in arrays]

    # -- one row in each of several lanes ---------------------------------------------------------
    def _put_rows(self, slot_ids: Lanes, index: Lanes, lanes: Lanes, rows: Sequence[Any],
                  meta: Lanes) -> None:
        """The stamp protocol for one row per lane (``slot_ids`` over the whole buffer), each
        step one store over all the lanes, in the order a single row takes: claim, odd stamp,
        columns, meta, even stamp, ``committed``."""
        claimed = self._reserved_v[lanes]  # (a dead writer's claim may reach past index + 1)
        slots.claim(self._reserved_v, lanes, np.maximum(claimed, index + 1)
                    if isinstance(lanes, np.ndarray) else max(int(claimed), index + 1))
        slots.mark_writing(self._slot_stamps, slot_ids, index)
        for col, values in zip(self._columns, rows):
            col[slot_ids] = values
        self._slot_meta[slot_ids] = meta
        slots.mark_held(self._slot_stamps, slot_ids, index)
        slots.publish(self._committed_v, lanes, index + 1)

    # -- episodes ------------------------------------------------------------------------------------
    def _finish_episodes(self, lanes: Lanes, episodes: Lanes, lengths: Lanes, next_index: Lanes,
                         truncated: Lanes, records: Sequence[Any] | None, pending: Any) -> Lanes:
        """End episode ``episodes`` (of ``lengths`` steps) in each of ``lanes``, whose next
        index is ``next_index``: in derived buffers its FINAL row (holding ``pending``, its last
        next_obs), then its record in the episode table (``records``: one checked value list
        per episode, or None for zeros), then the lane words that open the next episode.
        Returns the lanes' next index after the FINAL rows."""
        many = isinstance(lanes, np.ndarray)
        starts = next_index - lengths
        if self._derived:
            self._ensure_room(self._room_position(), lanes.size if many else 1)
            rows = [pending if k == self._obs_col else 0 for k in range(len(self._columns))]
            meta = (episodes << L.STEP_BITS) | L.FLAG_FINAL | (lengths & L.STEP_MASK)
            self._put_rows(lanes * self._capacity + next_index % self._capacity, next_index,
                           lanes, rows, meta)
            next_index = next_index + 1
        table = self._storage.episodes
        if table is not None and not many:
            table.write(lanes, episodes, starts, lengths, bool(truncated),
                        records[0] if records is not None else table.check({}))
        elif table is not None:  # one record per finished episode, not per step
            ended = zip(lanes.tolist(), episodes.tolist(), starts.tolist(), lengths.tolist(),
                        truncated.tolist())
            for j, (lane, episode, start, length, trunc) in enumerate(ended):
                table.write(lane, episode, start, length, bool(trunc),
                            records[j] if records is not None else table.check({}))
        self._episode_start_v[lanes] = next_index
        self._episode_v[lanes] = episodes + 1
        return next_index

    # -- teardown -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the lanes (idempotent). Their rows stay; another writer may take them over."""
        if self._closed_reason is None:
            self._closed_reason = "closed"
            self._heartbeat_v[self._lane_ids] = time.time_ns()
        self._drop_views()
        self._release_lanes()
        LaneWriter._live.discard(self)

    def _release_lanes(self) -> None:
        """Give the lanes' writer leases back."""
        raise NotImplementedError

    def _drop_views(self) -> None:
        """Drop every view of the segment, so the buffer can unmap it."""
        self._columns = []
        self._slot_stamps = self._slot_meta = None  # type: ignore[assignment]
        self._committed_v = self._reserved_v = None  # type: ignore[assignment]
        self._episode_v = self._episode_start_v = self._heartbeat_v = None  # type: ignore[assignment]
        self._words = None  # type: ignore[assignment]

    @classmethod
    def _after_fork_in_child(cls) -> None:
        """The parent keeps writing these lanes: a child's copy must never store to them. Its
        leases close themselves (``Lease``)."""
        for w in list(LaneWriter._live):
            if w._closed_reason is None:
                w._closed_reason = "inherited by a forked child; open a writer in the child instead"
            w._drop_views()
        LaneWriter._live = weakref.WeakSet()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


os.register_at_fork(after_in_child=LaneWriter._after_fork_in_child)


class Writer(LaneWriter):
    """Appends transitions to one lane. Get one with ``ReplayBuffer.writer()``.

    Concurrency (as ``LaneWriter``): for index i in slot s it stores, through ``slots``,
    ``reserved``, ``stamp[s] = 2i+1``, the row, ``stamp[s] = 2i+2`` and then
    ``committed = i+1``.

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

    def __init__(self, storage: BufferStorage, lane: int, lease: Lease,
                 insert_timeout: float) -> None:
        super().__init__(storage, [lane], timeout_seconds("insert_timeout", insert_timeout),
                         f"lane {lane}")
        self.lane = lane
        self._lease = lease
        lay, q = storage.layout, self._words
        C = self._C = lay.capacity
        w = lambda word: lay.lane_word(lane, word) // 8  # noqa: E731
        self._w_committed, self._w_reserved = w(L.LANE_COMMITTED), w(L.LANE_RESERVED)
        self._stamp0 = lay.stamp(lane * C) // 8
        self._meta0 = (lay.meta.offset // 8) + lane * C
        base = lane * C
        self._cols = [column[base : base + C] for column in self._columns]  # this lane's
        self._stamps = storage.stamps[base : base + C]
        self._meta = storage.meta[base : base + C]
        self._ramp = self._ramp2 = np.arange(0, dtype=np.int64)
        self._k0 = np.zeros((), np.int64)  # 0-d operand: ufuncs take it faster than an int
        if self._derived:
            self._last_next_obs = self._pending[0]  # this lane's row of the core's _pending
        # The compiled add's store of a whole row (None where _add_c was not built).
        self._put = self._row_put(one_env=False) if puts_rows(self._checker) else None

        # Take the lane over from whoever had it (nobody, a closed writer or a dead one).
        committed = slots.take_over(q, self._w_committed, self._w_reserved, C)[0]
        self._next = committed
        q[w(L.LANE_EPOCH)] = q[w(L.LANE_EPOCH)] + 1
        q[w(L.LANE_WRITER_PID)] = os.getpid()
        episode, start = q[w(L.LANE_EPISODE)], q[w(L.LANE_EPISODE_START)]
        if committed > start:  # the previous writer left an episode open: start a new one
            episode += 1
            start = committed
            q[w(L.LANE_EPISODE_START)] = start
            q[w(L.LANE_EPISODE)] = episode
        self.episode = episode
        self._step = committed - start
        self._episode_bits = episode << L.STEP_BITS

    def _row_put(self, one_env: bool) -> Callable[..., Any]:
        """``addcompile.row_put`` for this lane: the compiled ``add``'s check and stores of one
        row, with the words, columns and pending next_obs row of this lane."""
        at = (self._w_committed, self._w_reserved, self._w_lim_gen, self._stamp0, self._meta0,
              self._C, L.STEP_MASK)
        return row_put(self._checker, self._words, at, self._cols,
                       self._last_next_obs if self._derived else None, one_env)

    @classmethod
    def open(cls, storage: BufferStorage, lane: int | None, timeout: float,
             insert_timeout: float) -> Writer:
        """A writer of ``lane``, or of the first free lane, taken within ``timeout`` s
        (``BufferStorage.lease_lane``). A lane whose writer died is taken over: the new writer
        continues at its ``committed`` index and starts a new episode."""
        lane, lease = storage.lease_lane(lane, timeout)
        try:
            return compiled_writer_class(storage, cls)(storage, lane, lease, insert_timeout)
        except BaseException:
            lease.close()  # releases the lane now, not when the traceback dies
            raise

    # -- state -----------------------------------------------------------------------------------------
    @property
    def committed(self) -> int:
        """Rows this lane has published (the next add gets this logical index)."""
        return self._next

    @property
    def step(self) -> int:
        """Steps in the current episode so far."""
        return self._step

    def _room_position(self) -> int:
        return self._next

    # -- hot path ----------------------------------------------------------------------------------------
    def add(self, **fields: Any) -> int:
        """Append one transition; returns its logical index in the lane.

        Every field of the spec must be given. The whole transition is validated before
        anything is written; a bad one raises ``SpecMismatchError`` and changes nothing.
        May wait up to ``self.timeout`` seconds on the rate limiter (``RateLimitTimeout``).
        """
        # A writer's class runs this method as ``compiled_add`` made it from this source for
        # its buffer's spec: the lines marked COMPILED(...) are replaced there.
        lane = self  # COMPILED(lane)
        # COMPILED(put): one call that checks and stores the row (``addcompile.row_put``)
        values = lane._add_checked(fields, ())  # COMPILED(check)
        i = lane._next
        q = lane._words
        if i >= lane._room_until or q[lane._w_lim_gen] != lane._lim_gen:  # _ensure_room, inline
            lane._make_room(1, i)  # COMPILED(room)
        # COMPILED(put_checked): the same call with the checked values, now of the fields' dtypes
        s = i % lane._C
        if i >= q[lane._w_reserved]:
            slots.claim(q, lane._w_reserved, i + 1)
        slots.write_row(q, lane._stamp0 + s, lane._meta0 + s, lane._w_committed, i, lane._cols,
                        s, values, lane._episode_bits | (lane._step & L.STEP_MASK))
        lane._next = i + 1
        lane._step += 1
        if lane._derived:  # COMPILED(derived)
            lane._last_next_obs[...] = values[-1]
        return i  # COMPILED(return)

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
        self._ensure_room(i0, n, timeout)
        C = self._C
        keep = min(n, C)
        skip = n - keep
        first = i0 + skip
        end = i0 + n
        q = self._words
        if end > q[self._w_reserved]:
            slots.claim(q, self._w_reserved, end)
        if self._ramp.shape[0] < keep:
            self._grow_ramp(keep)
        ramp, k0 = self._ramp, self._k0
        add = np.add
        stamps, meta = self._stamps, self._meta
        segments = ring_segments(first, keep, C)
        slots.mark_ring_writing(stamps, segments, first, self._ramp2, k0)
        for col, arr, store in zip(self._cols, arrays, self._row_stores):
            for a, b, off in segments:
                rows = arr[skip + off : skip + off + (b - a)] if skip or len(segments) > 1 else arr
                if store is None or not store(col, a, rows, b - a):  # fenced: see _stream_c.c
                    col[a:b] = rows
        for a, b, off in segments:
            k0[()] = self._episode_bits | ((self._step + skip + off) & L.STEP_MASK)
            add(ramp[: b - a], k0, meta[a:b])
        slots.mark_ring_held(stamps, segments)
        slots.publish(q, self._w_committed, end)
        self._next = end
        self._step += n
        if self._derived:
            self._last_next_obs[...] = arrays[-1][-1]
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
        if self._step == 0:
            return ended
        self._next = self._finish_episodes(self.lane, ended, self._step, self._next, truncated,
                                           None if values is None else [values],
                                           self._last_next_obs if self._derived else None)
        self.episode += 1
        self._episode_bits = self.episode << L.STEP_BITS
        self._step = 0
        return ended

    # -- teardown ---------------------------------------------------------------------------------------------
    def _release_lanes(self) -> None:
        self._lease.close()

    def _drop_views(self) -> None:
        super()._drop_views()
        self._cols = []
        self._stamps = self._meta = self._put = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"next={self._next}"
        return f"<Writer lane={self.lane} {state}>"


_classes: weakref.WeakKeyDictionary[RowChecker, dict[type, type]] = weakref.WeakKeyDictionary()


def compiled_writer_class(storage: BufferStorage, base: type[Writer]) -> type[Writer]:
    """``base`` with ``add`` compiled for ``storage``'s spec (one class per buffer and base)."""
    cache = _classes.setdefault(storage.input_checker(), {})
    if base not in cache:
        add = compiled_add(Writer.add, storage.input_checker(), storage.derived_next_obs,
                           one_env=False)
        cache[base] = base if add is None else type(
            base.__name__, (base,), {"add": add, "__module__": base.__module__,
                                     "__qualname__": base.__qualname__})
    return cache[base]
