"""Saving and restoring replay buffers: a directory of ``.npy`` files plus a JSON manifest, and
in-memory state dicts for training checkpoints.

Reads are seqlock-checked, so saving while writers run is safe; restores hold every lane's lease.

A saved directory holds, for a buffer of L lanes whose lanes keep n_0 .. n_{L-1} rows:

- one ``NNN_<field>.npy`` per field, shape ``[n_0 + ... + n_{L-1}, *shape]``: lane 0's rows oldest
  first, then lane 1's, ... (``/`` in field names becomes ``__``; the manifest names each file);
- ``_meta.npy``, int64 ``[rows]``: each row's ``episode << 32 | flags | step_in_episode``;
- ``_episodes.npy``, int64 ``[records, 5]``: the episode records held (lane, episode, start,
  length, flags), by lane then episode, and one ``_ep_NNN_<field>.npy`` per episode-spec field;
- ``manifest.json``, written last (temp file + rename), so a directory without one is an
  incomplete save: format and version, spec, capacity, lanes, the buffer's options (``next_obs``,
  ``episode_spec``, ``episode_capacity``; absent in older checkpoints, which load with the
  defaults), per lane the first logical index kept, the row count, the row offset in the files
  and the lane's episode words, and the episode files.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import layout as L
from ._progress import Progress
from .buffer import ReplayBuffer, _positive_int, _ring_segments
from .errors import CheckpointError, SpecMismatchError
from .spec import Spec

FORMAT = "shmbuf-checkpoint"
STATE_FORMAT = "shmbuf-state"
VERSION = 1
MANIFEST = "manifest.json"
META_FILE = "_meta.npy"
EPISODES_FILE = "_episodes.npy"
RECORD_COLUMNS = ("lane", "episode", "start", "length", "flags")  # of EPISODES_FILE
CHUNK_BYTES = 64 << 20  # rows are copied out of shared memory this many bytes at a time

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
    buf: ReplayBuffer,
    sizes: np.ndarray,
    out: Mapping[str, np.ndarray],
    meta_out: np.ndarray,
    bar: Progress,
) -> list[LaneRows]:
    """Copy each lane's newest held rows, at most ``sizes[k]`` of them, into ``out`` (lane k at
    rows ``sizes[:k].sum()`` on, oldest first) and return the rows of each lane that were intact.

    Each lane's window is read just before its copy, after its episode words (a writer moves
    ``episode_start`` only up to its ``committed``, so the window ends at or after it). The rows
    of a window were held when it was read, so a row copied whole is good iff its stamp still
    says so after the copy. Writers overwrite a lane oldest first, so a bad row makes every older
    row suspect too: each lane keeps the suffix after its newest bad row.
    """
    C = buf.capacity
    cols, stamps, meta, words = buf._cols, buf._stamps, buf._meta, buf._lane_words
    row_nbytes = _row_nbytes(buf.spec)
    chunk_rows = max(1, CHUNK_BYTES // row_nbytes)
    lanes = []
    pos = 0
    for k in range(buf.lanes):
        episode_start = int(words[k, L.LANE_EPISODE_START, 0])
        episode = int(words[k, L.LANE_EPISODE, 0])
        win = buf.windows()
        size = int(sizes[k])
        hi = int(win.hi[k])
        lo = max(int(win.lo[k]), hi - size)
        base = k * C
        keep_from = lo
        for i0 in range(lo, hi, chunk_rows):
            i1 = min(i0 + chunk_rows, hi)
            at = pos + (i0 - lo)
            segments = _ring_segments(i0, i1 - i0, C)
            for a, b, off in segments:
                for name, dst in out.items():
                    dst[at + off : at + off + (b - a)] = cols[name][base + a : base + b]
                meta_out[at + off : at + off + (b - a)] = meta[base + a : base + b]
            after = np.concatenate([stamps[base + a : base + b] for a, b, _ in segments])
            bad = np.flatnonzero(after != np.arange(2 * i0 + 2, 2 * i1 + 2, 2, dtype=np.int64))
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


def _options(buf: ReplayBuffer) -> dict[str, Any]:
    """What ``ReplayBuffer.create`` needs besides spec, capacity and lanes to recreate ``buf``."""
    spec = buf.episode_spec
    return {
        "next_obs": "derived" if buf.derived_next_obs else "stored",
        "episode_spec": spec.to_json() if spec is not None else [],
        "episode_capacity": buf._layout.episode_capacity,
    }


def _copy_episodes(buf: ReplayBuffer) -> Records:
    """Every episode record held now, each copied whole (its stamp said "held" before and after
    the copy; a record being written or overwritten meanwhile is left out)."""
    spec = buf.episode_spec
    table = buf._episodes
    names = list(spec) if spec is not None else []
    if table is None:
        return Records(np.zeros((0, len(RECORD_COLUMNS)), np.int64),
                       {n: np.zeros((0, *spec[n].shape), spec[n].dtype) for n in names})
    before = table.stamp.copy()
    columns = [table.start.copy(), table.length.copy(), table.flags.copy()]
    data = {n: table.data[n].copy() for n in names}
    after = table.stamp
    rows = np.flatnonzero((before == after) & (before > 0) & (before % 2 == 0))
    lanes = rows // table.capacity
    ids = before[rows] // 2 - 1
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
    if n and (table[:, 0].min() < 0 or table[:, 0].max() >= n_lanes or table[:, 1].min() < 0):
        raise CheckpointError(
            f"{where}: episode records name lanes outside [0, {n_lanes}) or negative episode ids"
        )


def _restore_episodes(buf: ReplayBuffer, records: Records | None) -> None:
    """Replace every lane's episode records with ``records`` (the caller holds every lane's
    lease). A lane keeps its newest ``episode_capacity`` records, as its writer's ring would."""
    table = buf._episodes
    if table is None:
        return
    table.stamp[:] = 0  # nothing held while we rewrite
    if records is None or not len(records.table):
        return
    E = table.capacity
    lanes, ids = records.table[:, 0], records.table[:, 1]
    newest = np.full(buf.lanes, -1, np.int64)
    np.maximum.at(newest, lanes, ids)
    keep = ids > newest[lanes] - E
    rec = records.table[keep]
    ids = rec[:, 1]
    r = rec[:, 0] * E + ids % E
    table.stamp[r] = 2 * ids + 1
    table.start[r], table.length[r], table.flags[r] = rec[:, 2], rec[:, 3], rec[:, 4]
    for name, col in table.data.items():
        col[r] = records.fields[name][keep]
    table.stamp[r] = 2 * ids + 2


