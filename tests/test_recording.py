"""Recording: RecordEpisodes into a directory, a ReplayBuffer and counters, and playback.

Every round trip compares what was stored with an independent record the test keeps of what the
wrapped env returned (exact equality), under a seeded random policy, for CartPole-v1, an env with
64x64x3 uint8 frames that are a function of (episode seed, step, action), and a Dict-observation
env. Frames that depend on the step and action prove that no observation is shifted by one, taken
from the wrong episode, or aliased to a later one.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

import shmbuf
from shmbuf import RecordEpisodes, ReplayBuffer, Spec, iter_episodes, scan_episodes
from shmbuf.errors import CheckpointError, ClosedError, SpecMismatchError

N_EPISODES = 6


# ------------------------------------------------------------------------------------------------
# Test environments
# ------------------------------------------------------------------------------------------------
def _frame(seed: int, t: int, action: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng([seed, t, action]).integers(0, 256, shape, dtype=np.uint8)


class ImageEnv(gym.Env):
    """64x64x3 uint8 frames, a function of the episode's seed, the step and the last action.

    Episodes terminate after 3..13 steps or are truncated at 9, so both ends occur. The env
    hands out the same frame array every step, changed in place (as some emulators do), so a
    recorder that keeps references instead of copies records wrong frames.
    """

    metadata = {"render_modes": []}
    shape = (64, 64, 3)

    def __init__(self, max_steps: int = 9) -> None:
        self.observation_space = spaces.Box(0, 255, self.shape, np.uint8)
        self.action_space = spaces.Discrete(4)
        self.max_steps = max_steps
        self.closes = 0
        self._buf = np.zeros(self.shape, np.uint8)

    def _obs(self, action: int) -> np.ndarray:
        self._buf[...] = _frame(self._seed, self._t, action, self.shape)
        return self._buf

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._seed = int(self.np_random.integers(2**31))
        self._length = int(self.np_random.integers(3, 14))
        self._t = 0
        return self._obs(0), {}

    def step(self, action):
        self._t += 1
        reward = 0.25 * int(action) - 0.5
        terminated = self._t >= self._length
        truncated = not terminated and self._t >= self.max_steps
        return self._obs(int(action)), reward, terminated, truncated, {}

    def close(self):
        self.closes += 1


class DictEnv(gym.Env):
    """Dict observations (an image and a vector) and a 2-d continuous action."""

    metadata = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Dict(
            {
                "image": spaces.Box(0, 255, (16, 16, 3), np.uint8),
                "vector": spaces.Box(-1, 1, (5,), np.float32),
            }
        )
        self.action_space = spaces.Box(-1, 1, (2,), np.float32)

    def _obs(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self._seed, self._t])
        return {
            "image": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8),
            "vector": rng.uniform(-1, 1, 5).astype(np.float32),
        }

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._seed = int(self.np_random.integers(2**31))
        self._length = int(self.np_random.integers(2, 12))
        self._t = 0
        return self._obs(), {}

    def step(self, action):
        self._t += 1
        reward = float(np.float32(np.sum(action)))
        terminated = self._t >= self._length
        truncated = not terminated and self._t >= 8
        return self._obs(), reward, terminated, truncated, {}


ENVS = {
    "cartpole": lambda: gym.make("CartPole-v1", max_episode_steps=20),
    "image": ImageEnv,
    "dict": DictEnv,
}


# ------------------------------------------------------------------------------------------------
# The independent record
# ------------------------------------------------------------------------------------------------
def play(env: gym.Env, episodes: int, seed: int) -> list[dict]:
    """Run a seeded random policy for whole episodes; record what ``env`` returned (copies)."""
    env.action_space.seed(seed)
    out = []
    for k in range(episodes):
        obs, _ = env.reset(seed=seed + k)
        ep = {"obs": [copy.deepcopy(obs)], "actions": [], "rewards": []}
        while True:
            action = env.action_space.sample()
            obs, reward, terminated, truncated, _ = env.step(action)
            ep["actions"].append(copy.deepcopy(action))
            ep["rewards"].append(float(reward))
            ep["obs"].append(copy.deepcopy(obs))
            if terminated or truncated:
                ep["terminated"], ep["truncated"] = bool(terminated), bool(truncated)
                break
        out.append(ep)
    return out


def steps(env: gym.Env, n: int, seed: int) -> dict:
    """``n`` steps after a reset, recorded as by ``play`` (the episode must not end)."""
    env.action_space.seed(seed)
    obs, _ = env.reset(seed=seed)
    ep = {"obs": [copy.deepcopy(obs)], "actions": [], "rewards": []}
    for _ in range(n):
        action = env.action_space.sample()
        obs, reward, terminated, truncated, _ = env.step(action)
        assert not (terminated or truncated), "pick a seed whose episode is longer"
        ep["actions"].append(copy.deepcopy(action))
        ep["rewards"].append(float(reward))
        ep["obs"].append(copy.deepcopy(obs))
    return ep


def stacked(values: list) -> np.ndarray | dict[str, np.ndarray]:
    if isinstance(values[0], dict):
        return {k: np.stack([v[k] for v in values]) for k in values[0]}
    return np.stack([np.asarray(v) for v in values])


def assert_same(got, want, what: str) -> None:
    """Exact equality, dtype and shape included; dicts key by key."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), what
        for k in want:
            assert_same(got[k], want[k], f"{what}/{k}")
        return
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.array_equal(got, want), f"{what}: values differ"


