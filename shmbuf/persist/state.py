"""The in-memory form of a checkpoint: ``state_dict`` returns a snapshot as plain Python and NumPy
objects (picklable, ``torch.save``-able), ``load_state_dict`` checks one and restores it.

A state dict holds the same things as a checkpoint directory's manifest (``directory.py``), with
arrays in place of file entries:

``format`` ("shmbuf-state"), ``version`` (1), ``spec`` (``Spec.to_json``), ``capacity``,
``lanes``, ``per_lane`` (per lane: lane, first, count, offset, episode, episode_start:
``snapshot.LaneRows``), ``fields`` (name -> array ``[rows, *shape]``, lanes one after another,
each oldest first), ``meta`` (int64 ``[rows]``), the options ``next_obs``, ``episode_spec``
(JSON, ``[]`` for none), ``episode_capacity`` and ``actor_priorities`` (True; absent for
none), ``priorities`` (only if ``actor_priorities``: ``values`` float64 ``[rows]``, the
priority each row's writer gave, 0.0 where none, and ``given`` uint8 ``[rows]``, 1 where one
was given), and ``episodes``
(``records``: int64 ``[n, 5]`` lane, episode, start, length, flags; ``fields``: name ->
``[n, *shape]``). The options, ``priorities`` and ``episodes`` are absent in older states,
which load as stored-next_obs states without actor priorities or records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import numpy as np

from ..errors import SpecMismatchError
from ..storage import BufferStorage
from . import snapshot
from .snapshot import PRIORITY_COLUMNS, ArrayRows
from .validate import (
    WORD_DTYPE,
    Header,
    as_array,
    bad,
    check_contents,
    check_format,
    check_header,
    entry,
    show,
)

FORMAT = "shmbuf-state"
VERSION = 1


def state_dict(storage: BufferStorage) -> dict[str, Any]:
    """The buffer's contents as a state dict (see the module docstring). Safe while writers
    run, like ``save``: each lane keeps the rows still intact at the end of the copy."""
    spec = storage.spec
    sizes = storage.windows().sizes  # rows to allocate; lanes are re-read as they are copied
    rows = int(sizes.sum())
    fields = {name: ArrayRows(f.dtype, (rows, *f.shape)) for name, f in spec.items()}
    meta = ArrayRows(WORD_DTYPE, (rows,))
    priorities = {name: ArrayRows(dtype, (rows,)) for name, dtype in PRIORITY_COLUMNS
                  } if snapshot.keeps_priorities(storage) else None
    lanes = snapshot.take_rows(storage, sizes, fields, meta, None, f"state_dict of {storage.name}",
                               priorities)
    records = snapshot.take_records(storage)
    return {
        "format": FORMAT,
        "version": VERSION,
        "spec": spec.to_json(),
        "capacity": storage.capacity,
        "lanes": storage.lanes,
        "per_lane": [asdict(r) for r in lanes],
        "fields": {name: sink.array for name, sink in fields.items()},
        "meta": meta.array,
        **snapshot.buffer_options(storage),
        **({"priorities": {name: sink.array for name, sink in priorities.items()}}
           if priorities is not None else {}),
        "episodes": {"records": records.table, "fields": records.fields},
    }


def load_state_dict(storage: BufferStorage, state: Mapping[str, Any]) -> None:
    """Replace the buffer's contents with ``state`` (from ``state_dict``), holding every lane.

    The capacity may differ: a lane with more rows than the buffer's capacity keeps its newest;
    so may the episode capacity (a lane keeps its newest records).

    Every entry of ``state`` is checked (``validate``: types, shapes, dtypes, each per-lane
    counter's range, lengths that agree) before the first byte of the buffer changes: a
    rejected state leaves it exactly as it was.

    Raises:
        SpecMismatchError: the state's spec, lane count, next_obs mode or episode spec differs
            from the buffer's, or it has actor priorities and the buffer keeps none.
        CheckpointError: the state is malformed or inconsistent.
        LaneBusyError: a lane has a live writer; nothing was changed.
    """
    where = "load_state_dict()"
    check_format(state, FORMAT, VERSION, "a dict from buf.state_dict()", where)
    header = check_header(state, where)
    _check_fits(storage, header, "episodes" in state)
    meta = as_array(entry(state, "meta", where), "'meta'", where)
    if meta.ndim != 1:
        raise bad(where, f"'meta' should be int64 [rows], found {meta.shape} {meta.dtype}")
    contents = check_contents(state, header, int(meta.shape[0]), ArrayForm(), where)
    snapshot.restore(storage, contents.lanes, contents.fields, contents.meta, contents.records,
                     None, f"load_state_dict into {storage.name}", contents.priorities)


def _check_fits(storage: BufferStorage, header: Header, has_records: bool) -> None:
    """SpecMismatchError unless the state is of a buffer like ``storage``: the same spec, lanes,
    next_obs mode and, if it holds episode records, episode spec; actor priorities only into a
    buffer that keeps them (a state without them loads into any: its rows have none)."""
    where = "load_state_dict()"
    if header.spec != storage.spec:
        raise SpecMismatchError(
            f"{where}: the state's spec is {header.spec!r}, this buffer's is {storage.spec!r}. "
            f"Fix: load it into a buffer created with the same spec, e.g. "
            f"ReplayBuffer.create(Spec.from_json(state['spec']), capacity, lanes={header.lanes})"
        )
    if header.lanes != storage.lanes:
        raise SpecMismatchError(
            f"{where}: the state has {header.lanes} lanes, this buffer has {storage.lanes}. "
            f"Fix: create the buffer with lanes={header.lanes}"
        )
    mode = "derived" if storage.derived_next_obs else "stored"
    if header.next_obs != mode:
        raise SpecMismatchError(
            f"{where}: the state is of a next_obs={header.next_obs!r} buffer, this one has "
            f"next_obs={mode!r} (its rows would mean something else). Fix: create the buffer "
            f"with next_obs={header.next_obs!r}"
        )
    if header.actor_priorities and not snapshot.keeps_priorities(storage):
        raise SpecMismatchError(
            f"{where}: the state is of a buffer with actor priorities, this one keeps none (they "
            f"would be lost). Fix: create the buffer with actor_priorities=True; to drop them "
            f"instead, delete state['priorities'] and set state['actor_priorities'] = False"
        )
    if has_records and header.episode_spec != storage.episode_spec:
        raise SpecMismatchError(
            f"{where}: the state's episode_spec is {header.episode_spec!r}, this buffer's is "
            f"{storage.episode_spec!r}. Fix: create the buffer with the same episode_spec"
        )


class ArrayForm:
    """How a state dict holds columns (``validate.Form``): arrays (or anything ``np.asarray``
    takes), in dicts from names to arrays."""

    def column(self, value: Any, what: str, where: str) -> np.ndarray:
        return as_array(value, what, where)

    def columns(self, value: Any, names: list[str], key: str, what: str, where: str
                ) -> dict[str, np.ndarray]:
        if not isinstance(value, Mapping) or set(value) != set(names):
            found = sorted(map(str, value)) if isinstance(value, Mapping) else show(value)
            raise bad(where, f"{key} should hold arrays for the {what}s {names}, found {found}")
        return {name: as_array(value[name], f"{what} {name!r}", where) for name in names}

    def array(self, column: np.ndarray, what: str, where: str) -> np.ndarray:
        return column
