#!/usr/bin/env python
"""Diagnostic for issue 13's cache-line audit: how much does a process that touches the lines a
writer stores to every ``add`` slow that writer, per second it runs on a CPU?

One actor process adds to a full one-lane buffer (as ``bench_storage.py``'s keep-up section)
while, phase by phase, one other process: does nothing ("alone"); loads the lane's ``committed``
and ``reserved`` words in a tight loop (a reader polling the writer's lines, which no shmbuf
reader does); stores to a spare word of the ``committed`` line (false sharing, which the layout
rules out); stores to a line of its own (the control for the last two: a busy process on the
machine, nothing shared); gathers batches from the buffer with ``sample_into`` (a sampler without
staging); or gathers the same amount from private memory (memory traffic, nothing shared).
Rounds alternate; a ratio is the median of per-round ratios to the rate alone.

    python scripts/diag_hot_lines.py [--workload atari|mujoco] [--rounds N] [--seconds S]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from bench_storage import KEEPUP_BATCH, KEEPUP_CAPACITY, WORKLOADS, cpu_seconds_of, keepup_actor

import benchlib
from shmbuf import ReplayBuffer, Spec
from workers import ActorGroup
from workers.supervise import stop_process

INNER = 10_000  # touches between looks at the stop event


def _attached(name: str, stop: Any, body: Callable[[ReplayBuffer], Callable[[], None]]) -> None:
    buf = ReplayBuffer.attach(name)
    step = body(buf)
    while not stop.is_set():
        step()
    step = None  # type: ignore[assignment]  # drop the views before unmapping
    buf.close()


def poll_lane_words(buf: ReplayBuffer) -> Callable[[], None]:
    committed, reserved = buf.storage.committed, buf.storage.reserved

    def step() -> None:
        for _ in range(INNER):
            committed[0]
            reserved[0]

    return step


def _store_loop(view: np.ndarray) -> Callable[[], None]:
    def step() -> None:
        for i in range(INNER):
            view[0] = i

    return step


def store_on_committed_line(buf: ReplayBuffer) -> Callable[[], None]:
    return _store_loop(buf.storage.lane_words[0, 0, 1:2])  # word 1 of the committed line


def store_on_own_line(buf: ReplayBuffer) -> Callable[[], None]:
    return _store_loop(np.zeros(16, np.int64)[8:9])  # private memory


def sample_into(buf: ReplayBuffer) -> Callable[[], None]:
    out = {n: np.zeros((KEEPUP_BATCH, *f.shape), f.dtype) for n, f in buf.spec.items()}
    rng = np.random.default_rng(0)

    def step() -> None:
        buf.sample_into(out, rng)

    return step


def gather_private(buf: ReplayBuffer) -> Callable[[], None]:
    C = buf.capacity
    cols = {n: np.ones((C, *f.shape), f.dtype) for n, f in buf.spec.items()}
    out = {n: np.zeros((KEEPUP_BATCH, *f.shape), f.dtype) for n, f in buf.spec.items()}
    rng = np.random.default_rng(0)

    def step() -> None:
        idx = rng.integers(0, C, KEEPUP_BATCH)
        for n, col in cols.items():
            np.take(col, idx, axis=0, out=out[n], mode="clip")

    return step


BODIES = {"poll committed/reserved": poll_lane_words,
          "store on committed's line": store_on_committed_line,
          "store on own line (control)": store_on_own_line,
          "sample_into the buffer": sample_into, "gather private memory": gather_private}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=[w.name for w in WORKLOADS], default="mujoco")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=1.0)
    args = p.parse_args(argv)
    wl = next(w for w in WORKLOADS if w.name == args.workload)
    spec, capacity = Spec(wl.spec), KEEPUP_CAPACITY[wl.name][0]
    ctx = mp.get_context("fork")
    results: dict[str, list[tuple[float, float]]] = {"alone": [], **{k: [] for k in BODIES}}
    with ReplayBuffer.create(spec, capacity) as buf:
        benchlib.fill_repeating(buf, benchlib.random_rows(spec, 1000, np.random.default_rng(0)),
                                capacity)
        with ActorGroup(keepup_actor, 1, buf, lanes=[0]) as actors:
            start = buf.committed(0)
            while buf.committed(0) < start + 1.2 * capacity:  # the actor's first lap
                time.sleep(0.05)
            names = list(results)
            for r in range(args.rounds):
                print(f"  round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                for name in names if r % 2 == 0 else names[::-1]:
                    stop, proc = ctx.Event(), None
                    if name != "alone":
                        proc = ctx.Process(target=_attached, args=(buf.name, stop, BODIES[name]))
                        proc.start()
                        time.sleep(0.5)  # attached and warm
                    try:
                        actor = actors.pids[0]
                        assert actor is not None
                        cpu0, c0, t0 = cpu_seconds_of(actor), buf.committed(0), time.perf_counter()
                        time.sleep(args.seconds)
                        took, n = time.perf_counter() - t0, buf.committed(0) - c0
                        results[name].append((n / took, n / (cpu_seconds_of(actor) - cpu0)))
                    finally:
                        if proc is not None:
                            stop.set()
                            stop_process(proc, 10)
    alone = results["alone"]
    print(f"{wl.name}, capacity {capacity:,}: the actor's add() rate with one other process "
          f"(median of {args.rounds} rounds; ratios to alone, median of per-round ratios)")
    for name, got in results.items():
        wall = statistics.median(a[0] / b[0] for a, b in zip(got, alone))
        cpu = statistics.median(a[1] / b[1] for a, b in zip(got, alone))
        print(f"  {name:28} {statistics.median(g[0] for g in got):10,.0f}/s  "
              f"{statistics.median(g[1] for g in got):10,.0f} per CPU-s   ratio {wall:.2f}   "
              f"per CPU {cpu:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
