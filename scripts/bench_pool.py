#!/usr/bin/env python
"""Sampler-pool benchmark: what the learner pays per batch, and what the pool buys a training loop.

In one run, on the same buffers (ratios are measured side by side; this machine is noisy):
  1. learner-side seconds per batch: ``pool.next()`` against in-process ``buf.sample()``;
  2. a training loop whose train step takes as long as one in-process sample: batches/s with the
     pool against in-process sampling;
  3. batches/s and GB/s against ``n_workers`` from 1 to the number of cores (PNG plot);
  4. learner batches/s (no train step) while an actor process inserts single transitions as
     fast as it can; both rates.

    python scripts/bench_pool.py [--quick] [--json out.json] [--plot bench-out/pool_scaling.png]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any, Iterator

import numpy as np

from shmbuf import ReplayBuffer, Spec
from workers import ActorContext, ActorGroup, SamplerPool

WORKLOADS = {
    "atari": dict(obs=((4, 84, 84), "uint8"), next_obs=((4, 84, 84), "uint8"),
                  action=((), "int64"), reward=((), "float32"), done=((), "bool")),
    "mujoco": dict(obs=((17,), "float32"), next_obs=((17,), "float32"), action=((6,), "float32"),
                   reward=((), "float32"), done=((), "bool")),
}
CASES = [("atari", 32), ("atari", 256), ("mujoco", 256)]


def random_rows(spec: Spec, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for name, f in spec.items():
        if f.dtype.kind == "u":
            out[name] = rng.integers(0, 255, (n, *f.shape), dtype=f.dtype)
        elif f.dtype.kind == "b":
            out[name] = rng.random((n, *f.shape)) < 0.01
        elif f.dtype.kind == "i":
            out[name] = rng.integers(0, 6, (n, *f.shape)).astype(f.dtype)
        else:
            out[name] = rng.standard_normal((n, *f.shape)).astype(f.dtype)
    return out


@contextlib.contextmanager
def filled_buffer(workload: str, capacity: int) -> Iterator[ReplayBuffer]:
    spec = Spec(WORKLOADS[workload])
    rng = np.random.default_rng(0)
    with ReplayBuffer.create(spec, capacity=capacity) as buf:
        with buf.writer() as w:
            chunk = random_rows(spec, min(capacity, 5000), rng)
            while w.committed < capacity:
                w.extend(chunk)
        yield buf


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def median_time(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def learner_cost(buf: ReplayBuffer, batch: int, workers: int, n: int) -> dict[str, float]:
    """(1) In-process sample time vs the time next() takes when the ring has refilled."""
    rng = np.random.default_rng(1)
    for _ in range(10):
        buf.sample(batch, rng)
    t_sample = median_time(lambda: buf.sample(batch, rng), n)
    with SamplerPool(buf, batch_size=batch, n_workers=workers, n_staging=2 * workers + 2,
                     seed=0) as pool:
        for _ in range(2 * workers + 2):
            pool.next()
        times = []
        for _ in range(n):
            busy(2 * t_sample)  # the "train step": long enough for the workers to refill
            t = time.perf_counter()
            pool.next()
            times.append(time.perf_counter() - t)
    t_next = statistics.median(times)
    return {"in_process_s": t_sample, "pool_next_s": t_next, "ratio": t_next / t_sample}


def training_loop(buf: ReplayBuffer, batch: int, workers: int, seconds: float) -> dict[str, float]:
    """(2) A loop whose train step costs one in-process sample: pool vs in-process."""
    rng = np.random.default_rng(2)
    t_sample = median_time(lambda: buf.sample(batch, rng), 50)
    rates = {"in_process": [], "pool": []}
    with SamplerPool(buf, batch_size=batch, n_workers=workers, seed=0) as pool:
        for _ in range(3):  # alternate the two loops: the machine's noise hits both alike
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                busy(t_sample)
                buf.sample(batch, rng)
                n += 1
            rates["in_process"].append(n / (time.perf_counter() - start))
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                pool.next()
                busy(t_sample)
                n += 1
            rates["pool"].append(n / (time.perf_counter() - start))
    ip, pl = statistics.median(rates["in_process"]), statistics.median(rates["pool"])
    return {"train_step_s": t_sample, "in_process_bps": ip, "pool_bps": pl, "speedup": pl / ip}


def pool_rate(buf: ReplayBuffer, batch: int, workers: int, seconds: float) -> float:
    with SamplerPool(buf, batch_size=batch, n_workers=workers, seed=0) as pool:
        for _ in range(20):
            pool.next()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            pool.next()
            n += 1
        return n / (time.perf_counter() - start)


def scaling(buf: ReplayBuffer, batch: int, max_workers: int, seconds: float) -> list[dict[str, float]]:
    """(3) batches/s against n_workers."""
    row_bytes = buf.spec.row_nbytes
    out = []
    for n in range(1, max_workers + 1):
        bps = pool_rate(buf, batch, n, seconds)
        out.append({"n_workers": n, "batches_per_s": bps, "gb_per_s": bps * batch * row_bytes / 1e9})
    return out


def inserting_actor(ctx: ActorContext) -> None:
    """Inserts single Atari transitions as fast as it can."""
    rng = np.random.default_rng(ctx.actor_id)
    frames = rng.integers(0, 255, (16, 4, 84, 84), dtype=np.uint8)
    w = ctx.writer
    t = 0
    while not ctx.stopping:
        w.add(obs=frames[t & 15], next_obs=frames[(t + 1) & 15], action=t % 6, reward=1.0,
              done=False)
        t += 1


def with_actor(capacity: int, batch: int, workers: int, seconds: float) -> dict[str, float]:
    """(4) Learner batches/s while one actor process inserts single transitions."""
    spec = Spec(WORKLOADS["atari"])
    with ReplayBuffer.create(spec, capacity=capacity, lanes=2) as buf:
        with buf.writer(lane=1) as w:  # a full lane to sample from while lane 0 fills
            rows = random_rows(spec, 2000, np.random.default_rng(0))
            while w.committed < capacity:
                w.extend(rows)
        with ActorGroup(inserting_actor, 1, buf, lanes=[0]) as group, \
                SamplerPool(buf, batch_size=batch, n_workers=workers, seed=0) as pool:
            for _ in range(20):
                pool.next()
            c0, n, start = int(buf.committed(0)), 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                pool.next()
                n += 1
            elapsed = time.perf_counter() - start
            inserts = int(buf.committed(0)) - c0
            group.poll()
    return {"n_workers": workers, "learner_bps": n / elapsed, "actor_inserts_per_s": inserts / elapsed,
            "gb_per_s": n / elapsed * batch * spec.row_nbytes / 1e9}


def plot(rows: list[dict[str, float]], path: str, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install 'shmbuf[bench]'): no plot"
    n = [r["n_workers"] for r in rows]
    bps = [r["batches_per_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(n, bps, "o-", label="measured")
    ax.plot(n, [bps[0] * k for k in n], "--", color="gray", label="linear (1 worker x n)")
    ax.plot(n, [0.8 * bps[0] * k for k in n], ":", color="gray", label="target 0.8 x linear")
    ax.set_xlabel("n_workers")
    ax.set_ylabel("batches/s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small buffers, short runs (smoke test)")
    p.add_argument("--workers", type=int, default=None, help="workers for 1, 2, 4 (default: cores)")
    p.add_argument("--max-workers", type=int, default=None, help="(3) up to this many workers")
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--plot", default="bench-out/pool_scaling.png")
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = p.parse_args(argv)
    cores = os.cpu_count() or 2
    workers = args.workers or cores
    max_workers = args.max_workers or cores
    quick = args.quick
    cap = {"atari": 2000 if quick else 50_000, "mujoco": 20_000 if quick else 1_000_000}
    n_calls, secs = (30, 0.5) if quick else (300, 3.0)
    results: dict[str, Any] = {"cores": cores, "workers": workers}
    verdicts = []

    print(f"bench_pool: {cores} cores, numpy {np.__version__}, {workers} workers"
          f"{' (quick)' if quick else ''}\n")
    print("(1) learner-side cost per batch: pool.next() vs in-process buf.sample()")
    print(f"    {'workload':<8} {'batch':>5} {'in-process':>12} {'pool next()':>12} {'ratio':>8}")
    results["learner_cost"] = []
    for workload, batch in CASES:
        with filled_buffer(workload, cap[workload]) as buf:
            r = learner_cost(buf, batch, workers, n_calls)
        r.update(workload=workload, batch=batch)
        results["learner_cost"].append(r)
        print(f"    {workload:<8} {batch:>5} {r['in_process_s'] * 1e6:>9.1f} us "
              f"{r['pool_next_s'] * 1e6:>9.1f} us {r['ratio']:>8.3f}  (1/{1 / r['ratio']:.0f})")
        if (workload, batch) == ("atari", 256):
            verdicts.append(("learner cost <= 1/20 of in-process, atari 256", r["ratio"] <= 1 / 20,
                             f"1/{1 / r['ratio']:.0f}"))

    print("\n(2) training loop, train step = one in-process sample time")
    results["training_loop"] = []
    best = None
    with filled_buffer("atari", cap["atari"]) as buf:
        for n in sorted({1, workers}):
            r = training_loop(buf, 256, n, secs)
            r["n_workers"] = n
            results["training_loop"].append(r)
            print(f"    atari 256, {n} worker(s): train step {r['train_step_s'] * 1e3:.2f} ms, "
                  f"in-process {r['in_process_bps']:.0f} batches/s, pool {r['pool_bps']:.0f} "
                  f"batches/s: {r['speedup']:.2f}x")
            best = r if best is None or r["speedup"] > best["speedup"] else best
    verdicts.append((f"training loop >= 1.6x on {cores} cores", best["speedup"] >= 1.6,
                     f"{best['speedup']:.2f}x with {best['n_workers']} worker(s)"))

    print("\n(3) scaling with n_workers (atari batch 256, no train step)")
    with filled_buffer("atari", cap["atari"]) as buf:
        rows = scaling(buf, 256, max_workers, secs)
    results["scaling"] = rows
    for r in rows:
        eff = r["batches_per_s"] / (r["n_workers"] * rows[0]["batches_per_s"])
        r["efficiency"] = eff
        print(f"    {r['n_workers']} worker(s): {r['batches_per_s']:7.0f} batches/s "
              f"{r['gb_per_s']:6.2f} GB/s  ({eff:.2f} of linear)")
    print("    " + plot(rows, args.plot, f"atari batch 256, {cores} cores"))
    worst = min(rows, key=lambda r: r["efficiency"])
    verdicts.append(("scaling >= 0.8 x n x one-worker rate", worst["efficiency"] >= 0.8,
                     f"worst {worst['efficiency']:.2f} at {worst['n_workers']} workers"))

    print("\n(4) learner batches/s (no train step) while one actor inserts single transitions")
    results["with_actor"] = []
    best = None
    for n in sorted({1, workers}):
        r = with_actor(cap["atari"], 256, n, secs)
        results["with_actor"].append(r)
        print(f"    {n} worker(s): learner {r['learner_bps']:.0f} atari-256 batches/s "
              f"({r['gb_per_s']:.2f} GB/s) with the actor at {r['actor_inserts_per_s']:,.0f} "
              f"inserts/s")
        ok = r["learner_bps"] >= 600 and r["actor_inserts_per_s"] > 50_000
        best = r if best is None or (ok, r["learner_bps"]) > (best[0], best[1]["learner_bps"]) \
            else best
        best = (ok, r) if not isinstance(best, tuple) else best
    ok, r = best
    verdicts.append(("learner >= 600 batches/s with actor > 50k inserts/s", ok,
                     f"{r['learner_bps']:.0f} batches/s, {r['actor_inserts_per_s']:,.0f} inserts/s"))

    print("\ntargets:")
    for name, ok, detail in verdicts:
        print(f"    {'PASS' if ok else 'MISS'}  {name}: {detail}")
    results["verdicts"] = [{"target": n, "pass": ok, "measured": d} for n, ok, d in verdicts]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if args.check and not all(ok for _, ok, _ in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