def check_episode_arrays(observations, actions, rewards, ep: dict, what: str) -> None:
    assert_same(observations, stacked(ep["obs"]), f"{what} observations")
    assert_same(actions, stacked(ep["actions"]), f"{what} actions")
    assert_same(rewards, np.asarray(ep["rewards"], np.float64), f"{what} rewards")


def transitions(record: list[dict]) -> dict[str, np.ndarray]:
    """The buffer rows a recorder should write for ``record``, by field name."""
    rows: dict[str, list] = {}

    def put(name: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{name}/{k}", v)
        else:
            rows.setdefault(name, []).append(np.asarray(value))

    for ep in record:
        n = len(ep["actions"])
        for t in range(n):
            put("obs", ep["obs"][t])
            put("next_obs", ep["obs"][t + 1])
            put("action", ep["actions"][t])
            put("reward", np.float32(ep["rewards"][t]))
            last = t == n - 1
            put("terminated", last and ep.get("terminated", False))
            put("truncated", last and ep.get("truncated", False))
    return {k: np.stack(v) for k, v in rows.items()}


def buffer_rows(buf: ReplayBuffer, lane: int = 0) -> dict[str, np.ndarray]:
    return buf.get(np.arange(buf.committed(lane)), lane)


def check_rows(buf: ReplayBuffer, record: list[dict], lane: int = 0) -> dict[str, np.ndarray]:
    got = buffer_rows(buf, lane)
    want = transitions(record)
    assert set(got) <= set(want), sorted(got)
    for name in got:
        assert_same(got[name], want[name].astype(buf.spec[name].dtype), f"buffer {name}")
    return got


def buffer_for(env: gym.Env, capacity: int, **kwargs) -> ReplayBuffer:
    """A buffer with the fields ``Spec.from_spaces`` names for ``env``'s spaces."""
    spec = Spec.from_spaces(env.observation_space, env.action_space)
    return ReplayBuffer.create(spec, capacity=capacity, **kwargs)


# ------------------------------------------------------------------------------------------------
# Round trips
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(ENVS))
def test_directory_round_trip(tmp_path, kind):
    """Every episode is played back, in order, equal step by step to what the env returned:
    observations [N+1] with the reset one first, actions [N], rewards [N] and the end flags."""
    rec = RecordEpisodes(ENVS[kind](), tmp_path / "rec")
    record = play(rec, N_EPISODES, seed=11)
    rec.close()
    assert {ep["terminated"] for ep in record} == {True, False}, "seeds must give both ends"

    played = []
    assert scan_episodes(tmp_path / "rec", lambda o, a, r: played.append((o, a, r))) == N_EPISODES
    for k, (ep, (o, a, r)) in enumerate(zip(record, played)):
        check_episode_arrays(o, a, r, ep, f"episode {k}")

    files = list(iter_episodes(tmp_path / "rec"))
    assert [os.path.basename(f["path"]) for f in files] == [
        f"episode-{k:06d}.npz" for k in range(N_EPISODES)
    ]
    for k, (ep, f) in enumerate(zip(record, files)):
        assert f["terminated"] == ep["terminated"] and f["truncated"] == ep["truncated"]
        assert f["complete"] is True and f["episode_index"] == k
        assert f["length"] == len(ep["actions"])
        assert "observation_steps" not in f
    assert rec.episodes_recorded == N_EPISODES
    assert rec.steps_recorded == sum(len(ep["actions"]) for ep in record)
    assert rec.episode_lengths == [len(ep["actions"]) for ep in record]
    assert rec.episode_returns == [sum(ep["rewards"]) for ep in record]
    assert not [p for p in os.listdir(tmp_path / "rec") if p.startswith(".")], "temp files left"


