"""``shmbuf demo``: actors stepping environments write to a shared buffer; a sampler pool feeds a
learner loop. Prints a live line of rates and a summary. The README's main job.

Run with ``shmbuf demo`` (a plugin command of the shmbuf CLI) or ``python -m workers.demo``;
``--ray-nodes N`` runs it across N local Ray nodes (``ray_nodes.py``).
"""

from __future__ import annotations

import argparse
from typing import Any

from .actor_learner import run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=15.0, help="how long to run (default 15)")
    p.add_argument("--actors", type=int, default=2, help="actor processes (default 2)")
    p.add_argument("--workers", type=int, default=2, help="sampler workers (default 2)")
    p.add_argument("--batch-size", type=int, default=256, help="batch size (default 256)")
    p.add_argument("--capacity", type=int, default=None,
                   help="transitions per lane (default: fits a quarter of /dev/shm, <= 512 MiB)")
    p.add_argument("--min-size", type=int, default=2000, help="transitions before sampling")
    p.add_argument("--samples-per-insert", type=float, default=None,
                   help="rate-limit to this many samples per inserted transition")
    p.add_argument("--train-ms", type=float, default=2.0,
                   help="synthetic compute per train step, in ms (default 2)")
    p.add_argument("--env", default=None, help="a gymnasium env id (needs gymnasium)")
    p.add_argument("--start-method", default=None, choices=["fork", "forkserver", "spawn"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="draw throughput over time to this file at the end (needs matplotlib)")
    p.add_argument("--ray-nodes", type=int, default=None, metavar="N",
                   help="run across N local Ray nodes (ray.cluster_utils.Cluster): --actors "
                        "and --workers are per node; needs pip install 'shmbuf[ray]'")
    p.add_argument("--isolated", action="store_true",
                   help="with --ray-nodes: each node in its own network namespace and "
                        "/dev/shm, the learner in the head's (needs root; "
                        "workers.cluster.netns)")


def register(subparsers: Any) -> None:
    """Plugin hook of the ``shmbuf`` CLI (entry point group ``shmbuf.commands``)."""
    p = subparsers.add_parser("demo", help="run the actor-learner demo",
                              description=__doc__.splitlines()[0])
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.demo", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))
