"""Prioritized, queue and epoch sampling across the nodes of a ``ReplayCluster`` (a 3-node Ray
cluster, started once for the module; isolated nodes where root allows): draws in proportion to
priorities over the union, with importance weights against the smallest priority of all nodes
and updates routed to each row's node, for rows and for sequences' window starts (``[B, T]``
updates reduced as on one machine); the queue delivers every row of every node exactly once,
through actor and host SIGKILLs; epochs deliver every row of every node once per epoch, the
nodes interleaved, in a seeded order, with each remainder dropped, short or carried.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import shmbuf  # noqa: E402
from shmbuf.sampling import Plan  # noqa: E402
from shmbuf.window_priority import reduce_windows  # noqa: E402
from tests import cluster_procs as cp  # noqa: E402
from tests._helpers.netns_cluster import local_unless_isolated  # noqa: E402
from tests.test_prioritized import chi_square_p  # noqa: E402
from workers.cluster import HostRestartedWarning, ReplayCluster  # noqa: E402
from workers.cluster.batch import window_updates  # noqa: E402
from workers.selection import Epoch, Prioritized, Queue  # noqa: E402

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


# -- epochs ---------------------------------------------------------------------------------------
EPOCH_ROWS = [150, 90, 40]  # per node, one lane each: 280 rows, 8 whole batches of 32 and 24 over


@pytest.fixture(scope="module")
def epoch_cluster(nodes):
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=200, lanes_per_node=1,
                       nodes=nodes) as cluster:
        ray.get([cp.write_rows.options(**cluster.on_node(n)).remote(cluster, k, 1,
                                                                     EPOCH_ROWS[k], 0)
                 for k, n in enumerate(cluster.node_ids)], timeout=60)
        yield cluster


def epoch_rows(sampler, epochs: int, shapes: list | None = None) -> list[list[tuple[int, int]]]:
    """The (node, index) of every row of the next ``epochs`` epochs, batch by batch checked:
    whole, of the node it names, and of the epoch it says; each batch's (rows, ends_epoch)
    appended to ``shapes`` per epoch."""
    out = []
    for e in range(epochs):
        rows: list[tuple[int, int]] = []
        sizes = []
        for batch in sampler.epoch():
            assert not cp.bad_rows(batch, 1).any()
            assert batch.epoch == e
            rows += list(zip(batch.nodes.tolist(), batch.indices.tolist()))
            sizes.append((batch.batch_size, batch.ends_epoch))
        out.append(rows)
        if shapes is not None:
            shapes.append(sizes)
    return out


def test_epochs_give_every_row_of_every_node_once_interleaved_and_seeded(epoch_cluster):
    everything = {(k, i) for k, n in enumerate(EPOCH_ROWS) for i in range(n)}
    orders = []
    for _ in range(2):
        shapes: list = []
        with epoch_cluster.sampler(32, selection=Epoch(drop_last=False), seed=11,
                                   workers=0) as sampler:
            orders.append(epoch_rows(sampler, 2, shapes))
            assert sampler.stats()["epoch_sizes"][-2:] == [sum(EPOCH_ROWS)] * 2
        # 8 whole batches and a short last one, which ends the epoch
        assert shapes == [[(32, False)] * 8 + [(sum(EPOCH_ROWS) % 32, True)]] * 2
    first, second = orders[0]
    for rows in (first, second):
        assert len(rows) == len(set(rows)) == sum(EPOCH_ROWS)
        assert set(rows) == everything
    assert first != second  # each epoch its own order
    assert orders[1] == orders[0]  # the same seed, the same epochs
    # Interleaved: every node gives rows all through an epoch, not one node after another.
    nodes = np.array([k for k, _ in first])
    for k in range(3):
        at = np.flatnonzero(nodes == k) / nodes.size
        assert 0.35 < at.mean() < 0.65, (k, at.mean())
        assert (nodes[:32] == k).any()


@pytest.mark.parametrize("mode", ["drop", "carry"])
def test_an_epochs_remainder_is_dropped_or_carried(epoch_cluster, mode):
    total = sum(EPOCH_ROWS)
    selection = Epoch() if mode == "drop" else Epoch(drop_last=False, carry_remainder=True)
    with epoch_cluster.sampler(32, selection=selection, seed=5) as sampler:
        if mode == "drop":
            for rows in epoch_rows(sampler, 3):  # 8 whole batches; another 24 left out each
                assert len(rows) == len(set(rows)) == total // 32 * 32
            assert sampler.stats()["epoch_rows_dropped"] >= 2 * (total % 32)
            return
        seen: dict[tuple[int, int], int] = {}
        ends = 0
        for _ in range(total * 4 // 32):  # 4 epochs in 35 whole batches
            batch = sampler.next()
            assert batch.batch_size == 32 and not cp.bad_rows(batch, 1).any()
            ends += batch.ends_epoch
            for key in zip(batch.nodes.tolist(), batch.indices.tolist()):
                seen[key] = seen.get(key, 0) + 1
    assert ends == 4
    assert len(seen) == total and set(seen.values()) == {4}


def test_epoch_refuses_a_ratio_and_epoch_needs_an_epoch_selection(epoch_cluster):
    from shmbuf import RateLimit, ShmbufError

    with pytest.raises(ValueError, match="samples_per_insert"):
        epoch_cluster.sampler(32, selection=Epoch(),
                              limit=RateLimit(min_size=1, samples_per_insert=2.0))
    with pytest.raises(ValueError, match="Queue.. delivers single"):
        epoch_cluster.sampler(32, selection=Queue(), plan=Plan(sequence_length=4))
    with epoch_cluster.sampler(32, seed=0, workers=0) as sampler:
        with pytest.raises(ShmbufError, match="Epoch"):
            sampler.epoch()


# -- prioritized sequences ------------------------------------------------------------------------
EPISODE = 10  # the sequence tests' rows: an episode ends after every 10 of a node's rows
T = 4


def next_windows(sampler):
    """The sampler's next batch, its rows whole and each window T consecutive rows."""
    batch = sampler.next()
    assert not cp.bad_rows(batch, 1).any()
    idx = batch.indices
    np.testing.assert_array_equal(idx - idx[:, :1], np.broadcast_to(np.arange(T), idx.shape))
    return batch


