"""What the benchmark scripts beside this file share: timed cases, interleaved rounds and rate
ratios, random rows for a Spec, the machine and CPU-share lines, space checks, common options,
and cleanup on Ctrl-C (views of shared memory, child processes)."""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmbuf import ReplayBuffer, Spec

SHM_DIR = "/dev/shm"


# ------------------------------------------------------------------------------------------------
# Timed cases, rounds, ratios
# ------------------------------------------------------------------------------------------------
@dataclass
class TimedCase:
    """One timed operation: ``run(n)`` performs it n times and returns the seconds taken."""

    name: str
    run: Callable[[int], float]
    n: int = 1
    secs: list[float] = field(default_factory=list)  # seconds per operation, one per round
    faults: list[float] = field(default_factory=list)  # minor page faults per operation

    def calibrate(self, seconds: float) -> None:
        """Warm up, then pick n so that one measurement takes about ``seconds``."""
        n, took = 1, self.run(1)
        while took < min(0.02, seconds / 2):
            n *= 4
            took = self.run(n)
        self.n = max(1, round(n * seconds / took))

    def measure(self) -> None:
        """One round: time n operations, and count the minor page faults they took."""
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        took = self.run(self.n)
        f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.secs.append(took / self.n)
        self.faults.append((f1 - f0) / self.n)

    @property
    def rates(self) -> list[float]:
        """Operations per second, one per round."""
        return [1 / s for s in self.secs]


def loop_runner(op: Callable[[], Any]) -> Callable[[int], float]:
    """A ``TimedCase.run`` that calls ``op()`` n times."""

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            op()
        return time.perf_counter() - t0

    return run


