"""Faults of a ``ReplayCluster`` on a Ray cluster (started once for the module; isolated nodes
where root allows): an actor
SIGKILLed (restarted by Ray, its lane taken over), a host actor SIGKILLed (restarted; it
re-adopts its node's segment and no row is lost), a node removed (dropped with a warning, or a
typed error when strict), also when the sampler finds the loss while polling the nodes'
counts, and a node lost in the middle of a queue batch (the batch's rows are kept). The learner
never sees a torn or foreign row, nor the sampler's internal ``NodeLost``; nothing hangs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import shmbuf  # noqa: E402
from tests import cluster_procs as cp  # noqa: E402
from tests._helpers.netns_cluster import local_unless_isolated  # noqa: E402
from tests._helpers.rows import ShiftedBatches  # noqa: E402
from workers.cluster import (  # noqa: E402
    HostRestartedWarning,
    NodeLostError,
    NodeLostWarning,
    ReplayCluster,
)
from workers.cluster.nodes import node_alive  # noqa: E402
from workers.cluster.sources import NodeLost  # noqa: E402
from workers.selection import Queue  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240), local_unless_isolated]

LANES = 2


@pytest.fixture(scope="module")
def ray_nodes():
    """The cluster (``add_node``, ``remove_node``: on isolated nodes, a node is lost by killing
    every process in its namespace) and its node ids, the learner's first."""
    with cp.ray_cluster(3) as cluster_utils:
        yield cluster_utils, cp.live_nodes_learner_first()


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


@contextlib.contextmanager
def cluster_with_extra_node(ray_nodes, rows=(300, 300), lane=None):
    """A cluster over the learner's node and a node added for the test (one the test may
    lose), each holding ``rows`` self-checking rows (in ``lane``, or a free one):
    ``(cluster_utils, extra, [learner's node, extra's], cluster)``."""
    cluster_utils, nodes = ray_nodes
    extra = cluster_utils.add_node(**cp.NODE_ARGS)
    cluster_utils.wait_for_nodes(timeout=60)
    pair = [nodes[0], extra.node_id]
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=512, lanes_per_node=LANES,
                       nodes=pair) as cluster:
        ray.get([cp.write_rows.options(**cluster.on_node(n)).remote(cluster, k, LANES, r, lane)
                 for k, (n, r) in enumerate(zip(pair, rows))], timeout=60)
        yield cluster_utils, extra, pair, cluster


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
    with cluster_with_extra_node(ray_nodes) as (cluster_utils, extra, pair, cluster):
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


@pytest.mark.parametrize("strict", [False, True])
def test_node_lost_while_polling_counts_is_dropped_or_raises_when_strict(ray_nodes, strict):
    """``next()`` first polls every node's replies and counts; a node found lost there is
    dropped with ``NodeLostWarning`` (``NodeLostError`` when strict), never ``NodeLost``.

    Deterministic: a queue sampler drains the remote node, so its fetches wait on its host
    (``wait_s``) when the node is removed; once Ray has failed them, the next ``next()`` (more
    than ``POLL_EVERY_S`` later) polls before it takes any row and finds the loss there."""
    with cluster_with_extra_node(ray_nodes, rows=(256, 64), lane=0) as (
            cluster_utils, extra, pair, cluster):
        with cluster.sampler(32, selection=Queue(), seed=8, timeout=60, strict=strict,
                             prefetch_calls=2, wait_s=120.0) as sampler:
            deadline = time.monotonic() + 60
            while sampler.stats()["nodes"][1]["rows_sampled"] < 64:  # the remote node drained
                assert time.monotonic() < deadline, sampler.stats()
                assert not cp.bad_rows(sampler.next(), LANES).any()
            pending = cp.calls_in_flight(sampler, 1)
            assert pending, "the drained node's fetches wait on its host"
            ray.get(cp.write_rows.options(**cluster.on_node(pair[0])).remote(
                cluster, 0, LANES, 64, 1), timeout=60)  # rows for the batches after the loss
            cluster_utils.remove_node(extra, allow_graceful=False)
            cp.wait_for(lambda: not node_alive(extra.node_id), 90, "Ray to see the node dead")
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=90)
            assert len(done) == len(pending), "the calls to the lost host failed"
            if strict:
                with pytest.raises(NodeLostError, match=extra.node_id[:12]):
                    sampler.next()
            else:
                with pytest.warns(NodeLostWarning, match=extra.node_id[:12]):
                    batch = sampler.next()
                assert sampler.stats()["dropped"] == [extra.node_id]
                assert not cp.bad_rows(batch, LANES).any() and (batch.nodes == 0).all()
                assert not cp.bad_rows(sampler.next(), LANES).any()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cluster.close()


