"""Snapshots: which rows of which lanes a checkpoint holds, copied out of a live buffer under the
seqlock and compacted, with the episode records; and the restore that writes them back.

Both checkpoint forms (``directory``, ``state``) take and restore a buffer only through here.
A snapshot holds nothing below a lane's floor (``clear()`` under a live writer): rows are read
through ``storage.windows()`` and records that began below it are left out; a restore sets
every floor it rewrites back to 0 (``restore_lane``, under ``LOCK_CLEAR``). A buffer with actor
priorities also gives each row's priority, if its writer gave one (``PRIORITY_COLUMNS``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from .. import layout as L
from .. import slots
from .._progress import Progress
from ..checks import ring_segments
from ..spec import Spec
from ..storage import BufferStorage
from ..store import priority_columns

CHUNK_BYTES = 64 << 20  # rows are copied out of shared memory this many bytes at a time
RECORD_COLUMNS = ("lane", "episode", "start", "length", "flags")  # of Records.table
# A snapshot of an ``actor_priorities`` buffer: per row, the priority its writer gave (0.0 where
# none) and whether one was given (1) or not (0: written without one, or the slot's tag named
# another row). A restore tags the rows given one at their (same) logical index.
PRIORITY_COLUMNS = (("values", np.dtype("<f8")), ("given", np.dtype("|u1")))

# A snapshot's rows, in both forms: one array per field, shape ``[n_0 + ... + n_{L-1}, *shape]``
# for a buffer of L lanes that keep n_0 .. n_{L-1} rows: lane 0's rows oldest first, then lane
# 1's, ...; one int64 ``meta`` word per row (``episode << 32 | flags | step_in_episode``); with
# actor priorities, the ``PRIORITY_COLUMNS`` ``[rows]`` each; and one ``LaneRows`` per lane
# saying where its rows are. Episode records are ``Records``.


@dataclass(frozen=True)
class LaneRows:
    """One lane in a snapshot: logical indices ``[first, first+count)`` of ``lane`` sit at rows
    ``[offset, offset+count)`` of every array, oldest first; ``episode`` and ``episode_start``
    are the lane's episode words."""

    lane: int
    first: int
    count: int
    offset: int
    episode: int
    episode_start: int


@dataclass(frozen=True)
class Records:
    """Episode records: ``table`` int64 ``[n, 5]`` (``RECORD_COLUMNS``: lane, episode, start,
    length, flags), by lane then episode, and each episode-spec field's values ``[n, *shape]``."""

    table: np.ndarray
    fields: dict[str, np.ndarray]


class RowSink(Protocol):
    """Where one column of a snapshot goes while it is taken: rows are stored as
    ``sink[a:b] = rows``, then ``compact`` moves row runs ``(src, dst, count)`` (``dst <= src``,
    ascending) and cuts the column to ``rows`` rows. ``ArrayRows`` keeps them in memory,
    ``_files.NpyWriter`` writes a ``.npy`` file."""

    def __setitem__(self, rows: slice, values: np.ndarray) -> None: ...

    def compact(self, moves: Sequence[tuple[int, int, int]], rows: int) -> None: ...


class ArrayRows:
    """A ``RowSink`` in memory: ``array``; after ``compact``, a new array of the rows kept."""

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.array = np.empty(shape, dtype)

    def __setitem__(self, rows: slice, values: np.ndarray) -> None:
        self.array[rows] = values

    def compact(self, moves: Sequence[tuple[int, int, int]], rows: int) -> None:
        out = np.empty((rows, *self.array.shape[1:]), self.array.dtype)
        for src, dst, count in moves:
            out[dst : dst + count] = self.array[src : src + count]
        self.array = out


def _row_nbytes(spec: Spec, actor_priorities: bool) -> int:
    """Bytes a snapshot holds per row: the fields, the meta word and the priority columns."""
    priorities = sum(d.itemsize for _, d in PRIORITY_COLUMNS) if actor_priorities else 0
    return spec.row_nbytes + L.WORD + priorities


def keeps_priorities(storage: BufferStorage) -> bool:
    """Whether ``storage`` keeps actor priorities (``create(actor_priorities=True)``)."""
    return storage.priority is not None


def buffer_options(storage: BufferStorage) -> dict[str, Any]:
    """What ``ReplayBuffer.create`` needs besides spec, capacity and lanes to recreate the
    buffer (JSON-ready): ``next_obs``, ``episode_spec`` (``[]`` for none), ``episode_capacity``,
    and ``actor_priorities: True`` where it keeps them (only then: a checkpoint of a buffer
    without them is the one it always was)."""
    spec = storage.episode_spec
    return {
        "next_obs": "derived" if storage.derived_next_obs else "stored",
        "episode_spec": spec.to_json() if spec is not None else [],
        "episode_capacity": storage.layout.episode_capacity,
        **({"actor_priorities": True} if keeps_priorities(storage) else {}),
    }


