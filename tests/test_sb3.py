"""``shmbuf.integrations.sb3``: same inputs, same rows out as SB3's own ReplayBuffer; SB3's
algorithms train with it unchanged; seeding, save/load, reset and the sb3 Spec layout.

Skipped without stable-baselines3 (the ``sb3`` extra; CI installs it).
"""

from __future__ import annotations

import pickle
import time

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
        dones = np.array([[s % 7 == 6, s % 5 == 4] for s in range(30)], np.float32)
        assert np.array_equal(buf.dones[:30], dones) and not buf.dones[30:].any()
        assert np.array_equal(buf.timeouts[:30], dones)  # SB3's layout, at SB3's positions
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


# -- SB3's attributes: SB3's layout at SB3's positions, read-only ------------------------------
def _assert_same_layout(ours, theirs, upto=None):
    """Every SB3 attribute of ``ours`` equals SB3's array, for the positions below ``upto``."""
    rows = slice(None, upto)
    names = ["actions", "rewards", "dones", "timeouts", "observations"]
    if not ours.optimize_memory_usage:
        names.append("next_observations")
    for name in names:
        a, b = getattr(ours, name), getattr(theirs, name)
        pairs = [(a[k], b[k]) for k in b] if isinstance(b, dict) else [(a, b)]
        for x, y in pairs:
            assert x.shape == y.shape and x.dtype == y.dtype, (name, x.shape, y.shape)
            assert np.array_equal(np.asarray(x)[rows], y[rows]), name


@pytest.mark.parametrize("n_envs", [1, 2])
@pytest.mark.parametrize("spaces_", ["box", "discrete", "image", "dict"])
def test_attributes_are_sb3s_arrays_at_sb3s_positions(n_envs, spaces_):
    """Fed the same transitions, ``.observations``, ``.next_observations``, ``.actions``,
    ``.rewards``, ``.dones``, ``.timeouts``, ``.pos`` and ``.full`` equal SB3's, before and past a
    wrap of the ring and after ``reset()``; indexing them reads what SB3's arrays hold."""
    obs_space, act_space = {
        "box": (spaces.Box(-1, 1, (3,), np.float32), spaces.Box(-2, 2, (2,), np.float64)),
        "discrete": (spaces.Discrete(7), spaces.Discrete(3)),
        "image": (spaces.Box(0, 255, (3, 8, 8), np.uint8), spaces.MultiDiscrete([3, 4])),
        "dict": (spaces.Dict(pos=spaces.Box(-1, 1, (2,), np.float32), k=spaces.Discrete(4)),
                 spaces.Box(-1, 1, (1,), np.float32)),
    }[spaces_]
    ours_cls, theirs_cls = ((DictReplayBuffer, Sb3DictReplayBuffer) if spaces_ == "dict"
                            else (ReplayBuffer, Sb3ReplayBuffer))
    ours = ours_cls(40, obs_space, act_space, device="cpu", n_envs=n_envs)
    theirs = theirs_cls(40, obs_space, act_space, device="cpu", n_envs=n_envs)
    try:
        for steps in (7, 50):  # not full, then wrapped
            feed([ours, theirs], obs_space, act_space, n_envs, steps, seed=steps)
            assert (ours.pos, ours.full) == (theirs.pos, theirs.full)
            _assert_same_layout(ours, theirs)
        a, b = ours.observations, theirs.observations
        a, b = (a["pos"], b["pos"]) if spaces_ == "dict" else (a, b)
        rng = np.random.default_rng(0)
        size = theirs.buffer_size
        for key in (3, -1, slice(2, 9, 3), rng.integers(0, size, 12), [1, 1, 0],
                    (rng.integers(0, size, 5), rng.integers(0, n_envs, 5)),
                    (slice(None), 0), (Ellipsis, 0), rng.random(size) < 0.3,
                    (slice(None), np.array([n_envs - 1, 0]))):
            assert np.array_equal(a[key], b[key]), key
        assert len(a) == len(b) and np.array_equal(a.mean(axis=0), b.mean(axis=0))
        assert np.array_equal(ours.rewards == 0, theirs.rewards == 0)
        ours.reset()
        theirs.reset()
        feed([ours, theirs], obs_space, act_space, n_envs, 5, seed=3)
        assert (ours.pos, ours.full) == (theirs.pos, theirs.full) == (5, False)
        _assert_same_layout(ours, theirs, upto=5)  # (SB3's arrays keep old rows past pos)
        assert not np.asarray(ours.rewards)[5:].any()  # positions not written read as zeros
    finally:
        ours.close()


