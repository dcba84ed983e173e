"""Stable-Baselines3 replay buffers kept in shmbuf shared memory: ``ReplayBuffer`` and
``DictReplayBuffer`` are drop-in ``replay_buffer_class`` values for DQN, SAC, TD3 and DDPG.

Needs the ``sb3`` extra (``pip install shmbuf[sb3]``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common import buffers as sb3_buffers
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from ..buffer import ReplayBuffer as SharedBuffer
from ..errors import EmptyBufferError, StaleIndexError
from ..sampling import Draw, Windows
from ..spec import Spec
from .sb3_columns import Column, ColumnDict, RowsWriteError, read_rows, refuse_write

# Attributes that hold live shared-memory handles or processes: never pickled.
_LIVE = ("_shared", "_writer", "_pool", "_pool_batch_size", "_rng", "_plan")


def _shaped(value: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``value`` reshaped (the method: ``np.reshape`` costs 2 us more per call)."""
    return (value if type(value) is np.ndarray else np.asarray(value)).reshape(shape)


# The earlier releases' SamplerPool keywords that ``Workers`` now holds.
_OLD_WORKER_KEYWORDS = frozenset({"n_staging", "start_method", "max_restarts_per_minute",
                                  "ordered"})


def _prefetch_options(prefetch: int, given: dict[str, Any]) -> dict[str, Any]:
    """``SamplerPool``'s keyword arguments for the prefetching pool: the user's
    ``prefetch_kwargs`` as given, with ``prefetch`` sampler processes. A ``workers=Workers(...)``
    among them sets the other worker options (its ``n`` left out, or ``prefetch``); with the
    earlier releases' ``start_method=``, ``n_staging=``... the count goes in their spelling too,
    so that they combine (``SamplerPool`` then warns, showing ``workers=Workers(...)``)."""
    options = dict(given)
    if "n_workers" in options:
        raise TypeError("prefetch_kwargs: the number of sampler processes is prefetch=; drop "
                        "n_workers from prefetch_kwargs")
    workers = options.pop("workers", None)
    if workers is None:
        options["n_workers" if _OLD_WORKER_KEYWORDS & options.keys() else "workers"] = prefetch
        return options
    from workers.config import Workers  # lazily: see the structure rule for integrations

    if not isinstance(workers, Workers) or workers.n not in (None, prefetch):
        raise ValueError(
            f"prefetch_kwargs workers={workers!r}: the number of sampler processes is "
            f"prefetch={prefetch}; pass workers=Workers(staging=..., start_method=...) without n")
    options["workers"] = dataclasses.replace(workers, n=prefetch)
    return options


def _read_only(read: Any) -> Any:
    """One of SB3's array attributes: ``read`` gives its ``Column`` (or dict of them); setting
    the attribute raises ``RowsWriteError``."""
    name = read.__name__.removeprefix("_sb3_")

    def refuse(self: Any, value: Any) -> None:
        refuse_write(f"{name} = ...")

    return property(read, refuse, doc=read.__doc__)


