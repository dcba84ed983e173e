#!/usr/bin/env python
"""Prioritized replay at speed (issue 16): the learner's ``next()`` + ``update_priorities()``.

In one run, rows of 42 float32, B=256, one update of 256 priorities per batch, in-process
(``SamplerPool(sampler="prioritized", n_workers=0)``):
  - quiet: shmbuf against cpprb's ``PrioritizedReplayBuffer`` (sample + update_priorities) on
    100k rows, side by side in rounds (``benchlib.run_rounds``), by wall time and by this
    process's CPU time per batch (what holds up on a machine shared with other jobs); shmbuf
    twice where its compiled sum tree is built: with it, and with the NumPy walks;
  - scale: time per batch at 100k, 1M and 10M rows (wall and CPU);
  - with sampler workers: the same quiet sample + update with 0, 1 and 2 workers;
  - under load: 2 writer processes (one lane each) adding 64-row chunks at 25k, 100k, 400k
    rows/s each and flat out, while the learner samples + updates: the learner's batches/s
    against its quiet rate measured right before, beside what a uniform learner keeps under
    the same writers (the CPU the writers take), the writers' rows/s against the same writers
    beside a uniform learner, the learner's CPU time per batch against quiet's (the work the
    write rate adds, apart from the CPU the writers take), and any exception it raised; then
    cpprb's ``MPPrioritizedReplayBuffer`` under the same writers (``per_mp_peer.py``).

Run it with another checkout first on PYTHONPATH to measure that one (before/after):

    python scripts/bench_per.py [--quick] [--seconds S] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from per_mp_peer import cpprb_mp_under_load

import benchlib
from benchlib import TimedCase
from shmbuf import ReplayBuffer, Spec
from shmbuf.sampling import Plan, sumtree
from workers import SamplerPool
from workers.selection import Prioritized

ALPHA, BETA, B, COLUMNS, CHUNK = 0.6, 0.4, 256, 42, 64
TD_POOL = 64  # distinct |TD| arrays cycled through (the RNG is not what is measured)
SPEC = Spec({"obs": ((COLUMNS,), "float32")})
RATES: tuple[float | None, ...] = (25_000, 100_000, 400_000, None)  # per writer; None: flat out


def tds(rng: np.random.Generator) -> list[np.ndarray]:
    return [np.abs(rng.standard_normal(B)) for _ in range(TD_POOL)]


def prioritized(buf: ReplayBuffer) -> SamplerPool:
    return SamplerPool(buf, batch_size=B, selection=Prioritized(alpha=ALPHA, beta=BETA),
                       workers=0, seed=0, timeout=60)


def learner_step(pool: SamplerPool, errors: list[np.ndarray]) -> Callable[[], None]:
    """One learner iteration: a batch, then new priorities for its rows."""
    k = [0]

    def step() -> None:
        batch = pool.next()
        pool.update_priorities(batch.indices, errors[k[0] % TD_POOL])
        k[0] += 1

    return step


def filled(rows: int, lanes: int = 1) -> ReplayBuffer:
    buf = ReplayBuffer.create(SPEC, capacity=rows // lanes, lanes=lanes)
    chunk = benchlib.random_rows(SPEC, 5000, np.random.default_rng(0))
    for lane in range(lanes):
        benchlib.fill_repeating(buf, chunk, rows // lanes, lane=lane)
    return buf


# ------------------------------------------------------------------------------------------------
# Quiet and scale
# ------------------------------------------------------------------------------------------------
def cpprb_step(rows: int, errors: list[np.ndarray]) -> tuple[Callable[[], None] | None, str]:
    try:
        import cpprb  # type: ignore[import-untyped]
    except ImportError as e:
        return None, f"cpprb not installed ({e})"
    rb = cpprb.PrioritizedReplayBuffer(rows, {"obs": {"shape": COLUMNS, "dtype": np.float32}},
                                       alpha=ALPHA)
    chunk = benchlib.random_rows(SPEC, 5000, np.random.default_rng(0))
    for _ in range(rows // 5000):
        rb.add(**chunk)
    k = [0]

    def step() -> None:
        s = rb.sample(B, beta=BETA)
        rb.update_priorities(s["indexes"], errors[k[0] % TD_POOL])
        k[0] += 1

    return step, cpprb.__version__ if hasattr(cpprb, "__version__") else "cpprb"


def cpu_logged(op: Callable[[], Any], log: list[float]) -> Callable[[int], float]:
    """``benchlib.loop_runner`` that also appends the CPU time of this process per call of
    ``op`` to ``log`` (one entry per run: the last ``rounds`` are the measured ones). On a
    machine shared with other jobs, CPU time is the work done, apart from waiting for a core."""

    def run(n: int) -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            op()
        took = time.perf_counter() - t0
        log.append((time.process_time() - c0) / n)
        return took

    return run


def numpy_walks(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with the sum tree's NumPy walks instead of the compiled ones (``_sumtree_c``)."""

    def run() -> None:
        before = sumtree.use_compiled(False)
        try:
            step()
        finally:
            sumtree.use_compiled(before)

    return run


