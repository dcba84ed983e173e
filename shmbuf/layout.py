"""Byte layout of shmbuf segments: frozen constants and pure offset math, no I/O.

Every segment (replay buffer or staging ring) starts with the same header page, whose fixed
prefix is ``HEADER`` (one struct, its field offsets ``H_*`` beside it, below):

- 8 bytes  magic ``b"SHMBUF\\0\\1"``, written last by the creator, so an attacher that sees it
  knows the rest of the header is complete.
- u32 @ 8  format version (``FORMAT_VERSION``).
- u32 @ 12 kind: 1 = replay buffer, 2 = staging ring, 3 = priority table, 4 = weight store
  (``KIND_NAMES``).
- u64 @ 16 total size of the segment in bytes.
- u64 @ 24 owner pid.  u64 @ 32 owner start time (clock ticks since boot, /proc/PID/stat #22).
- f64 @ 40 creation time (Unix seconds).  u32 @ 48 owner uid.  u32 @ 52 layout JSON length.
- bytes @ 64 the layout JSON (spec, capacity, lanes, ...), a JSON object of at most
  ``MAX_LAYOUT_JSON`` bytes nested at most ``MAX_LAYOUT_DEPTH`` deep; the header is padded to
  a multiple of 4096 bytes. The whole segment is a multiple of 4096 bytes.

A replay buffer's body, each region 64-byte aligned:

- lane headers: ``LANE_LINES`` 64-byte lines per lane, one hot u64 per line (``LANE_*``), plus
  the lane's "cleared below" floor in word ``CLEARED_BELOW_WORD`` of the rarely written
  ``LANE_EPOCH`` line (format version 2): ``clear()`` stores the lane's ``committed`` there when
  a live writer keeps it from emptying the lane itself; readers never read below it.
- limiter block: ``LIMITER_CONFIG_LINES`` lines of config then ``MAX_SAMPLERS`` counter lines.
- slot stamps: one u64 per slot, ``lanes * capacity`` of them.  Lane k owns slots
  ``[k*C, (k+1)*C)``; index i of lane k lives in slot ``k*C + i % C``.
- ``_meta`` column: one u64 per slot, ``episode << 32 | flags | step_in_episode`` (``FLAG_FINAL``:
  the row holds an episode's final observation, not a transition; derived-next_obs buffers only).
- one column per field, ``[lanes * capacity, *shape]``, contiguous.
- actor priorities (only in buffers created with ``actor_priorities=True``, whose layout JSON
  says ``"actor_priorities": true``; a document without the key has none, so older segments
  attach unchanged): ``_priority``, one f64 per slot, the priority a writer gave with the row,
  and ``_priority_row``, one i64 per slot, ``i + 1`` where row i was given that priority (0:
  never). Both are stored between the row's odd and even stamps, so they are published by the
  row's ``committed``; a row written without one leaves the slot's ``_priority_row`` naming an
  older row, and so has none (``PRIORITY_COLUMNS``, ``priority_row_tag``).
- the episode table: per lane a ring of ``episode_capacity`` records, record e of lane k at
  ``k*E + e % E``, as columns ``_ep_stamp`` (2e+1 while written, 2e+2 once held), ``_ep_start``
  (logical index of the episode's first step), ``_ep_length`` (its transitions), ``_ep_flags``
  (``EPISODE_TRUNCATED``) and one column per field of the episode spec.

A staging ring's body is laid out by ``workers.staging``: a line of pool counters, its slot
control lines and slot data. Its layout JSON says where the counters are (``pool_stats``: their
lines and word names) and where the control words are (``slot_control``), so readers that do not
import ``workers`` (``shmbuf top``) find them there, never in a constant of this module.

A weight store's body (``shmbuf.weights``, whose docstring lays it out byte by byte beside its
offsets) is a control line, one stamp line per copy and ``WEIGHT_COPIES`` copies of its
tensors; its layout JSON lists the tensors (``"tensors"``) and the copies (``"copies"``).

All words are little-endian (only little-endian machines are supported). Advisory OFD locks on the
segment's file (never on its bytes) mark who is alive: ``LOCK_OWNER`` for the creator,
``lock_lane(k)`` for lane k's writer, ``LOCK_LIMITER`` for the pool that drives the rate limiter,
``LOCK_CLEAR`` for whoever stores the lanes' floors (``clear()``, restores), ``LOCK_PUBLISHER``
for a weight store's publisher.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

MAGIC = b"SHMBUF\x00\x01"
FORMAT_VERSION = 2  # 2: the lanes' "cleared below" floors (version 1 shmbufs would ignore them)
KIND_BUFFER = 1
KIND_STAGING = 2
KIND_PRIORITY = 3
KIND_WEIGHTS = 4  # shmbuf.weights.WeightStore
KIND_NAMES = {KIND_BUFFER: "replay buffer", KIND_STAGING: "staging ring",
              KIND_PRIORITY: "priority table", KIND_WEIGHTS: "weight store"}
KIND_TAGS = {KIND_BUFFER: "buf", KIND_STAGING: "staging", KIND_PRIORITY: "prio",
             KIND_WEIGHTS: "weights"}  # default names
WEIGHT_COPIES = 2  # a weight store's copies of its tensors (double buffering; shmbuf.weights)

PAGE = 4096
LINE = 64
WORD = 8
WORDS_PER_LINE = LINE // WORD

# Fixed header prefix: HEADER packs and unpacks it; H_* are its fields' byte offsets, in order
# (tests/test_layout.py checks the two agree).
HEADER = struct.Struct("<8sIIQQQdII")
H_MAGIC = 0  # 8s   MAGIC once the header is complete
H_VERSION = 8  # u32  FORMAT_VERSION
H_KIND = 12  # u32  KIND_*
H_TOTAL_SIZE = 16  # u64  segment size in bytes
H_OWNER_PID = 24  # u64
H_OWNER_START = 32  # u64  clock ticks since boot
H_CREATED = 40  # f64  Unix seconds
H_OWNER_UID = 48  # u32
H_JSON_LEN = 52  # u32  layout JSON length in bytes; 56..63 are zero
H_JSON = 64  # the layout JSON, then zeros up to header_size()
MAX_LAYOUT_JSON = 1 << 20  # bytes; a spec of thousands of fields stays far below
MAX_LAYOUT_DEPTH = 32  # nesting of the layout JSON (a spec nests 4 deep)
MAX_CREATED = 1e11  # creation times past this (year 5138) are corrupt
MAX_ROWS = 1 << 40  # capacity, episode_capacity: bounds a header can claim
MAX_STAGING_SLOTS = 1 << 16

# Lane header: one hot word per 64-byte line. Only the lane's writer stores any of them.
LANE_COMMITTED = 0  # transitions published: indices [0, committed) were written
LANE_RESERVED = 1  # writer's claim: indices [committed, reserved) are being written
LANE_EPISODE = 2  # id of the episode the next add belongs to
LANE_EPOCH = 3  # bumped by every writer that takes the lane
LANE_HEARTBEAT = 4  # time.time_ns() of the writer's last publish (sampled, not every add)
LANE_WRITER_PID = 5  # pid of the lane's current (or last) writer
LANE_EPISODE_START = 6  # logical index of the current episode's first step
LANE_CONSUMED = 7  # queue mode: rows below this were consumed (released by a learner; ``Limiter``)
LANE_LINES = 8
# Word 1 of the LANE_EPOCH line: the lane's floor, "indices below this were cleared". Stored only
# by the holder of LOCK_CLEAR (clear(), restores); never by the lane's writer, whose hot path
# neither reads nor writes it. Readers take max(window start, floor).
CLEARED_BELOW_WORD = 1

# Limiter block: config lines written by the pool holding LOCK_LIMITER, then one samples counter
# per sampler slot, each written only by the process that holds that sampler slot.
LIM_GENERATION = 0  # bumped whenever the config changes; 0 = never configured
LIM_ACTIVE = 1  # 1 while a pool drives the limiter
LIM_SPI = 2  # samples per insert (f64 bits)
LIM_MIN_DIFF = 3  # f64 bits
LIM_MAX_DIFF = 4  # f64 bits
LIM_MIN_SIZE = 5  # u64
LIM_INSERTS_BASE = 6  # total committed when the limiter was (re)configured
LIM_N_SAMPLERS = 7  # sampler counters [0, n) belong to the limiting pool
LIM_QUEUE = 8  # 1: queue mode, a writer waits while its lane holds `capacity` undelivered rows
LIMITER_CONFIG_LINES = 16
MAX_SAMPLERS = 64

# OFD lock offsets (advisory byte ranges on the file, beyond any data; never touch the bytes).
LOCK_OWNER = 1 << 40
LOCK_LIMITER = LOCK_OWNER + 1
LOCK_CLEAR = LOCK_OWNER + 2  # held while the lanes' floors (CLEARED_BELOW_WORD) are stored
LOCK_PUBLISHER = LOCK_OWNER + 3  # a weight store's one publisher (shmbuf.weights)
LOCK_SAMPLER_BASE = LOCK_OWNER + 1024
LOCK_LANE_BASE = LOCK_OWNER + (1 << 20)

MAX_LANES = 4096
STEP_BITS = 32  # the episode id sits above this many bits of _meta
FLAG_FINAL = 1 << 31  # _meta flag: the row is an episode's final observation, not a transition
STEP_MASK = FLAG_FINAL - 1
EPISODE_TRUNCATED = 1  # _ep_flags bit: the episode was cut short (time limit), not terminated
EPISODE_COLUMNS = ("_ep_stamp", "_ep_start", "_ep_length", "_ep_flags")
# Actor priorities (``actor_priorities=True`` buffers): the priority given with each slot's row
# and the tag saying which row that was (``priority_row_tag``: 0 = none).
PRIORITY_COLUMNS = (("_priority", np.dtype("<f8")), ("_priority_row", np.dtype("<i8")))


def kind_name(kind: int) -> str:
    """What a segment of ``kind`` is, for people (``ls``, ``inspect``, error messages)."""
    return KIND_NAMES.get(kind, f"unknown kind {kind}")


def lock_lane(lane: int) -> int:
    """Byte offset of the OFD lock that lane ``lane``'s writer holds."""
    return LOCK_LANE_BASE + lane


