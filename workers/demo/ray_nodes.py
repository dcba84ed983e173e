"""``shmbuf demo --ray-nodes N``: the actor-learner demo across a local multi-node Ray cluster
(``ray.cluster_utils.Cluster``): actors on every node write their node's buffer, the learner
samples the union through ``ReplayCluster.sampler``. Same live line as the demo, plus one
column per node (its inserts/s and its share of the rows sampled).

With ``--isolated`` the nodes share nothing but the filesystem (``workers.cluster.netns``: a
network namespace, /dev/shm and host name each; root only): this process makes them and runs
the demo again inside the head node, which connects to them instead of starting a cluster.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from typing import Any, Callable

from shmbuf.segment import fmt_bytes
from shmbuf.shmdir import shm_free_bytes

from .line import LiveLine

NODE_CPUS = 1
OBJECT_STORE_BYTES = 256 << 20


def start_local_cluster(n_nodes: int) -> Any:
    """A Ray cluster of ``n_nodes`` nodes on this machine, connected (the learner is on the
    head node)."""
    import ray
    from ray.cluster_utils import Cluster

    args: dict[str, Any] = {"num_cpus": NODE_CPUS, "object_store_memory": OBJECT_STORE_BYTES}
    cluster = Cluster(initialize_head=True, head_node_args=dict(args))
    try:
        for _ in range(n_nodes - 1):
            cluster.add_node(**args)
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def run_isolated(args: argparse.Namespace) -> int:
    """Make ``args.ray_nodes`` isolated nodes, run the demo (these ``args``) inside the head
    node, and remove the nodes; the inner demo's exit status."""
    from ..cluster import netns

    n = args.ray_nodes
    reason = netns.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--isolated: {reason}")
    argv = [sys.executable, "-m", "workers.demo", *_argv_of(args)]
    shm = max(256 << 20, shm_free_bytes() // max(n, 1))  # the nodes share this machine's RAM
    print(f"starting {n} isolated Ray nodes (a network namespace, /dev/shm of "
          f"{fmt_bytes(shm)} and host name each; the learner runs in the head's)", flush=True)
    with netns.IsolatedNodes(n, shm_size=str(shm), num_cpus=NODE_CPUS,
                             object_store_memory=OBJECT_STORE_BYTES) as nodes:
        return subprocess.run(nodes.learner_command(argv), env=nodes.learner_env()).returncode


_NOT_OPTIONS = {"command", "func"}  # what the shmbuf CLI adds to the demo's options


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The demo's command line for ``args`` (every option ``--name value``; a flag if True;
    left out if None or False)."""
    out: list[str] = []
    for name, value in sorted(vars(args).items()):
        if name in _NOT_OPTIONS or value is None or value is False or callable(value):
            continue
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def node_columns(stats: dict[str, Any], last: dict[str, tuple[int, int]], dt: float) -> str:
    """``a1b2c3 12,345/s 33%`` per node (``here`` for the learner's): inserts/s and the share of
    the rows sampled since the ``last`` line."""
    nodes = stats["nodes"]
    seen = {n["node_id"]: last.get(n["node_id"], (n["committed"], 0)) for n in nodes}
    sampled = max(1, sum(n["rows_sampled"] - seen[n["node_id"]][1] for n in nodes))
    cols = []
    for n in nodes:
        committed0, sampled0 = seen[n["node_id"]]
        last[n["node_id"]] = (n["committed"], n["rows_sampled"])
        tag = "here" if n["local"] else n["node_id"][:6]
        cols.append(f"{tag} {(n['committed'] - committed0) / dt:7,.0f}/s "
                    f"{100 * (n['rows_sampled'] - sampled0) / sampled:3.0f}%"
                    + (" lost" if n["dropped"] else ""))
    return " | ".join(cols)


def run_ray(args: argparse.Namespace, spec: Any, actor_fn: Callable[[Any], None],
            train_step: Callable[[Any, float], float], capacity: int,
            limits: Callable[[argparse.Namespace, int], Any]) -> int:
    """The demo on ``args.ray_nodes`` local Ray nodes (``args`` as ``command.add_arguments``;
    ``capacity``: rows per lane the demo would give one machine, shared out over the nodes;
    ``limits``: ``actor_learner.demo_limits``, a ``RateLimit`` for the rows in all)."""
    try:
        import ray
    except ImportError:
        raise SystemExit("--ray-nodes needs Ray: pip install 'shmbuf[ray]'") from None
    from ..cluster import ReplayCluster, current_node_id, netns

    n = args.ray_nodes
    if n < 1:
        raise SystemExit(f"--ray-nodes must be >= 1, got {n}")
    isolated = bool(getattr(args, "isolated", False))
    if isolated and not netns.inside():
        return run_isolated(args)
    lanes = args.actors
    if args.capacity is None:  # local nodes share this machine's /dev/shm; isolated ones not
        share = 1 if isolated else n
        capacity = max(4 * args.batch_size, min(
            capacity, (shm_free_bytes() // 4) // (spec.row_nbytes * lanes * share)))
    batch_bytes = spec.row_nbytes * args.batch_size
    limit = limits(args, capacity * lanes * n)
    kind = "isolated" if isolated else "local"
    print(f"shmbuf demo on Ray: {n} {kind} nodes x {args.actors} actors, {args.workers} sampler "
          f"workers per node, {args.env or 'synthetic Atari'} frames, batch {args.batch_size} "
          f"({fmt_bytes(batch_bytes)}), {lanes} lanes x {capacity} per node "
          f"({fmt_bytes(spec.row_nbytes * capacity * lanes * n)} of /dev/shm in all), "
          f"{args.seconds:g} s", flush=True)
    t0 = time.monotonic()
    local = None
    if isolated:
        desc = netns.connect(logging_level=logging.WARNING)
        if sum(1 for node in desc["nodes"] if node["node_id"]) != n:
            raise SystemExit(f"the isolated cluster runs {len(desc['nodes'])} nodes, not {n}")
    else:
        local = start_local_cluster(n)
    batches = 0
    try:
        with ReplayCluster(spec, capacity, lanes) as cluster:
            group = cluster.actors(actor_fn, per_node=args.actors, seed=args.seed)
            with cluster.sampler(args.batch_size, workers=args.workers, limit=limit,
                                 seed=args.seed, timeout=120.0) as sampler:
                print(f"cluster up in {time.monotonic() - t0:.1f} s: nodes "
                      f"{', '.join(i[:6] for i in cluster.node_ids)} (learner on "
                      f"{current_node_id()[:6]}: 'here')", flush=True)
                line = LiveLine(batch_bytes)
                last_wait = 0.0
                per_node: dict[str, tuple[int, int]] = {}
                while line.elapsed() < args.seconds:
                    batch = sampler.next()
                    train_step(batch, args.train_ms)
                    batches += 1
                    dt = line.due()
                    if dt is not None:
                        group.poll()
                        st = sampler.stats()
                        wait = ((st["learner_wait_s"] - last_wait)
                                / max(batches - line.last_batches, 1))
                        last_wait = st["learner_wait_s"]
                        line.show(batches, sum(x["committed"] for x in st["nodes"]),
                                  f"wait {1e3 * wait:6.2f} ms/batch | "
                                  f"{node_columns(st, per_node, dt)}")
                elapsed = line.elapsed()
                group.poll()
                st = sampler.stats()
        line.close()
        inserts = sum(x["committed"] for x in st["nodes"])
        remote = sum(x["bytes_received"] for x in st["nodes"])
        print(f"{line.summary(batches, elapsed)}, "
              f"{remote / elapsed / 1e9:.2f} GB/s of it through Ray); {inserts:,} transitions "
              f"inserted on {n} nodes ({inserts / elapsed:,.0f}/s); learner waited "
              f"{1e3 * st['learner_wait_s'] / max(batches, 1):.2f} ms per batch; actor "
              f"restarts {group.restarts}; rows per node "
              f"{', '.join(str(x['rows_sampled']) for x in st['nodes'])}")
    finally:
        ray.shutdown()
        if local is not None:
            local.shutdown()
    return 0
