"""Row stores: the one place where a writer's rows are published under the per-slot seqlock.

A lane's store (``lane_store``) holds the lane's cursor and publishes its rows (``append`` and
``put`` one row, ``put_many`` rows): ``_add_c.LaneStore`` where that extension was built, else
``NumpyLaneStore`` (through ``slots``), with the same bytes. ``add_method`` gives a writer class
its ``add`` for a spec, with a signature that names the fields. ``LanesStore`` puts one row in each
of several lanes at once (``CompiledLanesStore``: through the lanes' compiled stores). Rows given with an actor priority (``actor_priorities`` buffers) are
published by a store made ``with_priorities`` (compiled or NumPy, as the lane's own): the
priority columns are two more columns of the row, under the same stamps and ``committed``;
``forget_priorities`` takes back the tags of rows that were claimed but never published.
"""

from __future__ import annotations

import inspect
import os
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from . import layout as L
from . import slots
from .checks import ring_segments
from .rowcheck import RowChecker, fast_scalars
from .spec import Field

if TYPE_CHECKING:
    from .storage import BufferStorage

# Large rows go past the caches (``large_rows``) unless SHMBUF_STREAM=off: then every store,
# compiled or NumPy, writes them through the caches (for measuring what streaming buys).
STREAMING = os.environ.get("SHMBUF_STREAM", "").lower() != "off"
stream_rows: Callable[[np.ndarray, int, Any, int], bool] | None = None
if STREAMING:  # optional, built where a compiler was at hand (setup.py): else NumPy's stores
    try:
        from ._stream_c import store_rows as stream_rows
    except ImportError:
        pass

# The compiled store and add (optional, built against NumPy's headers: a NumPy older than the
# one it was built against raises ImportError). SHMBUF_STORE=numpy leaves them out.
_compiled: Any = None
if os.environ.get("SHMBUF_STORE", "").lower() != "numpy":
    try:
        from . import _add_c as _compiled
    except ImportError:
        pass
CompiledStore: Any = None if _compiled is None else _compiled.LaneStore
CompiledAdd: Any = None if _compiled is None else _compiled.AddMethod
COMPILED_MAX_FIELDS: int = 0 if _compiled is None else _compiled.MAX_FIELDS

# Rows of at least this many bytes are stored streaming past the caches (``_stream_c.c``): an
# Atari frame stack (28 KB) in about half the time of NumPy's copy, which first reads every
# cache line it writes. Below a few KB a row is better left in the cache it is written to.
STREAM_MIN_ROW_BYTES = 4096
_INT64 = (-(1 << 63), (1 << 63) - 1)
_STEP_MASK = L.STEP_MASK
# The priority columns as fields of a row (``with_priorities`` stores), after the spec's.
PRIORITY_FIELDS = tuple(Field(name, (), dtype) for name, dtype in L.PRIORITY_COLUMNS)


def large_rows(field: Field) -> bool:
    """Whether rows of ``field`` are large enough to store streaming past the caches
    (``STREAM_MIN_ROW_BYTES``): by ``stream_rows`` and by the compiled store (never with
    SHMBUF_STREAM=off)."""
    return STREAMING and field.dtype.itemsize * int(np.prod(field.shape)) >= STREAM_MIN_ROW_BYTES


def streams(field: Field) -> bool:
    """Whether ``NumpyLaneStore`` stores rows of ``field`` with ``stream_rows``: large rows of
    plain numeric dtypes, where the streaming extension was built. A row it cannot take as it
    is (another dtype, not contiguous) it refuses, and NumPy stores it."""
    return (stream_rows is not None and field.dtype.kind in "biuf" and field.dtype.isnative
            and large_rows(field))


def compiled_for(checker: RowChecker, extra: int = 0) -> bool:
    """Whether writers of ``checker``'s spec get the compiled store and add: where ``_add_c``
    was built, for up to ``COMPILED_MAX_FIELDS`` fields (pending row and ``extra`` columns,
    e.g. the priority columns, included)."""
    return CompiledStore is not None and len(checker.fields) + extra <= COMPILED_MAX_FIELDS


