"""Saving and restoring replay buffers: a directory of ``.npy`` files plus a JSON manifest, and
in-memory state dicts for training checkpoints.

Reads are seqlock-checked, so saving while writers run is safe; restores hold every lane's lease.

A saved directory holds, for a buffer of L lanes whose lanes keep n_0 .. n_{L-1} rows:

- one ``NNN_<field>.npy`` per field, shape ``[n_0 + ... + n_{L-1}, *shape]``: lane 0's rows oldest
  first, then lane 1's, ... (``/`` in field names becomes ``__``; the manifest names each file);
- ``_meta.npy``, int64 ``[rows]``: each row's ``episode << 32 | flags | step_in_episode``;
- ``_episodes.npy``, int64 ``[records, 5]``: the episode records held (lane, episode, start,
  length, flags), by lane then episode, and one ``_ep_NNN_<field>.npy`` per episode-spec field;
- ``manifest.json``, written last, so a directory without one is an incomplete save (``save``
  writes into a hidden directory and renames it into place only when complete, so only older
  versions leave such directories at the target): format and version, spec, capacity, lanes,
  the buffer's options (``next_obs``, ``episode_spec``, ``episode_capacity``; absent in older
  checkpoints, which load with the defaults), per lane the first logical index kept, the row
  count, the row offset in the files and the lane's episode words, and the episode files.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import reprlib
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import _files
from . import layout as L
from . import slots
from ._progress import Progress
from .checks import positive_int, ring_segments
from .errors import CapacityError, CheckpointError, SpecMismatchError
from .segment import fmt_bytes
from .spec import Spec
from .storage import BufferStorage

FORMAT = "shmbuf-checkpoint"
STATE_FORMAT = "shmbuf-state"
VERSION = 1
MANIFEST = "manifest.json"
META_FILE = "_meta.npy"
EPISODES_FILE = "_episodes.npy"
RECORD_COLUMNS = ("lane", "episode", "start", "length", "flags")  # of EPISODES_FILE
CHUNK_BYTES = 64 << 20  # rows are copied out of shared memory this many bytes at a time
MAX_MANIFEST_BYTES = 16 << 20  # a manifest is a few KiB; a larger file is not one of ours
MAX_INDEX = 1 << 61  # largest logical index or capacity a checkpoint may name (stamps 2i+2: int64)
MAX_EPISODE = (1 << 31) - 1  # episode ids sit above STEP_BITS in the int64 _meta word (the
# record table alone would allow more: episodes.MAX_EPISODE; a lane's rows would not)
MAX_SEGMENT_BYTES = 1 << 62  # a buffer larger than this cannot exist; a manifest saying so is bad

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


@dataclass(frozen=True)
class LaneRows:
    """One lane in a saved layout: logical indices ``[first, first+count)`` of ``lane`` sit at
    rows ``[offset, offset+count)`` of every array, oldest first."""

    lane: int
    first: int
    count: int
    offset: int
    episode: int
    episode_start: int


def file_name(position: int, field: str) -> str:
    """The ``.npy`` name of the ``position``-th field (from 0): ``2, "obs/camera"`` ->
    ``002_obs__camera.npy``."""
    return f"{position:03d}_{_UNSAFE.sub('_', field.replace('/', '__'))}.npy"


# --------------------------------------------------------------------------------------------
# Reading a live buffer (seqlock-checked)
# --------------------------------------------------------------------------------------------
def _row_nbytes(spec: Spec) -> int:
    return spec.row_nbytes + L.WORD  # + the _meta word


def _copy_lanes(
    storage: BufferStorage,
    sizes: np.ndarray,
    out: Mapping[str, Any],
    meta_out: Any,
    bar: Progress,
) -> list[LaneRows]:
    """Copy each lane's newest held rows, at most ``sizes[k]`` of them, into ``out`` (lane k at
    rows ``sizes[:k].sum()`` on, oldest first) and return the rows of each lane that were intact.
    ``out`` and ``meta_out`` are arrays or ``_files.NpyWriter`` s: only ``dst[a:b] = rows`` is used.

    Each lane's window is read just before its copy, after its episode words (a writer moves
    ``episode_start`` only up to its ``committed``, so the window ends at or after it). The rows
    of a window were held when it was read, so a row copied whole is good iff its stamp still
    says so after the copy. Writers overwrite a lane oldest first, so a bad row makes every older
    row suspect too: each lane keeps the suffix after its newest bad row.
    """
    C = storage.capacity
    cols, stamps, meta, words = storage.columns, storage.stamps, storage.meta, storage.lane_words
    row_nbytes = _row_nbytes(storage.spec)
    chunk_rows = max(1, CHUNK_BYTES // row_nbytes)
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
            for a, b, off in segments:
                for name, dst in out.items():
                    dst[at + off : at + off + (b - a)] = cols[name][base + a : base + b]
                meta_out[at + off : at + off + (b - a)] = meta[base + a : base + b]
            bad = np.flatnonzero(~slots.still_held_run(stamps, segments, base, i0, i1))
            if bad.size:
                keep_from = i0 + int(bad[-1]) + 1
            bar.update((i1 - i0) * row_nbytes)
        bar.update((size - (hi - lo)) * row_nbytes)  # rows the lane no longer had
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


def _packed(lanes: list[LaneRows]) -> list[LaneRows]:
    """The same lanes with offsets that leave no gaps."""
    out, pos = [], 0
    for r in lanes:
        out.append(replace(r, offset=pos))
        pos += r.count
    return out


def _copy_rows(src: np.ndarray, dst: np.ndarray, old: list[LaneRows], new: list[LaneRows]) -> None:
    """Move each lane's rows from ``old`` offsets in ``src`` to ``new`` offsets in ``dst``."""
    row = max(1, src.itemsize * int(np.prod(src.shape[1:], dtype=np.int64)))
    step = max(1, CHUNK_BYTES // row)
    for o, n in zip(old, new):
        for j in range(0, o.count, step):
            m = min(step, o.count - j)
            dst[n.offset + j : n.offset + j + m] = src[o.offset + j : o.offset + j + m]


@dataclass(frozen=True)
class Records:
    """Episode records: ``table`` int64 ``[n, 5]`` (``RECORD_COLUMNS``), by lane then episode,
    and each episode-spec field's values ``[n, *shape]``."""

    table: np.ndarray
    fields: dict[str, np.ndarray]


def _options(storage: BufferStorage) -> dict[str, Any]:
    """What ``ReplayBuffer.create`` needs besides spec, capacity and lanes to recreate ``buf``."""
    spec = storage.episode_spec
    return {
        "next_obs": "derived" if storage.derived_next_obs else "stored",
        "episode_spec": spec.to_json() if spec is not None else [],
        "episode_capacity": storage.layout.episode_capacity,
    }


def _copy_episodes(storage: BufferStorage) -> Records:
    """Every episode record held now, each copied whole (its stamp said "held" before and after
    the copy; a record being written or overwritten meanwhile is left out)."""
    spec = storage.episode_spec
    table = storage.episodes
    names = list(spec) if spec is not None else []
    if table is None:
        return Records(np.zeros((0, len(RECORD_COLUMNS)), np.int64),
                       {n: np.zeros((0, *spec[n].shape), spec[n].dtype) for n in names})
    rows, ids, (columns, data) = slots.copy_held_records(table.stamp, lambda: (
        [table.start.copy(), table.length.copy(), table.flags.copy()],
        {n: table.data[n].copy() for n in names}))
    lanes = rows // table.capacity
    order = np.lexsort((ids, lanes))
    rows = rows[order]
    records = np.stack([lanes[order], ids[order], *(c[rows] for c in columns)], axis=1)
    return Records(records.astype(np.int64), {n: data[n][rows] for n in names})


def _check_records(records: Records, n_lanes: int, spec: Spec | None, where: str) -> None:
    """Raise CheckpointError unless ``records`` fit a buffer of ``n_lanes`` with ``spec``."""
    table = records.table
    if table.ndim != 2 or table.shape[1] != len(RECORD_COLUMNS) or table.dtype != np.int64:
        raise CheckpointError(
            f"{where}: the episode records should be int64 [records, {len(RECORD_COLUMNS)}] "
            f"({', '.join(RECORD_COLUMNS)}), found {table.shape} {table.dtype}"
        )
    names = list(spec) if spec is not None else []
    if sorted(records.fields) != sorted(names):
        raise CheckpointError(
            f"{where}: expected values of the episode fields {names}, found "
            f"{sorted(records.fields)}"
        )
    n = table.shape[0]
    for name in names:
        arr, f = records.fields[name], spec[name]
        if arr.shape != (n, *f.shape) or arr.dtype != f.dtype:
            raise CheckpointError(
                f"{where}: episode field {name!r} should be shape {(n, *f.shape)} {f.dtype}, "
                f"found {arr.shape} {arr.dtype}"
            )
    if not n:
        return
    bounds = {"lane": (0, n_lanes - 1), "episode": (0, MAX_EPISODE), "start": (0, MAX_INDEX),
              "length": (0, MAX_INDEX), "flags": (0, L.EPISODE_TRUNCATED)}
    for col, (lo, hi) in bounds.items():
        values = table[:, RECORD_COLUMNS.index(col)]
        bad = np.flatnonzero((values < lo) | (values > hi))
        if bad.size:
            raise CheckpointError(
                f"{where}: episode record {int(bad[0])} has {col} {int(values[bad[0]])}; every "
                f"record's {col} should be in [{lo}, {hi}]. The checkpoint is corrupt or was "
                f"edited. Fix: save the buffer again"
            )
    if np.unique(table[:, 0] * (MAX_EPISODE + 1) + table[:, 1]).size != n:
        raise CheckpointError(
            f"{where}: the episode records hold the same (lane, episode) more than once. The "
            f"checkpoint is corrupt or was edited. Fix: save the buffer again"
        )


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


# --------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------
def save(
    storage: BufferStorage,
    path: str | os.PathLike[str],
    overwrite: bool = False,
    progress: bool | None = None,
) -> None:
    """Write ``buf`` to the directory ``path`` (see the module docstring for the layout).

    Safe while writers run: each lane keeps the rows still intact at the end of the copy.

    Nothing half-made is ever at ``path``. The checkpoint is written into a hidden directory
    beside it (``.<name>.saving-<pid>-<random>``: same parent, so the same filesystem), every
    file and the directory are fsynced, and only then is it moved into place in one step: onto a
    new ``path`` by a rename that replaces nothing; over an old checkpoint (``overwrite=True``)
    by exchanging the two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``), so
    ``path`` holds a complete checkpoint at every instant, even if the process is killed, and the
    old one, now under the hidden name, is deleted after. Where the filesystem cannot exchange,
    the old checkpoint is renamed aside (``.<name>.old-<pid>-<random>``), the new one renamed
    in, then the old one deleted; a failure between the two renames moves the old one back.
    On any exception (a full disk, Ctrl-C in the progress display) the hidden directory is
    removed and ``path`` is as it was. A save killed outright leaves only the hidden directory;
    the next save to ``path`` removes it (the saver holds a lock on it, which dies with it).

    Space is checked before anything is written (``statvfs``; an old checkpoint stays until the
    new one is complete, so replacing one needs room for both) and reserved per file with
    ``posix_fallocate``; rows go in with plain writes, never through a memory map, so a full
    disk is a CapacityError, never a SIGBUS.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False, or it is not a checkpoint.
        CapacityError: the filesystem of ``path`` has too little room; ``path`` is unchanged.
    """
    final = Path(os.path.abspath(path))
    if not final.name:
        raise ValueError(f"cannot save to {os.fspath(path)!r}: name a directory to create")
    replacing = final.exists() or final.is_symlink()
    if replacing:
        _check_replaceable(final, overwrite)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_saves(final)
    sizes = storage.windows().sizes  # rows to allocate; lanes are re-read as they are copied
    needed = _bytes_needed(storage, int(sizes.sum()))
    free, inodes = _files.free_space(parent)
    n_files = len(storage.spec) + len(storage.episode_spec or ()) + 4  # + _meta, _episodes, manifest, dir
    if needed > free or inodes < n_files:
        raise _no_room(final, needed, free, replacing, inodes < n_files)
    tmp = final.with_name(f".{final.name}.saving-{os.getpid()}-{secrets.token_hex(4)}")
    lock, made = None, False
    try:
        tmp.mkdir()
        made = True
        lock = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "a save is writing here"
        _write_checkpoint(storage, tmp, sizes, progress)
        _files.fsync_dir(tmp)
        _move_into_place(tmp, final, overwrite)
        _files.fsync_dir(parent)
    except OSError as e:
        if made:
            shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in _files.NO_ROOM and not isinstance(e, CapacityError):
            free, inodes = _files.free_space(parent)
            raise _no_room(final, needed, free, replacing, inodes < n_files) from None
        raise
    except BaseException:
        if made:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _check_replaceable(path: Path, overwrite: bool) -> None:
    if not overwrite:
        raise FileExistsError(
            f"{path} already exists. Fix: pass overwrite=True to replace it, or save elsewhere"
        )
    if not path.is_dir() or path.is_symlink():
        raise FileExistsError(
            f"{path} exists and is not a directory; refusing to replace it with a checkpoint. "
            f"Fix: remove it, or save elsewhere"
        )
    foreign = [
        p.name for p in path.iterdir()
        if not (p.name == MANIFEST or (p.suffix == ".npy" and p.is_file()))
    ]
    if foreign:
        raise FileExistsError(
            f"{path} exists and holds files that a checkpoint does not ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); refusing to delete them with overwrite=True. "
            f"Fix: save elsewhere, or remove the directory yourself"
        )


def _move_into_place(tmp: Path, final: Path, overwrite: bool) -> None:
    """Make the complete checkpoint at ``tmp`` the one at ``final`` (see ``save``)."""
    if not (final.exists() or final.is_symlink()):
        try:
            if not _files.renameat2(tmp, final, _files.RENAME_NOREPLACE):
                os.rename(tmp, final)  # no renameat2: replaces at most an empty directory
        except FileExistsError:
            raise FileExistsError(
                f"{final} appeared while the buffer was being saved; it was left alone. Fix: "
                f"save again (with overwrite=True to replace it)"
            ) from None
        return
    _check_replaceable(final, overwrite)  # again: it may have changed while we wrote
    if _files.renameat2(tmp, final, _files.RENAME_EXCHANGE):
        shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoint, now at the temp name
        return
    old = final.with_name(f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove_dead_saves(final: Path) -> None:
    """Remove the hidden directories of saves to ``final`` that were killed midway: the ones
    whose lock nobody holds (a live save keeps its directory locked)."""
    prefix = f".{final.name}.saving-"
    try:
        entries = [e for e in os.scandir(final.parent) if e.name.startswith(prefix)]
    except OSError:
        return
    for entry in entries:
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live save
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)


def _npy_nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return len(_files.npy_header(dtype, shape)) + math.prod(shape) * dtype.itemsize


def _bytes_needed(storage: BufferStorage, rows: int) -> int:
    """Disk space a checkpoint of ``rows`` rows takes at most (a block of slack per file)."""
    block = 4096
    spec, i8 = storage.spec, np.dtype("<i8")
    files = [(f.dtype, (rows, *f.shape)) for f in spec.values()] + [(i8, (rows,))]
    records = storage.lanes * storage.layout.episode_capacity if storage.episodes is not None else 0
    files.append((i8, (records, len(RECORD_COLUMNS))))
    for f in (storage.episode_spec or {}).values():
        files.append((f.dtype, (records, *f.shape)))
    manifest = (16 << 10) + 256 * (storage.lanes + len(files))
    return sum(_npy_nbytes(np.dtype(d), s) + block for d, s in files) + manifest


def _no_room(final: Path, needed: int, free: int, replacing: bool,
             no_inodes: bool = False) -> CapacityError:
    both = (" The checkpoint already there stays until the new one is complete, so replacing it "
            "needs room for both." if replacing else "")
    inodes = " and it has no free inodes left" if no_inodes else ""
    return CapacityError(
        f"saving to {final} needs {fmt_bytes(needed)} ({needed} bytes) but only {fmt_bytes(free)} "
        f"free ({free} bytes) are left on its filesystem{inodes}; nothing was saved.{both} Fix: "
        f"free space there, or save elsewhere"
    )


def _write_checkpoint(storage: BufferStorage, directory: Path, sizes: np.ndarray,
                      progress: bool | None) -> None:
    """Write every file of a checkpoint into the (new, empty) ``directory``, the manifest last."""
    spec = storage.spec
    rows = int(sizes.sum())
    files = {name: file_name(i, name) for i, name in enumerate(spec)}
    opened: list[_files.NpyWriter] = []
    try:
        arrays = {}
        for name, f in spec.items():
            arrays[name] = _files.NpyWriter(directory / files[name], f.dtype, (rows, *f.shape))
            opened.append(arrays[name])
        meta = _files.NpyWriter(directory / META_FILE, np.dtype("<i8"), (rows,))
        opened.append(meta)
        with Progress(rows * _row_nbytes(spec), f"saving {storage.name}", progress) as bar:
            lanes = _copy_lanes(storage, sizes, arrays, meta, bar)
        if sum(r.count for r in lanes) != rows:  # writers overwrote rows under the copy: compact
            packed = _packed(lanes)
            rows = sum(r.count for r in packed)
            moves = [(o.offset, n.offset, o.count) for o, n in zip(lanes, packed)]
            for w in opened:
                w.compact(moves, rows, CHUNK_BYTES)
            lanes = packed
        for w in opened:
            w.finish()
        records = _copy_episodes(storage)
        _write_npy(directory / EPISODES_FILE, records.table)
        ep_files = {name: "_ep_" + file_name(i, name) for i, name in enumerate(records.fields)}
        for name, values in records.fields.items():
            _write_npy(directory / ep_files[name], values)
    finally:
        for w in opened:
            w.close()
    n_records = int(records.table.shape[0])
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "created": time.time(),
        "source": storage.name,
        "spec": spec.to_json(),
        "capacity": storage.capacity,
        "lanes": storage.lanes,
        "rows": rows,
        "per_lane": [asdict(r) for r in lanes],
        "fields": [
            {"name": name, "file": files[name], "shape": [rows, *f.shape], "dtype": f.dtype.str}
            for name, f in spec.items()
        ],
        "meta": {"file": META_FILE, "shape": [rows], "dtype": np.dtype("<i8").str},
        **_options(storage),
        "episodes": {
            "records": {"file": EPISODES_FILE, "shape": [n_records, len(RECORD_COLUMNS)],
                        "dtype": np.dtype("<i8").str},
            "columns": list(RECORD_COLUMNS),
            "fields": [
                {"name": name, "file": ep_files[name], "shape": list(values.shape),
                 "dtype": values.dtype.str}
                for name, values in records.fields.items()
            ],
        },
    }
    _files.write_file(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def _write_npy(path: Path, values: np.ndarray) -> None:
    w = _files.NpyWriter(path, values.dtype, values.shape)
    try:
        w[0 : values.shape[0]] = values
        w.finish()
    finally:
        w.close()


# --------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------
def load(
    create: Callable[..., Any],
    path: str | os.PathLike[str],
    name: str | None = None,
    capacity: int | None = None,
    progress: bool | None = None,
) -> Any:
    """Create a buffer with ``create`` (``ReplayBuffer.create``) from a directory written by
    ``save``; see ``ReplayBuffer.load``.

    The whole directory is checked before any shared memory is created: the manifest (read only
    if it is a regular file of at most ``MAX_MANIFEST_BYTES``; every entry's type and range),
    each ``.npy`` file (a regular file, opened without blocking; its header's shape and dtype;
    its length) and the episode records' values, so a bad checkpoint is a CheckpointError naming
    the file and the entry. A failure after the buffer exists closes (and unlinks) it.
    """
    directory = Path(path)
    doc = _read_manifest(directory)
    where = str(directory / MANIFEST)
    spec, saved_capacity, lanes = _check_manifest(doc, directory)
    options, records = _check_episode_section(doc, directory, len(lanes))
    rows = sum(r.count for r in lanes)
    arrays = {
        name: _files.open_npy(directory / entry["file"], (rows, *f.shape), f.dtype,
                              f"field {name!r}")
        for entry, (name, f) in zip(doc["fields"], spec.items())  # checked: same names, order
    }
    meta = _files.open_npy(directory / doc["meta"]["file"], (rows,), np.dtype("<i8"),
                           "the _meta column")
    if capacity is None:
        capacity = saved_capacity
        _check_size(spec, capacity, len(lanes), options, f"{where}: 'capacity' or 'spec'")
    else:
        capacity = positive_int("capacity", capacity)
        _check_size(spec, capacity, len(lanes), options, "capacity=")
    buf = create(spec, capacity, len(lanes), name, **options)
    try:
        _restore(buf.storage, lanes, arrays, meta, progress, f"loading {directory.name}", records)
    except BaseException:
        buf.close()
        raise
    return buf


def _restore(
    storage: BufferStorage,
    lanes: list[LaneRows],
    arrays: Mapping[str, np.ndarray],
    meta: np.ndarray,
    progress: bool | None,
    desc: str,
    records: Records | None = None,
) -> None:
    """Rewrite every lane of ``buf`` from ``lanes``, and its episode records from ``records``;
    a lane keeps its newest ``capacity`` rows. The caller has validated everything: the only
    error expected here is LaneBusyError, raised before anything changes."""
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
                    {name: arr[a : a + n] for name, arr in arrays.items()},
                    meta[a : a + n],
                    r.episode,
                    r.episode_start,
                    on_copied=bar.update,
                )
        _restore_episodes(storage, records)
    finally:
        lease.close()


