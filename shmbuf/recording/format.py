"""The episode file format, and the structure of (possibly nested) gymnasium spaces in it.

Episode files. One ``.npz`` per finished episode, ``episode-000000.npz``, ``episode-000001.npz``,
... numbered in the order they were written (a new recorder continues after the highest number
present). Each is written to a hidden temp file, fsynced, then published under its final name
with a hard link, which fails if the name is taken: a reader never sees a half-written file and
recorders sharing a directory never overwrite each other. For an episode of N steps it holds:

- ``observations`` ``[K, ...]``: K = N + 1, the reset observation first, unless a frame_filter
  kept fewer. Dict / Tuple observation spaces store one array per leaf: ``observations/<key>``,
  ``observations/<key>/<subkey>``, ``observations/<i>`` for Tuple items;
- ``observation_steps`` int64 ``[K]``: the step of each kept observation (0 = reset); present
  whenever a frame_filter was given;
- ``actions`` ``[N, ...]`` (Dict / Tuple action spaces as ``actions/<key>``) as passed to
  ``step``; ``rewards`` float64 ``[N]``;
- 0-d arrays: ``terminated`` and ``truncated`` (how the episode ended), ``complete`` (False when
  the env never reported the end: ``reset()`` mid-episode or ``close()`` cut it short; then
  truncated is True), ``length`` (N) and ``episode_index`` (the recorder's count of episodes,
  filtered-out ones included);
- ``_header``: a 0-d unicode array holding JSON: ``format``, ``version``, and the tree of the
  ``observations`` / ``actions`` (null: one array, object: Dict, list: Tuple) when stored.

``drop=`` leaves ``observations``, ``actions`` and/or ``rewards`` out. Everything loads with
``np.load(path, allow_pickle=False)``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

FORMAT = "shmbuf-episode"
VERSION = 1
FILE_PATTERN = re.compile(r"^episode-(\d{6,})\.npz$")
DROPPABLE = ("observations", "actions", "rewards")

KeyPath = tuple[Any, ...]  # Dict keys / Tuple indices from an observation (or action) to one array


# --------------------------------------------------------------------------------------------
# Space structure: leaves, names and the tree stored in each file's header
# --------------------------------------------------------------------------------------------
def _leaf_paths(space: Any, path: KeyPath = ()) -> list[KeyPath]:
    """Paths to every array of a value of ``space``: Dict keys and Tuple indices, depth first,
    in the order ``Spec.from_spaces`` names its fields."""
    from gymnasium import spaces

    if isinstance(space, spaces.Dict):
        return [p for key, sub in space.spaces.items() for p in _leaf_paths(sub, (*path, key))]
    if isinstance(space, spaces.Tuple):
        return [p for i, sub in enumerate(space.spaces) for p in _leaf_paths(sub, (*path, i))]
    return [path]


def _tree(space: Any) -> Any:
    """JSON shape of ``space``: null for an array, an object for Dict, a list for Tuple."""
    from gymnasium import spaces

    if isinstance(space, spaces.Dict):
        return {str(key): _tree(sub) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return [_tree(sub) for sub in space.spaces]
    return None


def _name(prefix: str, path: KeyPath) -> str:
    return prefix + "".join(f"/{p}" for p in path)


def _leaf(value: Any, path: KeyPath) -> Any:
    for p in path:
        value = value[p]
    return value


def _rebuild(tree: Any, prefix: str, arrays: dict[str, np.ndarray]) -> Any:
    if tree is None:
        return arrays[prefix]
    if isinstance(tree, list):
        return tuple(_rebuild(sub, f"{prefix}/{i}", arrays) for i, sub in enumerate(tree))
    return {key: _rebuild(sub, f"{prefix}/{key}", arrays) for key, sub in tree.items()}
