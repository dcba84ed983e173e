"""``CheckpointSurface``: ``ReplayBuffer``'s checkpoint methods (``save``/``load`` a directory,
``state_dict``/``load_state_dict`` in memory), documented here and done by ``persist.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from .storage import BufferStorage


class CheckpointSurface:
    """The checkpoint half of the ``ReplayBuffer`` façade (a mixin over its storage).

    Concurrency: ``save`` and ``state_dict`` read with seqlock checks while writers run;
    ``load_state_dict`` holds every lane's writer lease while it rewrites the buffer.
    """

    _storage: BufferStorage
    if TYPE_CHECKING:  # provided by ReplayBuffer
        def _check_open(self) -> None: ...

        @classmethod
        def create(cls, *args: Any, **kwargs: Any) -> Self: ...

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False,
             progress: bool | None = None) -> None:
        """Write the buffer to a directory: ``manifest.json`` plus one ``.npy`` per field.

        Rows are stored per lane, oldest first; each ``.npy`` opens with plain
        ``numpy.load(path, mmap_mode="r")``. Safe while writers run: it saves the rows that
        were still intact at the end of the copy. Shows progress on large buffers.
        """
        from .persist import save

        self._check_open()
        save(self._storage, path, overwrite=overwrite, progress=progress)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        name: str | None = None,
        capacity: int | None = None,
        progress: bool | None = None,
    ) -> Self:
        """Create a new buffer (this process owns it) from a directory written by ``save``.

        Logical indices and episode counters are preserved. ``capacity`` may differ from the
        saved one; a smaller one keeps each lane's newest rows.

        Raises:
            CheckpointError: the directory is incomplete, truncated or inconsistent.
        """
        from .persist import load

        buf: Self = load(cls.create, path, name=name, capacity=capacity, progress=progress)
        return buf

    def state_dict(self) -> dict[str, Any]:
        """The buffer's contents as plain Python/NumPy objects, for training checkpoints."""
        from .persist import state_dict

        self._check_open()
        return state_dict(self._storage)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this buffer's contents with ``state``; needs every lane free of writers.

        Raises:
            SpecMismatchError: the state's spec or lanes differ from this buffer's.
            LaneBusyError: a lane has a live writer.
        """
        from .persist import load_state_dict

        self._check_open()
        load_state_dict(self._storage, state)
