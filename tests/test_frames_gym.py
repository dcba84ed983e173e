"""Frame stacks rebuilt by shmbuf equal gymnasium's ``FrameStackObservation(env, 4,
padding_type="zero")`` on the same seeded episodes.

A small deterministic environment's observation names its episode and step (``[seed + 1,
step + 1]``, never zero, so padding shows); episodes end by termination or by a ``TimeLimit``
truncation, some after one step. The wrapped environment is played; each step's newest frame is
written once (stored and derived ``next_obs``), and the wrapper's stacked observation and next
observation are kept by the step's tag. Then:

- flat ``frame_stack=4, n_step=3``: for every anchor (all of them, through ``anchors`` /
  ``gather_at``, first frames of every episode included) and for sampled batches of a wrapped
  buffer, ``obs`` is the wrapper's stacked observation and ``next_obs`` its stacked next
  observation after the transition's last step (n steps on, or the episode's end);
- R2D2 windows (``sequence_length=8, stride=4, frame_stack=4``, strict and crossing episode
  ends): every start is a multiple of 4 in its episode, and each step of each window holds
  the wrapper's stacks; steps past the episode's end are zero and masked;
- the same through a prioritized ``SamplerPool`` under every start method.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import shmbuf
from shmbuf.sampling import Plan

gym = pytest.importorskip("gymnasium")
from gymnasium.wrappers import FrameStackObservation, TimeLimit  # noqa: E402

pytestmark = pytest.mark.timeout(120)

K = 4  # frames per stack
LIMIT = 9  # TimeLimit: longer episodes are truncated at 9 steps
GAMMA = 0.9


def tag(seed: int, step: int) -> int:
    return seed << 16 | step


class TagEnv(gym.Env):
    """Deterministic per reset seed: ``1 + integers(12)`` steps then terminated (a
    ``TimeLimit`` truncates the longer ones); observation ``[seed + 1, step + 1]``."""

    observation_space = gym.spaces.Box(0, 1 << 20, (2,), np.int32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        assert seed is not None
        self.seed_, self.step_ = seed, 0
        self.length = 1 + int(self.np_random.integers(12))
        return self._obs(), {}

    def _obs(self) -> np.ndarray:
        return np.array([self.seed_ + 1, self.step_ + 1], np.int32)

    def step(self, action: Any):
        self.step_ += 1
        reward = float(self.seed_ % 7 + self.step_ % 5)
        return self._obs(), reward, self.step_ >= self.length, False, {}


class Played:
    """What the wrapper gave at each step, by tag: stacked obs, stacked next obs, reward,
    terminated; and each episode's length."""

    def __init__(self) -> None:
        self.obs: dict[int, np.ndarray] = {}
        self.next_obs: dict[int, np.ndarray] = {}
        self.reward: dict[int, float] = {}
        self.terminated: dict[int, bool] = {}
        self.length: dict[int, int] = {}

    def steps(self, seed: int) -> list[int]:
        return [tag(seed, t) for t in range(self.length[seed])]


SPEC = shmbuf.Spec({"obs": ((2,), "int32"), "next_obs": ((2,), "int32"),
                    "action": ((), "int64"), "reward": ((), "float32"),
                    "terminated": ((), "bool"), "truncated": ((), "bool")})


def new_buffer(mode: str, capacity: int, lanes: int = 1) -> shmbuf.ReplayBuffer:
    spec = SPEC if mode == "stored" else shmbuf.Spec(
        {k: v for k, v in SPEC.items() if k != "next_obs"})
    return shmbuf.ReplayBuffer.create(spec, capacity, lanes=lanes, next_obs=mode)


def play(buf: shmbuf.ReplayBuffer, seeds_per_lane: list[list[int]]) -> Played:
    """Play each lane's seeded episodes on the wrapped env, writing the newest frame only."""
    played = Played()
    for lane, seeds in enumerate(seeds_per_lane):
        env = FrameStackObservation(TimeLimit(TagEnv(), LIMIT), K, padding_type="zero")
        with buf.writer(lane=lane, timeout=5) as w:
            for seed in seeds:
                obs, _ = env.reset(seed=seed)
                assert (obs[:-1] == 0).all()  # the zero padding this test is about
                step = 0
                while True:
                    nxt, reward, terminated, truncated, _ = env.step(0)
                    t = tag(seed, step)
                    played.obs[t], played.next_obs[t] = obs, nxt
                    played.reward[t], played.terminated[t] = reward, terminated
                    w.add(obs=obs[-1], next_obs=nxt[-1], action=t, reward=reward,
                          terminated=terminated, truncated=truncated and not terminated)
                    obs, step = nxt, step + 1
                    if terminated or truncated:
                        w.end_episode(truncated=not terminated)
                        played.length[seed] = step
                        break
        env.close()
    lengths = set(played.length.values())
    assert 1 in lengths and LIMIT in lengths and min(lengths) < K < max(lengths)
    return played


SEEDS = [[*range(0, 40)], [*range(100, 130)]]


