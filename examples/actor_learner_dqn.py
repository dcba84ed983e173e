"""Actor-learner DQN on CartPole-v1: actor processes step gymnasium environments into a shared
replay buffer while a plain torch DQN learner trains from a ``SamplerPool``.

- ``ActorGroup`` runs ``--actors`` processes, each on its own lane of the buffer, each acting
  epsilon-greedily (Ape-X style: every actor its own epsilon floor) with the learner's newest
  Q-network. They record each episode's return with ``end_episode(**{"return": ...})``.
- The learner's weights reach the actors through a second, tiny shmbuf buffer (one row per
  published version): a reader never sees a half-written row, so no lock is needed.
- ``limit=RateLimit(min_size, samples_per_insert, tolerance)`` paces the actors to the learner
  (Reverb-style), so the ratio of updates to environment steps stays what it is set to, however
  fast either side runs.

Run: ``python examples/actor_learner_dqn.py --seconds 30`` (needs torch and gymnasium:
``pip install -e '.[torch,gym]'``). It prints progress every couple of seconds and a final line
with the recent return (each actor's last 5 episodes) against the first one measured.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import shmbuf
from workers import ActorGroup, SamplerPool
from workers.config import Workers

OBS_DIM, N_ACTIONS = 4, 2  # CartPole-v1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=30.0, help="train for this long at most")
    p.add_argument("--steps", type=int, default=200_000, help="stop after this many env steps")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-method", default="forkserver",
                   choices=["fork", "forkserver", "spawn"])
    p.add_argument("--buffer-size", type=int, default=50_000, help="rows per actor lane")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--learning-starts", type=int, default=1_000)
    p.add_argument("--samples-per-insert", type=float, default=16.0,
                   help="rows sampled per env step (the actors wait beyond this)")
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--target-every", type=int, default=250, help="updates between target syncs")
    p.add_argument("--publish-every", type=int, default=50, help="updates between weight pushes")
    p.add_argument("--explore-steps", type=int, default=10_000,
                   help="steps over which each actor's epsilon falls from 1 to its floor")
    return p.parse_args(argv)


def q_network() -> nn.Module:
    return nn.Sequential(nn.Linear(OBS_DIM, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, N_ACTIONS))


def n_params() -> int:
    return sum(p.numel() for p in q_network().parameters())


def make_actor(board_name: str, n_actors: int, explore_steps: int) -> Any:
    """The actor function ``ActorGroup`` runs in each process (closes over plain values only)."""

    def actor(ctx: Any) -> None:
        torch.set_num_threads(1)
        board = shmbuf.ReplayBuffer.attach(board_name)  # the learner's published weights
        net, version = q_network(), 0
        floor = 0.1 ** (1 + ctx.actor_id / max(n_actors - 1, 1))  # 0.1 .. 0.01 (Ape-X style)
        env = gym.make("CartPole-v1")
        obs, _ = env.reset(seed=int(ctx.rng.integers(2**31)))
        episode_return, steps = 0.0, 0
        try:
            while not ctx.stopping:
                newest = board.committed(0)
                if newest > version:  # load the newest weights (a torn row is never read)
                    try:
                        row = board.get(newest - 1)["params"][0]
                    except shmbuf.StaleIndexError:
                        pass  # overwritten meanwhile: take the next one
                    else:
                        nn.utils.vector_to_parameters(torch.from_numpy(row), net.parameters())
                        version = newest
                epsilon = max(floor, 1.0 - steps / explore_steps)
                if ctx.rng.random() < epsilon:
                    action = int(ctx.rng.integers(N_ACTIONS))
                else:
                    with torch.no_grad():
                        action = int(net(torch.from_numpy(obs)).argmax())
                next_obs, reward, terminated, truncated, _ = env.step(action)
                ctx.writer.add(obs=obs, action=action, reward=reward, next_obs=next_obs,
                               terminated=terminated, truncated=truncated)
                episode_return += float(reward)
                steps += 1
                obs = next_obs
                if terminated or truncated:
                    ctx.writer.end_episode(truncated=truncated, **{"return": episode_return})
                    obs, _ = env.reset()
                    episode_return = 0.0
        finally:
            env.close()
            board.close()

    return actor


def recent_return(buf: shmbuf.ReplayBuffer, per_lane: int = 5) -> tuple[float, int]:
    """(mean return of each lane's last ``per_lane`` episodes, episodes finished in all)."""
    rec = buf.episodes()
    if not rec["episode"].size:
        return float("nan"), 0
    last = [rec["return"][rec["lane"] == k][-per_lane:] for k in np.unique(rec["lane"])]
    finished = int(sum(rec["episode"][rec["lane"] == k].max() + 1 for k in np.unique(rec["lane"])))
    return float(np.concatenate(last).mean()), finished


def train(args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the cores are the actors'
    spec = shmbuf.Spec(obs=((OBS_DIM,), "float32"), action=((), "int64"),
                       reward=((), "float32"), next_obs=((OBS_DIM,), "float32"),
                       terminated=((), "bool"), truncated=((), "bool"))
    qnet, target = q_network(), q_network()
    target.load_state_dict(qnet.state_dict())
    optimizer = torch.optim.Adam(qnet.parameters(), lr=args.learning_rate)
    limit = shmbuf.RateLimit(args.learning_starts, args.samples_per_insert,
                             max(20 * args.batch_size, args.samples_per_insert))
    with shmbuf.ReplayBuffer.create(spec, args.buffer_size, lanes=args.actors,
                                    episode_spec={"return": ((), "float32")}) as buf, \
            shmbuf.ReplayBuffer.create({"params": ((n_params(),), "float32")}, 4) as board, \
            board.writer(lane=0) as publish:
        def push() -> None:
            publish.add(params=nn.utils.parameters_to_vector(qnet.parameters()).detach().numpy())

        push()
        actor = make_actor(board.name, args.actors, args.explore_steps)
        with ActorGroup(actor, args.actors, buf, start_method=args.start_method,
                        seed=args.seed) as actors, \
                SamplerPool(buf, batch_size=args.batch_size, limit=limit,
                            workers=Workers(1, start_method=args.start_method), output="torch",
                            seed=args.seed) as pool:
            t0 = next_report = time.monotonic()
            first = None
            updates, loss = 0, float("nan")
            while time.monotonic() - t0 < args.seconds and len(buf) < args.steps:
                batch = pool.next()
                q = qnet(batch["obs"]).gather(1, batch["action"][:, None]).squeeze(1)
                with torch.no_grad():
                    best = target(batch["next_obs"]).max(1).values
                    y = batch["reward"] + args.gamma * (~batch["terminated"]) * best
                td = F.smooth_l1_loss(q, y)
                optimizer.zero_grad()
                td.backward()
                optimizer.step()
                updates += 1
                if updates % args.target_every == 0:
                    target.load_state_dict(qnet.state_dict())
                if updates % args.publish_every == 0:
                    push()
                if time.monotonic() >= next_report:
                    actors.poll()  # re-raises an actor's exception, restarts a crashed one
                    loss = td.item()
                    ret, episodes = recent_return(buf)
                    if first is None and episodes >= 2 * args.actors:
                        first = ret
                    print(f"{time.monotonic() - t0:5.1f}s  env steps {len(buf):6d}  updates "
                          f"{updates:6d}  episodes {episodes:4d}  recent return {ret:6.1f}  "
                          f"loss {loss:.3f}", flush=True)
                    next_report = time.monotonic() + 2.0
            ret, episodes = recent_return(buf)
            result = {"seconds": time.monotonic() - t0, "env_steps": len(buf),
                      "updates": updates, "episodes": episodes, "first_return": first or ret,
                      "final_return": ret}
    print(f"result: recent return {result['final_return']:.1f} (at the start "
          f"{result['first_return']:.1f}) after {result['env_steps']} env steps, "
          f"{result['updates']} updates, {result['episodes']} episodes in "
          f"{result['seconds']:.1f} s", flush=True)
    return result


if __name__ == "__main__":
    train(parse_args())