def lock_sampler(slot: int) -> int:
    """Byte offset of the OFD lock held by the process that owns sampler counter ``slot``."""
    return LOCK_SAMPLER_BASE + slot


def align(n: int, to: int = LINE) -> int:
    """Round ``n`` up to a multiple of ``to``."""
    return -(-n // to) * to


def header_size(json_len: int) -> int:
    """Bytes of the header page(s) for a layout JSON of ``json_len`` bytes."""
    return align(H_JSON + json_len, PAGE)


@dataclass(frozen=True)
class Column:
    """One array in a segment body: where it starts and what it holds."""

    name: str
    offset: int
    shape: tuple[int, ...]  # full shape, leading axis = rows
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class BufferLayout:
    """Where everything of a replay buffer lives, derived from (fields, capacity, lanes)."""

    capacity: int
    lanes: int
    header_size: int
    lane_offset: int
    limiter_offset: int
    stamps_offset: int
    meta: Column
    columns: tuple[Column, ...]
    total_size: int
    episode_capacity: int = 0
    episode_columns: tuple[Column, ...] = ()
    priority_columns: tuple[Column, ...] = ()  # ``PRIORITY_COLUMNS``, or none

    @property
    def slots(self) -> int:
        return self.capacity * self.lanes

    def lane_word(self, lane: int, word: int) -> int:
        """Byte offset of hot word ``word`` of lane ``lane``."""
        return self.lane_offset + (lane * LANE_LINES + word) * LINE

    def cleared_below(self, lane: int) -> int:
        """Byte offset of lane ``lane``'s floor (``CLEARED_BELOW_WORD`` of its epoch line)."""
        return self.lane_word(lane, LANE_EPOCH) + CLEARED_BELOW_WORD * WORD

    def limiter_word(self, word: int) -> int:
        return self.limiter_offset + word * LINE

    def sampler_counter(self, slot: int) -> int:
        return self.limiter_offset + (LIMITER_CONFIG_LINES + slot) * LINE

    def stamp(self, slot: int) -> int:
        return self.stamps_offset + slot * WORD


def buffer_layout(
    fields: list[tuple[str, tuple[int, ...], np.dtype]],
    capacity: int,
    lanes: int,
    json_len: int,
    episode_fields: Sequence[tuple[str, tuple[int, ...], np.dtype]] = (),
    episode_capacity: int = 0,
    actor_priorities: bool = False,
) -> BufferLayout:
    """Compute the layout of a replay buffer; pure, so it is the same in every process.
    ``actor_priorities``: with the ``PRIORITY_COLUMNS`` after the fields' columns."""
    if capacity < 1 or lanes < 1:
        raise ValueError(f"capacity and lanes must be >= 1, got {capacity}, {lanes}")
    slots = capacity * lanes
    hdr = header_size(json_len)
    lane_offset = hdr
    limiter_offset = align(lane_offset + lanes * LANE_LINES * LINE)
    stamps_offset = align(limiter_offset + (LIMITER_CONFIG_LINES + MAX_SAMPLERS) * LINE)
    meta_offset = align(stamps_offset + slots * WORD)
    meta = Column("_meta", meta_offset, (slots,), np.dtype("<u8"))
    offset = align(meta_offset + meta.nbytes)
    columns = []
    for name, shape, dtype in fields:
        col = Column(name, offset, (slots, *shape), np.dtype(dtype))
        columns.append(col)
        offset = align(offset + col.nbytes)
    priority_columns = []
    for name, dtype in PRIORITY_COLUMNS if actor_priorities else ():
        col = Column(name, offset, (slots,), dtype)
        priority_columns.append(col)
        offset = align(offset + col.nbytes)
    episode_columns = []
    if episode_capacity > 0:
        records = lanes * episode_capacity
        internal = [(name, (), np.dtype("<i8")) for name in EPISODE_COLUMNS]
        for name, shape, dtype in [*internal, *episode_fields]:
            col = Column(name, offset, (records, *shape), np.dtype(dtype))
            episode_columns.append(col)
            offset = align(offset + col.nbytes)
    total = align(offset, PAGE)
    return BufferLayout(
        capacity=capacity,
        lanes=lanes,
        header_size=hdr,
        lane_offset=lane_offset,
        limiter_offset=limiter_offset,
        stamps_offset=stamps_offset,
        meta=meta,
        columns=tuple(columns),
        total_size=total,
        episode_capacity=episode_capacity,
        episode_columns=tuple(episode_columns),
        priority_columns=tuple(priority_columns),
    )


def _depth(doc: Any) -> int:
    """Nesting depth of a decoded JSON value, without recursion."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_LAYOUT_DEPTH:
            break
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return deepest


# Integer entries a layout document may carry: (lowest, highest) allowed.
_DOC_INTS = {"capacity": (1, MAX_ROWS), "lanes": (1, MAX_LANES),
             "episode_capacity": (0, MAX_ROWS), "n_slots": (1, MAX_STAGING_SLOTS),
             "copies": (WEIGHT_COPIES, WEIGHT_COPIES)}
_DOC_REQUIRED = {KIND_BUFFER: ("capacity", "lanes"), KIND_PRIORITY: ("capacity", "lanes"),
                 KIND_WEIGHTS: ("copies", "tensors")}


def check_layout_doc(kind: int, doc: Any, total_size: int) -> None:
    """Raise ValueError unless ``doc`` is a plausible layout document of a ``kind`` segment of
    ``total_size`` bytes: a JSON object, not too deep, whose geometry is ints in range that fit
    the segment, and whose fields' sizes (rows x shape x itemsize, in exact integers: a shape
    of 2**64 elements does not wrap) fit in ``total_size``, which ``read_header`` has checked
    against the file's real size. Pure, so readers of an untrusted header call it before any
    layout math."""
    if not isinstance(doc, dict):
        raise ValueError(f"the layout is a JSON {type(doc).__name__}, not an object")
    if _depth(doc) > MAX_LAYOUT_DEPTH:
        raise ValueError(f"the layout JSON nests deeper than {MAX_LAYOUT_DEPTH} levels")
    for key in _DOC_REQUIRED.get(kind, ()):
        if key not in doc:
            raise ValueError(f"the layout has no {key!r}")
    for key, (lo, hi) in _DOC_INTS.items():
        if key not in doc:
            continue
        value = doc[key]
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(f"the layout's {key} is {value!r}, not an int in [{lo}, {hi}]")
    # Every slot has at least one 8-byte word (a stamp, a generation) in the body.
    if kind in (KIND_BUFFER, KIND_PRIORITY) and doc["capacity"] * doc["lanes"] * WORD > total_size:
        raise ValueError(
            f"capacity {doc['capacity']} x lanes {doc['lanes']} does not fit in {total_size} bytes"
        )
    if kind == KIND_BUFFER and "spec" not in doc:
        raise ValueError("the layout has no 'spec'")
    needed = 0
    for key in _DOC_FIELD_LISTS:
        if key in doc:
            _check_fields(key, doc[key])
            needed += _fields_bytes(key, doc[key], doc, total_size)
    if needed > total_size:
        raise ValueError(
            f"the layout's fields need at least {needed} bytes, more than the segment's "
            f"{total_size}"
        )


_DOC_FIELD_LISTS = ("spec", "episode_spec", "arrays", "tensors")  # {"name", "shape", "dtype"}
# How many rows of each field list a segment holds: the product of these layout entries (an
# entry a document does not carry counts 1). A staging ring's shapes include the batch axis; a
# weight store holds its tensors once per copy.
_FIELD_ROWS = {"spec": ("capacity", "lanes"), "episode_spec": ("episode_capacity", "lanes"),
               "arrays": ("n_slots",), "tensors": ("copies",)}


def _itemsize(dtype: str) -> int:
    """Bytes of one element of ``dtype``, at least 1; 1 for a string NumPy cannot parse (its
    reader refuses it)."""
    try:
        return max(1, np.dtype(dtype).itemsize)
    except (TypeError, ValueError, OverflowError):
        return 1


def _fields_bytes(key: str, fields: list[dict[str, Any]], doc: dict[str, Any],
                  total_size: int) -> int:
    """Bytes the rows of the field list ``doc[key]`` take at least, in exact integers (a shape
    whose product overflows 64 bits must not wrap into a small size); raise ValueError if one
    field alone does not fit in ``total_size`` bytes, counting one row even where none is
    stored. Call after ``_check_fields`` and the range checks of ``_DOC_INTS``."""
    rows = 1
    for entry in _FIELD_ROWS[key]:
        rows *= doc.get(entry, 1)
    total = 0
    for f in fields:
        row = _itemsize(f["dtype"])
        if 0 not in f["shape"]:
            for d in f["shape"]:  # stop early: a long shape of big dims stays a small int
                row *= d
                if row > total_size:
                    break
        else:
            row = 0
        if max(rows, 1) * row > total_size:
            raise ValueError(
                f"{key} field {f['name'][:40]!r} of shape {str(f['shape'])[:60]}, {rows} times "
                f"over, needs more than the segment's {total_size} bytes"
            )
        total += rows * row
    return total


def _check_fields(key: str, fields: Any) -> None:
    """Each entry of a field list is ``{"name": str, "shape": [int >= 0, ...], "dtype": str}``
    with every dimension at most ``MAX_ROWS``; dtypes themselves are checked by their reader."""
    if not isinstance(fields, list):
        raise ValueError(f"the layout's {key} is a {type(fields).__name__}, not a list")
    for f in fields:
        if not (isinstance(f, dict) and isinstance(f.get("name"), str)
                and isinstance(f.get("dtype"), str) and isinstance(f.get("shape"), list)):
            raise ValueError(f"the layout's {key} has a malformed field {str(f)[:100]}")
        for d in f["shape"]:
            if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= MAX_ROWS:
                raise ValueError(
                    f"field {f['name'][:100]!r} of the layout's {key} has dimension "
                    f"{str(d)[:100]}, not an int in [0, {MAX_ROWS}]"
                )


def encode_layout(doc: dict[str, Any]) -> bytes:
    """The canonical JSON bytes stored in a header (sorted keys, so equal layouts are equal)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


