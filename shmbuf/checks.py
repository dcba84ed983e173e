"""Argument checks and ring-segment math, shared by ``shmbuf`` and ``workers`` (public on
purpose: the workers validate their timeouts and sizes with the same words)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


def ring_segments(first: int, n: int, C: int) -> list[tuple[int, int, int]]:
    """Contiguous slot ranges [a, b) for logical indices [first, first+n), n <= C, with the
    offset of each range's first row within the n."""
    s0 = first % C
    if s0 + n <= C:
        return [(s0, s0 + n, 0)]
    head = C - s0
    return [(s0, C, 0), (0, n - head, head)]


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def timeout_seconds(name: str, value: Any, positive: bool = False) -> float:
    """Seconds for a blocking call: a finite real number >= 0 (> 0 if ``positive``).

    The one check every public ``timeout=`` goes through. Refused, with a ValueError naming
    ``name`` and the value: NaN (a deadline that never arrives), infinity (nothing in shmbuf
    waits forever: pass a large number instead), negatives, and anything that is not a real
    number, strings included (``"5"``: convert user input first; the CLI does).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{name} must be a number of seconds, got {value!r} (a {type(value).__name__}). "
            f"Fix: pass an int or float, e.g. {name}=5.0"
        )
    t = float(value)
    bound = ">" if positive else ">="
    if math.isnan(t):
        raise ValueError(f"{name} must be {bound} 0 seconds, got {value!r} (not a number)")
    if math.isinf(t):
        raise ValueError(
            f"{name} must be finite, got {value!r}: nothing in shmbuf waits forever. Fix: pass "
            f"a large number of seconds instead (e.g. 86400 for a day)"
        )
    if t < 0 or (positive and t == 0):
        raise ValueError(f"{name} must be {bound} 0 seconds, got {value!r}")
    return t
