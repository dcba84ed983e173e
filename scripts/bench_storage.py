#!/usr/bin/env python
"""Storage benchmark: shmbuf ``add``/``extend``/``sample`` against plain-NumPy baselines.

Every measurement runs next to its baselines in the same round, on the same data, with the order
flipped every other round; a rate is the median over rounds and a ratio the median of the
per-round ratios (a 2-core machine is noisy). Each workload runs in a fresh process, as a learner
would (see ``run_isolated``). Benchmarks report, they do not gate: the exit code is 0 unless
``--check`` is given and a gated target is missed. Results and their reading: BENCHMARKS.md.

    python scripts/bench_storage.py [--quick] [--rounds N] [--json PATH] [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmbuf import ReplayBuffer, Spec

SHM_DIR = "/dev/shm"
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
)


# ------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One timed operation: ``run(n)`` performs it n times and returns the seconds taken.

    ``work`` is what one operation moves (rows, or bytes for GB/s), so rate = n * work / seconds.
    """

    name: str
    run: Callable[[int], float]
    work: float
    unit: str  # "rows/s" or "GB/s"
    n: int = 1
    rates: list[float] = field(default_factory=list)
    op_us: list[float] = field(default_factory=list)
    faults: list[float] = field(default_factory=list)  # minor page faults per operation

    def calibrate(self, seconds: float) -> None:
        """Warm up, then pick n so that one measurement takes about ``seconds``."""
        n, took = 1, self.run(1)
        while took < min(0.02, seconds / 2):
            n *= 4
            took = self.run(n)
        self.n = max(1, round(n * seconds / took))

    def measure(self) -> None:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        took = self.run(self.n)
        f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        scale = 1e-9 if self.unit == "GB/s" else 1.0
        self.rates.append(self.n * self.work * scale / took)
        self.op_us.append(took / self.n * 1e6)
        self.faults.append((f1 - f0) / self.n)


@dataclass
class Group:
    """Cases measured back to back in every round; ``pairs`` (case, baseline) give the ratios."""

    cases: list[Case]
    pairs: list[tuple[str, str]]


def run_rounds(groups: list[Group], rounds: int, seconds: float, label: str) -> None:
    """Calibrate every case, then measure each group's cases back to back, ``rounds`` times.

    The order inside a group is reversed every other round so that neither a case nor its
    baseline always runs first (warm caches, clock boost, whatever shares the other core).
    """
    for g in groups:
        for c in g.cases:
            c.calibrate(seconds)
    for r in range(rounds):
        print(f"  {label}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        for g in groups:
            for c in g.cases if r % 2 == 0 else g.cases[::-1]:
                c.measure()


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
                "op_us": statistics.median(c.op_us),
                "faults_per_op": statistics.median(c.faults),
                "ops_per_round": c.n,
                "rounds": c.rates,
            }
        for a, b in g.pairs:
            per_round = [x / y for x, y in zip(by_name[a].rates, by_name[b].rates)]
            ratios[f"{a}/{b}"] = {
                "case": a,
                "baseline": b,
                "median": statistics.median(per_round),
                "min": min(per_round),
                "max": max(per_round),
                "rounds": per_round,
            }
    return {"cases": cases, "ratios": ratios}


