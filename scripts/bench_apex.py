#!/usr/bin/env python
"""Ape-X on Atari (issue 29): what shmbuf costs the actors, the memory of a transition, and
the learner's batches against cpprb, as ratios measured side by side in one run.

- actors: ``--actors`` processes of ``examples/apex_atari.py``'s ``ApexActor`` stepping
  ``--env`` and computing every row's priority with their network, alone, against the same
  actors also writing their rows to a shmbuf buffer (``extend``, chunks of 32) and refreshing
  their network from a ``WeightStore`` that this process publishes into ``--publish-hz`` times
  a second. The same inference and priorities in both, so the ratio of env steps per actor
  CPU-second is shmbuf's cost (target >= 0.95); rounds alternate the order.
- memory: bytes of /dev/shm per stored transition of the example's buffer (one 84x84 frame,
  ``next_obs="derived"``, one extra row per episode of ``--episode-length`` steps) against the
  frame plus its scalar fields (target <= 1.1x); beside SB3's ``ReplayBuffer`` with
  ``optimize_memory_usage=True`` and a shmbuf buffer storing stacked ``obs`` and ``next_obs``
  (what a buffer without frame stacks at sampling needs), and cpprb's ``stack_compress``.
- learner: batches/s of the Ape-X batch (B=512, frame stack 4, n-step 3, prioritized, with the
  priority update) from ``--rows`` random 84x84 frames, in-process and with 2 sampler workers,
  against cpprb's ``PrioritizedReplayBuffer(next_of="obs", stack_compress="obs")`` on the same
  frames (cpprb's ``Nstep`` drops ``next_obs`` from its samples when combined with those two
  options, so its n-step variant is shown apart: it delivers half the bytes); and the learner's
  wait with workers while it spends ``--train-ms`` per batch.

    python scripts/bench_apex.py [--quick] [--env ALE/Pong-v5] [--actors 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import benchlib
from shmbuf import ReplayBuffer, Spec, WeightStore
from shmbuf.sampling import Plan
from workers import SamplerPool
from workers.selection import Prioritized

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import apex_atari  # type: ignore[import-not-found]  # noqa: E402  (examples/: no package)

B, STACK, NSTEP, GAMMA, ALPHA, BETA = 512, 4, 3, 0.99, 0.6, 0.4
FRAME = (84, 84)
CHUNK = 32  # rows per extend, as the example's --flush-rows
SETUP_TIMEOUT = 300.0  # an actor process that is not ready by then is hung


def frame_spec(frame: tuple[int, ...] = FRAME) -> Spec:
    """The example's row: one frame and its scalars."""
    return Spec(obs=(frame, "uint8"), action=((), "uint8"), reward=((), "float32"),
                terminated=((), "bool"), version=((), "int32"))


# --------------------------------------------------------------------------------------------
# Actors
# --------------------------------------------------------------------------------------------
def actor_proc(mode: str, actor_id: int, args: dict[str, Any], names: tuple[str, str],
               go: Any, results: Any) -> None:
    """One actor for one measurement: set up, wait for ``go``, run ``seconds``, report
    (steps, wall seconds, CPU seconds). ``mode`` "alone" writes nothing and reads no weights
    but the first version, before it starts (both modes act with the same network)."""
    import torch

    torch.set_num_threads(1)
    cfg = apex_atari.ActorConfig(args["env"], args["actors"], names[1], STACK, NSTEP, GAMMA,
                                 CHUNK, 10_000)
    rng = np.random.default_rng(actor_id)
    buf = writer = weights = None
    try:
        if mode == "shmbuf":
            buf = ReplayBuffer.attach(names[0])
            writer = buf.writer(lane=actor_id)
            weights = WeightStore.attach(names[1])
            extend = writer.extend
            actor = apex_atari.ApexActor(cfg, actor_id, rng, lambda rows, _p: extend(rows),
                                         writer.end_episode, weights)
        else:  # the same weights (an untimed read), so both act alike
            weights = WeightStore.attach(names[1])
            env = apex_atari.make_env(args["env"], 0)
            net = apex_atari.QNetwork(env.frame_shape, STACK, env.n_actions, env.scale)
            env.close()
            weights.load_into(net)
            actor = apex_atari.ApexActor(cfg, actor_id, rng, None, None, None, net=net)
        actor.run(lambda: False, max_steps=20)  # warm: the first steps load and fault in
        go.wait(SETUP_TIMEOUT)
        steps0, t0, c0 = actor.steps, time.perf_counter(), time.process_time()
        end = t0 + args["seconds"]
        actor.run(lambda: time.perf_counter() >= end)
        results.put((mode, actor_id, actor.steps - steps0, time.perf_counter() - t0,
                     time.process_time() - c0, actor.episodes))
    finally:
        for held in (writer, weights, buf):
            if held is not None:
                held.close()


