"""``samples_per_insert`` over a whole ``ReplayCluster`` on the writers' side (a 3-node Ray
cluster, started once for the module; isolated nodes where root allows): a slow or paused
learner holds back the writers of every node, not only its own, so that the cluster's inserts
stay within the tolerance; they resume when it samples again, time out with
``RateLimitTimeout`` while it does not, and go free when it closes its sampler.
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
from shmbuf.limiter import RateLimit  # noqa: E402
from tests import cluster_procs as cp  # noqa: E402
from tests._helpers.netns_cluster import local_unless_isolated  # noqa: E402
from workers.cluster import HostRestartedWarning, ReplayCluster  # noqa: E402
from workers.cluster.rate import (  # noqa: E402
    STARVE_S,
    NodeLimit,
    RoomShares,
    cluster_report,
)

pytestmark = [pytest.mark.timeout(240)]

LANES = 2
RATIO, TOL, MIN_SIZE, BATCH, CHUNK = 1.0, 64.0, 200, 16, 16


def committed(cluster: ReplayCluster) -> np.ndarray:
    """Rows committed on each node now, read on each node (a node's buffer outlives its host;
    no other node sees it)."""
    return cp.committed_per_node(cluster)


def start_writers(cluster: ReplayCluster, chunk: int = CHUNK) -> tuple[list, list]:
    """One ``RowWriter`` actor per node, each adding ``chunk``-row chunks with a 1 s insert
    timeout (so a held writer counts ``RateLimitTimeout``s); the actors and their runs."""
    writers = [cp.RowWriter.options(**cluster.on_node(n)).remote(cluster, k, LANES)
               for k, n in enumerate(cluster.node_ids)]
    return writers, [w.run.remote(chunk, insert_timeout=1.0) for w in writers]


def stop_writers(writers: list, runs: list) -> None:
    """Ask ``start_writers``' actors to stop and wait for their runs to end (bounded)."""
    ray.get([w.stop.remote() for w in writers], timeout=30)
    ray.get(runs, timeout=30)


def cluster_overshoot_bound(n_nodes: int) -> float:
    """How far past the limit the cluster may stand: each other node can spend the room the
    last report left (at most the tolerance plus one batch's worth of inserts), and each lane's
    writer may have one chunk in flight past it (writers of a node check their room at once)."""
    return (n_nodes - 1) * (TOL + BATCH / RATIO) + n_nodes * LANES * CHUNK


def excess(inserts: int, samples: int) -> float:
    """How far the cluster's inserts run past what the limit lets writers insert, in samples
    (<= 0 within the limit): ``inserts * ratio - samples - max_diff``."""
    return inserts * RATIO - samples - RateLimit(MIN_SIZE, RATIO, TOL).max_diff


def still(cluster: ReplayCluster, seconds: float) -> tuple[np.ndarray, np.ndarray]:
    """Rows committed per node at the start and the end of ``seconds``."""
    before = committed(cluster)
    time.sleep(seconds)
    return before, committed(cluster)


