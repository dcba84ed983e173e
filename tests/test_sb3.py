"""``shmbuf.integrations.sb3``: same inputs, same rows out as SB3's own ReplayBuffer; SB3's
algorithms train with it unchanged; seeding, save/load, reset and the sb3 Spec layout.

Skipped without stable-baselines3 (the ``sb3`` extra; CI installs it).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

sb3 = pytest.importorskip("stable_baselines3")
th = pytest.importorskip("torch")
gym = pytest.importorskip("gymnasium")

from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.buffers import DictReplayBuffer as Sb3DictReplayBuffer  # noqa: E402
from stable_baselines3.common.buffers import ReplayBuffer as Sb3ReplayBuffer  # noqa: E402
from stable_baselines3.common.logger import Logger  # noqa: E402

import shmbuf  # noqa: E402
from shmbuf.integrations.sb3 import DictReplayBuffer, ReplayBuffer  # noqa: E402
from workers.config import Workers  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Small networks train faster (and alike) on one thread; restored afterwards."""
    before = th.get_num_threads()
    th.set_num_threads(1)
    yield
    th.set_num_threads(before)


@pytest.fixture(autouse=True)
def no_sb3_log_folders_left(tmp_path, monkeypatch):
    """A model that learns with no logger of its own makes a ``SB3-<date>`` folder in the temp
    directory and leaves it there: every model here gets ``silent_logger`` instead. SB3 makes its
    default folder at ``$SB3_LOGDIR`` when that is set: a private path no test should create (so
    other sessions' folders in /tmp cannot fail this check)."""
    default_folder = tmp_path / "sb3_default_log_folder"
    monkeypatch.setenv("SB3_LOGDIR", str(default_folder))
    yield
    assert not default_folder.exists(), "a model logged to SB3's default folder: use silent_logger"


def silent_logger(model):
    """``model`` with a logger that has no folder and no outputs (SB3's default makes a folder)."""
    model.set_logger(Logger(folder=None, output_formats=[]))
    return model


def feed(buffers, obs_space, act_space, n_envs, steps, seed=0):
    """The same random transitions (with dones and time limits) into every buffer."""
    rng = np.random.default_rng(seed)
    obs_space.seed(seed)
    act_space.seed(seed)

    def batch(space):
        if isinstance(space, spaces.Dict):
            return {k: np.stack([s.sample() for _ in range(n_envs)]) for k, s in space.items()}
        return np.stack([space.sample() for _ in range(n_envs)])

    obs = batch(obs_space)
    for _ in range(steps):
        next_obs, action = batch(obs_space), batch(act_space)
        reward = rng.normal(size=n_envs).astype(np.float32)
        done = rng.random(n_envs) < 0.1
        infos = [{"TimeLimit.truncated": bool(d and rng.random() < 0.5)} for d in done]
        for b in buffers:
            b.add(obs, next_obs, action, reward, done, infos)
        obs = batch(obs_space)  # auto-reset or not: a fresh observation either way


def assert_same_samples(ours, theirs, batch_size=64, rounds=5):
    for r in range(rounds):
        np.random.seed(r)
        a = ours.sample(batch_size)
        np.random.seed(r)
        b = theirs.sample(batch_size)
        for name, x, y in zip(a._fields, a, b):
            if x is None or y is None:  # SB3's optional fields (n-step discounts)
                assert x is y is None, name
            elif isinstance(x, dict):
                for k in x:
                    assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, (name, k)
                    assert th.equal(x[k], y[k]), (name, k)
            else:
                assert x.dtype == y.dtype and x.shape == y.shape, (name, x.shape, y.shape)
                assert th.equal(x, y), name


