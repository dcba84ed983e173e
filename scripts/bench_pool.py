#!/usr/bin/env python
"""Sampler-pool benchmark: what the learner pays per batch, and what the pool buys a training loop.

In one run, on the same buffers (ratios are measured side by side; this machine is noisy):
  0. the learner's time inside ``pool.next()`` with a 5 ms train step (sleep) between batches,
     p50/p99, 1 and 4 workers (``--base DIR``: beside the same in a checkout of another commit);
     0b: the same with a 20 ms step, 4 workers and the other cores busy (workers block, and
     next() wakes them);
  1. learner-side seconds per batch: ``pool.next()`` against in-process ``buf.sample()``;
  2. a training loop whose train step takes as long as one in-process sample: batches/s with the
     pool against in-process sampling;
  3. batches/s and GB/s against ``n_workers`` from 1 to the number of cores (PNG plot);
  4. learner batches/s (no train step) while an actor process inserts single transitions as
     fast as it can, or at ``--actor-rate`` inserts/s; both rates. Unpaced, a faster ``add``
     also puts more memory traffic beside the learner: compare commits at one paced rate.

    python scripts/bench_pool.py [--quick] [--json out.json] [--plot bench-out/pool_scaling.png]
                                 [--actor-rate N]

Options shared with the other benchmarks (--quick, --rounds, --seconds, --json, --check) and the
timing loops come from ``benchlib``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from typing import Any, Iterator

import numpy as np

try:
    import benchlib
except ModuleNotFoundError:  # imported as scripts.bench_pool or by path: benchlib is beside it
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import benchlib
from benchlib import busy, calls_for, median_seconds, random_rows, rate_for
from shmbuf import ReplayBuffer, Spec
from workers import ActorContext, ActorGroup, SamplerPool
from workers.config import Workers

WORKLOADS = {
    "atari": dict(obs=((4, 84, 84), "uint8"), next_obs=((4, 84, 84), "uint8"),
                  action=((), "int64"), reward=((), "float32"), done=((), "bool")),
    "mujoco": dict(obs=((17,), "float32"), next_obs=((17,), "float32"), action=((6,), "float32"),
                   reward=((), "float32"), done=((), "bool")),
}
CASES = [("atari", 32), ("atari", 256), ("mujoco", 256)]
# (0b) a train step long enough that each of 4 workers waits 80 ms for its next slot, past the
# 50 ms it naps before it blocks (sampler_proc.NAP_BEFORE_BLOCKING): next() wakes a worker. The
# other cores are kept busy, as actors stepping environments keep them.
LONG_STEP, LONG_STEP_WORKERS = 0.02, 4


@contextlib.contextmanager
def spinning(n: int) -> Iterator[None]:
    """``n`` processes spinning on a core each while inside (killed on the way out)."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def filled_buffer(workload: str, capacity: int) -> Iterator[ReplayBuffer]:
    spec = Spec(WORKLOADS[workload])
    rng = np.random.default_rng(0)
    with ReplayBuffer.create(spec, capacity=capacity) as buf:
        benchlib.fill_repeating(buf, random_rows(spec, min(capacity, 5000), rng), capacity)
        yield buf


def learner_cost(buf: ReplayBuffer, batch: int, workers: int, n: int) -> dict[str, float]:
    """(1) In-process sample time vs the time next() takes when the ring has refilled."""
    rng = np.random.default_rng(1)
    for _ in range(10):
        buf.sample(batch, rng)
    t_sample = median_seconds(lambda: buf.sample(batch, rng), n)
    with SamplerPool(buf, batch_size=batch, workers=Workers(workers, staging=2 * workers + 2),
                     seed=0) as pool:
        for _ in range(2 * workers + 2):
            pool.next()
        # before each call a "train step", long enough for the workers to refill the ring
        t_next = median_seconds(pool.next, n, before=lambda: busy(2 * t_sample))
    return {"in_process_s": t_sample, "pool_next_s": t_next, "ratio": t_next / t_sample}