@pytest.mark.ray
@local_unless_isolated
def test_writers_of_every_node_follow_the_learner(nodes):
    """A learner sampling slowly holds every node's writers to the cluster's ratio; paused, it
    stops them all (their waits run out: ``RateLimitTimeout``); sampling again, it lets every
    node write; closing its sampler lets them all go."""
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=1 << 14, lanes_per_node=LANES,
                       nodes=nodes) as cluster:
        sampler = cluster.sampler(BATCH, limit=RateLimit(MIN_SIZE, RATIO, TOL), seed=5, timeout=60)
        writers, runs = start_writers(cluster)
        try:
            samples = 0
            for _ in range(40):  # a slow learner: the writers are the ones held back
                batch = sampler.next()
                assert not cp.bad_rows(batch, LANES).any()
                samples += BATCH
                time.sleep(0.02)
            # Paused: nobody reports, so every node's writers stop where the last report left
            # them, and keep timing out (the writer's own timeout, as under a local pool).
            time.sleep(1.0)
            before, after = still(cluster, 1.5)
            assert (after == before).all(), (before, after)
            assert (before > 0).all(), before  # every node wrote
            over = excess(int(after.sum()), samples)
            print(f"paused: per node {after}, inserts {after.sum()}, samples {samples}, "
                  f"excess {over}")
            assert over <= cluster_overshoot_bound(len(nodes)), over
            progress = ray.get([w.progress.remote() for w in writers], timeout=30)
            assert all(timeouts >= 1 for _, timeouts in progress), progress
            # Sampling again lets every node's writers go on, within the ratio.
            for _ in range(60):
                sampler.next()
                samples += BATCH
                time.sleep(0.01)
            time.sleep(1.0)
            before, again = still(cluster, 1.0)
            assert (again == before).all(), (before, again)
            assert (again > after).all(), (after, again)
            over = excess(int(again.sum()), samples)
            print(f"resumed: per node {again}, inserts {again.sum()}, samples {samples}, "
                  f"excess {over}")
            assert over <= cluster_overshoot_bound(len(nodes)), over
            assert excess(int(again.sum()), samples) > -4 * TOL  # the writers kept up
            # Closing the sampler lifts the limit on every node.
            sampler.close()
            cp.wait_for(lambda: (committed(cluster) > again + 1000).all(), 30,
                        "every node's writers to resume after the sampler closed")
        finally:
            sampler.close()
            stop_writers(writers, runs)


@pytest.mark.ray
@local_unless_isolated
def test_writers_are_free_until_the_cluster_holds_min_size(nodes):
    """No writer waits before the cluster holds ``min_size`` rows (far more than the
    tolerance lets one node write); then they stop. Each node may reach ``min_size`` (plus
    the tolerance) on its own before the learner's report of the others reaches it: the
    cluster holds at most nodes x that."""
    min_size = 3000
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=1 << 14, lanes_per_node=LANES,
                       nodes=nodes) as cluster:
        with cluster.sampler(BATCH, limit=RateLimit(min_size, RATIO, TOL), timeout=60) as sampler:
            writers, runs = start_writers(cluster)
            try:
                sampler.next()  # waits for min_size over the cluster (reporting meanwhile)
                # A node whose writers started late (a loaded machine) still writes its own way
                # up to min_size: wait until no node writes for a second, then judge the counts.
                counts: list[np.ndarray] = []

                def stopped() -> bool:
                    before, after = still(cluster, 1.0)
                    counts.append(after)
                    return bool((after == before).all())

                cp.wait_for(stopped, 30, "every node's writers to stop after min_size")
                after = counts[-1]
                print(f"min_size {min_size}: per node {after} (seen {counts})")
                assert after.sum() >= min_size
                assert after.sum() <= len(nodes) * (min_size + TOL / RATIO + BATCH), after
            finally:
                stop_writers(writers, runs)


@pytest.mark.ray
@local_unless_isolated
def test_a_restarted_host_holds_its_writers_again(nodes):
    """A SIGKILLed host lifts its node's limit (as a dead pool does); the restarted host
    re-adopts the segment and the learner's next call sets the limit again."""
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=1 << 14, lanes_per_node=LANES,
                       nodes=nodes, host_restarts=1) as cluster:
        sampler = cluster.sampler(BATCH, limit=RateLimit(MIN_SIZE, RATIO, TOL), seed=6, timeout=90)
        writers, runs = start_writers(cluster)
        try:
            for _ in range(20):
                sampler.next()
                time.sleep(0.02)
            time.sleep(1.0)
            held = committed(cluster)
            os.kill(cluster.info()[nodes[2]]["pid"], signal.SIGKILL)
            cp.wait_for(lambda: committed(cluster)[2] > held[2] + 2000, 60,
                        "node 2's writer to run free while its host is down")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", HostRestartedWarning)
                while sampler.stats()["nodes"][2]["host_restarts"] == 0:
                    sampler.next()
            # The cluster is far past its limit now (node 2 ran free): every node stands.
            time.sleep(1.0)
            before, after = still(cluster, 1.0)
            assert (after == before).all(), (before, after)
        finally:
            sampler.close()
            stop_writers(writers, runs)