# --------------------------------------------------------------------------------------------
# Checking a saved directory or a state dict: every entry's type and range, before any write
# --------------------------------------------------------------------------------------------
def _show(value: Any) -> str:
    """A short repr of an untrusted value (bounded in length and depth)."""
    try:
        return reprlib.repr(value)
    except Exception:  # noqa: BLE001 - a user object whose __repr__ fails
        return f"<{type(value).__name__}>"


def _bad(where: str, text: str) -> CheckpointError:
    return CheckpointError(f"{where}: {text}. The checkpoint is corrupt or was edited. Fix: save "
                           f"the buffer again")


def _entry(doc: Mapping[str, Any], key: str, where: str) -> Any:
    try:
        return doc[key]
    except KeyError:
        raise _bad(where, f"the required entry {key!r} is missing") from None


def _check_int(value: Any, what: str, lo: int, hi: int, where: str) -> int:
    """``value`` as an int in ``[lo, hi]``: a bool, float or numeric string is refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise _bad(where, f"{what} should be an int, found {_show(value)} "
                          f"({type(value).__name__})")
    v = int(value)
    if not lo <= v <= hi:
        expected = str(lo) if lo == hi else f"an int in [{lo}, {hi}]"
        raise _bad(where, f"{what} is {v}; expected {expected}")
    return v


def _spec_from_json(value: Any, key: str, where: str) -> Spec:
    if not isinstance(value, list):
        raise _bad(where, f"{key!r} should be a list of fields (name, shape, dtype), found "
                          f"{_show(value)}")
    try:
        return Spec.from_json(value)
    except Exception as e:  # noqa: BLE001 - whatever a malformed field list makes Spec raise
        raise _bad(where, f"{key!r} is malformed ({type(e).__name__}: {_show(str(e))})") from None


def _as_array(value: Any, what: str, where: str) -> np.ndarray:
    try:
        return np.asarray(value)
    except Exception as e:  # noqa: BLE001 - ragged nested lists and the like
        raise _bad(where, f"{what} is not an array ({type(e).__name__}: {_show(str(e))})") from None


def _check_size(spec: Spec, capacity: int, lanes: int, options: Mapping[str, Any],
                what: str) -> None:
    """Refuse a capacity whose buffer no machine could hold (its index math would overflow)."""
    ep_spec, ep_cap = options["episode_spec"], options["episode_capacity"]
    ep_cap = ep_cap if ep_cap is not None else max(64, capacity // 8)
    size = (capacity * lanes * (spec.row_nbytes + 2 * L.WORD)
            + ep_cap * lanes * (4 * L.WORD + (ep_spec.row_nbytes if ep_spec else 0)))
    if capacity <= MAX_INDEX and size <= MAX_SEGMENT_BYTES:
        return
    text = (f"capacity {capacity} x {lanes} lanes of {spec.row_nbytes}-byte rows would need "
            f"{size} bytes of shared memory (at most {MAX_SEGMENT_BYTES} is possible)")
    if what == "capacity=":
        raise ValueError(f"load(capacity={capacity}): {text}. Fix: pass a smaller capacity")
    raise _bad(what, text)


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory} is not a directory; expected a checkpoint directory written by "
            f"buf.save(). Fix: pass the directory that holds {MANIFEST}"
        )
    try:
        data = _files.read_bounded(path, "the manifest", MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        npys = sorted(p.name for p in directory.glob("*.npy"))
        found = f"{len(npys)} .npy file(s) and no manifest" if npys else "no manifest"
        raise CheckpointError(
            f"{path}: missing; found {found}. {MANIFEST} is written last, so this is an "
            f"incomplete save (it was interrupted) or not a shmbuf checkpoint. Fix: save the "
            f"buffer again"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e}). Fix: save the buffer again") from None
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(
            f"{path}: expected JSON, found a corrupt file ({type(e).__name__}: "
            f"{_show(str(e))}). Fix: save the buffer again"
        ) from None
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if not isinstance(fmt, str) or fmt != FORMAT:
        found = _show(fmt) if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
        raise CheckpointError(
            f"{path}: expected format {FORMAT!r}, found {found}: not a shmbuf checkpoint"
        )
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version != VERSION:
        raise CheckpointError(
            f"{path}: expected format version {VERSION}, found {_show(version)}. Fix: load it "
            f"with the shmbuf version that saved it"
        )
    return doc


def _check_manifest(doc: dict[str, Any], directory: Path) -> tuple[Spec, int, list[LaneRows]]:
    """Validate the manifest's own consistency (not the .npy files); return (spec, capacity,
    lanes)."""
    where = str(directory / MANIFEST)
    spec = _spec_from_json(_entry(doc, "spec", where), "spec", where)
    capacity = _check_int(_entry(doc, "capacity", where), "'capacity'", 1, MAX_INDEX, where)
    n_lanes = _check_int(_entry(doc, "lanes", where), "'lanes'", 1, L.MAX_LANES, where)
    rows = _check_int(_entry(doc, "rows", where), "'rows'", 0, capacity * n_lanes, where)
    lanes = _check_lanes(_entry(doc, "per_lane", where), n_lanes, capacity, rows, where)
    fields = _entry(doc, "fields", where)
    if (not isinstance(fields, list) or not all(isinstance(f, dict) for f in fields)
            or [f.get("name") for f in fields] != list(spec)):
        raise _bad(where, f"'fields' should list one entry per spec field {list(spec)}, in that "
                          f"order; found {_show(fields)}")
    for entry, (name, field) in zip(fields, spec.items()):
        _check_entry(entry, [rows, *field.shape], field.dtype, f"'fields' entry {name!r}", where)
    _check_entry(_entry(doc, "meta", where), [rows], np.dtype("<i8"),
                 "'meta' (the _meta column)", where)
    return spec, capacity, lanes


def _parse_options(doc: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``create`` options from a manifest or state; absent keys (older versions) are defaults."""
    next_obs = doc.get("next_obs", "stored")
    if not isinstance(next_obs, str) or next_obs not in ("stored", "derived"):
        raise _bad(where, f"'next_obs' should be 'stored' or 'derived', found {_show(next_obs)}")
    ep_json = doc.get("episode_spec")
    episode_spec = None
    if not (ep_json is None or (isinstance(ep_json, list) and not ep_json)):  # None, []: none
        episode_spec = _spec_from_json(ep_json, "episode_spec", where)
    episode_capacity = doc.get("episode_capacity")
    if episode_capacity is not None:
        episode_capacity = _check_int(episode_capacity, "'episode_capacity'", 1, MAX_INDEX, where)
    return {"next_obs": next_obs, "episode_spec": episode_spec,
            "episode_capacity": episode_capacity}