def measure_actors(mode: str, args: dict[str, Any], names: tuple[str, str],
                   store: WeightStore, params: dict[str, Any]) -> dict[str, float]:
    """Start the actors, let them run ``seconds`` together (publishing meanwhile in "shmbuf"
    mode), and sum what they report."""
    ctx = multiprocessing.get_context("spawn")
    n = args["actors"]
    go, results = ctx.Barrier(n + 1), ctx.Queue()
    procs = [ctx.Process(target=actor_proc, args=(mode, i, args, names, go, results))
             for i in range(n)]
    for p in procs:
        p.start()
    try:
        go.wait(SETUP_TIMEOUT)
        end = time.perf_counter() + args["seconds"]
        while mode == "shmbuf" and time.perf_counter() < end:
            store.publish(params)
            time.sleep(1.0 / args["publish_hz"])
        got = [results.get(timeout=args["seconds"] + SETUP_TIMEOUT) for _ in range(n)]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    steps = sum(g[2] for g in got)
    return {"steps": steps, "steps_per_s": sum(g[2] / g[3] for g in got),
            "steps_per_cpu_s": steps / sum(g[4] for g in got),
            "cpu_share": sum(g[4] for g in got) / sum(g[3] for g in got),
            "episodes": sum(g[5] for g in got)}


def bench_actors(args: argparse.Namespace) -> dict[str, Any]:
    env = apex_atari.make_env(args.env, 0)
    net = apex_atari.QNetwork(env.frame_shape, STACK, env.n_actions, env.scale)
    env.close()
    params = {k: v.numpy() for k, v in net.state_dict().items()}
    shared = {"env": args.env, "actors": args.actors, "seconds": args.seconds,
              "publish_hz": args.publish_hz}
    runs: dict[str, list[dict[str, float]]] = {"alone": [], "shmbuf": []}
    with ReplayBuffer.create(frame_spec(env.frame_shape), args.actor_rows, lanes=args.actors,
                             next_obs="derived", episode_spec=apex_atari.EPISODE_SPEC) as buf, \
            WeightStore.create(template=params) as store:
        store.publish(params)
        names = (buf.name, store.name)
        for r in range(args.rounds):
            order = ("alone", "shmbuf") if r % 2 == 0 else ("shmbuf", "alone")
            for mode in order:
                print(f"  actors: round {r + 1}/{args.rounds} {mode}", file=sys.stderr,
                      flush=True)
                runs[mode].append(measure_actors(mode, shared, names, store, params))
        versions = store.version
    per_cpu = [s["steps_per_cpu_s"] / a["steps_per_cpu_s"]
               for a, s in zip(runs["alone"], runs["shmbuf"])]
    wall = [s["steps_per_s"] / a["steps_per_s"] for a, s in zip(runs["alone"], runs["shmbuf"])]
    return {"runs": runs, "ratio_per_cpu_s": statistics.median(per_cpu),
            "ratio_per_cpu_s_rounds": per_cpu, "ratio_wall": statistics.median(wall),
            "versions_published": versions,
            "weights_bytes": int(sum(v.nbytes for v in params.values()))}