# --------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------
def save(
    buf: ReplayBuffer,
    path: str | os.PathLike[str],
    overwrite: bool = False,
    progress: bool | None = None,
) -> None:
    """Write ``buf`` to the directory ``path`` (see the module docstring for the layout).

    Safe while writers run: each lane keeps the rows still intact at the end of the copy.
    With ``overwrite=True`` an existing checkpoint is replaced only once the new one is complete.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False, or it is not a checkpoint.
    """
    buf._check_open()
    final = Path(path)
    if final.exists() or final.is_symlink():
        _check_replaceable(final, overwrite)
        target = final.with_name(f".{final.name}.saving-{os.getpid()}-{secrets.token_hex(4)}")
    else:
        target = final
    target.mkdir(parents=True)
    try:
        _write_checkpoint(buf, target, progress)
        if target != final:
            _swap_in(target, final)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise


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


def _swap_in(new: Path, final: Path) -> None:
    """Replace the checkpoint at ``final`` with the complete one at ``new``."""
    old = final.with_name(f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(final, old)
    try:
        os.rename(new, final)
    except BaseException:
        os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_checkpoint(buf: ReplayBuffer, directory: Path, progress: bool | None) -> None:
    spec = buf.spec
    sizes = buf.windows().sizes  # rows to allocate; lanes are re-read as they are copied
    rows = int(sizes.sum())
    files = {name: file_name(i, name) for i, name in enumerate(spec)}
    arrays = {
        name: np.lib.format.open_memmap(
            directory / files[name], mode="w+", dtype=f.dtype, shape=(rows, *f.shape)
        )
        for name, f in spec.items()
    }
    meta = np.lib.format.open_memmap(directory / META_FILE, mode="w+", dtype="<i8", shape=(rows,))
    with Progress(rows * _row_nbytes(spec), f"saving {buf.name}", progress) as bar:
        lanes = _copy_lanes(buf, sizes, arrays, meta, bar)
    if sum(r.count for r in lanes) != rows:  # writers overwrote rows under the copy: compact
        packed = _packed(lanes)
        total = sum(r.count for r in packed)
        for name, f in spec.items():
            arrays[name] = _rewrite(directory / files[name], arrays[name], lanes, packed,
                                    (total, *f.shape))
        meta = _rewrite(directory / META_FILE, meta, lanes, packed, (total,))
        lanes, rows = packed, total
    for arr in (*arrays.values(), meta):
        arr.flush()
    del arrays, meta
    records = _copy_episodes(buf)
    np.save(directory / EPISODES_FILE, records.table)
    ep_files = {name: "_ep_" + file_name(i, name) for i, name in enumerate(records.fields)}
    for name, values in records.fields.items():
        np.save(directory / ep_files[name], values)
    n_records = int(records.table.shape[0])
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "created": time.time(),
        "source": buf.name,
        "spec": spec.to_json(),
        "capacity": buf.capacity,
        "lanes": buf.lanes,
        "rows": rows,
        "per_lane": [asdict(r) for r in lanes],
        "fields": [
            {"name": name, "file": files[name], "shape": [rows, *f.shape], "dtype": f.dtype.str}
            for name, f in spec.items()
        ],
        "meta": {"file": META_FILE, "shape": [rows], "dtype": np.dtype("<i8").str},
        **_options(buf),
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
    _write_json_atomic(directory / MANIFEST, manifest)


def _rewrite(path: Path, src: np.ndarray, old: list[LaneRows], new: list[LaneRows],
             shape: tuple[int, ...]) -> np.memmap:
    tmp = path.with_name(path.name + ".tmp")
    dst = np.lib.format.open_memmap(tmp, mode="w+", dtype=src.dtype, shape=shape)
    _copy_rows(src, dst, old, new)
    dst.flush()
    os.replace(tmp, path)
    return dst


def _write_json_atomic(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(
    cls: type[ReplayBuffer],
    path: str | os.PathLike[str],
    name: str | None = None,
    capacity: int | None = None,
    progress: bool | None = None,
) -> ReplayBuffer:
    """Create a buffer from a directory written by ``save``; see ``ReplayBuffer.load``.

    The whole directory is checked before any shared memory is created; a failure after that
    closes (and unlinks) the new buffer before raising.
    """
    directory = Path(path)
    manifest = _read_manifest(directory)
    spec, lanes = _check_manifest(manifest, directory)
    options, records = _check_episode_section(manifest, directory, len(lanes))
    arrays = {
        entry["name"]: _open_npy(directory, entry, f"field {entry['name']!r}")
        for entry in manifest["fields"]
    }
    meta = _open_npy(directory, manifest["meta"], "the _meta column")
    if capacity is None:
        capacity = int(manifest["capacity"])
    capacity = _positive_int("capacity", capacity)
    buf = cls.create(spec, capacity, len(lanes), name, **options)
    try:
        _restore(buf, lanes, arrays, meta, progress, f"loading {directory.name}", records)
    except BaseException:
        buf.close()
        raise
    return buf


def _restore(
    buf: ReplayBuffer,
    lanes: list[LaneRows],
    arrays: Mapping[str, np.ndarray],
    meta: np.ndarray,
    progress: bool | None,
    desc: str,
    records: Records | None = None,
) -> None:
    """Rewrite every lane of ``buf`` from ``lanes``, and its episode records from ``records``;
    a lane keeps its newest ``capacity`` rows."""
    C = buf.capacity
    kept = [min(r.count, C) for r in lanes]
    total = sum(kept) * buf.spec.row_nbytes
    lease = buf._lock_all_lanes()  # LaneBusyError before anything changes
    try:
        with Progress(total, desc, progress) as bar:
            for r, n in zip(lanes, kept):
                a = r.offset + r.count - n
                buf._restore_lane(
                    r.lane,
                    r.first + r.count - n,
                    {name: arr[a : a + n] for name, arr in arrays.items()},
                    meta[a : a + n],
                    r.episode,
                    r.episode_start,
                    on_copied=bar.update,
                )
        _restore_episodes(buf, records)
    finally:
        lease.close()


# --------------------------------------------------------------------------------------------
# Checking a saved directory
# --------------------------------------------------------------------------------------------
def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory} is not a directory; expected a checkpoint directory written by "
            f"buf.save(). Fix: pass the directory that holds {MANIFEST}"
        )
    try:
        text = path.read_text()
    except FileNotFoundError:
        npys = sorted(p.name for p in directory.glob("*.npy"))
        found = f"{len(npys)} .npy file(s) and no manifest" if npys else "no manifest"
        raise CheckpointError(
            f"{path}: missing; found {found}. {MANIFEST} is written last, so this is an "
            f"incomplete save (it was interrupted) or not a shmbuf checkpoint. Fix: save the "
            f"buffer again"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot be read ({e}). Fix: save the buffer again") from None
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise CheckpointError(
            f"{path}: expected JSON, found a corrupt file ({e}). Fix: save the buffer again"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        fmt = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CheckpointError(
            f"{path}: expected format {FORMAT!r}, found {fmt!r}: not a shmbuf checkpoint"
        )
    if doc.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: expected format version {VERSION}, found {doc.get('version')!r}. Fix: load "
            f"it with the shmbuf version that saved it"
        )
    return doc


def _check_manifest(doc: dict[str, Any], directory: Path) -> tuple[Spec, list[LaneRows]]:
    """Validate the manifest's own consistency (not the .npy files); return (spec, lanes)."""
    where = directory / MANIFEST
    try:
        spec = Spec.from_json(doc["spec"])
        capacity = int(doc["capacity"])
        n_lanes = int(doc["lanes"])
        rows = int(doc["rows"])
        fields = list(doc["fields"])
        meta = dict(doc["meta"])
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{where}: a required entry is missing or malformed ({type(e).__name__}: {e}). "
            f"Fix: save the buffer again"
        ) from None
    if capacity < 1 or not 1 <= n_lanes <= L.MAX_LANES or rows < 0:
        raise CheckpointError(
            f"{where}: expected capacity >= 1, 1 <= lanes <= {L.MAX_LANES} and rows >= 0; found "
            f"capacity {capacity}, lanes {n_lanes}, rows {rows}"
        )
    lanes = _check_lanes(doc.get("per_lane"), n_lanes, capacity, rows, str(where))
    names = [f.get("name") if isinstance(f, dict) else None for f in fields]
    if names != list(spec):
        raise CheckpointError(
            f"{where}: expected one file entry per spec field {list(spec)}, found {names}"
        )
    for entry, (name, field) in zip(fields, spec.items()):
        _check_entry(entry, [rows, *field.shape], field.dtype, f"field {name!r}", where)
    _check_entry(meta, [rows], np.dtype("<i8"), "the _meta column", where)
    return spec, lanes


