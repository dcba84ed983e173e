"""SB3's buffer arrays over shmbuf rows: ``Column`` reads a field in SB3's layout
``(buffer_size, n_envs, *shape)`` at SB3's positions, every read a checked copy of the rows it
indexes; writes raise ``RowsWriteError``, naming the call that publishes rows.

Used by ``shmbuf.integrations.sb3`` for ``.observations``, ``.actions``, ``.rewards``...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from ..errors import ShmbufError, StaleIndexError

_READ_TRIES = 3


class RowsWriteError(ShmbufError, ValueError):
    """A write into SB3's arrays, or to ``pos``/``full``, that shmbuf's rows cannot take: rows
    are published only by ``add()`` (and emptied by ``reset()``), so that no reader ever sees
    a row half-written."""


def refuse_write(what: str) -> NoReturn:
    raise RowsWriteError(
        f"{what}: the rows of shmbuf.integrations.sb3's buffers are read-only (each is published "
        f"once, whole, for readers in any process). Fix: append transitions with add(), empty "
        f"the buffer with reset(), or edit a copy (np.array(buffer.observations))")


class Column(np.lib.mixins.NDArrayOperatorsMixin):
    """One field of an SB3 buffer as SB3 lays it out: ``column[position, env, ...]``.

    Indexing reads only the positions it selects, with the buffer's seqlock-checked reads, into
    a new array: where NumPy would return a view (an int or a slice as the first index), the
    array is read-only, since writing into it could not reach the buffer; where NumPy copies
    (index arrays, masks), it is the caller's, writable. ``np.asarray(column)`` and NumPy's
    methods (``column.mean()``) read the whole column. A position no transition holds (not
    written yet, emptied by ``reset()``, or with ``optimize_memory_usage`` overwritten by the
    ring's episode-final rows) reads as zeros, as SB3's zero-filled arrays do.

    Concurrency: reads only; the writer in the process that owns the SB3 buffer publishes.
    """

    def __init__(self, read: Callable[[np.ndarray], np.ndarray], length: int,
                 shape: tuple[int, ...], dtype: Any, name: str,
                 write: Callable[[Any, Any], None] | None = None) -> None:
        self._read = read
        self._write = write
        self._name = name
        self.shape = (length, *shape)
        self.dtype = np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<SB3 column {self._name} shape={self.shape} dtype={self.dtype}>"

    def __getitem__(self, key: Any) -> Any:
        key = key if isinstance(key, tuple) else (key,)
        first = key[0] if key else slice(None)
        if not isinstance(first, (int, np.integer, slice, list, np.ndarray)) or (
                isinstance(first, np.ndarray) and first.dtype == bool and first.ndim != 1):
            block, local = self._read(np.arange(self.shape[0])), key  # Ellipsis, None, masks
        else:
            positions = np.arange(self.shape[0])[first]  # NumPy's bounds and negative indices
            block = self._read(np.atleast_1d(positions).ravel())
            if isinstance(first, slice):
                local = (slice(None), *key[1:])
            elif positions.ndim == 0:
                local = (0, *key[1:])
            else:  # the same shape of index array, into the rows read: NumPy's semantics
                local = (np.arange(positions.size).reshape(positions.shape), *key[1:])
        out = block[local]
        if isinstance(out, np.ndarray) and np.may_share_memory(out, block):
            out.flags.writeable = False  # SB3's would be a view of the buffer: refuse writes
        return out

    def __setitem__(self, key: Any, value: Any) -> None:
        if self._write is None:
            refuse_write(f"{self._name}[...] = ...")
        self._write(key, value)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        whole = self._read(np.arange(self.shape[0]))
        if not copy:
            whole.flags.writeable = False
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if any(o is self for o in kwargs.get("out", ())):
            refuse_write(f"{self._name} as a ufunc's out= (an in-place operator)")
        inputs = tuple(np.asarray(x) if isinstance(x, Column) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __iter__(self) -> Any:
        return (self[p] for p in range(self.shape[0]))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (pickle and copy probe these: no whole read for them)
            raise AttributeError(name)
        return getattr(np.asarray(self), name)  # .mean(), .copy(), .tolist()...

    def __reduce__(self) -> NoReturn:
        raise TypeError(f"{self._name} is a view of a shared buffer: pickle np.array(it)")


class ColumnDict(dict):
    """A Dict observation space's columns, ``{key: Column}``; entries cannot be replaced."""

    def __setitem__(self, key: Any, value: Any) -> NoReturn:
        refuse_write(f"observations[{key!r}] = ...")

    def __delitem__(self, key: Any) -> NoReturn:
        refuse_write(f"del observations[{key!r}]")

    def update(self, *args: Any, **kwargs: Any) -> NoReturn:
        refuse_write("observations.update(...)")


def read_rows(shared: Any, rows: np.ndarray, field: str, tail: tuple[int, ...],
              dtype: np.dtype) -> np.ndarray:
    """``field`` at SB3 positions: ``rows[k, env]`` logical indices (-1: none) -> an array
    ``[k, n_envs, *tail]``, zeros where the row is not held; checked reads (``gather_at``)."""
    k, n_envs = rows.shape
    lanes = np.broadcast_to(np.arange(n_envs, dtype=np.int64), rows.shape).ravel()
    indices = rows.ravel()
    f = shared.spec[field]
    out = np.zeros((indices.size, *f.shape), f.dtype)
    for _ in range(_READ_TRIES):
        win = shared.windows()
        held = (indices >= win.lo[lanes]) & (indices < win.hi[lanes])
        got = {field: np.empty((int(held.sum()), *f.shape), f.dtype)}
        if not held.any() or shared.gather_at(got, lanes[held], indices[held]):
            out[held] = got[field]
            return out.reshape(k, n_envs, *tail).astype(dtype, copy=False)
    raise StaleIndexError(
        f"rows of {field!r} kept being overwritten while read ({_READ_TRIES} tries): another "
        f"process writes into this SB3 buffer's lanes; only its owner's add() should")


__all__ = ["Column", "ColumnDict", "RowsWriteError", "read_rows", "refuse_write"]