@pytest.mark.parametrize("kind", list(ENVS))
def test_buffer_round_trip(tmp_path, kind):
    """The same seeds into a ReplayBuffer (spec from Spec.from_spaces; Dict observations as
    obs/<key>): the same episodes as the directory run, and each stored transition is (obs_t,
    action_t, reward_t, obs_t+1) with terminated/truncated set only on an episode's last row."""
    rec_dir = RecordEpisodes(ENVS[kind](), tmp_path / "rec")
    record_dir = play(rec_dir, N_EPISODES, seed=11)
    rec_dir.close()

    env = ENVS[kind]()
    spec = Spec.from_spaces(env.observation_space, env.action_space)
    if kind == "dict":
        assert {"obs/image", "obs/vector", "next_obs/image", "next_obs/vector"} <= set(spec)
    with ReplayBuffer.create(spec, capacity=4096) as buf:
        rec = RecordEpisodes(env, buf)
        assert rec.lane == 0
        record = play(rec, N_EPISODES, seed=11)
        rec.close()
        for a, b in zip(record, record_dir):  # same seeds, same episodes
            check_episode_arrays(stacked(a["obs"]), stacked(a["actions"]),
                                 np.asarray(a["rewards"]), b, "rerun")

        got = check_rows(buf, record)
        assert len(got["reward"]) == sum(len(ep["actions"]) for ep in record)
        # next_obs of step t is obs of step t+1 inside an episode, and only there.
        obs_names = [n for n in spec if n.startswith("obs")]
        starts = np.cumsum([0] + [len(ep["actions"]) for ep in record])
        for t in range(len(got["reward"]) - 1):
            same = all(np.array_equal(got["next_" + n][t], got[n][t + 1]) for n in obs_names)
            assert same == (t + 1 not in starts), f"row {t}"
        ends = starts[1:] - 1
        assert (got["terminated"] | got["truncated"]).nonzero()[0].tolist() == ends.tolist()
        assert buf.stats()["per_lane"][0]["episode"] == N_EPISODES  # end_episode per episode
        with buf.writer(lane=0, timeout=0):  # close() released the lane
            pass


def test_recording_without_frames_into_a_buffer():
    """A buffer whose spec lacks obs/next_obs records actions, rewards and flags only."""
    env = ImageEnv()
    full = Spec.from_spaces(env.observation_space, env.action_space)
    spec = Spec({n: f for n, f in full.items() if not n.endswith("obs")})
    assert set(spec) == {"action", "reward", "terminated", "truncated"}
    with ReplayBuffer.create(spec, capacity=1024) as buf:
        with RecordEpisodes(env, buf) as rec:
            record = play(rec, 3, seed=5)
        check_rows(buf, record)


class TupleEnv(gym.Env):
    """Tuple observations (a vector and a Discrete) and Dict actions, nested one level."""

    metadata = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Tuple(
            (spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(5))
        )
        self.action_space = spaces.Dict(
            {"move": spaces.Discrete(3), "aim": spaces.Dict({"xy": spaces.Box(-1, 1, (2,))})}
        )

    def _obs(self):
        rng = np.random.default_rng([self._seed, self._t])
        return (rng.uniform(-1, 1, 3).astype(np.float32), np.int64(rng.integers(5)))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._seed, self._t = int(self.np_random.integers(2**31)), 0
        return self._obs(), {}

    def step(self, action):
        self._t += 1
        return self._obs(), float(action["move"]), self._t >= 4, False, {}