def _parse_options(doc: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``create`` options from a manifest or state; absent keys (older versions) are defaults."""
    try:
        next_obs = doc.get("next_obs", "stored")
        ep_json = doc.get("episode_spec") or []
        episode_spec = Spec.from_json(ep_json) if ep_json else None
        episode_capacity = doc.get("episode_capacity")
        episode_capacity = None if episode_capacity is None else int(episode_capacity)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{where}: the buffer options are malformed ({type(e).__name__}: {e})"
        ) from None
    if next_obs not in ("stored", "derived"):
        raise CheckpointError(
            f"{where}: next_obs should be 'stored' or 'derived', found {next_obs!r}")
    if episode_capacity is not None and episode_capacity < 1:
        raise CheckpointError(f"{where}: episode_capacity should be >= 1, found {episode_capacity}")
    return {"next_obs": next_obs, "episode_spec": episode_spec,
            "episode_capacity": episode_capacity}


def _check_episode_section(doc: dict[str, Any], directory: Path, n_lanes: int
                           ) -> tuple[dict[str, Any], Records | None]:
    """The buffer options and the episode records of a manifest (None if it has none)."""
    where = directory / MANIFEST
    options = _parse_options(doc, str(where))
    section = doc.get("episodes")
    if section is None:
        return options, None
    spec = options["episode_spec"]
    try:
        rec_entry = dict(section["records"])
        n = int(rec_entry["shape"][0])
        fields = [dict(f) for f in section["fields"]]
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{where}: the episodes entry is malformed ({type(e).__name__}: {e}). Fix: save the "
            f"buffer again"
        ) from None
    names = [f.get("name") for f in fields]
    if names != (list(spec) if spec is not None else []):
        raise CheckpointError(
            f"{where}: expected one file entry per episode field "
            f"{list(spec) if spec is not None else []}, found {names}"
        )
    _check_entry(rec_entry, [n, len(RECORD_COLUMNS)], np.dtype("<i8"), "the episode records",
                 where)
    for entry in fields:
        field = spec[entry["name"]]
        _check_entry(entry, [n, *field.shape], field.dtype, f"episode field {entry['name']!r}",
                     where)
    records = Records(
        np.asarray(_open_npy(directory, rec_entry, "the episode records")),
        {e["name"]: np.asarray(_open_npy(directory, e, f"episode field {e['name']!r}"))
         for e in fields},
    )
    _check_records(records, n_lanes, spec, str(where))
    return options, records


def _check_entry(entry: dict[str, Any], shape: list[int], dtype: np.dtype, what: str,
                 where: Path) -> None:
    file = entry.get("file")
    if not isinstance(file, str) or Path(file).name != file or not file.endswith(".npy"):
        raise CheckpointError(f"{where}: {what} names file {file!r}; expected a plain .npy name")
    if list(entry.get("shape", ())) != shape or entry.get("dtype") != dtype.str:
        raise CheckpointError(
            f"{where}: {what} should be shape {tuple(shape)} {dtype} by the spec and row count; "
            f"the entry says shape {entry.get('shape')} {entry.get('dtype')}. The manifest is "
            f"inconsistent: save the buffer again"
        )


def _check_lanes(per_lane: Any, n_lanes: int, capacity: int | None, rows: int,
                 where: str) -> list[LaneRows]:
    if not isinstance(per_lane, (list, tuple)) or len(per_lane) != n_lanes:
        got = len(per_lane) if isinstance(per_lane, (list, tuple)) else type(per_lane).__name__
        raise CheckpointError(f"{where}: expected {n_lanes} per-lane entries, found {got}")
    lanes, pos = [], 0
    for k, entry in enumerate(per_lane):
        try:
            r = LaneRows(**{f: int(entry[f]) for f in LaneRows.__dataclass_fields__})
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{where}: lane {k}'s entry is malformed ({type(e).__name__}: {e}); expected "
                f"ints {', '.join(LaneRows.__dataclass_fields__)}"
            ) from None
        if (r.lane != k or r.first < 0 or r.count < 0 or r.offset != pos
                or (capacity is not None and r.count > capacity)):
            raise CheckpointError(
                f"{where}: lane {k}'s entry {asdict(r)} is inconsistent: expected lane {k}, "
                f"first >= 0, 0 <= count <= capacity ({capacity}) and offset {pos}"
            )
        lanes.append(r)
        pos += r.count
    if pos != rows:
        raise CheckpointError(
            f"{where}: the lanes hold {pos} rows in all but the arrays have {rows}"
        )
    return lanes


def _open_npy(directory: Path, entry: dict[str, Any], what: str) -> np.ndarray:
    """Map one ``.npy`` read-only and check it against its manifest entry."""
    path = directory / entry["file"]
    shape, dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])
    expected = f"shape {shape} {dtype}"
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing; the manifest lists it for {what} ({expected}). The checkpoint "
            f"is incomplete. Fix: save the buffer again, or restore the file from a copy"
        ) from None
    except (ValueError, EOFError, OSError) as e:
        size = path.stat().st_size if path.exists() else 0
        raise CheckpointError(
            f"{path}: truncated or corrupt ({size} bytes on disk; numpy says: {e}); expected "
            f"{what} as {expected}. Fix: save the buffer again, or restore the file from a copy"
        ) from None
    if arr.shape != shape or arr.dtype != dtype:
        raise CheckpointError(
            f"{path}: expected {what} as {expected}, found shape {arr.shape} {arr.dtype}. The "
            f"file does not belong to this manifest. Fix: save the buffer again"
        )
    return arr


# --------------------------------------------------------------------------------------------
# state_dict / load_state_dict
# --------------------------------------------------------------------------------------------
def state_dict(buf: ReplayBuffer) -> dict[str, Any]:
    """The buffer's contents as plain Python and NumPy objects (picklable, ``torch.save``-able).

    Keys: ``format``, ``version``, ``spec`` (JSON), ``capacity``, ``lanes``, ``per_lane`` (one
    dict per lane: lane, first, count, offset, episode, episode_start), ``fields`` (name ->
    array ``[rows, *shape]``, lanes concatenated, oldest first), ``meta`` (int64 ``[rows]``),
    the options ``next_obs``, ``episode_spec`` (JSON), ``episode_capacity``, and ``episodes``
    (``records``: int64 ``[n, 5]`` lane, episode, start, length, flags; ``fields``: name ->
    ``[n, *shape]``). Safe while writers run, like ``save``.
    """
    buf._check_open()
    spec = buf.spec
    sizes = buf.windows().sizes  # rows to allocate; lanes are re-read as they are copied
    rows = int(sizes.sum())
    arrays = {name: np.empty((rows, *f.shape), f.dtype) for name, f in spec.items()}
    meta = np.empty(rows, np.int64)
    with Progress(rows * _row_nbytes(spec), f"state_dict of {buf.name}") as bar:
        lanes = _copy_lanes(buf, sizes, arrays, meta, bar)
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
    records = _copy_episodes(buf)
    return {
        "format": STATE_FORMAT,
        "version": VERSION,
        "spec": spec.to_json(),
        "capacity": buf.capacity,
        "lanes": buf.lanes,
        "per_lane": [asdict(r) for r in lanes],
        "fields": arrays,
        "meta": meta,
        **_options(buf),
        "episodes": {"records": records.table, "fields": records.fields},
    }


def load_state_dict(buf: ReplayBuffer, state: Mapping[str, Any]) -> None:
    """Replace ``buf``'s contents with ``state`` (from ``state_dict``), holding every lane.

    The capacity may differ: a lane with more rows than ``buf.capacity`` keeps its newest; so
    may the episode capacity (a lane keeps its newest records). States from before episode
    records existed load as stored-next_obs states without records.

    Raises:
        SpecMismatchError: the state's spec, lane count, next_obs mode or episode spec differs
            from ``buf``'s.
        CheckpointError: the state is malformed or inconsistent.
        LaneBusyError: a lane has a live writer; nothing was changed.
    """
    buf._check_open()
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise CheckpointError(
            f"load_state_dict(): expected a dict from buf.state_dict() (format "
            f"{STATE_FORMAT!r}), found {found!r}"
        )
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"load_state_dict(): expected state version {VERSION}, found "
            f"{state.get('version')!r}. Fix: load it with the shmbuf version that made it"
        )
    try:
        spec = Spec.from_json(state["spec"])
        n_lanes = int(state["lanes"])
        fields = state["fields"]
        meta = np.asarray(state["meta"])
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"load_state_dict(): a required entry is missing or malformed "
            f"({type(e).__name__}: {e})"
        ) from None
    if spec != buf.spec:
        raise SpecMismatchError(
            f"load_state_dict(): the state's spec is {spec!r}, this buffer's is {buf.spec!r}. "
            f"Fix: load it into a buffer created with the same spec, e.g. "
            f"ReplayBuffer.create(Spec.from_json(state['spec']), capacity, lanes={n_lanes})"
        )
    if n_lanes != buf.lanes:
        raise SpecMismatchError(
            f"load_state_dict(): the state has {n_lanes} lanes, this buffer has {buf.lanes}. "
            f"Fix: create the buffer with lanes={n_lanes}"
        )
    options = _parse_options(state, "load_state_dict()")
    mode = "derived" if buf.derived_next_obs else "stored"
    if options["next_obs"] != mode:
        raise SpecMismatchError(
            f"load_state_dict(): the state is of a next_obs={options['next_obs']!r} buffer, this "
            f"one has next_obs={mode!r} (its rows would mean something else). Fix: create the "
            f"buffer with next_obs={options['next_obs']!r}"
        )
    records = None
    if "episodes" in state:
        if options["episode_spec"] != buf.episode_spec:
            raise SpecMismatchError(
                f"load_state_dict(): the state's episode_spec is {options['episode_spec']!r}, "
                f"this buffer's is {buf.episode_spec!r}. Fix: create the buffer with the same "
                f"episode_spec"
            )
        try:
            episodes = state["episodes"]
            records = Records(np.asarray(episodes["records"]),
                              {k: np.asarray(v) for k, v in dict(episodes["fields"]).items()})
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"load_state_dict(): 'episodes' is malformed ({type(e).__name__}: {e})"
            ) from None
        _check_records(records, n_lanes, buf.episode_spec, "load_state_dict()")
    rows = int(meta.shape[0]) if meta.ndim == 1 else -1
    if meta.dtype != np.int64 or rows < 0:
        raise CheckpointError(
            f"load_state_dict(): 'meta' should be int64 [rows], found {meta.shape} {meta.dtype}"
        )
    lanes = _check_lanes(state.get("per_lane"), n_lanes, None, rows, "load_state_dict()")
    if not isinstance(fields, Mapping) or set(fields) != set(spec):
        got = sorted(fields) if isinstance(fields, Mapping) else type(fields).__name__
        raise CheckpointError(
            f"load_state_dict(): 'fields' should hold arrays for {list(spec)}, found {got}"
        )
    arrays = {}
    for name, f in spec.items():
        arr = np.asarray(fields[name])
        if arr.shape != (rows, *f.shape) or arr.dtype != f.dtype:
            raise CheckpointError(
                f"load_state_dict(): field {name!r} should be shape {(rows, *f.shape)} "
                f"{f.dtype}, found {arr.shape} {arr.dtype}. The state is inconsistent"
            )
        arrays[name] = arr
    _restore(buf, lanes, arrays, meta, None, f"load_state_dict into {buf.name}", records)