def test_writes_are_refused_with_the_call_to_use_and_change_nothing():
    """A write through an attribute, or setting ``pos``/``full``, raises ``RowsWriteError``
    naming ``add()``/``reset()``; arrays read through a basic index are read-only (SB3's would
    be views), fancy-indexed ones are the caller's; the rows stay readable and unchanged."""
    from shmbuf.integrations.sb3 import RowsWriteError

    obs_space, act_space = spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(3)
    ours = ReplayBuffer(20, obs_space, act_space, device="cpu", n_envs=2)
    try:
        feed([ours], obs_space, act_space, 2, 30)
        before = {n: np.array(getattr(ours, n)) for n in ("observations", "actions", "dones")}
        writes = [
            lambda: ours.observations.__setitem__(0, 1.0),
            lambda: ours.dones.__setitem__(ours.pos - 1, True),  # (only with optimize_memory)
            lambda: ours.rewards.__iadd__(1),
            lambda: setattr(ours, "actions", np.zeros((20, 2, 1))),
            lambda: setattr(ours, "pos", ours.pos + 1),
            lambda: setattr(ours, "full", False),
        ]
        for write in writes:
            with pytest.raises(RowsWriteError, match=r"add\(\).*reset\(\)"):
                write()
        with pytest.raises(ValueError, match="read-only"):
            ours.observations[:3][0, 0] = 5.0
        mine = ours.observations[[0, 1]]
        mine[0] = 5.0  # a copy, as NumPy's fancy indexing gives
        ours.pos = ours.pos  # (no change: allowed, as BaseBuffer.__init__ does)
        for name, array in before.items():
            assert np.array_equal(np.asarray(getattr(ours, name)), array), name
        assert ours.sample(8).observations.shape == (8, 3) and ours.full and ours.pos == 0
    finally:
        ours.close()


def test_full_on_an_empty_buffer_publishes_sb3s_zero_rows():
    """SB3's arrays start as zeros, so ``full = True`` on an empty buffer makes zero
    transitions sampleable (SB3's test_buffer_dtypes does it); shmbuf adds them."""
    space = spaces.Box(0, 100, dtype=np.uint16)  # shape (): SB3's scalar observations
    ours = ReplayBuffer(4, space, spaces.Discrete(10), device="cpu", n_envs=2)
    theirs = Sb3ReplayBuffer(4, space, spaces.Discrete(10), device="cpu", n_envs=2)
    try:
        ours.full = theirs.full = True
        assert len(ours) == 4 and (ours.pos, ours.full) == (0, True)  # 2 positions, 2 envs
        _assert_same_layout(ours, theirs)
        assert_same_samples(ours, theirs)
    finally:
        ours.close()


def test_get_samples_reads_sb3s_positions():
    """``_get_samples(batch_inds)`` returns SB3's transitions at those positions (envs drawn
    from NumPy's generator as SB3 draws them); a position holding none raises."""
    obs_space, act_space = spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(4)
    ours = ReplayBuffer(30, obs_space, act_space, device="cpu", n_envs=3)
    theirs = Sb3ReplayBuffer(30, obs_space, act_space, device="cpu", n_envs=3)
    try:
        feed([ours, theirs], obs_space, act_space, 3, 6)
        inds = np.array([0, 5, 3, 3, 1])
        np.random.seed(1)
        a = ours._get_samples(inds)
        np.random.seed(1)
        b = theirs._get_samples(inds)
        for name, x, y in zip(a._fields, a, b):
            assert (x is y is None) or th.equal(x, y), name
        with pytest.raises(shmbuf.StaleIndexError, match="below size"):
            ours._get_samples(np.array([7]))
        with pytest.raises(IndexError, match=r"\[0, 10\)"):
            ours._get_samples(np.array([10]))
    finally:
        ours.close()


