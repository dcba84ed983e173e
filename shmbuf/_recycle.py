"""Reusable memory for ``ReplayBuffer.sample()``'s large output arrays.

Fresh multi-megabyte arrays page-fault on every call (atari batch 256: about 3x slower), so
``sample()`` lends the memory of arrays the caller has dropped to later batches. Whether an array
is dropped is decided by a weakref on it, never by reference counts (which differ between
interpreter versions: Python 3.14 borrows references on the stack).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np


class Recycler:
    """Output memory for one (field, batch shape, dtype) of ``sample()``'s results.

    Each array handed out is a new ndarray over a private ``bytearray``. The array is the owner
    every view of it refers to: NumPy collapses a view's ``.base`` only through ndarrays, and
    this one's base is the bytearray, so slices, reshapes and transposes keep the array itself
    alive, as do memoryviews, ``torch.from_numpy`` tensors and DLPack capsules. A weakref
    callback puts the bytearray back on the free list only when the array object is freed,
    i.e. when nothing can reach its memory any more (short of holding its ``.base``, the
    bytearray, directly). At most ``keep`` bytearrays are made; past that, plain new arrays.

    Concurrency: per process; ``list.pop`` / ``append`` make it safe for threads under the GIL.
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, keep: int) -> None:
        self.shape, self.dtype, self.keep = shape, dtype, keep
        self.nbytes = math.prod(shape) * dtype.itemsize
        self._free: list[bytearray] = []
        self._lent: dict[int, tuple[weakref.ref[np.ndarray], bytearray]] = {}
        self._pins: list[memoryview] = []  # an export per bytearray: it can never be resized

    def take(self) -> np.ndarray:
        """An array no one else references (its contents are whatever was there)."""
        try:
            memory = self._free.pop()
        except IndexError:
            if len(self._pins) >= self.keep:
                return np.empty(self.shape, self.dtype)
            memory = bytearray(self.nbytes)
            self._pins.append(memoryview(memory))
        # np.ndarray over a buffer, not np.frombuffer(...).reshape(...): the reshaped view's
        # base would be the frombuffer array, and views of it would skip ours. Safe here (unlike
        # over the segment's mmap): the bytearray is private, pinned, and never closed.
        arr = np.ndarray(self.shape, self.dtype, buffer=memory)
        ref = weakref.ref(arr, self._returned)
        self._lent[id(ref)] = (ref, memory)
        return arr

    def _returned(self, ref: weakref.ref[Any]) -> None:
        """The array lent with ``ref`` was freed: its memory is free again."""
        entry = self._lent.pop(id(ref), None)
        if entry is not None:
            self._free.append(entry[1])