def test_tuple_observations_and_nested_dict_actions(tmp_path):
    """Tuple observations play back as tuples, nested Dict actions as nested dicts; into a
    buffer they go to the fields Spec.from_spaces names (obs/0, action/aim/xy, ...)."""
    with RecordEpisodes(TupleEnv(), tmp_path) as rec:
        record = play(rec, 2, seed=1)
    for ep, f in zip(record, iter_episodes(tmp_path)):
        obs = f["observations"]
        assert isinstance(obs, tuple) and len(obs) == 2
        assert_same(obs[0], np.stack([o[0] for o in ep["obs"]]), "obs/0")
        assert_same(obs[1], np.stack([o[1] for o in ep["obs"]]), "obs/1")
        assert_same(f["actions"]["move"], np.stack([a["move"] for a in ep["actions"]]), "move")
        assert_same(f["actions"]["aim"]["xy"], np.stack([a["aim"]["xy"] for a in ep["actions"]]),
                    "aim/xy")
    env = TupleEnv()
    with buffer_for(env, capacity=64, lanes=2) as buf:
        with RecordEpisodes(env, buf, lane=1) as rec:
            assert rec.lane == 1
            record = play(rec, 2, seed=1)
        got = buffer_rows(buf, lane=1)
        want_obs0 = np.stack([o[0] for ep in record for o in ep["obs"][:-1]])
        want_xy = np.stack([a["aim"]["xy"] for ep in record for a in ep["actions"]])
        assert_same(got["obs/0"], want_obs0, "obs/0")
        assert_same(got["action/aim/xy"], want_xy.astype(np.float32), "action/aim/xy")
        assert buf.committed(0) == 0


def test_closing_the_buffer_before_the_recorder():
    """close() after the buffer (and so the lane's writer) was closed does not raise."""
    env = ImageEnv(max_steps=100)
    buf = buffer_for(env, capacity=64)
    rec = RecordEpisodes(env, buf)
    steps(rec, 2, seed=99)
    buf.close()
    rec.close()
    assert env.closes == 1 and rec.episodes_recorded == 1


# ------------------------------------------------------------------------------------------------
# Filters, drop, counting
# ------------------------------------------------------------------------------------------------
def test_episode_filter_every_second_episode(tmp_path):
    """Only episodes 0, 2, 4 are written, numbered files 0..2, each holding that episode and
    its episode_index; counters count recorded episodes, episodes_seen all of them."""
    rec = RecordEpisodes(ImageEnv(), tmp_path, episode_filter=lambda i: i % 2 == 0)
    record = play(rec, N_EPISODES, seed=3)
    rec.close()
    files = list(iter_episodes(tmp_path))
    assert [f["episode_index"] for f in files] == [0, 2, 4]
    for f, k in zip(files, [0, 2, 4]):
        check_episode_arrays(f["observations"], f["actions"], f["rewards"], record[k], f"ep {k}")
    assert rec.episodes_recorded == 3 and rec.episodes_seen == N_EPISODES
    assert rec.steps_recorded == sum(len(record[k]["actions"]) for k in (0, 2, 4))


def test_episode_filter_into_a_buffer():
    env = ImageEnv()
    with buffer_for(env, capacity=1024) as buf:
        with RecordEpisodes(env, buf, episode_filter=lambda i: i % 2 == 1) as rec:
            record = play(rec, N_EPISODES, seed=3)
        check_rows(buf, [record[1], record[3], record[5]])
        assert buf.stats()["per_lane"][0]["episode"] == 3


def test_frame_filter_keeps_chosen_observations(tmp_path):
    """observation_steps lists the kept steps (0 = reset); observations hold exactly those
    frames; actions and rewards stay whole."""
    rec = RecordEpisodes(ImageEnv(), tmp_path, frame_filter=lambda t: t % 3 == 0)
    record = play(rec, 4, seed=7)
    rec.close()
    for ep, f in zip(record, iter_episodes(tmp_path)):
        n = len(ep["actions"])
        kept = np.arange(0, n + 1, 3)
        assert_same(f["observation_steps"], kept.astype(np.int64), "observation_steps")
        assert_same(f["observations"], stacked(ep["obs"])[kept], "observations")
        assert_same(f["actions"], stacked(ep["actions"]), "actions")
        assert f["length"] == n