FAIR_WINDOW_S = 15.0


@pytest.mark.ray
@local_unless_isolated
def test_every_node_gets_a_fair_share_of_the_inserts(nodes):
    """One unpaced writer per node and an unpaced learner: the learner's node hears of new
    room first (every 10 ms, the others through Ray), yet over the window every node inserts
    within 1.5x of every other (``RoomShares``: each node's cap rises by its share of the new
    room), and the cluster stays within its limit."""
    tol = 32 * BATCH
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=1 << 14, lanes_per_node=LANES,
                       nodes=nodes) as cluster:
        sampler = cluster.sampler(BATCH, limit=RateLimit(MIN_SIZE, RATIO, tol), seed=7,
                                  timeout=60)
        writers, runs = start_writers(cluster, chunk=64)
        try:
            for _ in range(50):  # past min_size, every node writing
                sampler.next()
            before, samples0 = committed(cluster), int(sampler.rows_from.sum())
            deadline = time.monotonic() + FAIR_WINDOW_S
            while time.monotonic() < deadline:
                batch = sampler.next()
                assert not cp.bad_rows(batch, LANES).any()
            after, samples1 = committed(cluster), int(sampler.rows_from.sum())
            inserts = after - before
            st = sampler.stats()
            print(f"inserts per node over {FAIR_WINDOW_S:g} s: {inserts} "
                  f"(shares {np.round(inserts / inserts.sum(), 3)}), samples "
                  f"{samples1 - samples0}, room pooled {st['room_pooled']} times")
            assert inserts.min() > 0 and inserts.max() <= 1.5 * inserts.min(), inserts
            # The writers kept up with the learner: it sampled about as much as they inserted.
            assert abs((samples1 - samples0) - inserts.sum() * RATIO) <= 2 * tol + 3 * 64 * 2
        finally:
            sampler.close()
            stop_writers(writers, runs)


@pytest.mark.ray
@local_unless_isolated
def test_no_stall_when_a_nodes_share_is_smaller_than_an_extend(nodes):
    """With a tolerance of 64 rows over 3 nodes, each node's share of the room is smaller than
    its writer's 64-row ``extend``: fair caps alone would leave every writer and the learner
    waiting. The learner, held back with no insert anywhere, gives the whole room to one node
    at a time (the fewest rows first) until it samples again: batches keep coming, and every
    node gets to write."""
    chunk = int(TOL / RATIO)  # the most that fits at once (RateLimit.max_insert_chunk)
    with ReplayCluster(cp.ROWS.fields, capacity_per_node=1 << 14, lanes_per_node=LANES,
                       nodes=nodes) as cluster:
        sampler = cluster.sampler(BATCH, limit=RateLimit(MIN_SIZE, RATIO, TOL), seed=8,
                                  timeout=30)
        writers, runs = start_writers(cluster, chunk=chunk)
        try:
            t0 = time.monotonic()
            for _ in range(150):
                assert not cp.bad_rows(sampler.next(), LANES).any()  # Timeout: a stall
            took = time.monotonic() - t0
            st = sampler.stats()
            print(f"150 batches in {took:.1f} s, room pooled {st['room_pooled']} times, "
                  f"per node {committed(cluster)}")
            assert st["room_pooled"] >= 1  # the stall happened, and ended
            deadline = time.monotonic() + 60  # (a writer actor may start late on a busy box)
            while not (committed(cluster) > 0).all():
                assert time.monotonic() < deadline, committed(cluster)
                for _ in range(10):
                    sampler.next()
        finally:
            sampler.close()
            stop_writers(writers, runs)


