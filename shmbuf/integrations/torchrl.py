"""A TorchRL storage backed by a shmbuf ``ReplayBuffer``: TensorDicts in and out, any of TorchRL's
samplers on top, and the rows in POSIX shared memory where other processes can attach by name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection
from torchrl.data.replay_buffers.storages import Storage as _TorchRLStorage

from ..buffer import ReplayBuffer
from ..errors import SpecMismatchError, StaleIndexError
from ..spec import Spec

KEY_SEPARATOR = "/"  # nested TensorDict key ("next", "obs") <-> shmbuf field "next/obs"
LANE = 0  # the one lane the storage writes and reads
STALE_RETRIES = 8  # re-reads of a batch whose rows another process overwrote under the copy


_UNSET = object()


def _whole_batch(batch: TensorDictBase) -> TensorDictBase:
    """The collate function of a ReplayBuffer over this storage: ``get`` returns whole batches."""
    return batch


class CursorMismatchError(ValueError):
    """TorchRL's writer asked for positions other than the shared ring's next ones."""


def _numpy_dtype(key: str, dtype: torch.dtype) -> np.dtype:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        raise SpecMismatchError(
            f"TensorDict entry {key!r}: dtype {dtype} has no NumPy equivalent; cast it (e.g. "
            f"bfloat16 -> float32) before extending the buffer"
        ) from None


def _flat_fields(data: TensorDictBase) -> dict[str, torch.Tensor]:
    """Leaves of ``data`` keyed by their "/"-joined nested key, in the TensorDict's order."""
    out: dict[str, torch.Tensor] = {}
    for key, value in data.items(include_nested=True, leaves_only=True):
        parts = (key,) if isinstance(key, str) else key
        if any(KEY_SEPARATOR in p for p in parts):
            raise SpecMismatchError(
                f"TensorDict key {key!r} contains {KEY_SEPARATOR!r}, which this storage uses to "
                f"join nested keys; rename the entry"
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"TensorDict entry {key!r} is a {type(value).__name__}, not a tensor: "
                            f"this storage keeps tensors only")
        out[KEY_SEPARATOR.join(parts)] = value
    return out


