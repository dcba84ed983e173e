#!/usr/bin/env python
"""Storage benchmark: shmbuf ``add``/``extend``/``sample`` against plain-NumPy baselines.

Every measurement runs next to its baselines in the same round, on the same data, with the order
flipped every other round; a rate is the median over rounds and a ratio the median of the
per-round ratios (a 2-core machine is noisy). Each workload runs in a fresh process, as a learner
would (see ``run_isolated``). Benchmarks report, they do not gate: the exit code is 0 unless
``--check`` is given and a gated target is missed. Results and their reading: BENCHMARKS.md.

The keep-up section (``--only keepup-atari``/``keepup-mujoco``, issue 13) measures one actor
process's ``add`` rate while the buffer is sampled, against the same actor's rate alone.

    python scripts/bench_storage.py [--quick] [--only NAME] [--rounds N] [--json PATH] [--check]
                                    [--store numpy]

``--store numpy`` measures the NumPy store and add (``shmbuf/store.py``), as a machine without a
compiler runs them (``SHMBUF_STORE=numpy``, passed on to every workload's process).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import benchlib
from benchlib import fmt_us, loop_runner
from shmbuf import ReplayBuffer, Spec
from shmbuf import store as shmbuf_store
from workers import ActorContext, ActorGroup, SamplerPool

EXTEND_ROWS = 1000  # rows per extend() call (the same batch every call)
ROW_POOL = 1000  # distinct per-step transitions that add() cycles through

FIELDS = ("obs", "next_obs", "action", "reward", "done")  # both workloads use these names


@dataclass(frozen=True)
class Workload:
    """A transition spec, the ring capacity it is measured at and the sample batch sizes."""

    name: str
    spec: dict[str, tuple[tuple[int, ...], str]]
    capacity: int
    quick_capacity: int
    batches: tuple[int, ...]


WORKLOADS = (
    Workload(
        "mujoco",
        {
            "obs": ((17,), "float32"),
            "next_obs": ((17,), "float32"),
            "action": ((6,), "float32"),
            "reward": ((), "float32"),
            "done": ((), "bool"),
        },
        capacity=1_000_000,
        quick_capacity=100_000,
        batches=(256,),
    ),
    Workload(
        "atari",
        {
            "obs": ((4, 84, 84), "uint8"),
            "next_obs": ((4, 84, 84), "uint8"),
            "action": ((), "int64"),
            "reward": ((), "float32"),
            "done": ((), "bool"),
        },
        capacity=50_000,
        quick_capacity=5_000,
        batches=(32, 256),
    ),
)


@dataclass(frozen=True)
class Target:
    """A goal from issue 2: ``metric`` (a rate or a ratio) must reach ``threshold``."""

    label: str
    workload: str
    metric: str  # a case name (absolute rate) or "case/baseline" (ratio)
    threshold: float
    gated: bool = True  # counts for --check
    note: str = "upper bound; not gated by --check"  # shown when not gated


TARGETS = (
    Target("mujoco add >= 250,000 rows/s", "mujoco", "shmbuf add", 250_000),
    Target("mujoco extend(1000) >= 0.5 x numpy ring", "mujoco",
           "shmbuf extend(1000)/numpy ring copyto", 0.5),
    Target("mujoco extend(1000) >= 0.5 x hot memcpy", "mujoco",
           "shmbuf extend(1000)/hot memcpy", 0.5, gated=False),
    Target("atari extend(1000) >= 0.5 x numpy ring", "atari",
           "shmbuf extend(1000)/numpy ring copyto", 0.5),
    Target("atari extend(1000) >= 0.5 x hot memcpy", "atari",
           "shmbuf extend(1000)/hot memcpy", 0.5, gated=False),
    Target("mujoco sample(256) >= 0.5 x raw gather", "mujoco",
           "sample() B=256/raw np.take B=256", 0.5),
    Target("mujoco sample_into(256) >= 0.5 x raw gather", "mujoco",
           "sample_into B=256/raw np.take B=256", 0.5),
    Target("atari sample(256) >= 0.8 x raw gather", "atari",
           "sample() B=256/raw np.take B=256", 0.8),
    Target("atari sample_into(256) >= 0.8 x raw gather", "atari",
           "sample_into B=256/raw np.take B=256", 0.8),
    # Issue 13: readers must not slow writers. Four workers, the learner and the actor need
    # six cores, so on fewer the four-worker figures also measure CPU sharing (the actor's rate,
    # and per second on a CPU the caches it finds cold after each preemption) and are not
    # gated; the paced learner's per CPU-second figure measures what the samplers' memory
    # traffic costs the writer.
    *(Target(f"{wl} actor while 4 workers sample >= 0.9 x alone", f"keepup-{wl}",
             "4 workers/alone", 0.9, gated=(os.cpu_count() or 1) >= 6,
             note="4 workers + learner + actor need 6 cores; not gated on fewer")
      for wl in ("atari", "mujoco")),
    *(Target(f"{wl} actor per CPU-second while 4 workers sample >= 0.9 x alone",
             f"keepup-{wl}", "4 workers/alone per CPU", 0.9, gated=(os.cpu_count() or 1) >= 6,
             note="counts preemptions on fewer than 6 cores; not gated there")
      for wl in ("atari", "mujoco")),
    *(Target(f"{wl} actor per CPU-second while 4 workers feed a 5 ms train step >= 0.9 x "
             f"alone", f"keepup-{wl}", "4 workers, 5 ms step/alone per CPU", 0.9)
      for wl in ("atari", "mujoco")),
)


# ------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------
@dataclass
class Case(benchlib.TimedCase):
    """A timed operation whose rate counts ``work``, what one operation moves: rows
    (``unit`` "rows/s") or bytes (``unit`` "GB/s")."""

    work: float = 1.0
    unit: str = "rows/s"

    @property
    def rates(self) -> list[float]:
        scale = 1e-9 if self.unit == "GB/s" else 1.0
        return [self.work * scale / s for s in self.secs]


@dataclass
class Group:
    """Cases measured back to back in every round; ``pairs`` (case, baseline) give the ratios."""

    cases: list[Case]
    pairs: list[tuple[str, str]]


def summarize(groups: list[Group]) -> dict[str, Any]:
    """Median rate per case, median (and range) of the per-round ratio per pair."""
    cases: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for g in groups:
        by_name = {c.name: c for c in g.cases}
        for c in g.cases:
            cases[c.name] = {
                "unit": c.unit,
                "median": statistics.median(c.rates),
                "op_us": statistics.median(c.secs) * 1e6,
                "faults_per_op": statistics.median(c.faults),
                "ops_per_round": c.n,
                "rounds": c.rates,
            }
        for a, b in g.pairs:
            ratios[f"{a}/{b}"] = {"case": a, "baseline": b,
                                  **benchlib.ratio(by_name[a], by_name[b])}
    return {"cases": cases, "ratios": ratios}


# ------------------------------------------------------------------------------------------------
# Data and baselines
# ------------------------------------------------------------------------------------------------
def make_rows(batch: dict[str, np.ndarray]) -> list[tuple[Any, ...]]:
    """Per-step transitions as an environment loop hands them over: a fresh array per
    observation and action vector, Python scalars for reward, done and a discrete action."""
    rows = []
    for i in range(batch["obs"].shape[0]):
        row = []
        for name in FIELDS:
            v = batch[name][i]
            row.append(v.copy() if v.ndim else v.item())
        rows.append(tuple(row))
    return rows


class NumpyRing:
    """The baseline store: preallocated NumPy arrays written in place, as Stable-Baselines3's
    ``ReplayBuffer.add`` does (row assignment at a wrapping position), without shared memory,
    validation or any cross-process protocol."""

    def __init__(self, spec: Spec, capacity: int) -> None:
        self.capacity = capacity
        self.pos = 0
        self.full = False
        self.cols = {n: np.empty((capacity, *f.shape), f.dtype) for n, f in spec.items()}
        self.obs, self.next_obs = self.cols["obs"], self.cols["next_obs"]
        self.action, self.reward, self.done = (self.cols[n] for n in ("action", "reward", "done"))

    def add(self, obs: Any, next_obs: Any, action: Any, reward: Any, done: Any) -> None:
        p = self.pos
        self.obs[p] = obs
        self.next_obs[p] = next_obs
        self.action[p] = action
        self.reward[p] = reward
        self.done[p] = done
        self.pos = p + 1
        if self.pos == self.capacity:
            self.full = True
            self.pos = 0

    def copy_in(self, batch: dict[str, np.ndarray], n: int) -> None:
        """np.copyto of n rows at the advancing ring position (split at the wrap)."""
        p, C = self.pos, self.capacity
        head = min(n, C - p)
        for name, dst in self.cols.items():
            src = batch[name]
            np.copyto(dst[p : p + head], src[:head])
            if head < n:
                np.copyto(dst[: n - head], src[head:n])
        self.pos = (p + n) % C


def add_runner(add: Callable[..., Any], rows: list[tuple[Any, ...]]) -> Callable[[int], float]:
    def run(n: int) -> float:
        full, rest = divmod(n, len(rows))
        tail = rows[:rest]
        t0 = time.perf_counter()
        for _ in range(full):
            for o, no, a, r, d in rows:
                add(obs=o, next_obs=no, action=a, reward=r, done=d)
        for o, no, a, r, d in tail:
            add(obs=o, next_obs=no, action=a, reward=r, done=d)
        return time.perf_counter() - t0

    return run


def env_rows(spec: Spec, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``rows`` as a one-env vectorized environment hands them over (SB3's ``add``, a
    one-env ``VectorWriter``): every field an array of its dtype with a leading axis of 1."""
    dtypes = [spec[name].dtype for name in FIELDS]
    return [tuple(np.asarray(v, dt).reshape(1, *np.shape(v)) for v, dt in zip(row, dtypes))
            for row in rows]


