#!/usr/bin/env python
"""Stress test: N actors x M sampler workers for T seconds under random SIGKILLs.

Every row checks itself (``tests/_helpers/rows.py``, the scheme the tests use): it carries its
lane, its logical index, ``--payload`` bytes and a check word derived from both. The learner
verifies every row of every batch
against ``batch.lanes``/``batch.indices``, so a torn row (two writes mixed), a stale row or a
foreign row is caught. With ``--sampler queue`` it also checks that every row is delivered
exactly once, oldest first (no duplicate, no gap within a lane). With ``--sampler prioritized``
the learner updates priorities on every batch. Exits non-zero on any corrupt row, duplicate or
gap, any hang past ``--hang-timeout``, or any entry left in /dev/shm.

    python scripts/stress.py --actors 3 --workers 2 --seconds 30 --kill-every 0.5
    python scripts/stress.py --workers 4 --train-step 0.02   # workers block: next() wakes them
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np

from shmbuf import ReplayBuffer, Spec
from shmbuf.errors import Timeout
from shmbuf.scan import scan
from workers import ActorContext, ActorGroup, SamplerPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests._helpers
from tests._helpers.rows import RowScheme

SHM_DIR = "/dev/shm"


def stress_actor(ctx: ActorContext, rows: RowScheme, max_extend: int) -> None:
    """Writes self-checking rows: mostly extends of random size, sometimes single adds."""
    w, rng = ctx.writer, ctx.rng
    while not ctx.stopping:
        if rng.random() < 0.2:
            w.add(**rows.row(ctx.lane, w.committed))
        else:
            n = int(rng.integers(1, max_extend + 1))
            w.extend(rows.batch(ctx.lane, np.arange(w.committed, w.committed + n)))
        if rng.random() < 0.01:
            w.end_episode()


def left_behind(before: set[str]) -> list[str]:
    """New /dev/shm entries that this run made: segments it owns, or files that are not
    shmbuf segments. Segments of other processes running beside us are not ours to judge."""
    new = set(os.listdir(SHM_DIR)) - before
    owners = {i.name: i.header.owner_pid for i in scan() if i.header is not None}
    return sorted(n for n in new if owners.get(n, os.getpid()) == os.getpid())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--kill-every", type=float, default=0.5,
                   help="seconds between SIGKILLs of a random actor or worker (0: none)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--capacity", type=int, default=2048, help="rows per lane (small: lots of wrap)")
    p.add_argument("--payload", type=int, default=1024, help="payload bytes per row")
    p.add_argument("--max-extend", type=int, default=64)
    p.add_argument("--hang-timeout", type=float, default=15.0,
                   help="a next() that waits longer than this is a hang")
    p.add_argument("--start-method", default=None, choices=["fork", "forkserver", "spawn"])
    p.add_argument("--sampler", default="uniform", choices=["uniform", "prioritized", "queue"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-step", type=float, default=0.0,
                   help="seconds the learner sleeps after each batch (e.g. 0.02: the workers "
                        "then block between batches, and next() wakes them)")
    args = p.parse_args(argv)

    shm_before = set(os.listdir(SHM_DIR))
    watchdog = args.seconds + 4 * args.hang_timeout + 60
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(
        SystemExit(f"FAIL: watchdog fired after {watchdog:.0f} s: something hung")))
    signal.alarm(int(watchdog))

    rows_scheme = RowScheme(payload_words=args.payload, payload_dtype="uint8", lane_dtype="int32")
    spec = Spec(rows_scheme.fields)
    rng = random.Random(args.seed)
    kills = {"actor": 0, "worker": 0}
    batches = rows = corrupt = timeouts = duplicates = 0
    delivered: list[list[np.ndarray]] = [[] for _ in range(args.actors)]  # queue mode
    actor = functools.partial(stress_actor, rows=rows_scheme, max_extend=args.max_extend)
    print(f"stress: {args.actors} actors x {args.workers} workers, {args.seconds:g} s, kill every "
          f"{args.kill_every:g} s, capacity {args.capacity}/lane, batch {args.batch_size}",
          flush=True)
    t0 = time.monotonic()
    with ReplayBuffer.create(spec, capacity=args.capacity, lanes=args.actors) as buf, \
            ActorGroup(actor, args.actors, buf, start_method=args.start_method, seed=args.seed,
                       max_restarts_per_minute=10_000) as group, \
            SamplerPool(buf, batch_size=args.batch_size, n_workers=args.workers,
                        start_method=args.start_method, seed=args.seed, min_size=args.batch_size,
                        max_restarts_per_minute=10_000, timeout=args.hang_timeout,
                        sampler=args.sampler) as pool:
        next_kill = time.monotonic() + args.kill_every if args.kill_every > 0 else float("inf")
        next_report = time.monotonic() + 2.0
        while time.monotonic() - t0 < args.seconds:
            try:
                batch = pool.next()
            except Timeout as e:
                timeouts += 1
                print(f"FAIL: hang: {e}", flush=True)
                break
            bad = int(rows_scheme.bad_rows(batch, batch.lanes, batch.indices).sum())
            if bad:
                corrupt += bad
                print(f"FAIL: {bad} corrupt row(s) in batch {batches}", flush=True)
            batches += 1
            rows += batch.batch_size
            if args.sampler == "prioritized":
                prio = np.random.default_rng(batches).random(batch.batch_size)
                pool.update_priorities(batch.indices, prio, batch.lanes)
            elif args.sampler == "queue":
                for k in np.unique(batch.lanes):
                    delivered[k].append(np.asarray(batch.indices)[np.asarray(batch.lanes) == k])
            group.poll()
            if args.train_step > 0:
                time.sleep(args.train_step)
            now = time.monotonic()
            if now >= next_kill:
                next_kill = now + args.kill_every
                victims = [("actor", pid) for pid in group.pids if pid] + \
                          [("worker", pid) for pid in pool.worker_pids]
                kind, pid = rng.choice(victims)
                try:
                    os.kill(pid, signal.SIGKILL)
                    kills[kind] += 1
                except ProcessLookupError:
                    pass
            if now >= next_report:
                next_report = now + 2.0
                print(f"  {now - t0:5.1f} s: {batches:,} batches, {rows:,} rows verified, "
                      f"{int(buf.committed().sum()):,} written, kills {kills}", flush=True)
        written = int(buf.committed().sum())
        st = pool.stats()
        actor_restarts = group.restarts
    signal.alarm(0)
    gaps = 0
    if args.sampler == "queue":  # exactly once, oldest first: each lane's indices consecutive
        for k, parts in enumerate(delivered):
            if parts:
                got = np.concatenate(parts)
                duplicates += int(got.size - np.unique(got).size)
                gaps += int((np.diff(got) != 1).sum())
                if duplicates or gaps:
                    print(f"FAIL: lane {k}: {duplicates} duplicate(s), {gaps} gap(s)", flush=True)

    deadline = time.monotonic() + 5.0
    leaked = left_behind(shm_before)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.1)
        leaked = left_behind(shm_before)
    print(f"summary: {written:,} rows written; {batches:,} batches ({rows:,} rows) verified; "
          f"{corrupt} corrupt rows; kills survived: {kills['actor']} actors, {kills['worker']} "
          f"workers; restarts: {actor_restarts} actors, {st['restarts']} workers; "
          f"{timeouts} hangs; {len(leaked)} /dev/shm entries left {leaked if leaked else ''}"
          + (f"; queue: {duplicates} duplicates, {gaps} gaps" if args.sampler == "queue" else ""))
    failed = corrupt or timeouts or leaked or batches == 0 or duplicates or gaps
    print("FAIL" if failed else "PASS", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
