"""Argument checks and ring-segment math, shared by ``shmbuf`` and ``workers`` (public on
purpose: the workers validate their timeouts and sizes with the same words)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


def ring_segments(first: int, n: int, capacity: int) -> list[tuple[int, int, int]]:
    """Contiguous slot ranges [a, b) for logical indices [first, first+n), n <= capacity, with
    the offset of each range's first row within the n."""
    start = first % capacity
    if start + n <= capacity:
        return [(start, start + n, 0)]
    head = capacity - start
    return [(start, capacity, 0), (0, n - head, head)]


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int, refused with a ValueError naming ``name`` unless it is one >= 1."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


_SECONDS = (float, int)  # (bool is a subclass of int, not int: it takes the full check)


def timeout_seconds(name: str, value: Any, positive: bool = False) -> float:
    """Seconds for a blocking call: a finite real number >= 0 (> 0 if ``positive``).

    The one check every public ``timeout=`` goes through. Refused, with a ValueError naming
    ``name`` and the value: NaN (a deadline that never arrives), infinity (nothing in shmbuf
    waits forever: pass a large number instead), negatives, and anything that is not a real
    number, strings included (``"5"``: convert user input first; the CLI does).
    """
    if type(value) in _SECONDS and 0 < value < math.inf:  # the common case, without the ABC
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{name} must be a number of seconds, got {value!r} (a {type(value).__name__}). "
            f"Fix: pass an int or float, e.g. {name}=5.0"
        )
    seconds = float(value)
    bound = ">" if positive else ">="
    if math.isnan(seconds):
        raise ValueError(f"{name} must be {bound} 0 seconds, got {value!r} (not a number)")
    if math.isinf(seconds):
        raise ValueError(
            f"{name} must be finite, got {value!r}: nothing in shmbuf waits forever. Fix: pass "
            f"a large number of seconds instead (e.g. 86400 for a day)"
        )
    if seconds < 0 or (positive and seconds == 0):
        raise ValueError(f"{name} must be {bound} 0 seconds, got {value!r}")
    return seconds
