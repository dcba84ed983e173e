"""``ReplayCluster``: one host actor per Ray node, each owning that node's buffer; the writers,
samplers and actors of the cluster are made from it.
"""

from __future__ import annotations

import secrets
import time
import warnings
from typing import Any

import ray

from shmbuf import Spec, segment
from shmbuf.checks import positive_int, timeout_seconds
from shmbuf.errors import ClosedError

from ..supervise import refuse_main_reimport
from .actors import ClusterActors
from .host import CONTROL, NodeHost, remove_leaked_segments, sweep_segments
from .nodes import NAME_PREFIX, ClusterClient, alive_node_ids, detach_all, on_node
from .sampler import ClusterSampler

_sweep_task: Any = ray.remote(num_cpus=0, max_retries=0)(sweep_segments)


class ReplayCluster(ClusterClient):
    """One host actor per chosen Ray node, each owning that node's ``ReplayBuffer``.

    Args:
        spec: the transition's fields (a ``Spec`` or a mapping ``Spec`` accepts).
        capacity_per_node: rows per lane on each node.
        lanes_per_node: lanes (concurrent writers) on each node.
        nodes: Ray node ids to host a buffer on (default: every live node).
        name: a tag in the segment names (default random); segment names are
            ``shmbuf-ray-<tag>-<node id>``, since nodes may share a machine's /dev/shm (each
            node's buffer is only ever opened on its own node).
        host_restarts: how many times Ray restarts a dead host (it re-adopts the segment).
        timeout: seconds to wait for the hosts to start.
        buffer_kwargs: passed to ``ReplayBuffer.create`` (``next_obs``, ``episode_spec``, ...).

    Raises:
        MainModuleReimportError: made while a child process (a pool's spawn or forkserver
            worker) re-runs the main script: put that code under ``if __name__ == "__main__":``.

    Concurrency: hosts own the segments; writers on a node attach by name and write lanes as
    with one buffer. Sampling goes through ``sampler()``; see ``ClusterSampler``.

    Example:
        >>> ray.init()
        >>> with ReplayCluster(spec, capacity_per_node=100_000, lanes_per_node=4) as cluster:
        ...     actors = [Actor.options(**cluster.on_node(n)).remote(cluster)
        ...               for n in cluster.node_ids]          # each calls cluster.writer()
        ...     with cluster.sampler(256) as sampler:
        ...         for batch in sampler: ...
    """

    def __init__(self, spec: Spec | dict[str, Any], capacity_per_node: int,
                 lanes_per_node: int = 1, nodes: list[str] | None = None, *,
                 name: str | None = None, host_restarts: int = 3, timeout: float = 60.0,
                 **buffer_kwargs: Any) -> None:
        refuse_main_reimport("ReplayCluster")  # a child re-running the script: no second cluster
        if not ray.is_initialized():
            raise RuntimeError("ReplayCluster needs a connected Ray: call ray.init() first")
        spec = spec if isinstance(spec, Spec) else Spec(spec)
        self.capacity_per_node = positive_int("capacity_per_node", capacity_per_node)
        self.lanes_per_node = positive_int("lanes_per_node", lanes_per_node)
        if isinstance(host_restarts, bool) or not isinstance(host_restarts, int) or host_restarts < 0:
            raise ValueError(f"host_restarts must be an int >= 0, got {host_restarts!r}")
        wait = timeout_seconds("timeout", timeout)
        alive = alive_node_ids()
        nodes = alive if nodes is None else list(nodes)
        missing = [n for n in nodes if n not in alive]
        if not nodes or missing or len(set(nodes)) != len(nodes):
            raise ValueError(
                f"nodes must list distinct live Ray node ids; got {nodes!r} (not alive: "
                f"{missing}). Live nodes: {alive}")
        self.tag = name if name is not None else secrets.token_hex(4)
        names = {n: self._segment_name(n) for n in nodes}
        super().__init__(names, spec)
        self.hosts: dict[str, Any] = {}
        self.host_restarts = host_restarts
        self._samplers: list[Any] = []
        self._groups: list[ClusterActors] = []
        self._closed = False
        self._dropped = 0  # hosts killed by drop_node
        self._all_nodes = list(nodes)  # every node a host ran on (close sweeps them)
        # (concurrency groups are fixed with the class: .options() cannot set them)
        self._host_cls = ray.remote(concurrency_groups={CONTROL: 1})(NodeHost)  # type: ignore[call-overload]
        self._buffer_kwargs = buffer_kwargs
        try:
            for node in nodes:
                self.hosts[node] = self._start_host(node)
            infos = ray.get([h.info.remote() for h in self.hosts.values()], timeout=wait)
        except BaseException:
            self.close(timeout=5.0)
            raise
        self.adopted = {i["node_id"]: i["adopted"] for i in infos}

    def _segment_name(self, node: str) -> str:
        return segment.normalize_name(f"{NAME_PREFIX}{self.tag}-{node[:16]}")

    def _start_host(self, node: str) -> Any:
        return self._host_cls.options(
            num_cpus=0, max_restarts=self.host_restarts, max_task_retries=0,
            **on_node(node)).remote(self._segment_name(node), self.spec, self.capacity_per_node,
                                    self.lanes_per_node, self._buffer_kwargs)

    def add_node(self, node_id: str, timeout: float = 60.0) -> dict[str, Any]:
        """Take in a Ray node that joined after the cluster was made, e.g. a machine that came
        back (a new Ray node id, an empty /dev/shm): a host starts there with a new buffer (or
        re-adopts one a dead host of this cluster left there), and every open sampler of the
        cluster draws from it from its next batch on (``ClusterSampler.add_node``). It is a
        call, never automatic: a cluster does not take nodes it was not given. Start actors
        there with ``cluster.actors(fn, nodes=[node_id])``. Returns the host's ``info()``.

        Raises:
            ValueError: ``node_id`` is not a live Ray node, or has a host of this cluster.
            ClosedError: the cluster is closed.
            ray.exceptions.GetTimeoutError: the host did not start within ``timeout``.
        """
        self._check_open()
        wait = timeout_seconds("timeout", timeout)
        alive = alive_node_ids()
        if node_id not in alive or node_id in self.hosts:
            raise ValueError(
                f"node_id must be a live Ray node without a host of this cluster; got "
                f"{node_id!r} ({'has a host' if node_id in self.hosts else 'not alive'}). "
                f"Live nodes without one: {[n for n in alive if n not in self.hosts]}")
        host = self._start_host(node_id)
        try:
            info = ray.get(host.info.remote(), timeout=wait)
        except BaseException:
            try:
                ray.kill(host, no_restart=True)
            except Exception:  # noqa: BLE001 - never started
                pass
            raise
        self.hosts[node_id] = host
        self.buffer_names[node_id] = self._segment_name(node_id)
        self._all_nodes.append(node_id)
        self.adopted[node_id] = info["adopted"]
        for sampler in self._samplers:
            if not sampler.closed:
                sampler.add_node(node_id)
        return info

    # -- learner side ------------------------------------------------------------------------------
    def sampler(self, batch_size: int, **kwargs: Any) -> Any:
        """A ``ClusterSampler`` over every node's rows (see its arguments)."""
        self._check_open()
        sampler = ClusterSampler(self, batch_size, **kwargs)
        self._samplers.append(sampler)
        return sampler

    def actors(self, actor_fn: Any, per_node: int = 1, **kwargs: Any) -> ClusterActors:
        """``ClusterActors`` running ``actor_fn`` on every node (stopped by ``close()``)."""
        self._check_open()
        group = ClusterActors(self, actor_fn, per_node, **kwargs)
        self._groups.append(group)
        return group

    def info(self, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
        """Each live host's ``info()`` (node, pid, segment, adopted, size), by node id."""
        refs = {n: h.info.remote() for n, h in self.hosts.items()}
        out = {}
        for node, ref in refs.items():
            try:
                out[node] = ray.get(ref, timeout=timeout)
            except ray.exceptions.RayError:
                continue
        return out

    def __len__(self) -> int:
        return sum(i["size"] for i in self.info().values())

    def drop_node(self, node_id: str) -> None:
        """Forget a node (the sampler calls it when a node is lost): its host is killed."""
        host = self.hosts.pop(node_id, None)
        self.buffer_names.pop(node_id, None)
        if host is not None:
            self._dropped += 1  # close() waits for its segments (on a node still alive)
            try:
                ray.kill(host, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    # -- teardown --------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the ReplayCluster is closed")

    def close(self, timeout: float = 10.0) -> None:
        """Close samplers, then every host (each unlinks its node's buffer), then remove what
        hosts of this cluster leaked on each live node (``remove_leaked``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for group in self._groups:
            group.stop()
        for sampler in self._samplers:
            sampler.close()
        refs = {n: h.close.remote(timeout=min(timeout, 5.0)) for n, h in self.hosts.items()}
        deadline = time.monotonic() + timeout
        unclosed = 0
        for node, ref in refs.items():
            try:
                ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - a dead host: its segment is cleaned below
                unclosed += 1
                warnings.warn(f"host on node {node[:12]} did not close: {type(e).__name__}",
                              RuntimeWarning, stacklevel=2)
        for host in self.hosts.values():
            try:
                ray.kill(host, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        detach_all(f"{NAME_PREFIX}{self.tag}-")
        # A host killed above (it did not close in time) or dropped by a sampler leaves its
        # segments on its node once its process has exited, which ray.kill does not wait for:
        # each node that is still alive removes them there, within the timeout (a lost
        # machine's went with it). Only a node can see its own /dev/shm.
        wait = timeout if unclosed or self._dropped else 0.0
        self.remove_leaked(wait_s=wait, timeout=wait + timeout)

    def remove_leaked(self, wait_s: float = 0.0, timeout: float = 30.0) -> list[str]:
        """Unlink what dead hosts of this cluster left (a node's buffer and pools, when its
        host died holding them): a Ray task on every live node this cluster has had a host on
        sweeps that node's /dev/shm (waiting up to ``wait_s`` for owners still exiting), and
        this process sweeps its own machine's. Returns the names removed; a node that does
        not answer within ``timeout`` is skipped with a ``RuntimeWarning``."""
        prefix = f"{NAME_PREFIX}{self.tag}-"
        alive = set(alive_node_ids())
        refs = {n: _sweep_task.options(**on_node(n)).remote(prefix, wait_s)
                for n in self._all_nodes if n in alive}
        removed = remove_leaked_segments(prefix)
        deadline = time.monotonic() + timeout
        for node, ref in refs.items():
            try:
                got, left = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - a node lost meanwhile, or too slow
                warnings.warn(f"could not sweep node {node[:12]}'s /dev/shm: "
                              f"{type(e).__name__}", RuntimeWarning, stacklevel=2)
                continue
            removed += got
            if left:
                warnings.warn(f"segments of this cluster left on node {node[:12]} (owners "
                              f"still alive after {wait_s}s): {left}", RuntimeWarning,
                              stacklevel=2)
        return sorted(set(removed))

    def __enter__(self) -> ReplayCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ReplayCluster {self.tag} nodes={[n[:8] for n in self.node_ids]}>"