def _check_episode_section(doc: dict[str, Any], directory: Path, n_lanes: int
                           ) -> tuple[dict[str, Any], Records | None]:
    """The buffer options and the episode records of a manifest (None if it has none)."""
    where = str(directory / MANIFEST)
    options = _parse_options(doc, where)
    section = doc.get("episodes")
    if section is None:
        return options, None
    spec = options["episode_spec"]
    names = list(spec) if spec is not None else []
    if not isinstance(section, dict):
        raise _bad(where, f"'episodes' should be a dict with 'records' and 'fields', found "
                          f"{_show(section)}")
    rec_entry = section.get("records")
    shape = rec_entry.get("shape") if isinstance(rec_entry, dict) else None
    n = shape[0] if isinstance(shape, list) and shape else None
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_INDEX:
        raise _bad(where, f"'episodes' 'records' should be an entry of shape [records, "
                          f"{len(RECORD_COLUMNS)}], found {_show(rec_entry)}")
    _check_entry(rec_entry, [n, len(RECORD_COLUMNS)], np.dtype("<i8"),
                 "'episodes' 'records' (the episode records)", where)
    fields = section.get("fields")
    if (not isinstance(fields, list) or not all(isinstance(f, dict) for f in fields)
            or [f.get("name") for f in fields] != names):
        raise _bad(where, f"'episodes' 'fields' should list one entry per episode field "
                          f"{names}, in that order; found {_show(fields)}")
    for entry in fields:
        field = spec[entry["name"]]
        _check_entry(entry, [n, *field.shape], field.dtype, f"episode field {entry['name']!r}",
                     where)
    records = Records(
        np.asarray(_files.open_npy(directory / rec_entry["file"], (n, len(RECORD_COLUMNS)),
                                   np.dtype("<i8"), "the episode records")),
        {e["name"]: np.asarray(_files.open_npy(directory / e["file"],
                                               (n, *spec[e["name"]].shape),
                                               spec[e["name"]].dtype,
                                               f"episode field {e['name']!r}"))
         for e in fields},
    )
    _check_records(records, n_lanes, spec, where)
    return options, records


