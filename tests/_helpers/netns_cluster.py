"""Isolated Ray nodes for the tests of ``workers.cluster`` (``workers.cluster.netns``): which
cluster tests run on them, how a test module runs inside the head node, and the node set a test
inside it adds and loses nodes with.

Two sides:

- *outside* (the pytest run CI starts): ``tests/test_cluster_isolated.py`` makes the nodes and
  runs each module of ``ISOLATED_MODULES`` in a pytest of its own inside the head node
  (``run_module``); the same modules skip their Ray tests here (``local_unless_isolated``), so
  nothing runs twice. Without root or namespaces, they run on a local ``Cluster`` instead.
- *inside* (that pytest): ``tests/cluster_procs`` connects to the nodes instead of starting a
  local cluster (``inside()``), and ``IsolatedNodeSet`` adds a node (Ray started in a spare
  namespace) and loses one (every process in its namespace killed).

``SHMBUF_ISOLATED=0`` keeps every cluster test on a local ``Cluster`` even as root.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from workers.cluster import netns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The modules whose tests would notice a row read from another node's segment, a lost node
# that is not really gone, or a limit that is only right over one /dev/shm.
ISOLATED_MODULES = ["tests/test_cluster.py", "tests/test_cluster_modes.py",
                    "tests/test_cluster_faults.py", "tests/test_cluster_rate.py"]
SPARE_NODES = 1  # namespaces ready for a node a test adds (reused once it is lost)
SWITCH = "SHMBUF_ISOLATED"


def inside() -> bool:
    """True in the pytest that ``run_module`` started inside the head node."""
    return netns.inside()


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why the cluster tests cannot run on isolated nodes here (None: they can)."""
    if os.environ.get(SWITCH) == "0":
        return f"{SWITCH}=0: the cluster tests run on a local ray.cluster_utils.Cluster"
    return netns.unavailable_reason()


def runs_isolated_elsewhere() -> bool:
    """True outside, where ``tests/test_cluster_isolated.py`` runs the modules instead."""
    return not inside() and unavailable_reason() is None


local_unless_isolated = pytest.mark.skipif(
    runs_isolated_elsewhere(),
    reason="runs on isolated Ray nodes (own network and /dev/shm each) in "
           "tests/test_cluster_isolated.py")


def make_nodes(n_nodes: int = 3, spare: int = SPARE_NODES, **kwargs: Any) -> netns.IsolatedNodes:
    """``n_nodes`` isolated Ray nodes (+ ``spare`` namespaces) whose processes import this
    checkout (tests/cluster_procs' Ray tasks)."""
    env = dict(kwargs.pop("env", {}), PYTHONPATH=ROOT)
    return netns.IsolatedNodes(n_nodes, spare=spare, env=env, **kwargs)


def run_module(nodes: netns.IsolatedNodes, module: str, timeout: float,
               extra: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the Ray tests of ``module`` (``-m ray``: the others ran outside) in a pytest inside
    the head node (its network, /dev/shm and /tmp/ray); what it printed and its exit status."""
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "-m", "ray",
            "--shm-guard=strict", module, *(extra or [])]
    try:
        return subprocess.run(nodes.learner_command(argv, cwd=ROOT), env=nodes.learner_env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{module} ran past {timeout}s on isolated nodes:\n{out[-6000:]}")


class AddedNode:
    """A node ``IsolatedNodeSet.add_node`` started: its namespace index and Ray node id."""

    def __init__(self, index: int, node_id: str) -> None:
        self.index, self.node_id = index, node_id


class IsolatedNodeSet:
    """What the tests of ``tests/cluster_procs`` use of ``ray.cluster_utils.Cluster``
    (``add_node``, ``remove_node``, ``wait_for_nodes``), on the isolated nodes this process
    runs in: a node is added in a spare namespace and removed by killing every process in its
    namespace (a machine lost: its /dev/shm goes with it)."""

    def __init__(self) -> None:
        self.nodes = netns.IsolatedNodes.attach()
        self.added: list[AddedNode] = []

    def add_node(self, **_node_args: Any) -> AddedNode:
        free = [n for n in self.nodes.nodes[1:] if not n.node_id]  # spare, or lost before
        if not free:
            raise RuntimeError(f"no namespace free for another node (spares: {SPARE_NODES}); "
                               f"lose an added node first (remove_node)")
        node = free[0]
        added = AddedNode(node.index, self.nodes.start_node(node.index))
        self.added.append(added)
        return added

    def remove_node(self, node: AddedNode, allow_graceful: bool = False) -> None:
        self.nodes.kill_node(node.index)
        self.added.remove(node)

    def wait_for_nodes(self, timeout: float = 60.0) -> None:
        import ray

        want = {n.node_id for n in self.nodes.nodes if n.node_id}
        deadline = time.monotonic() + timeout
        while want - {n["NodeID"] for n in ray.nodes() if n["Alive"]}:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"isolated nodes {sorted(want)} not all alive in {timeout}s")
            time.sleep(0.2)

    def lose_added(self) -> None:
        """Lose every node this set added and did not remove (a test that failed midway)."""
        for node in list(self.added):
            self.remove_node(node)

    def shm_of_live_nodes(self) -> dict[int, list[str]]:
        """Each node's /dev/shm entries (nodes running Ray), by namespace index."""
        return {n.index: self.nodes.shm_entries(n.index) for n in self.nodes.nodes if n.node_id}