def test_optimize_memory_usage_layout_and_sb3s_resume_hook():
    """With ``optimize_memory_usage`` the observations sit at SB3's positions (no
    ``next_observations``, as in SB3); SB3's ``learn()`` resume hook, ``dones[pos - 1] = True``,
    ends the open episodes through the writer (truncated); any other write is refused."""
    from shmbuf.integrations.sb3 import RowsWriteError

    obs_space, act_space = spaces.Box(-1e6, 1e6, (1,), np.float32), spaces.Discrete(2)
    ours = ReplayBuffer(32, obs_space, act_space, device="cpu", n_envs=2,
                        optimize_memory_usage=True, handle_timeout_termination=False)
    theirs = Sb3ReplayBuffer(32, obs_space, act_space, device="cpu", n_envs=2,
                             optimize_memory_usage=True, handle_timeout_termination=False)
    try:
        t = np.array([0.0, 100.0], np.float32)
        for step in range(9):
            done = np.array([step == 4, False])
            for b in (ours, theirs):
                b.add(t[:, None], (t + 1)[:, None], np.array([0, 1]),
                      np.ones(2, np.float32), done, [{}, {}])
            t = np.where(done, 50.0, t + 1)
        _assert_same_layout(ours, theirs, upto=9)
        with pytest.raises(AttributeError, match="optimize_memory_usage"):
            assert ours.next_observations is None  # (raises)
        with pytest.raises(RowsWriteError):
            ours.dones[0] = True
        assert ours.shared.episodes()["length"].tolist() == [5]
        ours.dones[(ours.pos - 1) % ours.buffer_size] = True  # SB3's _setup_learn
        episodes = ours.shared.episodes()
        assert sorted(episodes["length"].tolist()) == [4, 5, 9]
        assert episodes["truncated"].tolist().count(True) == 2
        np.random.seed(0)
        s = ours.sample(256)
        assert th.equal(s.next_observations, s.observations + 1)  # true final observations
    finally:
        ours.close()


# -- non-contiguous observations (VecTransposeImage) -------------------------------------------
def test_any_strides_are_stored_as_sb3_stores_them():
    """Transposed, reversed, Fortran-ordered and sliced arrays are copied in as SB3 copies
    them (SB3's ``VecTransposeImage`` hands ``add`` non-contiguous images)."""
    obs_space = spaces.Box(0, 255, (3, 6, 5), np.uint8)
    ours = ReplayBuffer(16, obs_space, spaces.Discrete(2), device="cpu", n_envs=2)
    theirs = Sb3ReplayBuffer(16, obs_space, spaces.Discrete(2), device="cpu", n_envs=2)
    rng = np.random.default_rng(0)
    try:
        for i in range(12):
            hwc = rng.integers(0, 256, (2, 6, 5, 3), dtype=np.uint8)
            obs = [hwc.transpose(0, 3, 1, 2), np.asfortranarray(hwc.transpose(0, 3, 1, 2)),
                   rng.integers(0, 256, (2, 3, 6, 10), dtype=np.uint8)[..., ::2],
                   hwc.transpose(0, 3, 1, 2)[::-1, :, ::-1]][i % 4]
            assert not obs.flags.c_contiguous
            for b in (ours, theirs):
                b.add(obs, obs[:, ::-1], np.array([[i % 2], [1]]), np.ones(2, np.float32),
                      np.array([False, i % 5 == 4]), [{}, {}])
        _assert_same_layout(ours, theirs)
    finally:
        ours.close()


@pytest.mark.parametrize("n_envs", [1, 2])
@pytest.mark.parametrize("dict_obs", [False, True])
def test_cnn_policy_trains_on_channel_last_images(n_envs, dict_obs):
    """The issue's reproduction: DQN with CnnPolicy (MultiInputPolicy for Dict) on SB3's
    channel-last image envs, which VecTransposeImage hands to add() transposed; the rows
    stored are the images the env produced (``observations`` compared with SB3's buffer)."""
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.envs import FakeImageEnv, SimpleMultiObsEnv

    env_cls = (lambda: SimpleMultiObsEnv(random_start=False)) if dict_obs else (
        lambda: FakeImageEnv(screen_height=36, screen_width=36, n_channels=3, discrete=True))
    policy = "MultiInputPolicy" if dict_obs else "CnnPolicy"
    env = make_vec_env(env_cls, n_envs=n_envs, seed=0)
    buffer_class = DictReplayBuffer if dict_obs else ReplayBuffer
    model = silent_logger(sb3.DQN(policy, env, buffer_size=64, learning_starts=20,
                                  batch_size=8, seed=0, replay_buffer_class=buffer_class))
    try:
        model.learn(40)
        rb = model.replay_buffer
        assert isinstance(rb, buffer_class) and len(rb) == 40
        images = rb.observations["img"] if dict_obs else rb.observations
        assert images.shape[2:] == ((1, 64, 64) if dict_obs else (3, 36, 36))  # transposed
        assert np.asarray(images)[: rb.pos].any()  # the env's pixels, not zeros
    finally:
        model.replay_buffer.close()


