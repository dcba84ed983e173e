"""Prioritized and queue sampling across the nodes of a ``ReplayCluster`` (a 3-node Ray
cluster, started once for the module; isolated nodes where root allows): draws in proportion to
priorities over the union, with importance weights against the smallest priority of all nodes
and updates routed to each row's node; the queue delivers every row of every node exactly
once, through actor and host SIGKILLs.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import shmbuf  # noqa: E402
from tests import cluster_procs as cp  # noqa: E402
from tests._helpers.netns_cluster import local_unless_isolated  # noqa: E402
from tests.test_prioritized import chi_square_p  # noqa: E402
from workers.cluster import HostRestartedWarning, ReplayCluster  # noqa: E402
from workers.selection import Prioritized, Queue  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300), local_unless_isolated]

LANES = 2


def priority_of(node: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The test's priorities: node k's rows weigh (k+1) * (1, 2 or 3 by index % 3)."""
    return (node + 1.0) * (1.0 + index % 3)


def test_prioritized_draws_follow_priorities_over_the_union(nodes):
    rows_per_node = [300, 150, 60]  # the smallest node has the largest priorities
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=300, lanes_per_node=1,
                       nodes=nodes) as cluster:
        ray.get([cp.write_rows.options(**cluster.on_node(n)).remote(cluster, k, 1,
                                                                     rows_per_node[k], 0)
                 for k, n in enumerate(cluster.node_ids)], timeout=60)
        beta = 0.7
        with cluster.sampler(64, selection=Prioritized(alpha=1.0, beta=beta, eps=0.0),
                             rows_per_call=64, prefetch_calls=2, seed=6) as sampler:
            batch = sampler.next()
            with pytest.raises(shmbuf.InvalidPriorityError):
                sampler.update_priorities(batch.indices, np.full(64, np.nan))
            # Every row of every node gets its priority, each routed to its node.
            nd = np.concatenate([np.full(n, k) for k, n in enumerate(rows_per_node)])
            idx = np.concatenate([np.arange(n) for n in rows_per_node])
            sent = sampler.update_priorities(idx, priority_of(nd, idx), lanes=np.zeros_like(idx),
                                             nodes=nd)
            assert sent == idx.size
            time.sleep(1.0)
            for _ in range(30):  # batches drawn before the update was applied
                sampler.next()
            cells = np.zeros((3, 3), np.int64)
            p_min = priority_of(np.array([0]), np.array([0]))[0]
            stale = 0
            for _ in range(300):
                batch = sampler.next()
                assert not cp.bad_rows(batch, 1).any()
                p = priority_of(batch.nodes, batch.indices)
                fresh = np.isclose(batch.weights, (p / p_min) ** -beta, rtol=1e-5)
                # A node pool's prefetched slots drawn before the update reached it (a rarely
                # drawn node can still hold some after the drain above) carry the initial
                # priority, which is also the smallest one then: weight exactly 1. Nothing else.
                np.testing.assert_array_equal(batch.weights[~fresh], 1.0)
                stale += int((~fresh).sum())
                np.add.at(cells, (batch.nodes[fresh], batch.indices[fresh] % 3), 1)
            assert stale <= 64 * 16, stale  # a few prefetched slots' worth, not a trend
            assert sampler.stats()["priority_updates_sent"] == idx.size
    mass = np.array([[priority_of(np.array(k), np.arange(n))[np.arange(n) % 3 == c].sum()
                      for c in range(3)] for k, n in enumerate(rows_per_node)])
    assert chi_square_p(cells.ravel(), (mass / mass.sum()).ravel()) > 1e-4, cells


def queue_actor(node_ids: list[str], rows_per_lane: int):
    """Writes rows 0..rows_per_lane-1 of its lane (16 at a time, for about 1.5 s), then ends;
    a restarted one goes on from the lane's committed count."""

    def actor(ctx) -> None:
        k = node_ids.index(ctx.node_id)
        g = cp.global_lane(k, ctx.lane, LANES)
        i = int(ctx.buffer.committed(ctx.lane))
        while i < rows_per_lane and not ctx.stopping:
            n = min(16, rows_per_lane - i)
            ctx.writer.extend(cp.ROWS.batch(g, np.arange(i, i + n)))
            i += n
            time.sleep(0.025)

    return actor


@pytest.mark.parametrize("kill", ["actor", "host"])
def test_queue_delivers_every_row_of_every_node_exactly_once(nodes, kill):
    rows_per_lane, batch_size = 960, 32
    total = rows_per_lane * LANES * len(nodes)
    seen: dict[tuple[int, int, int], int] = {}
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=1024, lanes_per_node=LANES,
                       nodes=nodes) as cluster:
        group = cluster.actors(queue_actor(cluster.node_ids, rows_per_lane), per_node=LANES,
                               max_restarts=2)
        with cluster.sampler(batch_size, selection=Queue(), seed=7, timeout=60) as sampler:
            for b in range(total // batch_size):
                batch = sampler.next()
                assert not cp.bad_rows(batch, LANES).any()
                for key in zip(batch.nodes.tolist(), batch.lanes.tolist(),
                               batch.indices.tolist()):
                    seen[key] = seen.get(key, 0) + 1
                if b == 2 and kill == "actor":  # while it writes
                    os.kill(group.pids()[LANES + 1], signal.SIGKILL)  # node 1, lane 1
                if b == 10 and kill == "host":
                    with pytest.warns(HostRestartedWarning):
                        os.kill(cluster.info()[nodes[2]]["pid"], signal.SIGKILL)
                        while sampler.stats()["nodes"][2]["host_restarts"] == 0:
                            batch = sampler.next()
                            for key in zip(batch.nodes.tolist(), batch.lanes.tolist(),
                                           batch.indices.tolist()):
                                seen[key] = seen.get(key, 0) + 1
                if len(seen) == total:
                    break
                group.poll()
            st = sampler.stats()
        want = 1 if kill == "actor" else 0  # counted from the restarted process's own answer,
        cp.wait_for(lambda: (group.poll(), group.restarts)[1] >= want, 30, "the restart count")
        assert group.restarts == want       # which may come after its lane's last rows
    expected = {(k, lane, i) for k in range(3) for lane in range(LANES)
                for i in range(rows_per_lane)}
    assert set(seen) == expected
    assert max(seen.values()) == 1, "a row was delivered twice"
    assert st["queue_gaps"] == 0
    if kill == "host":
        assert st["nodes"][2]["host_restarts"] == 1