def _check_entry(entry: Any, shape: list[int], dtype: np.dtype, what: str, where: str) -> None:
    """A manifest's file entry: a plain ``.npy`` name in the directory, ``shape``, ``dtype``."""
    if not isinstance(entry, dict):
        raise _bad(where, f"{what} should be a dict with 'file', 'shape' and 'dtype', found "
                          f"{_show(entry)}")
    file = entry.get("file")
    if (not isinstance(file, str) or "\0" in file or Path(file).name != file
            or not file.endswith(".npy")):
        raise _bad(where, f"{what} names file {_show(file)}; expected a plain .npy file name in "
                          f"the checkpoint directory")
    found = entry.get("shape")
    ints = isinstance(found, list) and all(type(d) is int for d in found)
    if not ints or found != shape or entry.get("dtype") != dtype.str:
        raise _bad(where, f"{what} should be shape {tuple(shape)} {dtype} by the spec and row "
                          f"count; the entry says shape {_show(found)} {_show(entry.get('dtype'))}")


def _check_lanes(per_lane: Any, n_lanes: int, capacity: int, rows: int,
                 where: str) -> list[LaneRows]:
    """The per-lane entries, each field an int in range, offsets packed, counts adding up."""
    if not isinstance(per_lane, (list, tuple)) or len(per_lane) != n_lanes:
        raise _bad(where, f"'per_lane' should list {n_lanes} lane entries, one per lane; found "
                          f"{_show(per_lane)}")
    keys = list(LaneRows.__dataclass_fields__)
    lanes, pos = [], 0
    for k, entry in enumerate(per_lane):
        if not isinstance(entry, Mapping) or any(f not in entry for f in keys):
            raise _bad(where, f"per_lane[{k}] should be a dict of ints {', '.join(keys)}; found "
                              f"{_show(entry)}")
        at = f"lane {k}'s entry per_lane[{k}]"
        first = _check_int(entry["first"], f"{at}['first']", 0, MAX_INDEX, where)
        count = _check_int(entry["count"], f"{at}['count']", 0, capacity, where)
        if first + count > MAX_INDEX:
            raise _bad(where, f"{at}['first'] + ['count'] is {first + count}, past the largest "
                              f"logical index a lane can hold ({MAX_INDEX})")
        r = LaneRows(
            lane=_check_int(entry["lane"], f"{at}['lane']", k, k, where),
            first=first,
            count=count,
            offset=_check_int(entry["offset"], f"{at}['offset']", pos, pos, where),
            episode=_check_int(entry["episode"], f"{at}['episode']", 0, MAX_EPISODE, where),
            # A writer moves episode_start only up to its committed index (first + count).
            episode_start=_check_int(entry["episode_start"], f"{at}['episode_start']", 0,
                                     first + count, where),
        )
        lanes.append(r)
        pos += r.count
    if pos != rows:
        raise _bad(where, f"the lanes' counts add up to {pos} rows but the arrays have {rows} rows")
    return lanes


