"""``Batch``: the learner's zero-copy view of one staging slot."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from shmbuf.errors import ClosedError


class Batch(Mapping[str, Any]):
    """A read-only mapping of field -> array view into one staging slot.

    Valid until the next batch is taken from the pool or ``release()`` is called; after that the
    slot is refilled, so using the batch through its methods raises ``ClosedError``. Arrays taken
    out of it earlier keep viewing the slot: ``copy()`` what must outlive the batch.

    Attributes:
        indices: logical index of each row in its lane (``int64[B]``, or ``[B, T]`` sequences).
        lanes: lane of each row (``int64[B]``).
        weights: importance weights (``float32[B]``), all ones for uniform sampling.
    """

    __slots__ = ("_data", "_indices", "_lanes", "_weights", "_release_fn", "_released", "slot",
                 "generation")

    def __init__(self, data: dict[str, Any], indices: Any, lanes: Any, weights: Any,
                 release_fn: Any, slot: int = -1, generation: int = 0) -> None:
        self._data = data
        self._indices = indices
        self._lanes = lanes
        self._weights = weights
        self._release_fn = release_fn
        self._released = False
        self.slot = slot
        self.generation = generation

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

    def release(self) -> None:
        """Hand the slot back to the pool now (idempotent)."""
        if not self._released:
            fn = self._release_fn
            self._invalidate()
            if fn is not None:
                fn(self)

    def _invalidate(self) -> None:
        # Drop the views too, so a released batch does not keep the staging ring mapped.
        self._released = True
        self._release_fn = None
        self._data = {}
        self._indices = self._lanes = self._weights = None

    def __repr__(self) -> str:
        if self._released:
            return "<Batch released>"
        shapes = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self._data.items())
        return f"<Batch slot={self.slot} {shapes}>"


def _copy(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.copy()
    clone = getattr(v, "clone", None)  # torch.Tensor
    return clone() if clone is not None else np.array(v)
