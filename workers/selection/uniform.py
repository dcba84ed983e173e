"""``Uniform()``: workers draw uniformly (or per the plan: sequences, frame stacks, n-step)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import Selection, SelectionSpec


@dataclass(frozen=True)
class Uniform(SelectionSpec):
    """Every row (or window start of the plan) the buffer holds is equally likely; each worker
    draws its own batches.

    Example:
        >>> SamplerPool(buf, 256, selection=Uniform())
    """

    def open(self, buf: Any, compiled: Any) -> Selection:
        return UniformSelection()


class UniformSelection(Selection):
    """Workers draw uniformly (or per the plan: sequences, frame stacks, n-step)."""


