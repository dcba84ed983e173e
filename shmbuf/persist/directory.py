"""The directory form of a checkpoint: ``save`` writes a snapshot as ``.npy`` files plus a JSON
manifest (atomically, space checked first), ``load`` checks the whole directory and restores it.

A saved directory holds, for a buffer of L lanes whose lanes keep n_0 .. n_{L-1} rows (the
snapshot's layout, ``snapshot.py``):

- one ``NNN_<field>.npy`` per field (``file_name``), shape ``[n_0 + ... + n_{L-1}, *shape]``:
  lane 0's rows oldest first, then lane 1's, ...;
- ``_meta.npy``, int64 ``[rows]``: each row's ``episode << 32 | flags | step_in_episode``;
- of a buffer with actor priorities only: ``_priority.npy``, float64 ``[rows]``, the priority
  each row's writer gave (0.0 where none), and ``_priority_given.npy``, uint8 ``[rows]``, 1
  where one was given (``snapshot.PRIORITY_COLUMNS``);
- ``_episodes.npy``, int64 ``[records, 5]``: the episode records held (lane, episode, start,
  length, flags), by lane then episode, and one ``_ep_NNN_<field>.npy`` per episode-spec field;
- ``manifest.json``, written last (``save`` writes into a hidden directory and renames it into
  place only when complete, so only older versions leave directories without one at the target):

  ``format`` ("shmbuf-checkpoint"), ``version`` (1), ``created`` (Unix time), ``source`` (the
  segment's name), ``spec`` (``Spec.to_json``), ``capacity``, ``lanes``, ``rows``, ``per_lane``
  (per lane: lane, first, count, offset, episode, episode_start: ``snapshot.LaneRows``),
  ``fields`` (per field, in spec order: name, file, shape, dtype ``.str``), ``meta`` (file,
  shape, dtype), the options ``next_obs``, ``episode_spec`` (JSON, ``[]`` for none),
  ``episode_capacity`` and ``actor_priorities`` (true; absent for none), ``priorities`` (only if
  ``actor_priorities``: ``values`` and ``given``, a file entry each), and ``episodes``
  (``records``: file, shape, dtype; ``columns``: the record columns; ``fields``: one file entry
  per episode field). The options, ``priorities`` and ``episodes`` are absent in older
  checkpoints, which load with the defaults, without actor priorities and without records.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import positive_int
from ..errors import CapacityError, CheckpointError
from ..segment import fmt_bytes
from ..storage import BufferStorage
from . import _files, snapshot
from .snapshot import PRIORITY_COLUMNS, RECORD_COLUMNS
from .validate import (
    WORD_DTYPE,
    bad,
    check_contents,
    check_format,
    check_header,
    check_int,
    check_size,
    entry,
    show,
)

FORMAT = "shmbuf-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
META_FILE = "_meta.npy"
PRIORITY_FILES = {"values": "_priority.npy", "given": "_priority_given.npy"}  # PRIORITY_COLUMNS
EPISODES_FILE = "_episodes.npy"
MAX_MANIFEST_BYTES = 16 << 20  # a manifest is a few KiB; a larger file is not one of ours

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def file_name(position: int, field: str) -> str:
    """The ``.npy`` name of the ``position``-th field (from 0): ``2, "obs/camera"`` ->
    ``002_obs__camera.npy``; an episode field's name has ``_ep_`` in front."""
    return f"{position:03d}_{_UNSAFE.sub('_', field.replace('/', '__'))}.npy"


