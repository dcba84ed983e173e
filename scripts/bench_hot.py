#!/usr/bin/env python
"""The hot paths of ``make bench``, this checkout against another, side by side in one run.

Each row is measured in a fresh process importing shmbuf and workers from one checkout; the
rounds alternate the two checkouts (the order flipping each round), and the table shows each
side's median with its spread over the rounds and their ratio. Only public API that both an
older release and this one take is used (``SamplerPool``'s earlier keywords are translated, with
a warning, by this release), so any commit can be the base:

    mkdir -p /tmp/base && git archive df9ff63 | tar -x -C /tmp/base
    (cd /tmp/base && python setup.py build_ext --inplace -q)
    python scripts/bench_hot.py --base /tmp/base --rounds 5

``--base-env NAME=VALUE`` (repeatable) runs the base side with those variables set, on this
checkout unless ``--base`` names another: what a compiled extension buys, for example
``--base-env SHMBUF_TAKE=python`` (``next()``), ``SHMBUF_STORE=numpy`` (``add``/``extend``),
``SHMBUF_STREAM=off`` (large rows through the caches) or ``SHMBUF_SUMTREE=numpy``.

Rows: a learner's ``next()`` after a 5 ms train step (Atari rows, B=256, 1 and 4 workers: p50),
``next()`` back to back (1 and 2 workers: batches/s), ``Writer.add``, ``extend(32)`` (an
actor's flush) and ``extend(1000)`` of MuJoCo-sized (17 float64 obs, a 6-d action) and
Atari-sized (4x84x84 uint8) rows, and an in-process prioritized ``next()`` + ``update_priorities`` (B=256).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

ROWS = ("next after a 5 ms step, 1 worker", "next after a 5 ms step, 4 workers",
        "next back to back, 1 worker", "next back to back, 2 workers",
        "add mujoco", "add atari", "extend(32) mujoco", "extend(32) atari",
        "extend(1000) mujoco", "extend(1000) atari",
        "prioritized next + update, in-process")
UNITS = {"next after": "us p50", "next back": "batches/s", "add": "us", "extend": "us",
         "prioritized": "us"}
HIGHER_IS_BETTER = ("next back",)


def _spec(kind: str) -> Any:
    import shmbuf

    if kind == "atari":
        return shmbuf.Spec(obs=((4, 84, 84), "uint8"), action=((), "int64"),
                           reward=((), "float32"), done=((), "bool"))
    return shmbuf.Spec(obs=((17,), "float64"), action=((6,), "float32"),
                       reward=((), "float32"), done=((), "bool"))


def _rows(kind: str, n: int) -> dict[str, np.ndarray]:
    spec = _spec(kind)
    rng = np.random.default_rng(0)
    return {name: (rng.integers(0, 255, (n, *f.shape)).astype(f.dtype) if f.dtype.kind == "u"
                   else np.zeros((n, *f.shape), f.dtype)) for name, f in spec.items()}


def _filled(kind: str, capacity: int) -> Any:
    import shmbuf

    buf = shmbuf.ReplayBuffer.create(_spec(kind), capacity=capacity)
    rows = _rows(kind, 1000)
    with buf.writer() as w:
        for _ in range(-(-capacity // 1000)):
            w.extend(rows)
    return buf


def _best(fn: Callable[[], Any], n: int, repeats: int = 7) -> float:
    """Seconds per call: the best of ``repeats`` timings of ``n`` calls."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def measure(row: str) -> float:
    """One figure of ``row`` (see ``UNITS``), in this process's checkout."""
    from workers import SamplerPool

    warnings.simplefilter("ignore", DeprecationWarning)  # (a base or this release's shims)
    if row.startswith("next after"):
        n_workers = 1 if "1 worker" in row else 4
        with _filled("atari", 20_000) as buf, \
                SamplerPool(buf, batch_size=256, n_workers=n_workers, seed=0) as pool:
            for _ in range(2 * n_workers + 2):
                pool.next()
            times = []
            for _ in range(300):
                time.sleep(0.005)
                t0 = time.perf_counter()
                pool.next()
                times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6
    if row.startswith("next back"):
        n_workers = 1 if "1 worker" in row else 2
        with _filled("atari", 20_000) as buf, \
                SamplerPool(buf, batch_size=256, n_workers=n_workers, seed=0) as pool:
            for _ in range(20):
                pool.next()
            t0, n = time.perf_counter(), 0
            while time.perf_counter() - t0 < 3.0:
                pool.next()
                n += 1
        return n / (time.perf_counter() - t0)
    if row.startswith(("add", "extend")):
        import shmbuf

        kind = row.split()[-1]
        capacity = 100_000 if kind == "mujoco" else 4_000
        with shmbuf.ReplayBuffer.create(_spec(kind), capacity=capacity) as buf, \
                buf.writer() as w:
            many = _rows(kind, 1000)
            w.extend(many)
            for _ in range(capacity // 1000):  # a whole lap first: every page touched
                w.extend(many)
            if row.startswith("add"):
                one = {k: v[0] for k, v in many.items()}
                return _best(lambda: w.add(**one), 2000 if kind == "mujoco" else 200) * 1e6
            n = int(row[len("extend("):row.index(")")])
            part = {k: v[:n] for k, v in many.items()}
            calls = max(3, (20_000 if kind == "mujoco" else 3_000) // n)
            return _best(lambda: w.extend(part), calls) * 1e6
    with _filled("mujoco", 100_000) as buf, \
            SamplerPool(buf, batch_size=256, n_workers=0, sampler="prioritized", seed=0) as pool:
        rng = np.random.default_rng(0)

        def step() -> None:
            batch = pool.next()
            pool.update_priorities(batch.indices, rng.random(256))
        return _best(step, 200) * 1e6


def _one(root: str, row: str, env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", row],
                         env={**os.environ, **env, "PYTHONPATH": root}, cwd=root,
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="the checkout to compare against (built in place)")
    p.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE",
                   help="set this in the base side's processes (base: this checkout by default)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", action="append", choices=ROWS, help="these rows only")
    p.add_argument("--measure", choices=ROWS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return 0
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if any("=" not in item for item in args.base_env):
        p.error(f"--base-env takes NAME=VALUE, got {args.base_env}")
    base_env = dict(item.split("=", 1) for item in args.base_env)
    compare = bool(args.base or base_env)
    roots = {"new": here, **({"base": os.path.abspath(args.base or here)} if compare else {})}
    envs = {"new": {}, "base": base_env}
    print(f"bench_hot: {args.rounds} rounds, alternating {', '.join(roots)}"
          f"{f' (base with {base_env})' if base_env else ''}; "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    head = f"{'row':42} {'unit':10} " + " ".join(f"{k + ' median (min-max)':>28}" for k in roots)
    print(head + ("   new/base" if compare else ""))
    for row in args.only or ROWS:
        got: dict[str, list[float]] = {k: [] for k in roots}
        for r in range(args.rounds):
            for key in (list(roots) if r % 2 == 0 else list(reversed(roots))):
                got[key].append(_one(roots[key], row, envs[key]))
        unit = next(u for k, u in UNITS.items() if row.startswith(k))
        cells = [f"{statistics.median(v):12.2f} ({min(v):.2f}-{max(v):.2f})" for v in got.values()]
        line = f"{row:42} {unit:10} " + " ".join(f"{c:>28}" for c in cells)
        if compare:
            ratio = statistics.median(got["new"]) / statistics.median(got["base"])
            better = "higher is better" if row.startswith(HIGHER_IS_BETTER) else "lower is better"
            line += f"   {ratio:.2f} ({better})"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
