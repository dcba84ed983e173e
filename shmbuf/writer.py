"""Lane writers: ``LaneWriter``, the core every lane writer shares, and ``Writer`` (one lane).

``VectorWriter`` (``vector.py``, one lane per env) is the other writer on the same core. Every
row a writer publishes goes through a store (``store.py``): its lane's ``LaneStore``, compiled
where ``_add_c`` was built, or a ``LanesStore`` over several lanes. Rows given with a priority
(``extend(rows, priorities=ps)``, ``add_prioritized``) go through a second store of the lane that
also stores the priority columns (``checked_priorities`` refuses bad priorities first).
"""

from __future__ import annotations

import math
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from . import layout as L
from . import slots
from .checks import timeout_seconds
from .errors import ClosedError, InvalidPriorityError, SpecMismatchError
from .lease import Lease
from .rowcheck import RowChecker
from .store import NumpyLaneStore, add_method, compiled_for, forget_priorities, lane_store

if TYPE_CHECKING:
    from .storage import BufferStorage

Lanes = Any  # one lane (an int) or an int64 array of lanes, with state arrays to match


class LaneWriter:
    """The core of a lane writer, over one lane (``Writer``) or several (``VectorWriter``).

    It keeps what both need, once: room under the rate limiter (``_make_room``,
    ``_ensure_room``); the end of episodes (``_finish_episodes``: FINAL rows, records, the lane
    words that open the next episode); and the life cycle (``close``, a forked child's copy
    closed, the context manager). Subclasses keep their lanes' positions (next index, step,
    episode id, the room granted: ``_room_until``, ``_lim_gen``), in the lane's store for
    ``Writer``, arrays in ``VectorWriter``, publish rows through their ``_store`` and measure
    room in rows of their own count (``_room_position``).

    Concurrency: a lane writer holds the writer lease of each of its lanes, so it is the only
    process storing their lane words, slots, rows and episode records (through its store,
    ``slots`` and the episode table); readers never wait for it and it never waits for them
    (only, optionally, for the rate limiter). It belongs to the process that opened it: a forked
    child's copy is closed (its calls raise ``ClosedError``), because one writer per lane is
    what the seqlock relies on.
    """

    _live: weakref.WeakSet[LaneWriter] = weakref.WeakSet()
    _kind = "writer"  # for messages: "<kind> of <who> is closed"
    _room_until: int  # rows below this room position were granted by the rate limiter ...
    _lim_gen: int  # ... under this limiter generation
    _store: Any  # a LaneStore (one lane) or a LanesStore (store.py)
    _prioritized_store: Any = None  # the same, storing the priority columns too (made on use)

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
        words = storage.lane_words
        self._episode_v = words[:, L.LANE_EPISODE, 0]
        self._episode_start_v = words[:, L.LANE_EPISODE_START, 0]
        self._heartbeat_v = words[:, L.LANE_HEARTBEAT, 0]
        checker = self._checker = storage.input_checker()
        self._fast_row, self._check_row = checker.fast_row, checker.check_row
        self._check_batch = checker.check_batch
        self._derived = storage.derived_next_obs
        self._nstored = len(storage.spec)  # values of stored fields (then next_obs if derived)
        if self._derived:  # each lane's last next_obs, for its episode's FINAL row
            obs = storage.spec["obs"]
            self._pending = np.zeros((self._width, *obs.shape), obs.dtype)
            self._obs_col = list(storage.spec).index("obs")
            self._final_row = [np.zeros(f.shape, f.dtype) for f in storage.spec.values()]
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
            rows = list(self._final_row)  # zeros, but for obs: the last next_obs
            rows[self._obs_col] = pending
            meta = (episodes << L.STEP_BITS) | L.FLAG_FINAL | (lengths & L.STEP_MASK)
            if many:
                self._store.put(next_index, meta, rows, lanes)
            else:
                self._store.put(next_index, meta, rows)
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
        """Drop every view of the segment, so the buffer can unmap it (the store keeps the
        cursor)."""
        if getattr(self, "_store", None) is not None:
            self._store.release()
        if self._prioritized_store is not None:
            self._prioritized_store.release()
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


_INF_BITS = int(np.array(np.inf).view(np.uint64))  # 0x7FF0000000000000


def checked_priority(storage: BufferStorage, priority: Any, op: str) -> Any:
    """``checked_priorities`` of one row's priority (a Python float taken as it is)."""
    if type(priority) is float and storage.priority is not None \
            and 0 <= priority < math.inf:  # (NaN fails too)
        return priority
    return checked_priorities(storage, priority, None, op)


