#!/usr/bin/env python
"""cpprb's ``MPPrioritizedReplayBuffer`` under writer processes: issue 16's peer for the
"under load" rows of ``scripts/bench_per.py`` (the same rows, chunks, pacing and timing).

    python scripts/per_mp_peer.py [--seconds S] [--rows N]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from typing import Any

import numpy as np

# Issue 16's figures, the same as bench_per.py's (its hook passes its own constants).
ALPHA, BETA, B, COLUMNS, CHUNK = 0.6, 0.4, 256, 42, 64
TD_POOL = 64  # distinct |TD| arrays cycled through (the RNG is not what is measured)
RATES: tuple[float | None, ...] = (25_000, 100_000, 400_000, None)  # per writer; None: flat out
WRITERS = 2
START_TIMEOUT_S, STOP_TIMEOUT_S = 60.0, 10.0


def writer_main(rb: Any, writer: int, rate: float | None, columns: int, chunk: int,
                written_rows: Any, stop: Any) -> None:
    """Add ``chunk``-row chunks at ``rate`` rows/s (None: as fast as it can), paced as
    bench_per.py's ``writer_main`` paces shmbuf's writers; ``written_rows[writer]`` counts the
    rows added (only this writer stores its word; the learner loads it)."""
    rows = np.random.default_rng(writer).standard_normal((chunk, columns), dtype=np.float32)
    t0, written = time.perf_counter(), 0
    while not stop.is_set():
        rb.add(obs=rows)
        written += chunk
        written_rows[writer] = written
        if rate is not None:
            ahead = written / rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)


def cpprb_mp_under_load(rate_per_writer: float | None, seconds: float, rows: int = 100_000, *,
                        batch_size: int = B, columns: int = COLUMNS, chunk: int = CHUNK,
                        alpha: float = ALPHA, beta: float = BETA) -> dict[str, Any]:
    """cpprb's learner (``sample`` + ``update_priorities`` of ``batch_size`` rows) on a full
    ``MPPrioritizedReplayBuffer`` of ``rows`` rows while ``WRITERS`` spawned processes add
    ``chunk``-row chunks at ``rate_per_writer`` rows/s each (None: flat out).

    Returns ``learner_batches_per_s``, ``writer_rows_per_s`` (all writers together), the
    learner's ``quiet`` rate measured on the same buffer right before the writers start,
    ``learner_cpu_ms_per_batch`` and ``raised`` (what the learner raised, "" if nothing);
    or ``{"skipped": reason}`` when cpprb is not installed.
    """
    try:
        import cpprb  # type: ignore[import-untyped]
    except ImportError as e:
        return {"skipped": f"cpprb not installed ({e})"}
    ctx = multiprocessing.get_context("spawn")
    rb = cpprb.MPPrioritizedReplayBuffer(rows, {"obs": {"shape": columns, "dtype": np.float32}},
                                         alpha=alpha, ctx=ctx, backend="sharedctypes")
    fill = np.random.default_rng(0).standard_normal((5000, columns), dtype=np.float32)
    for _ in range(rows // 5000):
        rb.add(obs=fill)
    rng = np.random.default_rng(1)
    errors = [np.abs(rng.standard_normal(batch_size)) for _ in range(TD_POOL)]
    batches = [0]

    def step() -> None:
        s = rb.sample(batch_size, beta=beta)
        rb.update_priorities(s["indexes"], errors[batches[0] % TD_POOL])
        batches[0] += 1

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds / 2:
        step()
    quiet = batches[0] / (time.perf_counter() - t0)

    written_rows = ctx.RawArray("q", WRITERS)
    stop = ctx.Event()
    procs = [ctx.Process(target=writer_main, daemon=True,
                         args=(rb, w, rate_per_writer, columns, chunk, written_rows, stop))
             for w in range(WRITERS)]
    for p in procs:
        p.start()
    raised = ""
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while min(written_rows) == 0:  # until both writers are running and adding
            if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                raise RuntimeError(f"cpprb writers did not start within {START_TIMEOUT_S:.0f} s "
                                   f"(exit codes {[p.exitcode for p in procs]})")
            time.sleep(0.05)
        time.sleep(0.2)
        rows0, n0 = sum(written_rows), batches[0]
        t0, cpu0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            try:
                step()
            except Exception as e:  # report what the learner raised, as bench_per.py does
                raised = f"{type(e).__name__}: {e}"[:160]
                break
        took, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        written, done = sum(written_rows) - rows0, batches[0] - n0
    finally:
        stop.set()
        for p in procs:
            p.join(STOP_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(STOP_TIMEOUT_S)
    return {"learner_batches_per_s": done / took, "writer_rows_per_s": written / took,
            "quiet": quiet, "learner_cpu_ms_per_batch": 1e3 * cpu / max(done, 1),
            "raised": raised}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args(argv)
    print(f"cpprb MPPrioritizedReplayBuffer, {WRITERS} writer processes (spawn) adding "
          f"{CHUNK}-row chunks, {args.rows} rows of {COLUMNS} float32, B={B}, one update of "
          f"{B} priorities per batch")
    print("| rows/s per writer | learner batches/s | of quiet | writers' rows/s (total) |")
    print("|---|---|---|---|")
    for rate in RATES:
        label = "flat out" if rate is None else f"{rate:,.0f}"
        r = cpprb_mp_under_load(rate, args.seconds, args.rows)
        if "skipped" in r:
            print(r["skipped"])
            return 0
        print(f"| {label} | {r['learner_batches_per_s']:,.0f} | "
              f"{r['learner_batches_per_s'] / r['quiet']:.2f} of {r['quiet']:,.0f} | "
              f"{r['writer_rows_per_s']:,.0f} |" + (f" RAISED {r['raised']}" if r["raised"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
