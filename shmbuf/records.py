"""``EpisodeSurface``: ``ReplayBuffer``'s methods for the records of finished episodes
(``episode_spec``, ``episode(id, lane)``, ``episodes()``), read from ``episodes.EpisodeTable``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .spec import Spec
    from .storage import BufferStorage


class EpisodeSurface:
    """The episode-record part of the ``ReplayBuffer`` façade (a mixin over its storage).

    Concurrency: loads only; a record is copied between two loads of its stamp, so one being
    written, overwritten or cleared is never returned (``EpisodeTable``).
    """

    _storage: BufferStorage
    if TYPE_CHECKING:  # provided by ReplayBuffer
        def _check_open(self) -> None: ...

    @property
    def episode_spec(self) -> Spec | None:
        return self._storage.episode_spec

    def episode(self, episode_id: int, lane: int = 0) -> dict[str, Any]:
        """The record of a finished episode of ``lane``: ``start`` (logical index of its first
        step), ``length``, ``truncated`` and the episode-spec fields.

        Raises:
            StaleIndexError: not finished yet, older than the lane's ``episode_capacity``, or
                emptied by ``clear()``.
            ValueError: a negative id. TypeError: an id that is not an integer.
        """
        self._check_open()
        return self._storage.episode_table().get(episode_id, self._storage.lane_index(lane))

    def episodes(self, lane: int | None = None) -> dict[str, np.ndarray]:
        """Every episode record held now (one lane, or all), as arrays ordered by lane, id."""
        self._check_open()
        lane = None if lane is None else self._storage.lane_index(lane)
        return self._storage.episode_table().held(lane)
