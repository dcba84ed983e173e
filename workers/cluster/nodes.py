"""What every process of a ``ReplayCluster`` shares: Ray node ids and placement, and
``ClusterClient``, the picklable part of a cluster that attaches a node's buffer through shared
memory and hands out lane writers on it (the cluster's errors and warnings are in
``workers.errors``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shmbuf import ReplayBuffer, Spec, segment

from ..errors import NoHostOnNodeError

NAME_PREFIX = "shmbuf-ray-"


def current_node_id() -> str:
    """The Ray node this process runs on."""
    return ray.get_runtime_context().get_node_id()


def alive_node_ids() -> list[str]:
    """Node ids of the Ray cluster's live nodes (head first, as Ray lists them)."""
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def node_alive(node_id: str) -> bool:
    return node_id in alive_node_ids()


def on_node(node_id: str) -> dict[str, Any]:
    """Ray ``.options(**on_node(id))`` that place a task or actor on that node (hard affinity)."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def call_actor(method: Any, *args: Any, timeout: float) -> Any:
    """``ray.get(method.remote(*args))`` within ``timeout`` seconds, calling again while the
    actor is restarting (Ray refuses calls then with ``ActorUnavailableError``).

    Raises:
        ray.exceptions.ActorDiedError: the actor is dead for good.
        ray.exceptions.GetTimeoutError: no answer in time.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(method.remote(*args), timeout=max(0.01, deadline - time.monotonic()))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise ray.exceptions.GetTimeoutError(
                    f"the actor stayed unavailable (restarting) for {timeout}s") from None
            time.sleep(0.1)


# Buffers attached in this process, by name (a writer's process attaches its node's buffer once).
_attached: dict[str, ReplayBuffer] = {}


def _attach(name: str, timeout: float) -> ReplayBuffer:
    buf = _attached.get(name)
    if buf is not None and not buf.closed and _same_file(buf, name):
        return buf
    buf = ReplayBuffer.attach(name, timeout=timeout)
    _attached[name] = buf
    return buf


def detach_all(prefix: str) -> None:
    """Close this process's attached buffers whose names start with ``prefix``."""
    for name in [n for n in _attached if n.startswith(prefix)]:
        _attached.pop(name).close()


def _same_file(buf: ReplayBuffer, name: str) -> bool:
    """False once the segment behind ``buf`` was unlinked (e.g. recreated by a new host)."""
    fd = buf.storage.segment.fd
    try:
        return fd is not None and os.stat(f"{segment.SHM_DIR}/{name}").st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


class ClusterClient:
    """What any process needs to write into a ``ReplayCluster``: its nodes' buffer names.

    A ``ReplayCluster`` pickles to one (send the cluster to a Ray task or actor and call
    ``cluster.writer()`` there).
    """

    def __init__(self, names: dict[str, str], spec: Spec) -> None:
        self.buffer_names = dict(names)
        self.spec = spec

    @property
    def node_ids(self) -> list[str]:
        """The nodes with a host, in the order the cluster was given them."""
        return list(self.buffer_names)

    def buffer_name(self, node_id: str | None = None) -> str:
        """The segment name of ``node_id``'s buffer (default: this process's node).

        Raises:
            NoHostOnNodeError: that node has no host of this cluster.
        """
        node = current_node_id() if node_id is None else node_id
        name = self.buffer_names.get(node)
        if name is None:
            raise NoHostOnNodeError(
                f"Ray node {node} has no host of this ReplayCluster (hosts run on "
                f"{', '.join(n[:12] for n in self.buffer_names)}). Fix: place the actor on one "
                f"of them (`.options(**workers.cluster.on_node(cluster.node_ids[0]))`), or make "
                f"the cluster with that node in nodes=")
        return name

    def buffer(self, node_id: str | None = None, timeout: float = 5.0) -> ReplayBuffer:
        """This node's buffer, attached through shared memory (cached per process; do not
        close it while writers of it are open)."""
        return _attach(self.buffer_name(node_id), timeout)

    def writer(self, lane: int | None = None, timeout: float = 5.0, **writer_kwargs: Any) -> Any:
        """A lane writer on this process's node's buffer (``ReplayBuffer.writer``'s arguments).
        Call it inside a Ray task or actor; rows stay on the node, in shared memory.

        Raises:
            NoHostOnNodeError: this node has no host of the cluster.
            LaneBusyError: every lane of the node's buffer has a live writer.
        """
        return self.buffer(timeout=timeout).writer(lane, timeout, **writer_kwargs)

    def client(self) -> ClusterClient:
        """A plain ``ClusterClient`` of these nodes (what a pickled cluster becomes)."""
        return ClusterClient(self.buffer_names, self.spec)

    def on_node(self, node_id: str) -> dict[str, Any]:
        """``.options(**cluster.on_node(id))`` for a task or actor on that node."""
        if node_id not in self.buffer_names:
            self.buffer_name(node_id)  # raises NoHostOnNodeError
        return on_node(node_id)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ClusterClient, (self.buffer_names, self.spec))
