"""Byte layout of a weight store (``shmbuf.weights``): frozen constants and pure offset math.

A weight store's segment (kind ``layout.KIND_WEIGHTS``) after the common header page(s) of
``layout``, every region starting on a 64-byte line:

- the control line, 8 u64 words: word ``CURRENT`` (0) is the newest complete version, 0 until
  the first publish; ``PUBLISHER_PID`` (1) the pid of the process that holds (or last held) the
  publisher lease; ``PUBLISHED_NS`` (2) ``time.time_ns()`` of the last publish; 3-7 are zero.
- ``COPIES`` stamp lines: word 0 of line c is copy c's stamp, as a slot's stamp
  (``layout.stamp_writing``/``stamp_held``): 0 never written, 2v+1 while version v is being
  written into copy c, 2v+2 once copy c holds version v whole. The other words are zero.
- ``COPIES`` copies of the tensors, ``copy_bytes`` apart: in each, the tensors of the layout
  JSON's ``"tensors"`` list, in its order, each C-contiguous and starting on a line. Version v
  lives in copy ``v % COPIES``, so the copy being written is never the one ``CURRENT`` names.
- zeros up to a multiple of 4096 bytes.

The layout JSON is ``{"kind": "weights", "copies": COPIES, "tensors": [{"name", "shape",
"dtype"}, ...]}``, dtypes as little-endian ``np.dtype.str``; ``layout.check_layout_doc`` bounds
its sizes in exact integers, ``tensors_of`` and ``WeightStore`` check the rest at attach.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import layout as L
from .errors import SegmentFormatError
from .shmdir import SHM_DIR

COPIES = L.WEIGHT_COPIES
CONTROL_LINES = 1
CURRENT = 0  # control word: the newest complete version (0: none yet)
PUBLISHER_PID = 1  # control word: pid of the publisher lease's holder (0: never published)
PUBLISHED_NS = 2  # control word: time.time_ns() of the last publish
NUMERIC_KINDS = "biufc"  # dtype kinds a store holds: bool, int, uint, float, complex

Tensors = Sequence[tuple[str, tuple[int, ...], np.dtype]]


@dataclass(frozen=True)
class WeightsLayout:
    """Where everything of a weight store lives (see the module docstring)."""

    control: int  # byte offset of the control line
    stamps: int  # byte offset of copy 0's stamp line (copy c's is ``LINE * c`` further)
    data: int  # byte offset of copy 0
    copy_bytes: int  # bytes from one copy to the next (a multiple of ``LINE``)
    tensors: tuple[L.Column, ...]  # each at its byte offset in copy 0
    total_size: int

    def control_word(self, word: int) -> int:
        """Index of control word ``word`` among the segment's u64 words."""
        return self.control // L.WORD + word

    def stamp_word(self, copy: int) -> int:
        """Index of copy ``copy``'s stamp among the segment's u64 words."""
        return (self.stamps + copy * L.LINE) // L.WORD

    def offset(self, copy: int, tensor: L.Column) -> int:
        """Byte offset of ``tensor`` in copy ``copy``."""
        return tensor.offset + copy * self.copy_bytes


def weights_layout(tensors: Tensors, json_len: int) -> WeightsLayout:
    """The layout of a weight store holding ``tensors`` (name, shape, dtype), for a layout JSON
    of ``json_len`` bytes."""
    control = L.header_size(json_len)
    stamps = control + CONTROL_LINES * L.LINE
    data = stamps + COPIES * L.LINE
    offset, columns = data, []
    for name, shape, dtype in tensors:
        column = L.Column(name, offset, tuple(shape), np.dtype(dtype))
        columns.append(column)
        offset = L.align(offset + column.nbytes)
    copy_bytes = offset - data
    return WeightsLayout(control, stamps, data, copy_bytes, tuple(columns),
                         L.align(data + COPIES * copy_bytes, L.PAGE))


def weights_doc(tensors: Tensors) -> dict[str, Any]:
    """The layout document of a store of ``tensors``, as its header reads it back."""
    return {"kind": "weights", "copies": COPIES,
            "tensors": [{"name": n, "shape": [int(d) for d in s], "dtype": np.dtype(t).str}
                        for n, s, t in tensors]}


def tensors_of(name: str, doc: dict[str, Any]) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """The tensors the layout document of weight store ``name`` lists (a document that passed
    ``layout.check_layout_doc``).

    Raises:
        SegmentFormatError: no tensors, a name twice, or a dtype that is not plain numbers.
    """
    out: list[tuple[str, tuple[int, ...], np.dtype]] = []
    for entry in doc["tensors"]:
        try:
            dtype = np.dtype(entry["dtype"])
        except (TypeError, ValueError, OverflowError):
            dtype = np.dtype(object)
        if dtype.kind not in NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype:
            raise tampered(name, f"tensor {entry['name'][:60]!r} has dtype "
                                 f"{str(entry['dtype'])[:40]!r}, not a plain numeric one")
        out.append((entry["name"], tuple(entry["shape"]), dtype))
    names = [n for n, _, _ in out]
    if not names or len(set(names)) != len(names):
        raise tampered(name, "its tensor list is empty or names a tensor twice")
    return out


def tampered(name: str, why: str) -> SegmentFormatError:
    """The error for a weight store whose layout does not hold together."""
    return SegmentFormatError(
        f"weight store {name!r} is not a valid weight store: {why}: truncated or tampered. If it "
        f"is a leftover, remove it by hand (rm {os.path.join(SHM_DIR, name)})")