def quiet(rows: int, rounds: int, seconds: float) -> dict[str, Any]:
    """shmbuf's learner step (compiled sum tree where built), the same with the NumPy walks,
    and cpprb's, side by side in rounds: rates (wall) and CPU time per batch."""
    errors = tds(np.random.default_rng(1))
    cpu: dict[str, list[float]] = {}
    with filled(rows) as buf, prioritized(buf) as pool:
        pool.next()  # the first batch enters every row
        steps: dict[str, Callable[[], None]] = {"shmbuf": learner_step(pool, errors)}
        if sumtree.compiled():
            steps["shmbuf_numpy"] = numpy_walks(steps["shmbuf"])
        step, what = cpprb_step(rows, errors)
        if step is not None:
            steps["cpprb_rate"] = step
        cases = [TimedCase(name, cpu_logged(op, cpu.setdefault(name, [])))
                 for name, op in steps.items()]
        benchlib.run_rounds([cases], rounds, seconds, f"quiet {rows} rows")
    out: dict[str, Any] = {c.name: statistics.median(c.rates) for c in cases}
    by_name = {c.name: c for c in cases}
    for name in steps:
        out[f"{name.removesuffix('_rate')}_cpu_us"] = 1e6 * statistics.median(cpu[name][-rounds:])
    if step is not None:
        for name in [n for n in steps if n.startswith("shmbuf")]:
            out[f"{name}/cpprb"] = benchlib.ratio(by_name[name], by_name["cpprb_rate"])["median"]
            out[f"{name}/cpprb_cpu"] = statistics.median(
                b / a for a, b in zip(cpu[name][-rounds:], cpu["cpprb_rate"][-rounds:]))
    out["cpprb"] = what
    return out


def scale(sizes: list[int], seconds: float) -> dict[str, float]:
    """Seconds per batch at each size (wall; ``<rows>_cpu``: CPU time of this process), and
    (``<rows>_uniform``) a uniform learner's ``next()`` on the same buffer, side by side in
    rounds: how much of the growth is the gather of rows from a larger buffer, not the tree."""
    errors = tds(np.random.default_rng(1))
    out = {}
    for rows in sizes:
        with filled(rows) as buf, prioritized(buf) as pool, SamplerPool(
                buf, batch_size=B, workers=0, seed=0, timeout=60) as uniform:
            t0 = time.perf_counter()
            pool.next()
            first = time.perf_counter() - t0
            cpu: list[float] = []
            case = TimedCase(str(rows), cpu_logged(learner_step(pool, errors), cpu))
            peer = TimedCase(f"{rows}_uniform", benchlib.loop_runner(uniform.next))
            benchlib.run_rounds([[case, peer]], 3, seconds, f"scale {rows} rows")
            out[str(rows)] = statistics.median(case.secs)
            out[f"{rows}_cpu"] = statistics.median(cpu[-3:])
            out[f"{rows}_uniform"] = statistics.median(peer.secs)
            print(f"  {rows} rows: first batch (enters every row) {first * 1e3:.0f} ms",
                  file=sys.stderr, flush=True)
    return out


# ------------------------------------------------------------------------------------------------
# Under load
# ------------------------------------------------------------------------------------------------
def writer_main(name: str, lane: int, rate: float | None, stop: Any) -> None:
    """Add CHUNK-row chunks to ``lane`` at ``rate`` rows/s (None: as fast as it can)."""
    buf = ReplayBuffer.attach(name)
    chunk = benchlib.random_rows(SPEC, CHUNK, np.random.default_rng(lane))
    with buf, buf.writer(lane) as w:
        t0, written = time.perf_counter(), 0
        while not stop.is_set():
            w.extend(chunk)
            written += CHUNK
            if rate is not None:
                ahead = written / rate - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)


