"""Playing recorded directories back: ``scan_episodes``, ``iter_episodes``, ``load_episode``."""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .format import FORMAT, VERSION, _rebuild
from .sinks import _episode_files

# --------------------------------------------------------------------------------------------
# Playback
# --------------------------------------------------------------------------------------------
_READ_ERRORS = (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error)


def load_episode(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read one episode file completely, checking that its arrays agree.

    Returns the dict ``iter_episodes`` yields. Raises ``CheckpointError`` naming the file if it
    is truncated, corrupt, not an episode file or inconsistent.
    """
    path = Path(path)

    def bad(why: str) -> CheckpointError:
        return CheckpointError(
            f"episode file {str(path)!r}: {why}. Recorders publish files whole, so it was "
            f"damaged (or put there) afterwards. Fix: move it out of the directory"
        )

    try:
        with open(path, "rb") as f:
            npz = np.load(f, allow_pickle=False)
            if not isinstance(npz, np.lib.npyio.NpzFile):
                raise bad("not an .npz archive")
            with npz:
                raw = {k: npz[k] for k in npz.files}  # read all now: damage surfaces here
    except CheckpointError:
        raise
    except _READ_ERRORS as e:
        raise bad(f"cannot be read ({type(e).__name__}: {e})") from e
    try:
        header = json.loads(str(raw.pop("_header")))
    except (KeyError, ValueError):
        raise bad("no shmbuf episode header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise bad(f"not a {FORMAT} file")
    version = header.get("version")
    if not isinstance(version, int):
        raise bad(f"malformed header {header!r}")
    if version > VERSION:
        raise CheckpointError(
            f"{str(path)!r}: episode format version {version} is newer than this "
            f"shmbuf reads ({VERSION}). Fix: upgrade shmbuf"
        )
    out: dict[str, Any] = {}
    try:
        for key in ("terminated", "truncated", "complete"):
            out[key] = bool(raw.pop(key))
        for key in ("length", "episode_index"):
            out[key] = int(raw.pop(key))
        n = out["length"]
        if "observations" in header:
            out["observations"] = _rebuild(header["observations"], "observations", raw)
        if "actions" in header:
            out["actions"] = _rebuild(header["actions"], "actions", raw)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise bad(f"missing or malformed array {e}") from None
    if "rewards" in raw:
        out["rewards"] = raw["rewards"]
    if "observation_steps" in raw:
        out["observation_steps"] = raw["observation_steps"]
    steps = out.get("observation_steps", np.arange(n + 1))
    checks = [(f"actions/{k}" if k else "actions", a, n) for k, a in _flat(out.get("actions"))]
    checks += [("rewards", out["rewards"], n)] if "rewards" in out else []
    checks += [(f"observations/{k}" if k else "observations", a, len(steps))
               for k, a in _flat(out.get("observations"))]
    for name, arr, rows in checks:
        if arr.ndim == 0 or arr.shape[0] != rows:
            raise bad(f"{name} has shape {arr.shape}, expected {rows} rows for length {n}")
    if len(steps) and (steps.min() < 0 or steps.max() > n or (np.diff(steps) <= 0).any()):
        raise bad(f"observation_steps {steps} is not increasing within [0, {n}]")
    out["path"] = str(path)
    return out


def _flat(value: Any, prefix: str = "") -> list[tuple[str, np.ndarray]]:
    if value is None:
        return []
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _flat(v, f"{prefix}/{k}".lstrip("/"))]
    if isinstance(value, tuple):
        return [x for i, v in enumerate(value) for x in _flat(v, f"{prefix}/{i}".lstrip("/"))]
    return [(prefix, value)]


def iter_episodes(directory: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield each recorded episode of ``directory`` in file order, as a dict.

    Keys: ``observations`` (an array, or a dict / tuple of arrays for Dict / Tuple spaces),
    ``observation_steps`` (when a frame filter was used), ``actions``, ``rewards`` (each absent
    when dropped), ``terminated``, ``truncated``, ``complete`` (bools), ``length``,
    ``episode_index`` (ints) and ``path``. The file list is taken when iteration starts; files
    written later are not included. Files are read one at a time.

    Raises:
        CheckpointError: a file is truncated, corrupt or inconsistent (the message names it).
        FileNotFoundError: ``directory`` does not exist.
    """
    for _, path in _episode_files(Path(directory)):
        yield load_episode(path)


def scan_episodes(
    directory: str | os.PathLike[str],
    callback: Callable[[Any, Any, Any], Any],
) -> int:
    """Play recorded episodes back in order: ``callback(observations, actions, rewards)`` each.

    The signature of gym_recording's ``scan_recorded_traces`` callback: for an episode of N
    steps, observations ``[N + 1, ...]`` (a dict of arrays for Dict spaces; the kept steps only
    with a frame filter), actions ``[N, ...]``, rewards ``[N]``; None for a dropped array.

    Returns:
        the number of episodes played.

    Raises:
        CheckpointError: a file is truncated or corrupt (the message names it).
    """
    count = 0
    for ep in iter_episodes(directory):
        callback(ep.get("observations"), ep.get("actions"), ep.get("rewards"))
        count += 1
    return count