def test_prioritized_windows_over_the_union_with_b_t_updates(nodes):
    rows_per_node = [200, 100, 50]
    eta, beta = 0.9, 0.5
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=200, lanes_per_node=1,
                       nodes=nodes) as cluster:
        ray.get([cp.write_episodes.options(**cluster.on_node(n)).remote(
            cluster, k, rows_per_node[k], EPISODE) for k, n in enumerate(cluster.node_ids)],
            timeout=60)
        with cluster.sampler(32, selection=Prioritized(alpha=1.0, beta=beta, eps=0.0, eta=eta),
                             plan=Plan(sequence_length=T), rows_per_call=32, prefetch_calls=2,
                             seed=3) as sampler:
            batch = sampler.next()
            assert batch.indices.shape == (32, T) and batch["payload"].shape[:2] == (32, T)
            # Every usable start of every node (its window inside one episode) gets a priority
            # given per step: the reduction keeps it in proportion to priority_of.
            starts = [np.array([s for s in range(n - T + 1)
                                if s // EPISODE == (s + T - 1) // EPISODE])
                      for n in rows_per_node]
            nd = np.concatenate([np.full(s.size, k) for k, s in enumerate(starts)])
            st = np.concatenate(starts)
            windows = st[:, None] + np.arange(T)
            steps = priority_of(nd, st)[:, None] * np.linspace(0.5, 1.0, T)[None, :]
            with pytest.raises(shmbuf.InvalidPriorityError):
                sampler.update_priorities(windows, np.where(np.arange(T) == 2, np.nan, steps),
                                          lanes=np.zeros_like(st), nodes=nd)
            assert sampler.update_priorities(windows, steps, lanes=np.zeros_like(st),
                                             nodes=nd) == st.size
            value = reduce_windows(steps, eta)  # what each node's table holds per start
            time.sleep(1.0)
            for _ in range(30):  # batches drawn before the update was applied
                sampler.next()
            v_min = value.min()
            cells = np.zeros((3, 3), np.int64)
            for _ in range(200):
                batch = next_windows(sampler)
                idx = batch.indices
                assert (idx // EPISODE == idx[:, :1] // EPISODE).all()  # never across an end
                v = value[[int(np.flatnonzero((nd == k) & (st == s))[0])
                           for k, s in zip(batch.nodes.tolist(), idx[:, 0].tolist())]]
                fresh = np.isclose(batch.weights, (v / v_min) ** -beta, rtol=1e-5)
                np.testing.assert_array_equal(batch.weights[~fresh], 1.0)  # prefetched earlier
                np.add.at(cells, (batch.nodes[fresh], idx[fresh, 0] % 3), 1)
    assert cells.sum() > 200 * 32 * 0.8, cells.sum()  # a few prefetched slots' worth stale
    mass = np.array([[value[(nd == k) & (st % 3 == c)].sum() for c in range(3)]
                     for k in range(3)])
    assert chi_square_p(cells.ravel(), (mass / mass.sum()).ravel()) > 1e-4, cells


def test_window_updates_reduce_per_window_and_refuse_bad_steps():
    idx = np.arange(12).reshape(3, 4) + 100
    prio = np.arange(12, dtype=float).reshape(3, 4)
    starts, values = window_updates(idx, prio, None, 0.9)
    np.testing.assert_array_equal(starts, [100, 104, 108])
    np.testing.assert_allclose(values, 0.9 * prio.max(1) + 0.1 * prio.mean(1))
    mask = np.arange(4)[None, :] < np.array([[1], [2], [4]])
    bad = np.where(mask, prio, np.nan)  # NaN only in steps the mask leaves out: fine
    _, masked = window_updates(idx, bad, mask, 0.9)
    np.testing.assert_allclose(masked, reduce_windows(prio, 0.9, mask))
    np.testing.assert_array_equal(window_updates(idx, prio[:, 0], None, 0.9)[1], prio[:, 0])
    with pytest.raises(shmbuf.InvalidPriorityError):
        window_updates(idx, -prio, None, 0.9)
    with pytest.raises(ValueError, match="shape"):
        window_updates(idx, prio[:, :3], None, 0.9)
    with pytest.raises(ValueError, match="mask"):
        window_updates(idx, prio[:, 0], mask, 0.9)


def test_uniform_windows_split_by_each_nodes_window_starts(nodes):
    """Uniform sequences over the union: every window start of every node equally likely. The
    nodes hold the same rows in episodes of different lengths, so they hold different numbers
    of starts (a window never crosses an episode end); split by rows, the node of short
    episodes would get a third of every batch instead of its fifth."""
    rows, episodes = 200, [50, 10, 5]
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=rows, lanes_per_node=1,
                       nodes=nodes) as cluster:
        with cluster.sampler(32, plan=Plan(sequence_length=T), rows_per_call=32,
                             prefetch_calls=2, seed=4) as sampler:
            # Written after the pools opened on empty buffers, then sampled once every node
            # has reported its starts (before, batches come from the nodes already counted).
            ray.get([cp.write_episodes.options(**cluster.on_node(n)).remote(
                cluster, k, rows, episodes[k]) for k, n in enumerate(cluster.node_ids)],
                timeout=60)
            cp.wait_for(lambda: sampler.next() is not None and min(
                node["weight"] for node in sampler.stats()["nodes"]) > 0, 60, "every node's starts")
            starts = [np.array([s for s in range(rows - T + 1)
                                if s // ep == (s + T - 1) // ep]) for ep in episodes]
            counts = [np.zeros(rows, np.int64) for _ in range(3)]
            for _ in range(150):
                batch = next_windows(sampler)
                idx = batch.indices
                for k in range(3):
                    np.add.at(counts[k], idx[batch.nodes == k, 0], 1)
            # A buffer this small is judged whole: each node's weight is its starts, exactly.
            weights = [node["weight"] for node in sampler.stats()["nodes"]]
            np.testing.assert_allclose(weights, [s.size for s in starts])
    # Only starts came, and every start of the union equally often.
    assert all(counts[k][np.setdiff1d(np.arange(rows), starts[k])].sum() == 0
               for k in range(3)), counts
    cells = np.concatenate([counts[k][starts[k]] for k in range(3)])
    assert chi_square_p(cells, np.full(cells.size, 1.0 / cells.size)) > 1e-4
    shares = np.array([c.sum() for c in counts]) / cells.sum()
    expected = np.array([s.size for s in starts]) / cells.size  # 188, 140, 80 of 408
    assert np.abs(shares - expected).max() < 0.03, (shares, expected, weights)


def test_window_starts_are_judged_again_as_the_buffer_fills():
    """A node's count of starts follows its rows at once while the buffer fills (judged again
    whenever its anchor rows doubled), not a second later; judged whole, it is exact."""
    from workers.cluster.sources import WindowStarts

    spec = shmbuf.Spec(cp.ROWS.fields)
    with shmbuf.ReplayBuffer.create(spec, 200) as buf:
        starts = WindowStarts(buf, Plan(sequence_length=T), None, 0)
        assert starts.count() == 0.0
        with buf.writer(lane=0) as w:
            first = want = 0
            for length in (10, 30, 100):  # episodes: each has length - T + 1 starts
                w.extend(cp.ROWS.batch(0, np.arange(first, first + length)))
                w.end_episode()
                first, want = first + length, want + length - T + 1
                assert starts.count() == pytest.approx(want)
