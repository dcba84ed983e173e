"""The checks ``ReplayBuffer.from_data`` and ``store`` run on data given the way imitation's
``Buffer`` takes it (field -> ``[n, ...]`` arrays), before anything is created or written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .checks import positive_int
from .spec import Spec


def check_data(data: Mapping[str, Any]) -> int:
    """Rows in ``data`` (imitation's checks): ValueError if empty or of unequal lengths."""
    if not data:
        raise ValueError("data is empty: pass a mapping of field name -> array")
    lengths = {k: len(v) for k, v in data.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"data arrays differ in the length of their first axis: {lengths}")
    n = next(iter(lengths.values()))
    if n == 0:
        raise ValueError("data is empty: every array has 0 rows")
    return n


def checked_data(data: Mapping[str, Any], capacity: int | None, truncate_ok: bool
                 ) -> tuple[dict[str, np.ndarray], Spec, int]:
    """``from_data``'s arrays, the spec they imply and the capacity (n rows by default), or
    ValueError: ``data`` is empty, its arrays differ in length, or n rows exceed ``capacity``
    without ``truncate_ok``."""
    arrays = {k: np.asarray(v) for k, v in data.items()}
    n = check_data(arrays)
    capacity = n if capacity is None else positive_int("capacity", capacity)
    if n > capacity and not truncate_ok:
        raise ValueError(
            f"data has {n} rows but capacity is {capacity}: pass truncate_ok=True to keep "
            f"the last {capacity}, or a larger capacity"
        )
    return arrays, Spec({k: (v.shape[1:], v.dtype) for k, v in arrays.items()}), capacity


def check_fits(data: Mapping[str, Any], capacity: int, truncate_ok: bool) -> int:
    """Rows in ``data`` for ``store``, or ValueError: empty, unequal lengths, or more rows than
    ``capacity`` without ``truncate_ok``."""
    n = check_data(data)
    if n > capacity and not truncate_ok:
        raise ValueError(
            f"{n} rows exceed the capacity {capacity}: pass truncate_ok=True to store "
            f"only the last {capacity}"
        )
    return n
