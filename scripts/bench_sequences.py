#!/usr/bin/env python
"""Sequence benchmark: ``[B, T]`` sequence batches, frame stacks, n-step and derived ``next_obs``.

Issue 4's benchmark, in one run: sequence batches/s for T = 16 and 64 (B = 32 and 64) from a
100k- and a 1M-row buffer, strict and episode-crossing windows, each against a plain gather of
the same bytes, plus the cost of the transition options (frame_stack=4, n_step=3, derived
next_obs) against plain uniform ``sample_into``. The method is bench_storage.py's: every case
runs next to its baselines in the same round, the order flipped every other round; a rate is
the median over rounds and a ratio the median of the per-round ratios. Benchmarks report, they
do not gate: the exit code is 0 unless ``--check`` is given and a gated target is missed.
Results and their reading: BENCHMARKS.md, "Sequences".

    python scripts/bench_sequences.py [--quick] [--rounds N] [--json PATH] [--check]
                                      [--capacities SMALL,LARGE]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import benchlib
from benchlib import fmt_us
from shmbuf import ReplayBuffer, Spec

# mujoco-sized rows (165 B): issue 2's workload, with ``terminated`` for n-step.
STORED = {
    "obs": ((17,), "float32"),
    "next_obs": ((17,), "float32"),
    "action": ((6,), "float32"),
    "reward": ((), "float32"),
    "terminated": ((), "bool"),
}
DERIVED = {k: v for k, v in STORED.items() if k != "next_obs"}  # next_obs read from obs[t+1]
CAPACITIES = (100_000, 1_000_000)
QUICK_CAPACITIES = (10_000, 100_000)
SEQ_LENGTHS = (16, 64)
SEQ_BATCHES = (32, 64)
OPTION_BATCH = 256
EPISODE_LEN = (200, 1000)  # episode lengths drawn uniformly from [lo, hi]
OVERFILL = 1.25  # rows written per row of capacity: the ring has wrapped, as in training
# Issue 4: the cost of drawing a batch must not grow with the buffer's size. Any gather from a
# bigger buffer slows down (cache and TLB misses): the raw gather of the same bytes, with no
# shmbuf code, is the yardstick. Gate: our 1M/100k rate ratio is at least the raw gather's
# (less MIN_SIZE_SLACK for noise); the absolute ratio is reported beside it.
MIN_SIZE_RATIO = 0.85  # informational: the absolute 1M/100k ratio a "flat" cost would show
MIN_SIZE_SLACK = 0.05
NOT_PAYLOAD = ("mask", "discount", "steps")  # plan outputs not counted as gathered bytes


# ------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------
@dataclass
class Case(benchlib.TimedCase):
    """One timed operation: one run draws one batch of ``nbytes`` payload bytes."""

    nbytes: int = 0

    def summary(self) -> dict[str, Any]:
        per = statistics.median(self.secs)
        return {"batches_per_s": 1 / per, "gb_per_s": self.nbytes / per / 1e9,
                "us_per_batch": per * 1e6, "payload_bytes": self.nbytes,
                "faults_per_batch": statistics.median(self.faults), "batches_per_round": self.n,
                "us_per_batch_rounds": [s * 1e6 for s in self.secs]}


@dataclass
class Group:
    """Cases measured back to back in every round; ``pairs`` (case, baseline) give ratios of
    their rates (batches/s), so > 1 means the case is faster."""

    key: str
    cases: list[Case]
    pairs: list[tuple[str, str]]


def summarize(g: Group) -> dict[str, Any]:
    by_name = {c.name: c for c in g.cases}
    ratios = {f"{a}/{b}": benchlib.ratio(by_name[a], by_name[b]) for a, b in g.pairs}
    return {"cases": {c.name: c.summary() for c in g.cases}, "ratios": ratios}


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------
def fill(buf: ReplayBuffer, rows: int, rng: np.random.Generator) -> int:
    """Write episodes of random length (``EPISODE_LEN``) with one ``extend`` each until
    ``rows`` rows are written; half end terminated, half truncated. The last one stays open.
    Returns the number of episodes ended."""
    hi = EPISODE_LEN[1]
    pool = {n: rng.standard_normal((2 * hi, *s), dtype=np.float32) for n, (s, d) in STORED.items()
            if d == "float32"}
    term = np.zeros(hi, bool)
    written = episodes = 0
    with buf.writer() as w:
        while written < rows:
            length = min(int(rng.integers(EPISODE_LEN[0], hi + 1)), rows - written)
            o = int(rng.integers(0, hi))
            terminated = length < rows - written and bool(rng.integers(2))
            term[length - 1] = terminated
            w.extend({**{n: a[o : o + length] for n, a in pool.items()},
                      "terminated": term[:length]})  # a derived buffer takes next_obs too
            term[length - 1] = False
            written += length
            if written < rows:
                w.end_episode(truncated=not terminated)
                episodes += 1
    return episodes


def payload_bytes(outputs: Any, batch: int) -> int:
    """Bytes of a batch's field arrays (not masks, discounts or step counts)."""
    return batch * sum(math.prod(s) * d.itemsize for n, s, d in outputs
                       if n not in NOT_PAYLOAD and not n.endswith("_mask"))