def run_rounds(groups: Iterable[Sequence[TimedCase]], rounds: int, seconds: float,
               label: str | None = None) -> None:
    """Calibrate every case, then measure each group's cases back to back, ``rounds`` times.

    The order inside a group is reversed every other round so that neither a case nor its
    baseline always runs first (warm caches, clock boost, whatever shares the other core).
    """
    groups = list(groups)
    for cases in groups:
        for c in cases:
            c.calibrate(seconds)
    prefix = f"  {label}: " if label else "  "
    for r in range(rounds):
        print(f"{prefix}round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        for cases in groups:
            for c in cases if r % 2 == 0 else cases[::-1]:
                c.measure()


def ratio(case: TimedCase, baseline: TimedCase) -> dict[str, Any]:
    """The rate of ``case`` over that of ``baseline``, per round: median, range and rounds."""
    per_round = [b / a for a, b in zip(case.secs, baseline.secs)]
    return {"median": statistics.median(per_round), "min": min(per_round),
            "max": max(per_round), "rounds": per_round}


def median_seconds(op: Callable[[], Any], n: int,
                   before: Callable[[], Any] | None = None) -> float:
    """The median time of ``n`` calls of ``op()``; ``before()``, untimed, runs ahead of each."""
    times = []
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calls_for(op: Callable[[], Any], seconds: float) -> tuple[int, float]:
    """Call ``op()`` again and again for about ``seconds``: (calls, seconds they took)."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        op()
        n += 1
    return n, time.perf_counter() - t0


def rate_for(op: Callable[[], Any], seconds: float) -> float:
    """Calls of ``op()`` per second, over about ``seconds``."""
    n, took = calls_for(op, seconds)
    return n / took


def busy(seconds: float) -> None:
    """Spin for ``seconds``: a stand-in for a train step."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def fmt_us(us: float, decimals: int = 1) -> str:
    """Microseconds, as milliseconds from 1000 us on."""
    return f"{us:.{decimals}f} us" if us < 1000 else f"{us / 1000:.2f} ms"


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------
def random_rows(spec: Spec, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """n random transitions, one contiguous array per field: 1% of flags set, standard-normal
    floats, bytes 0-255 and other integers 0-17 (an Atari action)."""
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


def fill_repeating(buf: ReplayBuffer, rows: dict[str, np.ndarray], count: int,
                   lane: int | None = None) -> None:
    """``extend`` the same ``rows`` until the writer (of ``lane``) has committed ``count``."""
    with buf.writer(lane) as w:
        while w.committed < count:
            w.extend(rows)


# ------------------------------------------------------------------------------------------------
# Machine, CPU share of other processes, space
# ------------------------------------------------------------------------------------------------
def read(path: str) -> str:
    """A small text file's content, stripped, or "?" if it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def machine() -> dict[str, Any]:
    """CPU model, cores, NumPy, Python and kernel versions, transparent-huge-page settings."""
    model = next((line.split(":", 1)[1].strip() for line in read("/proc/cpuinfo").splitlines()
                  if line.startswith("model name")), "?")
    return {"cpu": model, "cores": os.cpu_count(), "numpy": np.__version__,
            "python": platform.python_version(), "kernel": platform.release(),
            "thp_anon": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_shmem": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled")}


def machine_line(info: dict[str, Any]) -> str:
    """The report's "machine:" line for ``machine()``'s result."""
    return (f"machine: {info['cores']} cores, {info['cpu']}, numpy {info['numpy']}, "
            f"Python {info['python']}, Linux {info['kernel']}; THP anon "
            f"{_selected(info['thp_anon'])}, shmem {_selected(info['thp_shmem'])}")


def _selected(sysfs_choice: str) -> str:
    """``always [madvise] never`` -> ``madvise``."""
    start, end = sysfs_choice.find("["), sysfs_choice.find("]")
    return sysfs_choice[start + 1 : end] if 0 <= start < end else sysfs_choice


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds all processes were busy since boot, CPU seconds of this process and its
    waited-for children): their difference over a run is what other processes used."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in read("/proc/stat").splitlines()[0].split()[1:9])
    own = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), own


class RunClock:
    """Started on creation; ``stop()`` gives the run's wall time and the share of the machine's
    CPU time (all cores) that other processes used meanwhile."""

    def __init__(self) -> None:
        self.busy0, self.own0 = cpu_seconds()
        self.t0 = time.perf_counter()

    def stop(self, own_elsewhere: float = 0.0) -> tuple[float, float]:
        """(seconds, share of other processes); ``own_elsewhere``: CPU seconds the run used in
        processes that are not its waited-for children (forkserver workers, say)."""
        runtime = time.perf_counter() - self.t0
        busy1, own1 = cpu_seconds()
        others = max(0.0, (busy1 - self.busy0) - (own1 - self.own0) - own_elsewhere)
        return runtime, others / (runtime * (os.cpu_count() or 1))


def runtime_line(runtime: float, others: float) -> str:
    """The report's last line: run time and the CPU share other processes took."""
    return (f"runtime {runtime:.1f}s; other processes used {others:.0%} of the machine's CPU time"
            f"{' (a noisy run: compare ratios, not rates)' if others > 0.1 else ''}")


def has_space(prog: str, need_shm: int, need_ram: int, shm_size: str, ram_for: str = "") -> bool:
    """Whether /dev/shm has ``need_shm`` bytes free and RAM ``need_ram`` available; if not, says
    so and what to do on stderr, as ``prog``. ``shm_size``: the ``docker run --shm-size`` to
    suggest; ``ram_for``: what the RAM holds, for the message."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    avail = next((int(line.split()[1]) * 1024 for line in read("/proc/meminfo").splitlines()
                  if line.startswith("MemAvailable:")), 1 << 62)  # unknown: don't refuse
    if free < need_shm:
        problem = (f"{SHM_DIR} has {free / 1e9:.2f} GB free; this run needs {need_shm / 1e9:.2f} "
                   f"GB. Fix: run with --quick, free {SHM_DIR} (`shmbuf gc`), or give the "
                   f"container more (docker run --shm-size={shm_size})")
    elif avail < need_ram:
        problem = (f"{avail / 1e9:.2f} GB of RAM available; this run needs about "
                   f"{need_ram / 1e9:.2f} GB{f' ({ram_for})' if ram_for else ''}. "
                   f"Fix: run with --quick")
    else:
        return True
    print(f"{prog}: {problem}", file=sys.stderr)
    return False


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------
def add_run_options(p: argparse.ArgumentParser, quick_help: str, seconds: float,
                    quick_seconds: float, rounds: int = 7, quick_rounds: int = 3,
                    ) -> Callable[[argparse.Namespace], tuple[int, float]]:
    """Add the options every round-based benchmark takes: --quick, --rounds, --seconds, --json,
    --check. Returns what turns the parsed arguments into (rounds, seconds per measurement):
    ``rounds`` (``quick_rounds`` with --quick) and ``seconds`` (``quick_seconds``) unless given;
    a usage error unless rounds >= 1 and seconds > 0."""
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--rounds", type=int, default=None,
                   help=f"measurement rounds (default {rounds}, or {quick_rounds} with --quick)")
    p.add_argument("--seconds", type=float, default=None,
                   help=f"seconds per measurement per round (default {seconds}, or "
                        f"{quick_seconds} with --quick)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--check", action="store_true", help="exit 1 if a gated target is missed")

    def resolve(args: argparse.Namespace) -> tuple[int, float]:
        n = args.rounds if args.rounds is not None else (
            quick_rounds if args.quick else rounds)
        secs = args.seconds if args.seconds is not None else (
            quick_seconds if args.quick else seconds)
        if n < 1 or secs <= 0:
            p.error("--rounds must be >= 1 and --seconds > 0")
        return n, secs

    return resolve


def finish(args: argparse.Namespace, doc: dict[str, Any]) -> int:
    """Write ``doc`` as JSON to ``--json`` if given; the exit status: 1 if ``--check`` is given
    and a gated target of ``doc["targets"]`` (one without "gated" counts) was missed, else 0."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    missed = [t for t in doc["targets"] if t.get("gated", True) and not t["pass"]]
    return 1 if args.check and missed else 0


# ------------------------------------------------------------------------------------------------
# Ctrl-C: views of shared memory, child processes
# ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def releasing(views: list[Any]) -> Iterator[list[Any]]:
    """Clear every container in ``views`` (lists or dicts holding column views of a buffer) on
    the way out, so that none outlives the buffer's unmapping. On an exception (Ctrl-C) the
    traceback's finished frames, which still reference views, are cleared first."""
    try:
        yield views
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        for v in views:
            v.clear()


CHILD_TIMEOUT = 30 * 60  # a workload child that runs longer than this is hung


def run_child(script: str, argv: list[str], what: str) -> dict[str, Any]:
    """Run ``script`` in a fresh interpreter with ``argv`` and ``--_out PATH``, and return the
    JSON it writes to PATH (see ``child_result``).

    On Ctrl-C the child, which got the SIGINT too, has 5 s to close its buffers; if it lingers
    it gets SIGTERM (on which an owner unlinks its segments as well), then SIGKILL.
    """
    prefix = os.path.splitext(os.path.basename(script))[0] + "-"
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        path = os.path.join(tmp, "result.json")
        proc = subprocess.Popen([sys.executable, os.path.abspath(script), *argv, "--_out", path])
        try:
            rc = proc.wait(CHILD_TIMEOUT)
        except BaseException:  # Ctrl-C, or subprocess.TimeoutExpired: stop the child
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
            raise RuntimeError(f"the {what} benchmark process exited with status {rc}")
        with open(path) as f:
            return json.load(f)


def add_child_options(p: argparse.ArgumentParser) -> None:
    """The hidden options of ``run_child``'s child: run one workload (``--_workload``, at
    ``--_capacity``) in this process and write its results to ``--_out``."""
    p.add_argument("--_workload", help=argparse.SUPPRESS)
    p.add_argument("--_capacity", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)


def child_result(out: str, compute: Callable[[], dict[str, Any]]) -> int:
    """The child side of ``run_child``: write ``compute()``'s result to ``out`` as JSON; the exit
    status (130 on Ctrl-C, after ``compute``'s own cleanup)."""
    try:
        result = compute()
    except KeyboardInterrupt:
        return 130
    with open(out, "w") as f:
        json.dump(result, f)
    return 0
