"""``ImitationSurface``: ``ReplayBuffer``'s methods for filling a buffer from arrays the way
imitation's ``Buffer`` does (``from_data``, ``store``, ``size``, ``clear``/``reset``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from .checks import positive_int, timeout_seconds
from .spec import Spec

if TYPE_CHECKING:
    from .storage import BufferStorage
    from .writer import Writer


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


class ImitationSurface:
    """The imitation-compatible half of the ``ReplayBuffer`` façade (a mixin).

    Concurrency: ``store`` writes through one ``Writer`` of lane 0 that the buffer keeps until
    ``clear`` or ``close``; ``clear`` holds every lane's writer lease while it empties them.
    """

    _storage: BufferStorage
    _store_writer: Writer | None
    if TYPE_CHECKING:  # provided by ReplayBuffer
        @property
        def capacity(self) -> int: ...

        def _check_open(self) -> None: ...

        def close(self) -> None: ...

        def __len__(self) -> int: ...

        def writer(self, lane: int | None = None) -> Any: ...

        @classmethod
        def create(cls, *args: Any, **kwargs: Any) -> Self: ...

    @classmethod
    def from_data(cls, data: Mapping[str, Any], capacity: int | None = None,
                  truncate_ok: bool = False, **create_kwargs: Any) -> Self:
        """A new one-lane buffer holding ``data`` (field -> ``[n, ...]``), dtypes and shapes
        inferred. ``capacity`` defaults to n (full); with fewer slots than rows, only the last
        ``capacity`` rows are kept if ``truncate_ok``, else ``ValueError``.

        Raises:
            ValueError: ``data`` is empty, its arrays differ in length, or it does not fit.
        """
        arrays = {k: np.asarray(v) for k, v in data.items()}
        n = check_data(arrays)
        capacity = n if capacity is None else positive_int("capacity", capacity)
        if n > capacity and not truncate_ok:
            raise ValueError(
                f"data has {n} rows but capacity is {capacity}: pass truncate_ok=True to keep "
                f"the last {capacity}, or a larger capacity"
            )
        spec = Spec({k: (v.shape[1:], v.dtype) for k, v in arrays.items()})
        buf = cls.create(spec, capacity, lanes=1, **create_kwargs)
        try:
            buf.store(arrays, truncate_ok=truncate_ok)
        except BaseException:
            buf.close()
            raise
        return buf

    def store(self, data: Mapping[str, Any], truncate_ok: bool = False) -> None:
        """Append rows (field -> ``[n, ...]``) to lane 0 in FIFO order, as imitation's
        ``Buffer.store``. Keeps an internal writer on lane 0 until ``close()``.

        Raises:
            ValueError: ``data`` is empty, its arrays differ in length, or n > capacity without
                ``truncate_ok`` (then only the last ``capacity`` rows are stored).
        """
        self._check_open()
        n = check_data(data)
        if n > self.capacity and not truncate_ok:
            raise ValueError(
                f"{n} rows exceed the capacity {self.capacity}: pass truncate_ok=True to store "
                f"only the last {self.capacity}"
            )
        if self._store_writer is None or self._store_writer.closed:
            self._store_writer = self.writer(lane=0)
        self._store_writer.extend(data)

    def size(self) -> int:
        """Rows readable now (imitation's ``Buffer.size()``); same as ``len(buf)``."""
        return len(self)

    def clear(self, timeout: float = 5.0) -> None:
        """Empty every lane, and drop the records of the episodes those rows held. Logical
        indices and episode ids keep growing (old ones are never reused), so indices,
        priorities and episode ids taken before are simply stale afterwards.

        Works while writers (of any handle or process) are open: their lanes are emptied up to
        the ``committed`` read during the call (their floor); rows they publish from then on,
        an add that overlaps the call included, count as written after it. Once it returns,
        ``len()``, ``sample()`` and checkpoints see none of the older rows, nor episodes that
        began before it. A pool's batches gathered before it returned may still hold them.

        Raises:
            LaneBusyError: another ``clear()`` or a restore kept going for ``timeout`` s.
        """
        self._check_open()
        timeout = timeout_seconds("timeout", timeout)
        if self._store_writer is not None:
            self._store_writer.close()
            self._store_writer = None
        self._storage.clear(timeout)

    reset = clear