def bench_actor_inprocess(args: argparse.Namespace) -> dict[str, Any]:
    """One actor in this process, alone and with shmbuf, alternating blocks of ``SYNC`` steps
    by CPU time: before each shmbuf block a new version is published (untimed), so every
    refresh the block makes copies the weights, as in the worst case of the multiprocess run;
    free of the scheduler's noise, which the multiprocess figure on a shared box is not."""
    import torch

    torch.set_num_threads(1)
    sync = 100
    cfg = apex_atari.ActorConfig(args.env, args.actors, "", STACK, NSTEP, GAMMA, CHUNK,
                                 10_000, sync)
    env = apex_atari.make_env(args.env, 0)
    net = apex_atari.QNetwork(env.frame_shape, STACK, env.n_actions, env.scale)
    env.close()
    params = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    cpu: dict[str, list[float]] = {"alone": [], "shmbuf": []}
    with ReplayBuffer.create(frame_spec(env.frame_shape), args.actor_rows, next_obs="derived",
                             episode_spec=apex_atari.EPISODE_SPEC) as buf, \
            buf.writer(lane=0) as writer, WeightStore.create(template=params) as store:
        store.publish(params)
        actors = {
            "alone": apex_atari.ApexActor(cfg, 0, np.random.default_rng(0), None, None, None,
                                          net=net),  # the weights the other one reads
            "shmbuf": apex_atari.ApexActor(cfg, 0, np.random.default_rng(0),
                                           lambda rows, _p: writer.extend(rows),
                                           writer.end_episode, store)}
        for actor in actors.values():
            actor.run(lambda: False, max_steps=sync)  # warm
        for r in range(args.rounds):
            print(f"  actors in-process: round {r + 1}/{args.rounds}", file=sys.stderr,
                  flush=True)
            for mode in (("alone", "shmbuf") if r % 2 == 0 else ("shmbuf", "alone")):
                actor, took = actors[mode], 0.0
                steps0 = actor.steps
                for _ in range(args.blocks):
                    if mode == "shmbuf":
                        store.publish(params)
                    c0 = time.process_time()
                    actor.run(lambda: False, max_steps=actor.steps + sync)
                    took += time.process_time() - c0
                cpu[mode].append((actor.steps - steps0) / took)
    per_round = [s / a for a, s in zip(cpu["alone"], cpu["shmbuf"])]
    return {"steps_per_cpu_s": cpu, "ratio": statistics.median(per_round),
            "rounds": per_round, "sync_every": sync}


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------
def shm_bytes(buf: ReplayBuffer) -> int:
    return os.stat(f"/dev/shm/{buf.name}").st_size


def bench_memory(args: argparse.Namespace) -> dict[str, Any]:
    import gymnasium as gym
    from stable_baselines3.common.buffers import ReplayBuffer as SB3Buffer

    n, length = args.memory_rows, args.episode_length
    transitions = n * length / (length + 1)  # one extra row per episode end (derived next_obs)
    spec = frame_spec()
    row = sum(int(np.prod(f.shape)) * f.dtype.itemsize for f in spec.values())
    with ReplayBuffer.create(spec, n, next_obs="derived",
                             episode_spec=apex_atari.EPISODE_SPEC) as buf:
        derived = shm_bytes(buf) / transitions
    stacked_spec = Spec(obs=((STACK, *FRAME), "uint8"), next_obs=((STACK, *FRAME), "uint8"),
                        action=((), "uint8"), reward=((), "float32"), terminated=((), "bool"))
    with ReplayBuffer.create(stacked_spec, n) as buf:
        stacked = shm_bytes(buf) / n
    sb3 = SB3Buffer(n, gym.spaces.Box(0, 255, (STACK, *FRAME), np.uint8),
                    gym.spaces.Discrete(6), device="cpu", optimize_memory_usage=True,
                    handle_timeout_termination=False)
    sb3_bytes = sum(v.nbytes for v in vars(sb3).values() if isinstance(v, np.ndarray)) / n
    del sb3
    return {"rows": n, "episode_length": length, "frame_plus_scalars": row,
            "shmbuf_derived": derived, "ratio": derived / row, "shmbuf_stacked": stacked,
            "sb3_optimize_memory_usage": sb3_bytes,
            "cpprb_stack_compress": cpprb_memory(min(n, 5_000))}


def cpprb_memory(n: int) -> float | None:
    """Bytes per row cpprb's stack_compress buffer allocates (its arrays hold one frame per
    row plus the stack's tail), from the process's resident size; None without cpprb."""
    try:
        from cpprb import ReplayBuffer as CpprbBuffer  # type: ignore[import-untyped]
    except ImportError:
        return None

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    rb = CpprbBuffer(n, cpprb_env_dict(), next_of="obs", stack_compress="obs")
    stack = np.ones((*FRAME, STACK), np.uint8)
    for _ in range(n + STACK):  # every row written: its pages resident
        rb.add(obs=stack, act=1, rew=0.0, next_obs=stack, done=0.0)
    used = (rss() - before) / n
    del rb
    return used


