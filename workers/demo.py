"""``shmbuf demo``: actors stepping environments write to a shared buffer; a sampler pool feeds a
learner loop. Prints a live line of rates and a summary. The README's main job.

Run with ``shmbuf demo`` (a plugin command of the shmbuf CLI) or ``python -m workers.demo``;
``--ray-nodes N`` runs it across N local Ray nodes (``workers.cluster_demo``).
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

from .actors import ActorContext, ActorGroup
from .config import Workers
from .demo_line import LiveLine
from .envs import SyntheticAtari, transition_spec_kwargs
from .plot import plots_throughput
from .pool import SamplerPool


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
    spec = _spec_for(args.env)
    capacity = _capacity_for(spec, args.actors, args.capacity, args.batch_size)
    if args.ray_nodes is not None:
        from .cluster_demo import run_ray

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=15.0, help="how long to run (default 15)")
    p.add_argument("--actors", type=int, default=2, help="actor processes (default 2)")
    p.add_argument("--workers", type=int, default=2, help="sampler workers (default 2)")
    p.add_argument("--batch-size", type=int, default=256, help="batch size (default 256)")
    p.add_argument("--capacity", type=int, default=None,
                   help="transitions per lane (default: fits a quarter of /dev/shm, <= 512 MiB)")
    p.add_argument("--min-size", type=int, default=2000, help="transitions before sampling")
    p.add_argument("--samples-per-insert", type=float, default=None,
                   help="rate-limit to this many samples per inserted transition")
    p.add_argument("--train-ms", type=float, default=2.0,
                   help="synthetic compute per train step, in ms (default 2)")
    p.add_argument("--env", default=None, help="a gymnasium env id (needs gymnasium)")
    p.add_argument("--start-method", default=None, choices=["fork", "forkserver", "spawn"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="draw throughput over time to this file at the end (needs matplotlib)")
    p.add_argument("--ray-nodes", type=int, default=None, metavar="N",
                   help="run across N local Ray nodes (ray.cluster_utils.Cluster): --actors "
                        "and --workers are per node; needs pip install 'shmbuf[ray]'")


def register(subparsers: Any) -> None:
    """Plugin hook of the ``shmbuf`` CLI (entry point group ``shmbuf.commands``)."""
    p = subparsers.add_parser("demo", help="run the actor-learner demo",
                              description=__doc__.splitlines()[0])
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.demo", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
