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

``--chaos`` (``scripts/chaos_harness.py``) adds SIGSTOPs of any process for 0.1-3 s, the learner
included, and SIGKILLs of the learner itself every 20-40 s: the learner then runs in its own
process (``scripts/chaos_learner.py``), restarted by the harness on the same buffer, and reports
each batch it checked over a socket that survives it. ``--mode`` picks what is sampled
(uniform, prioritized, queue, sequences, prioritized-sequences, framestack-nstep, epoch,
max-times, or all of them one after another, ``--seconds`` each); actors end episodes at random
and every window, stack and n-step return is checked against the episode ids they write. Each
mode prints a summary and PASS or FAIL; the exit status is non-zero if any mode failed.

    python scripts/stress.py --chaos --mode all --seconds 60 --actors 3 --workers 2
    python scripts/stress.py --chaos --mode queue --seconds 10 --learner-kill-every 3,6
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

from shmbuf import RateLimit, ReplayBuffer, Spec
from shmbuf.errors import Timeout
from shmbuf.scan import scan
from workers import ActorContext, ActorGroup, SamplerPool
from workers.config import Workers

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


def chaos_modes() -> list[str]:
    from chaos_modes import MODES  # (scripts/ is on sys.path: this script's directory)

    return list(MODES)


def seconds_range(text: str) -> tuple[float, float] | None:
    """``"20,40"`` -> (20.0, 40.0); ``"5"`` -> (5.0, 5.0); ``"0"`` -> None (never)."""
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX seconds, got {text!r}") from None
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or parts[0] < 0 or parts[1] < parts[0]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX seconds with 0 <= MIN <= MAX, got "
                                         f"{text!r}")
    return None if parts[1] == 0 else (parts[0], parts[1])


def arm_watchdog(what: str, seconds: int) -> None:
    """SIGALRM in ``seconds``: ends the run (its cleanup runs) with a FAIL line."""
    def fire(*_: object) -> None:
        raise SystemExit(f"FAIL [{what}]: watchdog fired after {seconds} s: the harness hung")

    signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)


def run_chaos(args: argparse.Namespace) -> int:
    """``--chaos`` / ``--mode``: each mode in its own run of ``chaos_harness.ChaosRun``."""
    from chaos_harness import ChaosConfig, ChaosRun
    from chaos_modes import MODES

    mode = args.mode or args.sampler
    names = list(MODES) if mode == "all" else [mode]
    hang = 30.0 if args.hang_timeout is None else args.hang_timeout
    summaries = []
    for i, name in enumerate(names):
        cfg = ChaosConfig(
            mode=name, seconds=args.seconds, actors=args.actors, workers=args.workers,
            batch_size=args.batch_size, capacity=args.capacity, payload=args.payload,
            max_extend=args.max_extend, longest_episode=args.longest_episode,
            kill_every=args.kill_every, chaos=args.chaos, stop_every=args.stop_every,
            stop_for=args.stop_for or (0.0, 0.0), train_step=args.train_step,
            learner_kill_every=args.learner_kill_every, hang_timeout=hang,
            max_segments=args.max_segments or None, seed=args.seed + i, start_method=args.start_method,
            log_events=args.log_events)
        arm_watchdog(name, int(args.seconds + 6 * hang + 120))  # only if the harness hangs
        summaries.append(ChaosRun(cfg).run())
        signal.alarm(0)
    if len(summaries) > 1:
        print("\nall modes:")
        for s in summaries:
            print(f"  {'PASS' if s.passed else 'FAIL'} {s.mode:22s} {s.batches:8,} batches "
                  f"{s.rows_verified:11,} rows verified, kills {sum(s.kills.values()):4}, "
                  f"SIGSTOPs {sum(s.stops.values()):3}, learner restarts {s.learner_restarts}, "
                  f"duplicates {s.duplicates}, gaps {s.gaps}, segments max "
                  f"{max(s.segments, default=0)}, {len(s.failures)} failures")
    failed = [s.mode for s in summaries if not s.passed]
    print(f"FAIL: {', '.join(failed)}" if failed else "PASS", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=20.0, help="the run's length (per mode)")
    p.add_argument("--kill-every", type=float, default=0.5,
                   help="seconds between SIGKILLs of a random actor or worker (0: none)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--capacity", type=int, default=2048, help="rows per lane (small: lots of wrap)")
    p.add_argument("--payload", type=int, default=1024, help="payload bytes per row")
    p.add_argument("--max-extend", type=int, default=64)
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="a next() that waits longer than this is a hang (default 15 s; with "
                        "--chaos or --mode: a learner with no progress for this long, 30 s)")
    p.add_argument("--start-method", default=None, choices=["fork", "forkserver", "spawn"])
    p.add_argument("--sampler", default="uniform", choices=["uniform", "prioritized", "queue"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-step", type=float, default=0.0,
                   help="seconds the learner sleeps after each batch (e.g. 0.02: the workers "
                        "then block between batches, and next() wakes them; with --mode, a "
                        "learner SIGKILL then mostly finds a batch held)")
    p.add_argument("--chaos", action="store_true",
                   help="also SIGSTOP any process and SIGKILL the learner (in its own process)")
    p.add_argument("--mode", default=None, choices=[*chaos_modes(), "all"],
                   help="what the learner samples (default: --sampler); 'all': every mode in "
                        "turn, --seconds each. Runs the learner in its own process")
    p.add_argument("--stop-every", type=float, default=1.0,
                   help="--chaos: seconds between SIGSTOPs of a random process (0: none)")
    p.add_argument("--stop-for", type=seconds_range, default=(0.1, 3.0), metavar="MIN,MAX",
                   help="--chaos: how long each SIGSTOP lasts, drawn in [MIN, MAX] seconds")
    p.add_argument("--learner-kill-every", type=seconds_range, default=(20.0, 40.0),
                   metavar="MIN,MAX", help="--chaos: seconds from a learner's start to its "
                                           "SIGKILL, drawn in [MIN, MAX] (0: never)")
    p.add_argument("--max-segments", type=int, default=3,
                   help="--mode: fail if more segments of the buffer than this exist in "
                        "/dev/shm after a learner restart (the buffer, a staging ring and a "
                        "priority table: a restarted learner reclaims what the dead one left; "
                        "0: no check)")
    p.add_argument("--longest-episode", type=int, default=200,
                   help="--mode: actors' episodes last 1 to this many steps")
    p.add_argument("--log-events", action="store_true",
                   help="--mode: print every signal sent and every learner start")
    args = p.parse_args(argv)
    if args.chaos or args.mode is not None:
        return run_chaos(args)
    if args.hang_timeout is None:
        args.hang_timeout = 15.0

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
            SamplerPool(buf, batch_size=args.batch_size, selection=args.sampler,
                        limit=RateLimit(args.batch_size),
                        workers=Workers(args.workers, start_method=args.start_method,
                                        max_restarts_per_minute=10_000),
                        seed=args.seed, timeout=args.hang_timeout) as pool:
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