class _SharedReplay:
    """What both SB3 buffer classes share: one shmbuf lane per env, SB3's shapes (``Spec.
    from_spaces(layout="sb3")``), SB3's sampling and seeding, pickling by value.

    Storage: the fields ``obs`` (``obs/<key>`` for Dict spaces), ``next_obs`` (unless
    ``optimize_memory_usage``), ``action``, ``reward``, ``done`` and ``truncated`` (SB3's
    ``info["TimeLimit.truncated"]``, kept even if ``handle_timeout_termination=False``; sampling
    then ignores it, as SB3 does). A ``done`` ends the env's episode in shmbuf too.

    ``optimize_memory_usage=True`` stores ``obs`` once (``next_obs="derived"``): an episode's
    true final observation is kept in one extra row, so unlike SB3's own buffer it works with
    ``handle_timeout_termination=True`` and the last transition's next observation is right.
    Those extra rows take capacity: the buffer then holds ``buffer_size`` rows, of which one
    per episode is not a transition.

    Seeding: without ``prefetch``, indices are drawn from NumPy's global generator exactly as
    SB3's ``ReplayBuffer`` draws them, so ``seed=`` reproduces a run and picks the same batches
    as SB3's own buffer fed the same transitions. With ``optimize_memory_usage`` or
    ``prefetch``, draws come from a generator seeded from NumPy's global one at the first
    ``sample``. A prefetching pool samples while ``add`` runs, so its batches depend on timing.

    SB3's attributes (``observations``, ``actions``, ``dones``...) are ``Column``s over the
    rows, in SB3's layout: ``_rows[position, env]`` is the logical index ``add`` gave the
    transition SB3 keeps at that position (-1: none), so reads find SB3's positions after a
    wrap, ``reset()`` and the final-observation rows of ``optimize_memory_usage``. Writes go
    through ``add`` only (``RowsWriteError`` otherwise; see ``sb3_columns``).

    Concurrency: this process owns the buffer and its one ``VectorWriter`` (all lanes); other
    processes may attach by ``name`` and sample. ``_rows``, ``pos`` and ``full`` live in this
    process: the positions are SB3's, not the buffer's. Pickling (SB3's ``save_replay_buffer``) stores
    the contents (``state_dict``), and unpickling creates a new segment holding them.
    """

    observation_space: Any
    action_space: Any
    buffer_size: int
    n_envs: int
    device: th.device
    obs_shape: Any
    action_dim: int

    def __init__(self, buffer_size: int, observation_space: spaces.Space,
                 action_space: spaces.Space, device: th.device | str = "auto", n_envs: int = 1,
                 optimize_memory_usage: bool = False, handle_timeout_termination: bool = True,
                 *, prefetch: int = 0, prefetch_kwargs: dict[str, Any] | None = None,
                 name: str | None = None) -> None:
        if optimize_memory_usage and isinstance(observation_space, spaces.Dict):
            raise ValueError("DictReplayBuffer does not support optimize_memory_usage=True (as "
                             "in SB3): pass optimize_memory_usage=False")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (sampler processes), got {prefetch!r}")
        self._pos, self._full = 0, False  # (BaseBuffer.__init__ sets pos and full to these)
        sb3_buffers.BaseBuffer.__init__(self, buffer_size, observation_space,  # type: ignore[arg-type]
                                        action_space, device, n_envs=n_envs)
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.optimize_memory_usage = optimize_memory_usage
        self.handle_timeout_termination = handle_timeout_termination
        self.prefetch = prefetch
        self.prefetch_kwargs = dict(prefetch_kwargs or {})
        if prefetch:  # a wrong option fails here, not at the first sample()
            _prefetch_options(prefetch, self.prefetch_kwargs)
        self.spec = Spec.from_spaces(observation_space, action_space, layout="sb3",
                                     next_obs=not optimize_memory_usage)
        self._obs_keys = [k for k in self.spec if k.split("/")[0] == "obs"]
        self._dict_obs = isinstance(observation_space, spaces.Dict)
        self._last_next_obs: dict[str, np.ndarray] | None = None  # derived: chain check
        # SB3's positions: the logical index of the transition at [position, env], -1 if none
        self._rows = np.full((self.buffer_size, n_envs), -1, np.int64)
        self._add_shapes()
        self._open(name, None)

    # -- the shared buffer --------------------------------------------------------------------
    def _open(self, name: str | None, state: dict[str, Any] | None) -> None:
        self._shared = SharedBuffer.create(
            self.spec, self.buffer_size, lanes=self.n_envs, name=name,
            next_obs="derived" if self.optimize_memory_usage else "stored")
        try:
            if state is not None:
                self._shared.load_state_dict(state)
            self._writer = self._open_writer()
        except BaseException:
            self._shared.close()
            raise
        self._pool: Any = None
        self._pool_batch_size = 0
        self._rng: np.random.Generator | None = None
        self._plan = self._shared.compile() if self.optimize_memory_usage else None

    def _open_writer(self) -> Any:
        """One env: a lane ``Writer`` (its ``add`` is the cheapest); else a ``VectorWriter``."""
        if self.n_envs == 1:
            return self._shared.writer(lane=0)
        return self._shared.writer(num_envs=self.n_envs)

    def _end_episodes(self, envs: np.ndarray, truncated: Any) -> None:
        if self.n_envs == 1:
            self._writer.end_episode(truncated=bool(np.asarray(truncated).reshape(-1)[0]))
        else:
            self._writer.end_episode(envs, truncated=truncated)

    @property
    def shared(self) -> SharedBuffer:
        """The shmbuf buffer underneath (attach to it by ``shared.name`` from other processes)."""
        return self._shared

    # -- SB3's attributes ---------------------------------------------------------------------
    @property
    def pos(self) -> int:
        """SB3's next position (``add`` moves it). Setting it to another value is refused
        (``RowsWriteError``): the ring's next row is the lane's, not the caller's."""
        return self._pos

    @pos.setter
    def pos(self, value: int) -> None:
        if value != self._pos:
            refuse_write(f"pos = {value!r} (pos is {self._pos})")

    @property
    def full(self) -> bool:
        """SB3's ``full``. ``full = True`` on an empty buffer (SB3's arrays are zeros) publishes
        ``buffer_size`` zero transitions per env through ``add``, which is what SB3 then samples
        from; any other change is refused (``RowsWriteError``)."""
        return self._full

    @full.setter
    def full(self, value: bool) -> None:
        if bool(value) == self._full:
            return
        if value and self._pos == 0 and len(self._shared) == 0 and not self.optimize_memory_usage:
            self._publish_zero_rows()
            return
        refuse_write(f"full = {value!r} (full is {self._full}, pos {self._pos})")

    def _publish_zero_rows(self) -> None:
        """``buffer_size`` all-zero steps per env, added as any other (not a hot path: once)."""
        lead = (self.n_envs,)
        zeros = {name: np.zeros(lead + f.shape, f.dtype) for name, f in self.spec.items()}
        obs: Any = ({k[4:]: zeros[k] for k in self._obs_keys} if self._dict_obs
                    else zeros["obs"])
        next_obs: Any = ({k[4:]: zeros["next_" + k] for k in self._obs_keys}
                         if self._dict_obs else zeros["next_obs"])
        infos: list[dict[str, Any]] = [{} for _ in range(self.n_envs)]
        for _ in range(self.buffer_size):
            self.add(obs, next_obs, zeros["action"], zeros["reward"], zeros["done"], infos)

    def _column(self, field: str, tail: tuple[int, ...], dtype: Any, name: str,
                write: Any = None) -> Column:
        def read(positions: np.ndarray) -> np.ndarray:
            return read_rows(self._shared, self._rows[positions], field, tail, dtype)

        return Column(read, self.buffer_size, (self.n_envs, *tail), dtype, name, write)

    def _observation_columns(self, prefix: str, name: str) -> Any:
        space = self.observation_space
        if self._dict_obs:
            return ColumnDict({k[4:]: self._column(prefix + k[3:], self.spec[k].shape,
                                                   space[k[4:]].dtype, f"{name}[{k[4:]!r}]")
                               for k in self._obs_keys})
        return self._column(prefix, self.spec["obs"].shape, space.dtype, name)

    def _sb3_observations(self) -> Any:
        """SB3's ``observations``, ``[buffer_size, n_envs, *obs_shape]`` (a dict of them for
        Dict spaces)."""
        return self._observation_columns("obs", "observations")

    def _sb3_next_observations(self) -> Any:
        """SB3's ``next_observations`` (as in SB3, absent with ``optimize_memory_usage``)."""
        if self.optimize_memory_usage:
            raise AttributeError("next_observations: with optimize_memory_usage=True SB3's "
                                 "buffer has none either; the next observation of position p "
                                 "is sampled with it (sample(), _get_samples())")
        return self._observation_columns("next_obs", "next_observations")

    def _sb3_actions(self) -> Column:
        """SB3's ``actions``, ``[buffer_size, n_envs, action_dim]``."""
        return self._column("action", self.spec["action"].shape, self.spec["action"].dtype,
                            "actions")

    def _sb3_rewards(self) -> Column:
        """SB3's ``rewards``, ``[buffer_size, n_envs]`` float32."""
        return self._column("reward", (), np.float32, "rewards")

    def _sb3_dones(self) -> Column:
        """SB3's ``dones``, ``[buffer_size, n_envs]`` float32. One write is taken: SB3's
        ``learn()`` marks ``dones[pos - 1] = True`` before it resumes with
        ``optimize_memory_usage``; that ends the envs' open episodes here (truncated: the true
        next observation is kept, so no bootstrapping across the gap is lost)."""
        return self._column("done", (), np.float32, "dones", self._write_dones)

    def _sb3_timeouts(self) -> Column:
        """SB3's ``timeouts``, ``[buffer_size, n_envs]`` float32 (``TimeLimit.truncated``; zeros
        without ``handle_timeout_termination``, as in SB3)."""
        return self._column("truncated", (), np.float32, "timeouts")

    observations = _read_only(_sb3_observations)
    next_observations = _read_only(_sb3_next_observations)
    actions = _read_only(_sb3_actions)
    rewards = _read_only(_sb3_rewards)
    dones = _read_only(_sb3_dones)
    timeouts = _read_only(_sb3_timeouts)

    def _write_dones(self, key: Any, value: Any) -> None:
        last = (self._pos - 1) % self.buffer_size
        resume_hook = (self.optimize_memory_usage and np.ndim(value) == 0 and bool(value)
                       and isinstance(key, (int, np.integer)) and int(key) == last
                       and (self._full or self._pos > 0))
        if not resume_hook:
            refuse_write(f"dones[{key!r}] = {value!r}")
        last_obs = self._last_next_obs
        if last_obs is not None and last_obs["open"].any():
            self._end_episodes(last_obs["open"], np.ones(self.n_envs, bool))
        self._last_next_obs = None

    def size(self) -> int:
        """Transitions per env, as SB3's ``size()`` (``len(self)`` counts all envs)."""
        if self.optimize_memory_usage:
            return len(self._shared) // self.n_envs
        return self.buffer_size if self._full else self._pos

    def __len__(self) -> int:
        return len(self._shared)

    # -- writing ------------------------------------------------------------------------------
    def _add_shapes(self) -> None:
        """The shape each field is given to the writer in: ``[n_envs, ...]``, or one row's."""
        lead = (self.n_envs,) if self.n_envs > 1 else ()
        self._shapes = {name: lead + f.shape for name, f in self.spec.items()}
        self._no_truncation = np.zeros(self._shapes["truncated"], np.float32)
        self._no_truncation.flags.writeable = False

    def _obs_fields(self, obs: Any, prefix: str, rows: dict[str, Any]) -> None:
        shapes = self._shapes
        if isinstance(obs, dict):
            for k, v in obs.items():
                rows[f"{prefix}/{k}"] = _shaped(v, shapes[f"obs/{k}"])
        else:
            rows[prefix] = _shaped(obs, shapes["obs"])

    def add(self, obs: Any, next_obs: Any, action: np.ndarray, reward: np.ndarray,
            done: np.ndarray, infos: list[dict[str, Any]]) -> None:
        """Append one step of every env (SB3's signature; arrays ``[n_envs, ...]``)."""
        shapes = self._shapes
        rows: dict[str, Any] = {}
        self._obs_fields(obs, "obs", rows)
        self._obs_fields(next_obs, "next_obs", rows)
        rows["action"] = _shaped(action, shapes["action"])
        rows["reward"] = _shaped(reward, shapes["reward"])
        rows["done"] = done = _shaped(done, shapes["done"])
        rows["truncated"] = truncated = self._no_truncation if not (
            self.handle_timeout_termination) else np.array(
            [info.get("TimeLimit.truncated", False) for info in infos],
            np.float32).reshape(shapes["truncated"])
        if self.optimize_memory_usage:
            self._end_broken_chains(rows["obs"])
        self._rows[self._pos] = self._writer.add(**rows)
        ended = done.reshape(self.n_envs).astype(bool)
        if ended.any() if self.n_envs > 1 else ended[0]:
            self._end_episodes(ended, truncated.reshape(self.n_envs).astype(bool))
        if self.optimize_memory_usage:
            last = np.array(rows["next_obs"]).reshape(self.n_envs, -1)
            self._last_next_obs = {"obs": last, "open": ~ended}
        self._pos += 1
        if self._pos == self.buffer_size:
            self._full, self._pos = True, 0

    def _end_broken_chains(self, obs: np.ndarray) -> None:
        """With derived next_obs, a step whose ``obs`` is not the previous step's ``next_obs``
        (a resumed ``learn()``, a swapped env) ends the env's open episode, truncated, first."""
        last = self._last_next_obs
        if last is None:
            return
        broken = last["open"] & (obs.reshape(self.n_envs, -1) != last["obs"]).any(axis=1)
        if broken.any():
            self._end_episodes(broken, True)

    # -- sampling -----------------------------------------------------------------------------
    def _draw_like_sb3(self, windows: Windows, batch_size: int,
                       rng: np.random.Generator) -> Draw:
        """SB3's draw, from NumPy's global generator: a position below ``size()``, then an
        env; the row is the one ``add`` wrote at that position (``_rows``)."""
        upper = int(windows.sizes.min())
        if upper <= 0:
            raise EmptyBufferError("cannot sample: the replay buffer holds no transitions yet")
        positions = np.random.randint(0, upper, size=batch_size)
        lanes = np.random.randint(0, high=self.n_envs, size=(batch_size,))
        return Draw(lanes.astype(np.int64), self._rows[positions, lanes])

    def _read_at(self, positions: np.ndarray, lanes: np.ndarray) -> dict[str, np.ndarray]:
        """The transitions at SB3 positions ``positions`` of envs ``lanes``, as sampled."""
        if positions.size and (positions.min() < 0 or positions.max() >= self.buffer_size):
            raise IndexError(f"batch_inds must be positions in [0, {self.buffer_size}), got "
                             f"{positions.min()}..{positions.max()}")
        indices = self._rows[positions, lanes]
        n = len(positions)
        out = self._plan.allocate(n) if self._plan is not None else {
            name: np.empty((n, *f.shape), f.dtype) for name, f in self.spec.items()}
        if (indices < 0).any() or not self._shared.gather_at(out, lanes, indices,
                                                             plan=self._plan):
            raise StaleIndexError(
                "_get_samples(): a position holds no transition (not written since the buffer "
                "was made or reset, or overwritten); draw positions below size(), as sample() "
                "does")
        return out

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None) -> Any:
        """SB3's ``_get_samples``: the transitions at positions ``batch_inds``, each of an env
        drawn from NumPy's global generator as SB3 draws it."""
        positions = np.asarray(batch_inds, np.int64).reshape(-1)
        lanes = np.random.randint(0, high=self.n_envs, size=(len(positions),))
        return self._samples(self._read_at(positions, lanes.astype(np.int64)), env)

    def _samples(self, arrays: dict[str, np.ndarray], env: VecNormalize | None) -> Any:
        raise NotImplementedError  # ReplayBuffer and DictReplayBuffer below

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> Any:
        """``batch_size`` transitions as tensors on ``self.device`` that the caller owns."""
        return self._samples(self._sample_arrays(batch_size), env)

    def _generator(self) -> np.random.Generator:
        if self._rng is None:  # seeded from SB3's seed (set_random_seed seeds np.random)
            self._rng = np.random.default_rng(np.random.randint(0, 2**63 - 1, dtype=np.int64))
        return self._rng

    def _sample_arrays(self, batch_size: int) -> dict[str, np.ndarray]:
        """A batch as new arrays this call owns (field name -> ``[B, ...]``)."""
        if self.prefetch:
            return self._pool_sample(batch_size)
        if self._plan is not None:
            out = self._plan.allocate(batch_size)
            self._shared.sample_into(out, self._generator(), plan=self._plan)
            return out
        out = {name: np.empty((batch_size, *f.shape), f.dtype)
               for name, f in self.spec.items()}
        self._shared.sample_into(out, sampler=self._draw_like_sb3)
        return out

    def _pool_sample(self, batch_size: int) -> dict[str, np.ndarray]:
        if self._pool is None or self._pool_batch_size != batch_size:
            from workers import SamplerPool  # lazily: see the structure rule for integrations

            self._close_pool()
            seed = int(np.random.randint(0, 2**63 - 1, dtype=np.int64))
            self._pool = SamplerPool(self._shared, batch_size=batch_size, seed=seed,
                                     **_prefetch_options(self.prefetch, self.prefetch_kwargs))
            self._pool_batch_size = batch_size
        batch = next(self._pool)
        return batch.copy()  # arrays of our own, not views of a staging slot

    def _tensor(self, array: np.ndarray) -> th.Tensor:
        return th.from_numpy(array).to(self.device)  # the array is this call's own: no copy

    def _common(self, arrays: dict[str, np.ndarray], env: VecNormalize | None
                ) -> tuple[th.Tensor, th.Tensor, th.Tensor]:
        dones = arrays["done"]
        if self.handle_timeout_termination:
            dones = dones * (1 - arrays["truncated"])
        rewards = arrays["reward"]
        if env is not None:
            rewards = np.asarray(env.normalize_reward(rewards), np.float32)
        return (self._tensor(np.ascontiguousarray(arrays["action"])), self._tensor(dones),
                self._tensor(rewards))

    # -- lifecycle ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the buffer (SB3's ``reset``). The writer stays open (``clear()`` empties its
        lanes under it), and so may writers of other handles or processes; positions count
        from the rows written after the reset, as in SB3's own buffer."""
        self._close_pool()
        self._shared.clear()
        self._rows.fill(-1)
        self._last_next_obs = None
        self._pos, self._full = 0, False

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def close(self) -> None:
        """Stop the prefetch pool, close the writer and unlink the segment. Idempotent."""
        if "_shared" in self.__dict__:
            self._close_pool()
            self._writer.close()
            self._shared.close()

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in _LIVE}
        state["_shared_state"] = self._shared.state_dict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        contents = state.pop("_shared_state")
        self.__dict__.update(state)
        self._open(None, contents)