# ------------------------------------------------------------------------------------------------
# Data and baselines
# ------------------------------------------------------------------------------------------------
def make_batch(spec: Spec, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """n random transitions, one contiguous array per field."""
    out = {}
    for name, f in spec.items():
        shape = (n, *f.shape)
        if f.dtype == np.bool_:
            out[name] = rng.random(shape) < 0.01
        elif f.dtype.kind == "f":
            out[name] = rng.standard_normal(shape, dtype=np.float32).astype(f.dtype)
        else:
            hi = 256 if f.dtype == np.uint8 else 18
            out[name] = rng.integers(0, hi, size=shape, dtype=f.dtype)
    return out


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


def loop_runner(op: Callable[[], Any]) -> Callable[[int], float]:
    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            op()
        return time.perf_counter() - t0

    return run


def sample_group(buf: ReplayBuffer, spec: Spec, cols: dict[str, np.ndarray], B: int,
                 row_bytes: int, views: list[list[Any]]) -> Group:
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
            Case(s, loop_runner(lambda: buf.sample(B, rng_s)), nbytes, "GB/s"),
            Case(si, loop_runner(lambda: buf.sample_into(out, rng_i)), nbytes, "GB/s"),
            Case(r, loop_runner(raw), nbytes, "GB/s"),
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
    batch = make_batch(spec, EXTEND_ROWS, np.random.default_rng(0))
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
                    Case("shmbuf add", add_runner(w.add, rows), 1, "rows/s"),
                    Case("numpy ring add", add_runner(ring.add, rows), 1, "rows/s"),
                ],
                [("shmbuf add", "numpy ring add")],
            ),
            Group(
                [
                    Case(ext, loop_runner(lambda: w.extend(batch)), extend_bytes, "GB/s"),
                    Case("numpy ring copyto",
                         loop_runner(lambda: ring.copy_in(batch, EXTEND_ROWS)),
                         extend_bytes, "GB/s"),
                    Case("hot memcpy", loop_runner(hot_memcpy), extend_bytes, "GB/s"),
                ],
                [(ext, "numpy ring copyto"), (ext, "hot memcpy")],
            ),
        ]
        cols = {n: buf.column(n) for n in spec}  # zero-copy views of the buffer's own memory
        views: list[list[Any]] = []
        try:
            groups += [sample_group(buf, spec, cols, B, row_bytes, views) for B in wl.batches]
            run_rounds(groups, rounds, seconds, wl.name)
            assert len(buf) == capacity
            result = summarize(groups)
        except BaseException as e:  # Ctrl-C: the traceback's frames hold views; free them
            traceback.clear_frames(e.__traceback__)
            raise
        finally:
            # The views must be gone before the buffer unmaps, even while a traceback (Ctrl-C)
            # still holds the frames and closures that reference them.
            cols.clear()
            for v in views:
                v.clear()
    result.update(capacity=capacity, row_bytes=row_bytes, segment_bytes=segment_bytes)
    return result


# ------------------------------------------------------------------------------------------------
# Machine, space check, report
# ------------------------------------------------------------------------------------------------
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def machine() -> dict[str, Any]:
    model = "?"
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "thp_anon": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
    }


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds all processes were busy since boot, CPU seconds of this process and its
    waited-for children): their difference over a run is what other processes used."""
    ticks = os.sysconf("SC_CLK_TCK")
    parts = _read("/proc/stat").splitlines()[0].split()[1:9]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in parts)
    busy = (user + nice + system + irq + softirq + steal) / ticks
    own = sum(
        r.ru_utime + r.ru_stime
        for r in (resource.getrusage(resource.RUSAGE_SELF),
                  resource.getrusage(resource.RUSAGE_CHILDREN))
    )
    return busy, own


def mem_available() -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def check_space(workloads: list[tuple[Workload, int]]) -> str | None:
    """An error message if /dev/shm or RAM cannot hold the largest workload (they run one at a
    time: the buffer's segment plus the NumPy ring baseline of the same size)."""
    need_shm = max(cap * (Spec(wl.spec).row_nbytes + 16) for wl, cap in workloads) + (64 << 20)
    st = os.statvfs(SHM_DIR)
    free_shm = st.f_bavail * st.f_frsize
    if free_shm < need_shm:
        return (
            f"{SHM_DIR} has {free_shm / 1e9:.2f} GB free; this run needs {need_shm / 1e9:.2f} GB. "
            f"Fix: run with --quick, free {SHM_DIR} (`shmbuf gc`), or give the container more "
            f"(docker run --shm-size=4g)"
        )
    need_ram = 2 * need_shm + (512 << 20)
    if mem_available() < need_ram:
        return (
            f"{mem_available() / 1e9:.2f} GB of RAM available; this run needs about "
            f"{need_ram / 1e9:.2f} GB (segment + NumPy ring baseline). Fix: run with --quick"
        )
    return None


def fmt_rate(value: float, unit: str) -> str:
    if unit == "rows/s":
        return f"{value / 1e3:,.0f}k rows/s"
    return f"{value:.2f} GB/s"


def fmt_us(us: float) -> str:
    return f"{us:.1f} us" if us < 1000 else f"{us / 1000:.2f} ms"


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
        note = "" if t["gated"] else "  (upper bound; not gated by --check)"
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
                    "gated": t.gated})
    return out


