"""Selection strategies for ``SamplerPool(selection=...)``: which rows each batch holds.

``Uniform()``, ``Prioritized(alpha, beta, eps, eta)``, ``Counted(k, of)``, ``Queue()`` and
``Epoch(drop_last, carry_remainder)``, one module each behind ``base`` (``SelectionSpec`` for
what the user passes, ``Selection`` for what it opens in the learner). The names ``"uniform"``,
``"prioritized"``, ``"queue"`` and ``"epoch"`` are shorthands for their defaults.
"""

from __future__ import annotations

from typing import Any

from .base import Rows, Selection, SelectionSpec
from .counted import Counted, CountedSelection
from .epoch import Epoch, EpochSelection
from .prioritized import Prioritized, PrioritizedSelection
from .queue import Queue, QueueSelection
from .uniform import Uniform, UniformSelection

SHORTHANDS: dict[str, type[SelectionSpec]] = {
    "uniform": Uniform, "prioritized": Prioritized, "queue": Queue, "epoch": Epoch}


def selection_spec(value: Any) -> SelectionSpec:
    """``value`` as a strategy: a ``SelectionSpec`` as it is, a shorthand name built with its
    defaults, None as ``Uniform()``; anything else is a ``TypeError`` naming the choices."""
    if value is None:
        return Uniform()
    if isinstance(value, SelectionSpec):
        return value
    if isinstance(value, str) and value in SHORTHANDS:
        return SHORTHANDS[value]()
    raise TypeError(
        f"selection={value!r} is not a selection strategy: pass Uniform(), Prioritized(...), "
        f"Counted(k), Queue() or Epoch(...) (from workers.selection), or one of the names "
        f"{sorted(SHORTHANDS)}")


__all__ = [
    "Counted", "CountedSelection", "Epoch", "EpochSelection", "Prioritized",
    "PrioritizedSelection", "Queue", "QueueSelection", "Rows", "SHORTHANDS", "Selection",
    "SelectionSpec", "Uniform", "UniformSelection", "selection_spec",
]
