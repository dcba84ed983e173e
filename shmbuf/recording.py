"""Recording gymnasium episodes (every action, observation and reward) into a replay buffer, a
directory of ``.npz`` episode files or counters, and playing recorded directories back.

gymnasium is imported only when a recorder is created: ``import shmbuf`` and playback need none.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .buffer import ReplayBuffer
from .errors import CheckpointError, ClosedError, SpecMismatchError
from .spec import Spec

# Episode files. One ``.npz`` per finished episode, ``episode-000000.npz``, ``episode-000001.npz``,
# ... numbered in the order they were written (a new recorder continues after the highest number
# present). Each is written to a hidden temp file, fsynced, then published under its final name
# with a hard link, which fails if the name is taken: a reader never sees a half-written file and
# recorders sharing a directory never overwrite each other. For an episode of N steps it holds:
#
# - ``observations`` ``[K, ...]``: K = N + 1, the reset observation first, unless a frame_filter
#   kept fewer. Dict / Tuple observation spaces store one array per leaf: ``observations/<key>``,
#   ``observations/<key>/<subkey>``, ``observations/<i>`` for Tuple items;
# - ``observation_steps`` int64 ``[K]``: the step of each kept observation (0 = reset); present
#   whenever a frame_filter was given;
# - ``actions`` ``[N, ...]`` (Dict / Tuple action spaces as ``actions/<key>``) as passed to
#   ``step``; ``rewards`` float64 ``[N]``;
# - 0-d arrays: ``terminated`` and ``truncated`` (how the episode ended), ``complete`` (False when
#   the env never reported the end: ``reset()`` mid-episode or ``close()`` cut it short; then
#   truncated is True), ``length`` (N) and ``episode_index`` (the recorder's count of episodes,
#   filtered-out ones included);
# - ``_header``: a 0-d unicode array holding JSON: ``format``, ``version``, and the tree of the
#   ``observations`` / ``actions`` (null: one array, object: Dict, list: Tuple) when stored.
#
# ``drop=`` leaves ``observations``, ``actions`` and/or ``rewards`` out. Everything loads with
# ``np.load(path, allow_pickle=False)``.
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
        self._obs = [(_name("obs", p), p) for p in obs_paths if _name("obs", p) in spec]
        self._next = [(_name("next_obs", p), p) for p in obs_paths if _name("next_obs", p) in spec]
        self._act = [(_name("action", p), p) for p in _leaf_paths(action_space)]
        self._prev: dict[str, np.ndarray] = {}
        self.writer = buffer.writer(lane)  # last: nothing above changes shared state

    def _keep_obs(self, obs: Any) -> None:
        # A copy: envs may hand out the same array every step and change it in place.
        self._prev = {name: np.array(_leaf(obs, path)) for name, path in self._obs}

    def start(self, obs: Any) -> None:
        self._keep_obs(obs)

    def step(self, t: int, action: Any, obs: Any, reward: Any, terminated: bool,
             truncated: bool) -> None:
        row: dict[str, Any] = dict(self._prev)
        for name, path in self._next:
            row[name] = _leaf(obs, path)
        for name, path in self._act:
            row[name] = _leaf(action, path)
        row["reward"] = reward
        row["terminated"] = terminated
        row["truncated"] = truncated
        self.writer.add(**row)
        if self._obs:
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
        raise SpecMismatchError(f"RecordEpisodes cannot record this env into a buffer: {e}") from None
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
        self._save = np.savez_compressed if compress else np.savez
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
        self._obs: list[list[np.ndarray]] = [[] for _ in self._obs_paths]
        self._templates = [np.asarray(_leaf(obs, p)) for p in self._obs_paths]
        for path, t in zip(self._obs_paths, self._templates):
            if t.dtype == object:
                raise SpecMismatchError(
                    f"RecordEpisodes: observation {_name('observations', path)!r} is not a "
                    f"numeric array (got {type(_leaf(obs, path)).__name__}). Fix: "
                    f"drop=('observations',)"
                )
        self._steps: list[int] = []
        self._actions: list[list[np.ndarray]] = [[] for _ in self._act_paths]
        self._rewards: list[float] = []
        self._keep(0, obs)

    def _keep(self, t: int, obs: Any) -> None:
        if self._obs_paths and (self._frame_filter is None or self._frame_filter(t)):
            self._steps.append(t)
            for kept, path in zip(self._obs, self._obs_paths):
                kept.append(np.array(_leaf(obs, path)))  # a copy (envs may reuse the array)

    def step(self, t: int, action: Any, obs: Any, reward: Any, terminated: bool,
             truncated: bool) -> None:
        for kept, path in zip(self._actions, self._act_paths):
            kept.append(np.array(_leaf(action, path)))
        self._rewards.append(float(reward))
        self._keep(t, obs)

    def finish(self, index: int, length: int, terminated: bool, truncated: bool,
               complete: bool) -> None:
        arrays: dict[str, np.ndarray] = {"_header": np.array(json.dumps(self._header))}
        for path, kept, tmpl in zip(self._obs_paths, self._obs, self._templates):
            arrays[_name("observations", path)] = _stack(kept, tmpl)
        if self._obs_paths and self._frame_filter is not None:
            arrays["observation_steps"] = np.asarray(self._steps, dtype=np.int64)
        for path, kept in zip(self._act_paths, self._actions):
            arrays[_name("actions", path)] = np.stack(kept)
        if "rewards" not in self._drop:
            arrays["rewards"] = np.asarray(self._rewards, dtype=np.float64)
        arrays["terminated"] = np.array(terminated)
        arrays["truncated"] = np.array(truncated)
        arrays["complete"] = np.array(complete)
        arrays["length"] = np.array(length, dtype=np.int64)
        arrays["episode_index"] = np.array(index, dtype=np.int64)
        self._obs, self._actions, self._rewards = [], [], []
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
        m = FILE_PATTERN.match(name)
        if m:
            found.append((int(m.group(1)), directory / name))
    found.sort()
    return found


def _next_number(directory: Path) -> int:
    files = _episode_files(directory)
    return files[-1][0] + 1 if files else 0


# --------------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------------
_GYM_CLASSES: dict[type, type] = {}


def _with_gym_wrapper(cls: type) -> type:
    """``cls`` with ``gymnasium.Wrapper`` as a base, made once per class on first use, so that
    defining (and importing) ``RecordEpisodes`` needs no gymnasium."""
    try:
        import gymnasium
    except ImportError:
        raise ImportError(
            "RecordEpisodes needs gymnasium: pip install 'shmbuf[gym]' (playing recordings back "
            "with scan_episodes / iter_episodes does not)"
        ) from None
    if issubclass(cls, gymnasium.Wrapper):
        return cls
    made = _GYM_CLASSES.get(cls)
    if made is None:
        made = type(cls.__name__, (cls, gymnasium.Wrapper), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        })
        _GYM_CLASSES[cls] = made
    return made


class RecordEpisodes:
    """A gymnasium wrapper that records every action, observation and reward of every episode.

    For an episode of N steps that is actions ``[N]``, observations ``[N + 1]`` (the one from
    ``reset`` first) and rewards ``[N]``, sent to ``target``:

    - a ``ReplayBuffer``: the wrapper takes a lane (``buffer.writer(lane)``) and each step adds
      one transition with the buffer's fields among ``obs``, ``next_obs``, ``action``,
      ``reward``, ``terminated``, ``truncated`` (Dict observations as ``obs/<key>``, the names of
      ``Spec.from_spaces``). Action, reward, terminated and truncated fields are required; the
      observation fields are optional (leave them out to record without frames). At the end of
      an episode it calls ``writer.end_episode(truncated=truncated and not terminated)``:
      termination wins when the env reports both. Rows are stored as they happen, so an
      episode cut short by ``reset()`` or ``close()`` keeps the env's flags on its last row
      (both False) and is closed with ``end_episode(truncated=True)``.
    - a directory (``str`` or ``PathLike``, created if missing): the episode is kept in memory
      (copies of every array) and written as one ``.npz`` file when it ends (the format is
      described above ``FORMAT`` in this module; numbering continues after files already
      there). ``drop`` names arrays to leave out (``"observations"``, ``"actions"``,
      ``"rewards"``); ``compress=True`` uses ``np.savez_compressed``.
    - ``None``: nothing is stored; only the counters below (for debugging runs where storing
      frames costs too much).

    Args:
        env: the ``gymnasium.Env`` to wrap (one env; wrap each env of a vector env by itself).
        target: a ``ReplayBuffer``, a directory, or None.
        episode_filter: ``f(episode_index) -> bool``, which episodes to record; the index counts
            every episode the wrapper saw from 0 (an episode is a reset followed by at least one
            step). All episodes by default.
        frame_filter: ``f(step) -> bool``, the steps whose observation a directory recording
            keeps (0 = the reset observation); kept steps are listed in ``observation_steps``.
            Directory targets only.
        drop: arrays a directory recording leaves out.
        lane: the buffer lane to write (the first free one by default).
        compress: compress episode files.

    Attributes:
        steps_recorded: steps of recorded episodes, counted as they happen.
        episodes_recorded: recorded episodes that have ended (by the env, ``reset()`` or
            ``close()``).
        episodes_seen: episodes started, recorded or not.
        episode_lengths / episode_returns: per recorded episode.
        files: paths written (directory targets).

    The wrapper must be reset before the first step and after each episode's end (stepping
    then raises ``gymnasium.error.ResetNeeded``). ``close()`` writes the episode in progress
    (``complete=False``, ``truncated=True``), releases the buffer lane (the buffer stays open)
    and closes the env; it is idempotent, and the wrapper is a context manager.

    Concurrency: with a buffer target the recorder holds one lane's writer from construction to
    ``close()``; only it writes that lane, and samplers in any process can read each transition
    once ``step()`` returns. A recorder belongs to the process that made it (it cannot be
    pickled).

    Instances are of a subclass made on first use that also derives from ``gymnasium.Wrapper``
    (so that ``import shmbuf`` needs no gymnasium): ``isinstance(rec, RecordEpisodes)`` and
    ``isinstance(rec, gymnasium.Wrapper)`` both hold.

    Example:
        >>> env = RecordEpisodes(gymnasium.make("CartPole-v1"), "/tmp/traces")
        >>> obs, info = env.reset(seed=0)
        >>> obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
        >>> env.close()
        >>> scan_episodes("/tmp/traces", lambda observations, actions, rewards: ...)
        1
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> RecordEpisodes:
        return super().__new__(_with_gym_wrapper(cls))

    def __init__(
        self,
        env: Any,
        target: ReplayBuffer | str | os.PathLike[str] | None,
        episode_filter: Callable[[int], bool] | None = None,
        frame_filter: Callable[[int], bool] | None = None,
        drop: tuple[str, ...] | list[str] | str = (),
        *,
        lane: int | None = None,
        compress: bool = False,
    ) -> None:
        super().__init__(env)  # gymnasium.Wrapper: raises TypeError unless env is a gymnasium.Env
        for name, f in (("episode_filter", episode_filter), ("frame_filter", frame_filter)):
            if f is not None and not callable(f):
                raise TypeError(f"{name} must be a callable taking an int, got {f!r}")
        drop_set = frozenset([drop] if isinstance(drop, str) else drop)
        bad = sorted(drop_set - set(DROPPABLE))
        if bad:
            raise ValueError(f"drop: unknown name(s) {bad}; choose from {DROPPABLE}")
        is_dir = isinstance(target, (str, os.PathLike))
        kind = "a ReplayBuffer" if isinstance(target, ReplayBuffer) else repr(target)
        if not is_dir and frame_filter is not None:
            raise ValueError(
                f"frame_filter applies to directory targets only, and target is {kind}. Fix: "
                f"record to a directory, or leave the observation fields out of the buffer's "
                f"spec to record without frames"
            )
        if not is_dir and drop_set:
            raise ValueError(
                f"drop applies to directory targets only, and target is {kind}. Fix: for a "
                f"buffer, leave the fields out of its spec (observation fields are optional)"
            )
        if is_dir and frame_filter is not None and "observations" in drop_set:
            raise ValueError("frame_filter selects observations, which drop=('observations',) "
                             "leaves out; pass one or the other")
        if lane is not None and not isinstance(target, ReplayBuffer):
            raise ValueError(f"lane= applies to ReplayBuffer targets only, and target is {kind}")

        self._episode_filter = episode_filter
        self.steps_recorded = 0
        self.episodes_recorded = 0
        self.episode_lengths: list[int] = []
        self.episode_returns: list[float] = []
        self._seen = 0  # episodes that had a step
        self._decided: tuple[int, bool] | None = None  # (index, record?) of the last reset
        self._in_episode = False
        self._recording = False
        self._t = 0
        self._return = 0.0
        self._closed = False

        obs_space, act_space = env.observation_space, env.action_space
        self.buffer: ReplayBuffer | None = None
        self.directory: Path | None = None
        self._sink: _CountSink | _BufferSink | _DirectorySink
        if isinstance(target, ReplayBuffer):
            self._sink = _BufferSink(target, obs_space, act_space, lane)
            self.buffer = target
        elif is_dir:
            self.directory = Path(target)  # type: ignore[arg-type]
            self._sink = _DirectorySink(self.directory, obs_space, act_space, drop_set,
                                        frame_filter, compress)
        elif target is None:
            self._sink = _CountSink()
        else:
            raise TypeError(
                f"target must be a ReplayBuffer, a directory (str or PathLike) or None, got "
                f"{type(target).__name__}"
            )

    # -- state ------------------------------------------------------------------------------
    @property
    def episodes_seen(self) -> int:
        return self._seen

    @property
    def files(self) -> list[Path]:
        return list(self._sink.files) if isinstance(self._sink, _DirectorySink) else []

    @property
    def lane(self) -> int | None:
        """The buffer lane this recorder writes (None for other targets)."""
        return self._sink.writer.lane if isinstance(self._sink, _BufferSink) else None

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("RecordEpisodes is closed; wrap the env in a new one to record more")

    # -- gymnasium API ----------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[Any, dict[str, Any]]:
        """Reset the env; an episode still running is first recorded as cut short."""
        self._check_open()
        if self._in_episode and self._t > 0:
            self._finish(terminated=False, truncated=True, complete=False)
        obs, info = self.env.reset(seed=seed, options=options)
        index = self._seen  # an episode without a step is not counted: its index is reused
        if self._decided is None or self._decided[0] != index:
            record = self._episode_filter is None or bool(self._episode_filter(index))
            self._decided = (index, record)
        self._recording = self._decided[1]
        self._in_episode = True
        self._t = 0
        self._return = 0.0
        if self._recording:
            self._sink.start(obs)
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        self._check_open()
        if not self._in_episode:
            from gymnasium.error import ResetNeeded

            raise ResetNeeded(
                "RecordEpisodes: the episode has ended (terminated or truncated); call reset() "
                "before step()" if self._decided else
                "RecordEpisodes: call reset() before the first step()"
            )
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self._t == 0:
            self._seen += 1
        self._t += 1
        if self._recording:
            self.steps_recorded += 1
            self._return += float(reward)
            self._sink.step(self._t, action, obs, reward, bool(terminated), bool(truncated))
        if terminated or truncated:
            self._finish(bool(terminated), bool(truncated), complete=True)
        return obs, reward, terminated, truncated, info

    def _finish(self, terminated: bool, truncated: bool, complete: bool) -> None:
        self._in_episode = False
        if self._recording:
            self._sink.finish(self._seen - 1, self._t, terminated, truncated, complete)
            self.episodes_recorded += 1
            self.episode_lengths.append(self._t)
            self.episode_returns.append(self._return)

    def close(self) -> None:
        """Record the episode in progress (cut short), release the lane, close the env.

        Idempotent. The env and the lane are released even if writing the last episode fails.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._in_episode and self._t > 0:
                self._finish(terminated=False, truncated=True, complete=False)
        finally:
            try:
                self._sink.close()
            finally:
                self.env.close()

    def __enter__(self) -> RecordEpisodes:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError(
            "RecordEpisodes cannot be pickled: it holds an episode in progress and possibly a "
            "buffer lane. Fix: create the recorder in the process that steps the env"
        )


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


__all__ = ["RecordEpisodes", "iter_episodes", "load_episode", "scan_episodes"]
