#!/usr/bin/env python
"""Ray cluster benchmark (issue 15): the learner's batches/s and the actors' inserts/s across a
local 3-node Ray cluster (``ray.cluster_utils.Cluster``, one CPU per node, learner on the head).

All rows in one run, per workload (atari: uint8 4x84x84, 7.2 MB a batch; mujoco: 42 float32,
43 kB), batch 256:
  numpy gather      ``buf.sample(256)`` in the learner's own process
  ray raw (remote)  an actor on another node returns ``buf.sample(256)``, 4 calls in flight
  ray raw (local)   the same with the actor on the learner's node
  torchrl           TorchRL's ``RayReplayBuffer`` (one actor holds it all): sampling alone, and
                    while one writer per node extends 64 rows at a time (if torchrl imports;
                    its actor is placed on a node other than the learner's)
  lone writer       a writer extending 64 rows at a time into a buffer nobody samples
  local pool        a ``SamplerPool`` over a local buffer, one writer on it
  cluster N nodes   ``ReplayCluster.sampler`` over 1, 2, 3 nodes, one writer per node; and
                    over 3 nodes with no writers (like for like with Ray's raw rows)
  cluster, busy     3 nodes, no writers, the learner computing between batches for 1.5x the
                    free-running batch time (the hosts keep up): the learner's wait per batch
  cluster, spi      3 nodes, one writer per node, ``samples_per_insert=(1, 16 batches)``: the
                    samples per insert over the window (writers held on every node), how
                    far the inserts stand past the limit once the learner stops, and each
                    node's share of the inserts (target: the largest <= 1.5x the smallest;
                    ``--spi-seconds 30`` for the issue's window)

With ``--isolated`` (root) the 3 nodes share nothing but the filesystem: each has its own
network namespace, /dev/shm and host name (``workers.cluster.netns``), and the benchmark runs
inside the head node; Ray's raw rows are then the transfer between those nodes.

    python scripts/bench_cluster.py [--quick] [--seconds S] [--workloads atari,mujoco] [--json P]
                                    [--isolated]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

try:
    import benchlib
except ModuleNotFoundError:  # run by path: benchlib is beside it
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import benchlib

import ray  # noqa: E402

from shmbuf import ReplayBuffer, Spec  # noqa: E402
from shmbuf.errors import ClosedError  # noqa: E402
from shmbuf.limiter import RateLimit  # noqa: E402
from workers import SamplerPool  # noqa: E402
from workers.cluster import ReplayCluster, current_node_id, netns, on_node  # noqa: E402
from workers.config import Workers  # noqa: E402
from workers.demo.ray_nodes import start_local_cluster  # noqa: E402

WORKLOADS: dict[str, dict[str, Any]] = {"atari": {"obs": ((4, 84, 84), "uint8")},
                                         "mujoco": {"obs": ((42,), "float32")}}
CAPACITY = {"atari": 4096, "mujoco": 200_000}  # rows per node
BATCH = 256
CHUNK = 64  # rows per writer extend
SPI = (1.0, 16.0 * BATCH)  # the samples_per_insert row's (ratio, tolerance)
LINK_GBPS = 25.0  # the link the report extrapolates to


def rows_for(spec: Spec, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    return benchlib.random_rows(spec, n, np.random.default_rng(seed))


@ray.remote(num_cpus=0, max_concurrency=2)
class Writer:
    """Extends ``CHUNK`` rows at a time, as fast as it can, into a buffer (by name), a
    ``ReplayCluster`` (its node's buffer) or a TorchRL replay buffer client, until stopped;
    ``progress()`` reads its count while it runs."""

    def __init__(self, spec: Any) -> None:
        self.rows = rows_for(Spec(spec), CHUNK, seed=os.getpid())
        self.stopping = False
        self.n = 0

    def run(self, target: Any, kind: str) -> int:
        if kind == "torchrl":
            import torch
            from tensordict import TensorDict

            td = TensorDict({k: torch.from_numpy(v) for k, v in self.rows.items()},
                            batch_size=[CHUNK])
            while not self.stopping:
                target.extend(td)
                self.n += CHUNK
            return self.n
        buf = ReplayBuffer.attach(target) if kind == "name" else target.buffer()
        with buf.writer(timeout=10.0) as w:
            w.stop_when = lambda: self.stopping  # a stop ends a wait on the rate limiter
            while not self.stopping:
                try:
                    w.extend(self.rows)
                except ClosedError:
                    break
                self.n += CHUNK
        return self.n

    def progress(self) -> tuple[int, float]:
        return self.n, time.perf_counter()

    def stop(self) -> None:
        self.stopping = True


@ray.remote(num_cpus=0)
class Gatherer:
    """Holds a filled buffer on its node and returns ``sample(BATCH)`` batches (Ray's raw path)."""

    def __init__(self, spec: Any, capacity: int) -> None:
        self.buf = ReplayBuffer.create(Spec(spec), capacity)
        rows = rows_for(self.buf.spec, 1024)
        benchlib.fill_repeating(self.buf, rows, capacity)

    def batch(self) -> dict[str, np.ndarray]:
        return self.buf.sample(BATCH)

    def close(self) -> None:
        self.buf.close()


def with_writers(targets: list[tuple[str, Any, str]], spec: dict, seconds: float,
                 learner: Any) -> dict[str, Any]:
    """Start one ``Writer`` per (node, target, kind) and wait until each writes, then run
    ``learner(seconds)`` -> dict and add the writers' inserts/s over that window."""
    writers = [Writer.options(**on_node(node)).remote(spec) for node, _, _ in targets]
    runs = [w.run.remote(t, kind) for w, (_, t, kind) in zip(writers, targets)]
    deadline = time.monotonic() + 120
    while min(n for n, _ in ray.get([w.progress.remote() for w in writers], timeout=120)) == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("a writer never started writing")
        time.sleep(0.1)
    try:
        start = ray.get([w.progress.remote() for w in writers], timeout=60)
        out = learner(seconds)
        end = ray.get([w.progress.remote() for w in writers], timeout=60)
    finally:
        for w in writers:
            w.stop.remote()
        ray.get(runs, timeout=60)
        for w in writers:
            ray.kill(w)
    out["inserts_per_s_each"] = [(n1 - n0) / (t1 - t0) for (n0, t0), (n1, t1) in zip(start, end)]
    out["inserts_per_s"] = sum(out["inserts_per_s_each"])
    return out


def rate(take: Any, seconds: float) -> dict[str, Any]:
    take()  # the first batch waits for pools and prefetch to start
    n, took = benchlib.calls_for(take, seconds)
    return {"batches_per_s": n / took}


def bench_workload(name: str, nodes: list[str], seconds: float, torchrl_ok: bool,
                   spi_seconds: float | None = None) -> list[dict]:
    spec = WORKLOADS[name]
    cap = CAPACITY[name]
    batch_bytes = Spec(spec).row_nbytes * BATCH
    out: list[dict] = []

    def add(row: str, res: dict[str, Any]) -> None:
        res.update(workload=name, row=row, batch_mb=batch_bytes / 1e6)
        out.append(res)
        extra = "".join(f", {k} {v:,.0f}" for k, v in res.items() if k == "inserts_per_s")
        print(f"  {name:6s} {row:28s} {res.get('batches_per_s', 0):9,.1f} batches/s{extra}",
              file=sys.stderr, flush=True)

    # NumPy gather in the learner's process.
    with ReplayBuffer.create(Spec(spec), cap) as buf:
        benchlib.fill_repeating(buf, rows_for(buf.spec, 1024), cap)
        add("numpy gather", rate(lambda: buf.sample(BATCH), seconds))
    # Ray's raw transfer: a gathered batch returned by an actor, 4 calls in flight.
    for where, node in (("ray raw (remote node)", nodes[1]), ("ray raw (same node)", nodes[0])):
        g = Gatherer.options(**on_node(node)).remote(spec, min(cap, 4096))
        refs = [g.batch.remote() for _ in range(4)]

        def take(g: Any = g, refs: list = refs) -> None:
            ray.get(refs.pop(0), timeout=60)
            refs.append(g.batch.remote())

        add(where, rate(take, seconds))
        ray.get(refs, timeout=60)
        ray.get(g.close.remote(), timeout=60)
        ray.kill(g)
    if torchrl_ok:
        out += bench_torchrl(name, spec, nodes, seconds, add)
    # A lone writer (the per-node insert baseline), then the local pool with one writer.
    idle = lambda s: (time.sleep(s), {})[1]  # noqa: E731 - the learner does nothing
    with ReplayBuffer.create(Spec(spec), cap) as buf:
        add("lone writer", with_writers([(nodes[0], buf.name, "name")], spec, seconds, idle))
    # The same CPU contention as the cluster rows, without any sampling: a buffer on each node
    # (each node's own /dev/shm: a cluster's hosts make them), nobody sampling.
    with ReplayCluster(spec, capacity_per_node=cap, lanes_per_node=1, nodes=nodes) as idle_cluster:
        add("3 lone writers, 1 per node", with_writers(
            [(n, idle_cluster.client(), "cluster") for n in nodes], spec, seconds, idle))
    with ReplayBuffer.create(Spec(spec), cap) as buf:
        benchlib.fill_repeating(buf, rows_for(buf.spec, 1024), BATCH * 4)
        with SamplerPool(buf, BATCH, workers=Workers(1, start_method="forkserver"),
                         seed=0) as pool:
            add("local pool, 1 writer",
                with_writers([(nodes[0], buf.name, "name")], spec, seconds,
                             lambda s: rate(pool.next, s)))
    for k in (1, 2, 3):
        add(f"cluster {k} node{'s' if k > 1 else ''}, 1 writer each",
            bench_cluster(spec, nodes[:k], cap, seconds, train_ms=0.0))
    add("cluster 3 nodes, no writers", bench_cluster(spec, nodes, cap, seconds, train_ms=0.0,
                                                     writers=False))
    add(f"cluster 3 nodes, 1 writer each, samples_per_insert {SPI[0]:g}",
        bench_cluster(spec, nodes, cap, spi_seconds or seconds, train_ms=0.0, spi=SPI))
    ref = next(r for r in out if r["row"] == "cluster 3 nodes, 1 writer each")
    busy_ms = 1.5e3 / max(ref["batches_per_s"], 1e-3)  # 1.5x the free-running batch time
    add(f"cluster 3 nodes, no writers, learner busy {busy_ms:.1f} ms",
        bench_cluster(spec, nodes, cap, seconds, train_ms=busy_ms, writers=False))
    return out


def bench_cluster(spec: dict, nodes: list[str], cap: int, seconds: float,
                  train_ms: float, writers: bool = True,
                  spi: tuple[float, float] | None = None) -> dict[str, Any]:
    with ReplayCluster(spec, capacity_per_node=cap, lanes_per_node=1, nodes=nodes) as cluster:
        for node in nodes:  # a few batches' worth on every node before the clock starts
            ray.get(_prefill.options(**on_node(node)).remote(cluster, spec, BATCH * 4),
                    timeout=120)

        def inserts() -> int:  # every node's rows, as the hosts read them now
            return sum(i["committed"] for i in cluster.info().values())

        limit = RateLimit(1, *spi) if spi is not None else None
        with cluster.sampler(BATCH, limit=limit, seed=0) as sampler:
            def learn(s: float) -> dict[str, Any]:
                sampler.next()
                st0 = sampler.stats()
                i0, s0 = inserts(), int(sampler.rows_from.sum())
                t0 = time.perf_counter()
                n = 0
                while time.perf_counter() - t0 < s:
                    sampler.next()
                    if train_ms:
                        benchlib.busy(train_ms / 1e3)
                    n += 1
                took = time.perf_counter() - t0
                st = sampler.stats()
                limits = {}
                if spi is not None:  # samples per insert over the window, and at rest
                    i1, s1 = inserts(), int(sampler.rows_from.sum())
                    time.sleep(1.0)  # the learner stopped: writers stop where it left them
                    at_rest = inserts() * spi[0] - s1 - RateLimit(1, *spi).max_diff
                    limits = {"samples_per_insert": (s1 - s0) / max(i1 - i0, 1),
                              "excess_at_rest": at_rest, "window_inserts_per_s": (i1 - i0) / took}
                got = sum(x["bytes_received"] for x in st["nodes"]) - sum(
                    x["bytes_received"] for x in st0["nodes"])
                return {"batches_per_s": n / took,
                        "wait_ms_per_batch": 1e3 * (st["learner_wait_s"] - st0["learner_wait_s"])
                        / max(n, 1),
                        "next_ms_per_batch": 1e3 * (st["learner_next_s"] - st0["learner_next_s"])
                        / max(n, 1),
                        "ray_bytes_per_batch": got / max(n, 1),
                        "rows_per_call": sampler.rows_per_call, **limits}

            if not writers:
                return learn(seconds)
            return with_writers([(n, cluster.client(), "cluster") for n in nodes], spec,
                                seconds, learn)


@ray.remote(num_cpus=0)
def _prefill(cluster: Any, spec: dict, n: int) -> None:
    rows = rows_for(Spec(spec), n)
    with cluster.writer() as w:
        w.extend(rows)


def bench_torchrl(name: str, spec: dict, nodes: list[str], seconds: float, add: Any) -> list:
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage
    from torchrl.data.replay_buffers import RayReplayBuffer

    # Its one actor on another node than the learner's, as most of a cluster's rows are.
    rb = RayReplayBuffer(storage=LazyTensorStorage(CAPACITY[name]), batch_size=BATCH,
                         remote_config={"num_cpus": 0, **on_node(nodes[1])})
    try:
        rows = rows_for(Spec(spec), 1024)
        td = TensorDict({k: torch.from_numpy(v) for k, v in rows.items()}, batch_size=[1024])
        for _ in range(4):
            rb.extend(td)
        add("torchrl RayReplayBuffer", rate(rb.sample, seconds))
        add("torchrl + 1 writer per node", with_writers(
            [(n, rb.client(), "torchrl") for n in nodes], spec, seconds,
            lambda s: rate(rb.sample, s)))
    finally:
        rb.close()
    return []


def report(rows: list[dict]) -> list[dict]:
    """Print the table and the issue's targets; return the targets."""
    targets = []
    for wl in sorted({r["workload"] for r in rows}):
        by = {r["row"]: r for r in rows if r["workload"] == wl}
        print(f"\n{wl} (batch {BATCH}, {by['numpy gather']['batch_mb']:.3f} MB):")
        for row, r in by.items():
            extra = []
            if "window_inserts_per_s" in r:  # the writers' counts also span the rest after
                per = np.asarray(r["inserts_per_s_each"], float)
                each = ", ".join(f"{100 * x / max(per.sum(), 1e-9):.0f}%" for x in per)
                extra.append(f"inserts/s {r['window_inserts_per_s']:,.0f} (share per node "
                             f"{each}, the learner's first)")
            elif "inserts_per_s" in r:
                each = ", ".join(f"{x:,.0f}" for x in r["inserts_per_s_each"])
                extra.append(f"inserts/s {r['inserts_per_s']:,.0f} ({each})")
            if "samples_per_insert" in r:
                extra.append(f"{r['samples_per_insert']:.3f} samples per insert; at rest the "
                             f"inserts stand {r['excess_at_rest'] / SPI[0]:+,.0f} rows from the "
                             f"limit (tolerance {SPI[1] / SPI[0]:,.0f})")
            if "wait_ms_per_batch" in r:
                extra.append(f"wait {r['wait_ms_per_batch']:.3f} ms/batch (next() "
                             f"{r['next_ms_per_batch']:.3f} ms in all)")
            if "ray_bytes_per_batch" in r:
                bpb = r["ray_bytes_per_batch"]
                link = LINK_GBPS / 8 * 1e9 / bpb if bpb else float("inf")
                extra.append(f"{bpb / 1e6:.2f} MB/batch through Ray (a {LINK_GBPS:g} Gb/s link "
                             f"carries {link:,.0f} batches/s)")
            bps = f"{r['batches_per_s']:10,.1f} batches/s" if "batches_per_s" in r else " " * 20
            print(f"  {row:40s} {bps}  {'; '.join(extra)}")
        c3 = by["cluster 3 nodes, 1 writer each"]
        raw = by["ray raw (remote node)"]
        for row, gated in (("cluster 3 nodes, no writers", True), (c3["row"], False)):
            r = by[row]  # bytes through Ray per second, against the raw path's (no writers)
            cross = r["ray_bytes_per_batch"] / (r["batch_mb"] * 1e6)  # share that crossed
            targets.append({"workload": wl, "what": f"{row} / ray raw, same bytes",
                            "value": r["batches_per_s"] * cross / raw["batches_per_s"],
                            "target": 0.8 if wl == "atari" and gated else None})
        targets.append({"workload": wl, "what": "cluster 3 nodes / local pool",
                        "value": c3["batches_per_s"] / by["local pool, 1 writer"]["batches_per_s"],
                        "target": 0.5 if wl == "mujoco" else None})
        lone = by["lone writer"]["inserts_per_s"]
        three = by["3 lone writers, 1 per node"]["inserts_per_s_each"]
        targets.append({"workload": wl, "what": "inserts per node (3 nodes) / lone writer",
                        "value": min(c3["inserts_per_s_each"]) / lone, "target": 0.8})
        targets.append({"workload": wl, "what": "inserts per node / 3 lone writers' per writer",
                        "value": np.mean(c3["inserts_per_s_each"]) / np.mean(three),
                        "target": None})
        held = next(r for k, r in by.items() if "samples_per_insert" in k)
        targets.append({"workload": wl, "what": f"samples per insert, spi {SPI[0]:g}, 3 nodes",
                        "value": held["samples_per_insert"], "target": None})
        targets.append({"workload": wl, "what": "inserts past the limit at rest / tolerance",
                        "value": held["excess_at_rest"] / SPI[1], "target": None})
        each = np.asarray(held["inserts_per_s_each"])
        targets.append({"workload": wl, "what": "spi: largest node's inserts / smallest's",
                        "value": float(each.max() / max(each.min(), 1e-9)), "target": 1.5,
                        "lower_is_better": True})
        targets.append({"workload": wl, "what": "learner wait when hosts keep up (ms/batch)",
                        "value": next(r for k, r in by.items() if "busy" in k)["wait_ms_per_batch"],
                        "target": 0.1, "lower_is_better": True})
        if "torchrl + 1 writer per node" in by:
            trl, trw = by["torchrl RayReplayBuffer"], by["torchrl + 1 writer per node"]
            targets.append({"workload": wl, "what": "cluster 3 nodes / torchrl (with writers)",
                            "value": c3["batches_per_s"] / trw["batches_per_s"],
                            "target": 4.0 if wl == "atari" else 10.0})
            targets.append({"workload": wl, "what": "cluster inserts / torchrl inserts",
                            "value": c3["inserts_per_s"] / trw["inserts_per_s"],
                            "target": 10.0})
            targets.append({"workload": wl, "what": "cluster 3 nodes / torchrl sampling alone",
                            "value": c3["batches_per_s"] / trl["batches_per_s"], "target": None})
    print("\ntargets:")
    for t in targets:
        goal = t["target"]
        ok = None if goal is None else (t["value"] <= goal if t.get("lower_is_better")
                                        else t["value"] >= goal)
        t["pass"] = True if ok is None else ok
        t["gated"] = goal is not None
        mark = "" if ok is None else ("  ok" if ok else "  MISSED")
        tgt = "" if goal is None else f" (target {'<=' if t.get('lower_is_better') else '>='} {goal:g})"
        print(f"  {t['workload']:6s} {t['what']:48s} {t['value']:8.3f}{tgt}{mark}")
    return targets


def run_isolated(args: argparse.Namespace, argv: list[str]) -> int:
    """Make 3 isolated nodes and run this benchmark (``argv``) inside the head node."""
    reason = netns.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--isolated: {reason}")
    if args.json and os.path.abspath(args.json).startswith("/tmp/"):
        raise SystemExit(f"--json {args.json}: each isolated node has a /tmp of its own; "
                         f"write it elsewhere (e.g. bench-out/)")
    here_dir = os.path.dirname(os.path.abspath(__file__))
    env = {"PYTHONPATH": os.pathsep.join([here_dir, os.path.dirname(here_dir)])}
    with netns.IsolatedNodes(3, shm_size="3g", num_cpus=1, object_store_memory=256 << 20,
                             env=env) as nodes:
        cmd = nodes.learner_command([sys.executable, os.path.abspath(__file__), *argv])
        return subprocess.run(cmd, env=nodes.learner_env()).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 s per row (default 5 s)")
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--workloads", default="atari,mujoco")
    p.add_argument("--no-torchrl", action="store_true", help="skip TorchRL's rows")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--spi-seconds", type=float, default=None,
                   help="window of the samples_per_insert row (default --seconds)")
    p.add_argument("--check", action="store_true", help="exit 1 if a gated target is missed")
    p.add_argument("--isolated", action="store_true",
                   help="nodes in network namespaces with a /dev/shm each (root)")
    args = p.parse_args(argv)
    if args.isolated and not netns.inside():
        return run_isolated(args, list(sys.argv[1:] if argv is None else argv))
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    torchrl_ok = False
    if not args.no_torchrl:
        try:
            import torchrl  # noqa: F401

            torchrl_ok = True
        except ImportError:
            print("torchrl not installed: its rows are skipped", file=sys.stderr)
    info = benchlib.machine()
    clock = benchlib.RunClock()
    here_dir = os.path.dirname(os.path.abspath(__file__))  # Ray workers import benchlib too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [here_dir, os.path.dirname(here_dir), os.environ.get("PYTHONPATH", "")])
    t0 = time.monotonic()
    local = None
    if args.isolated:
        netns.connect(runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    else:
        local = start_local_cluster(3)
    try:
        here = current_node_id()
        nodes = [here] + [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
        print(f"3 {'isolated' if args.isolated else 'local'} Ray nodes up in "
              f"{time.monotonic() - t0:.1f} s", file=sys.stderr)
        rows = []
        for wl in args.workloads.split(","):
            rows += bench_workload(wl, nodes, seconds, torchrl_ok, args.spi_seconds)
    finally:
        ray.shutdown()
        if local is not None:
            local.shutdown()
    where = "3 isolated nodes (network namespace, /dev/shm each)" if args.isolated else \
        "3 local nodes (one /dev/shm)"
    print(benchlib.machine_line(info) + f"; ray {ray.__version__}; {where}")
    targets = report(rows)
    runtime, others = clock.stop()
    print(benchlib.runtime_line(runtime, others))
    return benchlib.finish(args, {"machine": info, "rows": rows, "targets": targets,
                                  "seconds": seconds})


if __name__ == "__main__":
    raise SystemExit(main())
