"""examples/apex_atari.py (issue 29): the priorities its actors compute are the TD errors of the
very batches shmbuf's frame-stack, n-step plan delivers, and the example runs for a few seconds
on MinAtar Breakout (and ALE Pong, where ale-py is installed) with rows written, updates made
and newer weights read by the actors. Skipped without the ``atari`` extra
(``pip install -e '.[atari]'``); the runs of the example are marked ``slow``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_examples import _run

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def apex():
    """The example as a module (it is a script, not a package)."""
    pytest.importorskip("torch")
    pytest.importorskip("minatar")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import apex_atari
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return apex_atari


@pytest.mark.parametrize("game", ["Breakout", "SpaceInvaders", "Seaquest", "Asterix", "Freeway"])
def test_every_minatar_game_steps_by_its_id(apex, game):
    """``--env MinAtar/<Game>`` names each of MinAtar's five games (``SpaceInvaders`` is
    MinAtar's ``space_invaders``; the R2D2 example names them with the same ``minatar_game``)."""
    env = apex.MinAtarEnv(f"MinAtar/{game}", seed=0, max_episode_steps=100)
    frame = env.reset()
    assert frame.shape == env.frame_shape and frame.dtype == np.uint8
    assert env.frame_shape[1:] == (10, 10) and env.n_actions >= 3


def test_actor_priorities_are_the_td_errors_of_the_plans_batches(apex):
    """An actor's priority for each row, from the stack it acted on and the Q-values it
    computed then, equals |reward + discount * max Q(next_obs) - Q(obs, action)| computed by
    the same network from the batch shmbuf's ``Plan(frame_stack=4, n_step=3)`` delivers for
    that row: the actor's zero-padded stacks and n-step targets are the plan's, across
    terminations, truncations (every 12 steps here) and the first frames of an episode."""
    import torch

    import shmbuf
    from shmbuf.sampling import Plan
    from workers import SamplerPool

    torch.manual_seed(0)
    cfg = apex.ActorConfig("MinAtar/Breakout", n_actors=2, weights="", frame_stack=4, n_step=3,
                           gamma=0.9, flush_rows=5, max_episode_steps=12)
    env = apex.make_env(cfg.env_id, 0, cfg.max_episode_steps)
    spec = shmbuf.Spec(obs=(env.frame_shape, "uint8"), action=((), "uint8"),
                       reward=((), "float32"), terminated=((), "bool"), version=((), "int32"))
    given = np.full(1_000, np.nan)  # priority by logical index
    with shmbuf.ReplayBuffer.create(spec, 1_000, lanes=1, next_obs="derived",
                                    episode_spec=apex.EPISODE_SPEC) as buf, \
            buf.writer(lane=0) as writer:
        def write(rows, priorities):
            written = writer.extend(rows)
            given[written.start:written.stop] = priorities

        actor = apex.ApexActor(cfg, 0, np.random.default_rng(1), write, writer.end_episode,
                               weights=None)  # epsilon 0.4: both greedy and random actions
        actor.run(lambda: False, max_steps=300)
        assert len(buf) == np.isfinite(given).sum() >= 250 and actor.episodes >= 10
        truncated = buf.episodes()["truncated"]
        assert truncated.any() and not truncated.all()  # both kinds of episode end
        plan = Plan(frame_stack=4, n_step=3, gamma=cfg.gamma)
        with SamplerPool(buf, 256, plan=plan, workers=0, seed=0) as pool:
            batch = pool.next(timeout=30)
            net = actor.net
            with torch.no_grad():
                q = net(torch.from_numpy(np.ascontiguousarray(batch["obs"])))
                best = net(torch.from_numpy(np.ascontiguousarray(batch["next_obs"]))).max(1)
            taken = q.numpy()[np.arange(256), batch["action"].astype(np.int64)]
            td = np.abs(batch["reward"] + batch["discount"] * best.values.numpy() - taken)
            indices = np.asarray(batch.indices)
            assert (batch["discount"] == 0).any() and (batch["steps"] < 3).any()
            assert not batch["obs_mask"].all()  # first frames of episodes, zero-padded
    np.testing.assert_allclose(td, given[indices], rtol=1e-4, atol=1e-5)


def _result(out: str) -> tuple[int, int, int, int]:
    """(env steps, updates, newest weights version the actors acted with, versions published)
    from the example's ``result:`` line."""
    found = re.search(r"result: mean return of the last 100 episodes \S+ after (\d+) env steps, "
                      r"(\d+) updates, \d+ episodes in [\d.]+ s; actors acted with weights "
                      r"versions up to (\d+) of (\d+) published", out)
    assert found is not None, out
    return tuple(int(g) for g in found.groups())  # type: ignore[return-value]


@pytest.mark.slow
@pytest.mark.parametrize("env_id", ["MinAtar/Breakout", "ALE/Pong-v5"])
def test_apex_example_runs_and_actors_read_newer_weights(env_id):
    pytest.importorskip("torch")
    if env_id.startswith("MinAtar/"):
        pytest.importorskip("minatar")
    else:
        pytest.importorskip("ale_py")
        pytest.importorskip("cv2")
    # it stops as soon as the learner drew rows made with version 3 (or after 150 s)
    out = _run("apex_atari.py", "--env", env_id, "--seconds", "150", "--until-version", "3",
               "--actors", "2", "--learning-starts", "200", "--batch-size", "32",
               "--publish-every", "2", "--sync-every", "10", "--capacity", "20000",
               "--report-every", "5", timeout=240)
    steps, updates, newest, published = _result(out)
    assert steps >= 200 and updates > 0, out  # rows written, the learner trained
    # rows drawn by the learner were made with weights it published after the first version:
    # the actors loaded them from the WeightStore
    assert 3 <= newest <= published, out