# --------------------------------------------------------------------------------------------
# state_dict / load_state_dict
# --------------------------------------------------------------------------------------------
def state_dict(storage: BufferStorage) -> dict[str, Any]:
    """The buffer's contents as plain Python and NumPy objects (picklable, ``torch.save``-able).

    Keys: ``format``, ``version``, ``spec`` (JSON), ``capacity``, ``lanes``, ``per_lane`` (one
    dict per lane: lane, first, count, offset, episode, episode_start), ``fields`` (name ->
    array ``[rows, *shape]``, lanes concatenated, oldest first), ``meta`` (int64 ``[rows]``),
    the options ``next_obs``, ``episode_spec`` (JSON), ``episode_capacity``, and ``episodes``
    (``records``: int64 ``[n, 5]`` lane, episode, start, length, flags; ``fields``: name ->
    ``[n, *shape]``). Safe while writers run, like ``save``.
    """
    spec = storage.spec
    sizes = storage.windows().sizes  # rows to allocate; lanes are re-read as they are copied
    rows = int(sizes.sum())
    arrays = {name: np.empty((rows, *f.shape), f.dtype) for name, f in spec.items()}
    meta = np.empty(rows, np.int64)
    with Progress(rows * _row_nbytes(spec), f"state_dict of {storage.name}") as bar:
        lanes = _copy_lanes(storage, sizes, arrays, meta, bar)
    if sum(r.count for r in lanes) != rows:
        packed = _packed(lanes)
        total = sum(r.count for r in packed)
        for name, f in spec.items():
            dst = np.empty((total, *f.shape), f.dtype)
            _copy_rows(arrays[name], dst, lanes, packed)
            arrays[name] = dst
        dst = np.empty(total, np.int64)
        _copy_rows(meta, dst, lanes, packed)
        meta, lanes = dst, packed
    records = _copy_episodes(storage)
    return {
        "format": STATE_FORMAT,
        "version": VERSION,
        "spec": spec.to_json(),
        "capacity": storage.capacity,
        "lanes": storage.lanes,
        "per_lane": [asdict(r) for r in lanes],
        "fields": arrays,
        "meta": meta,
        **_options(storage),
        "episodes": {"records": records.table, "fields": records.fields},
    }