def run_isolated(wl: Workload, capacity: int, rounds: int, seconds: float) -> dict[str, Any]:
    """Run one workload in a fresh interpreter and return its results.

    Isolation matters: what an earlier workload freed changes glibc's dynamic mmap threshold,
    which decides whether ``sample()``'s new multi-MB arrays come from a warm heap or from fresh,
    page-faulting mmaps (a 3x difference for atari batch 256). A fresh process is what a learner
    is. On Ctrl-C the child (which got the SIGINT too) closes its buffer; if it lingers it gets
    SIGTERM, on which the owner unlinks its segment as well.
    """
    with tempfile.TemporaryDirectory(prefix="bench_storage-") as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--rounds", str(rounds), "--seconds",
               str(seconds), "--_workload", wl.name, "--_capacity", str(capacity), "--_out", path]
        proc = subprocess.Popen(cmd)
        try:
            rc = proc.wait()
        except BaseException:
            for stop in (None, proc.terminate, proc.kill):
                if stop is not None:
                    stop()
                try:
                    proc.wait(5)
                    break
                except subprocess.TimeoutExpired:
                    continue
            raise
        if rc != 0:
            raise RuntimeError(f"the {wl.name} benchmark process exited with status {rc}")
        with open(path) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small capacities and short rounds: a smoke test (well under 60 s)")
    p.add_argument("--rounds", type=int, default=None,
                   help="measurement rounds (default 7, or 3 with --quick)")
    p.add_argument("--seconds", type=float, default=None,
                   help="seconds per measurement per round (default 0.25, or 0.03 with --quick)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--check", action="store_true", help="exit 1 if a gated target is missed")
    p.add_argument("--only", choices=[w.name for w in WORKLOADS], action="append",
                   help="run only this workload (repeatable)")
    p.add_argument("--in-process", action="store_true",
                   help="run the workloads in this process, not one fresh process each "
                        "(for profilers; sample() results then depend on the heap history)")
    # Internal: run one workload in this process and write its results to --_out.
    p.add_argument("--_workload", help=argparse.SUPPRESS)
    p.add_argument("--_capacity", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 7)
    seconds = args.seconds if args.seconds is not None else (0.03 if args.quick else 0.25)
    if rounds < 1 or seconds <= 0:
        p.error("--rounds must be >= 1 and --seconds > 0")

    if args._workload:  # the child side of run_isolated
        wl = next(w for w in WORKLOADS if w.name == args._workload)
        try:
            result = bench_workload(wl, args._capacity, rounds, seconds)
        except KeyboardInterrupt:
            return 130
        with open(args._out, "w") as f:
            json.dump(result, f)
        return 0

    plan = [(wl, wl.quick_capacity if args.quick else wl.capacity) for wl in WORKLOADS
            if not args.only or wl.name in args.only]
    problem = check_space(plan)
    if problem:
        print(f"bench_storage: {problem}", file=sys.stderr)
        return 2

    info = machine()
    busy0, own0 = cpu_seconds()
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    run = bench_workload if args.in_process else run_isolated
    try:
        for wl, cap in plan:
            results[wl.name] = run(wl, cap, rounds, seconds)
    except KeyboardInterrupt:
        print("bench_storage: interrupted; buffers closed", file=sys.stderr)
        return 130
    runtime = time.perf_counter() - t0
    busy1, own1 = cpu_seconds()
    others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (runtime * (os.cpu_count() or 1))
    targets = evaluate(results)

    caps = ", ".join(f"{wl.name} capacity {cap:,}" for wl, cap in plan)
    print(f"shmbuf storage benchmark{' (--quick)' if args.quick else ''}: {caps}; "
          f"{EXTEND_ROWS}-row extend; {rounds} rounds x {seconds}s per case; medians")
    print(f"machine: {info['cores']} cores, {info['cpu']}, numpy {info['numpy']}, "
          f"Python {info['python']}, Linux {info['kernel']}; THP anon {_selected(info['thp_anon'])}"
          f", shmem {_selected(info['thp_shmem'])}")
    print(report(results, targets))
    print(f"runtime {runtime:.1f}s; other processes used {others:.0%} of the machine's CPU time"
          f"{' (a noisy run: compare ratios, not rates)' if others > 0.1 else ''}")

    if args.json:
        doc = {"argv": sys.argv, "quick": args.quick, "rounds": rounds, "seconds": seconds,
               "machine": info, "runtime_s": runtime,
               "other_cpu_fraction": others, "workloads": results, "targets": targets}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    missed = [t for t in targets if t["gated"] and not t["pass"]]
    return 1 if args.check and missed else 0


def _selected(sysfs_choice: str) -> str:
    """``always [madvise] never`` -> ``madvise``."""
    start, end = sysfs_choice.find("["), sysfs_choice.find("]")
    return sysfs_choice[start + 1 : end] if 0 <= start < end else sysfs_choice


if __name__ == "__main__":
    sys.exit(main())