@pytest.mark.parametrize("n_envs", [1, 2])
@pytest.mark.parametrize("spaces_", ["box", "discrete", "image"])
def test_same_transitions_in_same_rows_out(n_envs, spaces_):
    """Fed the same transitions (past a wrap of the ring), our buffer and SB3's return identical
    batches for the same NumPy seed: same indices, same values, dtypes and shapes."""
    obs_space, act_space = {
        "box": (spaces.Box(-1, 1, (3,), np.float32), spaces.Box(-2, 2, (2,), np.float64)),
        "discrete": (spaces.Discrete(7), spaces.Discrete(3)),
        "image": (spaces.Box(0, 255, (3, 8, 8), np.uint8), spaces.MultiDiscrete([3, 4])),
    }[spaces_]
    ours = ReplayBuffer(100, obs_space, act_space, device="cpu", n_envs=n_envs)
    theirs = Sb3ReplayBuffer(100, obs_space, act_space, device="cpu", n_envs=n_envs)
    try:
        for steps in (30, 90):  # not full yet, then wrapped
            feed([ours, theirs], obs_space, act_space, n_envs, steps, seed=steps)
            assert (ours.pos, ours.full, ours.size()) == (theirs.pos, theirs.full, theirs.size())
            assert_same_samples(ours, theirs)
    finally:
        ours.close()


def test_dict_observations_same_rows_out():
    obs_space = spaces.Dict(pos=spaces.Box(-1, 1, (2,), np.float32), k=spaces.Discrete(4))
    act_space = spaces.Box(-1, 1, (1,), np.float32)
    ours = DictReplayBuffer(50, obs_space, act_space, device="cpu", n_envs=2)
    theirs = Sb3DictReplayBuffer(50, obs_space, act_space, device="cpu", n_envs=2)
    try:
        feed([ours, theirs], obs_space, act_space, 2, 40)
        assert_same_samples(ours, theirs)
    finally:
        ours.close()
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        DictReplayBuffer(50, obs_space, act_space, optimize_memory_usage=True)


def test_timeouts_kept_and_handled():
    """done and info["TimeLimit.truncated"] are both stored; sampled dones drop time limits
    only with handle_timeout_termination, as in SB3."""
    obs_space, act_space = spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(2)
    for handle in (True, False):
        buf = ReplayBuffer(10, obs_space, act_space, device="cpu",
                           handle_timeout_termination=handle)
        try:
            o = np.zeros((1, 2), np.float32)
            buf.add(o, o, np.array([1]), np.array([1.0]), np.array([True]),
                    [{"TimeLimit.truncated": True}])
            row = buf.shared.get([0], [0])
            assert row["done"][0, 0] == 1.0 and row["truncated"][0, 0] == float(handle)
            assert buf.sample(4).dones.flatten().tolist() == [0.0 if handle else 1.0] * 4
            episodes = buf.shared.episodes()
            assert episodes["truncated"].tolist() == [handle]
        finally:
            buf.close()


def test_optimize_memory_usage_derives_next_obs_and_keeps_final_obs():
    """optimize_memory_usage stores obs once; every sampled next_obs is the true one, the final
    observation of an episode too (SB3's own buffer loses it); with time limits handled."""
    obs_space, act_space = spaces.Box(-100, 100, (1,), np.float32), spaces.Discrete(2)
    buf = ReplayBuffer(128, obs_space, act_space, device="cpu", n_envs=2,
                       optimize_memory_usage=True, handle_timeout_termination=True)
    try:
        t = np.zeros(2, np.float32)
        for step in range(30):
            done = np.array([step % 7 == 6, step % 5 == 4])
            nxt = t + 1  # next_obs is obs + 1, the final one of an episode included
            buf.add(t[:, None], nxt[:, None], np.array([0, 1]), np.ones(2, np.float32), done,
                    [{"TimeLimit.truncated": bool(d)} for d in done])
            t = np.where(done, 100 * (step + 1), nxt)  # a reset jumps
        assert len(buf) == 60 and buf.size() == 30  # transitions, not rows with final obs
        np.random.seed(0)
        s = buf.sample(512)
        assert th.equal(s.next_observations, s.observations + 1)
        assert s.dones.sum() == 0  # every done here is a time limit
        assert not buf.dones.any()  # SB3's resume hook writes into a scratch array
    finally:
        buf.close()


