"""A TorchRL storage backed by a shmbuf ``ReplayBuffer``: TensorDicts in and out, any of TorchRL's
samplers on top, and the rows in POSIX shared memory under a name fixed when the storage is made,
so every copy of it (pickled, or a forked child's) holds the same rows, whoever writes first."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection
from torchrl.data.replay_buffers.storages import Storage as _TorchRLStorage

from ..buffer import ReplayBuffer
from ..cleanup import forget_owned, register_owned
from ..errors import (
    BufferInUseError,
    ClosedError,
    SegmentExistsError,
    SegmentNotFoundError,
    SpecMismatchError,
    StaleIndexError,
)
from ..layout import LOCK_OWNER
from ..shmdir import new_name, normalize_name, unlink
from ..spec import Spec
from ..storage import BufferStorage

KEY_SEPARATOR = "/"  # nested TensorDict key ("next", "obs") <-> shmbuf field "next/obs"
LANE = 0  # the one lane the storage writes and reads
STALE_RETRIES = 8  # re-reads of a batch whose rows another process overwrote under the copy
CREATE_TRIES = 3  # create-or-attach rounds of a first write while the name comes and goes
CLOCK_SLACK_S = 1.0  # a segment made this long before its Storage object is still its own
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


def _spec_of(batch: TensorDictBase) -> Spec:
    """The shmbuf spec a TensorDict batch (with a batch dimension) would be stored under."""
    if batch.batch_dims < 1:
        raise SpecMismatchError(f"expected a TensorDict batch (batch_size [n, ...]), got "
                                f"batch_size {tuple(batch.batch_size)}")
    return Spec({name: (tuple(t.shape[1:]), _numpy_dtype(name, t.dtype))
                 for name, t in _flat_fields(batch).items()})


def _check_fits(spec: Spec, stored: Spec, name: str) -> None:
    """``spec`` (of a first batch) must be the spec another copy created ``name`` with."""
    ours, theirs = {f: spec[f].describe() for f in spec}, {f: stored[f].describe() for f in stored}
    diff = [f"{f!r}: {ours.get(f, 'absent')} here, {theirs.get(f, 'absent')} in the segment"
            for f in sorted(set(ours) | set(theirs)) if ours.get(f) != theirs.get(f)]
    if diff:
        raise SpecMismatchError(
            f"this batch does not fit segment {name!r}, which another copy of the storage "
            f"created from its own first batch: {'; '.join(diff)}. Fix: write batches with the "
            f"same entries, shapes and dtypes in every process")


class NamedBuffer:
    """The ``ReplayBuffer`` behind a ``Storage``, known by name before it exists: the first write
    in any process creates it (its spec from that batch), every other copy attaches by name.

    Ownership: the process that made the ``Storage`` (its *home*) owns the segment and unlinks
    it at ``close()`` and at exit (on SIGTERM, SIGINT, SIGHUP too), whoever created it. A copy in
    another process that creates it keeps the owner lease while it lives (``shmbuf gc`` never
    takes it for leaked) but never unlinks it; the home adopts it (``BufferStorage.adopt``) at
    its first use after that copy let go (closed, exited, killed). A segment of that name older
    than the ``Storage`` is someone else's: ``SegmentExistsError``.

    Concurrency: copies writing their first batch at once race on an exclusive create; exactly
    one creates, the others attach (waiting for the creator's header) and check that their batch
    fits. Rows follow the buffer's lane protocol.
    """

    def __init__(self, name: str | None, timeout: float) -> None:
        self.name = new_name("buf") if name is None else normalize_name(name)
        self.named = name is not None  # a name of the user's: the segment may predate us
        self.home: int | None = os.getpid()  # None: attached by from_name, never the owner
        self.made_at = time.time()
        self.timeout = timeout
        self.copy = False  # an unpickled copy: never the home, even in the home's process
        self.closed = False
        self.buffer: ReplayBuffer | None = None  # this process's handle, once attached
        if not self.named:  # nobody else can hold a fresh name: unlink it at exit, whoever made it
            register_owned(self.name)

    @property
    def at_home(self) -> bool:
        return self.home == os.getpid() and not self.copy

    def live(self) -> ReplayBuffer | None:
        """This process's handle on the segment (attached by name the first time it is there,
        adopted by the home once free); None if no copy has written yet, or closed."""
        if self.closed:
            return None
        if self.buffer is None:
            return self._attach()
        if self.at_home and not self.buffer.is_owner:
            self._adopt_if_free()
        return self.buffer

    def create(self, spec: Spec, max_size: int) -> tuple[ReplayBuffer, bool]:
        """Create the segment for ``spec``, or attach to the one another copy just created;
        ``(buffer, whether this call created it)``."""
        if self.closed:
            raise ClosedError(f"the storage over {self.name!r} is closed")
        for _ in range(CREATE_TRIES):
            try:
                buffer = ReplayBuffer.create(spec, max_size, lanes=1, name=self.name)
            except SegmentExistsError:
                attached = self._attach()
                if attached is None:  # unlinked between the two calls: try again
                    continue
                return attached, False
            if not self.at_home:  # the home owns it: this process must never unlink it
                buffer.storage.segment.owner = False
                forget_owned(self.name)
            elif self.named:
                register_owned(self.name)
            self.buffer = buffer
            return buffer, True
        raise SegmentExistsError(f"segment {self.name!r} came and went {CREATE_TRIES} times: "
                                 f"does another program use this name?")

    def _attach(self) -> ReplayBuffer | None:
        try:
            buffer = ReplayBuffer.attach(self.name, self.timeout)
        except SegmentNotFoundError:
            return None
        header = buffer.storage.segment.header
        if header.created < self.made_at - CLOCK_SLACK_S:
            buffer.close()
            raise SegmentExistsError(
                f"a segment named {self.name!r} exists from before this Storage was made (pid "
                f"{header.owner_pid} owns it): it is not this storage's. Fix: pass another "
                f"name= (or none), attach to it with Storage.from_name({self.name!r}), or "
                f"remove a leaked one with `shmbuf gc`")
        self.buffer = buffer
        if self.at_home:
            register_owned(self.name)  # ours: unlinked at exit even while a copy holds it
            self._adopt_if_free()
        return self.buffer

    def _adopt_if_free(self) -> None:
        """The home takes the owner lease once the copy that created the segment let it go."""
        old = self.buffer
        if old is None or old.storage.segment.probe(LOCK_OWNER):
            return
        try:
            self.buffer = ReplayBuffer(BufferStorage.adopt(self.name, self.timeout))
            old.close()
        except (SegmentExistsError, SegmentNotFoundError):  # taken, or unlinked, meanwhile
            return
        except BufferInUseError:  # the old mapping goes once the arrays viewing it are freed
            pass

    def close(self) -> None:
        """Close this handle; at home also unlink the segment (whoever created it). Idempotent."""
        if self.closed:
            return
        buffer = self.buffer
        if self.at_home and buffer is None:
            try:
                buffer = self._attach()  # a copy may have made it since
            except SegmentExistsError:  # someone else's: left alone
                buffer = None
        self.closed, self.buffer = True, None
        if self.at_home:
            if buffer is not None and not buffer.is_owner:
                unlink(self.name)  # a live copy created it and holds it: ours all the same
            forget_owned(self.name)
        if buffer is not None:
            buffer.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "buffer": None}  # each process attaches by name

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, copy=True)


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

    Across processes: the segment's name is fixed when the storage is made, so every copy
    (pickled, as by TorchRL's ``rb.share()`` pattern, or a forked child's) holds the same rows,
    before and after the first write, wherever it happens (``NamedBuffer``: who creates, who
    owns and unlinks). ``Storage.from_name(storage.name)`` maps an existing segment. TorchRL's
    samplers keep their state (priorities, permutations) in their own process: rows appended
    elsewhere get a ``PrioritizedSampler``'s default priority only once they are sampled and
    updated. ``rb.empty()`` is local: attached storages must re-attach after it.

    Concurrency: a storage takes the lane's writer lease on its first write and keeps it until
    ``close_writer()`` or ``close()`` (so a learner that never writes leaves the lane to an
    actor), or, under a shared TorchRL ``ReplayBuffer`` (its lock orders the writes), until the
    write is done; only the lease holder stores the lane's rows. Readers in any process load the
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
        self._writer_timeout = writer_timeout
        self._rows = NamedBuffer(name, writer_timeout)
        self._writer: Any = None
        self._fits = False  # this process checked its first batch against the segment's spec
        self._origin = 0  # logical index of position 0
        if example is not None:
            self._rows.create(_spec_of(example), self.max_size)
            self._fits = True

    @classmethod
    def from_name(cls, name: str, timeout: float = 5.0) -> Storage:
        """A storage over the existing buffer ``name`` (made by another ``Storage``); this
        process never unlinks it."""
        buffer = ReplayBuffer.attach(name, timeout)
        self = cls(buffer.capacity, name=name)
        self._rows.home, self._rows.buffer = None, buffer
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
        """The shmbuf buffer holding the rows (None until a first write anywhere, or
        ``example=``; attached by name here on first use)."""
        return self._rows.live()

    @property
    def name(self) -> str:
        """The shared-memory segment's name (fixed when the storage is made; the segment exists
        once a first batch is written anywhere, or with ``example=``), for ``from_name``."""
        return self._rows.name

    def _for_write(self, data: TensorDictBase) -> ReplayBuffer:
        """The segment to write ``data`` to: created from it if no copy wrote yet; else its
        first batch in this process must fit the spec another copy created."""
        buffer = self._rows.live()
        if buffer is None:
            buffer, self._fits = self._rows.create(_spec_of(data), self.max_size)
        if not self._fits:
            _check_fits(_spec_of(data), buffer.spec, buffer.name)
            self._fits = True
        return buffer

    def _arrays(self, buffer: ReplayBuffer, data: TensorDictBase) -> dict[str, np.ndarray]:
        flat = _flat_fields(data)
        missing = [name for name in buffer.spec if name not in flat]
        if missing:
            raise SpecMismatchError(f"TensorDict has no entry {missing[0]!r}, which this storage "
                                    f"holds (its fields: {list(buffer.spec)})")
        return {name: flat[name].detach().cpu().numpy() for name in buffer.spec}

    def _shared(self) -> bool:
        """A shared TorchRL ReplayBuffer (``rb.share()``) writes through this storage."""
        return any(getattr(e, "shared", False) is True for e in self._attached_entities)

    # -- writing -----------------------------------------------------------------------------------------
    def extend(self, data: TensorDictBase) -> range:
        """Append a batch at the ring's next positions (for processes without a TorchRL writer).

        Returns the logical indices given to the rows."""
        if not is_tensor_collection(data):
            raise TypeError(f"expected a TensorDict batch, got {type(data).__name__}; this storage "
                            f"holds TensorDicts (wrap tensors: TensorDict({{'x': t}}, [n]))")
        buffer = self._for_write(data)
        if self._writer is None or self._writer.closed:
            self._writer = buffer.writer(LANE, timeout=self._writer_timeout)
        return self._writer.extend(self._arrays(buffer, data))

    def _next_positions(self, buffer: ReplayBuffer, n: int) -> np.ndarray:
        start = int(buffer.committed(LANE)) - self._origin
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
        buffer = self._rows.live()
        expected = (self._next_positions(buffer, positions.size) if buffer is not None
                    else np.arange(positions.size) % self.max_size)
        if not np.array_equal(positions, expected):
            raise CursorMismatchError(
                f"TorchRL's writer wants positions starting at {int(positions[0])}, but the "
                f"shared ring's next position is {int(expected[0])}: this storage only appends "
                f"(a RoundRobinWriter, the lane's only writer in this process). Write from other "
                f"processes with storage.extend(td), and do not assign rb[i] = data")
        self.extend(data)
        if self._shared():  # the next writer may be another process's copy: give the lane back
            self.close_writer()
        if set_cursor:
            self._set_last_cursor(cursor)
        self._bump_mutation_revision()

    # -- reading -----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._held(self._rows.live())

    def _held(self, buffer: ReplayBuffer | None) -> int:
        if buffer is None or buffer.closed:
            return 0
        win = buffer.windows()
        return max(0, int(win.hi[LANE]) - max(int(win.lo[LANE]), self._origin))

    def _logical(self, buffer: ReplayBuffer, positions: np.ndarray) -> np.ndarray:
        written = int(buffer.windows().hi[LANE]) - self._origin
        held = min(written, self.max_size)
        if positions.size and (positions.min() < 0 or positions.max() >= held):
            bad = positions[(positions < 0) | (positions >= held)][0]
            raise IndexError(f"position {int(bad)} is not held: the storage holds {held} rows "
                             f"(positions [0, {held}))")
        return self._origin + positions + self.max_size * ((written - 1 - positions) // self.max_size)

    def get(self, index: Any) -> TensorDictBase:
        """Rows at ``index`` (an int, a sequence, a tensor or a slice of positions), copied."""
        buffer = self._rows.live()
        if buffer is None:
            raise (ClosedError(f"the storage over {self.name!r} is closed") if self._rows.closed
                   else IndexError("the storage is empty: nothing was written yet"))
        if isinstance(index, slice):
            index = range(*index.indices(self._held(buffer)))
        positions = np.asarray(torch.as_tensor(index).cpu(), dtype=np.int64)
        shape, flat = positions.shape, positions.reshape(-1)
        for attempt in range(STALE_RETRIES):
            try:
                rows = buffer.get(self._logical(buffer, flat), LANE)
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
        buffer = self._rows.live()
        if buffer is None:
            return {"buffer": None, "origin": 0}
        return {"buffer": buffer.state_dict(), "origin": self._origin}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = state_dict["buffer"]
        self.close_writer()
        buffer = self._rows.live()
        if state is None:
            if buffer is not None:
                self._empty()
            return
        if buffer is None:
            buffer, self._fits = self._rows.create(Spec.from_json(state["spec"]), self.max_size)
        buffer.load_state_dict(state)
        self._origin = int(state_dict["origin"])
        self._bump_mutation_revision()

    def dumps(self, path: str | os.PathLike[str]) -> None:
        """Save the rows to the directory ``path`` (``buf.save``'s format, plus ``origin``)."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        buffer = self._rows.live()
        if buffer is not None:
            buffer.save(directory / "rows", overwrite=True)
        (directory / "storage.json").write_text(json.dumps(
            {"origin": self._origin, "rows": buffer is not None}))

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
        buffer = self._rows.live()
        if buffer is None:
            return
        self.close_writer()
        buffer.clear()
        self._origin = int(buffer.committed(LANE))
        self._bump_mutation_revision()

    # -- teardown ------------------------------------------------------------------------------------------
    def close_writer(self) -> None:
        """Give the lane's writer lease back (the next write takes it again)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        """Close the writer and the buffer; in the process that made the storage, also unlink
        the segment (whichever copy created it). Idempotent."""
        self.close_writer()
        self._rows.close()

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_writer"] = None  # the lease stays here; the other process opens its own
        state["_fits"] = False  # a copy checks its own first batch
        return state

    def __repr__(self) -> str:
        return f"<shmbuf TorchRL Storage {self.name} {len(self)}/{self.max_size}>"


__all__ = ["CursorMismatchError", "Storage"]