SMALL_CAPACITY = 2000  # rows per lane of the buffers that only the one-env add cases write


def one_env_group(spec: Spec, rows: list[tuple[Any, ...]], stack: Any) -> Group:
    """``Writer.add`` and a one-env ``VectorWriter.add`` on two lanes of one small buffer, and
    SB3's own ``ReplayBuffer.add`` with shmbuf's SB3 adapter, both of ``SMALL_CAPACITY`` rows
    (issue 12: the vector writer within 10% of the writer, add within 1.5x of SB3's).
    Buffers and writers are entered on ``stack``. SB3 cases only where SB3 is installed."""
    buf = stack.enter_context(ReplayBuffer.create(spec, SMALL_CAPACITY, lanes=2))
    w = stack.enter_context(buf.writer(lane=0))
    vw = stack.enter_context(buf.writer(lanes=[1], num_envs=1))
    vrows = env_rows(spec, rows)
    batch = {name: np.concatenate([np.asarray(r[k], spec[name].dtype)[None] for r in rows])
             for k, name in enumerate(FIELDS)}
    for _ in range(-(-SMALL_CAPACITY // len(rows))):  # touch every page, as the big buffer's
        w.extend(batch)
    add_runner(vw.add, vrows)(SMALL_CAPACITY)
    cases = [Case("writer add (2k)", add_runner(w.add, rows)),
             Case("vector(1) add", add_runner(vw.add, vrows))]
    pairs = [("vector(1) add", "writer add (2k)")]
    try:
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer as SB3Buffer

        from shmbuf.integrations.sb3 import ReplayBuffer as SharedSB3
    except ImportError:
        return Group(cases, pairs)
    f = spec["obs"]
    obs_space = spaces.Box(0, 255, f.shape, f.dtype) if f.dtype.kind == "u" else spaces.Box(
        -np.inf, np.inf, f.shape, f.dtype)
    a = spec["action"]
    act_space = spaces.Discrete(18) if a.shape == () else spaces.Box(-1, 1, a.shape, a.dtype)
    sb3 = SB3Buffer(SMALL_CAPACITY, obs_space, act_space, device="cpu")
    shared = SharedSB3(SMALL_CAPACITY, obs_space, act_space, device="cpu")
    stack.callback(shared.close)
    infos: list[dict[str, Any]] = [{}]
    srows = [(o, no, act.reshape(1, -1) if act.ndim == 1 else act, r, d)
             for o, no, act, r, d in vrows]

    def sb3_runner(target: Any) -> Callable[[int], float]:
        add = target.add

        def run(n: int) -> float:
            full, rest = divmod(n, len(srows))
            t0 = time.perf_counter()
            for _ in range(full):
                for o, no, act, r, d in srows:
                    add(o, no, act, r, d, infos)
            for o, no, act, r, d in srows[:rest]:
                add(o, no, act, r, d, infos)
            return time.perf_counter() - t0

        return run

    for target in (sb3, shared):
        sb3_runner(target)(SMALL_CAPACITY)  # touch every page
    cases += [Case("sb3 add", sb3_runner(sb3)), Case("shmbuf sb3 add", sb3_runner(shared))]
    pairs += [("writer add (2k)", "sb3 add"), ("vector(1) add", "sb3 add"),
              ("shmbuf sb3 add", "sb3 add")]
    return Group(cases, pairs)


def sample_group(buf: ReplayBuffer, spec: Spec, cols: dict[str, np.ndarray], B: int,
                 row_bytes: int, views: list[Any]) -> Group:
    """``buf.sample()`` (new arrays per call, the public API) and ``buf.sample_into()`` (reused
    arrays) against ``np.take(..., mode="clip")`` of the same fields from the same shared memory
    into reused arrays. Every case draws its own random indices: the RNG draw is in all three.
    The column views it holds are appended to ``views``, for the caller to drop before closing."""
    N = len(buf)
    out = {n: np.zeros((B, *f.shape), f.dtype) for n, f in spec.items()}
    raw_out = {n: np.zeros((B, *f.shape), f.dtype) for n, f in spec.items()}
    rng_s, rng_i, rng_r = (np.random.default_rng(seed) for seed in (1, 2, 3))
    pairs = [(cols[n], raw_out[n]) for n in spec]
    views.append(pairs)
    take, integers = np.take, rng_r.integers

    def raw() -> None:
        idx = integers(0, N, size=B)
        for col, dst in pairs:
            take(col, idx, axis=0, out=dst, mode="clip")

    nbytes = B * row_bytes
    s, si, r = f"sample() B={B}", f"sample_into B={B}", f"raw np.take B={B}"
    return Group(
        [
            Case(s, loop_runner(lambda: buf.sample(B, rng_s)), work=nbytes, unit="GB/s"),
            Case(si, loop_runner(lambda: buf.sample_into(out, rng_i)), work=nbytes, unit="GB/s"),
            Case(r, loop_runner(raw), work=nbytes, unit="GB/s"),
        ],
        [(s, r), (si, r)],
    )


# ------------------------------------------------------------------------------------------------
# One workload
# ------------------------------------------------------------------------------------------------
def bench_workload(wl: Workload, capacity: int, rounds: int, seconds: float) -> dict[str, Any]:
    """Fill a buffer and a NumPy ring of ``capacity`` rows, then measure every group in rounds.

    Both stores stay full throughout (extend and add wrap around), so sampled indices span the
    whole ring. The buffer is closed (and its segment unlinked) however this returns.
    """
    spec = Spec(wl.spec)
    assert tuple(spec) == FIELDS, "the add loops name these fields"
    row_bytes = spec.row_nbytes
    batch = benchlib.random_rows(spec, EXTEND_ROWS, np.random.default_rng(0))
    rows = make_rows({k: v[:ROW_POOL] for k, v in batch.items()})
    extend_bytes = EXTEND_ROWS * row_bytes
    fills = -(-capacity // EXTEND_ROWS)

    t0 = time.perf_counter()
    ring = NumpyRing(spec, capacity)
    for _ in range(fills):  # touch every page of the baseline ring, as the buffer's fill does
        ring.copy_in(batch, EXTEND_ROWS)
    hot = {n: a.copy() for n, a in batch.items()}

    def hot_memcpy() -> None:
        for n, a in batch.items():
            np.copyto(hot[n], a)

    with ReplayBuffer.create(spec, capacity) as buf, buf.writer() as w:
        for _ in range(fills):
            w.extend(batch)
        assert len(buf) == capacity, (len(buf), capacity)
        segment_bytes = buf.nbytes
        print(
            f"  {wl.name}: {buf.nbytes / 1e9:.2f} GB segment and {row_bytes * capacity / 1e9:.2f}"
            f" GB NumPy ring filled in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
            flush=True,
        )
        ext = "shmbuf extend(1000)"
        groups = [
            Group(
                [
                    Case("shmbuf add", add_runner(w.add, rows)),
                    Case("numpy ring add", add_runner(ring.add, rows)),
                ],
                [("shmbuf add", "numpy ring add")],
            ),
            Group(
                [
                    Case(ext, loop_runner(lambda: w.extend(batch)), work=extend_bytes,
                         unit="GB/s"),
                    Case("numpy ring copyto",
                         loop_runner(lambda: ring.copy_in(batch, EXTEND_ROWS)),
                         work=extend_bytes, unit="GB/s"),
                    Case("hot memcpy", loop_runner(hot_memcpy), work=extend_bytes, unit="GB/s"),
                ],
                [(ext, "numpy ring copyto"), (ext, "hot memcpy")],
            ),
        ]
        stack = contextlib.ExitStack()
        groups.append(one_env_group(spec, rows, stack))
        cols = {n: buf.column(n) for n in spec}  # zero-copy views of the buffer's own memory
        # The views must be gone before the buffer unmaps, even while a traceback (Ctrl-C)
        # still holds the frames and closures that reference them.
        with benchlib.releasing([cols]) as views:
            groups += [sample_group(buf, spec, cols, B, row_bytes, views) for B in wl.batches]
            benchlib.run_rounds([g.cases for g in groups], rounds, seconds, wl.name)
            assert len(buf) == capacity
            result = summarize(groups)
        groups = []  # the one-env buffers' writers are in its cases: drop them before closing
        stack.close()
    result.update(capacity=capacity, row_bytes=row_bytes, segment_bytes=segment_bytes)
    return result


# ------------------------------------------------------------------------------------------------
# Keep-up: one actor's add() rate while the buffer is sampled (issue 13)
# ------------------------------------------------------------------------------------------------
KEEPUP = "keepup-"  # the prefix of the keep-up section's workload names
KEEPUP_CAPACITY = {"atari": (20_000, 5_000), "mujoco": (1_000_000, 100_000)}  # full, --quick
KEEPUP_BATCH = 256
TRAIN_STEP = 0.005  # the paced learner's train step (a sleep), as issue 13's learner
SETTLE = 0.2  # seconds a phase runs before it is measured (rings refill or drain)
NICE = 19  # the CPU priority of the third pool's workers: on few cores, who gets the CPU
MIN_PHASE_SECONDS = 0.5


def keepup_actor(ctx: ActorContext) -> None:
    """Adds single transitions to its lane as fast as it can, cycling through ``ROW_POOL`` rows
    made as the ``shmbuf add`` case makes them; looks for a stop once per pass."""
    rows = make_rows(benchlib.random_rows(ctx.buffer.spec, ROW_POOL, np.random.default_rng(0)))
    add = ctx.writer.add
    while not ctx.stopping:
        for o, no, a, r, d in rows:
            add(obs=o, next_obs=no, action=a, reward=r, done=d)


@dataclass
class Phase:
    """What the learner does while the actor's rate is measured: ``run(until)`` goes on until
    ``time.perf_counter()`` reaches ``until`` and returns the batches it took."""

    name: str
    run: Callable[[float], int]
    rates: list[float] = field(default_factory=list)  # the actor's inserts/s, one per round
    cpu_rates: list[float] = field(default_factory=list)  # its inserts per second on a CPU
    shares: list[float] = field(default_factory=list)  # its seconds on a CPU per second
    batches: list[float] = field(default_factory=list)  # the learner's batches/s, one per round


def cpu_seconds_of(pid: int) -> float:
    """Seconds process ``pid`` has run on a CPU (``/proc/PID/schedstat``, in nanoseconds)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def idle(until: float) -> int:
    """The learner takes nothing: the pools' rings are full and their workers wait."""
    time.sleep(max(0.0, until - time.perf_counter()))
    return 0


def taking(next_batch: Callable[[], Any], train_step: float = 0.0) -> Callable[[float], int]:
    """A learner that takes batches back to back, or with a ``train_step`` sleep after each."""

    def run(until: float) -> int:
        n = 0
        while time.perf_counter() < until:
            next_batch()
            n += 1
            if train_step:
                time.sleep(train_step)
        return n

    return run


def keepup_workload(wl: Workload, capacity: int, rounds: int, seconds: float) -> dict[str, Any]:
    """One actor process adds to a full one-lane buffer of ``capacity`` rows while the learner,
    phase by phase, takes nothing ("alone"), takes batches of a 4-worker pool back to back or
    with a 5 ms train step, of a 4-worker pool whose workers run at nice ``NICE``, of a 1-worker
    pool, or samples in its own process. Every round runs every phase (order flipped every
    other round); a ratio is the median over rounds of the phase's rate over the same round's
    rate alone.

    On a machine with fewer than six cores the four-worker phase shares CPUs: the figure that
    shows what sampling costs the writer through memory (cache lines, bandwidth) is its rate
    per second on a CPU (``/proc/PID/schedstat``): descheduled time does not count there."""
    spec = Spec(wl.spec)
    phase_seconds = max(MIN_PHASE_SECONDS, 4 * seconds)
    with ReplayBuffer.create(spec, capacity) as buf:
        benchlib.fill_repeating(buf, benchlib.random_rows(spec, EXTEND_ROWS,
                                                          np.random.default_rng(0)), capacity)
        rng = np.random.default_rng(4)
        with ActorGroup(keepup_actor, 1, buf, lanes=[0]) as actors, \
                SamplerPool(buf, KEEPUP_BATCH, workers=4, seed=1) as pool4, \
                SamplerPool(buf, KEEPUP_BATCH, workers=4, seed=2) as niced, \
                SamplerPool(buf, KEEPUP_BATCH, workers=1, seed=3) as pool1:
            for pid in niced.worker_pids:  # the scheduler then favours the actor
                os.setpriority(os.PRIO_PROCESS, pid, NICE)
            phases = [Phase("alone", idle), Phase("4 workers", taking(pool4.next)),
                      Phase("4 workers, 5 ms step", taking(pool4.next, TRAIN_STEP)),
                      Phase(f"4 workers at nice {NICE}", taking(niced.next)),
                      Phase("1 worker", taking(pool1.next)),
                      Phase("in-process sample", taking(lambda: buf.sample(KEEPUP_BATCH, rng)))]
            # Warm-up: the actor's first lap of its lane (a page fault per page) and every
            # sampler's first reads are behind us.
            start, deadline = buf.committed(0), time.perf_counter() + 300
            while buf.committed(0) < start + 1.2 * capacity and time.perf_counter() < deadline:
                for ph in phases:
                    ph.run(time.perf_counter() + 0.1)
                actors.poll()
            for r in range(rounds):
                print(f"  {wl.name} keep-up: round {r + 1}/{rounds}", file=sys.stderr,
                      flush=True)
                for ph in phases if r % 2 == 0 else phases[::-1]:
                    ph.run(time.perf_counter() + SETTLE)
                    actor = actors.pids[0]
                    assert actor is not None
                    cpu0, c0, t0 = cpu_seconds_of(actor), buf.committed(0), time.perf_counter()
                    n = ph.run(t0 + phase_seconds)
                    took, inserts = time.perf_counter() - t0, buf.committed(0) - c0
                    cpu = cpu_seconds_of(actor) - cpu0
                    ph.rates.append(inserts / took)
                    ph.cpu_rates.append(inserts / cpu)
                    ph.shares.append(cpu / took)
                    ph.batches.append(n / took)
                actors.poll()
    alone = phases[0]
    med = statistics.median
    cases = {ph.name: {"unit": "rows/s", "median": med(ph.rates), "per_cpu": med(ph.cpu_rates),
                       "cpu_share": med(ph.shares), "learner_batches_per_s": med(ph.batches),
                       "rounds": ph.rates, "rounds_per_cpu": ph.cpu_rates} for ph in phases}
    ratios = {}
    for ph in phases[1:]:
        for key, mine, base in ((f"{ph.name}/alone", ph.rates, alone.rates),
                                (f"{ph.name}/alone per CPU", ph.cpu_rates, alone.cpu_rates)):
            per_round = [a / b for a, b in zip(mine, base)]
            ratios[key] = {"case": ph.name, "baseline": alone.name, "median": med(per_round),
                           "min": min(per_round), "max": max(per_round), "rounds": per_round}
    return {"keepup": True, "capacity": capacity, "phase_seconds": phase_seconds,
            "cases": cases, "ratios": ratios}


def report_keepup(results: dict[str, Any]) -> str:
    """The keep-up table: per phase the actor's rate (per second, and per second it was on a
    CPU), its CPU share, the learner's batches/s, and both rates' ratios to the rate alone."""
    head = (f"{'workload':8} {'learner while the actor adds':28} {'actor rate':>13} "
            f"{'CPU':>4} {'per CPU-s':>13} {'learner':>10}   {'ratio':>5}  range      "
            f"{'per CPU':>7}  range")
    lines = [f"keep-up (issue 13): one actor process's add() rate while the buffer is sampled "
             f"(B={KEEPUP_BATCH}), over its rate alone. 'per CPU' counts only the time the "
             f"actor ran on a CPU: the cache/memory interference figure (cleanest with the "
             f"paced learner, '4 workers, 5 ms step'); the plain ratio also counts CPU sharing",
             head, "-" * len(head)]
    for wl_name, res in results.items():
        for name, c in res["cases"].items():
            shown = ""
            for key in (f"{name}/alone", f"{name}/alone per CPU"):
                r = res["ratios"].get(key)
                shown += f"   {r['median']:5.2f}  {r['min']:.2f}-{r['max']:.2f}" if r else ""
            lines.append(f"{wl_name.removeprefix(KEEPUP):8} {name:28} "
                         f"{fmt_rate(c['median'], 'rows/s'):>13} {c['cpu_share']:4.2f} "
                         f"{fmt_rate(c['per_cpu'], 'rows/s'):>13} "
                         f"{c['learner_batches_per_s']:6,.0f} b/s{shown}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Machine, space check, report
# ------------------------------------------------------------------------------------------------
def check_space(workloads: list[tuple[Workload, int]]) -> bool:
    """Whether /dev/shm and RAM can hold the largest workload (they run one at a time: the
    buffer's segment plus the NumPy ring baseline of the same size); says why not on stderr."""
    need_shm = max(cap * (Spec(wl.spec).row_nbytes + 16) for wl, cap in workloads) + (64 << 20)
    return benchlib.has_space("bench_storage", need_shm, 2 * need_shm + (512 << 20), "4g",
                              "segment + NumPy ring baseline")


def fmt_rate(value: float, unit: str) -> str:
    if unit == "rows/s":
        return f"{value / 1e3:,.0f}k rows/s"
    return f"{value:.2f} GB/s"


def report(results: dict[str, Any], targets: list[dict[str, Any]]) -> str:
    """The table (one line per case/baseline pair) and a PASS/MISS line per target."""
    lines = []
    head = (f"{'workload':8} {'operation':19} {'rate':>13} {'per op':>9} {'flt/op':>6}   "
            f"{'baseline':18} {'rate':>13} {'per op':>9} {'flt/op':>6}   {'ratio':>5}  range")
    lines += [head, "-" * (len(head) + 6)]
    for wl_name, res in results.items():
        cases = res["cases"]
        for r in res["ratios"].values():
            a, b = cases[r["case"]], cases[r["baseline"]]
            lines.append(
                f"{wl_name:8} {r['case']:19} {fmt_rate(a['median'], a['unit']):>13} "
                f"{fmt_us(a['op_us']):>9} {a['faults_per_op']:6.0f}   {r['baseline']:18} "
                f"{fmt_rate(b['median'], b['unit']):>13} {fmt_us(b['op_us']):>9} "
                f"{b['faults_per_op']:6.0f}   {r['median']:5.2f}  {r['min']:.2f}-{r['max']:.2f}"
            )
    lines.append("")
    for t in targets:
        mark = "PASS" if t["pass"] else "MISS"
        shown = f"{t['value']:,.0f} rows/s" if t["kind"] == "rate" else f"{t['value']:.2f}"
        note = "" if t["gated"] else f"  ({t['note']})"
        lines.append(f"{mark}  {t['label']}: {shown}{note}")
    return "\n".join(lines)


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for t in TARGETS:
        res = results.get(t.workload)
        if res is None:
            continue
        if t.metric in res["ratios"]:
            kind, value = "ratio", res["ratios"][t.metric]["median"]
        else:
            kind, value = "rate", res["cases"][t.metric]["median"]
        out.append({"label": t.label, "workload": t.workload, "metric": t.metric, "kind": kind,
                    "value": value, "threshold": t.threshold, "pass": value >= t.threshold,
                    "gated": t.gated, "note": t.note})
    return out


def run_isolated(name: str, capacity: int, rounds: int, seconds: float) -> dict[str, Any]:
    """Run one workload (``name``: a workload, or ``keepup-`` and one) in a fresh interpreter and
    return its results.

    Isolation matters: what an earlier workload freed changes glibc's dynamic mmap threshold,
    which decides whether ``sample()``'s new multi-MB arrays come from a warm heap or from fresh,
    page-faulting mmaps (a 3x difference for atari batch 256). A fresh process is what a learner
    is. Ctrl-C: see ``benchlib.run_child``.
    """
    return benchlib.run_child(__file__, ["--rounds", str(rounds), "--seconds", str(seconds),
                                         "--_workload", name, "--_capacity", str(capacity)],
                              name)


def run_in_process(name: str, capacity: int, rounds: int, seconds: float) -> dict[str, Any]:
    """Run one workload (``name`` as ``run_isolated``'s) in this process."""
    wl = next(w for w in WORKLOADS if w.name == name.removeprefix(KEEPUP))
    bench = keepup_workload if name.startswith(KEEPUP) else bench_workload
    return bench(wl, capacity, rounds, seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_options = benchlib.add_run_options(
        p, "small capacities and short rounds: a smoke test (well under 60 s)", 0.25, 0.03)
    names = [w.name for w in WORKLOADS] + [KEEPUP + w.name for w in WORKLOADS]
    p.add_argument("--only", choices=names, action="append",
                   help="run only this workload (repeatable); keepup-NAME: the keep-up section "
                        "for workload NAME")
    p.add_argument("--store", choices=["compiled", "numpy"], default="compiled",
                   help="numpy: writers use the NumPy store and add (SHMBUF_STORE=numpy), as "
                        "where shmbuf/_add_c.c was not built (default: compiled, where built)")
    p.add_argument("--in-process", action="store_true",
                   help="run the workloads in this process, not one fresh process each "
                        "(for profilers; sample() results then depend on the heap history)")
    benchlib.add_child_options(p)
    args = p.parse_args(argv)
    rounds, seconds = run_options(args)
    if args.store == "numpy":
        os.environ["SHMBUF_STORE"] = "numpy"  # for the workloads' processes, and this one's:
        shmbuf_store.CompiledStore = shmbuf_store.CompiledAdd = None  # (imported already)

    if args._workload:  # the child side of run_isolated
        return benchlib.child_result(
            args._out, lambda: run_in_process(args._workload, args._capacity, rounds, seconds))

    plan = [(wl.name, wl, wl.quick_capacity if args.quick else wl.capacity) for wl in WORKLOADS]
    plan += [(KEEPUP + wl.name, wl, KEEPUP_CAPACITY[wl.name][1 if args.quick else 0])
             for wl in WORKLOADS]
    plan = [entry for entry in plan if not args.only or entry[0] in args.only]
    if not check_space([(wl, cap) for _, wl, cap in plan]):
        return 2

    info = benchlib.machine()
    clock = benchlib.RunClock()
    results: dict[str, Any] = {}
    run = run_in_process if args.in_process else run_isolated
    try:
        for name, _, cap in plan:
            results[name] = run(name, cap, rounds, seconds)
    except KeyboardInterrupt:
        print("bench_storage: interrupted; buffers closed", file=sys.stderr)
        return 130
    runtime, others = clock.stop()
    targets = evaluate(results)

    caps = ", ".join(f"{name} capacity {cap:,}" for name, _, cap in plan)
    print(f"shmbuf storage benchmark{' (--quick)' if args.quick else ''}"
          f"{' (--store numpy)' if args.store == 'numpy' else ''}: {caps}; "
          f"{EXTEND_ROWS}-row extend; {rounds} rounds x {seconds}s per case; medians")
    print(benchlib.machine_line(info))
    storage = {k: v for k, v in results.items() if not k.startswith(KEEPUP)}
    keepup = {k: v for k, v in results.items() if k.startswith(KEEPUP)}
    if storage:
        print(report(storage, [t for t in targets if not t["workload"].startswith(KEEPUP)]))
    if keepup:
        if storage:
            print()
        print(report_keepup(keepup))
        print("\n".join(report({}, [t for t in targets if t["workload"].startswith(KEEPUP)])
                        .splitlines()[3:]))
    print(benchlib.runtime_line(runtime, others))
    return benchlib.finish(args, {
        "argv": sys.argv, "quick": args.quick, "store": args.store, "rounds": rounds,
        "seconds": seconds,
        "machine": info, "runtime_s": runtime, "other_cpu_fraction": others,
        "workloads": results, "targets": targets})


if __name__ == "__main__":
    sys.exit(main())