def test_save_load_round_trip_and_reset(tmp_path):
    """Pickling stores the contents (SB3's save_replay_buffer); loading makes a new segment
    that samples the same batches; reset() empties the buffer while its writer is open."""
    obs_space, act_space = spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(3)
    ours = ReplayBuffer(40, obs_space, act_space, device="cpu", n_envs=2)
    copy = None
    try:
        feed([ours], obs_space, act_space, 2, 30)
        data = pickle.dumps(ours)
        copy = pickle.loads(data)
        assert copy.shared.name != ours.shared.name and (copy.pos, copy.full) == (ours.pos, True)
        assert_same_samples(copy, ours)
        feed([ours, copy], obs_space, act_space, 2, 5, seed=9)  # both keep writing alike
        assert_same_samples(copy, ours)
        ours.reset()
        assert len(ours) == 0 and ours.size() == 0
        with pytest.raises(shmbuf.EmptyBufferError):
            ours.sample(4)
        feed([ours], obs_space, act_space, 2, 3)
        assert len(ours) == 6
    finally:
        ours.close()
        if copy is not None:
            copy.close()


def _dqn(buffer_class, **kw):
    return silent_logger(sb3.DQN(
        "MlpPolicy", "CartPole-v1", buffer_size=2_000, learning_starts=100, train_freq=4,
        batch_size=32, seed=0, policy_kwargs={"net_arch": [32]}, replay_buffer_class=buffer_class,
        **kw))


def test_dqn_cartpole_trains_identically_to_sb3s_buffer(tmp_path):
    """DQN on CartPole-v1 with our buffer ends with exactly the weights SB3's own buffer gives
    (same seed: same batches), and save/load_replay_buffer round-trips it."""
    ours = _dqn(ReplayBuffer)  # each made and trained in turn: both seed NumPy's global RNG
    try:
        ours.learn(600)
        theirs = _dqn(None).learn(600)
        for a, b in zip(ours.policy.parameters(), theirs.policy.parameters()):
            assert th.equal(a, b)
        ours.save_replay_buffer(tmp_path / "rb.pkl")
        before = ours.replay_buffer
        ours.load_replay_buffer(tmp_path / "rb.pkl")
        assert isinstance(ours.replay_buffer, ReplayBuffer) and ours.replay_buffer is not before
        assert len(ours.replay_buffer) == len(before) == 600
        before.close()
        ours.learn(200, reset_num_timesteps=False)
        assert len(ours.replay_buffer) == 800
    finally:
        ours.replay_buffer.close()