def short(capacity: int) -> str:
    """1000000 -> "1M", 100000 -> "100k", other sizes as they are."""
    if capacity % 1_000_000 == 0:
        return f"{capacity // 1_000_000}M"
    return f"{capacity // 1000}k" if capacity % 1000 == 0 else str(capacity)


# ------------------------------------------------------------------------------------------------
# Groups
# ------------------------------------------------------------------------------------------------
def sequence_group(bufs: dict[int, ReplayBuffer], T: int, B: int, rng_seed: int,
                   views: list[list[Any]]) -> Group:
    """Strict and crossing windows from both buffers, and the raw gather from both.

    The raw gather draws B start slots, builds the ``[B, T]`` index matrix and ``np.take``s
    every field of the same shared memory into reused ``[B, T, ...]`` arrays: the same bytes,
    without seqlock, window or episode checks. The two sizes of each case run next to each
    other, so the size ratios compare neighbours. The column views go into ``views``, for the
    caller to drop before closing.
    """
    cases = []
    for mode in ("strict", "cross", "raw"):
        for cap, buf in bufs.items():
            rng = np.random.default_rng(rng_seed)
            if mode == "raw":
                cols = [(buf.column(n), np.empty((B, T, *f.shape), f.dtype))
                        for n, f in buf.spec.items()]
                flat = [(col, dst.reshape(B * T, *dst.shape[2:])) for col, dst in cols]
                views.append(flat)
                op, nbytes = _raw_op(flat, buf.capacity, T, B, rng), B * T * buf.spec.row_nbytes
            else:
                plan = buf.compile(sequence_length=T, cross_episodes=mode == "cross")
                op = _sample_op(buf, plan.allocate(B), rng, plan)
                nbytes = payload_bytes(plan.outputs, B)
            cases.append(Case(f"{mode} {short(cap)}", benchlib.loop_runner(op), nbytes=nbytes))
    small, large = (short(c) for c in bufs)
    pairs = [(f"{m} {tag}", f"raw {tag}") for tag in (small, large) for m in ("strict", "cross")]
    pairs += [(f"{m} {large}", f"{m} {small}") for m in ("strict", "cross", "raw")]
    return Group(f"B={B} T={T}", cases, pairs)


def _sample_op(buf: ReplayBuffer, out: dict[str, np.ndarray], rng: np.random.Generator,
               plan: Any | None) -> Callable[[], Any]:
    sample_into = buf.sample_into
    return lambda: sample_into(out, rng, plan=plan)


def _raw_op(flat: list[tuple[np.ndarray, np.ndarray]], capacity: int, T: int, B: int,
            rng: np.random.Generator) -> Callable[[], None]:
    take, integers, steps = np.take, rng.integers, np.arange(T, dtype=np.int64)

    def raw() -> None:
        idx = (integers(0, capacity - T + 1, size=B, dtype=np.int64)[:, None] + steps).ravel()
        for col, dst in flat:
            take(col, idx, axis=0, out=dst, mode="clip")

    return raw


def options_group(stored: ReplayBuffer, derived: ReplayBuffer, B: int, rng_seed: int) -> Group:
    """Transition batches with each option against plain uniform ``sample_into`` of the same
    fields (obs, next_obs, action, reward, terminated) from the stored-next_obs buffer."""
    variants = [
        ("plain", stored, {}),
        ("frame_stack=4", stored, {"frame_stack": 4}),
        ("n_step=3", stored, {"n_step": 3, "gamma": 0.99}),
        ("derived next_obs", derived, {}),
        ("derived, frame_stack=4", derived, {"frame_stack": 4}),
        ("derived, n_step=3", derived, {"n_step": 3, "gamma": 0.99}),
    ]
    cases = []
    for name, buf, kw in variants:
        plan = buf.compile(**kw)
        out = plan.allocate(B)
        rng = np.random.default_rng(rng_seed)
        # "plain" passes no plan: the buffer's own fast path, what sample(B) takes
        op = _sample_op(buf, out, rng, None if name == "plain" else plan)
        cases.append(Case(name, benchlib.loop_runner(op), nbytes=payload_bytes(plan.outputs, B)))
    return Group(f"options B={B}", cases, [(c.name, "plain") for c in cases[1:]])