def test_frame_filter_keeping_nothing(tmp_path):
    with RecordEpisodes(DictEnv(), tmp_path, frame_filter=lambda t: False) as rec:
        play(rec, 1, seed=1)
    (f,) = iter_episodes(tmp_path)
    assert f["observation_steps"].shape == (0,)
    assert f["observations"]["image"].shape == (0, 16, 16, 3)
    assert f["observations"]["image"].dtype == np.uint8


@pytest.mark.parametrize("drop", [("observations",), "observations", ["actions", "rewards"]])
def test_drop(tmp_path, drop):
    """Dropped arrays are absent from the files and None in scan_episodes; the rest is whole."""
    names = {drop} if isinstance(drop, str) else set(drop)
    with RecordEpisodes(ImageEnv(), tmp_path, drop=drop) as rec:
        record = play(rec, 3, seed=2)
    played = []
    assert scan_episodes(tmp_path, lambda o, a, r: played.append((o, a, r))) == 3
    for ep, (o, a, r), f in zip(record, played, iter_episodes(tmp_path)):
        assert (o is None) == ("observations" in names) == ("observations" not in f)
        assert (a is None) == ("actions" in names)
        assert (r is None) == ("rewards" in names)
        if o is not None:
            assert_same(o, stacked(ep["obs"]), "observations")
        if a is not None:
            assert_same(a, stacked(ep["actions"]), "actions")
        if r is not None:
            assert_same(r, np.asarray(ep["rewards"]), "rewards")
        assert f["length"] == len(ep["actions"])
    with np.load(rec.files[0]) as z:
        assert not any(k.split("/")[0] in names for k in z.files)


def test_count_only_recorder():
    """target=None stores nothing and counts steps, episodes, lengths and returns."""
    with RecordEpisodes(gym.make("CartPole-v1"), None, episode_filter=lambda i: i != 1) as rec:
        record = play(rec, 4, seed=0)
        assert rec.files == [] and rec.lane is None
    kept = [record[k] for k in (0, 2, 3)]
    assert rec.episodes_recorded == 3 and rec.episodes_seen == 4
    assert rec.steps_recorded == sum(len(ep["actions"]) for ep in kept)
    assert rec.episode_lengths == [len(ep["actions"]) for ep in kept]
    assert rec.episode_returns == [sum(ep["rewards"]) for ep in kept]


# ------------------------------------------------------------------------------------------------
# Cut-short episodes, close, order of calls
# ------------------------------------------------------------------------------------------------
def test_close_flushes_partial_episode(tmp_path):
    """close() writes the episode in progress (complete=False, truncated=True), closes the env
    once, and is idempotent; the recorder refuses use afterwards."""
    env = ImageEnv(max_steps=100)
    rec = RecordEpisodes(env, tmp_path)
    record = play(rec, 2, seed=4)
    record.append(steps(rec, 2, seed=99))
    rec.close()
    rec.close()
    assert env.closes == 1
    files = list(iter_episodes(tmp_path))
    assert len(files) == 3 and rec.episodes_recorded == 3
    last = files[-1]
    assert (last["complete"], last["truncated"], last["terminated"]) == (False, True, False)
    assert last["length"] == 2 and last["observations"].shape == (3, 64, 64, 3)
    check_episode_arrays(last["observations"], last["actions"], last["rewards"], record[2], "cut")
    assert all(f["complete"] for f in files[:2])
    with pytest.raises(ClosedError):
        rec.reset()
    with pytest.raises(ClosedError):
        rec.step(0)


def test_close_ends_partial_episode_in_buffer():
    env = ImageEnv(max_steps=100)
    with buffer_for(env, capacity=1024) as buf:
        with RecordEpisodes(env, buf) as rec:
            record = play(rec, 1, seed=4)
            record.append(steps(rec, 2, seed=99))
        assert env.closes == 1
        check_rows(buf, record)  # the cut episode's last row keeps the env's flags (False)
        assert buf.stats()["per_lane"][0]["episode"] == 2
        assert not buf.closed  # the recorder releases its lane, not the buffer
        with buf.writer(lane=0, timeout=0):
            pass