class Storage(_TorchRLStorage):
    """A TorchRL storage whose rows live in a shmbuf ``ReplayBuffer`` (one lane, ``max_size`` rows).

    The shmbuf spec is inferred from the first TensorDict written (nested keys become fields
    named ``"next/obs"``; each entry's shape after the batch dimension is its field's shape), or
    given up front with ``example=`` so the segment exists, and can be attached, before any write.
    Rows come back with ``batch_size=[n]``: batch dims after the first are kept in the tensors'
    shapes but not restored as TensorDict batch dims.
    ``get`` returns TensorDicts of CPU tensors that own their memory: every read is a checked copy
    out of shared memory (a row being overwritten is re-read), wrapped with ``torch.from_numpy``
    without a second copy, so batches stay valid however long TorchRL or the learner keeps them.

    TorchRL's ``RoundRobinWriter`` chooses the positions of a write; shmbuf writers append. The
    two agree because position ``p`` is the ring slot of logical index ``origin + p`` (``origin``
    is where the ring was last emptied), and each ``set`` checks that the cursor is the ring's
    next position, raising ``CursorMismatchError`` otherwise (another writer appended to the
    lane, or ``rb[i] = data`` tried to overwrite a row in place).

    Across processes: ``Storage.from_name(storage.name)`` (or pickling the storage) maps the same
    rows. A process that only writes appends with ``storage.extend(td)``; the process that owns
    the TorchRL ``ReplayBuffer`` samples everything held, whoever wrote it. TorchRL's samplers
    keep their state (priorities, permutations) in their own process: rows appended elsewhere get
    a ``PrioritizedSampler``'s default priority only once they are sampled and updated.
    ``rb.empty()`` is local: attached storages must re-attach after it.

    Concurrency: a storage takes the lane's writer lease on its first write and keeps it until
    ``close_writer()`` or ``close()`` (so a learner that never writes leaves the lane to an
    actor); only the lease holder stores the lane's rows. Readers in any process load the
    lane's window and check every row's stamp around the copy.

    Example:
        >>> from torchrl.data import ReplayBuffer, RandomSampler
        >>> rb = ReplayBuffer(storage=Storage(1000), sampler=RandomSampler(), batch_size=32)
        >>> rb.extend(TensorDict({"obs": torch.zeros(64, 4)}, batch_size=[64]))
        >>> rb.sample()["obs"].shape
        torch.Size([32, 4])
    """

    def __init__(self, max_size: int, *, name: str | None = None,
                 example: TensorDictBase | None = None, writer_timeout: float = 5.0) -> None:
        super().__init__(max_size)
        if self.max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self._name = name
        self._writer_timeout = writer_timeout
        self._buffer: ReplayBuffer | None = None
        self._writer: Any = None
        self._origin = 0  # logical index of position 0
        if example is not None:
            self._create(example)

    @classmethod
    def from_name(cls, name: str, timeout: float = 5.0) -> Storage:
        """A storage over the existing buffer ``name`` (made by another ``Storage``)."""
        buffer = ReplayBuffer.attach(name, timeout)
        self = cls(buffer.capacity, name=name)
        self._buffer = buffer
        return self

    def attach(self, buffer: Any) -> None:
        """TorchRL's hook for a ReplayBuffer (or sampler) reading this storage.

        ``get`` already returns whole batches, so a ReplayBuffer built without ``collate_fn``
        gets the identity (TorchRL picks it by storage class, and knows only its own; should a
        TorchRL release rename the attribute, pass ``collate_fn=lambda batch: batch``).
        """
        super().attach(buffer)
        if getattr(buffer, "_init_collate_fn", _UNSET) is None:
            buffer._init_collate_fn = _whole_batch

    # -- the shmbuf buffer -------------------------------------------------------------------------------
    @property
    def buffer(self) -> ReplayBuffer | None:
        """The shmbuf buffer holding the rows (None until the first write or ``example=``)."""
        return self._buffer

    @property
    def name(self) -> str:
        """The shared-memory segment's name, for ``Storage.from_name`` in another process."""
        if self._buffer is None:
            raise RuntimeError("the storage has no segment yet: write a first batch, or pass "
                               "example=<a TensorDict batch> to Storage(...)")
        return self._buffer.name

    def _create(self, batch: TensorDictBase) -> None:
        """Make the segment, its spec from ``batch`` (a TensorDict with a batch dimension)."""
        if batch.batch_dims < 1:
            raise SpecMismatchError(f"expected a TensorDict batch (batch_size [n, ...]), got "
                                    f"batch_size {tuple(batch.batch_size)}")
        fields = {name: (tuple(t.shape[1:]), _numpy_dtype(name, t.dtype))
                  for name, t in _flat_fields(batch).items()}
        self._buffer = ReplayBuffer.create(Spec(fields), self.max_size, lanes=1, name=self._name)

    def _open_writer(self) -> Any:
        if self._writer is None or self._writer.closed:
            assert self._buffer is not None
            self._writer = self._buffer.writer(LANE, timeout=self._writer_timeout)
        return self._writer

    def _arrays(self, data: TensorDictBase) -> dict[str, np.ndarray]:
        assert self._buffer is not None
        flat = _flat_fields(data)
        out: dict[str, np.ndarray] = {}
        for name in self._buffer.spec:
            if name not in flat:
                raise SpecMismatchError(f"TensorDict has no entry {name!r}, which this storage "
                                        f"holds (its fields: {list(self._buffer.spec)})")
            out[name] = flat[name].detach().cpu().numpy()
        return out

    # -- writing -----------------------------------------------------------------------------------------
    def extend(self, data: TensorDictBase) -> range:
        """Append a batch at the ring's next positions (for processes without a TorchRL writer).

        Returns the logical indices given to the rows."""
        if not is_tensor_collection(data):
            raise TypeError(f"expected a TensorDict batch, got {type(data).__name__}; this storage "
                            f"holds TensorDicts (wrap tensors: TensorDict({{'x': t}}, [n]))")
        if self._buffer is None:
            self._create(data)
        return self._open_writer().extend(self._arrays(data))

    def _next_positions(self, n: int) -> np.ndarray:
        assert self._buffer is not None
        start = int(self._buffer.committed(LANE)) - self._origin
        return (start + np.arange(n)) % self.max_size

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """TorchRL's write: ``data`` at positions ``cursor``, which must be the ring's next ones."""
        if not is_tensor_collection(data):
            raise TypeError(f"expected a TensorDict, got {type(data).__name__}; this storage holds "
                            f"TensorDicts (wrap tensors: TensorDict({{'x': t}}, batch_size=[n]))")
        single = isinstance(cursor, (int, np.integer)) or (
            isinstance(cursor, torch.Tensor) and cursor.ndim == 0)
        if single:
            data = data.unsqueeze(0)
        positions = np.atleast_1d(np.asarray(torch.as_tensor(cursor).cpu(), dtype=np.int64))
        expected = (self._next_positions(positions.size) if self._buffer is not None
                    else np.arange(positions.size) % self.max_size)
        if not np.array_equal(positions, expected):
            raise CursorMismatchError(
                f"TorchRL's writer wants positions starting at {int(positions[0])}, but the "
                f"shared ring's next position is {int(expected[0])}: this storage only appends "
                f"(a RoundRobinWriter, the lane's only writer in this process). Write from other "
                f"processes with storage.extend(td), and do not assign rb[i] = data")
        self.extend(data)
        if set_cursor:
            self._set_last_cursor(cursor)
        self._bump_mutation_revision()

    # -- reading -----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        if self._buffer is None or self._buffer.closed:
            return 0
        win = self._buffer.windows()
        lo, hi = int(win.lo[LANE]), int(win.hi[LANE])
        return max(0, hi - max(lo, self._origin))

    def _logical(self, positions: np.ndarray) -> np.ndarray:
        assert self._buffer is not None
        written = int(self._buffer.windows().hi[LANE]) - self._origin
        if positions.size and (positions.min() < 0 or positions.max() >= min(written, self.max_size)):
            bad = positions[(positions < 0) | (positions >= min(written, self.max_size))][0]
            raise IndexError(f"position {int(bad)} is not held: the storage holds "
                             f"{len(self)} rows (positions [0, {len(self)}))")
        return self._origin + positions + self.max_size * ((written - 1 - positions) // self.max_size)

    def get(self, index: Any) -> TensorDictBase:
        """Rows at ``index`` (an int, a sequence, a tensor or a slice of positions), copied."""
        if self._buffer is None:
            raise IndexError("the storage is empty: nothing was written yet")
        if isinstance(index, slice):
            index = range(*index.indices(len(self)))
        positions = np.asarray(torch.as_tensor(index).cpu(), dtype=np.int64)
        shape = positions.shape
        flat = positions.reshape(-1)
        for attempt in range(STALE_RETRIES):
            try:
                rows = self._buffer.get(self._logical(flat), LANE)
                break
            except StaleIndexError:  # another process overwrote some rows under the copy
                if attempt == STALE_RETRIES - 1:
                    raise
        out = TensorDict({}, batch_size=shape)
        for name, arr in rows.items():
            value = torch.from_numpy(arr)
            out.set(tuple(name.split(KEY_SEPARATOR)), value.reshape((*shape, *value.shape[1:])))
        return out

    def contains(self, item: Any) -> Any:
        positions = torch.as_tensor(item)
        return (positions >= 0) & (positions < len(self))

    # -- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._buffer is None:
            return {"buffer": None, "origin": 0}
        return {"buffer": self._buffer.state_dict(), "origin": self._origin}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = state_dict["buffer"]
        self.close_writer()
        if state is None:
            if self._buffer is not None:
                self._empty()
            return
        if self._buffer is None:
            spec = Spec.from_json(state["spec"])
            self._buffer = ReplayBuffer.create(spec, self.max_size, lanes=1, name=self._name)
        self._buffer.load_state_dict(state)
        self._origin = int(state_dict["origin"])
        self._bump_mutation_revision()

    def dumps(self, path: str | os.PathLike[str]) -> None:
        """Save the rows to the directory ``path`` (``buf.save``'s format, plus ``origin``)."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        if self._buffer is not None:
            self._buffer.save(directory / "rows", overwrite=True)
        (directory / "storage.json").write_text(json.dumps(
            {"origin": self._origin, "rows": self._buffer is not None}))

    def loads(self, path: str | os.PathLike[str]) -> None:
        """Replace the rows with those ``dumps`` saved in ``path``."""
        directory = Path(path)
        meta = json.loads((directory / "storage.json").read_text())
        state = None
        if meta["rows"]:
            with ReplayBuffer.load(directory / "rows", capacity=self.max_size) as saved:
                state = saved.state_dict()
        self.load_state_dict({"buffer": state, "origin": meta["origin"]})

    def _empty(self) -> None:
        if self._buffer is None:
            return
        self.close_writer()
        self._buffer.clear()
        self._origin = int(self._buffer.committed(LANE))
        self._bump_mutation_revision()

    # -- teardown ------------------------------------------------------------------------------------------
    def close_writer(self) -> None:
        """Give the lane's writer lease back (the next write takes it again)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        """Close the writer and the buffer; the creating storage also unlinks the segment."""
        self.close_writer()
        if self._buffer is not None:
            self._buffer.close()

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_writer"] = None  # the lease stays here; the other process opens its own
        return state

    def __repr__(self) -> str:
        where = self._buffer.name if self._buffer is not None else "no segment yet"
        return f"<shmbuf TorchRL Storage {where} {len(self)}/{self.max_size}>"


__all__ = ["CursorMismatchError", "Storage"]