# ------------------------------------------------------------------------------------------------
# Machine, space check, report
# ------------------------------------------------------------------------------------------------
def check_space(capacities: tuple[int, ...]) -> bool:
    """Whether /dev/shm and RAM can hold the three buffers (both sizes of the stored buffer and
    the large derived one); says why not on stderr."""
    row = Spec(STORED).row_nbytes + 16  # + stamp and meta words
    need = (sum(capacities) * row + max(capacities) * (Spec(DERIVED).row_nbytes + 16)
            + (16 << 20))
    return benchlib.has_space("bench_sequences", need, need + (256 << 20), "1g")


def _side(c: dict[str, Any]) -> str:
    return f"{c['batches_per_s']:>9,.0f} {c['gb_per_s']:6.2f} {fmt_us(c['us_per_batch']):>9}"


def report(res: dict[str, Any], caps: tuple[int, ...], targets: list[dict[str, Any]]) -> str:
    small, large = (short(c) for c in caps)
    lines = []
    head = (f"{'B':>3} {'T':>3} {'windows':7} {'rows':>5}   {'batches/s':>9} {'GB/s':>6} "
            f"{'per batch':>9}   {'raw gather':>9} {'GB/s':>6} {'per batch':>9}   "
            f"{'ratio':>5}  range")
    lines += ["sequences: buf.sample_into(out, rng, plan=buf.compile(sequence_length=T, "
              "cross_episodes=...)) against a raw [B, T] np.take gather", head,
              "-" * len(head)]
    for key, g in res["sequences"].items():
        B, T = (int(x.split("=")[1]) for x in key.split())
        cs, rs = g["cases"], g["ratios"]
        for cap in (small, large):
            for mode in ("strict", "cross"):
                r = rs[f"{mode} {cap}/raw {cap}"]
                lines.append(f"{B:>3} {T:>3} {mode:7} {cap:>5}   {_side(cs[f'{mode} {cap}'])}   "
                             f"{_side(cs[f'raw {cap}'])}   {r['median']:5.2f}  "
                             f"{r['min']:.2f}-{r['max']:.2f}")
    lines.append("")
    head = (f"{'B':>3} {'T':>3} {'windows':7}   {large}/{small} rate  range        "
            f"+us/batch   raw {large}/{small}  range        +us/batch")
    lines += [f"size: each rate at {large} rows over the same rate at {small} rows "
              f"(1.00 = no growth), and the time {large} adds per batch", head, "-" * len(head)]
    for key, g in res["sequences"].items():
        B, T = (int(x.split("=")[1]) for x in key.split())
        cs, rs = g["cases"], g["ratios"]
        raw = rs[f"raw {large}/raw {small}"]
        raw_add = cs[f"raw {large}"]["us_per_batch"] - cs[f"raw {small}"]["us_per_batch"]
        for mode in ("strict", "cross"):
            r = rs[f"{mode} {large}/{mode} {small}"]
            add = cs[f"{mode} {large}"]["us_per_batch"] - cs[f"{mode} {small}"]["us_per_batch"]
            lines.append(f"{B:>3} {T:>3} {mode:7}   {r['median']:13.2f}  "
                         f"{r['min']:.2f}-{r['max']:.2f}  {add:+9.1f}   {raw['median']:13.2f}  "
                         f"{raw['min']:.2f}-{raw['max']:.2f}  {raw_add:+9.1f}")
    lines.append("")
    g = res["options"]
    cs, rs = g["cases"], g["ratios"]
    head = (f"{'transition batch':24} {'batches/s':>9} {'GB/s':>6} {'per batch':>9} "
            f"{'flt':>4}   {'vs plain':>8}  range")
    lines += [f"options: B={OPTION_BATCH} transitions from {large} rows, each against plain "
              f"uniform sample_into of the stored buffer", head, "-" * len(head)]
    for name, c in cs.items():
        r = rs.get(f"{name}/plain")
        ratio = f"{r['median']:8.2f}  {r['min']:.2f}-{r['max']:.2f}" if r else f"{'1':>8}"
        lines.append(f"{name:24} {_side(c)} {c['faults_per_batch']:4.0f}   {ratio}")
    lines.append("")
    for t in targets:
        verdict = ("PASS" if t["pass"] else "MISS") if t["gated"] else "info"
        lines.append(f"{verdict}  {t['label']}: {t['value']:.2f}")
    return "\n".join(lines)


