"""The shared vocabulary of sampling strategies: windows in, draws out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Windows:
    """Readable logical indices of each lane: lane k holds ``[lo[k], hi[k])``.

    ``hi`` is the lane's ``committed``; ``lo`` excludes rows overwritten or being written.
    """

    lo: np.ndarray  # int64 [lanes]
    hi: np.ndarray  # int64 [lanes]

    @property
    def sizes(self) -> np.ndarray:
        return self.hi - self.lo

    @property
    def total(self) -> int:
        return int(self.sizes.sum())


@dataclass(frozen=True)
class Draw:
    """What to read: ``lanes[b]`` and logical ``indices[b]`` for each batch position b."""

    lanes: np.ndarray  # int64 [B]
    indices: np.ndarray  # int64 [B]
    probs: np.ndarray | None = None  # float64 [B]: probability each row was drawn with
    pmin: float = 0.0  # smallest probability of any row at draw time (importance weights)


# A draw strategy: (windows, batch size, rng) -> Draw (``draw_uniform``, ``PriorityTable.draw``).
Sampler = Callable[[Windows, int, np.random.Generator], Draw]


def lane_of(windows: Windows, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Map positions ``u`` in [0, total) of the lanes' concatenated windows to (lane, index)."""
    sizes = windows.sizes
    if sizes.shape[0] == 1:
        return np.zeros(u.shape, np.int64), windows.lo[0] + u
    ends = np.cumsum(sizes)
    lanes = np.searchsorted(ends, u, side="right")
    indices = u - (ends[lanes] - sizes[lanes]) + windows.lo[lanes]
    return lanes, indices


def every_index(windows: Windows) -> Draw:
    """Every (lane, index) the windows hold, once: lanes in order, indices ascending."""
    sizes = windows.sizes
    lanes = np.repeat(np.arange(sizes.size, dtype=np.int64), sizes)
    first = np.repeat(windows.lo - (np.cumsum(sizes) - sizes), sizes)  # index minus position
    return Draw(lanes, first + np.arange(lanes.size, dtype=np.int64))