# --------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------
def save(
    storage: BufferStorage,
    path: str | os.PathLike[str],
    overwrite: bool = False,
    progress: bool | None = None,
) -> None:
    """Write the buffer to the directory ``path`` (see the module docstring for the layout).

    Safe while writers run: each lane keeps the rows still intact at the end of the copy.

    Nothing half-made is ever at ``path``: the checkpoint is written into a hidden directory
    beside it and moved into place only when complete (``_files.new_directory``), so ``path``
    holds the previous checkpoint or the new one at every instant, even if the process is
    killed. A save killed outright leaves only its hidden directory, which the next save to
    ``path`` removes.

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
    sizes = storage.windows().sizes  # rows to allocate; lanes are re-read as they are copied
    needed = _bytes_needed(storage, int(sizes.sum()))
    # files to create: one per field and episode field, _meta, _episodes, the manifest, the dir,
    # and the priority columns
    n_files = len(storage.spec) + len(storage.episode_spec or ()) + 4
    n_files += len(PRIORITY_FILES) if snapshot.keeps_priorities(storage) else 0
    _files.remove_dead_saves(final)  # before the space check: they free theirs

    def no_room(free: int, inodes: int) -> CapacityError:
        both = (" The checkpoint already there stays until the new one is complete, so "
                "replacing it needs room for both." if replacing else "")
        no_inodes = " and it has no free inodes left" if inodes < n_files else ""
        return CapacityError(
            f"saving to {final} needs {fmt_bytes(needed)} ({needed} bytes) but only "
            f"{fmt_bytes(free)} free ({free} bytes) are left on its filesystem{no_inodes}; "
            f"nothing was saved.{both} Fix: free space there, or save elsewhere"
        )

    free, inodes = _files.free_space(parent)
    if needed > free or inodes < n_files:
        raise no_room(free, inodes)
    try:
        with _files.new_directory(final, lambda p: _check_replaceable(p, overwrite)) as tmp:
            _write_checkpoint(storage, tmp, sizes, progress)
    except OSError as e:
        if e.errno in _files.NO_ROOM and not isinstance(e, CapacityError):
            raise no_room(*_files.free_space(parent)) from None
        raise


def _check_replaceable(path: Path, overwrite: bool) -> None:
    """Raise FileExistsError unless ``path`` may be replaced: ``overwrite`` and a directory
    holding only checkpoint files."""
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


def _bytes_needed(storage: BufferStorage, rows: int) -> int:
    """Disk space a checkpoint of ``rows`` rows takes at most (a block of slack per file)."""
    block = 4096
    spec, i8 = storage.spec, WORD_DTYPE
    files = [(f.dtype, (rows, *f.shape)) for f in spec.values()] + [(i8, (rows,))]
    if snapshot.keeps_priorities(storage):
        files += [(dtype, (rows,)) for _, dtype in PRIORITY_COLUMNS]
    records = storage.lanes * storage.layout.episode_capacity if storage.episodes is not None else 0
    files.append((i8, (records, len(RECORD_COLUMNS))))
    for f in (storage.episode_spec or {}).values():
        files.append((f.dtype, (records, *f.shape)))
    manifest = (16 << 10) + 256 * (storage.lanes + len(files))
    npy_bytes = sum(len(_files.npy_header(d, s)) + math.prod(s) * d.itemsize for d, s in files)
    return npy_bytes + block * len(files) + manifest


def _write_checkpoint(storage: BufferStorage, directory: Path, sizes: np.ndarray,
                      progress: bool | None) -> None:
    """Write every file of a checkpoint into the (new, empty) ``directory``, the manifest last."""
    spec = storage.spec
    rows = int(sizes.sum())
    files = {name: file_name(i, name) for i, name in enumerate(spec)}
    keeps_priorities = snapshot.keeps_priorities(storage)
    opened: list[_files.NpyWriter] = []

    def open_npy(file: str, dtype: np.dtype, shape: tuple[int, ...]) -> _files.NpyWriter:
        opened.append(_files.NpyWriter(directory / file, dtype, shape))
        return opened[-1]

    try:
        fields = {name: open_npy(files[name], f.dtype, (rows, *f.shape))
                  for name, f in spec.items()}
        meta = open_npy(META_FILE, WORD_DTYPE, (rows,))
        priorities = {name: open_npy(PRIORITY_FILES[name], dtype, (rows,))
                      for name, dtype in PRIORITY_COLUMNS} if keeps_priorities else None
        lanes = snapshot.take_rows(storage, sizes, fields, meta, progress,
                                   f"saving {storage.name}", priorities)
        rows = sum(r.count for r in lanes)
        for w in opened:
            w.finish()
        records = snapshot.take_records(storage)
        ep_files = {name: "_ep_" + file_name(i, name) for i, name in enumerate(records.fields)}
        for file, values in [(EPISODES_FILE, records.table),
                             *((ep_files[n], v) for n, v in records.fields.items())]:
            w = open_npy(file, values.dtype, values.shape)
            w[0 : values.shape[0]] = values
            w.finish()
    finally:
        for w in opened:
            w.close()

    def file_entry(file: str, dtype: np.dtype, shape: tuple[int, ...]) -> dict[str, Any]:
        return {"file": file, "shape": list(shape), "dtype": dtype.str}

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
        "fields": [{"name": name, **file_entry(files[name], f.dtype, (rows, *f.shape))}
                   for name, f in spec.items()],
        "meta": file_entry(META_FILE, WORD_DTYPE, (rows,)),
        **snapshot.buffer_options(storage),
        **({"priorities": {name: file_entry(PRIORITY_FILES[name], dtype, (rows,))
                           for name, dtype in PRIORITY_COLUMNS}} if keeps_priorities else {}),
        "episodes": {
            "records": file_entry(EPISODES_FILE, WORD_DTYPE, records.table.shape),
            "columns": list(RECORD_COLUMNS),
            "fields": [{"name": name, **file_entry(ep_files[name], v.dtype, v.shape)}
                       for name, v in records.fields.items()],
        },
    }
    _files.write_file(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


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
    if it is a regular file of at most ``MAX_MANIFEST_BYTES``; every entry's type and range, by
    ``validate``), each ``.npy`` file (a regular file, opened without blocking; its header's
    shape and dtype; its length) and the episode records' values, so a bad checkpoint is a
    CheckpointError naming the file and the entry. A failure after the buffer exists closes (and
    unlinks) it.
    """
    directory = Path(path)
    where = str(directory / MANIFEST)
    doc = _read_manifest(directory, where)
    header = check_header(doc, where)
    rows = check_int(entry(doc, "rows", where), "'rows'", 0, header.capacity * header.lanes, where)
    contents = check_contents(doc, header, rows, ManifestForm(directory), where)
    if capacity is None:
        capacity = header.capacity
        check_size(header, capacity, False, where)
    else:
        capacity = positive_int("capacity", capacity)
        check_size(header, capacity, True, where)
    buf = create(header.spec, capacity, header.lanes, name, **header.options())
    try:
        snapshot.restore(buf.storage, contents.lanes, contents.fields, contents.meta,
                         contents.records, progress, f"loading {directory.name}",
                         contents.priorities)
    except BaseException:
        buf.close()
        raise
    return buf


