"""Built-in synthetic environments for the demo and the stress test (no gymnasium needed)."""

from __future__ import annotations

from typing import Any

import numpy as np


class SyntheticAtari:
    """An Atari-shaped environment: uint8 ``[4, 84, 84]`` observations, 6 actions.

    Frames cycle through a small bank of random frame stacks, so stepping costs almost nothing
    and the measured throughput is the replay machinery's. Episodes last 100-1000 steps and end
    by termination, or by truncation at ``max_steps``. Follows the gymnasium step API.
    """

    obs_shape = (4, 84, 84)
    n_actions = 6

    def __init__(self, seed: int | None = None, bank: int = 32, max_steps: int = 800) -> None:
        self._rng = np.random.default_rng(seed)
        self._bank = self._rng.integers(0, 256, (bank, *self.obs_shape), dtype=np.uint8)
        self._max_steps = max_steps
        self._t = 0
        self._length = 0

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._t = 0
        self._length = int(self._rng.integers(100, 1000))
        return self._bank[0], {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        obs = self._bank[(self._t * 7 + int(action)) % self._bank.shape[0]]
        reward = float(action == self._t % self.n_actions)
        terminated = self._t >= self._length
        truncated = not terminated and self._t >= self._max_steps
        return obs, reward, terminated, truncated, {}


def transition_spec_kwargs(obs_shape: tuple[int, ...], obs_dtype: Any) -> dict[str, Any]:
    """The demo's transition fields for an observation shape and dtype."""
    return {
        "obs": (obs_shape, obs_dtype),
        "next_obs": (obs_shape, obs_dtype),
        "action": ((), np.int64),
        "reward": ((), np.float32),
        "terminated": ((), np.bool_),
        "truncated": ((), np.bool_),
    }