def checked_priorities(storage: BufferStorage, priorities: Any, n: int | None, op: str
                       ) -> np.ndarray:
    """``priorities`` as float64, one per row (``[n]``; ``n`` None: one number, 0-d), or
    raise before anything is stored: ``SpecMismatchError`` where the buffer keeps no actor
    priorities, ``InvalidPriorityError`` for a value that is not a real number, a wrong
    length, or a priority that is NaN, infinite or negative (named with its position).
    Values too large for a priority table's sums are fine here: the pool clips them at
    ``sync`` and counts them (only it knows its alpha)."""
    if storage.priority is None:
        raise SpecMismatchError(
            f"{op}: buffer {storage.name!r} keeps no actor priorities. Fix: create it with "
            f"ReplayBuffer.create(..., actor_priorities=True), or leave the priorities out "
            f"(rows then enter a prioritized pool at its maximum priority)")
    try:
        values = priorities if type(priorities) is np.ndarray else np.asarray(priorities)
        if values.dtype != np.float64:
            if values.dtype.kind not in "biuf":
                raise TypeError(f"dtype {values.dtype}")
            values = values.astype(np.float64)
    except (TypeError, ValueError) as e:
        raise InvalidPriorityError(
            f"{op}: priorities must be real numbers, got {type(priorities).__name__} "
            f"({str(e)[:80]}); nothing was written. Fix: pass floats >= 0, e.g. |TD error|"
        ) from None
    want = () if n is None else (n,)
    if values.shape != want:
        raise InvalidPriorityError(
            f"{op}: priorities of shape {values.shape} for {'one row' if n is None else f'{n} rows'}"
            f"; expected shape {want}: one priority per row. Nothing was written")
    # One reduction for the usual case: as unsigned 64-bit words, the finite doubles >= +0.0
    # are exactly those below the bits of +inf (NaN, infinities and anything negative are
    # above), and only then the check that says what is wrong (which lets -0.0 through).
    if values.size and not (values.view(np.uint64).max() < _INF_BITS
                            or values.min() >= 0 and values.max() < np.inf):  # NaN fails too
        bad = ~np.isfinite(values) | (values < 0)
        at = int(np.flatnonzero(bad.reshape(-1))[0])
        where = "" if n is None else f" at position {at}"
        raise InvalidPriorityError(
            f"{op}: priority {float(values.reshape(-1)[at])!r}{where} is not allowed: priorities "
            f"must be finite and >= 0 ({int(bad.sum())} bad of {values.size}); nothing was "
            f"written. Fix: pass |TD error| (plus a small epsilon), e.g. np.abs(td) + 1e-6")
    return values


