"""Uniform sampling: every readable transition of every lane equally likely.

A batch therefore splits across lanes in proportion to what each lane holds.
"""

from __future__ import annotations

import numpy as np

from ..errors import EmptyBufferError
from .base import Draw, Windows, lane_of


def draw_uniform(windows: Windows, batch_size: int, rng: np.random.Generator) -> Draw:
    """Draw ``batch_size`` (lane, index) pairs uniformly, with replacement."""
    total = windows.total
    if total <= 0:
        raise EmptyBufferError(
            "cannot sample: the buffer holds no transitions yet. Add some first, or let a "
            "SamplerPool wait for them with min_size"
        )
    u = rng.integers(0, total, size=batch_size, dtype=np.int64)
    lanes, indices = lane_of(windows, u)
    return Draw(lanes, indices)
