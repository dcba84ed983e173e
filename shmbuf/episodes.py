"""The episode table: per lane, a ring of records of finished episodes, readable by episode id.

Record e of lane k lives at ``k*E + e % E`` (E = ``episode_capacity``): its stamp, the logical
index of its first step, its length in transitions, its flags (``EPISODE_TRUNCATED``) and the
values of the buffer's episode spec (return, seed, ...).

Concurrency: only lane k's writer stores lane k's records, stamp-first as rows are (2e+1 while
written, 2e+2 once held), and ``clear()``, which holds every lane's writer lease, zeroes their
stamps; readers check the stamp before and after copying, so a record being rewritten,
overwritten by a later episode or cleared is never returned.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import layout as L
from . import slots
from .errors import SpecMismatchError, StaleIndexError
from .rowcheck import RowChecker
from .spec import Spec

MAX_EPISODE = (1 << 62) - 2  # the largest id whose stamp 2e+2 fits the int64 stamp word


class EpisodeTable:
    """Views of a buffer's episode columns plus the checks for episode data."""

    def __init__(self, columns: Mapping[str, np.ndarray], capacity: int, lanes: int,
                 spec: Spec | None, cleared_below: np.ndarray | None = None) -> None:
        self.capacity = capacity  # records per lane
        self.lanes = lanes
        self.stamp = columns["_ep_stamp"]
        self.start = columns["_ep_start"]
        self.length = columns["_ep_length"]
        self.flags = columns["_ep_flags"]
        self.spec = spec
        self.cleared_below = np.zeros(lanes, np.int64) if cleared_below is None else cleared_below
        self.data = {name: columns[name] for name in (spec or {})}
        self._checker = RowChecker(spec, row_op="end_episode") if spec else None
        self._zeros = {name: np.zeros(f.shape, f.dtype) for name, f in (spec or {}).items()}

    # -- writing (the lane's writer only) -----------------------------------------------------------
    def check(self, values: Mapping[str, Any]) -> list[Any]:
        """Validate episode data before anything is stored; missing fields are zero."""
        if not values:
            return list(self._zeros.values())
        if self._checker is None:
            raise SpecMismatchError(
                f"end_episode() got episode data {sorted(values)} but the buffer has no episode "
                f"spec. Fix: create it with episode_spec=Spec(...) naming those fields"
            )
        full = dict(self._zeros)
        full.update(values)
        if len(full) != len(self._zeros):
            extra = sorted(set(values) - set(self._zeros))
            raise SpecMismatchError(
                f"end_episode(): unknown episode field(s) {extra}; the episode spec has "
                f"{', '.join(self._zeros)}"
            )
        return self._checker.check_row(full)

    def write(self, lane: int, episode: int, start: int, length: int, truncated: bool,
              values: list[Any]) -> None:
        r = lane * self.capacity + episode % self.capacity
        slots.mark_writing(self.stamp, r, episode)
        self.start[r] = start
        self.length[r] = length
        self.flags[r] = L.EPISODE_TRUNCATED if truncated else 0
        for col, v in zip(self.data.values(), values):
            col[r] = v
        slots.mark_held(self.stamp, r, episode)

    def clear(self, lane: int) -> None:
        """Drop every record of ``lane`` (its rows were emptied). The caller holds the lane's
        writer lease; ids go on from the lane's episode counter, so later records are found."""
        E = self.capacity
        slots.clear_stamps(self.stamp, slice(lane * E, (lane + 1) * E))

    # -- reading (anyone) -------------------------------------------------------------------------------
    def read(self, episodes: np.ndarray, lanes: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Records of ``episodes`` (ids) of ``lanes``; (arrays, which were held whole)."""
        r = lanes * self.capacity + episodes % self.capacity
        expected = slots.held_stamps(episodes)  # ids <= MAX_EPISODE: no wrap; never 0 (unwritten)
        before = slots.load_stamps(self.stamp, r)
        out = {
            "episode": episodes.copy(),
            "lane": lanes.copy(),
            "start": self.start[r],
            "length": self.length[r],
            "truncated": (self.flags[r] & L.EPISODE_TRUNCATED) != 0,
        }
        for name, col in self.data.items():
            out[name] = col[r]
        after = slots.reload_stamps(self.stamp, r)
        return out, slots.held_whole(before, after, expected) & self.above_floor(out["start"], lanes)

    def above_floor(self, start: np.ndarray, lanes: np.ndarray) -> np.ndarray:
        """Which records (first steps ``start`` of ``lanes``) began at or above their lane's
        floor: one that began below was cleared (``clear()`` with a live writer)."""
        return start >= self.cleared_below[lanes]

    def get(self, episode: Any, lane: int) -> dict[str, Any]:
        """The record of ``episode`` of ``lane``.

        Raises:
            TypeError: an id that is not an integer. ValueError: a negative id (ids count
                from 0 per lane). StaleIndexError: not finished yet, or no longer held.
        """
        try:
            episode = operator.index(episode)
        except TypeError:
            raise TypeError(
                f"episode id must be an int, got {type(episode).__name__} {episode!r}"
            ) from None
        if episode < 0:
            raise ValueError(
                f"episode id {episode} is negative: ids count from 0 in each lane (the values "
                f"end_episode() returns). Fix: pass one of those, or see episodes()"
            )
        if episode > MAX_EPISODE:
            raise StaleIndexError(
                f"no record of episode {episode} of lane {lane}: not finished yet (ids stay "
                f"below {MAX_EPISODE + 1})"
            )
        ep = np.array([episode], np.int64)
        rec, ok = self.read(ep, np.array([lane], np.int64))
        if not ok[0]:
            raise StaleIndexError(
                f"no record of episode {episode} of lane {lane}: not finished yet, or older "
                f"than the last {self.capacity} episodes of the lane (episode_capacity)"
            )
        return {k: (v[0].item() if v[0].ndim == 0 else v[0]) for k, v in rec.items()}

    def held(self, lane: int | None = None) -> dict[str, np.ndarray]:
        """Every record held now (of one lane or all), ordered by lane then episode."""
        stamps = self.stamp.reshape(self.lanes, self.capacity)
        lanes_sel = range(self.lanes) if lane is None else [lane]
        eps, lns = [], []
        for k in lanes_sel:
            good, ids = slots.held_records(stamps[k])
            eps.append(ids[good])
            lns.append(np.full(int(good.sum()), k, np.int64))
        episodes = np.concatenate(eps) if eps else np.zeros(0, np.int64)
        lanes = np.concatenate(lns) if lns else np.zeros(0, np.int64)
        rec, ok = self.read(episodes, lanes)
        order = np.lexsort((rec["episode"][ok], rec["lane"][ok]))
        return {k: v[ok][order] for k, v in rec.items()}
