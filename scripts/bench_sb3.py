#!/usr/bin/env python
"""Stable-Baselines3 benchmark: shmbuf's ``replay_buffer_class`` against SB3's own buffer, by the
operation and in a whole training step.

In the same rounds (ratios are taken side by side; this machine is noisy):
  - ops: ``add`` of one step (MuJoCo-sized rows: obs 17, action 6) with ``n_envs`` 1 and 4, and
    ``sample(256)``, each on SB3's ``ReplayBuffer`` and on ``shmbuf.integrations.sb3.ReplayBuffer``;
  - train: env steps per second of ``model.learn`` (acting, adding, sampling and the gradient
    step, on one CPU thread): SAC on Pendulum-v1 (one env, a gradient step per env step) and DQN
    on CartPole-v1 (4 envs, a gradient step every 4 steps), each model made afresh per round
    with the same seed, with each buffer class; and the share of that time spent inside the
    buffer's ``add`` and ``sample`` (timed around each call), which the noise of a whole
    training step hides less.

The ops show what the buffer itself costs; the train rows show what that costs in the loop a
user runs. Benchmarks report, they do not gate. Needs the ``sb3`` extra (torch, gymnasium).

    python scripts/bench_sb3.py [--quick] [--rounds N] [--seconds S] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

import benchlib
from benchlib import TimedCase

BATCH = 256


def _buffers(n_envs: int, closing: list[Any]) -> tuple[Any, Any]:
    """(SB3's buffer, shmbuf's), MuJoCo-sized, each holding 5,000 steps of every env."""
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer as SB3Buffer

    from shmbuf.integrations.sb3 import ReplayBuffer as ShmbufBuffer

    obs = spaces.Box(-1, 1, (17,), np.float32)
    act = spaces.Box(-1, 1, (6,), np.float32)
    out = []
    for cls in (SB3Buffer, ShmbufBuffer):
        buf = cls(100_000, obs, act, device="cpu", n_envs=n_envs)
        if hasattr(buf, "close"):
            closing.append(buf)
        step = _step(n_envs, np.random.default_rng(0))
        for _ in range(5_000):
            buf.add(*step)
        out.append(buf)
    return out[0], out[1]


def _step(n_envs: int, rng: np.random.Generator) -> tuple[Any, ...]:
    o = rng.random((n_envs, 17), np.float32)
    return (o, o, rng.random((n_envs, 6), np.float32), np.zeros(n_envs, np.float32),
            np.zeros(n_envs, np.float32), [{} for _ in range(n_envs)])


def _op_cases(closing: list[Any]) -> list[list[TimedCase]]:
    groups = []
    for n_envs in (1, 4):
        sb3, ours = _buffers(n_envs, closing)
        step = _step(n_envs, np.random.default_rng(1))
        groups.append([TimedCase(f"add, {n_envs} env(s), SB3",
                                 benchlib.loop_runner(lambda b=sb3, s=step: b.add(*s))),
                       TimedCase(f"add, {n_envs} env(s), shmbuf",
                                 benchlib.loop_runner(lambda b=ours, s=step: b.add(*s)))])
        if n_envs == 1:
            groups.append([TimedCase(f"sample({BATCH}), SB3",
                                     benchlib.loop_runner(lambda b=sb3: b.sample(BATCH))),
                           TimedCase(f"sample({BATCH}), shmbuf",
                                     benchlib.loop_runner(lambda b=ours: b.sample(BATCH)))])
    return groups


TRAINING = {  # name: (algorithm, env, n_envs, env steps timed per round, model kwargs)
    "SAC Pendulum-v1, 1 env": ("SAC", "Pendulum-v1", 1, 1_000, dict(learning_starts=200)),
    "DQN CartPole-v1, 4 envs": ("DQN", "CartPole-v1", 4, 12_000, dict(learning_starts=500,
                                                                      train_freq=4)),
}


def _timed(obj: Any, name: str, spent: list[float]) -> None:
    """Add the seconds each call of ``obj.name`` takes to ``spent[0]``."""
    method = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    setattr(obj, name, timed)


def _train_rate(name: str, shmbuf_buffer: bool, scale: float) -> tuple[float, float]:
    """(env steps per second of ``learn`` past ``learning_starts``, a fresh model; the share
    of that time spent in the buffer's ``add`` and ``sample``)."""
    import stable_baselines3 as sb3
    from stable_baselines3.common.env_util import make_vec_env

    from shmbuf.integrations.sb3 import ReplayBuffer as ShmbufBuffer

    algo, env_id, n_envs, steps, kwargs = TRAINING[name]
    steps = max(100, int(steps * scale))
    env = make_vec_env(env_id, n_envs=n_envs, seed=0)
    extra = {"replay_buffer_class": ShmbufBuffer} if shmbuf_buffer else {}
    model = getattr(sb3, algo)("MlpPolicy", env, seed=0, device="cpu", verbose=0, **kwargs,
                               **extra)
    try:
        model.learn(kwargs["learning_starts"] + 100)  # past learning_starts: training runs
        spent = [0.0]
        _timed(model.replay_buffer, "add", spent)
        _timed(model.replay_buffer, "sample", spent)
        t0 = time.perf_counter()
        model.learn(steps, reset_num_timesteps=False)
        took = time.perf_counter() - t0
        return steps / took, spent[0] / took
    finally:
        close = getattr(model.replay_buffer, "close", None)
        if close is not None:
            close()
        env.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_options = benchlib.add_run_options(p, "short rounds (< 1 min)", 0.25, 0.05)
    p.add_argument("--part", choices=["all", "ops", "train"], default="all")
    p.add_argument("--train-scale", type=float, default=None,
                   help="env steps timed per training round, as a share of the defaults "
                        "(SAC 1,000, DQN 12,000; 0.2 with --quick)")
    args = p.parse_args(argv)
    rounds, seconds = run_options(args)
    scale = args.train_scale or (0.2 if args.quick else 1.0)
    import torch

    torch.set_num_threads(1)  # one thread each: the ratio is the buffer's, not the BLAS's
    info = benchlib.machine()
    clock = benchlib.RunClock()
    results: dict[str, Any] = {}
    closing: list[Any] = []
    try:
        if args.part in ("all", "ops"):
            groups = _op_cases(closing)
            benchlib.run_rounds(groups, rounds, seconds)
            for base, case in groups:
                r = benchlib.ratio(case, base)
                results[case.name.rsplit(",", 1)[0]] = {
                    "sb3_us": statistics.median(base.secs) * 1e6,
                    "shmbuf_us": statistics.median(case.secs) * 1e6, "ratio": r}
        if args.part in ("all", "train"):
            for name in TRAINING:
                pairs = []
                for k in range(rounds):
                    print(f"  train {name}: round {k + 1}/{rounds}", file=sys.stderr, flush=True)
                    pairs.append((_train_rate(name, False, scale), _train_rate(name, True, scale)))
                ratios = sorted(o[0] / s[0] for s, o in pairs)
                results[f"train {name}"] = {
                    "sb3_steps_per_s": statistics.median(s[0] for s, _ in pairs),
                    "shmbuf_steps_per_s": statistics.median(o[0] for _, o in pairs),
                    "sb3_buffer_share": statistics.median(s[1] for s, _ in pairs),
                    "shmbuf_buffer_share": statistics.median(o[1] for _, o in pairs),
                    "ratio": {"median": statistics.median(ratios), "min": ratios[0],
                              "max": ratios[-1], "rounds": ratios}}
    except KeyboardInterrupt:
        print("bench_sb3: interrupted", file=sys.stderr)
        return 130
    finally:
        for thing in closing:
            thing.close()
    print(f"shmbuf vs SB3's replay buffer{' (--quick)' if args.quick else ''}: {rounds} rounds; "
          f"medians; ratio = SB3's time / shmbuf's (above 1: shmbuf faster)")
    print(benchlib.machine_line(info))
    for name, r in results.items():
        q = r["ratio"]
        if name.startswith("train"):
            print(f"{name:<40} SB3 {r['sb3_steps_per_s']:>8.0f} steps/s  shmbuf "
                  f"{r['shmbuf_steps_per_s']:>8.0f} steps/s  {q['median']:.3f}x "
                  f"({q['min']:.3f}-{q['max']:.3f}); in add + sample: SB3 "
                  f"{r['sb3_buffer_share']:.1%}, shmbuf {r['shmbuf_buffer_share']:.1%} of the time")
        else:
            print(f"{name:<40} SB3 {benchlib.fmt_us(r['sb3_us']):>10}  shmbuf "
                  f"{benchlib.fmt_us(r['shmbuf_us']):>10}  {q['median']:.2f}x "
                  f"({q['min']:.2f}-{q['max']:.2f})")
    print(benchlib.runtime_line(*clock.stop()))
    return benchlib.finish(args, {"machine": info, "results": results, "targets": []})


if __name__ == "__main__":
    sys.exit(main())