class LaneStore(Protocol):
    """A lane's store: its cursor and the publication of its rows (``lane_store``).

    ``append``, ``put`` and ``put_many`` take values ``RowChecker`` let through (any strides:
    a value of the field's dtype is copied as its bytes lie, others as NumPy converts them) and
    store them by the seqlock protocol of ``slots``: ``reserved``, odd stamps, the rows, the
    ``_meta`` words, even stamps, ``committed``. Given a value for the pending field too (a
    derived buffer's ``next_obs``, last), they keep its last row for the episode's FINAL row.
    A store made ``with_priorities`` stores two more columns after the fields',
    ``layout.PRIORITY_COLUMNS``: each call then takes a priority and a row tag
    (``layout.priority_row_tag``) after the fields' values, before the pending row's.
    (Issue 30's writes at an index are ``put``.)
    The cursor (``next``, ``step``, ``episode_bits`` and the room ``room_until``/``lim_gen``
    granted by the rate limiter) is the writer's state; the compiled add reads and advances it.

    Concurrency: only the holder of the lane's writer lease calls it; it stores the lane's
    ``reserved`` and ``committed``, its slots' stamps, meta words and rows, nothing else.
    """

    compiled: bool
    next: int
    step: int
    episode_bits: int
    room_until: int
    lim_gen: int

    def append(self, values: Sequence[Any]) -> int | None:
        """Publish one row at the cursor (its index is returned, the cursor advanced) if the
        room granted is left (``next < room_until``, ``lim_gen`` still the limiter's); else
        None, and nothing is stored."""

    def put(self, index: int, meta: int, values: Sequence[Any]) -> None:
        """Publish one row at logical ``index`` with meta word ``meta``."""

    def put_many(self, first: int, meta: int, arrays: Sequence[np.ndarray]) -> None:
        """Publish rows ``first .. first + n - 1`` (``arrays`` of ``[n, *shape]``), keeping
        the last ``capacity`` of them; row j's meta word is ``meta`` with its step plus j."""

    def release(self) -> None:
        """Drop every view of the segment (idempotent); ``put`` raises from then on."""


