#!/usr/bin/env python
"""Actor-priority benchmark (Ape-X): what giving a priority with each row costs the writer, and
what entering rows at their actor priorities costs the learner's ``next()``.

In the same rounds (ratios are taken side by side; this machine is noisy), on buffers created
with ``actor_priorities=True``:
  - writer: ``extend(rows, priorities=ps)`` against ``extend(rows)`` (64 and 1024 rows), and
    ``add_prioritized(p, **row)`` against ``add(**row)`` (the compiled store takes plain rows;
    prioritized ones go through NumPy's), for small rows and for one 84x84 frame per row;
  - learner: an in-process prioritized pool's ``next()`` (batch 512), each after a writer
    published 64 new rows, which ``next()`` enters: at the priorities given with them, against
    rows given none (entered at the maximum priority).

Benchmarks report, they do not gate: the exit code is 0 unless ``--check`` is given and a target
is missed (none is gated yet). Results and their reading: BENCHMARKS.md.

    python scripts/bench_actor_priorities.py [--quick] [--rounds N] [--seconds S] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import benchlib
from benchlib import TimedCase
from shmbuf import ReplayBuffer, Spec
from workers import SamplerPool
from workers.config import Workers
from workers.selection import Prioritized

SPECS = {
    "small": Spec({"obs": ((17,), "float32"), "next_obs": ((17,), "float32"),
                   "action": ((6,), "float32"), "reward": ((), "float32"),
                   "done": ((), "bool")}),
    "frame": Spec({"obs": ((84, 84), "uint8"), "action": ((), "int64"),
                   "reward": ((), "float32"), "done": ((), "bool")}),
}
BATCH, NEW_ROWS = 512, 64  # the learner's batch, rows published before each next()


def _writer_cases(name: str, spec: Spec, capacity: int, rng: np.random.Generator,
                  closing: list[Any]) -> list[list[TimedCase]]:
    """(plain, prioritized) pairs of extend (64, 1024 rows) and of single-row adds."""
    buf = ReplayBuffer.create(spec, capacity, lanes=1, actor_priorities=True)
    closing.append(buf)
    w = buf.writer(lane=0)
    closing.insert(0, w)
    groups = []
    for n in (64, 1024):
        rows = benchlib.random_rows(spec, n, rng)
        ps = rng.uniform(0.1, 5.0, n)
        groups.append([
            TimedCase(f"{name} extend {n}", benchlib.loop_runner(lambda r=rows: w.extend(r))),
            TimedCase(f"{name} extend {n} +priorities",
                      benchlib.loop_runner(lambda r=rows, p=ps: w.extend(r, priorities=p)))])
    one = {k: v[0] for k, v in benchlib.random_rows(spec, 1, rng).items()}
    groups.append([
        TimedCase(f"{name} add", benchlib.loop_runner(lambda: w.add(**one))),
        TimedCase(f"{name} add_prioritized",
                  benchlib.loop_runner(lambda: w.add_prioritized(0.5, **one)))])
    return groups


def _next_case(label: str, spec: Spec, capacity: int, with_priorities: bool,
               rng: np.random.Generator, closing: list[Any]) -> TimedCase:
    """``next()`` of an in-process prioritized pool, after each of which (untimed) a writer
    publishes ``NEW_ROWS`` rows, with or without priorities, that the next ``next()`` enters."""
    buf = ReplayBuffer.create(spec, capacity, lanes=1, actor_priorities=True)
    closing.append(buf)
    rows = benchlib.random_rows(spec, NEW_ROWS, rng)
    ps = rng.uniform(0.1, 5.0, NEW_ROWS)
    w = buf.writer(lane=0)
    closing.insert(0, w)
    fill = benchlib.random_rows(spec, min(capacity, 4096), rng)
    for _ in range(-(-capacity // len(fill["obs"]))):  # a full buffer
        w.extend(fill, priorities=rng.uniform(0.1, 5.0, len(fill["obs"])) if with_priorities
                 else None)
    pool = SamplerPool(buf, BATCH, selection=Prioritized(alpha=0.6, beta=0.4),
                       workers=Workers(0), seed=0)
    closing.insert(0, pool)
    pool.next()

    def run(n: int) -> float:
        took = 0.0
        for _ in range(n):
            w.extend(rows, priorities=ps if with_priorities else None)
            t0 = time.perf_counter()
            pool.next()
            took += time.perf_counter() - t0
        return took

    return TimedCase(label, run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_options = benchlib.add_run_options(p, "small capacities, short rounds (< 20 s)", 0.25,
                                           0.05)
    args = p.parse_args(argv)
    rounds, seconds = run_options(args)
    capacity = 20_000 if args.quick else 200_000
    rng = np.random.default_rng(0)
    closing: list[Any] = []
    info = benchlib.machine()
    try:
        groups: list[list[TimedCase]] = []
        for name, spec in SPECS.items():
            groups += _writer_cases(name, spec, 4096, rng, closing)
        next_cases = [_next_case(f"next() {BATCH} after {NEW_ROWS} rows, max-priority entry",
                                 SPECS["small"], capacity, False, rng, closing),
                      _next_case(f"next() {BATCH} after {NEW_ROWS} rows, actor priorities",
                                 SPECS["small"], capacity, True, rng, closing)]
        groups.append(next_cases)
        benchlib.run_rounds(groups, rounds, seconds)
    except KeyboardInterrupt:
        print("bench_actor_priorities: interrupted", file=sys.stderr)
        return 130
    finally:
        for thing in closing:
            thing.close()
    print(f"shmbuf actor-priority benchmark{' (--quick)' if args.quick else ''}: "
          f"{rounds} rounds x {seconds}s per case; medians; pool capacity {capacity:,}")
    print(benchlib.machine_line(info))
    print(f"{'case':<52} {'per op':>10} {'vs plain':>9}  (per-round range)")
    results: dict[str, Any] = {}
    for base, case in groups:
        r = benchlib.ratio(case, base)
        for c in (base, case):
            us = sorted(c.secs)[len(c.secs) // 2] * 1e6
            results[c.name] = {"us": us}
            extra = "" if c is base else f"{r['median']:>8.2f}x  ({r['min']:.2f}-{r['max']:.2f})"
            print(f"{c.name:<52} {benchlib.fmt_us(us):>10} {extra}")
        results[case.name]["ratio"] = r
    return benchlib.finish(args, {"machine": info, "results": results, "targets": []})


if __name__ == "__main__":
    sys.exit(main())