def test_room_shares_split_new_room_evenly_and_pool_on_a_stall():
    """``RoomShares`` (without Ray): the caps split the room evenly, grow by a third of every
    new row of room each, a node's report leaves it exactly its cap, and a stall pools the
    room until the learner samples again."""
    limit = RateLimit(min_size=30, samples_per_insert=1.0, tolerance=60)
    shares = RoomShares(limit, 3)
    committed = [10, 10, 10]
    shares.update(committed, 0)  # allowed = (30 + 60 + 0) / 1 = 90; room 60, 20 each
    assert np.allclose(shares.caps, [30, 30, 30])
    elsewhere, samples, _ = shares.report(committed, 0, 0)
    own_room = limit.inserts_allowed(committed[0] + elsewhere, samples)
    assert own_room == 20  # the node's cap, not the cluster's 60
    committed = [30, 10, 10]  # node 0 used its share; the learner samples 30
    shares.update(committed, 30)
    assert np.allclose(shares.caps, [40, 40, 40])  # +10 each, node 0's use took nobody's
    elsewhere, samples, _ = shares.report(committed, 1, 30)
    assert limit.inserts_allowed(committed[1] + elsewhere, samples) == 30
    before = shares.seq
    assert shares.report(committed, 2, 30)[2] == before + 1  # numbered
    shares.update([30, None, 10], 30)  # node 1 dropped: the room split afresh, in two
    assert shares.caps[1] == 0 and np.allclose(shares.caps[[0, 2]], [30 + 40, 10 + 40])
    shares.held_back(40)
    time.sleep(STARVE_S + 0.02)
    shares.held_back(40)  # no insert anywhere for STARVE_S: a stall
    assert shares.pooled == 1 and shares.favored == 2  # the node with the fewest rows
    seen = [30, None, 10]
    shares.update(seen, 30)
    elsewhere, samples, _ = shares.report(seen, 2, 30)
    assert limit.inserts_allowed(10 + elsewhere, samples) == 80  # the whole room
    elsewhere, samples, _ = shares.report(seen, 0, 30)
    assert limit.inserts_allowed(30 + elsewhere, samples) == 0  # none: not its turn
    time.sleep(STARVE_S + 0.02)
    shares.held_back(40)  # node 2 did not insert either: node 0's turn
    assert shares.pooled == 2 and shares.favored == 0
    shares.sampled()
    shares.update(seen, 30)
    assert shares.shared and shares.favored is None


def test_node_limit_counts_the_cluster():
    """``NodeLimit`` (without Ray): the node's writers count their node's rows live plus the
    other nodes' and the samples as reported; only one limiting holder per buffer; release
    lifts it."""
    limit = RateLimit(min_size=10, samples_per_insert=1.0, tolerance=4)
    assert cluster_report([5, 7, 0], 1, 20) == (5, 20)
    with shmbuf.ReplayBuffer.create(cp.ROWS.fields, capacity=64, lanes=1) as buf:
        lim = buf.storage.limiter
        with buf.writer(insert_timeout=0.2) as w:

            def put(n: int) -> None:
                w.extend(cp.ROWS.batch(0, np.arange(w.committed, w.committed + n)))

            put(6)
            node = NodeLimit(buf, limit, report=(5, 0))
            try:
                with pytest.raises(shmbuf.ShmbufError, match="already rate-limits"):
                    NodeLimit(buf, limit)
                st = lim.stats()
                assert (st["inserts"], st["samples"]) == (11, 0)  # 6 here + 5 elsewhere
                put(3)  # 14 <= min_size + (0 + tol) / ratio
                with pytest.raises(shmbuf.RateLimitTimeout, match="inserts 14, samples 0"):
                    put(1)
                node.apply((5, 3))  # the learner sampled 3: room for 3 more
                put(3)
                with pytest.raises(shmbuf.RateLimitTimeout):
                    put(1)
                node.apply((0, 3))  # another node was dropped: its rows no longer count
                put(5)
                assert lim.stats()["inserts"] == 17
                node.apply((100, 3, 2))  # numbered: applied
                node.apply((0, 3, 1))  # an older report that overtook nothing: ignored
                assert lim.stats()["inserts"] == 117  # 17 here + 100 elsewhere
            finally:
                node.release()
                node.release()
            assert not lim.stats()["active"]
            put(20)  # free
