"""A TorchRL storage backed by a shmbuf ``ReplayBuffer``: ``LazyTensorStorage``'s contract
(TensorDicts, tensors, pytrees, ``ndim``, writes at any held position, TorchRL's writers and
samplers on top) with the rows in POSIX shared memory under a name fixed when the storage is made,
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
from tensordict import TensorDictBase
from torchrl.data.replay_buffers.storages import Storage as _TorchRLStorage

from .. import slots
from ..buffer import ReplayBuffer
from ..cleanup import forget_owned, register_owned
from ..errors import (
    BufferInUseError,
    ClosedError,
    SegmentExistsError,
    SegmentNotFoundError,
    ShmbufError,
    SpecMismatchError,
    StaleIndexError,
)
from ..layout import LOCK_OWNER
from ..shmdir import new_name, normalize_name, unlink
from ..spec import Spec
from ..storage import BufferStorage
from . import torchrl_forms as forms
from .torchrl_forms import Form

LANE = 0  # the one lane the storage writes and reads
STALE_RETRIES = 8  # re-reads of a batch whose rows another process overwrote under the copy
CREATE_TRIES = 3  # create-or-attach rounds of a first write while the name comes and goes
CLOCK_SLACK_S = 1.0  # a segment made this long before its Storage object is still its own
_UNSET = object()
_KIND_NAMES = {"td": "TensorDict", "tensor": "tensor", "tree": "pytree of tensors"}


def _whole_batch(batch: TensorDictBase) -> TensorDictBase:
    """The collate function of a ReplayBuffer over this storage: ``get`` returns whole batches."""
    return batch


class CursorMismatchError(ShmbufError, ValueError):
    """A write names positions the storage cannot take: new positions that are not the ring's
    next ones in order (positions already held can be rewritten), or a cursor of another kind
    than positions along the first dimension."""


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
    """A TorchRL storage whose rows live in a shmbuf ``ReplayBuffer`` (one lane): a drop-in for
    ``LazyTensorStorage`` whose rows every process sees.

    What it holds, as ``LazyTensorStorage`` does: TensorDicts (nested keys become fields named
    ``"next/obs"``; batch dimensions after the first come back as batch dimensions), plain
    tensors, pytrees (dicts, tuples, lists) of tensors, and lists of such items (stacked, one
    row each). The shmbuf spec is inferred from the first write, in any process, or given up
    front with ``example=`` (a batch) so the segment exists before any write. With ``ndim=2``
    (TorchRL's envs x time layout) a row is one step of every env: ``len`` counts elements,
    ``max_size`` rounds up to whole rows, and indices are tuples, as ``LazyTensorStorage``'s.

    Positions: position ``p`` is the ring slot of logical index ``origin + p`` (``origin`` is
    where the ring was last emptied), so TorchRL's ``RoundRobinWriter`` appends. A write at
    positions already held (``rb[i] = td``, ``rb[1:2] = td``, ``TensorDictMaxValueWriter``
    replacing a row, a writer whose cursor another process moved) rewrites those rows in place
    under a versioned stamp (``slots.rewrite_rows``): a reader copying a row while it is
    rewritten retries, it never gets half of each. New positions must be the ring's next ones
    in order (``CursorMismatchError`` otherwise, before anything is stored).

    ``get`` returns CPU tensors (moved to ``device`` if another) that own their memory: every
    read is a checked copy out of shared memory, so batches stay valid however long they are
    kept. ``len`` counts the rows held (times the elements per row with ``ndim=2``), which is
    ``LazyTensorStorage``'s count except after a write with ``set_cursor=True`` at positions
    already held, which it counts again and this storage does not.

    Across processes: the segment's name is fixed when the storage is made, so every copy
    (pickled, as by TorchRL's ``rb.share()`` pattern, or a forked child's) holds the same rows,
    before and after the first write, wherever it happens (``NamedBuffer``: who creates, who
    owns and unlinks); ``shared_init`` is accepted for ``LazyTensorStorage``'s signature and
    always so. ``Storage.from_name(storage.name)`` maps an existing segment. TorchRL's samplers
    and writers keep their state (priorities, rankings, cursors) in their own process unless
    the ReplayBuffer is shared. ``rb.empty()`` is local: attached storages must re-attach.

    Concurrency: a storage takes the lane's writer lease on its first write and keeps it until
    ``close_writer()`` or ``close()`` (so a learner that never writes leaves the lane to an
    actor), or, under a shared TorchRL ``ReplayBuffer`` (its lock orders the writes), until the
    write is done; only the lease holder stores the lane's rows, appends and rewrites alike.
    Readers in any process load the lane's window and check every row's stamp around the copy.

    Example:
        >>> from torchrl.data import ReplayBuffer, RandomSampler
        >>> rb = ReplayBuffer(storage=Storage(1000), sampler=RandomSampler(), batch_size=32)
        >>> rb.extend(TensorDict({"obs": torch.zeros(64, 4)}, batch_size=[64]))
        >>> rb.sample()["obs"].shape
        torch.Size([32, 4])
    """

    def __init__(self, max_size: int, *, name: str | None = None, example: Any = None,
                 writer_timeout: float = 5.0, ndim: int = 1, device: Any = "cpu",
                 shared_init: bool = True) -> None:
        super().__init__(max_size)
        if self.max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        if not isinstance(ndim, int) or ndim < 1:
            raise ValueError(f"ndim must be an int >= 1, got {ndim!r}")
        self.ndim = ndim
        self.device = torch.device("cpu") if device in (None, "auto") else torch.device(device)
        self.shared_init = shared_init  # always shared: the name is fixed now
        self._writer_timeout = writer_timeout
        self._rows = NamedBuffer(name, writer_timeout)
        self._writer: Any = None
        self._fits = False  # this process checked its first batch against the segment's spec
        self._origin = 0  # logical index of position 0
        self._marks = np.zeros(0, np.uint8)  # the marker field's values (any n, all 0)
        if example is not None:
            form, fields = forms.flatten(example, ndim)
            self._create(forms.spec_of(form, fields), fields)
            self._fits = True

    @classmethod
    def from_name(cls, name: str, timeout: float = 5.0, *, ndim: int = 1) -> Storage:
        """A storage over the existing buffer ``name`` (made by another ``Storage``); this
        process never unlinks it."""
        buffer = ReplayBuffer.attach(name, timeout)
        self = cls(buffer.capacity, name=name, ndim=ndim)
        self._rows.home, self._rows.buffer = None, buffer
        self._sync_max_size(buffer)
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
        return self._live()

    @property
    def name(self) -> str:
        """The shared-memory segment's name (fixed when the storage is made; the segment exists
        once a first batch is written anywhere, or with ``example=``), for ``from_name``."""
        return self._rows.name

    def _live(self) -> ReplayBuffer | None:
        buffer = self._rows.live()
        if buffer is not None and self.ndim > 1:
            self._sync_max_size(buffer)
        return buffer

    def _per_row(self, spec: Spec) -> int:
        """Elements per row: the product of the first ``ndim - 1`` dims of the fields."""
        if self.ndim == 1:
            return 1
        shape = spec[forms.data_fields(spec)[0]].shape
        if len(shape) < self.ndim - 1:
            raise SpecMismatchError(f"the rows of {self.name!r} have shape {shape}: too few "
                                    f"dimensions for ndim={self.ndim}")
        return int(np.prod(shape[: self.ndim - 1]))

    def _sync_max_size(self, buffer: ReplayBuffer) -> None:
        """With ``ndim > 1``, ``max_size`` is whole rows' elements (as ``LazyTensorStorage``'s)."""
        self.max_size = buffer.capacity * self._per_row(buffer.spec)

    def _create(self, spec: Spec, fields: dict[str, torch.Tensor]) -> ReplayBuffer:
        rows = -(self.max_size // -self._per_row(spec))
        buffer, self._fits = self._rows.create(spec, rows)
        self._sync_max_size(buffer)
        return buffer

    def _for_write(self, form: Form, fields: dict[str, torch.Tensor]) -> ReplayBuffer:
        """The segment to write to: created from this batch if no copy wrote yet; else its
        first batch in this process must fit the spec another copy created."""
        buffer = self._live()
        spec = forms.spec_of(form, fields)
        if buffer is None:
            buffer = self._create(spec, fields)
        if not self._fits:
            _check_fits(spec, buffer.spec, buffer.name)
            self._fits = True
        return buffer

    def _arrays(self, buffer: ReplayBuffer, form: Form, fields: dict[str, torch.Tensor],
                n: int) -> dict[str, np.ndarray]:
        """Each field's ``n`` rows as NumPy arrays of the field's dtype, checked against the
        spec (form, names, shapes, dtypes) before anything is stored."""
        spec = buffer.spec
        held = Form.of_spec(spec)
        if held != form:
            raise SpecMismatchError(
                f"these rows are a {_KIND_NAMES[form.kind]} with {form.batch_dims} batch "
                f"dimension(s) after the first; the storage holds rows of a "
                f"{_KIND_NAMES[held.kind]} with {held.batch_dims}: write data of one kind")
        names = forms.data_fields(spec)
        missing = [name for name in names if name not in fields]
        extra = [name for name in fields if name not in spec]
        if missing or extra:
            raise SpecMismatchError(
                f"these rows do not match the storage's entries: missing {missing}, not held "
                f"{extra} (the storage holds {names}); write the same entries every time")
        out: dict[str, np.ndarray] = {}
        for name in names:
            field, value = spec[name], fields[name].detach()
            if tuple(value.shape) != (n, *field.shape):
                raise SpecMismatchError(
                    f"entry {name!r}: rows of shape {tuple(value.shape[1:])}, the storage holds "
                    f"{field.shape}; reshape them (or make another storage)")
            array = value.cpu().numpy()
            if array.dtype != field.dtype:
                if not np.can_cast(array.dtype, field.dtype, "same_kind"):
                    raise SpecMismatchError(
                        f"entry {name!r}: dtype {array.dtype} does not cast to the storage's "
                        f"{field.dtype}; cast the rows first")
                array = array.astype(field.dtype)
            out[name] = array
        for name in spec:
            if name not in out:  # the marker
                if self._marks.shape[0] < n:
                    self._marks = np.zeros(max(n, 2 * self._marks.shape[0]), np.uint8)
                out[name] = self._marks[:n]
        return out

    def _shared(self) -> bool:
        """A shared TorchRL ReplayBuffer (``rb.share()``) writes through this storage."""
        return any(getattr(e, "shared", False) is True for e in self._attached_entities)

    # -- writing -----------------------------------------------------------------------------------------
    def extend(self, data: Any) -> range:
        """Append a batch (a TensorDict, tensor, pytree of tensors, or a list of items) at the
        ring's next positions, for processes without a TorchRL writer.

        Returns the logical indices given to the rows."""
        data = forms.stack_items(data) if isinstance(data, list) else data
        form, fields = forms.flatten(data, self.ndim)
        buffer = self._for_write(form, fields)
        arrays = self._arrays(buffer, form, fields, next(iter(fields.values())).shape[0])
        return self._append(buffer, arrays)

    def _append(self, buffer: ReplayBuffer, arrays: dict[str, np.ndarray]) -> range:
        self._lease(buffer)
        return self._writer.extend(arrays)  # type: ignore[no-any-return]

    def _lease(self, buffer: ReplayBuffer) -> None:
        """Hold the lane's writer lease (taken once, kept until ``close_writer``)."""
        if self._writer is None or self._writer.closed:
            self._writer = buffer.writer(LANE, timeout=self._writer_timeout)

    def _next_positions(self, buffer: ReplayBuffer, n: int) -> np.ndarray:
        start = int(buffer.committed(LANE)) - self._origin
        return (start + np.arange(n)) % buffer.capacity

    def _cursor_positions(self, cursor: Any, n: int, buffer: ReplayBuffer | None) -> np.ndarray:
        """The positions a write's ``cursor`` names, one per row, or ``CursorMismatchError``."""
        capacity = buffer.capacity if buffer is not None else None
        if isinstance(cursor, slice):
            if capacity is None:
                raise CursorMismatchError(
                    f"cursor {cursor}: nothing was written yet, so the storage has no positions "
                    f"to slice; append with rb.extend(data) first")
            positions = np.arange(capacity)[cursor]
        elif isinstance(cursor, tuple):
            raise CursorMismatchError(
                f"cursor {cursor!r}: this storage writes whole positions along the first "
                f"dimension only; write rows at positions (rb[i] = row), not elements of a row")
        else:
            positions = np.atleast_1d(np.asarray(torch.as_tensor(cursor).cpu(), dtype=np.int64))
            positions = positions.reshape(-1)
        if positions.size != n:
            raise CursorMismatchError(f"cursor {cursor!r} names {positions.size} positions for "
                                      f"{n} rows; give one position per row")
        return positions

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """TorchRL's write: ``data`` (a batch, a list of items, or one item at an int cursor)
        at positions ``cursor``: appended where they are the ring's next ones, rewritten in
        place where they are held already."""
        if isinstance(data, list):
            data = forms.stack_items(data)
        single = isinstance(cursor, (int, np.integer)) or (
            isinstance(cursor, torch.Tensor) and cursor.ndim == 0)
        if single:
            data = forms.with_batch_dim(data)
        form, fields = forms.flatten(data, self.ndim)
        n = next(iter(fields.values())).shape[0]
        positions = self._cursor_positions(cursor, n, self._live())
        buffer = self._for_write(form, fields)
        arrays = self._arrays(buffer, form, fields, n)
        self._write(buffer, positions, arrays)
        if self._shared():  # the next writer may be another process's copy: give the lane back
            self.close_writer()
        if set_cursor:
            self._set_last_cursor(cursor)
        self._bump_mutation_revision()

    def _write(self, buffer: ReplayBuffer, positions: np.ndarray,
               arrays: dict[str, np.ndarray]) -> None:
        """Append the rows at the ring's next positions, rewrite those at held positions (the
        last row given for a position wins); check every position before storing any."""
        if np.array_equal(positions, self._next_positions(buffer, positions.size)):
            self._append(buffer, arrays)
            return
        capacity, held = buffer.capacity, self._held_rows(buffer)
        negative = positions < 0
        positions = np.where(negative, positions + held, positions)
        last = positions.size - 1 - np.unique(positions[::-1], return_index=True)[1]
        unique = positions[last]  # ascending, each position's last row
        new = unique >= held
        want = np.arange(held, held + int(new.sum()))
        if (unique < 0).any() or not np.array_equal(unique[new], want) or want.size and (
                want[-1] >= capacity):
            bad = unique[(unique < 0) | (unique >= capacity)]
            raise CursorMismatchError(
                f"positions {unique[new].tolist() if not bad.size else bad.tolist()} cannot be "
                f"written: the storage holds positions [0, {held}) of {capacity}, and new rows "
                f"go at the next positions in order ({held}, {held + 1}, ...). Rewrite held "
                f"positions (rb[i] = row), or append (rb.extend(rows))")
        if new.any():
            self._append(buffer, {f: a[last[new]] for f, a in arrays.items()})
        if not new.all():
            self._rewrite(buffer, unique[~new], {f: a[last[~new]] for f, a in arrays.items()})

    def _rewrite(self, buffer: ReplayBuffer, positions: np.ndarray,
                 arrays: dict[str, np.ndarray]) -> None:
        """Rewrite held ``positions`` (distinct) in place, under the lane's writer lease."""
        self._lease(buffer)
        logical = self._logical(buffer, positions)
        storage = buffer.storage
        names = list(buffer.spec)
        slots.rewrite_rows(storage.stamps, logical % buffer.capacity, logical,
                           [storage.columns[f] for f in names], [arrays[f] for f in names])

    # -- reading -----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        buffer = self._live()
        if buffer is None or buffer.closed:
            return 0
        return self._held_rows(buffer) * self._per_row(buffer.spec)

    @property
    def _len(self) -> int:
        return len(self)

    @_len.setter
    def _len(self, value: int) -> None:
        """TorchRL's writers set it after ``write_at``; here the ring's words say it."""

    def _held_rows(self, buffer: ReplayBuffer | None) -> int:
        if buffer is None or buffer.closed:
            return 0
        win = buffer.windows()
        return max(0, int(win.hi[LANE]) - max(int(win.lo[LANE]), self._origin))

    @property
    def _len_along_dim0(self) -> int:
        return self._held_rows(self._live())

    @property
    def _total_shape(self) -> torch.Size | None:
        buffer = self._live()
        if buffer is None:
            return None
        first = buffer.spec[forms.data_fields(buffer.spec)[0]]
        return torch.Size([buffer.capacity, *first.shape[: self.ndim - 1]])

    @property
    def shape(self) -> torch.Size | None:
        """``[rows held, *the row's first ndim - 1 dims]`` (None before the first write)."""
        total = self._total_shape
        if total is None:
            return None
        return torch.Size([self._len_along_dim0, *total[1:]])

    @property
    def _is_full(self) -> bool:
        buffer = self._live()
        return buffer is not None and self._held_rows(buffer) == buffer.capacity

    @property
    def _last_cursor_index(self) -> int | None:
        """The position of the ring's newest row (None when empty), from the shared words, so
        it is right whichever process wrote last."""
        buffer = self._live()
        if buffer is None or self._held_rows(buffer) == 0:
            return None
        return (int(buffer.committed(LANE)) - self._origin - 1) % buffer.capacity

    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        buffer = self._live()
        if buffer is not None:
            return buffer.capacity
        if self.ndim == 1:
            return self.max_size
        data, skip = (single_data, 0) if single_data is not None else (batched_data, 1)
        if data is None:
            raise ValueError("single_data or batched_data must be passed")
        if isinstance(data, list):
            data, skip = data[0], 0
        leaf = data if isinstance(data, torch.Tensor) else next(iter(forms.flatten(
            forms.with_batch_dim(data) if skip == 0 else data, 1)[1].values()))
        per_row = int(np.prod(leaf.shape[1 : self.ndim] if skip or not isinstance(
            data, torch.Tensor) else leaf.shape[: self.ndim - 1]))
        return -(self.max_size // -per_row)

    def _rand_given_ndim(self, batch_size: int) -> Any:
        held = self._len_along_dim0
        if held == 0:
            raise IndexError("the storage is empty: nothing to sample")
        if self.ndim == 1:
            return torch.randint(0, held, (batch_size,), generator=self._rng)
        return tuple(torch.randint(dim, (batch_size,), generator=self._rng)
                     for dim in self.shape)  # type: ignore[union-attr]

    def get(self, index: Any) -> Any:
        """Rows at ``index`` (an int, a sequence, an array, a tensor or a slice of positions;
        with ``ndim=2`` also a tuple whose first item picks rows and the rest index into them),
        copied; negative positions count from the newest held position."""
        buffer = self._live()
        if buffer is None:
            raise (ClosedError(f"the storage over {self.name!r} is closed") if self._rows.closed
                   else IndexError("the storage is empty: nothing was written yet"))
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        held = self._held_rows(buffer)
        scalar = isinstance(first, (int, np.integer)) or (
            isinstance(first, (torch.Tensor, np.ndarray)) and first.ndim == 0)
        if isinstance(first, slice):
            positions = np.arange(held)[first]
        else:
            positions = np.asarray(torch.as_tensor(first).cpu(), dtype=np.int64)
            if positions.dtype == np.bool_:
                positions = np.flatnonzero(positions)
            positions = np.where(positions < 0, positions + held, positions)
        if rest:
            unique, inverse = np.unique(positions.reshape(-1), return_inverse=True)
            rows = self._fetch(buffer, unique)
            pick = torch.as_tensor(inverse.reshape(positions.shape))
            out = forms.index_data(rows, (pick, *rest))
        else:
            out = self._fetch(buffer, positions)
        if scalar and not rest:
            out = forms.index_data(out, 0) if positions.ndim == 1 else out
        return out if self.device.type == "cpu" else forms.to_device(out, self.device)

    def _fetch(self, buffer: ReplayBuffer, positions: np.ndarray) -> Any:
        """Copies of the rows at ``positions`` (any shape), rebuilt as the data written."""
        shape, flat = positions.shape, positions.reshape(-1)
        for attempt in range(STALE_RETRIES):
            try:
                rows = buffer.get(self._logical(buffer, flat), LANE)
                break
            except StaleIndexError:  # another process overwrote some rows under the copy
                if attempt == STALE_RETRIES - 1:
                    raise
        return forms.rebuild(Form.of_spec(buffer.spec), buffer.spec, rows, shape)

    def _logical(self, buffer: ReplayBuffer, positions: np.ndarray) -> np.ndarray:
        capacity = buffer.capacity
        written = int(buffer.windows().hi[LANE]) - self._origin
        held = min(written, capacity, self._held_rows(buffer))
        if positions.size and (positions.min() < 0 or positions.max() >= held):
            bad = positions[(positions < 0) | (positions >= held)][0]
            raise IndexError(f"position {int(bad)} is not held: the storage holds {held} rows "
                             f"(positions [0, {held}))")
        return self._origin + positions + capacity * ((written - 1 - positions) // capacity)

    def contains(self, item: Any) -> Any:
        if isinstance(item, int):
            held = self._len_along_dim0
            return -held <= item < held
        positions = torch.as_tensor(item)
        return (positions >= 0) & (positions < self._len_along_dim0)

    # -- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        buffer = self._live()
        if buffer is None:
            return {"buffer": None, "origin": 0}
        return {"buffer": buffer.state_dict(), "origin": self._origin}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = state_dict["buffer"]
        self.close_writer()
        buffer = self._live()
        if state is None:
            if buffer is not None:
                self._empty()
            return
        if buffer is None:
            spec = Spec.from_json(state["spec"])
            buffer, self._fits = self._rows.create(spec, int(state.get("capacity") or -(
                self.max_size // -self._per_row(spec))))
            self._sync_max_size(buffer)
        buffer.load_state_dict(state)
        self._origin = int(state_dict["origin"])
        self._bump_mutation_revision()

    def dumps(self, path: str | os.PathLike[str]) -> None:
        """Save the rows to the directory ``path`` (``buf.save``'s format, plus ``origin``)."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        buffer = self._live()
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
            buffer = self._live()
            rows = buffer.capacity if buffer is not None else None
            with ReplayBuffer.load(directory / "rows", capacity=rows) as saved:
                state = saved.state_dict()
        self.load_state_dict({"buffer": state, "origin": meta["origin"]})

    def _empty(self) -> None:
        buffer = self._live()
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