def loaded(buf: ReplayBuffer, pool: SamplerPool, step: Callable[[], Any],
           rate: float | None, seconds: float) -> dict[str, Any]:
    """Learner batches/s and writer rows/s (both writers together) while the writers run."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=writer_main, args=(buf.name, lane, rate, stop), daemon=True)
             for lane in range(2)]
    for p in procs:
        p.start()
    raised, batches = "", 0
    try:
        start = np.asarray(buf.committed()).copy()
        deadline = time.monotonic() + 60
        while (np.asarray(buf.committed()) == start).any() and time.monotonic() < deadline:
            time.sleep(0.05)  # until both writers are attached and writing
        time.sleep(0.2)
        c0, t0, cpu0 = int(np.sum(buf.committed())), time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            try:
                step()
            except Exception as e:  # the learner must not raise: report what it did
                raised = f"{type(e).__name__}: {e}"[:160]
                break
            batches += 1
        took, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        rows = int(np.sum(buf.committed())) - c0
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return {"learner_batches_per_s": batches / took, "writer_rows_per_s": rows / took,
            "learner_cpu_ms_per_batch": 1e3 * cpu / max(batches, 1), "raised": raised}


def quiet_cpu_ms(step: Callable[[], Any], seconds: float) -> float:
    """The learner's CPU time per batch (this process; the load on the machine aside)."""
    cpu0, t0, n = time.process_time(), time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
    return 1e3 * (time.process_time() - cpu0) / n


def under_load(rows: int, seconds: float) -> dict[str, Any]:
    """Per write rate: the learner's quiet rate right before the writers start (the machine's
    load drifts: each loaded rate is compared with the quiet one next to it), then under the
    writers; the same for a uniform learner, whose writers are the baseline for the writers
    beside prioritized and whose own kept share is the peer (what CPU contention alone costs
    a learner on this machine)."""
    errors = tds(np.random.default_rng(1))
    out: dict[str, Any] = {}
    with filled(rows, lanes=2) as buf:
        with prioritized(buf) as pool:
            pool.next()
            step = learner_step(pool, errors)
            quiet_rates = []
            for rate in RATES:
                label = "flat out" if rate is None else f"{rate:.0f}"
                quiet_rates.append(benchlib.rate_for(step, seconds / 2))
                quiet_cpu = quiet_cpu_ms(step, seconds / 4)
                out[label] = loaded(buf, pool, step, rate, seconds)
                out[label]["quiet"] = quiet_rates[-1]
                out[label]["quiet_cpu_ms_per_batch"] = quiet_cpu
            out["quiet"] = statistics.median(quiet_rates)
        with SamplerPool(buf, batch_size=B, workers=0, seed=0, timeout=60) as uniform:
            for rate in RATES:
                label = "flat out" if rate is None else f"{rate:.0f}"
                quiet_uniform = benchlib.rate_for(uniform.next, seconds / 2)
                peer = loaded(buf, uniform, uniform.next, rate, seconds)
                out[label]["uniform_writer_rows_per_s"] = peer["writer_rows_per_s"]
                out[label]["uniform_kept"] = peer["learner_batches_per_s"] / quiet_uniform
    for rate in RATES:  # the peer: cpprb's multiprocess PER under the same writers' pacing
        label = "flat out" if rate is None else f"{rate:.0f}"
        out[label]["cpprb_mp"] = cpprb_mp_under_load(rate, seconds, rows, batch_size=B,
                                                     columns=COLUMNS, chunk=CHUNK,
                                                     alpha=ALPHA, beta=BETA)
    return out


def with_workers(rows: int, workers: list[int], seconds: float) -> dict[str, float]:
    """Quiet sample + update batches/s with sampler workers (prefetching in other processes)
    against in-process, side by side in rounds."""
    errors = tds(np.random.default_rng(1))
    out: dict[str, float] = {}
    with filled(rows) as buf:
        pools = [SamplerPool(buf, batch_size=B, selection=Prioritized(alpha=ALPHA, beta=BETA),
                             workers=w, seed=0, timeout=60) for w in workers]
        try:
            cases = []
            for w, pool in zip(workers, pools):
                pool.next()
                cases.append(TimedCase(str(w), benchlib.loop_runner(learner_step(pool, errors))))
            for case in cases:  # one pool at a time: the others' workers would compete
                benchlib.run_rounds([[case]], 3, seconds, f"workers={case.name}")
                out[case.name] = statistics.median(case.rates)
        finally:
            for pool in pools:
                pool.close()
    return out