# --------------------------------------------------------------------------------------------
# Flat stacks with n-step returns
# --------------------------------------------------------------------------------------------
def check_flat(played: Played, out: dict[str, np.ndarray]) -> list[int]:
    """Every row equals the wrapper's stacks; returns the rows' tags."""
    tags = out["action"].tolist()
    for b, t in enumerate(tags):
        seed, step = t >> 16, t & 0xFFFF
        length = played.length[seed]
        m = min(3, length - step)
        last = tag(seed, step + m - 1)
        np.testing.assert_array_equal(out["obs"][b], played.obs[t], err_msg=f"obs {seed}/{step}")
        np.testing.assert_array_equal(out["obs_mask"][b], np.arange(K) >= K - 1 - step)
        np.testing.assert_array_equal(out["next_obs"][b], played.next_obs[last],
                                      err_msg=f"next_obs {seed}/{step}")
        assert out["steps"][b] == m
        want = sum(GAMMA ** j * played.reward[tag(seed, step + j)] for j in range(m))
        assert np.isclose(out["reward"][b], want, rtol=1e-6)
        assert out["discount"][b] == pytest.approx(0.0 if played.terminated[last] else GAMMA ** m)
    return tags


@pytest.mark.parametrize("mode", ["stored", "derived"])
def test_flat_stacks_equal_the_wrapper_at_every_step(mode):
    with new_buffer(mode, 1024, lanes=2) as buf:
        played = play(buf, SEEDS)
        compiled = buf.compile(frame_stack=K, n_step=3, gamma=GAMMA)
        anchors = buf.anchors(compiled)
        out = compiled.allocate(anchors.indices.size)
        assert buf.gather_at(out, anchors.lanes, anchors.indices, plan=compiled)
        tags = check_flat(played, out)
        assert sorted(tags) == sorted(played.obs)  # every step, first frames included


@pytest.mark.parametrize("mode", ["stored", "derived"])
def test_sampled_flat_stacks_of_a_wrapped_buffer_equal_the_wrapper(mode):
    """A lane holds 64 of its ~250 rows: sampled rows still equal the wrapper (steps whose
    look-back frames were overwritten are not drawn)."""
    with new_buffer(mode, 64, lanes=2) as buf:
        played = play(buf, SEEDS)
        seen = set()
        rng = np.random.default_rng(0)
        for _ in range(20):
            batch = buf.sample(32, rng, frame_stack=K, n_step=3, gamma=GAMMA)
            seen.update(check_flat(played, batch))
        assert any(t & 0xFFFF == 0 for t in seen)  # first steps of episodes came up


# --------------------------------------------------------------------------------------------
# R2D2 windows: stride 4, a stack per step
# --------------------------------------------------------------------------------------------
T, STRIDE = 8, 4


def check_windows(played: Played, out: dict[str, np.ndarray], cross_episodes: bool
                  ) -> list[int]:
    """Each window starts at a multiple of the stride, and each of its steps holds the
    wrapper's stacks (zero and masked past its episode's end)."""
    starts = []
    for b, first in enumerate(out["action"][:, 0].tolist()):
        seed, s0 = first >> 16, first & 0xFFFF
        length = played.length[seed]
        assert s0 % STRIDE == 0, f"window starts at step {s0}"
        assert cross_episodes or s0 + T <= length
        kept = s0 + np.arange(T) < length
        np.testing.assert_array_equal(out["mask"][b], kept)
        for j in range(T):
            if not kept[j]:
                for name in ("obs", "next_obs", "obs_mask", "next_obs_mask", "action"):
                    assert not out[name][b, j].any(), (name, seed, s0, j)
                continue
            t = tag(seed, s0 + j)
            assert out["action"][b, j] == t
            np.testing.assert_array_equal(out["obs"][b, j], played.obs[t])
            np.testing.assert_array_equal(out["next_obs"][b, j], played.next_obs[t])
            np.testing.assert_array_equal(out["obs_mask"][b, j], np.arange(K) >= K - 1 - s0 - j)
        starts.append(first)
    return starts


def strided_starts(played: Played, cross_episodes: bool) -> list[int]:
    return [tag(seed, s) for seed, length in played.length.items()
            for s in range(0, length, STRIDE) if cross_episodes or s + T <= length]


@pytest.mark.parametrize("cross_episodes", [True, False])
@pytest.mark.parametrize("mode", ["stored", "derived"])
def test_windows_hold_the_wrappers_stacks_at_every_step(mode, cross_episodes):
    plan = dict(sequence_length=T, stride=STRIDE, frame_stack=K, cross_episodes=cross_episodes)
    with new_buffer(mode, 1024, lanes=2) as buf:
        played = play(buf, SEEDS)
        compiled = buf.compile(**plan)
        anchors = buf.anchors(compiled)
        out = compiled.allocate(anchors.indices.size)
        assert buf.gather_at(out, anchors.lanes, anchors.indices, plan=compiled)
        starts = check_windows(played, out, cross_episodes)
        assert sorted(starts) == sorted(strided_starts(played, cross_episodes))
        batch = buf.sample(64, 1, **plan)  # and drawn
        check_windows(played, batch, cross_episodes)


@pytest.mark.timeout(120)
def test_prioritized_pool_windows_hold_the_wrappers_stacks(start_method):
    from workers import SamplerPool
    from workers.config import Workers
    from workers.selection import Prioritized

    plan = Plan(sequence_length=T, stride=STRIDE, frame_stack=K, cross_episodes=True)
    with new_buffer("derived", 96, lanes=2) as buf:
        played = play(buf, SEEDS)
        with SamplerPool(buf, 16, selection=Prioritized(alpha=0.6, beta=0.4), plan=plan,
                         workers=Workers(1, start_method=start_method), seed=3,
                         timeout=60) as pool:
            for _ in range(10):
                batch = pool.next(timeout=60)
                out = {n: np.asarray(batch[n]) for n in batch}
                check_windows(played, out, True)
                td = np.abs(out["reward"]) + 0.1  # [B, T] per-step priorities
                pool.update_priorities(batch.indices, td, mask=out["mask"])