def lane_store(storage: BufferStorage, lane: int, checker: RowChecker,
               pending: np.ndarray | None, with_priorities: bool = False) -> LaneStore:
    """The store of ``lane`` for writers of ``checker``'s fields (the spec's, then ``next_obs``
    of a derived buffer, kept in ``pending``, not stored): compiled where ``compiled_for``.
    ``with_priorities``: it also stores the priority columns (``LaneStore``), which the
    compiled store takes as two more columns."""
    extra = len(PRIORITY_FIELDS) if with_priorities else 0
    if not compiled_for(checker, extra):
        return NumpyLaneStore(storage, lane, checker, pending, with_priorities)
    lay, C = storage.layout, storage.capacity
    columns = [storage.columns[name][lane * C : (lane + 1) * C] for name in storage.spec]
    at = (lay.lane_word(lane, L.LANE_COMMITTED) // 8, lay.lane_word(lane, L.LANE_RESERVED) // 8,
          storage.limiter.generation_index, lay.stamp(lane * C) // 8,
          lay.meta.offset // 8 + lane * C, C, L.STEP_MASK)  # word offsets, capacity, step mask
    k = len(columns)  # the fields' columns; then the priority columns; then the pending row
    given = [*checker.fields[:k], *(PRIORITY_FIELDS if with_priorities else ()),
             *checker.fields[k:]]
    if with_priorities:
        columns += [column[lane * C : (lane + 1) * C] for column in priority_columns(storage)]
    dests = [*columns, *([] if pending is None else [pending])]
    fields = [_compiled_field(f, dest) for f, dest in zip(given, dests, strict=True)]
    pending_field = fields.pop() if pending is not None else None
    store: LaneStore = CompiledStore(storage.words, at, tuple(f.name for f in given), fields,
                                     pending_field)
    return store


def _compiled_field(f: Field, dest: np.ndarray) -> tuple[Any, ...]:
    """A field as ``_add_c.LaneStore`` takes it: which Python numbers it converts itself."""
    numbers = f.shape == () and f.dtype.itemsize <= 16 and f.dtype.isnative
    types_, int_lo, int_hi, f_lo, f_hi = fast_scalars(f)
    plain = f.dtype.kind in "biu" or f.dtype.kind == "f" and f.dtype.itemsize in (4, 8)
    if not numbers or not plain:  # it converts Python numbers only into these
        types_, int_lo, int_hi, f_lo, f_hi = frozenset(), 1, 0, 1.0, 0.0
    return (f.dtype, f.shape, dest, large_rows(f), numbers, bool in types_, float in types_,
            max(int_lo, _INT64[0]), min(int_hi, _INT64[1]), f_lo, f_hi)


class NumpyLaneStore:
    """``LaneStore`` in NumPy, through ``slots`` (where ``_add_c`` was not built).

    Concurrency: as ``LaneStore``.
    """

    compiled = False

    def __init__(self, storage: BufferStorage, lane: int, checker: RowChecker,
                 pending: np.ndarray | None, with_priorities: bool = False) -> None:
        lay, C = storage.layout, storage.capacity
        self._capacity = C
        self._words = storage.words
        self._at_committed = lay.lane_word(lane, L.LANE_COMMITTED) // 8
        self._at_reserved = lay.lane_word(lane, L.LANE_RESERVED) // 8
        self._at_lim_gen = storage.limiter.generation_index
        self._at = (lay.stamp(lane * C) // 8, lay.meta.offset // 8 + lane * C,
                    self._at_committed, self._at_reserved, C)  # slots.write_row's
        base = lane * C
        self._columns = [storage.columns[name][base : base + C] for name in storage.spec]
        # put_many's store per field: streamed for large rows (None: NumPy's)
        self._row_stores = [stream_rows if streams(f) else None
                            for f in checker.fields[: len(self._columns)]]
        if with_priorities:  # the priority and its row tag, after the fields' columns
            self._columns += [column[base : base + C] for column in priority_columns(storage)]
            self._row_stores += [None, None]
        self._ncolumns = len(self._columns)
        self._slot_stamps = storage.stamps[base : base + C]
        self._slot_meta = storage.meta[base : base + C]
        self._pending = pending
        self._ramp = self._ramp2 = np.arange(0, dtype=np.int64)
        self._k0 = np.zeros((), np.int64)  # 0-d operand: ufuncs take it faster than an int
        self.next = self.step = self.episode_bits = self.room_until = 0
        self.lim_gen = -1

    def append(self, values: Sequence[Any]) -> int | None:
        i = self.next
        if i >= self.room_until or self._words[self._at_lim_gen] != self.lim_gen:
            return None
        slots.write_row(self._words, self._at, i, self._columns, values,
                        self.episode_bits | (self.step & _STEP_MASK))
        self.next = i + 1
        self.step += 1
        if self._pending is not None and len(values) > self._ncolumns:
            self._pending[...] = values[-1]
        return i

    def put(self, index: int, meta: int, values: Sequence[Any]) -> None:
        slots.write_row(self._words, self._at, index, self._columns, values, meta)
        if self._pending is not None and len(values) > self._ncolumns:
            self._pending[...] = values[-1]

    def put_many(self, first: int, meta: int, arrays: Sequence[np.ndarray]) -> None:
        n = arrays[0].shape[0]
        if n == 0:
            return
        C = self._capacity
        keep = min(n, C)
        skip = n - keep
        end = first + n
        q = self._words
        if end > q[self._at_reserved]:
            slots.claim(q, self._at_reserved, end)
        if self._ramp.shape[0] < keep:
            size = min(max(keep, 2 * self._ramp.shape[0], 1024), C)
            self._ramp = np.arange(size, dtype=np.int64)
            self._ramp2 = self._ramp * 2
        ramp, k0, add = self._ramp, self._k0, np.add
        segments = ring_segments(first + skip, keep, C)
        slots.mark_ring_writing(self._slot_stamps, segments, first + skip, self._ramp2, k0)
        for col, arr, store in zip(self._columns, arrays, self._row_stores):
            for a, b, off in segments:
                rows = arr[skip + off : skip + off + (b - a)] if skip or len(segments) > 1 else arr
                if store is None or not store(col, a, rows, b - a):  # fenced: see _stream_c.c
                    col[a:b] = rows
        bits, step = meta & ~_STEP_MASK, meta & _STEP_MASK
        for a, b, off in segments:
            k0[()] = bits | ((step + skip + off) & _STEP_MASK)
            add(ramp[: b - a], k0, self._slot_meta[a:b])
        slots.mark_ring_held(self._slot_stamps, segments)
        slots.publish(q, self._at_committed, end)
        if self._pending is not None and len(arrays) > self._ncolumns:
            self._pending[...] = arrays[-1][-1]

    def release(self) -> None:
        self._columns = []
        self._words = self._slot_stamps = self._slot_meta = None  # type: ignore[assignment]


class LanesStore:
    """One row in each of several lanes, each step of the protocol one NumPy store over all the
    lanes, in the order a single row takes: claim, odd stamp, columns, meta, even stamp,
    ``committed`` (``VectorWriter``: a step of every env, the FINAL rows of those that end).

    Concurrency: as ``LaneStore``, for each of the lanes (its vector writer holds their leases).
    """

    compiled = False

    def __init__(self, storage: BufferStorage, lanes: np.ndarray,
                 with_priorities: bool = False) -> None:
        self._lanes, self._capacity = lanes, storage.capacity
        self._columns = [storage.columns[name] for name in storage.spec]
        if with_priorities:  # as NumpyLaneStore's: the priority and its row tag, last
            self._columns += priority_columns(storage)
        self._slot_stamps, self._slot_meta = storage.stamps, storage.meta
        self._committed_v, self._reserved_v = storage.committed, storage.reserved

    def put(self, index: np.ndarray, meta: np.ndarray, values: Sequence[Any],
            lanes: np.ndarray | None = None) -> None:
        """Publish a row at ``index[e]`` of lane ``lanes[e]`` (default: this store's lanes),
        from ``values`` (one per stored column, ``[len(lanes), *shape]``; values past them are
        not stored)."""
        lanes = self._lanes if lanes is None else lanes
        slot_ids = lanes * self._capacity + index % self._capacity
        claimed = self._reserved_v[lanes]  # (a dead writer's claim may reach past index + 1)
        slots.claim(self._reserved_v, lanes, np.maximum(claimed, index + 1))
        slots.mark_writing(self._slot_stamps, slot_ids, index)
        for col, v in zip(self._columns, values):
            col[slot_ids] = v
        self._slot_meta[slot_ids] = meta
        slots.mark_held(self._slot_stamps, slot_ids, index)
        slots.publish(self._committed_v, lanes, index + 1)

    def release(self) -> None:
        self._columns = []
        self._slot_stamps = self._slot_meta = None  # type: ignore[assignment]
        self._committed_v = self._reserved_v = None  # type: ignore[assignment]


class CompiledLanesStore:
    """``LanesStore.put`` by the lanes' own compiled stores (``_add_c.put_lanes``: each row by
    the compiled store's one protocol, lane after lane, in C), where every lane's store is
    compiled (``lanes_store``).

    Concurrency: as ``LanesStore``.
    """

    compiled = True

    def __init__(self, lanes: np.ndarray, stores: Sequence[Any], fields: Sequence[Field]
                 ) -> None:
        self._stores = list(stores)
        self._of = dict(zip(lanes.tolist(), self._stores))
        self._shapes = [f.shape for f in fields]

    def put(self, index: np.ndarray, meta: np.ndarray, values: Sequence[Any],
            lanes: np.ndarray | None = None) -> None:
        """As ``LanesStore.put``; with ``lanes``, a value may be one row for all of them."""
        if lanes is None:
            _compiled.put_lanes(self._stores, index, meta, values)
            return
        stores = [self._of[k] for k in lanes.tolist()]  # (episode ends: FINAL rows)
        rows = [np.broadcast_to(v, (len(stores), *shape))
                for v, shape in zip(values, self._shapes)]
        _compiled.put_lanes(stores, np.broadcast_to(index, (len(stores),)),
                            np.broadcast_to(meta, (len(stores),)), rows)

    def release(self) -> None:
        self._stores, self._of = [], {}


def lanes_store(storage: BufferStorage, lanes: np.ndarray, stores: Sequence[Any]
                ) -> LanesStore | CompiledLanesStore:
    """The store of one row in each of ``lanes`` (their lanes' ``stores``, in order): by
    those stores where every one is compiled, else ``LanesStore`` (NumPy)."""
    if stores and all(getattr(st, "compiled", False) for st in stores):
        return CompiledLanesStore(lanes, stores, list(storage.spec.values()))
    return LanesStore(storage, lanes)


def priority_columns(storage: BufferStorage) -> list[np.ndarray]:
    """The buffer's ``_priority`` and ``_priority_row`` columns (every slot), or ValueError
    where it keeps none (the writers refuse first, naming the fix)."""
    if storage.priority is None or storage.priority_row is None:
        raise ValueError(f"buffer {storage.name!r} keeps no actor priorities")
    return [storage.priority, storage.priority_row]


def forget_priorities(storage: BufferStorage, lanes: Any, first: Any, end: Any) -> None:
    """Take back the priorities given with rows ``first .. end - 1`` of ``lanes`` (ints, or
    arrays of one row per lane) that their writer claimed but never published: a row that
    their writer (or the next writer of the lane) then writes again at the same index without
    a priority must not find one. Only tags that name such a row are cleared, so a slot still
    holding an older, published row keeps that row's. The caller holds the lanes' leases.

    Concurrency: only slots at or above their lane's ``committed`` are touched (no reader
    takes them for a published row, and the learner's sync checks the stamps around them).
    """
    tags = storage.priority_row
    if tags is None:
        return
    C = storage.capacity
    lanes, first, end = (np.atleast_1d(np.asarray(a, np.int64)) for a in (lanes, first, end))
    for lane, lo, hi in zip(lanes.tolist(), first.tolist(), end.tolist()):  # (one per lane)
        lo = max(lo, hi - C, int(storage.committed[lane]))
        if hi <= lo:
            continue
        index = np.arange(lo, hi, dtype=np.int64)
        slot = lane * C + index % C
        tags[slot[tags[slot] == L.priority_row_tag(index)]] = 0


# --------------------------------------------------------------------------------------------
# A writer class's add
# --------------------------------------------------------------------------------------------
def add_method(method: Callable[..., Any], checker: RowChecker, one_env: bool = False
               ) -> Callable[..., Any]:
    """``method`` (a writer's Python ``add``, ``(self, /, **fields)``) as the ``add`` of a writer
    class of ``checker``'s spec, with a signature that names the fields (``help``, ``inspect``).

    Where ``compiled_for``: ``_add_c.AddMethod``, which stores a row straight into the writer's
    ``_store`` where every value stores as it is and room is left, and calls ``method`` for the
    rest (``one_env``: a one-env vector writer's rows ``[1, *shape]``, the index returned as an
    array of one). Else a copy of ``method`` (the same code object: nothing is compiled here)."""
    add: Any
    if compiled_for(checker):
        add = CompiledAdd(method, one_env)
    else:
        add = types.FunctionType(method.__code__, method.__globals__, method.__name__,
                                 method.__defaults__, method.__closure__)  # type: ignore[attr-defined]
        add.__kwdefaults__ = method.__kwdefaults__  # type: ignore[attr-defined]
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(add, attr, getattr(method, attr))
    add.__signature__ = _signature(checker, one_env)
    return add  # type: ignore[no-any-return]


def _signature(checker: RowChecker, one_env: bool) -> inspect.Signature:
    """``(self, /, *, <a keyword per field>) -> int`` (one_env: rows ``[1, *shape]``, an array
    returned), or ``(self, /, **fields)`` where a name cannot be a parameter."""
    P = inspect.Parameter
    lead = (1,) if one_env else ()
    try:
        params = [P(f.name, P.KEYWORD_ONLY, annotation=f"{f.dtype} {(*lead, *f.shape)}")
                  for f in checker.fields]
        return inspect.Signature([P("self", P.POSITIONAL_ONLY), *params],
                                 return_annotation="np.ndarray" if one_env else "int")
    except ValueError:  # not an identifier, a keyword, or "self"
        return inspect.Signature([P("self", P.POSITIONAL_ONLY), P("fields", P.VAR_KEYWORD)])