# --------------------------------------------------------------------------------------------
# Taking a snapshot (seqlock-checked reads; writers keep running)
# --------------------------------------------------------------------------------------------
def take_rows(
    storage: BufferStorage,
    sizes: np.ndarray,
    fields: Mapping[str, RowSink],
    meta: RowSink,
    progress: bool | None,
    desc: str,
    priorities: Mapping[str, RowSink] | None = None,
) -> list[LaneRows]:
    """Copy each lane's newest held rows, at most ``sizes[k]`` of lane k (``sizes`` read from
    ``storage.windows()`` when the sinks were sized), into ``fields``, ``meta`` and (a buffer
    with actor priorities) ``priorities`` (one sink per ``PRIORITY_COLUMNS`` name), and return
    where each lane's rows are: packed, lane after lane, with no gap.

    A row that a writer overwrote during the copy is left out with every older row of its lane
    (see ``_copy_lanes``); the sinks are then compacted to the rows kept.
    """
    rows = int(sizes.sum())
    priorities = priorities or {}
    with Progress(rows * _row_nbytes(storage.spec, bool(priorities)), desc, progress) as bar:
        lanes = _copy_lanes(storage, sizes, fields, meta, priorities, bar)
    kept = sum(r.count for r in lanes)
    if kept != rows:  # writers overwrote rows under the copy: close the gaps
        packed, pos = [], 0
        for r in lanes:
            packed.append(replace(r, offset=pos))
            pos += r.count
        moves = [(old.offset, new.offset, old.count) for old, new in zip(lanes, packed)]
        for sink in (*fields.values(), meta, *priorities.values()):
            sink.compact(moves, kept)
        lanes = packed
    return lanes


