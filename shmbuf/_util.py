"""Small shared helpers: argument checks and ring-segment math."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _ring_segments(first: int, n: int, C: int) -> list[tuple[int, int, int]]:
    """Contiguous slot ranges [a, b) for logical indices [first, first+n), n <= C, with the
    offset of each range's first row within the n."""
    s0 = first % C
    if s0 + n <= C:
        return [(s0, s0 + n, 0)]
    head = C - s0
    return [(s0, C, 0), (0, n - head, head)]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _timeout(name: str, value: Any, positive: bool = False) -> float:
    """Seconds: a number >= 0 (> 0 if ``positive``), else ValueError naming ``name``."""
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if math.isnan(t) or t < 0 or (positive and t == 0):
        raise ValueError(f"{name} must be {'>' if positive else '>='} 0 seconds, got {value!r}")
    return t
