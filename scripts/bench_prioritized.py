#!/usr/bin/env python
"""Prioritized-replay benchmark: prioritized against uniform batches/s, and against cpprb.

On the same buffer, in the same rounds (ratios are taken side by side; this machine is noisy):
  - batches/s of ``SamplerPool(sampler="prioritized")`` with the learner sending new priorities
    (random |TD| values) for every batch, against ``sampler="uniform"``: (a) in-process
    (``n_workers=0``) and (b) with worker processes;
  - cpprb's ``PrioritizedReplayBuffer`` on the same workload (``sample`` + ``update_priorities``
    in one process), where cpprb is installed (``pip install cpprb``; not a shmbuf dependency);
  - the learner-side cost with workers: ``next()`` and ``update_priorities`` per batch, timed
    separately while a train step gives the workers time to refill the staging ring.

Benchmarks report, they do not gate: the exit code is 0 unless ``--check`` is given and a target
is missed. Results and their reading: BENCHMARKS.md.

    python scripts/bench_prioritized.py [--quick] [--workers N] [--json PATH] [--check]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import benchlib
from benchlib import TimedCase, busy
from shmbuf import ReplayBuffer, Spec
from workers import SamplerPool
from workers.config import Workers
from workers.selection import Prioritized

ALPHA, BETA = 0.6, 0.4
FS = "forkserver"  # workers' start method: they do not inherit cpprb's copy of the data
TD_POOL = 64  # distinct |TD| arrays cycled through (the RNG is not what is measured)

WORKLOADS = {
    "mujoco": {
        "spec": {"obs": ((17,), "float32"), "next_obs": ((17,), "float32"),
                 "action": ((6,), "float32"), "reward": ((), "float32"), "done": ((), "bool")},
        "capacity": 1_000_000, "quick_capacity": 100_000, "batches": (256,),
    },
    "atari": {
        "spec": {"obs": ((4, 84, 84), "uint8"), "next_obs": ((4, 84, 84), "uint8"),
                 "action": ((), "int64"), "reward": ((), "float32"), "done": ((), "bool")},
        "capacity": 50_000, "quick_capacity": 5_000, "batches": (32, 256),
    },
}

# Issue 5 sets no numbers. ``--check`` gates on what the design promises instead: with workers,
# the learner's own cost for a prioritized batch (next() + update_priorities) is below what
# sampling that batch in-process costs; and for atari frames the pool is not slower than cpprb.
# (label, workload, batch, metric, threshold); metrics are computed in ``evaluate``.
TARGETS = (
    ("mujoco B=256: learner cost with workers < in-process prioritized batch", "mujoco", 256,
     "in-process/learner", 1.0),
    ("atari B=32: learner cost with workers < in-process prioritized batch", "atari", 32,
     "in-process/learner", 1.0),
    ("atari B=256: learner cost with workers < in-process prioritized batch", "atari", 256,
     "in-process/learner", 1.0),
    ("atari B=256: prioritized with workers >= cpprb PER", "atari", 256,
     "prioritized workers/cpprb PER", 1.0),
)


# ------------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------------
def pool_runner(pool: SamplerPool, tds: list[np.ndarray] | None) -> Callable[[int], float]:
    """n learner iterations: ``next()``, plus ``update_priorities`` when ``tds`` is given."""
    k = [0]

    def run(n: int) -> float:
        nxt, upd = pool.next, pool.update_priorities
        t0 = time.perf_counter()
        if tds is None:
            for _ in range(n):
                nxt()
        else:
            j = k[0]
            for _ in range(n):
                batch = nxt()
                upd(batch.indices, tds[j % TD_POOL])
                j += 1
            k[0] = j
        return time.perf_counter() - t0

    return run


def cpprb_runner(rb: Any, B: int, tds: list[np.ndarray]) -> Callable[[int], float]:
    k = [0]

    def run(n: int) -> float:
        sample, upd = rb.sample, rb.update_priorities
        j = k[0]
        t0 = time.perf_counter()
        for _ in range(n):
            s = sample(B, beta=BETA)
            upd(s["indexes"], tds[j % TD_POOL])
            j += 1
        k[0] = j
        return time.perf_counter() - t0

    return run


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds a live process has used (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0.0
    fields = data[data.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def learner_cost(pool: SamplerPool, tds: list[np.ndarray], train_s: float, n: int
                 ) -> dict[str, float]:
    """Median seconds of ``next()`` and of ``update_priorities`` per batch, with a train step of
    ``train_s`` between batches (the workers refill the ring meanwhile)."""
    t_next, t_upd = [], []
    for j in range(n):
        busy(train_s)
        t0 = time.perf_counter()
        batch = pool.next()
        t1 = time.perf_counter()
        pool.update_priorities(batch.indices, tds[j % TD_POOL])
        t2 = time.perf_counter()
        t_next.append(t1 - t0)
        t_upd.append(t2 - t1)
    return {"next_s": statistics.median(t_next), "update_s": statistics.median(t_upd)}


def make_cpprb(spec: Spec, capacity: int, chunk: dict[str, np.ndarray]) -> tuple[Any, str]:
    """cpprb's PrioritizedReplayBuffer filled like the shmbuf buffer, or (None, why not)."""
    try:
        import cpprb
    except ImportError as e:
        return None, f"cpprb not installed ({e}); pip install cpprb to add this column"
    # cpprb spells a scalar field as shape 1 (shape () makes its buffer allocation fail).
    env_dict = {n: {"shape": f.shape or 1, "dtype": f.dtype} for n, f in spec.items()}
    try:
        rb = cpprb.PrioritizedReplayBuffer(capacity, env_dict, alpha=ALPHA)
        rows = len(next(iter(chunk.values())))
        for _ in range(-(-capacity // rows)):
            rb.add(**chunk)
        return rb, ""
    except Exception as e:  # a build or ABI problem: report it, measure the rest
        return None, f"cpprb failed: {type(e).__name__}: {e}"


def bench_workload(name: str, capacity: int, rounds: int, seconds: float, n_workers: int,
                   cost_calls: int) -> dict[str, Any]:
    wl = WORKLOADS[name]
    spec = Spec(wl["spec"])
    rng = np.random.default_rng(0)
    chunk = benchlib.random_rows(spec, min(capacity, 5000), rng)
    out: dict[str, Any] = {"capacity": capacity, "row_bytes": spec.row_nbytes,
                           "n_workers": n_workers, "batches": {}}
    t0 = time.perf_counter()
    rb, why = make_cpprb(spec, capacity, chunk)
    with ReplayBuffer.create(spec, capacity=capacity) as buf:
        benchlib.fill_repeating(buf, chunk, capacity)
        for B in wl["batches"]:
            tds = [np.abs(rng.standard_normal(B)) for _ in range(TD_POOL)]
            common = dict(batch_size=B, seed=0, timeout=60)
            per = Prioritized(alpha=ALPHA, beta=BETA)
            pools = {
                "uniform": SamplerPool(buf, workers=0, **common),
                "prioritized": SamplerPool(buf, selection=per, workers=0, **common),
                "uniform workers": SamplerPool(buf, workers=Workers(n_workers, start_method=FS),
                                               **common),
                "prioritized workers": SamplerPool(
                    buf, selection=per, workers=Workers(n_workers, start_method=FS), **common),
            }
            try:
                for p in pools.values():  # first batch: the prioritized trees are filled here
                    p.next()
                cases = [
                    TimedCase("uniform", pool_runner(pools["uniform"], None)),
                    TimedCase("prioritized", pool_runner(pools["prioritized"], tds)),
                    TimedCase("uniform workers", pool_runner(pools["uniform workers"], None)),
                    TimedCase("prioritized workers",
                              pool_runner(pools["prioritized workers"], tds)),
                ]
                if rb is not None:
                    cases.append(TimedCase("cpprb PER", cpprb_runner(rb, B, tds)))
                print(f"  {name} B={B}: set up in {time.perf_counter() - t0:.1f}s",
                      file=sys.stderr, flush=True)
                benchlib.run_rounds([cases], rounds, seconds, f"{name} B={B}")
                by = {c.name: c for c in cases}
                res: dict[str, Any] = {
                    "rates": {c.name: {"median": statistics.median(c.rates), "rounds": c.rates}
                              for c in cases},
                    "ratios": {},
                    "cpprb": why or "measured",
                }
                pairs = [("prioritized", "uniform"),
                         ("prioritized workers", "uniform workers")]
                if rb is not None:
                    pairs += [("prioritized", "cpprb PER"), ("prioritized workers", "cpprb PER")]
                for a, b in pairs:
                    res["ratios"][f"{a}/{b}"] = benchlib.ratio(by[a], by[b])
                # Learner-side cost with workers. The train step is two in-process
                # prioritized batches (as in bench_pool.py), long enough for the workers to
                # refill the ring on a machine whose other core the learner keeps busy.
                in_process_s = 1.0 / res["rates"]["prioritized"]["median"]
                cost = [learner_cost(pools["prioritized workers"], tds, 2 * in_process_s,
                                     cost_calls) for _ in range(3)]
                res["learner_cost"] = {
                    "train_step_s": 2 * in_process_s,
                    "next_s": statistics.median(c["next_s"] for c in cost),
                    "update_s": statistics.median(c["update_s"] for c in cost),
                    "in_process_prioritized_s": in_process_s,
                    "cpprb_s": (1.0 / res["rates"]["cpprb PER"]["median"]
                                if rb is not None else None),
                }
                out["batches"][str(B)] = res
            finally:
                for p in pools.values():
                    out["workers_cpu_s"] = out.get("workers_cpu_s", 0.0) + sum(
                        _proc_cpu_s(pid) for pid in p.worker_pids)
                    p.close()
        out["cpprb"] = why or "measured"
    return out


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def fmt_us(s: float | None) -> str:
    """Seconds as whole microseconds (or ms), "-" for None."""
    return "-" if s is None else benchlib.fmt_us(s * 1e6, decimals=0)


def report(results: dict[str, Any], n_workers: int) -> list[str]:
    lines = []
    head = (f"{'workload':8} {'B':>4} | {'uniform':>8} {'prio':>8} {'ratio':>5} {'range':>9} | "
            f"{'uniform':>8} {'prio':>8} {'ratio':>5} {'range':>9} | {'cpprb':>8} "
            f"{'prio/cpprb':>10} {'prioW/cpprb':>11}")
    lines += [f"{'':14}| in-process (n_workers=0), batches/s     | "
              f"{n_workers} worker(s), batches/s{'':17}| cpprb PER, batches/s",
              head, "-" * len(head)]
    for wl, res in results.items():
        for B, r in res["batches"].items():
            rt, ra = r["rates"], r["ratios"]

            def cell(a: str, b: str) -> str:
                x = ra[f"{a}/{b}"]  # noqa: B023 (called within this iteration)
                return f"{x['median']:5.2f} {x['min']:.2f}-{x['max']:.2f}"

            if "cpprb PER" in rt:
                cp = (f"{rt['cpprb PER']['median']:8.0f} "
                      f"{ra['prioritized/cpprb PER']['median']:10.2f} "
                      f"{ra['prioritized workers/cpprb PER']['median']:11.2f}")
            else:
                cp = f"{'-':>8} {'-':>10} {'-':>11}"
            lines.append(
                f"{wl:8} {B:>4} | {rt['uniform']['median']:8.0f} "
                f"{rt['prioritized']['median']:8.0f} {cell('prioritized', 'uniform')} | "
                f"{rt['uniform workers']['median']:8.0f} "
                f"{rt['prioritized workers']['median']:8.0f} "
                f"{cell('prioritized workers', 'uniform workers')} | {cp}")
    lines += ["", "learner-side cost per prioritized batch with workers (train step between "
                  "batches = two in-process prioritized batches):",
              f"{'workload':8} {'B':>4}   {'next()':>9} {'update':>9} {'sum':>9}   "
              f"{'in-process':>10} {'cpprb':>9}"]
    for wl, res in results.items():
        for B, r in res["batches"].items():
            c = r["learner_cost"]
            lines.append(
                f"{wl:8} {B:>4}   {fmt_us(c['next_s']):>9} {fmt_us(c['update_s']):>9} "
                f"{fmt_us(c['next_s'] + c['update_s']):>9}   "
                f"{fmt_us(c['in_process_prioritized_s']):>10} {fmt_us(c['cpprb_s']):>9}")
    notes = {res["cpprb"] for res in results.values() if res["cpprb"] != "measured"}
    lines += [f"note: {n}" for n in sorted(notes)]
    return lines


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for label, wl, B, metric, threshold in TARGETS:
        r = results.get(wl, {}).get("batches", {}).get(str(B))
        if r is None:
            continue
        if metric == "in-process/learner":
            c = r["learner_cost"]
            v = c["in_process_prioritized_s"] / (c["next_s"] + c["update_s"])
        elif metric in r["ratios"]:
            v = r["ratios"][metric]["median"]
        else:
            continue  # e.g. no cpprb
        out.append({"label": label, "value": v, "threshold": threshold, "pass": v > threshold})
    return out


def check_space(plan: list[tuple[str, int]], cpprb_too: bool) -> bool:
    """Whether /dev/shm and RAM can hold the largest workload (and, with cpprb, cpprb's copy of
    it); says why not on stderr."""
    need = max(cap * (Spec(WORKLOADS[wl]["spec"]).row_nbytes + 64) for wl, cap in plan)
    return benchlib.has_space("bench_prioritized", need + (64 << 20),
                              (2 if cpprb_too else 1) * need + (1 << 30), "4g",
                              "the buffer and cpprb's copy" if cpprb_too else "")


def run_isolated(name: str, capacity: int, args: argparse.Namespace, rounds: int,
                 seconds: float) -> dict[str, Any]:
    """One workload in a fresh interpreter, like a learner (what earlier cases freed changes
    glibc's thresholds, and with them the cost of cpprb's fresh output arrays)."""
    return benchlib.run_child(
        __file__, ["--rounds", str(rounds), "--seconds", str(seconds), "--workers",
                   str(args.workers), "--cost-calls", str(args.cost_calls), "--_workload", name,
                   "--_capacity", str(capacity)], name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_options = benchlib.add_run_options(p, "small capacities, short rounds (< 30 s)", 0.25,
                                           0.04)
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                   help="sampler workers for the worker columns (default min(2, cores))")
    p.add_argument("--cost-calls", type=int, default=None,
                   help="batches per learner-cost measurement (default 200; 30 with --quick)")
    p.add_argument("--only", choices=list(WORKLOADS), action="append")
    benchlib.add_child_options(p)
    args = p.parse_args(argv)
    rounds, seconds = run_options(args)
    if args.cost_calls is None:
        args.cost_calls = 30 if args.quick else 200
    if args.workers < 1:
        p.error("--workers must be >= 1")

    if args._workload:  # the child side of run_isolated
        return benchlib.child_result(
            args._out, lambda: bench_workload(args._workload, args._capacity, rounds, seconds,
                                              args.workers, args.cost_calls))

    plan = [(n, wl["quick_capacity"] if args.quick else wl["capacity"])
            for n, wl in WORKLOADS.items() if not args.only or n in args.only]
    try:
        import cpprb  # noqa: F401

        have_cpprb = True
    except ImportError:
        have_cpprb = False
    if not check_space(plan, have_cpprb):
        return 2
    info = benchlib.machine()
    clock = benchlib.RunClock()
    results: dict[str, Any] = {}
    try:
        for name, cap in plan:
            results[name] = run_isolated(name, cap, args, rounds, seconds)
    except KeyboardInterrupt:
        print("bench_prioritized: interrupted; buffers and pools closed", file=sys.stderr)
        return 130
    # Sampler workers are forkserver children, not ours: their CPU time is reported back.
    runtime, others = clock.stop(sum(r.get("workers_cpu_s", 0.0) for r in results.values()))
    caps = ", ".join(f"{n} capacity {c:,}" for n, c in plan)
    try:
        import cpprb

        cp_version = getattr(cpprb, "__version__", None) or _dist_version("cpprb")
    except ImportError:
        cp_version = "not installed"
    print(f"shmbuf prioritized-replay benchmark{' (--quick)' if args.quick else ''}: {caps}; "
          f"alpha {ALPHA}, beta {BETA}; learner sends |TD| for every prioritized batch; "
          f"{rounds} rounds x {seconds}s per case; medians")
    print(f"machine: {info['cores']} cores, numpy {info['numpy']}, Python {info['python']}, "
          f"cpprb {cp_version}")
    for line in report(results, args.workers):
        print(line)
    targets = evaluate(results)
    print()
    for t in targets:
        print(f"{'PASS' if t['pass'] else 'MISS'}  {t['label']}: {t['value']:.2f}x")
    print(benchlib.runtime_line(runtime, others))
    return benchlib.finish(args, {
        "argv": sys.argv, "quick": args.quick, "rounds": rounds, "seconds": seconds,
        "workers": args.workers, "cpprb": cp_version, "runtime_s": runtime,
        "other_cpu_fraction": others, "workloads": results, "targets": targets})


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
