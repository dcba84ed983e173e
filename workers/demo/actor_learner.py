"""The actor-learner demo on this machine: actor processes step environments into a shared
buffer while a sampler pool feeds a learner loop (``--ray-nodes N``: ``ray_nodes.run_ray``).
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import numpy as np

from shmbuf import RateLimit, ReplayBuffer, Spec
from shmbuf.segment import fmt_bytes
from shmbuf.shmdir import shm_free_bytes

from ..actors import ActorContext, ActorGroup
from ..config import Workers
from ..pool import SamplerPool
from .envs import SyntheticAtari, transition_spec_kwargs
from .line import LiveLine
from .plot import plots_throughput


def env_actor(ctx: ActorContext, env_id: str | None = None) -> None:
    """Step an environment with random actions and write every transition."""
    env = _make_env(env_id, seed=int(ctx.rng.integers(1 << 31)))
    n_actions = getattr(getattr(env, "action_space", None), "n", SyntheticAtari.n_actions)
    obs, _ = env.reset(seed=int(ctx.rng.integers(1 << 31)))
    writer, rng = ctx.writer, ctx.rng
    actions = rng.integers(0, n_actions, size=4096)
    t = 0
    while not ctx.stopping:
        action = int(actions[t % 4096])
        t += 1
        next_obs, reward, terminated, truncated, _ = env.step(action)
        writer.add(obs=np.asarray(obs), next_obs=np.asarray(next_obs), action=action,
                   reward=float(reward), terminated=bool(terminated), truncated=bool(truncated))
        if terminated or truncated:
            writer.end_episode()
            obs, _ = env.reset()
        else:
            obs = next_obs


def _make_env(env_id: str | None, seed: int) -> Any:
    if env_id is None:
        return SyntheticAtari(seed=seed)
    import gymnasium

    return gymnasium.make(env_id)


def _spec_for(env_id: str | None) -> Spec:
    if env_id is None:
        return Spec(transition_spec_kwargs(SyntheticAtari.obs_shape, np.uint8))
    try:
        import gymnasium
    except ImportError:
        raise SystemExit("--env needs gymnasium: pip install 'shmbuf[gym]'") from None
    env = gymnasium.make(env_id)
    spec = Spec.from_spaces(env.observation_space, env.action_space)
    env.close()
    if any("/" in name for name in spec):
        raise SystemExit(f"--env {env_id}: Dict/Tuple observations are not supported by the demo")
    return spec


def _capacity_for(spec: Spec, lanes: int, asked: int | None, batch_size: int) -> int:
    if asked is not None:
        return asked
    # A quarter of /dev/shm, at most 512 MiB: lanes wrap within seconds, so the demo shows the
    # steady state rather than the first lap's page faults (see README, "first touch").
    room = min(shm_free_bytes() // 4, 512 << 20)
    per_lane = room // (spec.row_nbytes * lanes)
    return int(max(4 * batch_size, min(per_lane, 50_000)))


def train_step(batch: Any, busy_ms: float) -> float:
    """A stand-in for a gradient step: reads a row of every observation, then burns ``busy_ms``
    of CPU (as a forward/backward pass would keep the learner busy)."""
    obs = np.asarray(batch["obs"])
    value = float(obs.reshape(obs.shape[0], -1)[:, -64:].mean()) + float(
        np.asarray(batch["reward"]).sum())
    if busy_ms > 0:
        end = time.perf_counter() + busy_ms / 1e3
        while time.perf_counter() < end:
            pass
    return value


def demo_limits(args: argparse.Namespace, rows: int) -> RateLimit:
    """The rate limit of a demo buffer of ``rows`` rows in all: min_size at most half of it, and
    the ratio's tolerance (if ``--samples-per-insert``) at least four batches."""
    min_size = min(args.min_size, rows // 2)
    spi = args.samples_per_insert
    if spi is None:
        return RateLimit(min_size)
    return RateLimit(min_size, spi, max(4 * args.batch_size, spi * 1000))


@plots_throughput  # --plot PATH
def run(args: argparse.Namespace) -> int:
    if getattr(args, "isolated", False) and args.ray_nodes is None:
        raise SystemExit("--isolated puts each Ray node in namespaces of its own: give the "
                         "nodes with it, e.g. --ray-nodes 3 --isolated")
    spec = _spec_for(args.env)
    capacity = _capacity_for(spec, args.actors, args.capacity, args.batch_size)
    if args.ray_nodes is not None:
        from .ray_nodes import run_ray

        return run_ray(args, spec, functools.partial(env_actor, env_id=args.env), train_step,
                       capacity, demo_limits)
    batch_bytes = spec.row_nbytes * args.batch_size
    limit = demo_limits(args, capacity * args.actors)
    print(f"shmbuf demo: {args.actors} actors x {args.workers} sampler workers, "
          f"{args.env or 'synthetic Atari'} frames, batch {args.batch_size} "
          f"({fmt_bytes(batch_bytes)}), buffer {args.actors} lanes x {capacity} "
          f"({fmt_bytes(spec.row_nbytes * capacity * args.actors)} of /dev/shm), "
          f"{args.seconds:g} s", flush=True)
    actor = functools.partial(env_actor, env_id=args.env)
    with ReplayBuffer.create(spec, capacity=capacity, lanes=args.actors) as buf, \
            ActorGroup(actor, args.actors, buf, start_method=args.start_method,
                       seed=args.seed) as group, \
            SamplerPool(buf, batch_size=args.batch_size,
                        workers=Workers(args.workers, start_method=args.start_method),
                        limit=limit, seed=args.seed, timeout=60.0) as pool:
        line = LiveLine(batch_bytes)
        batches = 0
        while line.elapsed() < args.seconds:
            batch = pool.next()
            train_step(batch, args.train_ms)
            batches += 1
            if line.due() is not None:
                group.poll()
                st = pool.stats()
                line.show(batches, int(buf.committed().sum()),
                          f"learner wait {100 * st['learner_wait_frac']:4.1f}% | staging "
                          f"{st['staging_ready']}/{pool.n_staging} ready | buffer {len(buf):,}")
        group.poll()
        elapsed = line.elapsed()
        st = pool.stats()
        total_inserts = int(buf.committed().sum())
    line.close()
    print(f"{line.summary(batches, elapsed)}); "
          f"{total_inserts:,} transitions inserted ({total_inserts / elapsed:,.0f}/s); "
          f"learner waited {100 * st['learner_wait_frac']:.1f}% of the time; "
          f"sampler restarts {st['restarts']}, actor restarts {group.restarts}")
    return 0