def _copy_lanes(
    storage: BufferStorage,
    sizes: np.ndarray,
    fields: Mapping[str, RowSink],
    meta: RowSink,
    priorities: Mapping[str, RowSink],
    bar: Progress,
) -> list[LaneRows]:
    """Copy lane k's newest held rows, at most ``sizes[k]``, to rows ``sizes[:k].sum()`` on of
    the sinks, oldest first, and return the rows of each lane that were intact.

    A row's actor priority is read between the same stamps as its fields; it counts as given
    iff the slot's tag names the row (``layout.priority_row_tag``), and is 0.0 otherwise.

    Each lane's window is read just before its copy, after its episode words (a writer moves
    ``episode_start`` only up to its ``committed``, so the window ends at or after it). The rows
    of a window were held when it was read, so a row copied whole is good iff its stamp still
    says so after the copy. Writers overwrite a lane oldest first, so a bad row makes every older
    row suspect too: each lane keeps the suffix after its newest bad row.
    """
    C = storage.capacity
    cols, stamps, meta_words = storage.columns, storage.stamps, storage.meta
    words = storage.lane_words
    row = _row_nbytes(storage.spec, bool(priorities))
    chunk_rows = max(1, CHUNK_BYTES // row)
    lanes = []
    pos = 0
    for k in range(storage.lanes):
        episode_start = int(words[k, L.LANE_EPISODE_START, 0])
        episode = int(words[k, L.LANE_EPISODE, 0])
        win = storage.windows()
        size = int(sizes[k])
        hi = int(win.hi[k])
        lo = max(int(win.lo[k]), hi - size)
        base = k * C
        keep_from = lo
        for i0 in range(lo, hi, chunk_rows):
            i1 = min(i0 + chunk_rows, hi)
            at = pos + (i0 - lo)
            segments = ring_segments(i0, i1 - i0, C)
            before = slots.load_run(stamps, segments, base)  # a rewrite in place changes them
            for a, b, off in segments:
                for name, dst in fields.items():
                    dst[at + off : at + off + (b - a)] = cols[name][base + a : base + b]
                meta[at + off : at + off + (b - a)] = meta_words[base + a : base + b]
                if priorities:
                    values, given = _priorities_of(storage, base + a, base + b, i0 + off)
                    priorities["values"][at + off : at + off + (b - a)] = values
                    priorities["given"][at + off : at + off + (b - a)] = given
            bad = np.flatnonzero(~slots.still_held_run(stamps, segments, base, i0, i1, before))
            if bad.size:
                keep_from = i0 + int(bad[-1]) + 1
            bar.update((i1 - i0) * row)
        bar.update((size - (hi - lo)) * row)  # rows the lane no longer had
        lanes.append(
            LaneRows(
                lane=k,
                first=keep_from,
                count=hi - keep_from,
                offset=pos + (keep_from - lo),
                episode=episode,
                episode_start=min(episode_start, hi),
            )
        )
        pos += size
    return lanes


def _priorities_of(storage: BufferStorage, a: int, b: int, first: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The actor priorities of slots ``[a, b)``, which hold rows ``first ..``: (values, given)
    as ``PRIORITY_COLUMNS``; a slot whose tag names another row has none (0.0, 0)."""
    priority, priority_row = priority_columns(storage)
    given = priority_row[a:b] == L.priority_row_tag(np.arange(first, first + (b - a)))
    return np.where(given, priority[a:b], 0.0), given.astype(np.uint8)


def take_records(storage: BufferStorage) -> Records:
    """Every episode record held now, each copied whole (its stamp said "held" before and after
    the copy; a record being written or overwritten meanwhile is left out)."""
    spec = storage.episode_spec
    fields = dict(spec.items()) if spec is not None else {}
    table = storage.episodes
    if table is None:
        return Records(np.zeros((0, len(RECORD_COLUMNS)), np.int64),
                       {n: np.zeros((0, *f.shape), f.dtype) for n, f in fields.items()})
    rows, ids, (columns, data) = slots.copy_held_records(table.stamp, lambda: (
        [table.start.copy(), table.length.copy(), table.flags.copy()],
        {n: table.data[n].copy() for n in fields}))
    lanes = rows // table.capacity
    above = table.above_floor(columns[0][rows], lanes)  # records cleared under a live writer
    rows, ids, lanes = rows[above], ids[above], lanes[above]
    order = np.lexsort((ids, lanes))
    rows = rows[order]
    records = np.stack([lanes[order], ids[order], *(c[rows] for c in columns)], axis=1)
    return Records(records.astype(np.int64), {n: data[n][rows] for n in fields})


# --------------------------------------------------------------------------------------------
# Restoring one (every lane's lease held)
# --------------------------------------------------------------------------------------------
def restore(
    storage: BufferStorage,
    lanes: Sequence[LaneRows],
    fields: Mapping[str, np.ndarray],
    meta: np.ndarray,
    records: Records | None,
    progress: bool | None,
    desc: str,
    priorities: Mapping[str, np.ndarray] | None = None,
) -> None:
    """Rewrite every lane of ``storage`` from ``lanes``, and its episode records from
    ``records`` (None: it keeps none); a lane keeps its newest ``capacity`` rows, with their
    actor priorities from ``priorities`` (``PRIORITY_COLUMNS``; None: the rows have none). The
    caller has validated everything: the only error expected here is LaneBusyError, raised
    before anything changes."""
    C = storage.capacity
    kept = [min(r.count, C) for r in lanes]
    total = sum(kept) * storage.spec.row_nbytes
    lease = storage.lock_all_lanes()  # LaneBusyError before anything changes
    try:
        with Progress(total, desc, progress) as bar:
            for r, n in zip(lanes, kept):
                a = r.offset + r.count - n
                storage.restore_lane(
                    r.lane,
                    r.first + r.count - n,
                    {name: arr[a : a + n] for name, arr in fields.items()},
                    meta[a : a + n],
                    r.episode,
                    r.episode_start,
                    on_copied=bar.update,
                    priorities=None if priorities is None else
                    (priorities["values"][a : a + n], priorities["given"][a : a + n]),
                )
        _restore_episodes(storage, records)
    finally:
        lease.close()


def _restore_episodes(storage: BufferStorage, records: Records | None) -> None:
    """Replace every lane's episode records with ``records`` (the caller holds every lane's
    lease). A lane keeps its newest ``episode_capacity`` records, as its writer's ring would."""
    table = storage.episodes
    if table is None:
        return
    slots.clear_stamps(table.stamp)  # nothing held while we rewrite
    if records is None or not len(records.table):
        return
    E = table.capacity
    lanes, ids = records.table[:, 0], records.table[:, 1]
    newest = np.full(storage.lanes, -1, np.int64)
    np.maximum.at(newest, lanes, ids)
    keep = ids > newest[lanes] - E
    rec = records.table[keep]
    ids = rec[:, 1]
    r = rec[:, 0] * E + ids % E
    slots.mark_writing(table.stamp, r, ids)
    table.start[r], table.length[r], table.flags[r] = rec[:, 2], rec[:, 3], rec[:, 4]
    for name, col in table.data.items():
        col[r] = records.fields[name][keep]
    slots.mark_held(table.stamp, r, ids)
