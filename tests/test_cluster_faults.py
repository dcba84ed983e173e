"""Faults of a ``ReplayCluster`` on a local Ray cluster (started once for the module): an actor
SIGKILLed (restarted by Ray, its lane taken over), a host actor SIGKILLed (restarted; it
re-adopts its node's segment and no row is lost), a node removed (dropped with a warning, or a
typed error when strict). The learner never sees a torn or foreign row, nothing hangs.
"""

from __future__ import annotations

import os
import signal
import time
import warnings

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import shmbuf  # noqa: E402
from tests import cluster_procs as cp  # noqa: E402
from tests._helpers.rows import ShiftedBatches  # noqa: E402
from workers.cluster import (  # noqa: E402
    HostRestartedWarning,
    NodeLostError,
    NodeLostWarning,
    ReplayCluster,
    current_node_id,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

LANES = 2


@pytest.fixture(scope="module")
def ray_nodes():
    with cp.local_ray_cluster(3) as cluster_utils:
        ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        here = current_node_id()
        yield cluster_utils, [here] + [n for n in ids if n != here]


def row_actor(node_ids: list[str]):
    """An actor function writing self-checking rows (global lanes) at a gentle pace."""

    def actor(ctx) -> None:
        k = node_ids.index(ctx.node_id)
        rows = ShiftedBatches(cp.ROWS, cp.global_lane(k, ctx.lane, LANES), 32)
        i = int(ctx.buffer.committed(ctx.lane))
        while not ctx.stopping:
            ctx.writer.extend(rows.make(i, 32))
            i += 32
            time.sleep(0.005)

    return actor


def failing_actor(ctx) -> None:
    raise RuntimeError(f"actor {ctx.actor_id} incarnation {ctx.incarnation} fails")


def sample_checked(sampler, n: int) -> np.ndarray:
    """Take ``n`` batches, fail on any torn or foreign row; rows per node index."""
    counts = np.zeros(len(sampler.node_ids), np.int64)
    for _ in range(n):
        batch = sampler.next()
        bad = cp.bad_rows(batch, LANES)
        assert not bad.any(), f"{bad.sum()} torn or foreign rows"
        counts += np.bincount(batch.nodes, minlength=len(counts))
    return counts


def test_killed_actor_is_restarted_and_takes_its_lane_over(ray_nodes):
    _, nodes = ray_nodes
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=4096, lanes_per_node=LANES,
                       nodes=nodes) as cluster:
        group = cluster.actors(row_actor(cluster.node_ids), per_node=1, max_restarts=2)
        cp.wait_for(lambda: min(i["size"] for i in cluster.info().values()) >= 100, 60,
                    "rows on every node")
        with cluster.sampler(32, seed=3) as sampler:
            assert sample_checked(sampler, 20).min() > 0  # every node serves rows
            victim = 1  # the actor on a remote node
            pid = group.pids()[victim]
            before = cluster.info()[nodes[1]]["committed"]
            os.kill(pid, signal.SIGKILL)
            cp.wait_for(lambda: (group.poll(), group.restarts)[1] == 1, 60, "the restart")
            cp.wait_for(lambda: group.pids(timeout=2.0)[victim] not in (None, pid), 60,
                        "the new actor process")
            cp.wait_for(lambda: cluster.info()[nodes[1]]["committed"] > before + 64, 60,
                        "the restarted actor to write")
            sample_checked(sampler, 30)
        group.poll()
        assert group.restarts == 1 and group.lost == 0
        group.stop()


def test_actor_that_keeps_raising_is_reported_with_its_traceback(ray_nodes):
    _, nodes = ray_nodes
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=16, lanes_per_node=1,
                       nodes=nodes[1:2]) as cluster:
        group = cluster.actors(failing_actor, max_restarts=1)
        with pytest.raises(shmbuf.ActorError, match="incarnation 1 fails"):
            cp.wait_for(lambda: group.poll(), 60, "the actor error")
        assert group.restarts == 1


def test_killed_host_is_restarted_and_readopts_its_segment(ray_nodes):
    _, nodes = ray_nodes
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=600, lanes_per_node=LANES,
                       nodes=nodes, host_restarts=1) as cluster:
        sizes = [200, 400, 600]
        ray.get([cp.write_rows.options(**cluster.on_node(n)).remote(cluster, k, LANES, sizes[k])
                 for k, n in enumerate(cluster.node_ids)], timeout=60)
        with cluster.sampler(32, seed=4, timeout=90) as sampler:
            sample_checked(sampler, 10)
            old = cluster.info()[nodes[2]]
            os.kill(old["pid"], signal.SIGKILL)
            with pytest.warns(HostRestartedWarning, match="re-adopted"):
                counts = np.zeros(3, np.int64)
                while sampler.stats()["nodes"][2]["host_restarts"] == 0 or counts[2] < 200:
                    counts += sample_checked(sampler, 10)
            new = cluster.info()[nodes[2]]
            assert new["pid"] != old["pid"] and new["adopted"] and new["name"] == old["name"]
            assert new["size"] == new["committed"] == 600  # no row lost
            assert sampler.stats()["dropped"] == []
        # Writers attach to the same segment and go on where the lanes stopped.
        ray.get(cp.write_rows.options(**cluster.on_node(nodes[2])).remote(
            cluster, 2, LANES, 10, 0), timeout=60)
        assert cluster.info()[nodes[2]]["committed"] == 610


@pytest.mark.parametrize("strict", [False, True])
def test_removed_node_is_dropped_or_raises_when_strict(ray_nodes, strict):
    cluster_utils, nodes = ray_nodes
    extra = cluster_utils.add_node(**cp.NODE_ARGS)
    cluster_utils.wait_for_nodes(timeout=60)
    pair = [nodes[0], extra.node_id]
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=512, lanes_per_node=LANES,
                       nodes=pair) as cluster:
        ray.get([cp.write_rows.options(**cluster.on_node(n)).remote(cluster, k, LANES, 300)
                 for k, n in enumerate(pair)], timeout=60)
        group = cluster.actors(row_actor(pair), per_node=1, nodes=[extra.node_id],
                               strict=strict)
        with cluster.sampler(32, seed=5, timeout=90, strict=strict, rows_per_call=64,
                             prefetch_calls=2) as sampler:
            assert sample_checked(sampler, 10)[1] > 0
            cluster_utils.remove_node(extra, allow_graceful=False)
            if strict:
                # Ray notices a killed node within its health-check period, not within a fixed
                # number of batches (prefetched rows of the lost node may still come first).
                deadline = time.monotonic() + 90
                with pytest.raises(NodeLostError, match=extra.node_id[:12]):
                    while time.monotonic() < deadline:
                        sample_checked(sampler, 5)
                with pytest.raises(NodeLostError):
                    cp.wait_for(lambda: group.poll(), 60, "the lost actor")
                return
            with pytest.warns(NodeLostWarning):
                while extra.node_id not in sampler.stats()["dropped"]:
                    sample_checked(sampler, 5)
            assert sample_checked(sampler, 20)[1] == 0  # only the live node's rows now
            with pytest.warns(NodeLostWarning):
                cp.wait_for(lambda: (group.poll(), group.lost)[1] == 1, 60, "the lost actor")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cluster.close()
