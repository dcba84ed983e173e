"""``RecordEpisodes``: the gymnasium wrapper that records every action, observation and reward.

gymnasium is imported only when a recorder is created: ``import shmbuf`` and playback need none.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..buffer import ReplayBuffer
from ..errors import ClosedError
from .format import DROPPABLE
from .sinks import _BufferSink, _CountSink, _DirectorySink

if TYPE_CHECKING:
    # Every instance is a gymnasium.Wrapper (see _with_gym_wrapper), so type it as one.
    from gymnasium import Wrapper as _WrapperBase
else:
    _WrapperBase = object

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


class RecordEpisodes(_WrapperBase):
    """A gymnasium wrapper that records every action, observation and reward of every episode.

    For an episode of N steps that is actions ``[N]``, observations ``[N + 1]`` (the one from
    ``reset`` first) and rewards ``[N]``, sent to ``target``:

    - a ``ReplayBuffer``: the wrapper takes a lane (``buffer.writer(lane)``) and each step adds
      one transition with the buffer's fields among ``obs``, ``next_obs``, ``action``,
      ``reward``, ``terminated``, ``truncated`` (Dict observations as ``obs/<key>``, the names of
      ``Spec.from_spaces``). Action, reward, terminated and truncated fields are required; the
      observation fields are optional (leave them out to record without frames); a
      ``next_obs="derived"`` buffer (spec from ``Spec.from_spaces(..., next_obs=False)``) is
      given each step's ``next_obs`` as its writer expects and stores it once. At the end of
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
        self._steps_taken = 0
        self._return = 0.0
        self._closed = False

        obs_space, act_space = env.observation_space, env.action_space
        self.buffer: ReplayBuffer | None = None
        self.directory: Path | None = None
        self._sink: _CountSink | _BufferSink | _DirectorySink
        if isinstance(target, ReplayBuffer):
            self._sink = _BufferSink(target, obs_space, act_space, lane)
            self.buffer = target
        elif isinstance(target, (str, os.PathLike)):
            self.directory = Path(target)
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
        if self._in_episode and self._steps_taken > 0:
            self._finish(terminated=False, truncated=True, complete=False)
        obs, info = self.env.reset(seed=seed, options=options)
        index = self._seen  # an episode without a step is not counted: its index is reused
        if self._decided is None or self._decided[0] != index:
            record = self._episode_filter is None or bool(self._episode_filter(index))
            self._decided = (index, record)
        self._recording = self._decided[1]
        self._in_episode = True
        self._steps_taken = 0
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
        if self._steps_taken == 0:
            self._seen += 1
        self._steps_taken += 1
        if self._recording:
            self.steps_recorded += 1
            self._return += float(reward)
            self._sink.step(self._steps_taken, action, obs, reward, bool(terminated),
                            bool(truncated))
        if terminated or truncated:
            self._finish(bool(terminated), bool(truncated), complete=True)
        return obs, reward, terminated, truncated, info

    def _finish(self, terminated: bool, truncated: bool, complete: bool) -> None:
        self._in_episode = False
        if self._recording:
            self._sink.finish(self._seen - 1, self._steps_taken, terminated, truncated, complete)
            self.episodes_recorded += 1
            self.episode_lengths.append(self._steps_taken)
            self.episode_returns.append(self._return)

    def close(self) -> None:
        """Record the episode in progress (cut short), release the lane, close the env.

        Idempotent. The env and the lane are released even if writing the last episode fails.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._in_episode and self._steps_taken > 0:
                self._finish(terminated=False, truncated=True, complete=False)
        finally:
            try:
                self._sink.close()
            finally:
                self.env.close()

    def __enter__(self) -> RecordEpisodes:
        return self

    def __exit__(self, *exc: Any) -> Literal[False]:
        self.close()
        return False  # exceptions propagate

    def __reduce__(self) -> Any:
        raise TypeError(
            "RecordEpisodes cannot be pickled: it holds an episode in progress and possibly a "
            "buffer lane. Fix: create the recorder in the process that steps the env"
        )
