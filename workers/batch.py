"""``Batch``: the learner's zero-copy view of one staging slot."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from shmbuf.errors import ClosedError


class BatchFields:
    """A ``Batch``'s fields and ``_invalidate``: ``workers._take_c.BatchCore`` where it was built
    (the compiled ``next()`` makes and lets go of batches with no Python frame), else these."""

    __slots__ = ("_data", "_indices", "_lanes", "_weights", "_release_fn", "_to_fn", "_released",
                 "slot", "generation", "epoch", "ends_epoch")
    _data: dict[str, Any]

    def _invalidate(self) -> None:
        # Drop the views too, so a released batch does not keep the staging ring mapped.
        self._released = True
        self._release_fn = self._to_fn = None
        self._data = {}
        self._indices = self._lanes = self._weights = None


try:
    from ._take_c import BatchCore as _Fields
except ImportError:  # the extension is optional
    _Fields = BatchFields  # type: ignore[misc,assignment]


class Batch(_Fields, Mapping[str, Any]):
    """A read-only mapping of field -> array view into one staging slot.

    Valid until the next batch is taken from the pool or ``release()`` is called; after that the
    slot is refilled, so using the batch through its methods raises ``ClosedError``. Arrays taken
    out of it earlier keep viewing the slot: ``copy()`` what must outlive the batch.

    From a pool with ``device=``, fields and ``weights`` are device tensors (in buffers the pool
    recycles once the learner's stream has passed the release), and ``indices``/``lanes`` are
    host tensors.

    Attributes:
        indices: logical index of each row in its lane (``int64[B]``, or ``[B, T]`` sequences).
        lanes: lane of each row (``int64[B]``).
        weights: importance weights (``float32[B]``), all ones for uniform sampling.
        slot: the staging slot (or, with ``device=``, the device buffer) it occupies.
        epoch: ``selection=Epoch()``: the epoch (from 0) its rows belong to (its first rows',
            if the remainder of an epoch was carried into it); else None.
        ends_epoch: ``selection=Epoch()``: the last batch of its epoch (``SamplerPool.epoch``
            stops after it).
    """

    __slots__ = ()

    def __init__(self, data: dict[str, Any], indices: Any, lanes: Any, weights: Any,
                 release_fn: Any, slot: int = -1, generation: int = 0, to_fn: Any = None,
                 info: list[int] | None = None) -> None:
        """``info``: the slot's ``staging.INFO`` words (rows filled, epoch + 1, ends epoch) of a
        learner-chosen batch; a batch of fewer rows than the slot's views its first rows."""
        self.epoch: int | None = None
        self.ends_epoch = False
        if info is not None:
            rows, epoch, ends = info
            if epoch:
                self.epoch, self.ends_epoch = epoch - 1, bool(ends)
            if rows:  # a short batch (an epoch's last): views of the rows filled
                data = {k: v[:rows] for k, v in data.items()}
                indices, lanes, weights = indices[:rows], lanes[:rows], weights[:rows]
        self._data = data
        self._indices = indices
        self._lanes = lanes
        self._weights = weights
        self._release_fn = release_fn
        self._to_fn = to_fn
        self._released = False
        self.slot = slot
        self.generation = generation

    def _renewed(self, generation: int, release_fn: Any = None, info: list[int] | None = None
                 ) -> Batch:
        """A new batch of this one's views, slot and ``to``, with ``generation`` (and
        ``release_fn``, ``info`` when given): how a delivery makes a slot's batch from the
        template it made once (``_take_c`` does the same in C)."""
        return Batch(self._data, self._indices, self._lanes, self._weights,
                     release_fn or self._release_fn, self.slot, generation, self._to_fn, info)

    def _check(self) -> None:
        if self._released:
            raise ClosedError(
                "this Batch was released (a newer batch was taken, or release() was called); "
                "its slot is being refilled. Use batch.copy() to keep data across batches"
            )

    def __getitem__(self, key: str) -> Any:
        self._check()
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        self._check()
        return iter(self._data)

    def __len__(self) -> int:
        self._check()
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        self._check()
        return key in self._data

    @property
    def indices(self) -> Any:
        self._check()
        return self._indices

    @property
    def lanes(self) -> Any:
        self._check()
        return self._lanes

    @property
    def weights(self) -> Any:
        self._check()
        return self._weights

    @property
    def released(self) -> bool:
        return self._released

    @property
    def batch_size(self) -> int:
        self._check()
        return int(self._indices.shape[0])

    def copy(self) -> dict[str, Any]:
        """Owned copies of every field plus ``indices``, ``lanes`` and ``weights``."""
        self._check()
        out = {k: _copy(v) for k, v in self._data.items()}
        out["indices"] = _copy(self._indices)
        out["lanes"] = _copy(self._lanes)
        out["weights"] = _copy(self._weights)
        return out

    def to(self, device: Any) -> dict[str, Any]:
        """Copies on ``device`` (e.g. "cuda") that the caller owns: every field and ``weights``
        on the device, ``indices`` and ``lanes`` on the host (for ``update_priorities``).

        The copies are asynchronous from a page-locked ring and ordered on the current CUDA
        stream, so kernels queued after this call see the data without a synchronize. The pool
        records an event after them and refills the slot only once it has passed: releasing
        the batch (or taking the next one) right away is safe. Needs ``output="torch"``.

        Raises:
            ClosedError: the batch was released.
            TypeError: the pool delivers NumPy arrays (``output="numpy"``).
        """
        self._check()
        if self._to_fn is None:
            raise TypeError(
                "Batch.to(device) needs a pool with output='torch' (host batches); with "
                "device= the batch is on its device already"
            )
        return self._to_fn(self, device)

    def release(self) -> None:
        """Hand the slot back to the pool now (idempotent)."""
        if not self._released:
            fn = self._release_fn
            self._invalidate()
            if fn is not None:
                fn(self)

    def __repr__(self) -> str:
        if self._released:
            return "<Batch released>"
        shapes = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self._data.items())
        return f"<Batch slot={self.slot} {shapes}>"


def _copy(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.copy()
    if hasattr(v, "block_until_ready"):  # jax.Array (whose clone() aliases the buffer)
        return v.copy()
    clone = getattr(v, "clone", None)  # torch.Tensor
    return clone() if clone is not None else np.array(v)