def test_reset_mid_episode(tmp_path):
    """A reset mid-episode records the partial episode as cut short; a reset straight after a
    reset makes no empty episode and uses no episode index."""
    rec = RecordEpisodes(ImageEnv(max_steps=100), tmp_path)
    partial = steps(rec, 3, seed=99)
    rec.reset(seed=1)
    record = play(rec, 1, seed=8)
    rec.close()
    files = list(iter_episodes(tmp_path))
    assert len(files) == 2 and rec.episodes_seen == 2
    assert (files[0]["complete"], files[0]["truncated"], files[0]["episode_index"]) == (
        False, True, 0)
    check_episode_arrays(files[0]["observations"], files[0]["actions"], files[0]["rewards"],
                         partial, "cut")
    assert files[1]["complete"] and files[1]["episode_index"] == 1
    check_episode_arrays(files[1]["observations"], files[1]["actions"], files[1]["rewards"],
                         record[0], "next")


def test_reset_mid_episode_into_buffer():
    env = ImageEnv(max_steps=100)
    with buffer_for(env, capacity=1024) as buf:
        with RecordEpisodes(env, buf) as rec:
            partial = steps(rec, 3, seed=99)
            record = play(rec, 1, seed=8)
        got = check_rows(buf, [partial, *record])
        # The new episode's first obs is its reset observation, not the cut one's last.
        assert not np.array_equal(got["next_obs"][2], got["obs"][3])
        assert buf.stats()["per_lane"][0]["episode"] == 2


def test_step_needs_reset(tmp_path):
    from gymnasium.error import ResetNeeded

    with RecordEpisodes(ImageEnv(), tmp_path) as rec:
        with pytest.raises(ResetNeeded, match="reset"):
            rec.step(0)
        play(rec, 1, seed=0)
        with pytest.raises(ResetNeeded, match="end"):
            rec.step(0)
    assert len(rec.files) == 1


def test_wrapper_is_a_gymnasium_wrapper(tmp_path):
    env = gym.make("CartPole-v1")
    with RecordEpisodes(env, None) as rec:
        assert isinstance(rec, gym.Wrapper) and isinstance(rec, RecordEpisodes)
        assert rec.observation_space == env.observation_space
        assert rec.unwrapped is env.unwrapped
        with pytest.raises(TypeError, match="pickled"):
            __import__("pickle").dumps(rec)
    with pytest.raises(TypeError, match="gymnasium.Env"):
        RecordEpisodes(object(), None)


def test_recorders_sharing_a_directory_never_overwrite(tmp_path):
    """Two recorders on one directory, and a third started later, write distinct files; the
    later one continues the numbering."""
    a = RecordEpisodes(ImageEnv(), tmp_path)
    b = RecordEpisodes(ImageEnv(), tmp_path)
    ra = play(a, 2, seed=20)
    rb = play(b, 2, seed=40)
    a.close()
    b.close()
    with RecordEpisodes(ImageEnv(), tmp_path) as c:
        rc = play(c, 1, seed=60)
    assert [p.name for p in c.files] == ["episode-000004.npz"]
    got = [f["observations"] for f in iter_episodes(tmp_path)]
    assert len(got) == 5
    for ep in [*ra, *rb, *rc]:
        assert sum(np.array_equal(g, stacked(ep["obs"])) for g in got) == 1


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
def _damage_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _damage_garbage(path):
    path.write_bytes(b"\x00garbage" * 100)


def _damage_empty(path):
    path.write_bytes(b"")


def _damage_foreign(path):
    with open(path, "wb") as f:
        np.savez(f, observations=np.zeros(3))


def _damage_inconsistent(path):
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["actions"] = arrays["actions"][:-1]
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _damage_flipped_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside the frames: the zip CRC catches it
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [_damage_truncate, _damage_garbage, _damage_empty, _damage_foreign, _damage_inconsistent,
     _damage_flipped_byte],
)
def test_corrupt_file_raises_checkpoint_error(tmp_path, damage):
    with RecordEpisodes(ImageEnv(), tmp_path) as rec:
        play(rec, 3, seed=1)
    damage(rec.files[1])
    with pytest.raises(CheckpointError, match="episode-000001.npz"):
        list(iter_episodes(tmp_path))
    seen = []
    with pytest.raises(CheckpointError, match="episode-000001.npz"):
        scan_episodes(tmp_path, lambda o, a, r: seen.append(o))
    assert len(seen) == 1  # the episodes before the damaged one were played