def sleep_wake(buf: ReplayBuffer, batch: int, workers: int, n: int,
               pause: float = 0.005) -> dict[str, float]:
    """(0) The learner's time inside next() when a train step (a sleep of ``pause``) separates
    the batches: the learner wakes cold, the workers have refilled the ring meanwhile. Also the
    share of calls that had to wake a worker: the held slot's worker was blocked (read before
    the timed call, from its waiting word)."""
    times, woke = [], 0
    with SamplerPool(buf, batch_size=batch, workers=workers, seed=0) as pool:
        for _ in range(2 * workers + 2):
            pool.next()
        d: Any = pool._delivery  # (a RingDelivery holding the last batch)
        for _ in range(n):
            time.sleep(pause)
            woke += d.ring.waiting(1 + d.held.slot % workers)
            t0 = time.perf_counter()
            pool.next()
            times.append(time.perf_counter() - t0)
    times.sort()
    return {"p50_s": times[len(times) // 2],
            "p99_s": times[min(len(times) - 1, len(times) * 99 // 100)], "woke": woke / n}


def timeout_forms(buf: ReplayBuffer, batch: int, workers: int, n: int, rounds: int,
                  pause: float = 0.005) -> dict[str, float]:
    """(0c) ``pool.next()`` against ``pool.next(timeout=10)`` after a train step (a sleep of
    ``pause``), in one pool and process: alternating rounds of ``n`` calls of each form, each
    written out as a direct call (a ``functools.partial`` or a lambda would add cold work of
    its own). The p50 of each form over all its calls, and their ratio."""
    plain: list[float] = []
    timed: list[float] = []
    with SamplerPool(buf, batch_size=batch, workers=workers, seed=0) as pool:
        for _ in range(2 * workers + 2):
            pool.next()
        for _ in range(rounds):
            for _ in range(n):
                time.sleep(pause)
                t0 = time.perf_counter()
                pool.next()
                plain.append(time.perf_counter() - t0)
            for _ in range(n):
                time.sleep(pause)
                t0 = time.perf_counter()
                pool.next(timeout=10)
                timed.append(time.perf_counter() - t0)
    plain.sort()
    timed.sort()
    p50, p50_timeout = plain[len(plain) // 2], timed[len(timed) // 2]
    return {"plain_p50_s": p50, "timeout_p50_s": p50_timeout, "ratio": p50_timeout / p50}


def measure_once(kind: str, workers: int, n: int, quick: bool) -> dict[str, float]:
    """One round of a section that ``--base`` compares, on atari B=256: ``sleep-wake`` (0),
    ``long-step`` (0b: the same with a ``LONG_STEP`` sleep), or ``back-to-back`` (1:
    ``pool.next()`` when the ring has refilled, no sleep in between)."""
    with filled_buffer("atari", 2000 if quick else 20_000) as buf:
        if kind == "sleep-wake":
            return sleep_wake(buf, 256, workers, n)
        if kind == "long-step":
            with spinning(max(1, (os.cpu_count() or 2) - 1)):
                return sleep_wake(buf, 256, workers, n, LONG_STEP)
        return {"next_s": learner_cost(buf, 256, workers, n)["pool_next_s"]}


def cold_wake_calibration(n: int, pause: float = 0.005) -> dict[str, float]:
    """(0)'s yardstick: a fixed pure-Python loop (about 2.6 us warm on a quick core) timed
    back to back, and right after a sleep of ``pause``: what waking cold costs here."""
    def loop() -> None:
        x = 0
        for i in range(140):
            x += i

    def timed() -> float:
        t0 = time.perf_counter()
        loop()
        return time.perf_counter() - t0

    warm = sorted(timed() for _ in range(n))
    cold = []
    for _ in range(n):
        time.sleep(pause)
        cold.append(timed())
    cold.sort()
    return {"warm_p50_s": warm[len(warm) // 2], "p50_s": cold[len(cold) // 2],
            "p99_s": cold[min(len(cold) - 1, len(cold) * 99 // 100)]}


def sleep_wake_rounds(workers: int, n: int, rounds: int, quick: bool,
                      kind: str = "sleep-wake") -> dict[str, float]:
    """Medians over ``rounds`` of ``sleep_wake`` on atari B=256 (``kind``: see measure_once)."""
    runs = [measure_once(kind, workers, n, quick) for _ in range(rounds)]
    return {k: statistics.median(r[k] for r in runs) for k in ("p50_s", "p99_s", "woke")}


def compare_with_base(base: str, kind: str, n: int, rounds: int, quick: bool,
                      workers_list: tuple[int, ...] = (1, 4)) -> list[dict[str, Any]]:
    """``kind`` (see ``measure_once``) here and in ``base`` (a checkout, e.g. a git worktree of
    the base commit), for each of ``workers_list``: each round runs both in fresh subprocesses
    importing shmbuf/workers from their checkout, the order alternating; medians of the
    rounds."""
    import json
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def one(root: str, workers: int) -> dict[str, float]:
        cmd = [sys.executable, os.path.abspath(__file__), "--measure-only", kind,
               "--measure-workers", str(workers), "--calls", str(n)] + (["--quick"] if quick else [])
        out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": root}, capture_output=True,
                             text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    rows = []
    for workers in workers_list:
        runs: dict[str, list[dict[str, float]]] = {here: [], base: []}
        for r in range(rounds):
            for root in (here, base) if r % 2 == 0 else (base, here):
                runs[root].append(one(root, workers))
        row: dict[str, Any] = {"n_workers": workers}
        for k in runs[here][0]:
            row[k] = statistics.median(x[k] for x in runs[here])
            row["base_" + k] = statistics.median(x[k] for x in runs[base])
        rows.append(row)
    return rows


def training_loop(buf: ReplayBuffer, batch: int, workers: int, seconds: float) -> dict[str, float]:
    """(2) A loop whose train step costs one in-process sample: pool vs in-process."""
    rng = np.random.default_rng(2)
    t_sample = median_seconds(lambda: buf.sample(batch, rng), 50)
    rates: dict[str, list[float]] = {"in_process": [], "pool": []}
    with SamplerPool(buf, batch_size=batch, workers=workers, seed=0) as pool:

        def in_process_step() -> None:
            busy(t_sample)
            buf.sample(batch, rng)

        def pool_step() -> None:
            pool.next()
            busy(t_sample)

        for _ in range(3):  # alternate the two loops: the machine's noise hits both alike
            rates["in_process"].append(rate_for(in_process_step, seconds))
            rates["pool"].append(rate_for(pool_step, seconds))
    ip, pl = statistics.median(rates["in_process"]), statistics.median(rates["pool"])
    return {"train_step_s": t_sample, "in_process_bps": ip, "pool_bps": pl, "speedup": pl / ip}


def warm(pool: SamplerPool, seconds: float) -> None:
    """Take batches for a while: every process pays a page fault per 4 KiB page it first
    touches (~7 us each on this VM); measure the steady state a long run lives in."""
    calls_for(pool.next, seconds)


def pool_rate(buf: ReplayBuffer, batch: int, workers: int, seconds: float) -> float:
    with SamplerPool(buf, batch_size=batch, workers=workers, seed=0) as pool:
        warm(pool, seconds)
        return rate_for(pool.next, seconds)


def raw_gather(name: str, batch: int, seconds: float, conn: Any) -> None:
    """A process gathering random rows of every field of the buffer into reused arrays, with
    no shmbuf in the loop: the machine's bandwidth for this access pattern."""
    buf = ReplayBuffer.attach(name)
    try:
        cols = {field: buf.column(field) for field in buf.spec}
        out = {k: np.empty((batch, *v.shape[1:]), v.dtype) for k, v in cols.items()}
        rng = np.random.default_rng(os.getpid())
        rows = len(next(iter(cols.values())))

        def gather() -> None:
            idx = rng.integers(0, rows, batch)
            for k, v in cols.items():
                np.take(v, idx, axis=0, out=out[k], mode="clip")

        with benchlib.releasing([cols, out]):  # views of the segment: gone before close()
            calls_for(gather, seconds)  # warm up, then measure
            conn.send(rate_for(gather, seconds))
    finally:
        buf.close()


def raw_rate(buf: ReplayBuffer, batch: int, procs: int, seconds: float) -> float:
    import multiprocess

    ctx = multiprocess.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(procs)]
    ps = [ctx.Process(target=raw_gather, args=(buf.name, batch, seconds, child))
          for _, child in pipes]
    for p in ps:
        p.start()
    try:
        rates = []
        for parent, _ in pipes:
            if not parent.poll(2 * seconds + 60):
                raise TimeoutError("a raw gathering process did not report within its time")
            rates.append(parent.recv())
    finally:
        for p in ps:
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join(5)
    return sum(rates)


def scaling(buf: ReplayBuffer, batch: int, max_workers: int, seconds: float,
            rounds: int) -> list[dict[str, float]]:
    """(3) batches/s against n_workers, beside n processes gathering the same rows raw; the
    median of ``rounds`` interleaved rounds (this machine's rates swing by 20% run to run)."""
    row_bytes = buf.spec.row_nbytes
    runs: dict[int, list[tuple[float, float]]] = {n: [] for n in range(1, max_workers + 1)}
    for _ in range(rounds):
        for n in runs:
            runs[n].append((pool_rate(buf, batch, n, seconds), raw_rate(buf, batch, n, seconds)))
    out = []
    for n, rs in runs.items():
        bps = statistics.median(r[0] for r in rs)
        raw = statistics.median(r[1] for r in rs)
        out.append({"n_workers": n, "batches_per_s": bps, "gb_per_s": bps * batch * row_bytes / 1e9,
                    "raw_batches_per_s": raw, "raw_gb_per_s": raw * batch * row_bytes / 1e9,
                    "rounds": [r[0] for r in rs]})
    return out


def inserting_actor(ctx: ActorContext, rate: float = 0.0) -> None:
    """Inserts single Atari transitions as fast as it can, or at ``rate`` inserts/s."""
    rng = np.random.default_rng(ctx.actor_id)
    frames = rng.integers(0, 255, (16, 4, 84, 84), dtype=np.uint8)
    w = ctx.writer
    t = 0
    t0 = time.perf_counter()
    while not ctx.stopping:
        w.add(obs=frames[t & 15], next_obs=frames[(t + 1) & 15], action=t % 6, reward=1.0,
              done=False)
        t += 1
        if rate and not t % 256:  # paced: sleep off whatever is ahead of the rate
            ahead = t / rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)


def with_actor(capacity: int, batch: int, workers: int, seconds: float, rate: float = 0.0
               ) -> dict[str, float]:
    """(4) Learner batches/s while one actor process inserts single transitions (``rate``:
    paced at that many inserts/s; 0: as fast as it can)."""
    spec = Spec(WORKLOADS["atari"])
    with ReplayBuffer.create(spec, capacity=capacity, lanes=2) as buf:
        # a full lane to sample from while lane 0 fills
        benchlib.fill_repeating(buf, random_rows(spec, 2000, np.random.default_rng(0)), capacity,
                                lane=1)
        actor = functools.partial(inserting_actor, rate=rate)
        with ActorGroup(actor, 1, buf, lanes=[0]) as group, \
                SamplerPool(buf, batch_size=batch, workers=workers, seed=0) as pool:
            # Steady state: the actor has written a whole lap (its first touch of every page of
            # its lane is behind it) and the workers have read for a while.
            deadline = time.perf_counter() + 120
            while (buf.committed(0) < 1.2 * capacity and time.perf_counter() < deadline):
                pool.next()
            warm(pool, seconds)
            c0 = int(buf.committed(0))
            n, elapsed = calls_for(pool.next, seconds)
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
    ax.plot(n, bps, "o-", label="pool (measured)")
    if "raw_batches_per_s" in rows[0]:
        ax.plot(n, [r["raw_batches_per_s"] for r in rows], "s-", alpha=0.6,
                label="raw gather, n processes")
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


def sleep_wake_section(base: str | None, kind: str, workers_list: tuple[int, ...], n: int,
                       rounds: int, quick: bool) -> list[dict[str, Any]]:
    """(0) or (0b): ``kind`` (see ``measure_once``) for each of ``workers_list``, beside
    ``base`` if given; a line for each."""
    if base:
        rows = compare_with_base(base, kind, n, rounds, quick, workers_list)
    else:
        rows = [{"n_workers": w, **sleep_wake_rounds(w, n, rounds, quick, kind)}
                for w in workers_list]
    for r in rows:
        line = (f"    {r['n_workers']} worker(s): p50 {r['p50_s'] * 1e6:6.1f} us, "
                f"p99 {r['p99_s'] * 1e6:6.1f} us, {r['woke']:.0%} woke a worker")
        if "base_p50_s" in r:
            line += (f" | base p50 {r['base_p50_s'] * 1e6:6.1f} us, p99 "
                     f"{r['base_p99_s'] * 1e6:6.1f} us, {r['base_woke']:.0%} | after/before p50 "
                     f"{r['p50_s'] / r['base_p50_s']:.2f}, p99 {r['p99_s'] / r['base_p99_s']:.2f}")
        print(line)
    return rows


def back_to_back_only(base: str | None, n: int, rounds: int, quick: bool) -> int:
    """``--only back-to-back``: (1) on atari 256 (``learner_cost``), 1 and 4 workers, beside
    ``base`` if given."""
    print(f"(1) pool.next() back to back (ring refilled), atari 256, median of {rounds} rounds")
    if base:
        rows = compare_with_base(base, "back-to-back", n, rounds, quick)
    else:
        rows = [{"n_workers": w, "next_s": statistics.median(
            measure_once("back-to-back", w, n, quick)["next_s"] for _ in range(rounds))}
            for w in (1, 4)]
    for r in rows:
        line = f"    {r['n_workers']} worker(s): next() {r['next_s'] * 1e6:6.1f} us"
        if "base_next_s" in r:
            line += (f" | base {r['base_next_s'] * 1e6:6.1f} us | after/before "
                     f"{r['next_s'] / r['base_next_s']:.2f}")
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    run_options = benchlib.add_run_options(
        p, "small buffers, short runs (smoke test)", seconds=3.0, quick_seconds=0.5,
        rounds=5, quick_rounds=1)  # rounds: (3) and (4) report the median of this many
    p.add_argument("--workers", type=int, default=None, help="workers for 1, 2, 4 (default: cores)")
    p.add_argument("--max-workers", type=int, default=None, help="(3) up to this many workers")
    p.add_argument("--plot", default="bench-out/pool_scaling.png")
    p.add_argument("--actor-rate", type=float, default=0.0,
                   help="(4) pace the actor at this many inserts/s (default: as fast as it can; "
                        "a faster add then also means more memory traffic beside the learner)")
    p.add_argument("--base", default=None,
                   help="(0) also measure this checkout (e.g. a worktree of the base commit)")
    p.add_argument("--only", choices=["sleep-wake", "long-step", "back-to-back"], default=None,
                   help="run only (0) and (0b), only (0b), or only (1) on atari 256 with 1 and 4 "
                        "workers (the sections --base compares)")
    p.add_argument("--measure-only", choices=["sleep-wake", "long-step", "back-to-back"],
                   help=argparse.SUPPRESS)
    p.add_argument("--measure-workers", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, default=None, help="(0) next() calls per round")
    args = p.parse_args(argv)
    if args.measure_only is not None:  # a --base subprocess: one round, JSON out
        import json
        print(json.dumps(measure_once(args.measure_only, args.measure_workers,
                                      args.calls, args.quick)))
        return 0
    rounds, secs = run_options(args)
    cores = os.cpu_count() or 2
    workers = args.workers or cores
    max_workers = args.max_workers or cores
    quick = args.quick
    cap = {"atari": 2000 if quick else 50_000, "mujoco": 20_000 if quick else 1_000_000}
    warm_cap = 2000 if quick else 10_000  # (3), (4): lanes small enough to warm up quickly
    n_calls = 30 if quick else 300
    info = benchlib.machine()
    results: dict[str, Any] = {"machine": info, "cores": cores, "workers": workers}
    verdicts = []

    print(f"bench_pool: {workers} workers{' (quick)' if quick else ''}, {rounds} round(s) of "
          f"{secs:g} s\n{benchlib.machine_line(info)}\n")
    if args.only == "back-to-back":
        return back_to_back_only(args.base, n_calls, rounds, quick)
    n_sw = args.calls or (50 if quick else 400)
    if args.only != "long-step":
        print("(0) learner time inside next() with a 5 ms sleep (train step) between batches, "
              f"atari 256 (median of {rounds} rounds of {n_sw} calls)")
        cold = cold_wake_calibration(n_sw)
        results["cold_wake"] = cold
        print(f"    calibration: a {cold['warm_p50_s'] * 1e6:.1f} us pure-Python loop takes "
              f"{cold['p50_s'] * 1e6:.1f} us p50, {cold['p99_s'] * 1e6:.1f} us p99 right after a "
              f"5 ms sleep on this machine (os.getloadavg: {os.getloadavg()[0]:.1f})")
        results["sleep_wake"] = sleep_wake_section(args.base, "sleep-wake", (1, 4), n_sw, rounds,
                                                   quick)
        for r in results["sleep_wake"]:
            verdicts.append((f"sleep/wake next() <= 20 us p50, <= 50 us p99, {r['n_workers']} "
                             f"worker(s)", r["p50_s"] <= 20e-6 and r["p99_s"] <= 50e-6,
                             f"p50 {r['p50_s'] * 1e6:.1f} us, p99 {r['p99_s'] * 1e6:.1f} us"))
    if args.only in (None, "sleep-wake"):
        n_forms = 40 if quick else 200
        print(f"(0c) next() and next(timeout=10) after a 5 ms sleep, atari 256, 1 worker, one "
              f"pool: {rounds} alternating rounds of {n_forms} calls of each")
        with filled_buffer("atari", 2000 if quick else 20_000) as buf:
            forms = timeout_forms(buf, 256, 1, n_forms, rounds)
        results["timeout_forms"] = forms
        print(f"    next() p50 {forms['plain_p50_s'] * 1e6:.1f} us, next(timeout=10) p50 "
              f"{forms['timeout_p50_s'] * 1e6:.1f} us: ratio {forms['ratio']:.2f}")
        verdicts.append(("next(timeout=10) within 10% of next() after a train step",
                         forms["ratio"] <= 1.10, f"ratio {forms['ratio']:.2f}"))
    n_long = max(10, n_sw // 2)
    print(f"(0b) the same with a {LONG_STEP * 1e3:g} ms train step, {LONG_STEP_WORKERS} workers "
          "(which then block between their batches: next() wakes the one whose slot it hands "
          "back) and every other core kept busy by a spinning process, as actors keep them "
          f"(median of {rounds} rounds of {n_long} calls; reported, not gated)")
    results["long_step"] = sleep_wake_section(args.base, "long-step", (LONG_STEP_WORKERS,),
                                              n_long, rounds, quick)
    if args.only is not None:
        for name, ok, detail in verdicts:
            print(f"    {'PASS' if ok else 'MISS'}  {name}: {detail}")
        return 0

    print("\n(1) learner-side cost per batch: pool.next() vs in-process buf.sample()")
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

    print("\n(3) scaling with n_workers (atari batch 256, no train step), beside n processes "
          "gathering the same rows raw (the machine's bandwidth for this access pattern)")
    with filled_buffer("atari", warm_cap) as buf:
        rows = scaling(buf, 256, max_workers, secs, rounds)
    results["scaling"] = rows
    for r in rows:
        r["efficiency"] = r["batches_per_s"] / (r["n_workers"] * rows[0]["batches_per_s"])
        r["raw_efficiency"] = r["raw_batches_per_s"] / (r["n_workers"] * rows[0]["raw_batches_per_s"])
        r["of_raw"] = r["batches_per_s"] / r["raw_batches_per_s"]
        print(f"    {r['n_workers']} worker(s): {r['batches_per_s']:7.0f} batches/s "
              f"{r['gb_per_s']:6.2f} GB/s ({r['efficiency']:.2f} of linear) | raw gather in "
              f"{r['n_workers']} process(es): {r['raw_gb_per_s']:6.2f} GB/s "
              f"({r['raw_efficiency']:.2f} of linear) | pool = {r['of_raw']:.2f} of raw")
    print("    " + plot(rows, args.plot, f"atari batch 256, {cores} cores"))
    # "Until memory bandwidth is reached": a row passes at 0.8 of linear, or, where raw gathers
    # themselves scale below 0.8 (the bandwidth is reached), at 0.8 of the raw rate.
    ok = all(r["efficiency"] >= 0.8 or (r["raw_efficiency"] < 0.8 and r["of_raw"] >= 0.8)
             for r in rows)
    verdicts.append(("scaling >= 0.8 x n x one-worker rate until memory bandwidth", ok,
                     "; ".join(f"{r['n_workers']}w: {r['efficiency']:.2f} of linear, "
                               f"{r['of_raw']:.2f} of raw (raw scales {r['raw_efficiency']:.2f})"
                               for r in rows)))

    pace = f", paced at {args.actor_rate:,.0f}/s" if args.actor_rate else ", as fast as it can"
    print("\n(4) learner batches/s (no train step) while one actor inserts single transitions"
          + pace)
    results["with_actor"] = []
    best = None
    for n in sorted({1, workers}):
        runs = sorted((with_actor(warm_cap, 256, n, secs, args.actor_rate)
                       for _ in range(rounds)),
                      key=lambda r: r["learner_bps"])
        r = dict(runs[len(runs) // 2], rounds=[(x["learner_bps"], x["actor_inserts_per_s"])
                                                for x in runs])
        results["with_actor"].append(r)
        print(f"    {n} worker(s): learner {r['learner_bps']:.0f} atari-256 batches/s "
              f"({r['gb_per_s']:.2f} GB/s) with the actor at {r['actor_inserts_per_s']:,.0f} "
              f"inserts/s (median of {rounds}; rounds: "
              + ", ".join(f"{b:.0f}/{a / 1e3:.0f}k" for b, a in r["rounds"]) + ")")
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
    results["targets"] = [{"target": n, "pass": ok, "measured": d} for n, ok, d in verdicts]
    return benchlib.finish(args, results)


if __name__ == "__main__":
    sys.exit(main())