def evaluate(res: dict[str, Any], caps: tuple[int, ...]) -> list[dict[str, Any]]:
    """Issue 4's target, per (B, T, windows): going from the small to the large buffer slows a
    sequence batch no more than it slows a raw gather of the same bytes (gated); and the
    absolute large/small rate ratio against ``MIN_SIZE_RATIO`` (reported, not gated)."""
    small, large = (short(c) for c in caps)
    out = []
    for key, g in res["sequences"].items():
        raw = g["ratios"][f"raw {large}/raw {small}"]["median"]
        for mode in ("strict", "cross"):
            v = g["ratios"][f"{mode} {large}/{mode} {small}"]["median"]
            out.append({"label": f"{key} {mode}: {large}/{small} rate ratio >= raw gather's "
                                 f"({raw:.2f}) - {MIN_SIZE_SLACK}",
                        "value": v, "threshold": raw - MIN_SIZE_SLACK,
                        "pass": v >= raw - MIN_SIZE_SLACK, "gated": True})
            out.append({"label": f"{key} {mode}: {large} rate >= {MIN_SIZE_RATIO} x {small} "
                                 f"rate (absolute; informational)",
                        "value": v, "threshold": MIN_SIZE_RATIO, "pass": v >= MIN_SIZE_RATIO,
                        "gated": False})
    return out


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------
def bench(caps: tuple[int, ...], rounds: int, seconds: float) -> dict[str, Any]:
    """Create and fill the buffers, measure every group in rounds; the buffers are closed (and
    their segments unlinked) however this returns."""
    rng = np.random.default_rng(0)
    bufs: dict[int, ReplayBuffer] = {}
    derived: ReplayBuffer | None = None
    try:
        # The column views go into ``views``: they must be gone before the buffers unmap.
        with benchlib.releasing([]) as views:
            t0 = time.perf_counter()
            for cap in caps:
                bufs[cap] = ReplayBuffer.create(Spec(STORED), cap)
                fill(bufs[cap], int(cap * OVERFILL), rng)
            derived = ReplayBuffer.create(Spec(DERIVED), caps[-1], next_obs="derived")
            fill(derived, int(caps[-1] * OVERFILL), rng)
            shm_mb = (sum(b.nbytes for b in bufs.values()) + derived.nbytes) / 1e6
            print(f"  {len(caps) + 1} buffers, {shm_mb:.0f} MB of /dev/shm, filled in "
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
            seq = [sequence_group(bufs, T, B, 10 * T + B, views)
                   for B in SEQ_BATCHES for T in SEQ_LENGTHS]
            opt = options_group(bufs[caps[-1]], derived, OPTION_BATCH, 1)
            benchlib.run_rounds([g.cases for g in [*seq, opt]], rounds, seconds)
            return {"sequences": {g.key: summarize(g) for g in seq}, "options": summarize(opt),
                    "buffer_bytes": {short(c): b.nbytes for c, b in bufs.items()},
                    "derived_buffer_bytes": derived.nbytes}
    finally:
        for b in [*bufs.values(), derived]:
            if b is not None:
                b.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_options = benchlib.add_run_options(
        p, "10k/100k-row buffers and short rounds: a smoke test (about 5 s)", 0.2, 0.03)
    p.add_argument("--capacities", metavar="SMALL,LARGE",
                   help="the two buffer sizes to compare (default 100000,1000000, or "
                        "10000,100000 with --quick)")
    args = p.parse_args(argv)
    rounds, seconds = run_options(args)
    caps = QUICK_CAPACITIES if args.quick else CAPACITIES
    if args.capacities:
        try:
            caps = tuple(int(x) for x in args.capacities.split(","))
        except ValueError:
            caps = ()
        if len(caps) != 2 or not 0 < caps[0] < caps[1] or caps[0] <= 2 * EPISODE_LEN[1]:
            p.error(f"--capacities takes two sizes SMALL,LARGE with {2 * EPISODE_LEN[1]} < SMALL "
                    f"< LARGE, got {args.capacities!r}")
    if not check_space(caps):
        return 2

    info = benchlib.machine()
    clock = benchlib.RunClock()
    try:
        res = bench(caps, rounds, seconds)
    except KeyboardInterrupt:
        print("bench_sequences: interrupted; buffers closed", file=sys.stderr)
        return 130
    runtime, others = clock.stop()
    targets = evaluate(res, caps)

    print(f"shmbuf sequence benchmark{' (--quick)' if args.quick else ''}: "
          f"{' and '.join(f'{c:,}' for c in caps)} rows of 165 B (mujoco), episodes of "
          f"{EPISODE_LEN[0]}-{EPISODE_LEN[1]} steps, rings wrapped; {rounds} rounds x {seconds}s "
          f"per case; medians")
    print(benchlib.machine_line(info))
    print(report(res, caps, targets))
    if args.quick:
        print(f"(--quick: {caps[0]:,} rows fit in the CPU caches, so the lines above test the "
              f"script, not the target)")
    print(benchlib.runtime_line(runtime, others))
    return benchlib.finish(args, {
        "argv": sys.argv, "quick": args.quick, "rounds": rounds, "seconds": seconds,
        "capacities": list(caps), "machine": info, "runtime_s": runtime,
        "other_cpu_fraction": others, "results": res, "targets": targets})


if __name__ == "__main__":
    sys.exit(main())