class ReplayBuffer(_SharedReplay, sb3_buffers.ReplayBuffer):  # type: ignore[misc]
    """SB3's ``ReplayBuffer`` in shmbuf shared memory.

    Example:
        >>> from stable_baselines3 import DQN
        >>> from shmbuf.integrations.sb3 import ReplayBuffer
        >>> model = DQN("MlpPolicy", "CartPole-v1", replay_buffer_class=ReplayBuffer,
        ...             replay_buffer_kwargs={"prefetch": 0})
        >>> model.learn(2_000); model.replay_buffer.close()
    """

    def _samples(self, arrays: dict[str, np.ndarray], env: VecNormalize | None
                 ) -> ReplayBufferSamples:
        actions, dones, rewards = self._common(arrays, env)
        obs: Any = arrays["obs"]
        next_obs: Any = arrays["next_obs"]
        if env is not None:
            obs, next_obs = env.normalize_obs(obs), env.normalize_obs(next_obs)
        return ReplayBufferSamples(self._tensor(np.asarray(obs)), actions,
                                   self._tensor(np.asarray(next_obs)), dones, rewards)


class DictReplayBuffer(_SharedReplay, sb3_buffers.DictReplayBuffer):  # type: ignore[misc]
    """SB3's ``DictReplayBuffer`` in shmbuf shared memory (Dict observation spaces)."""

    def _samples(self, arrays: dict[str, np.ndarray], env: VecNormalize | None
                 ) -> DictReplayBufferSamples:
        actions, dones, rewards = self._common(arrays, env)
        obs: Any = {k[4:]: arrays[k] for k in self._obs_keys}
        next_obs: Any = {k[4:]: arrays["next_" + k] for k in self._obs_keys}
        if env is not None:
            obs, next_obs = env.normalize_obs(obs), env.normalize_obs(next_obs)
        return DictReplayBufferSamples(
            {k: self._tensor(np.asarray(v)) for k, v in obs.items()}, actions,
            {k: self._tensor(np.asarray(v)) for k, v in next_obs.items()}, dones, rewards)


__all__ = ["DictReplayBuffer", "ReplayBuffer", "RowsWriteError"]
