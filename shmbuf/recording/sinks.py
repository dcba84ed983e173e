"""Where a recorded episode goes: a replay buffer, a directory of episode files, or nowhere
(counting only). The wrapper calls ``start`` / ``step`` / ``finish`` for recorded episodes only,
and ``close`` once."""

from __future__ import annotations

import errno
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..buffer import ReplayBuffer
from ..errors import SpecMismatchError
from ..spec import Spec
from .format import FILE_PATTERN, FORMAT, VERSION, _leaf, _leaf_paths, _name, _tree


# --------------------------------------------------------------------------------------------
# Sinks: where a recorded episode goes. The wrapper calls start / step / finish for recorded
# episodes only, and close once.
# --------------------------------------------------------------------------------------------
class _CountSink:
    """Stores nothing (the wrapper keeps the counters)."""

    def start(self, obs: Any) -> None:
        pass

    def step(self, t: int, action: Any, obs: Any, reward: Any, terminated: bool,
             truncated: bool) -> None:
        pass

    def finish(self, index: int, length: int, terminated: bool, truncated: bool,
               complete: bool) -> None:
        pass

    def close(self) -> None:
        pass


class _BufferSink:
    """One ``writer.add`` per step, ``writer.end_episode`` per episode.

    Concurrency: holds one lane's writer lease from construction to ``close()``; only this sink
    writes that lane, and samplers in any process may read each row once ``add`` returns.
    """

    def __init__(self, buffer: ReplayBuffer, observation_space: Any, action_space: Any,
                 lane: int | None) -> None:
        spec = buffer.spec
        _check_fields(spec, observation_space, action_space)
        obs_paths = _leaf_paths(observation_space)
        self._obs_fields = [(_name("obs", p), p) for p in obs_paths if _name("obs", p) in spec]
        self._next_obs_fields = [(_name("next_obs", p), p) for p in obs_paths
                                 if _name("next_obs", p) in spec]
        if buffer.derived_next_obs:  # the spec has "obs" only; its writer takes next_obs too
            self._next_obs_fields = [("next_obs", p) for name, p in self._obs_fields
                                     if name == "obs"]
        self._action_fields = [(_name("action", p), p) for p in _leaf_paths(action_space)]
        self._previous_obs: dict[str, np.ndarray] = {}
        self.writer = buffer.writer(lane)  # last: nothing above changes shared state

    def _keep_obs(self, obs: Any) -> None:
        # A copy: envs may hand out the same array every step and change it in place.
        self._previous_obs = {name: np.array(_leaf(obs, path)) for name, path in self._obs_fields}

    def start(self, obs: Any) -> None:
        self._keep_obs(obs)

    def step(self, t: int, action: Any, obs: Any, reward: Any, terminated: bool,
             truncated: bool) -> None:
        row: dict[str, Any] = dict(self._previous_obs)
        for name, path in self._next_obs_fields:
            row[name] = _leaf(obs, path)
        for name, path in self._action_fields:
            row[name] = _leaf(action, path)
        row["reward"] = reward
        row["terminated"] = terminated
        row["truncated"] = truncated
        self.writer.add(**row)
        if self._obs_fields:
            self._keep_obs(obs)

    def finish(self, index: int, length: int, terminated: bool, truncated: bool,
               complete: bool) -> None:
        if self.writer.closed:  # the buffer was closed first: its rows are final already
            return
        self.writer.end_episode(truncated=truncated and not terminated)

    def close(self) -> None:
        self.writer.close()


def _check_fields(spec: Spec, observation_space: Any, action_space: Any) -> None:
    """The fields a recorder fills; raise if ``spec`` has one it cannot fill or lacks one it
    must (every action leaf, reward, terminated, truncated), or shapes / dtypes disagree."""
    fix = (
        "Fix: create the buffer with Spec.from_spaces(env.observation_space, env.action_space) "
        "(observation fields may be left out to record without frames)"
    )
    try:
        expected = Spec.from_spaces(observation_space, action_space)
    except SpecMismatchError as e:
        raise SpecMismatchError(
            f"RecordEpisodes cannot record this env into a buffer: {e}") from None
    unknown = [n for n in spec if n not in expected]
    if unknown:
        raise SpecMismatchError(
            f"RecordEpisodes: the buffer's field(s) {', '.join(map(repr, unknown))} cannot be "
            f"filled from this env; it fills {', '.join(expected)}. {fix}"
        )
    required = [n for n in expected if n.split("/")[0] in ("action", "reward", "terminated",
                                                           "truncated")]
    missing = [n for n in required if n not in spec]
    if missing:
        raise SpecMismatchError(
            f"RecordEpisodes: the buffer has no field(s) {', '.join(map(repr, missing))}, which "
            f"every recorded step fills. {fix}"
        )
    for name in spec:
        have, want = spec[name], expected[name]
        if have.shape != want.shape:
            raise SpecMismatchError(
                f"RecordEpisodes: buffer field {name!r} has shape {have.shape}, the env gives "
                f"{want.shape}. {fix}"
            )
        if not np.can_cast(want.dtype, have.dtype, "same_kind"):
            raise SpecMismatchError(
                f"RecordEpisodes: buffer field {name!r} is {have.dtype}, the env gives "
                f"{want.dtype}, which does not cast to it safely. {fix}"
            )