# ------------------------------------------------------------------------------------------------
# Sequences (R2D2)
# ------------------------------------------------------------------------------------------------
SEQ_B, EPISODE_STEPS, CLASSES = 64, 400, 5  # windows per batch, steps per episode, priority bins


def episodes(rows: int) -> ReplayBuffer:
    """One lane of ``rows`` rows, an episode ending every ``EPISODE_STEPS`` steps."""
    buf = ReplayBuffer.create(SPEC, capacity=rows, lanes=1)
    chunk = benchlib.random_rows(SPEC, EPISODE_STEPS, np.random.default_rng(0))
    with buf.writer(lane=0) as w:
        for _ in range(rows // EPISODE_STEPS):
            w.extend(chunk)
            w.end_episode()
    return buf


def proportional_p(pool: SamplerPool, draws: int) -> tuple[float, float]:
    """Chi-square check of the draws: every valid start gets priority ``1 + start % CLASSES``;
    windows drawn are counted per class against ``count_c * (1 + c) ** alpha``. Returns (the
    statistic, its p-value; df = CLASSES - 1 = 4: P(X >= x) = exp(-x/2) (1 + x/2))."""
    table = pool._table
    assert table is not None
    held = np.arange(table.capacity)
    valid = held[table.leaf_values(np.zeros(held.size, np.int64), held) > 0]
    pool.update_priorities(valid, 1.0 + valid % CLASSES, lanes=0)
    counts = np.zeros(CLASSES)
    for _ in range(-(-draws // SEQ_B)):
        np.add.at(counts, np.asarray(pool.next().indices)[:, 0] % CLASSES, 1)
    share = np.bincount(valid % CLASSES, minlength=CLASSES) * (1.0 + np.arange(CLASSES)) ** ALPHA
    expected = counts.sum() * share / share.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    return stat, float(np.exp(-stat / 2) * (1 + stat / 2))


def sequences(rows: int, rounds: int, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with episodes(rows) as buf:
        for length in (16, 80):
            td = [np.abs(np.random.default_rng(k).standard_normal((SEQ_B, length)))
                  for k in range(TD_POOL)]
            with SamplerPool(buf, batch_size=SEQ_B, selection=Prioritized(alpha=ALPHA, beta=BETA),
                             plan=Plan(sequence_length=length), workers=0, seed=0,
                             timeout=60) as per, \
                 SamplerPool(buf, batch_size=SEQ_B, plan=Plan(sequence_length=length), workers=0,
                             seed=0, timeout=60) as uniform:
                t0 = time.perf_counter()
                per.next()
                first = time.perf_counter() - t0
                cases = [TimedCase("prioritized", benchlib.loop_runner(learner_step(per, td))),
                         TimedCase("uniform", benchlib.loop_runner(uniform.next))]
                benchlib.run_rounds([cases], rounds, seconds, f"sequences T={length}")
                stat, p = proportional_p(per, 40_000)
            out[str(length)] = {
                "prioritized_batches_per_s": statistics.median(cases[0].rates),
                "uniform_batches_per_s": statistics.median(cases[1].rates),
                "first_batch_s": first, "chi2": stat, "chi2_p": p}
    return out


def report(res: dict[str, Any]) -> None:
    q = res["quiet"]
    walks = "compiled" if res["compiled"] else "NumPy (the compiled sum tree is not built)"
    print(f"quiet, {res['rows']} rows, B={B}, {COLUMNS} float32, sum-tree walks {walks}: shmbuf "
          f"{q['shmbuf']:.0f} batches/s" + (f", cpprb {q['cpprb_rate']:.0f}, ratio "
                                            f"{q['shmbuf/cpprb']:.2f}x; CPU per batch "
                                            f"{q['shmbuf_cpu_us']:.0f} / "
                                            f"{q['cpprb_cpu_us']:.0f} us, ratio "
                                            f"{q['shmbuf/cpprb_cpu']:.2f}x"
                                            if "cpprb_rate" in q else f" ({q['cpprb']})"))
    if "shmbuf_numpy" in q:
        print(f"  the same with the NumPy walks: {q['shmbuf_numpy']:.0f} batches/s"
              + (f", ratio {q['shmbuf_numpy/cpprb']:.2f}x cpprb; CPU per batch "
                 f"{q['shmbuf_numpy_cpu_us']:.0f} us, ratio {q['shmbuf_numpy/cpprb_cpu']:.2f}x"
                 if "cpprb_rate" in q else ""))
    base = base_cpu = base_uniform = None
    for rows, s in [(k, v) for k, v in res["scale"].items() if k.isdigit()]:
        cpu, uniform = res["scale"][f"{rows}_cpu"], res["scale"].get(f"{rows}_uniform")
        base, base_cpu = base or s, base_cpu or cpu
        base_uniform = base_uniform or uniform
        print(f"scale {int(rows):>10,} rows: {s * 1e3:.3f} ms per batch ({s / base:.2f}x), "
              f"CPU {cpu * 1e3:.3f} ms ({cpu / base_cpu:.2f}x)"
              + (f"; uniform next() beside it {uniform * 1e3:.3f} ms ({uniform / base_uniform:.2f}x)"
                 if uniform and base_uniform else ""))
    if res.get("workers"):
        w = res["workers"]
        print("sample + update with sampler workers (quiet): " + ", ".join(
            f"{k} workers {v:.0f} batches/s ({v / w['0']:.2f}x)" for k, v in w.items()))
    load = res["load"]
    print(f"under load (2 writers, {res['rows']} rows in 2 lanes); learner quiet "
          f"{load['quiet']:.0f} batches/s (median of the quiet rates next to each load)")
    for label in [k for k in load if k != "quiet"]:
        r = load[label]
        print(f"  {label:>8} rows/s each: learner {r['learner_batches_per_s']:.0f} batches/s "
              f"({r['learner_batches_per_s'] / r['quiet']:.2f} of quiet; a uniform learner "
              f"keeps {r['uniform_kept']:.2f}; learner CPU per batch "
              f"{r['learner_cpu_ms_per_batch'] / r['quiet_cpu_ms_per_batch']:.2f}x quiet's), "
              f"writers {r['writer_rows_per_s']:,.0f} rows/s "
              f"({r['writer_rows_per_s'] / max(1.0, r['uniform_writer_rows_per_s']):.2f}"
              f" of {r['uniform_writer_rows_per_s']:,.0f} beside uniform)"
              + (f"  RAISED {r['raised']}" if r["raised"] else ""))
        c = r["cpprb_mp"]
        print(f"  {'':>8} cpprb MPPrioritizedReplayBuffer: " + (c["skipped"] if "skipped" in c else
              f"learner {c['learner_batches_per_s']:.0f} batches/s "
              f"({c['learner_batches_per_s'] / c['quiet']:.2f} of its quiet "
              f"{c['quiet']:.0f}), writers {c['writer_rows_per_s']:,.0f} rows/s"
              + (f"  RAISED {c['raised']}" if c["raised"] else "")))
    for length, r in res.get("sequences", {}).items():
        print(f"sequences T={length}, B={SEQ_B}, {res['rows']} rows: prioritized sample + [B, T] "
              f"update {r['prioritized_batches_per_s']:.0f} batches/s, uniform "
              f"{r['uniform_batches_per_s']:.0f} "
              f"({r['prioritized_batches_per_s'] / r['uniform_batches_per_s']:.2f}x); first "
              f"batch {r['first_batch_s'] * 1e3:.0f} ms; chi-square of 40k windows over "
              f"{CLASSES} priority classes {r['chi2']:.2f}, p = {r['chi2_p']:.3f} "
              f"({'proportional' if r['chi2_p'] > 1e-3 else 'NOT proportional'})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="no 10M scale row, shorter rounds")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--skip", default="",
                   help="comma list of quiet,scale,load,workers,sequences to skip")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    seconds = args.seconds or (0.5 if args.quick else 2.0)
    skip = set(args.skip.split(","))
    import shmbuf
    res: dict[str, Any] = {"rows": args.rows, "shmbuf": shmbuf.__file__,
                           "machine": benchlib.machine_line(benchlib.machine())}
    res["compiled"] = sumtree.compiled()
    print(f"shmbuf from {shmbuf.__file__}; {res['machine']}")
    res["quiet"] = quiet(args.rows, args.rounds, seconds) if "quiet" not in skip else {
        "shmbuf": float("nan"), "cpprb": "skipped"}
    sizes = [100_000, 1_000_000] + ([] if args.quick else [10_000_000])
    res["scale"] = scale(sizes, seconds) if "scale" not in skip else {}
    res["workers"] = with_workers(args.rows, [0, 1, 2], seconds) if "workers" not in skip else {}
    res["load"] = under_load(args.rows, max(seconds, 2.0)) if "load" not in skip else {
        "quiet": 1.0}
    if "sequences" not in skip:
        res["sequences"] = sequences(args.rows, args.rounds, seconds)
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
