"""A multi-node Ray cluster for the tests of ``workers.cluster`` (a local
``ray.cluster_utils.Cluster``, or, in a test module that ``tests/test_cluster_isolated.py`` runs
inside an isolated head node, those isolated nodes: ``tests/_helpers/netns_cluster.py``), and
the Ray tasks and actors that write self-checking rows on a chosen node.

Rows follow ``tests/_helpers/rows.py``; the row's ``lane`` field holds a *global* lane,
``node_index * lanes_per_node + lane``, so a learner can tell a row of another node (a foreign
row) from one of the node it was drawn from, besides a torn or stale one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster

from shmbuf import scan as segment_scan
from shmbuf import shmdir
from tests._helpers.processes import descendants, kill_quietly, wait_dead
from tests._helpers.rows import RowScheme, ShiftedBatches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = RowScheme(payload_words=8)
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 128 << 20}


@contextlib.contextmanager
def learner_first_nodes(n_nodes: int) -> Iterator[list[str]]:
    """``ray_cluster(n_nodes)``, yielding its live node ids, the learner's (this process's)
    node first."""
    with ray_cluster(n_nodes):
        yield live_nodes_learner_first()


def live_nodes_learner_first() -> list[str]:
    from workers.cluster import current_node_id

    ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    here = current_node_id()
    return [here] + [n for n in ids if n != here]


@contextlib.contextmanager
def ray_cluster(n_nodes: int) -> Iterator[Any]:
    """A connected Ray cluster of ``n_nodes`` nodes with ``add_node``, ``remove_node`` and
    ``wait_for_nodes``: the isolated nodes this process runs in (``netns_cluster.inside()``),
    else a local one (``local_ray_cluster``)."""
    from tests._helpers import netns_cluster

    if not netns_cluster.inside():
        with local_ray_cluster(n_nodes) as cluster:
            yield cluster
        return
    with isolated_ray_cluster(n_nodes) as cluster:
        yield cluster


@contextlib.contextmanager
def isolated_ray_cluster(n_nodes: int) -> Iterator[Any]:
    """Connect to the isolated nodes this process runs in (the learner on the head); on exit
    lose the nodes a test added and left, disconnect, and check that no live node's /dev/shm
    holds a segment of a cluster (each node's own /dev/shm, seen from inside it)."""
    from tests._helpers import netns_cluster
    from workers.cluster import netns

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT,
                                                         signal.SIGHUP)}
    node_set = netns_cluster.IsolatedNodeSet()
    running = [n for n in node_set.nodes.nodes if n.node_id]
    assert len(running) == n_nodes, f"the isolated cluster runs {len(running)} nodes, not {n_nodes}"
    netns.connect(runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        node_set.wait_for_nodes(timeout=60)
        yield node_set
    finally:
        try:
            node_set.lose_added()
        finally:
            ray.shutdown()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    left = {k: [e for e in names if e.startswith("shmbuf-")]
            for k, names in _wait_for_empty_shm(node_set).items()}
    assert not any(left.values()), f"shmbuf segments left on the isolated nodes: {left}"


def _wait_for_empty_shm(node_set: Any, timeout: float = 30.0) -> dict[int, list[str]]:
    """Each live node's /dev/shm once no shmbuf entry is left in it (the hosts' pools exit
    after the driver), or as it stands at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        shm = node_set.shm_of_live_nodes()
        if not any(e.startswith("shmbuf-") for names in shm.values() for e in names) or \
                time.monotonic() >= deadline:
            return shm
        time.sleep(0.2)


@contextlib.contextmanager
def local_ray_cluster(n_nodes: int) -> Iterator[Cluster]:
    """Start ``n_nodes`` Ray nodes on this machine and connect; on exit shut all of it down and
    check that no process of it is left and no cluster segment is left in /dev/shm."""
    mine_before = set(descendants(os.getpid()))
    # Other sessions on this machine may run clusters too: only segments that appear while
    # this one runs are its own to check and remove.
    others = {i.name for i in segment_scan.scan() if i.name.startswith("shmbuf-ray-")}
    # ray.init puts its own SIGTERM handler in the driver and leaves it there: later tests fork
    # children that must inherit shmbuf's (tests/test_hardening_segment.py), so restore them.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT,
                                                         signal.SIGHUP)}
    cluster = Cluster(initialize_head=True, head_node_args=dict(NODE_ARGS))
    try:
        for _ in range(n_nodes - 1):
            cluster.add_node(**NODE_ARGS)
        cluster.wait_for_nodes(timeout=60)
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        stray = [p for p in descendants(os.getpid())
                 if p not in mine_before and not _multiprocessing_server(p)]
        left = wait_dead(stray, timeout=30.0)
        kill_quietly(left)
        shm = [i.name for i in segment_scan.scan()
               if i.name.startswith("shmbuf-ray-") and i.name not in others and not i.alive]
        for name in shm:
            shmdir.unlink(name)
    assert not left, f"Ray cluster processes still running after shutdown: {left}"
    assert not shm, f"cluster segments left in /dev/shm: {shm}"


def _multiprocessing_server(pid: int) -> bool:
    """The forkserver (and its resource tracker) that a pool of the learner started: it serves
    this process for its lifetime, as in every forkserver test."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return b"forkserver" in cmd or b"resource_tracker" in cmd


def global_lane(node_index: int, lane: int, lanes_per_node: int) -> int:
    return node_index * lanes_per_node + lane


@ray.remote(num_cpus=0)
def write_rows(client: Any, node_index: int, lanes_per_node: int, n: int,
               lane: int | None = None) -> tuple[str, int, int]:
    """Append ``n`` self-checking rows to a lane of this node's buffer; ``(node, lane, n)``."""
    with client.writer(lane=lane, timeout=10.0) as w:
        i0 = int(client.buffer().committed(w.lane))
        w.extend(ROWS.batch(global_lane(node_index, w.lane, lanes_per_node),
                            np.arange(i0, i0 + n)))
        return ray.get_runtime_context().get_node_id(), w.lane, n


@ray.remote(num_cpus=0)
def node_committed(client: Any, node_id: str) -> int:
    """Rows ever committed to ``node_id``'s buffer, read on that node (through its shared
    memory; a task, since no other node sees it): run it there with ``on_node``."""
    return int(client.buffer(node_id).committed().sum())


def committed_per_node(cluster: Any, timeout: float = 30.0) -> np.ndarray:
    """Rows committed on each node of ``cluster`` now, each read on its own node (works while
    a node's host is down: the buffer outlives it)."""
    from workers.cluster import on_node

    refs = [node_committed.options(**on_node(n)).remote(cluster.client(), n)
            for n in cluster.node_ids]
    return np.array(ray.get(refs, timeout=timeout), np.int64)


@ray.remote(num_cpus=0)
def segments_here(prefix: str) -> list[str]:
    """The /dev/shm entries starting with ``prefix`` on the node this task runs on."""
    return sorted(n for n in os.listdir(shmdir.SHM_DIR) if n.startswith(prefix))


@ray.remote(num_cpus=0)
def writer_node_error(client: Any) -> str:
    """Try ``client.writer()`` here; the error's type name (or "" if it worked)."""
    try:
        client.writer(timeout=1.0).close()
    except Exception as e:  # noqa: BLE001 - the test checks which
        return f"{type(e).__name__}: {e}"
    return ""


@ray.remote(num_cpus=0, max_concurrency=2)
class RowWriter:
    """Writes self-checking rows as fast as it can (``extend`` of ``chunk`` rows) on one lane of
    its node until ``stop()``; reports its pid, rows written and the waits on the rate limiter
    that ran out (``RateLimitTimeout``: the extend wrote nothing and is tried again)."""

    def __init__(self, client: Any, node_index: int, lanes_per_node: int) -> None:
        self.client, self.node_index, self.lanes = client, node_index, lanes_per_node
        self.stopping = False
        self.written = 0
        self.timeouts = 0

    def pid(self) -> int:
        return os.getpid()

    def run(self, chunk: int = 64, max_rows: int = 1 << 62, lane: int | None = None,
            insert_timeout: float = 10.0) -> int:
        from shmbuf.errors import ClosedError, RateLimitTimeout

        with self.client.writer(lane=lane, timeout=10.0, insert_timeout=insert_timeout) as w:
            w.stop_when = lambda: self.stopping  # a stop also ends a wait on the limiter
            rows = ShiftedBatches(ROWS, global_lane(self.node_index, w.lane, self.lanes), chunk)
            i = int(self.client.buffer().committed(w.lane))
            while not self.stopping and self.written < max_rows:
                try:
                    w.extend(rows.make(i, chunk))
                except RateLimitTimeout:
                    self.timeouts += 1
                    continue
                except ClosedError:
                    if self.stopping:
                        break
                    raise
                i += chunk
                self.written += chunk
        return self.written

    def progress(self) -> tuple[int, int]:
        """(rows written, rate-limiter waits that timed out)."""
        return self.written, self.timeouts

    def stop(self) -> int:
        self.stopping = True
        return self.written


def bad_rows(batch: Any, lanes_per_node: int) -> np.ndarray:
    """Rows of a ``ClusterBatch`` that are torn, stale, or not the (node, lane, index) drawn
    (``[B]``, or ``[B, T]``: every step of every window)."""
    idx = np.asarray(batch.indices)
    steps = idx.shape[1] if idx.ndim == 2 else 1
    rows = {k: np.asarray(batch[k]) for k in batch if k in ROWS.fields}
    rows = {k: v.reshape(idx.size, *v.shape[idx.ndim:]) for k, v in rows.items()}
    g = rows["lane"]
    bad = ROWS.bad_rows(rows, indices=idx.reshape(-1))
    bad |= (g // lanes_per_node) != np.repeat(batch.nodes, steps)
    bad |= (g % lanes_per_node) != np.repeat(batch.lanes, steps)
    return bad.reshape(idx.shape)


@ray.remote(num_cpus=0)
def write_episodes(client: Any, node_index: int, n: int, episode: int) -> int:
    """Rows 0 .. n-1 into lane 0 of this node's buffer (one lane per node), an episode ending
    after every ``episode`` of them."""
    with client.writer(lane=0, timeout=10.0) as w:
        for first in range(0, n, episode):
            w.extend(ROWS.batch(global_lane(node_index, 0, 1),
                                np.arange(first, min(first + episode, n))))
            w.end_episode()
    return n


def wait_for(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def calls_in_flight(sampler: Any, k: int) -> list[Any]:
    """The Ray refs of the fetches ``sampler`` has in flight to node ``k``'s host (a fault test
    waits until they have failed, so that the sampler's next look at the node finds it lost)."""
    return list(sampler._sources[k].inflight)