class _DirectorySink:
    """Buffers one episode in memory (copies of every kept array) and writes it as one file."""

    def __init__(self, directory: Path, observation_space: Any, action_space: Any,
                 drop: frozenset[str], frame_filter: Callable[[int], bool] | None,
                 compress: bool) -> None:
        self.directory = directory
        self._frame_filter = frame_filter
        self._save: Callable[..., None] = np.savez_compressed if compress else np.savez
        self._drop = drop
        self._obs_paths = [] if "observations" in drop else _leaf_paths(observation_space)
        self._act_paths = [] if "actions" in drop else _leaf_paths(action_space)
        self._header: dict[str, Any] = {"format": FORMAT, "version": VERSION}
        if self._obs_paths:
            self._header["observations"] = _tree(observation_space)
        if self._act_paths:
            self._header["actions"] = _tree(action_space)
        self.files: list[Path] = []
        directory.mkdir(parents=True, exist_ok=True)
        self._number = _next_number(directory)

    def start(self, obs: Any) -> None:
        self._kept_obs: list[list[np.ndarray]] = [[] for _ in self._obs_paths]
        self._templates = [np.asarray(_leaf(obs, p)) for p in self._obs_paths]
        for path, template in zip(self._obs_paths, self._templates):
            if template.dtype == object:
                raise SpecMismatchError(
                    f"RecordEpisodes: observation {_name('observations', path)!r} is not a "
                    f"numeric array (got {type(_leaf(obs, path)).__name__}). Fix: "
                    f"drop=('observations',)"
                )
        self._steps: list[int] = []
        self._kept_actions: list[list[np.ndarray]] = [[] for _ in self._act_paths]
        self._rewards: list[float] = []
        self._keep(0, obs)

    def _keep(self, t: int, obs: Any) -> None:
        if self._obs_paths and (self._frame_filter is None or self._frame_filter(t)):
            self._steps.append(t)
            for kept, path in zip(self._kept_obs, self._obs_paths):
                kept.append(np.array(_leaf(obs, path)))  # a copy (envs may reuse the array)

    def step(self, t: int, action: Any, obs: Any, reward: Any, terminated: bool,
             truncated: bool) -> None:
        for kept, path in zip(self._kept_actions, self._act_paths):
            kept.append(np.array(_leaf(action, path)))
        self._rewards.append(float(reward))
        self._keep(t, obs)

    def finish(self, index: int, length: int, terminated: bool, truncated: bool,
               complete: bool) -> None:
        arrays: dict[str, np.ndarray] = {"_header": np.array(json.dumps(self._header))}
        for path, kept, template in zip(self._obs_paths, self._kept_obs, self._templates):
            arrays[_name("observations", path)] = _stack(kept, template)
        if self._obs_paths and self._frame_filter is not None:
            arrays["observation_steps"] = np.asarray(self._steps, dtype=np.int64)
        for path, kept in zip(self._act_paths, self._kept_actions):
            arrays[_name("actions", path)] = np.stack(kept)
        if "rewards" not in self._drop:
            arrays["rewards"] = np.asarray(self._rewards, dtype=np.float64)
        arrays["terminated"] = np.array(terminated)
        arrays["truncated"] = np.array(truncated)
        arrays["complete"] = np.array(complete)
        arrays["length"] = np.array(length, dtype=np.int64)
        arrays["episode_index"] = np.array(index, dtype=np.int64)
        self._kept_obs, self._kept_actions, self._rewards = [], [], []
        self.files.append(self._write(arrays))

    def _write(self, arrays: dict[str, np.ndarray]) -> Path:
        tmp = self.directory / f".episode-{os.getpid()}-{secrets.token_hex(6)}.npz.tmp"
        try:
            with open(tmp, "wb") as f:
                self._save(f, **arrays)
                f.flush()
                os.fsync(f.fileno())  # the data is on disk before the file has its name
            while True:
                final = self.directory / f"episode-{self._number:06d}.npz"
                self._number += 1
                if _publish(tmp, final):
                    return final
        finally:
            tmp.unlink(missing_ok=True)

    def close(self) -> None:
        pass


def _stack(kept: list[np.ndarray], template: np.ndarray) -> np.ndarray:
    if kept:
        return np.stack(kept)
    return np.empty((0, *template.shape), template.dtype)  # the frame_filter kept no step


def _publish(tmp: Path, final: Path) -> bool:
    """Give ``tmp`` the name ``final`` unless that name is taken; False if it is.

    A hard link fails on an existing name, so concurrent recorders never overwrite each other;
    file systems without hard links fall back to a check-then-rename.
    """
    try:
        os.link(tmp, final)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
    if final.exists():
        return False
    os.replace(tmp, final)
    return True


def _episode_files(directory: Path) -> list[tuple[int, Path]]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        raise FileNotFoundError(f"no recording directory {str(directory)!r}") from None
    found = []
    for name in names:
        match = FILE_PATTERN.match(name)
        if match:
            found.append((int(match.group(1)), directory / name))
    found.sort()
    return found


def _next_number(directory: Path) -> int:
    files = _episode_files(directory)
    return files[-1][0] + 1 if files else 0