def test_spec_mismatch_at_construction():
    """A field the recorder cannot fill, a missing required one, or a wrong shape is an error
    naming the field and Spec.from_spaces, raised before a lane is taken."""
    env = ImageEnv()
    good = Spec.from_spaces(env.observation_space, env.action_space)
    cases = {
        "'done'": Spec({**good, "done": ((), "bool")}),
        "'reward'": Spec({n: f for n, f in good.items() if n != "reward"}),
        "'obs'": Spec({**good, "obs": ((84, 84, 3), "uint8")}),
        "'next_obs'": Spec({**good, "next_obs": ((64, 64, 3), "bool")}),
    }
    for needle, spec in cases.items():
        with ReplayBuffer.create(spec, capacity=16) as buf:
            with pytest.raises(SpecMismatchError, match=needle) as info:
                RecordEpisodes(env, buf)
            assert "Spec.from_spaces" in str(info.value)
            with buf.writer(lane=0, timeout=0):  # no lane was taken
                pass


def test_invalid_arguments(tmp_path):
    env = ImageEnv()
    with buffer_for(env, capacity=16) as buf:
        with pytest.raises(ValueError, match="frame_filter applies to directory targets"):
            RecordEpisodes(env, buf, frame_filter=lambda t: True)
        with pytest.raises(ValueError, match="drop applies to directory targets"):
            RecordEpisodes(env, buf, drop=("observations",))
        with buf.writer(lane=0, timeout=0):
            pass
    with pytest.raises(ValueError, match="frame_filter applies"):
        RecordEpisodes(env, None, frame_filter=lambda t: True)
    with pytest.raises(ValueError, match="unknown name"):
        RecordEpisodes(env, tmp_path, drop=("frames",))
    with pytest.raises(ValueError, match="one or the other"):
        RecordEpisodes(env, tmp_path, drop="observations", frame_filter=lambda t: True)
    with pytest.raises(TypeError, match="ReplayBuffer, a directory"):
        RecordEpisodes(env, 42)
    with pytest.raises(TypeError, match="episode_filter"):
        RecordEpisodes(env, None, episode_filter=3)
    with pytest.raises(FileNotFoundError, match="no recording directory"):
        scan_episodes(tmp_path / "missing", print)
    assert scan_episodes(tmp_path, print) == 0


# ------------------------------------------------------------------------------------------------
# Without gymnasium
# ------------------------------------------------------------------------------------------------
def test_import_and_playback_without_gymnasium(tmp_path):
    """``import shmbuf`` neither needs nor imports gymnasium; playback works without it, and
    creating a recorder says how to install it."""
    with RecordEpisodes(DictEnv(), tmp_path) as rec:
        record = play(rec, 2, seed=0)
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["gymnasium"] = None  # any import of gymnasium now raises ImportError
        import shmbuf
        from shmbuf import RecordEpisodes, iter_episodes, scan_episodes
        assert sys.modules["gymnasium"] is None
        lengths = []
        n = scan_episodes({str(tmp_path)!r}, lambda o, a, r: lengths.append(
            (len(o["image"]), len(a), len(r))))
        print(n, lengths)
        try:
            RecordEpisodes(object(), None)
        except ImportError as e:
            assert "pip install" in str(e) and "gymnasium" in str(e), e
            print("import error ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    n = [len(ep["actions"]) for ep in record]
    assert out.stdout.splitlines() == [f"2 {[(k + 1, k, k) for k in n]}", "import error ok"]

    fresh = subprocess.run(
        [sys.executable, "-c", "import sys, shmbuf; print('gymnasium' in sys.modules)"],
        capture_output=True, text=True, timeout=60,
    )
    assert fresh.stdout.strip() == "False", fresh.stderr
    assert shmbuf.RecordEpisodes is RecordEpisodes
