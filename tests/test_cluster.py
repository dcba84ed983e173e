"""``ReplayCluster`` on a 3-node Ray cluster (started once for the module; isolated nodes where
root allows: ``tests/test_cluster_isolated.py``): hosts on every
node, writers in Ray tasks attaching to their own node's buffer, and the learner's sampler
drawing uniformly over the union of the nodes' rows, never a torn or foreign row.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import shmbuf  # noqa: E402
from shmbuf import RateLimit  # noqa: E402
from tests import cluster_procs as cp  # noqa: E402
from tests._helpers.netns_cluster import local_unless_isolated  # noqa: E402
from tests.test_prioritized import chi_square_p  # noqa: E402
from workers.cluster import NoHostOnNodeError, ReplayCluster, on_node  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240), local_unless_isolated]

LANES = 2


@pytest.fixture(scope="module")
def filled(nodes):
    """A cluster over the 3 nodes holding 150 / 450 / 900 rows (node 0 is the learner's)."""
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=600, lanes_per_node=LANES,
                       nodes=nodes) as cluster:
        sizes = [150, 450, 900]
        refs = []
        for k, node in enumerate(cluster.node_ids):
            per_lane = sizes[k] // LANES
            refs += [cp.write_rows.options(**cluster.on_node(node)).remote(
                cluster, k, LANES, per_lane, lane) for lane in range(LANES)]
        done = ray.get(refs, timeout=60)
        assert [d[0] for d in done] == [n for n in cluster.node_ids for _ in range(LANES)]
        yield cluster, sizes


def test_writers_write_their_own_nodes_buffer(filled):
    cluster, sizes = filled
    info = cluster.info()
    assert [info[n]["size"] for n in cluster.node_ids] == sizes
    assert len(set(cluster.buffer_names.values())) == 3
    for node, name in cluster.buffer_names.items():
        assert node[:16] in name and cluster.tag in name  # names carry the node id
    assert len(cluster) == sum(sizes)


def test_batches_are_uniform_over_the_union_and_never_foreign(filled):
    cluster, sizes = filled
    counts = np.zeros(3, np.int64)
    per_row: dict[tuple[int, int, int], int] = {}
    with cluster.sampler(64, rows_per_call=96, seed=1, timeout=60) as sampler:
        assert sampler.node_ids == cluster.node_ids
        for _ in range(400):
            batch = sampler.next()
            bad = cp.bad_rows(batch, LANES)
            assert not bad.any(), f"{bad.sum()} torn or foreign rows"
            counts += np.bincount(batch.nodes, minlength=3)
            keys = np.stack([batch.nodes, batch.lanes, batch.indices], 1)
            for key in map(tuple, keys.tolist()):
                per_row[key] = per_row.get(key, 0) + 1
        st = sampler.stats()
    total = sum(sizes)
    # Each node's share of the rows follows its share of the data...
    assert chi_square_p(counts, np.array(sizes) / total) > 1e-4, counts
    # ... and every one of the 1,500 rows is equally likely.
    assert len(per_row) <= total
    row_counts = np.array(list(per_row.values()) + [0] * (total - len(per_row)))
    assert chi_square_p(row_counts, np.full(total, 1 / total)) > 1e-4
    local, *remote = st["nodes"]
    assert local["local"] and not any(n["local"] for n in remote)
    assert local["bytes_received"] == 0 and all(n["bytes_received"] > 0 for n in remote)
    # Several batches' rows per call: far fewer calls than batches.
    assert all(n["calls"] < 400 / 2 for n in remote), st


def test_remote_rows_arrive_in_calls_of_many_rows_and_are_prefetched(filled):
    cluster, _ = filled
    with cluster.sampler(32, rows_per_call=512, prefetch_calls=2, seed=2) as sampler:
        for _ in range(60):
            sampler.next()
        st = sampler.stats()
    for n in st["nodes"][1:]:
        assert n["calls"] <= 60 * 32 // 512 + 3, n  # rows per call >> a batch's share


def test_min_size_holds_over_the_cluster(filled):
    cluster, sizes = filled
    with cluster.sampler(16, limit=RateLimit(sum(sizes) + 1), timeout=60) as sampler:
        with pytest.raises(shmbuf.Timeout, match="min_size"):
            sampler.next(timeout=1.5)
    with cluster.sampler(16, limit=RateLimit(sum(sizes)), timeout=60) as sampler:
        assert sampler.next().batch_size == 16  # the union is big enough, no node alone is


def test_samples_per_insert_holds_over_the_cluster(filled):
    cluster, sizes = filled
    ratio, tol = 2.0, 64.0
    with cluster.sampler(16, limit=RateLimit(100, ratio, tol)) as sampler:
        sampler.next()  # the first batch waits for the pools to start
        taken = 16
        with pytest.raises(shmbuf.RateLimitTimeout):
            while True:
                sampler.next(timeout=1.0)
                taken += 16
        # min_size*ratio + tolerance of head room, counted over every node's inserts.
        assert (taken - 16) <= sum(sizes) * ratio - 100 * ratio + tol < taken + 16
    assert taken > sum(sizes)  # more than one node's inserts would have allowed


def test_batch_is_valid_until_the_next(filled):
    cluster, _ = filled
    with cluster.sampler(8) as sampler:
        first = sampler.next()
        kept = first.copy()
        assert set(kept) >= {"nodes", "indices", "lanes", "weights", "payload"}
        sampler.next()
        with pytest.raises(shmbuf.ClosedError):
            first["payload"]
    with pytest.raises(shmbuf.ClosedError):
        sampler.next()


def test_writer_on_a_node_without_host_is_a_typed_error(nodes):
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=16, nodes=nodes[:2]) as cluster:
        err = ray.get(cp.writer_node_error.options(**on_node(nodes[2])).remote(cluster),
                      timeout=60)
        assert err.startswith("NoHostOnNodeError") and nodes[2] in err
        assert ray.get(cp.writer_node_error.options(**cluster.on_node(nodes[1])).remote(
            cluster), timeout=60) == ""
        with pytest.raises(NoHostOnNodeError):
            cluster.on_node(nodes[2])


def test_bad_arguments_are_refused_before_anything_starts(nodes):
    with pytest.raises(ValueError, match="nodes"):
        ReplayCluster(cp.ROWS.fields, capacity_per_node=16, nodes=["nope"])
    with pytest.raises(ValueError, match="capacity_per_node"):
        ReplayCluster(cp.ROWS.fields, capacity_per_node=0)
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=16, nodes=nodes[:1]) as cluster:
        with pytest.raises(ValueError, match="batch_size"):
            cluster.sampler(0)
        with pytest.raises(ValueError, match="not in the spec"):
            cluster.sampler(4, fields=["nope"])


def test_a_reopened_cluster_name_adopts_nothing_after_close(nodes):
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=16, nodes=nodes[:1],
                       name="reuse") as cluster:
        ray.get(cp.write_rows.options(**cluster.on_node(nodes[0])).remote(cluster, 0, 1, 5),
                timeout=60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ReplayCluster(cp.ROWS.fields, capacity_per_node=16, nodes=nodes[:1],
                           name="reuse") as cluster:
            assert cluster.adopted == {nodes[0]: False} and len(cluster) == 0
