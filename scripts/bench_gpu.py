#!/usr/bin/env python
"""GPU delivery benchmark: batches/s to the device, side by side with the copy limit, in one run.

For each workload (atari B=256: 7.2 MB of uint8 frames a batch; mujoco B=256 and B=4096):
  1. pinned host->device copy of one ready batch: the physical limit (the reference, 1.00);
  2. pageable copy of the same batch;
  3. ``buf.sample(B)`` then ``.to(device)``;
  4. ``SamplerPool(output="torch", pin_memory=True)`` + ``.to(device, non_blocking=True)``, at
     each worker count (fenced: a slot is refilled only after the copy has completed);
  5. ``SamplerPool(device=...)`` at each worker count, with the learner's wait per batch;
  6. GPU-resident storage with ``index_select`` on the device: the ceiling a host-side buffer
     cannot reach (no host->device copy at all).

    python scripts/bench_gpu.py [--quick] [--workers 1,2,4,8] [--json out.json]
    python scripts/bench_gpu.py --device cpu --quick   # a dry run of every code path, no GPU

Without CUDA (and no ``--device cpu``) it says so and exits 0: CI has no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

try:
    import benchlib
except ModuleNotFoundError:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import benchlib
from shmbuf import ReplayBuffer, Spec
from workers import SamplerPool
from workers.config import Device, Output

WORKLOADS = {
    "atari": dict(obs=((4, 84, 84), "uint8"), action=((), "int64"), reward=((), "float32"),
                  done=((), "bool")),
    "mujoco": dict(obs=((17,), "float32"), next_obs=((17,), "float32"), action=((6,), "float32"),
                   reward=((), "float32"), done=((), "bool")),
}
CASES = [("atari", 256), ("mujoco", 256), ("mujoco", 4096)]


def sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(torch: Any, device: Any, seconds: float, step: Any) -> tuple[float, int]:
    """Batches/s of ``step()`` over about ``seconds`` (after a warm-up), synchronized at the end."""
    for _ in range(3):
        step()
    sync(torch, device)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            step()
        n += 8
    sync(torch, device)
    return n / (time.perf_counter() - t0), n


def run_case(workload: str, B: int, args: argparse.Namespace, torch: Any, device: Any) -> dict:
    spec = Spec(WORKLOADS[workload])
    rng = np.random.default_rng(0)
    capacity = args.capacity
    rows: dict[str, float] = {}
    wait_us: dict[str, float] = {}
    with ReplayBuffer.create(spec, capacity=capacity) as buf:
        benchlib.fill_repeating(buf, benchlib.random_rows(spec, min(capacity, 4096), rng), capacity)
        host = buf.sample(B, rng=rng)
        names = list(host)
        pinned = {k: torch.from_numpy(v).pin_memory() if device.type == "cuda"
                  else torch.from_numpy(v) for k, v in host.items()}
        pageable = {k: torch.from_numpy(v.copy()) for k, v in host.items()}
        dst = {k: torch.empty(v.shape, dtype=pinned[k].dtype, device=device)
               for k, v in host.items()}

        def copy_from(src: dict[str, Any]) -> Any:
            def step() -> None:
                for k in names:
                    dst[k].copy_(src[k], non_blocking=True)
            return step

        rows["pinned copy (limit)"], _ = timed(torch, device, args.seconds, copy_from(pinned))
        rows["pageable copy"], _ = timed(torch, device, args.seconds, copy_from(pageable))

        def sample_then_copy() -> None:
            for v in buf.sample(B, rng=rng).values():
                torch.from_numpy(v).to(device)
        rows["buf.sample + .to(device)"], _ = timed(torch, device, args.seconds, sample_then_copy)

        for n_workers in args.workers:
            with SamplerPool(buf, batch_size=B, workers=n_workers,
                             output=Output("torch", pin_memory=device.type == "cuda"), seed=0,
                             timeout=60) as pool:
                def pinned_pool() -> None:
                    batch = pool.next()
                    for k in names:
                        batch[k].to(device, non_blocking=True)
                rows[f"pool pinned + .to, {n_workers} workers"], _ = timed(
                    torch, device, args.seconds, pinned_pool)
            with SamplerPool(buf, batch_size=B, workers=n_workers,
                             device=Device(device, prefetch=args.prefetch), seed=0,
                             timeout=60) as pool:
                pool.next()
                key = f"pool device=, {n_workers} workers"
                s0 = pool.stats()
                rows[key], n = timed(torch, device, args.seconds, pool.next)
                s1 = pool.stats()
                wait_us[key] = 1e6 * (s1["learner_wait_s"] - s0["learner_wait_s"]) / max(
                    1, s1["batches"] - s0["batches"])

        resident = {k: torch.from_numpy(buf.column(k)[:capacity].copy()).to(device)
                    for k in names}
        idx = torch.randint(0, capacity, (B,), device=device)

        def gather_on_device() -> None:
            torch.randint(0, capacity, (B,), device=device, out=idx)
            for k in names:
                torch.index_select(resident[k], 0, idx, out=dst[k])
        rows["GPU-resident index_select (ceiling)"], _ = timed(
            torch, device, args.seconds, gather_on_device)
    limit = rows["pinned copy (limit)"]
    return {"workload": workload, "batch_size": B,
            "batch_mb": sum(np.dtype(d).itemsize * int(np.prod(s)) for s, d in
                            WORKLOADS[workload].values()) * B / 1e6,
            "rows": {k: {"batches_per_s": v, "of_limit": v / limit,
                         **({"learner_wait_us": wait_us[k]} if k in wait_us else {})}
                     for k, v in rows.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--capacity", type=int, default=50_000)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="small buffers, 0.5 s a row")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.workers = [int(w) for w in args.workers.split(",")]
    if args.quick:
        args.capacity, args.seconds = 4096, 0.5
    try:
        import torch
    except ImportError:
        print("bench_gpu: torch is not installed; nothing to measure")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: CUDA is not available on this machine; nothing to measure "
              "(run it on the GPU machine, or --device cpu for a dry run)")
        return 0
    info = benchlib.machine()
    print(benchlib.machine_line(info))
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    results = []
    for workload, B in CASES:
        r = run_case(workload, B, args, torch, device)
        results.append(r)
        print(f"\n{workload} B={B} ({r['batch_mb']:.2f} MB a batch)")
        print(f"  {'path':44s} {'batches/s':>10s} {'of limit':>9s} {'wait us':>8s}")
        for name, row in r["rows"].items():
            wait = row.get("learner_wait_us")
            print(f"  {name:44s} {row['batches_per_s']:10.0f} {row['of_limit']:9.2f} "
                  f"{'' if wait is None else f'{wait:8.1f}'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
