"""``BufferStorage``: one replay buffer's segment and the named views every part works on.

Create, attach and close the segment; the lane words, stamps, meta words and field columns as
NumPy views; lane windows, lane leases, the rate ``Limiter``, the episode table and the
checked gather. Writers, readers, persistence and the sampler workers receive a storage; the
``ReplayBuffer`` façade holds one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import numpy as np

from . import layout as L
from . import slots
from .checks import positive_int, ring_segments
from .episodes import EpisodeTable
from .errors import (
    ClosedError,
    LaneBusyError,
    SegmentFormatError,
    SpecMismatchError,
    StaleIndexError,
)
from .lease import Lease
from .limiter import Limiter
from .rowcheck import RowChecker
from .sampling import Windows
from .segment import Segment
from .spec import Spec


def field_tuples(spec: Spec) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    return [(f.name, f.shape, f.dtype) for f in spec.values()]


class BufferStorage:
    """The segment of one buffer and its named views (internal, exported to ``workers``).

    Layout (``layout.buffer_layout``): header page, one line per lane word, one stamp and one
    meta word per slot, one column per field, the limiter block, the episode table.

    Concurrency: this class stores nothing by itself. ``words`` is the whole segment as int64
    words; ``lane_words[k]`` are lane k's words (``committed`` and ``reserved`` are the views of
    the two seqlock words over all lanes), written only by lane k's writer through ``slots``;
    ``stamps``/``meta``/``columns`` are slot-indexed (lane k owns ``[k*C, (k+1)*C)``). Readers
    load them and never wait. ``cleared_below[k]`` is lane k's floor, stored only under
    ``LOCK_CLEAR`` (``clear``, restores). ``lock_all_lanes`` takes every writer lease and
    ``LOCK_CLEAR``, for restores.
    """

    def __init__(self, segment: Segment) -> None:
        doc = segment.header.doc
        # The header is untrusted (segment.read_header checked its shape and ranges): any
        # failure to make sense of it is a SegmentFormatError, with the segment closed.
        try:
            self.spec = Spec.from_json(doc["spec"])
            capacity, lanes = int(doc["capacity"]), int(doc["lanes"])
            ep_doc = doc.get("episode_spec") or []
            self.episode_spec = Spec.from_json(ep_doc) if ep_doc else None
            episode_capacity = int(doc.get("episode_capacity", 0))
            self.derived_next_obs = doc.get("next_obs", "stored") == "derived"
            actor_priorities = doc.get("actor_priorities", False)  # (older segments: absent)
            if not isinstance(actor_priorities, bool):
                raise TypeError(f"actor_priorities is {actor_priorities!r}, not a bool")
            json_len = len(L.encode_layout(doc))
            self.layout = L.buffer_layout(
                field_tuples(self.spec), capacity, lanes, json_len,
                field_tuples(self.episode_spec) if self.episode_spec else [], episode_capacity,
                actor_priorities)
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError, MemoryError) as e:
            segment.close()
            raise SegmentFormatError(
                f"segment {segment.name!r} has a malformed layout ({type(e).__name__}: "
                f"{str(e)[:200]}); it was not made by this shmbuf"
            ) from None
        if self.layout.total_size != segment.header.total_size:
            segment.close()
            raise SegmentFormatError(
                f"segment {segment.name!r}: layout says {self.layout.total_size} bytes, header "
                f"says {segment.header.total_size}; it was made by an incompatible shmbuf"
            )
        self.segment = segment
        self.name = segment.name
        self.capacity = self.layout.capacity
        self.lanes = self.layout.lanes
        self._checker: RowChecker | None = None
        self.map_views()

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def create(cls, spec: Spec | Mapping[str, Any], capacity: int, lanes: int, name: str | None,
               next_obs: str, episode_spec: Spec | Mapping[str, Any] | None,
               episode_capacity: int | None, actor_priorities: bool = False) -> BufferStorage:
        """A new segment (this process owns it); see ``ReplayBuffer.create`` for the checks."""
        spec = spec if isinstance(spec, Spec) else Spec(spec)
        capacity, lanes = positive_int("capacity", capacity), positive_int("lanes", lanes)
        if lanes > L.MAX_LANES:
            raise ValueError(f"lanes must be <= {L.MAX_LANES}, got {lanes}")
        if next_obs not in ("stored", "derived"):
            raise ValueError(f"next_obs must be 'stored' or 'derived', got {next_obs!r}")
        if next_obs == "derived" and ("obs" not in spec or "next_obs" in spec):
            raise SpecMismatchError(
                f"next_obs='derived' stores 'obs' only and derives 'next_obs' from the next "
                f"step: the spec needs an 'obs' field and no 'next_obs' field; it has "
                f"{', '.join(spec)}"
            )
        if episode_spec is not None and not isinstance(episode_spec, Spec):
            episode_spec = Spec(episode_spec)
        if episode_capacity is None:
            episode_capacity = max(64, capacity // 8)
        episode_capacity = positive_int("episode_capacity", episode_capacity)
        if not isinstance(actor_priorities, (bool, np.bool_)):
            raise TypeError(f"actor_priorities must be True or False, got {actor_priorities!r}")
        doc = {"kind": "buffer", "spec": spec.to_json(), "capacity": capacity, "lanes": lanes,
               "next_obs": next_obs, "episode_capacity": episode_capacity,
               "episode_spec": episode_spec.to_json() if episode_spec else []}
        if actor_priorities:  # (only then: a buffer without them keeps the older document)
            doc["actor_priorities"] = True
        fields = field_tuples(spec)
        ep_fields = field_tuples(episode_spec) if episode_spec else []

        def size_of(json_len: int) -> int:
            return L.buffer_layout(fields, capacity, lanes, json_len, ep_fields,
                                   episode_capacity, bool(actor_priorities)).total_size

        return cls(Segment.create(name, L.KIND_BUFFER, doc, size_of))

    @classmethod
    def attach(cls, name: str, timeout: float = 5.0) -> BufferStorage:
        """Map an existing buffer's segment by name. Never resizes or changes it."""
        return cls(Segment.attach(name, L.KIND_BUFFER, timeout=timeout))

    @classmethod
    def adopt(cls, name: str, timeout: float = 5.0) -> BufferStorage:
        """Become the owner of a buffer whose owner died (``Segment.adopt``); rows untouched."""
        return cls(Segment.adopt(name, L.KIND_BUFFER, timeout=timeout))

    # -- views ---------------------------------------------------------------------------------------
    def map_views(self) -> None:
        mm, lay = self.segment.buf, self.layout
        if mm is None:
            raise ClosedError(f"segment {self.name!r} is closed")
        self.words = memoryview(mm).cast("q")
        lanes = np.frombuffer(
            mm, "<i8", count=lay.lanes * L.LANE_LINES * L.WORDS_PER_LINE, offset=lay.lane_offset
        ).reshape(lay.lanes, L.LANE_LINES, L.WORDS_PER_LINE)
        self.lane_words = lanes
        self.committed = lanes[:, L.LANE_COMMITTED, 0]
        self.reserved = lanes[:, L.LANE_RESERVED, 0]
        self.cleared_below = lanes[:, L.LANE_EPOCH, L.CLEARED_BELOW_WORD]  # the lanes' floors
        self.stamps = np.frombuffer(mm, "<i8", count=lay.slots, offset=lay.stamps_offset)
        self.meta = np.frombuffer(mm, "<i8", count=lay.slots, offset=lay.meta.offset)
        self.columns = {c.name: _column(mm, c) for c in lay.columns}
        # Actor priorities (``layout.PRIORITY_COLUMNS``), None where the buffer keeps none.
        priority: list[np.ndarray | None] = [_column(mm, c) for c in lay.priority_columns]
        self.priority, self.priority_row = priority or [None, None]
        self.limiter = Limiter(self.segment, mm, lay, words=self.words, committed=self.committed,
                               reserved=self.reserved, consumed=lanes[:, L.LANE_CONSUMED, 0],
                               cleared_below=self.cleared_below)
        self.episodes: EpisodeTable | None = None
        if lay.episode_capacity:
            ep_cols = {c.name: _column(mm, c) for c in lay.episode_columns}
            self.episodes = EpisodeTable(ep_cols, lay.episode_capacity, lay.lanes,
                                         self.episode_spec, self.cleared_below)

    def drop_views(self) -> None:
        """Drop every view of the segment (idempotent), so that it can be unmapped."""
        self.lane_words = self.committed = self.reserved = None  # type: ignore[assignment]
        self.cleared_below = None  # type: ignore[assignment]
        self.stamps = self.meta = None  # type: ignore[assignment]
        self.columns = {}
        self.priority = self.priority_row = None
        self.episodes = None
        if getattr(self, "limiter", None) is not None:
            self.limiter.drop_views()
        self.limiter = None  # type: ignore[assignment]
        if getattr(self, "words", None) is not None:
            self.words.release()
            self.words = None  # type: ignore[assignment]

    def close(self) -> None:
        """Drop the views and close the segment (the owner unlinks it). Idempotent.

        Raises:
            BufferInUseError: arrays made from the views still exist (see ``Segment.close``).
        """
        self.drop_views()
        self.segment.close()

    # -- lanes ---------------------------------------------------------------------------------------
    def word_index(self, lane: int, word: int) -> int:
        """Index in ``words`` of lane word ``word`` (``layout.LANE_*``) of ``lane``."""
        return self.layout.lane_word(lane, word) // 8

    def writer_pid(self, lane: int) -> int:
        return self.words[self.word_index(lane, L.LANE_WRITER_PID)]

    def lane_index(self, lane: Any) -> int:
        """``lane`` as an int in ``[0, lanes)``, or ValueError."""
        if not isinstance(lane, (int, np.integer)) or not 0 <= lane < self.lanes:
            raise ValueError(f"lane must be an int in [0, {self.lanes}), got {lane!r}")
        return int(lane)

    def lease_lane(self, lane: int | None, timeout: float) -> tuple[int, Lease]:
        """Take the writer lease of ``lane``, or of the first free lane, waiting up to
        ``timeout`` s (a finite number >= 0); return the lane and the lease holding it.

        A lane whose writer died (even by SIGKILL) is free at once: its lock died with it.

        Raises:
            LaneBusyError: no lane became free in time.
        """
        if lane is not None:
            candidates = [self.lane_index(lane)]
        else:  # start at a pid-dependent lane, so that concurrent actors rarely collide
            start = os.getpid() % self.lanes
            candidates = [(start + k) % self.lanes for k in range(self.lanes)]
        lease = self.segment.lease()
        deadline = time.monotonic() + timeout
        while True:
            for k in candidates:
                if lease.try_lock(L.lock_lane(k)):
                    return k, lease
            if time.monotonic() >= deadline:
                lease.close()
                busy = ", ".join(f"{k} (pid {self.writer_pid(k)})" for k in candidates)
                raise LaneBusyError(
                    f"no free lane after {timeout:g}s: lane(s) {busy} have live writers. Fix: close "
                    f"a writer, or create the buffer with more lanes (it has {self.lanes})"
                )
            time.sleep(0.01)

    def windows(self) -> Windows:
        """Each lane's readable logical indices ``[lo, hi)`` (``slots.read_windows``: the
        writer's claim is loaded before ``committed``)."""
        return Windows(*slots.read_windows(self.reserved, self.committed, self.capacity,
                                           self.cleared_below))

    def lock_all_lanes(self, timeout: float = 0.0, purpose: str = "restoring the buffer") -> Lease:
        """Take every lane's writer lease and ``LOCK_CLEAR`` (for restores), waiting up to
        ``timeout`` for each; raises LaneBusyError if one stays busy."""
        lease = self.segment.lease()
        lock_floors(lease, self.name, timeout, purpose)
        deadline = time.monotonic() + timeout
        for k in range(self.lanes):
            while not lease.try_lock(L.lock_lane(k)) and time.monotonic() < deadline:
                time.sleep(0.01)
            if not lease.try_lock(L.lock_lane(k)):
                lease.close()
                raise LaneBusyError(
                    f"lane {k} has a live writer (pid {self.writer_pid(k)}); close every "
                    f"writer (of this handle or any other) before {purpose}"
                )
        return lease

    def clear(self, timeout: float) -> None:
        """Empty every lane, live writers or not (``clear_lanes``)."""
        clear_lanes(self, timeout)

    def episode_table(self) -> EpisodeTable:
        """The lanes' episode records; StaleIndexError for a segment that keeps none."""
        if self.episodes is None:
            raise StaleIndexError(f"buffer {self.name!r} keeps no episode records "
                                  f"(episode_capacity=0)")
        return self.episodes

    def empty_lane(self, lane: int) -> None:
        """Make ``lane`` hold nothing and drop its episode records (caller holds its lease)."""
        slots.empty_lane(self.words, self.word_index(lane, L.LANE_COMMITTED),
                         self.word_index(lane, L.LANE_RESERVED), self.capacity)
        if self.episodes is not None:
            self.episodes.clear(lane)

    def restore_lane(self, lane: int, first: int, rows: Mapping[str, np.ndarray],
                     meta: np.ndarray, episode: int, episode_start: int,
                     on_copied: Callable[[int], None] | None = None,
                     priorities: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Write rows ``first .. first+n`` of ``lane`` (caller holds the lane's lease).

        ``priorities`` (values f8, given u1/bool, ``[n]`` each): the rows' actor priorities,
        stored with tags naming the rows where ``given`` (the buffer keeps actor priorities);
        every other slot of the lane is left with no priority. ``on_copied(nbytes)``, if given,
        is called after each column copy (progress display).
        """
        C = self.capacity
        n = int(meta.shape[0])
        q = self.words
        end = first + n
        base = lane * C
        committed_at = self.word_index(lane, L.LANE_COMMITTED)
        reserved_at = self.word_index(lane, L.LANE_RESERVED)
        lane_stamps = self.stamps[base : base + C]
        slots.begin_restore(lane_stamps, q, committed_at, reserved_at, end, C)  # nothing held
        slots.set_floor(self.cleared_below, lane, 0)  # (the caller holds LOCK_CLEAR too)
        segments = ring_segments(first, n, C)
        for a, b, off in segments:
            for name, src in rows.items():
                dst = self.columns[name][base + a : base + b]
                dst[...] = src[off : off + (b - a)]
                if on_copied is not None:
                    on_copied(dst.nbytes)
            self.meta[base + a : base + b] = meta[off : off + (b - a)]
        if self.priority is not None and self.priority_row is not None:
            self.priority_row[base : base + C] = 0  # no stale tag names a rewritten index
            if priorities is not None:
                values, given = priorities
                for a, b, off in segments:
                    tags = L.priority_row_tag(np.arange(first + off, first + off + (b - a)))
                    self.priority[base + a : base + b] = values[off : off + (b - a)]
                    self.priority_row[base + a : base + b] = np.where(
                        given[off : off + (b - a)], tags, 0)
        q[self.word_index(lane, L.LANE_EPISODE)] = episode
        q[self.word_index(lane, L.LANE_EPISODE_START)] = episode_start
        slots.finish_restore(lane_stamps, segments, first, q, reserved_at, end, C)

    # -- rows ------------------------------------------------------------------------------------------
    def gather(
        self, lanes: np.ndarray | None, indices: np.ndarray, out: Mapping[str, np.ndarray],
        meta_out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Copy rows (and their ``meta`` words into ``meta_out``) into ``out``; return which
        rows passed the seqlock check.

        A row is good if its stamp said "holds index i" both before and after the copy.
        """
        C = self.capacity
        slot_ids = indices % C
        if lanes is not None and self.lanes > 1:
            slot_ids += lanes * C
        return slots.checked_gather(self.stamps, slot_ids, indices, self.columns, out,
                                    self.meta, meta_out)

    def input_checker(self) -> RowChecker:
        """Validates what writers are given: the spec, plus ``next_obs`` (last) if derived."""
        if self._checker is None:
            spec = self.spec
            if self.derived_next_obs:
                obs = spec["obs"]
                spec = Spec({**{n: (f.shape, f.dtype) for n, f in spec.items()},
                             "next_obs": (obs.shape, obs.dtype)})
            self._checker = RowChecker(spec)
        return self._checker

    def refuse_episode_data(self, data: Mapping[str, Any]) -> NoReturn:
        """Raise: ``end_episode`` got episode data, and this buffer has no episode spec."""
        raise SpecMismatchError(
            f"end_episode() got episode data {sorted(data)} but buffer {self.name!r} has no "
            f"episode spec. Fix: ReplayBuffer.create(..., episode_spec=Spec(...))"
        )


def lock_floors(lease: Lease, name: str, timeout: float, purpose: str) -> None:
    """Take ``LOCK_CLEAR`` on ``lease`` (the right to store the lanes' floors), waiting up
    to ``timeout`` s for another clear or restore to finish; LaneBusyError (lease closed)
    past it."""
    deadline = time.monotonic() + timeout
    while not lease.try_lock(L.LOCK_CLEAR):
        if time.monotonic() >= deadline:
            lease.close()
            raise LaneBusyError(
                f"another clear() or restore of buffer {name!r} kept going for "
                f"{timeout:g}s; nothing was changed. Fix: retry {purpose}, or pass a larger "
                f"timeout"
            )
        time.sleep(0.01)


def clear_lanes(storage: BufferStorage, timeout: float) -> None:
    """Empty every lane, live writers or not, holding ``LOCK_CLEAR`` (waiting up to
    ``timeout`` s for another clear or restore; LaneBusyError past it, nothing changed).

    A lane whose lease it can take is emptied (``empty_lane``: window and episode records).
    A lane with a live writer (of any handle or process) gets its floor set to its
    ``committed`` instead (``slots.set_floor``): the writer is neither waited for nor
    touched, and what it publishes from then on (an add overlapping the clear included)
    counts as written after the clear. Its episode records starting below the floor read
    as not held; rows stay in their slots until overwritten, unreachable.
    """
    lease = storage.segment.lease()
    lock_floors(lease, storage.name, timeout, "clear()")
    try:
        for k in range(storage.lanes):
            if lease.try_lock(L.lock_lane(k)):  # held until the end, like lock_all_lanes
                storage.empty_lane(k)
            else:
                slots.set_floor(storage.cleared_below, k, storage.committed[k])
    finally:
        lease.close()


def _column(mm: Any, c: Any) -> np.ndarray:
    return np.frombuffer(
        mm, c.dtype, count=int(np.prod(c.shape, dtype=np.int64)), offset=c.offset
    ).reshape(c.shape)