def test_seeded_runs_reproduce_with_derived_next_obs():
    """With optimize_memory_usage (our own generator, seeded from SB3's seed) two runs match."""
    runs = []
    for _ in range(2):
        model = _dqn(ReplayBuffer, optimize_memory_usage=True,
                     replay_buffer_kwargs={"handle_timeout_termination": True})
        try:
            model.learn(400)
            runs.append([p.detach().clone() for p in model.policy.parameters()])
        finally:
            model.replay_buffer.close()
    assert all(th.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("algo", ["SAC", "TD3", "DDPG"])
def test_continuous_control_trains_with_two_envs(algo):
    from stable_baselines3.common.env_util import make_vec_env

    env = make_vec_env("Pendulum-v1", n_envs=2, seed=0)
    model = getattr(sb3, algo)("MlpPolicy", env, buffer_size=1_000, learning_starts=50,
                               batch_size=32, seed=0, policy_kwargs={"net_arch": [16]},
                               replay_buffer_class=ReplayBuffer)
    silent_logger(model)
    try:
        model.learn(200)
        assert len(model.replay_buffer) == 200 and model.replay_buffer.size() == 100
        assert model.replay_buffer.shared.spec["action"].dtype == np.float32
    finally:
        model.replay_buffer.close()


@pytest.mark.parametrize("start_method,optimize", [
    ("fork", False), ("forkserver", False), ("spawn", False), ("fork", True)])
def test_prefetch_pool_delivers_owned_tensors(start_method, optimize):
    """prefetch=N starts a SamplerPool on the first sample(batch_size); batches are tensors the
    caller owns (they outlive the next batch) and every row is one that was added."""
    obs_space, act_space = spaces.Box(-1000, 1000, (2,), np.float32), spaces.Discrete(5)
    buf = ReplayBuffer(64, obs_space, act_space, device="cpu", n_envs=2, prefetch=1,
                       prefetch_kwargs={"workers": Workers(start_method=start_method)},
                       optimize_memory_usage=optimize)
    try:
        for i in range(20):
            o = np.array([[i, 0], [i, 1]], np.float32)
            buf.add(o, o + 1, np.array([i % 5, i % 5]), np.full(2, i, np.float32),
                    np.full(2, i % 6 == 5), [{}, {}])  # episodes end (final obs rows)
        first = buf.sample(16)
        second = buf.sample(16)
        for s in (first, second):
            assert s.observations.shape == (16, 2) and s.rewards.shape == (16, 1)
            assert th.equal(s.next_observations, s.observations + 1)
            assert th.equal(s.rewards[:, 0], s.observations[:, 0])
        kept = first.observations.clone()
        buf.sample(16)
        assert th.equal(first.observations, kept)  # ours, not a staging slot's view
        assert buf.sample(8).observations.shape == (8, 2)  # a new batch size restarts the pool
    finally:
        buf.close()


def test_prefetch_kwargs_go_to_the_pool_as_given_with_prefetch_processes():
    """``prefetch_kwargs`` reach ``SamplerPool`` as the user gave them; ``prefetch`` is the
    process count, in whichever spelling they use (``workers=Workers(...)`` gets ``n``; the
    earlier releases' worker keywords get ``n_workers``, so the pool's shim combines them). A
    count given twice is refused when the buffer is made, before any sample."""
    from shmbuf.integrations.sb3 import _prefetch_options

    assert _prefetch_options(2, {"timeout": 5.0}) == {"timeout": 5.0, "workers": 2}
    given = {"workers": Workers(staging=6, start_method="spawn")}
    assert _prefetch_options(2, given) == {"workers": Workers(2, staging=6, start_method="spawn")}
    assert given == {"workers": Workers(staging=6, start_method="spawn")}  # not changed
    assert _prefetch_options(2, {"start_method": "spawn"}) == {"start_method": "spawn",
                                                                "n_workers": 2}
    with pytest.raises(ValueError, match=r"workers=Workers\(n=3.*prefetch=2.*without n"):
        _prefetch_options(2, {"workers": Workers(3)})
    with pytest.raises(ValueError, match=r"workers=3: .*prefetch=2"):
        ReplayBuffer(64, spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(5), device="cpu",
                     prefetch=2, prefetch_kwargs={"workers": 3})
    with pytest.raises(TypeError, match="drop n_workers"):
        _prefetch_options(2, {"n_workers": 3})


def test_spec_from_spaces_sb3_layout():
    spec = shmbuf.Spec.from_spaces(spaces.Discrete(5), spaces.Box(-1, 1, (2, 2), np.float64),
                                   layout="sb3")
    assert list(spec) == ["obs", "next_obs", "action", "reward", "done", "truncated"]
    assert spec["obs"].shape == (1,) and spec["action"] == ("action", (4,), np.float32)
    assert spec["reward"].shape == spec["done"].shape == (1,)
    assert spec["done"].dtype == spec["truncated"].dtype == np.float32
    assert shmbuf.Spec.from_spaces(spaces.Box(0, 1, (3,)), spaces.Discrete(2),
                                   layout="sb3")["action"].shape == (1,)
    with pytest.raises(ValueError, match="layout"):
        shmbuf.Spec.from_spaces(spaces.Discrete(5), spaces.Discrete(2), layout="cleanrl")


def test_derived_next_obs_ends_an_episode_where_observations_do_not_chain():
    """optimize_memory_usage: a step whose obs is not the last next_obs (a resumed learn(), a
    swapped env) ends the open episode as truncated, so no next_obs crosses the jump."""
    obs_space, act_space = spaces.Box(-1e6, 1e6, (1,), np.float32), spaces.Discrete(2)
    buf = ReplayBuffer(64, obs_space, act_space, device="cpu", optimize_memory_usage=True)
    try:
        one = np.ones(1, np.float32)
        for start in (0.0, 1000.0):  # the second run starts elsewhere, without a done
            for t in range(5):
                o = np.array([[start + t]], np.float32)
                buf.add(o, o + 1, np.array([0]), one, np.array([False]), [{}])
        episodes = buf.shared.episodes()
        assert episodes["length"].tolist() == [5] and episodes["truncated"].tolist() == [True]
        np.random.seed(0)
        s = buf.sample(256)
        assert th.equal(s.next_observations, s.observations + 1)
    finally:
        buf.close()