class Writer(LaneWriter):
    """Appends transitions to one lane. Get one with ``ReplayBuffer.writer()``.

    Concurrency (as ``LaneWriter``): for index i in slot s its lane's store (``store.py``)
    stores ``reserved``, ``stamp[s] = 2i+1``, the row, ``stamp[s] = 2i+2`` and then
    ``committed = i+1``.

    With ``next_obs="derived"`` buffers, ``add`` still takes ``next_obs`` but stores only ``obs``;
    the next observation is the next row's ``obs``, and ``end_episode`` stores the episode's true
    final observation as one extra row (flagged FINAL, never sampled as a transition). Call
    ``end_episode`` at every episode end there, or the last step is never sampled.

    A writer's class is made per spec (``writer_class``): its ``add`` names the spec's fields
    (``help(w.add)``), and where ``_add_c`` was built it stores the usual rows in one compiled
    call (``store.add_method``), calling the ``add`` below for the rest. Rows given with a
    priority (``extend(..., priorities=)``, ``add_prioritized``) are stored by a second store of
    the lane (compiled or not, as the first) that also stores the priority columns, under the
    same stamps and ``committed``.

    Example:
        >>> with buf.writer() as w:
        ...     w.add(obs=o, action=a, reward=r)
        ...     w.extend({"obs": obs_batch, "action": act_batch, "reward": rew_batch})
        ...     w.extend(rows, priorities=np.abs(td))  # an actor_priorities buffer (Ape-X)
        ...     w.end_episode(truncated=False, **{"return": 21.0})
    """

    def __init__(self, storage: BufferStorage, lane: int, lease: Lease,
                 insert_timeout: float) -> None:
        super().__init__(storage, [lane], timeout_seconds("insert_timeout", insert_timeout),
                         f"lane {lane}")
        self.lane = lane
        self._lease = lease
        lay, q = storage.layout, self._words
        C = lay.capacity
        w = lambda word: lay.lane_word(lane, word) // 8  # noqa: E731
        self._w_committed, self._w_reserved = w(L.LANE_COMMITTED), w(L.LANE_RESERVED)
        self._last_next_obs = self._pending[0] if self._derived else None  # this lane's row
        store = self._store = lane_store(storage, lane, self._checker, self._last_next_obs)

        # Take the lane over from whoever had it (nobody, a closed writer or a dead one).
        claimed = q[self._w_reserved]  # (before take_over trims it: its rows' tags are there)
        committed = slots.take_over(q, self._w_committed, self._w_reserved, C)[0]
        if claimed > committed:  # a dead writer's claim: it published none of those rows
            forget_priorities(storage, lane, first=committed, end=claimed)
        q[w(L.LANE_EPOCH)] = q[w(L.LANE_EPOCH)] + 1
        q[w(L.LANE_WRITER_PID)] = os.getpid()
        episode, start = q[w(L.LANE_EPISODE)], q[w(L.LANE_EPISODE_START)]
        if committed > start:  # the previous writer left an episode open: start a new one
            episode += 1
            start = committed
            q[w(L.LANE_EPISODE_START)] = start
            q[w(L.LANE_EPISODE)] = episode
        self.episode = episode
        store.next, store.step = committed, committed - start
        store.episode_bits = episode << L.STEP_BITS
        store.room_until, store.lim_gen = 0, -1  # check the rate limiter on the first insert

    @classmethod
    def open(cls, storage: BufferStorage, lane: int | None, timeout: float,
             insert_timeout: float) -> Writer:
        """A writer of ``lane``, or of the first free lane, taken within ``timeout`` s
        (``BufferStorage.lease_lane``). A lane whose writer died is taken over: the new writer
        continues at its ``committed`` index and starts a new episode."""
        lane, lease = storage.lease_lane(lane, timeout)
        try:
            return writer_class(storage.input_checker(), cls)(storage, lane, lease,
                                                              insert_timeout)
        except BaseException:
            lease.close()  # releases the lane now, not when the traceback dies
            raise

    # -- state: the lane's cursor, kept in its store (the compiled add advances it) -------------
    @property
    def committed(self) -> int:
        """Rows this lane has published (the next add gets this logical index)."""
        return int(self._store.next)

    @property
    def step(self) -> int:
        """Steps in the current episode so far."""
        return int(self._store.step)

    @property
    def _next(self) -> int:
        return int(self._store.next)

    @_next.setter
    def _next(self, index: int) -> None:
        self._store.next = index

    @property
    def _step(self) -> int:
        return int(self._store.step)

    @property
    def _room_until(self) -> int:  # type: ignore[override]
        return int(self._store.room_until)

    @_room_until.setter
    def _room_until(self, at: int) -> None:
        self._store.room_until = min(at, (1 << 63) - 1)

    @property
    def _lim_gen(self) -> int:  # type: ignore[override]
        return int(self._store.lim_gen)

    @_lim_gen.setter
    def _lim_gen(self, generation: int) -> None:
        self._store.lim_gen = generation

    def _room_position(self) -> int:
        return int(self._store.next)

    # -- writing ---------------------------------------------------------------------------------
    def add(self, /, **fields: Any) -> int:
        """Append one transition; returns its logical index in the lane.

        Every field of the spec must be given. The whole transition is validated before
        anything is written; a bad one raises ``SpecMismatchError`` and changes nothing.
        May wait up to ``self.timeout`` seconds on the rate limiter (``RateLimitTimeout``).
        """
        if self._closed_reason is not None:
            self._raise_closed()
        values = self._fast_row(fields) or self._check_row(fields)
        i = self._store.append(values)
        return self._append(values) if i is None else i

    def _append(self, values: Sequence[Any]) -> int:
        """Store one checked row at the lane's next index, waiting for room from the rate
        limiter while the room granted is used up (or void); return the index. (``add`` and
        a one-env ``VectorWriter.add`` try ``store.append`` first: room is usually left.)"""
        store = self._store
        i = store.append(values)
        while i is None:
            self._make_room(1, store.next)
            i = store.append(values)
        return i  # type: ignore[no-any-return]

    def add_prioritized(self, priority: float, /, **fields: Any) -> int:
        """``add`` with the row's priority (an ``actor_priorities`` buffer), e.g. an Ape-X
        actor's |TD error|: a prioritized pool enters the row at it instead of at its maximum
        priority. The priority comes first and positionally, so a field may be called
        ``priority`` (``w.add_prioritized(0.7, obs=o, priority=3)``).

        Raises:
            InvalidPriorityError: the priority is NaN, infinite, negative or not a number.
            SpecMismatchError: a field is wrong, or the buffer keeps no actor priorities.
            Nothing is written in either case.
        """
        if self._closed_reason is not None:
            self._raise_closed()
        p = checked_priority(self._storage, priority, "add_prioritized()")
        values = self._fast_row(fields) or self._check_row(fields)
        return self._append_prioritized(values, p)

    def _append_prioritized(self, values: Sequence[Any], priority: Any) -> int:
        """Store one checked row with its checked priority at the lane's next index, waiting
        for room as ``_append`` does; return the index."""
        store = self._store
        self._ensure_room(store.next, 1)
        i = store.next
        self._put_prioritized(i, store.episode_bits | (store.step & L.STEP_MASK), values,
                              priority, None)
        store.next = i + 1
        store.step += 1
        return i  # type: ignore[no-any-return]

    def _put_prioritized(self, first: int, meta: int, values: Sequence[Any],
                         priorities: Any, n: int | None) -> None:
        """Publish one row (``n`` None: ``values`` of one row, ``priorities`` one number) or ``n``
        rows at ``first`` with their priorities, through the lane's store of the priority
        columns. A failure part-way takes back the priorities of the rows left unpublished."""
        store = self._prioritized_store
        if store is None:  # compiled only where the lane's own store is
            make = lane_store if self._store.compiled else NumpyLaneStore
            store = self._prioritized_store = make(self._storage, self.lane, self._checker,
                                                   self._last_next_obs, with_priorities=True)
        k = self._nstored  # the fields' values; a derived buffer's next_obs follows
        tag = L.priority_row_tag(first)
        try:
            if n is None:
                store.put(first, meta, [*values[:k], priorities, tag, *values[k:]])
            else:
                store.put_many(first, meta, [*values[:k], priorities,
                                             np.arange(tag, tag + n), *values[k:]])
        except BaseException:
            forget_priorities(self._storage, self.lane, first, first + (1 if n is None else n))
            raise

    def extend(self, data: Mapping[str, Any], timeout: float | None = None, *,
               priorities: Any = None) -> range:
        """Append a batch: ``data[field]`` has shape ``[n, *shape]``, the same n for every field.

        Rows are published together (one ``committed`` store). If n exceeds the lane's capacity,
        only the last ``capacity`` rows are kept, as a ring would; logical indices still advance
        by n. Validated whole first: a bad batch raises and changes nothing. May wait on the rate
        limiter up to ``timeout`` (default ``self.timeout``).

        ``priorities`` (keyword only; ``[n]`` floats, an ``actor_priorities`` buffer): each
        row's priority, published with the row (Ape-X's actor priorities; ``add_prioritized``
        for one row). A prioritized pool enters the rows at them, rows without one at its
        maximum priority. NaN, infinite or negative ones, or not n of them, raise
        ``InvalidPriorityError`` and nothing is written.

        Returns:
            the logical indices given to the rows.
        """
        if self._closed_reason is not None:
            self._raise_closed()
        n, arrays = self._check_batch(data)
        p = None if priorities is None else checked_priorities(self._storage, priorities, n,
                                                                "extend()")
        store = self._store
        i0 = store.next
        if n == 0:
            return range(i0, i0)
        self._ensure_room(i0, n, timeout)
        meta = store.episode_bits | (store.step & L.STEP_MASK)
        if p is None:
            store.put_many(i0, meta, arrays)
        else:
            self._put_prioritized(i0, meta, arrays, p, n)
        store.next = i0 + n
        store.step += n
        return range(i0, i0 + n)

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
        ended, store = self.episode, self._store
        if store.step == 0:
            return ended
        store.next = self._finish_episodes(self.lane, ended, store.step, store.next, truncated,
                                           None if values is None else [values],
                                           self._last_next_obs)
        self.episode += 1
        store.episode_bits = self.episode << L.STEP_BITS
        store.step = 0
        return ended

    # -- teardown ---------------------------------------------------------------------------------------------
    def _release_lanes(self) -> None:
        self._lease.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"next={self._next}"
        return f"<Writer lane={self.lane} {state}>"


_classes: weakref.WeakKeyDictionary[RowChecker, dict[Any, type]] = weakref.WeakKeyDictionary()


def writer_class(checker: RowChecker, base: type[Writer]) -> type[Writer]:
    """``base`` for writers of ``checker``'s spec: its ``add`` from ``store.add_method`` (the
    fields in its signature, compiled where that is built), unless ``base`` has its own."""
    cache = _classes.setdefault(checker, {})
    key = (base, compiled_for(checker))
    if key not in cache:
        cache[key] = base if base.add is not Writer.add else type(
            base.__name__, (base,), {"add": add_method(Writer.add, checker),
                                     "__module__": base.__module__,
                                     "__qualname__": base.__qualname__, "__doc__": base.__doc__})
    return cache[key]