# Stamps: index i being written is 2i+1 (odd), index i held is 2i+2 (even), 0 = never written.
def stamp_writing(index: int) -> int:
    return 2 * index + 1


def stamp_held(index: int) -> int:
    return 2 * index + 2


def priority_row_tag(index: Any) -> Any:
    """What ``_priority_row`` holds for row ``index`` given a priority: ``index + 1`` (0, the
    zeroed segment's value, names no row)."""
    return index + 1


def pack_meta(episode: int, step: int, final: bool = False) -> int:
    return (episode << STEP_BITS) | (FLAG_FINAL if final else 0) | (step & STEP_MASK)


# -- moved out, for one release -------------------------------------------------------------------
# The staging ring's pool stats words are laid out by ``workers.staging`` now, and ``shmbuf top``
# finds them through the ring's layout document (``pool_stats``). Their old names here still read,
# with a DeprecationWarning naming the new place, until the next release.
_MOVED_TO_STAGING = {"STAT_BATCHES": 0, "STAT_WAIT_NS": 1, "STAT_RESTARTS": 2, "STAT_WORKERS": 3,
                     "STAT_RECLAIMED": 4, "STAT_RECLAIMED_BYTES": 5, "STAT_ADOPTED": 6,
                     "STAGING_STATS_LINES": 1}

if not TYPE_CHECKING:  # (hidden from mypy, which would otherwise accept any name of this module)

    def __getattr__(name: str) -> int:
        if name in _MOVED_TO_STAGING:
            warnings.warn(f"shmbuf.layout.{name} is deprecated and goes in the next release: "
                          f"use workers.staging.{name}", DeprecationWarning, stacklevel=2)
            return _MOVED_TO_STAGING[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