def load_state_dict(storage: BufferStorage, state: Mapping[str, Any]) -> None:
    """Replace ``buf``'s contents with ``state`` (from ``state_dict``), holding every lane.

    The capacity may differ: a lane with more rows than ``buf.capacity`` keeps its newest; so
    may the episode capacity (a lane keeps its newest records). States from before episode
    records existed load as stored-next_obs states without records.

    Every entry of ``state`` is checked (types, shapes, dtypes, each per-lane counter's range,
    lengths that agree) before the first byte of ``buf`` changes: a rejected state leaves the
    buffer exactly as it was.

    Raises:
        SpecMismatchError: the state's spec, lane count, next_obs mode or episode spec differs
            from ``buf``'s.
        CheckpointError: the state is malformed or inconsistent.
        LaneBusyError: a lane has a live writer; nothing was changed.
    """
    where = "load_state_dict()"
    fmt = state.get("format") if isinstance(state, Mapping) else None
    if not isinstance(fmt, str) or fmt != STATE_FORMAT:
        found = fmt if isinstance(state, Mapping) else type(state).__name__
        raise CheckpointError(
            f"load_state_dict(): expected a dict from buf.state_dict() (format "
            f"{STATE_FORMAT!r}), found {_show(found)}"
        )
    version = state.get("version")
    if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)) \
            or version != VERSION:
        raise CheckpointError(
            f"load_state_dict(): expected state version {VERSION}, found {_show(version)}. Fix: "
            f"load it with the shmbuf version that made it"
        )
    spec = _spec_from_json(_entry(state, "spec", where), "spec", where)
    n_lanes = _check_int(_entry(state, "lanes", where), "'lanes'", 1, L.MAX_LANES, where)
    capacity = _check_int(_entry(state, "capacity", where), "'capacity'", 1, MAX_INDEX, where)
    if spec != storage.spec:
        raise SpecMismatchError(
            f"load_state_dict(): the state's spec is {spec!r}, this buffer's is {storage.spec!r}. "
            f"Fix: load it into a buffer created with the same spec, e.g. "
            f"ReplayBuffer.create(Spec.from_json(state['spec']), capacity, lanes={n_lanes})"
        )
    if n_lanes != storage.lanes:
        raise SpecMismatchError(
            f"load_state_dict(): the state has {n_lanes} lanes, this buffer has {storage.lanes}. "
            f"Fix: create the buffer with lanes={n_lanes}"
        )
    options = _parse_options(state, where)
    mode = "derived" if storage.derived_next_obs else "stored"
    if options["next_obs"] != mode:
        raise SpecMismatchError(
            f"load_state_dict(): the state is of a next_obs={options['next_obs']!r} buffer, this "
            f"one has next_obs={mode!r} (its rows would mean something else). Fix: create the "
            f"buffer with next_obs={options['next_obs']!r}"
        )
    records = None
    if "episodes" in state:
        if options["episode_spec"] != storage.episode_spec:
            raise SpecMismatchError(
                f"load_state_dict(): the state's episode_spec is {options['episode_spec']!r}, "
                f"this buffer's is {storage.episode_spec!r}. Fix: create the buffer with the same "
                f"episode_spec"
            )
        records = _state_records(state["episodes"], storage.episode_spec, n_lanes, where)
    meta = _as_array(_entry(state, "meta", where), "'meta'", where)
    if meta.dtype != np.int64 or meta.ndim != 1:
        raise _bad(where, f"'meta' should be int64 [rows], found {meta.shape} {meta.dtype}")
    rows = int(meta.shape[0])
    lanes = _check_lanes(_entry(state, "per_lane", where), n_lanes, capacity, rows, where)
    fields = _entry(state, "fields", where)
    if not isinstance(fields, Mapping) or set(fields) != set(spec):
        got = sorted(map(str, fields)) if isinstance(fields, Mapping) else _show(fields)
        raise _bad(where, f"'fields' should hold arrays for {list(spec)}, found {got}")
    arrays = {}
    for name, f in spec.items():
        arr = _as_array(fields[name], f"field {name!r}", where)
        if arr.shape != (rows, *f.shape) or arr.dtype != f.dtype:
            raise _bad(where, f"field {name!r} should be shape {(rows, *f.shape)} {f.dtype}, "
                              f"found {arr.shape} {arr.dtype}")
        arrays[name] = arr
    _restore(storage, lanes, arrays, meta, None, f"load_state_dict into {storage.name}", records)


def _state_records(section: Any, spec: Spec | None, n_lanes: int, where: str) -> Records:
    """The episode records of a state dict, checked."""
    if not isinstance(section, Mapping) or "records" not in section or "fields" not in section:
        raise _bad(where, f"'episodes' should be a dict with 'records' and 'fields', found "
                          f"{_show(section)}")
    table = _as_array(section["records"], "'episodes' 'records'", where)
    fields = section["fields"]
    if not isinstance(fields, Mapping):
        raise _bad(where, f"'episodes' 'fields' should map episode field names to arrays, found "
                          f"{_show(fields)}")
    values = {k: _as_array(v, f"'episodes' 'fields'[{_show(k)}]", where) for k, v in fields.items()}
    records = Records(table, values)
    _check_records(records, n_lanes, spec, where)
    return records