def _read_manifest(directory: Path, where: str) -> dict[str, Any]:
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
            f"{show(str(e))}). Fix: save the buffer again"
        ) from None
    check_format(doc, FORMAT, VERSION, "a manifest written by buf.save()", where)
    return doc  # a dict: check_format found its "format"


@dataclass(frozen=True)
class FileEntry:
    """A manifest's entry for one ``.npy`` file: a plain name in the checkpoint directory, and
    the shape and dtype it says the file holds (``validate.Column``)."""

    file: str
    shape: tuple[int, ...]
    dtype: np.dtype


class ManifestForm:
    """How a manifest holds columns (``validate.Form``): file entries ``{"file", "shape",
    "dtype"}``, in lists of ``{"name", ...}`` in spec order, opened as read-only memory maps."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def column(self, value: Any, what: str, where: str) -> FileEntry:
        if not isinstance(value, dict):
            raise bad(where, f"{what} should be a dict with 'file', 'shape' and 'dtype', found "
                             f"{show(value)}")
        file, shape, dtype = value.get("file"), value.get("shape"), value.get("dtype")
        if (not isinstance(file, str) or "\0" in file or Path(file).name != file
                or not file.endswith(".npy")):
            raise bad(where, f"{what} names file {show(file)}; expected a plain .npy file name in "
                             f"the checkpoint directory")
        found = _dtype(dtype)
        if not (isinstance(shape, list) and all(type(d) is int for d in shape)) or found is None:
            raise bad(where, f"{what} should give its shape as a list of ints and its dtype as a "
                             f"NumPy dtype string such as '<i8'; the entry says shape "
                             f"{show(shape)} {show(dtype)}")
        return FileEntry(file, tuple(shape), found)

    def columns(self, value: Any, names: list[str], key: str, what: str, where: str
                ) -> dict[str, FileEntry]:
        if (not isinstance(value, list) or not all(isinstance(e, dict) for e in value)
                or [e.get("name") for e in value] != names):
            raise bad(where, f"{key} should list one entry per {what} {names}, in that order; "
                             f"found {show(value)}")
        return {name: self.column(e, f"{what} {name!r}", where) for name, e in zip(names, value)}

    def array(self, column: FileEntry, what: str, where: str) -> np.ndarray:
        return _files.open_npy(self.directory / column.file, column.shape, column.dtype, what)


def _dtype(value: Any) -> np.dtype | None:
    """The dtype a manifest names by its ``.str`` (``'<i8'``), None for anything else."""
    if not isinstance(value, str):
        return None
    try:
        dtype = np.dtype(value)
    except Exception:  # noqa: BLE001 - whatever numpy makes of an arbitrary string
        return None
    return dtype if dtype.str == value else None