# -- another process reads the buffer by name while the model trains ---------------------------
class CountingEnv(gym.Env):
    """Every observation checks itself: ``[episode, t, 7 t + episode]``; reward ``t`` after the
    step; episodes end at t = 15. A row mixing two transitions fails ``check_rows``."""

    observation_space = spaces.Box(-1e9, 1e9, (3,), np.float32)
    action_space = spaces.Discrete(2)
    episode = t = 0

    def _obs(self):
        return np.array([self.episode, self.t, 7 * self.t + self.episode], np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode, self.t = self.episode + 1, 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), float(self.t), self.t == 15, False, {}


def check_rows(batch):
    """The rows of a sampled batch (field -> array) are whole transitions of CountingEnv."""
    obs, nxt = batch["obs"], batch["next_obs"]
    for o in (obs, nxt):
        assert np.array_equal(o[:, 2], 7 * o[:, 1] + o[:, 0]), "a torn observation"
    assert np.array_equal(nxt[:, :2], obs[:, :2] + [0, 1]), "next_obs of another step"
    assert np.array_equal(batch["reward"][:, 0], nxt[:, 1]), "reward of another step"
    assert np.array_equal(batch["done"][:, 0], (nxt[:, 1] == 15).astype(np.float32))


def read_while_training(name, seen, stop):
    """Attach SB3's buffer by name and sample it until ``stop``, checking every row;
    ``seen`` is the most rows the buffer held when a batch was drawn."""
    buf = shmbuf.ReplayBuffer.attach(name, timeout=60)
    try:
        while not stop.is_set():
            held = len(buf)
            if held == 0:
                time.sleep(0.005)
                continue
            check_rows(buf.sample(64))
            seen.value = max(seen.value, held)
    finally:
        buf.close()


@pytest.mark.timeout(300)
def test_another_process_reads_the_buffer_by_name_while_the_model_trains(mp):
    """A DQN trains on two envs into shmbuf's SB3 buffer (it wraps); another process attaches
    it by name and samples. Every 200 steps training waits until the reader has drawn a batch
    from at least the rows held then, so reads provably overlap training; every row checks."""
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    class WaitForReader(BaseCallback):
        def __init__(self, reader, seen):
            super().__init__()
            self.reader, self.seen, self.waits = reader, seen, 0

        def _on_step(self):
            if self.num_timesteps % 200 == 0:
                held, deadline = len(self.model.replay_buffer), time.monotonic() + 60
                while self.seen.value < held:
                    assert self.reader.is_alive(), "the reader died (a bad row?)"
                    assert time.monotonic() < deadline, "the reader read nothing for 60 s"
                    time.sleep(0.005)
                self.waits += 1
            return True

    env = make_vec_env(CountingEnv, n_envs=2, seed=0)
    model = silent_logger(sb3.DQN("MlpPolicy", env, buffer_size=300, learning_starts=50,
                                  batch_size=16, seed=0, policy_kwargs={"net_arch": [8]},
                                  replay_buffer_class=ReplayBuffer))
    seen, stop = mp.Value("q", 0), mp.Event()
    reader = mp.Process(target=read_while_training,
                        args=(model.replay_buffer.shared.name, seen, stop))
    reader.start()
    callback = WaitForReader(reader, seen)
    try:
        model.learn(1_200, callback=callback)
        assert callback.waits == 6 and model.replay_buffer.full  # (it wrapped)
        check_rows(model.replay_buffer.shared.sample(256))  # the owner's rows check too
    finally:
        stop.set()
        reader.join(30)
        if reader.is_alive():
            reader.kill()
            reader.join()
        model.replay_buffer.close()
        callback.seen = None  # (the model's reference cycles keep the callback: not its lock)
    assert reader.exitcode == 0