# --------------------------------------------------------------------------------------------
# Learner
# --------------------------------------------------------------------------------------------
def cpprb_env_dict() -> dict[str, Any]:
    return {"obs": {"shape": (*FRAME, STACK), "dtype": np.uint8}, "act": {"dtype": np.uint8},
            "rew": {}, "done": {}}


def episodes_of(rows: int, length: int, rng: np.random.Generator) -> list[int]:
    """Episode lengths adding up to ``rows``, about ``length`` each."""
    out, left = [], rows
    while left > 0:
        k = min(left, int(rng.integers(length // 2, 3 * length // 2)))
        out.append(k)
        left -= k
    return out


def fill_shmbuf(buf: ReplayBuffer, frames: np.ndarray, lengths: list[int]) -> None:
    with buf.writer(lane=0) as w:
        i = 0
        for k in lengths:
            for s in range(0, k, CHUNK):
                m = min(CHUNK, k - s)
                idx = (i + s + np.arange(m + 1)) % len(frames)
                w.extend({"obs": frames[idx[:-1]], "next_obs": frames[idx[1:]],
                          "action": np.ones(m, np.uint8), "reward": np.ones(m, np.float32),
                          "terminated": np.arange(s, s + m) == k - 1,
                          "version": np.zeros(m, np.int32)})
            w.end_episode()
            i += k


def fill_cpprb(rb: Any, frames: np.ndarray, lengths: list[int]) -> None:
    i = 0
    for k in lengths:
        stack = np.zeros((*FRAME, STACK), np.uint8)
        for s in range(k):
            nxt = np.concatenate([stack[..., 1:], frames[(i + s + 1) % len(frames)][..., None]],
                                 axis=-1)
            rb.add(obs=stack, act=1, rew=1.0, next_obs=nxt, done=float(s == k - 1))
            stack = nxt
        rb.on_episode_end()
        i += k


def pool_step(pool: SamplerPool, tds: list[np.ndarray]) -> Any:
    """The learner's loop body: the next batch, and new priorities for its rows."""
    cycle = itertools.cycle(tds)

    def step() -> None:
        batch = pool.next()
        pool.update_priorities(batch.indices, next(cycle))

    return step


def timed_batches(step: Any, seconds: float) -> float:
    """Batches per second of ``step()`` over about ``seconds`` (after one untimed call)."""
    step()
    n, took = benchlib.calls_for(step, seconds)
    return n / took


def bench_learner(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (4_096, *FRAME), dtype=np.uint8)
    lengths = episodes_of(args.rows, args.episode_length, rng)
    tds = [np.abs(rng.standard_normal(B)) + 1e-3 for _ in range(16)]
    out: dict[str, Any] = {"rows": args.rows, "batch": B}
    rates: dict[str, list[float]] = {}
    plan = Plan(frame_stack=STACK, n_step=NSTEP, gamma=GAMMA)
    with ReplayBuffer.create(frame_spec(), args.rows + len(lengths) + 1,
                             next_obs="derived") as buf:
        print("  learner: filling shmbuf", file=sys.stderr, flush=True)
        fill_shmbuf(buf, frames, lengths)
        pools = {f"shmbuf, {w} workers" if w else "shmbuf, in-process":
                 SamplerPool(buf, B, selection=Prioritized(alpha=ALPHA, beta=BETA), plan=plan,
                             workers=w, seed=0, timeout=120) for w in (0, 2)}
        try:
            cases: dict[str, Any] = {name: pool_step(pool, tds) for name, pool in pools.items()}
            cases.update(cpprb_cases(frames, lengths, tds))
            waits: dict[str, list[float]] = {}
            for r in range(args.rounds):
                print(f"  learner: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                names = list(cases) if r % 2 == 0 else list(cases)[::-1]
                for name in names:
                    pool = pools.get(name)
                    w0, t0 = (pool.stats()["learner_wait_s"] if pool else 0.0), time.perf_counter()
                    rates.setdefault(name, []).append(timed_batches(cases[name], args.seconds))
                    if pool is not None:
                        waits.setdefault(name, []).append(
                            (pool.stats()["learner_wait_s"] - w0) / (time.perf_counter() - t0))
            out["wait_no_train"] = {k: statistics.median(v) for k, v in waits.items()}
            # the learner's wait while it trains (a stand-in: a busy loop), workers filling
            pool = pools["shmbuf, 2 workers"]
            step = pool_step(pool, tds)
            w0, t0 = pool.stats()["learner_wait_s"], time.perf_counter()
            n = 0
            while time.perf_counter() - t0 < args.seconds:
                step()
                benchlib.busy(args.train_ms / 1000)
                n += 1
            took = time.perf_counter() - t0
            out["wait_with_train"] = {
                "train_ms": args.train_ms, "batches_per_s": n / took,
                "learner_wait_frac": (pool.stats()["learner_wait_s"] - w0) / took}
        finally:
            for pool in pools.values():
                pool.close()
    out["batches_per_s"] = {k: statistics.median(v) for k, v in rates.items()}
    out["rounds"] = rates
    base = "cpprb next_of+stack_compress (1-step)"
    if base in rates:
        out["ratio_vs_cpprb"] = {k: statistics.median([a / b for a, b in zip(v, rates[base])])
                                 for k, v in rates.items() if k.startswith("shmbuf")}
    return out


def cpprb_cases(frames: np.ndarray, lengths: list[int], tds: list[np.ndarray]
                ) -> dict[str, Any]:
    """cpprb's prioritized buffer with stack_compress and next_of, filled with the same
    episodes: sample(512) + update_priorities, 1-step (obs and next_obs stacks, as shmbuf's
    batch) and with its Nstep (which then leaves next_obs out). Empty without cpprb."""
    try:
        from cpprb import PrioritizedReplayBuffer  # type: ignore[import-untyped]
    except ImportError:
        print("  learner: cpprb is not installed: no comparison", file=sys.stderr)
        return {}
    rows = sum(lengths)
    out = {}
    for name, extra in (("cpprb next_of+stack_compress (1-step)", {}),
                        ("cpprb +Nstep (no next_obs in its samples)",
                         {"Nstep": {"size": NSTEP, "gamma": GAMMA, "rew": "rew",
                                    "next": "next_obs"}})):
        rb = PrioritizedReplayBuffer(rows + 1, cpprb_env_dict(), alpha=ALPHA, next_of="obs",
                                     stack_compress="obs", **extra)
        print(f"  learner: filling {name}", file=sys.stderr, flush=True)
        fill_cpprb(rb, frames, lengths)

        cycle = itertools.cycle(tds)

        def step(rb: Any = rb, cycle: Any = cycle) -> None:
            s = rb.sample(B, beta=BETA)
            rb.update_priorities(s["indexes"], next(cycle))

        out[name] = step
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    resolve = benchlib.add_run_options(p, "short rounds, small buffers", seconds=10.0,
                                       quick_seconds=4.0, rounds=3, quick_rounds=2)
    default_env = "ALE/Pong-v5"
    try:
        import ale_py  # noqa: F401
    except ImportError:
        default_env = "MinAtar/Breakout"
    p.add_argument("--env", default=default_env, help="the actors' game (examples/apex_atari.py)")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--publish-hz", type=float, default=2.0,
                   help="weight publications per second while the actors run")
    p.add_argument("--rows", type=int, default=None, help="rows of the learner's buffers "
                   "(default 20000, 5000 with --quick)")
    p.add_argument("--episode-length", type=int, default=1000, help="mean steps per episode")
    p.add_argument("--train-ms", type=float, default=50.0,
                   help="the learner's train step while its wait is measured")
    p.add_argument("--blocks", type=int, default=20,
                   help="blocks of 100 steps per mode per round of the in-process actor")
    p.add_argument("--part", choices=["all", "actors", "actors-inprocess", "memory", "learner"], default="all")
    args = p.parse_args()
    args.rounds, args.seconds = resolve(args)
    args.rows = args.rows or (5_000 if args.quick else 20_000)
    args.actor_rows = 4_096
    args.memory_rows = 10_000
    need = args.rows * 7_200 + args.actors * args.actor_rows * 7_200
    if not benchlib.has_space("bench_apex", need, 2 * need, "2g"):
        return 2
    clock = benchlib.RunClock()
    doc: dict[str, Any] = {"machine": benchlib.machine_line(benchlib.machine()),
                           "env": args.env, "targets": []}
    print(doc["machine"])
    if args.part in ("all", "actors"):
        a = doc["actors"] = bench_actors(args)
        print(f"actors ({args.actors} x {args.env}, {args.seconds:g} s x {args.rounds} rounds, "
              f"weights {a['weights_bytes'] / 1e6:.1f} MB published {args.publish_hz:g}/s):")
        for mode in ("alone", "shmbuf"):
            runs = a["runs"][mode]
            print(f"  {mode:7s} env steps/s {statistics.median(r['steps_per_s'] for r in runs):7.0f}"
                  f"  per actor CPU-second "
                  f"{statistics.median(r['steps_per_cpu_s'] for r in runs):7.0f}"
                  f"  CPU share {statistics.median(r['cpu_share'] for r in runs):.2f}")
        print(f"  shmbuf / alone per CPU-second {a['ratio_per_cpu_s']:.3f} (rounds "
              f"{', '.join(f'{x:.3f}' for x in a['ratio_per_cpu_s_rounds'])}; target >= 0.95)"
              f"; wall {a['ratio_wall']:.3f}")
        doc["targets"].append({"name": "actors per CPU-second", "value": a["ratio_per_cpu_s"],
                               "target": 0.95, "pass": a["ratio_per_cpu_s"] >= 0.95})
    if args.part in ("all", "actors", "actors-inprocess"):
        one = doc["actor_inprocess"] = bench_actor_inprocess(args)
        print(f"one actor in-process ({args.env}), blocks of {one['sync_every']} steps, a new "
              f"version copied in each: shmbuf / alone per CPU-second {one['ratio']:.3f} (rounds "
              f"{', '.join(f'{x:.3f}' for x in one['rounds'])}; "
              f"{statistics.median(one['steps_per_cpu_s']['alone']):.0f} steps per CPU-second "
              f"alone)")
        doc["targets"].append({"name": "one actor per CPU-second", "value": one["ratio"],
                               "target": 0.95, "pass": one["ratio"] >= 0.95})
    if args.part in ("all", "memory"):
        m = doc["memory"] = bench_memory(args)
        print(f"memory per stored transition ({m['rows']} rows, episodes of "
              f"{m['episode_length']}):")
        print(f"  one 84x84 frame + scalars      {m['frame_plus_scalars']:8.0f} B")
        print(f"  shmbuf, derived next_obs       {m['shmbuf_derived']:8.0f} B  "
              f"{m['ratio']:.3f}x (target <= 1.1x)")
        cp = m["cpprb_stack_compress"]
        if cp is not None:
            print(f"  cpprb stack_compress+next_of   {cp:8.0f} B  "
                  f"{cp / m['frame_plus_scalars']:.2f}x (resident, 5000 rows)")
        print(f"  SB3 optimize_memory_usage      {m['sb3_optimize_memory_usage']:8.0f} B  "
              f"{m['sb3_optimize_memory_usage'] / m['frame_plus_scalars']:.2f}x")
        print(f"  shmbuf, stacked obs+next_obs   {m['shmbuf_stacked']:8.0f} B  "
              f"{m['shmbuf_stacked'] / m['frame_plus_scalars']:.2f}x")
        doc["targets"].append({"name": "memory per transition", "value": m["ratio"],
                               "target": 1.1, "pass": m["ratio"] <= 1.1})
    if args.part in ("all", "learner"):
        learner = doc["learner"] = bench_learner(args)
        print(f"learner (B={B}, frame stack {STACK}, n-step {NSTEP}, prioritized + update, "
              f"{args.rows} rows, {args.seconds:g} s x {args.rounds} rounds):")
        for name, rate in learner["batches_per_s"].items():
            vs = learner.get("ratio_vs_cpprb", {}).get(name)
            print(f"  {name:44s} {rate:7.1f} batches/s"
                  + (f"  {vs:.2f}x cpprb (1-step)" if vs is not None else ""))
        w = learner["wait_with_train"]
        print(f"  learner wait with 2 workers: {100 * learner['wait_no_train']['shmbuf, 2 workers']:.0f}%"
              f" taking batches flat out; {100 * w['learner_wait_frac']:.0f}% with a "
              f"{w['train_ms']:g} ms train step ({w['batches_per_s']:.1f} batches/s)")
    runtime, others = clock.stop()
    print(benchlib.runtime_line(runtime, others))
    return benchlib.finish(args, doc)


if __name__ == "__main__":
    sys.exit(main())