def test_queue_batch_keeps_its_rows_when_a_node_is_lost_in_it(ray_nodes):
    """A node found lost while a queue batch is half filled is dropped there: the rows already
    copied into the batch are delivered, so every node's rows still come once, oldest first,
    without a hole (a retried batch would drop them: they were taken from their chunks).

    The loss is injected at the node's source (``next_chunk`` raises the sampler's own
    ``NodeLost``) at the moment it matters: after some of the local node's rows went into the
    batch. A batch of 8 chunks (128 rows of 16) makes that moment come in every batch that
    takes local rows: the queue visits the nodes in turn, so the remote source is asked again
    within two chunks of the first local one, even when its own chunks come late (a batch of
    2 chunks could be filled by the local node alone, pass after pass)."""
    _, nodes = ray_nodes
    pair = nodes[:2]
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=1024, lanes_per_node=LANES,
                       nodes=pair) as cluster:
        ray.get([cp.write_rows.options(**cluster.on_node(n)).remote(cluster, k, LANES, 512, 0)
                 for k, n in enumerate(pair)], timeout=60)
        with cluster.sampler(128, selection=Queue(), seed=9, timeout=30,
                             rows_per_call=16) as sampler:
            remote = sampler._sources[1]
            remote_chunk = remote.next_chunk
            state = {"local_before": 0, "fired": 0}

            def remote_next_chunk(wait):
                if sampler.rows_from[0] > state["local_before"]:  # local rows in this batch
                    state["fired"] += 1
                    raise NodeLost(pair[1], f"node {pair[1][:12]} is gone (injected)")
                return remote_chunk(wait)

            remote.next_chunk = remote_next_chunk
            local_rows: list[int] = []
            with pytest.warns(NodeLostWarning, match="injected"):
                for _ in range(6):
                    state["local_before"] = int(sampler.rows_from[0])
                    batch = sampler.next()
                    assert not cp.bad_rows(batch, LANES).any()
                    local_rows += batch.indices[batch.nodes == 0].tolist()
                    if state["fired"] and len(local_rows) >= 160:
                        break
            assert state["fired"] == 1 and sampler.stats()["dropped"] == [pair[1]]
            # Lane 0 of the local node, oldest first: every row once, no hole.
            assert sorted(local_rows) == list(range(len(local_rows))), local_rows
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cluster.close()


def test_a_node_that_comes_back_is_taken_in_with_a_new_buffer(ray_nodes):
    """A node lost and started again (on isolated nodes: in the same namespace, with an empty
    /dev/shm) is a new Ray node: ``cluster.add_node`` starts a host there with a new buffer,
    the running sampler draws from it (a new index in ``node_ids``), and actors start there
    again; no row is torn or foreign."""
    with cluster_with_extra_node(ray_nodes) as (cluster_utils, extra, pair, cluster):
        with cluster.sampler(32, seed=10, timeout=90, rows_per_call=64,
                             prefetch_calls=2) as sampler:
            assert sample_checked(sampler, 10)[1] > 0
            cluster_utils.remove_node(extra, allow_graceful=False)
            with pytest.warns(NodeLostWarning):
                while extra.node_id not in sampler.stats()["dropped"]:
                    sample_checked(sampler, 5)
            back = cluster_utils.add_node(**cp.NODE_ARGS)
            cluster_utils.wait_for_nodes(timeout=60)
            assert back.node_id not in pair  # a new Ray node
            with pytest.raises(ValueError, match="has a host"):
                cluster.add_node(pair[0])
            info = cluster.add_node(back.node_id)
            assert not info["adopted"] and info["size"] == 0  # a new, empty buffer
            assert sampler.node_ids == [*pair, back.node_id]
            group = cluster.actors(row_actor(sampler.node_ids), per_node=1,
                                   nodes=[back.node_id])
            counts = np.zeros(3, np.int64)
            deadline = time.monotonic() + 90
            while counts[2] < 64:  # rows of the new node's actor, drawn by the same sampler
                assert time.monotonic() < deadline, counts
                counts += sample_checked(sampler, 5)
                group.poll()
            assert counts[1] == 0  # the lost node's rows never come back
            group.stop()
        cluster_utils.remove_node(back, allow_graceful=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cluster.close()


def test_close_removes_what_a_dead_host_left_on_its_own_node(ray_nodes):
    """A host SIGKILLed for good (no restarts) leaves its node's buffer in *that node's*
    /dev/shm (on isolated nodes nobody else sees it): ``close()`` sweeps every live node on the
    node itself, so it is gone afterwards."""
    _, nodes = ray_nodes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dead host did not close
        cluster = ReplayCluster(cp.ROWS.fields, capacity_per_node=64, lanes_per_node=1,
                                nodes=nodes, host_restarts=0)
        try:
            node, name = nodes[2], cluster.buffer_names[nodes[2]]
            ray.get(cp.write_rows.options(**cluster.on_node(node)).remote(cluster, 2, 1, 10),
                    timeout=60)
            os.kill(cluster.info()[node]["pid"], signal.SIGKILL)
            cp.wait_for(lambda: node not in cluster.info(timeout=2.0), 60, "the host's death")
            on_it = cp.segments_here.options(**cluster.on_node(node))
            assert ray.get(on_it.remote(name), timeout=60) == [name]  # left behind
        finally:
            cluster.close()
    assert ray.get(on_it.remote(name), timeout=60) == []
