"""``ActorGroup`` under fork, forkserver and spawn: actors write their own lanes, failures come back
with their traceback, killed actors are restarted and take their lane over, ``stop`` is graceful
then firm within its timeout, and actors end by themselves when their parent dies."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import multiprocess
import numpy as np
import pytest

import shmbuf
from shmbuf import RateLimit
from shmbuf.scan import scan
from shmbuf.shmdir import unlink
from tests import pool_procs as procs
from workers import ActorGroup

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def buf():
    b = shmbuf.ReplayBuffer.create(procs.SPEC, capacity=256, lanes=3)
    yield b
    b.close()


def _lane_rows(buf: shmbuf.ReplayBuffer, lane: int) -> dict[str, np.ndarray]:
    win = buf.windows()
    return buf.get(np.arange(win.lo[lane], win.hi[lane]), lane)


def _poll_until(group: ActorGroup, predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        group.poll()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_actors_write_their_own_lanes(buf, start_method):
    """Each actor writes only its lane (rows say so, and check themselves); a finished actor is
    reaped as done, not as a failure."""
    with ActorGroup(functools.partial(procs.bounded_writer, n=100), 3, buf,
                    start_method=start_method, restart="never", seed=0) as group:
        assert group.n_actors == 3 and len(set(group.pids)) == 3
        assert group.join(30), "actors did not finish"
        assert group.alive == 0 and group.restarts == 0
    assert buf.committed().tolist() == [100, 100, 100]
    for lane in range(3):
        rows = _lane_rows(buf, lane)
        assert (rows["lane"] == lane).all()
        assert (rows["index"] == np.arange(100)).all()
        assert not procs.bad_rows(rows).any()
        assert buf.stats()["per_lane"][lane]["episode"] == 1  # end_episode() was called


def test_actors_on_chosen_lanes_and_lambda_under_every_start_method(buf, start_method):
    """``lanes=`` picks the lanes; a lambda actor (cloudpickled) runs under every start
    method."""
    with ActorGroup(lambda ctx: procs.bounded_writer(ctx, n=10 + ctx.actor_id), 2, buf,
                    lanes=[2, 0], start_method=start_method, restart="never") as group:
        assert group.join(30)
    assert buf.committed().tolist() == [11, 0, 10]
    assert (_lane_rows(buf, 2)["lane"] == 2).all() and (_lane_rows(buf, 0)["lane"] == 0).all()


def test_actor_exception_comes_back_with_its_traceback(buf, start_method):
    """With restart="never", an exception in the actor function is raised from ``poll()`` as
    ActorError carrying the actor's traceback; what it wrote before stays."""
    with ActorGroup(procs.raising_actor, 1, buf, start_method=start_method,
                    restart="never") as group:
        deadline = time.monotonic() + 30
        with pytest.raises(shmbuf.ActorError) as info:
            while time.monotonic() < deadline:
                group.poll()
                time.sleep(0.01)
        msg = str(info.value)
        assert "actor-boom from actor 0" in msg and "Traceback" in msg
        assert "raising_actor" in msg and "ValueError" in msg
        assert "lane 0" in msg and "exited with code 1" in msg
        group.poll()  # reported once; the actor is not restarted
        assert group.restarts == 0 and group.alive == 0
    assert int(buf.committed(0)) == 4


def test_killed_actor_is_restarted_and_continues_its_lane(buf, start_method):
    """With restart="on-failure", a SIGKILLed actor is restarted by ``poll()``: the new process
    takes the same lane over, continues at the lane's committed index (no gap, no overlap),
    in a new episode, and every row of the lane checks."""
    actor = functools.partial(procs.lane_writer, chunk=4, pause=0.002)
    with ActorGroup(actor, 2, buf, start_method=start_method, restart="on-failure",
                    seed=0) as group:
        _poll_until(group, lambda: int(buf.committed(1)) > 20, 30, "actor 1 to write")
        old = group.pids[1]
        episode = buf.stats()["per_lane"][1]["episode"]
        os.kill(old, signal.SIGKILL)
        _poll_until(group, lambda: group.restarts == 1, 10, "the restart")
        new = group.pids[1]
        assert new != old and group.pids[0] is not None
        frozen = int(buf.committed(1))
        _poll_until(group, lambda: int(buf.committed(1)) > frozen + 40, 30,
                    "the restarted actor to write")
        lane = buf.stats()["per_lane"][1]
        assert lane["writer_pid"] == new and lane["episode"] > episode
        assert group.alive == 2
    rows = _lane_rows(buf, 1)
    assert not procs.bad_rows(rows).any()
    assert (np.diff(rows["index"]) == 1).all()  # contiguous across the takeover
    assert (rows["lane"] == 1).all()


def test_actor_that_keeps_failing_exhausts_its_budget(buf):
    """A crashing actor is restarted within the budget, then reported."""
    with ActorGroup(procs.raising_actor, 1, buf, start_method="fork", restart="on-failure",
                    max_restarts_per_minute=2) as group:
        deadline = time.monotonic() + 30
        with pytest.raises(shmbuf.ActorError, match="restart budget exhausted") as info:
            while time.monotonic() < deadline:
                group.poll()
                time.sleep(0.01)
        assert "actor-boom" in str(info.value)
        assert group.restarts == 2


def test_stop_is_graceful_for_actors_that_check_stopping(buf, start_method):
    """``stop()`` asks; actors that watch ``ctx.stopping`` return cleanly (exit code 0) well
    within the timeout, and their lanes are free again."""
    with ActorGroup(functools.partial(procs.lane_writer, chunk=4, pause=0.001), 3, buf,
                    start_method=start_method) as group:
        _poll_until(group, lambda: (buf.committed() > 0).all(), 30, "all actors to write")
        procs_ = [a.proc for a in group._actors]
        t0 = time.monotonic()
        group.stop(timeout=10)
        took = time.monotonic() - t0
        assert took < 2.0, f"graceful stop took {took:.2f}s"
        assert [p.exitcode for p in procs_] == [0, 0, 0]
        group.stop()  # idempotent
    for lane in range(3):
        with buf.writer(lane=lane, timeout=1):
            pass
        assert not procs.bad_rows(_lane_rows(buf, lane)).any()


@pytest.mark.parametrize("ignore_sigterm", [False, True])
def test_stop_is_firm_for_actors_that_ignore_it(buf, start_method, ignore_sigterm):
    """Actors that never check ``ctx.stopping`` are terminated after the timeout, and ones that
    ignore SIGTERM too are killed; ``stop(timeout)`` returns within about three timeouts."""
    actor = functools.partial(procs.stubborn_actor, ignore_sigterm=ignore_sigterm)
    with ActorGroup(actor, 2, buf, start_method=start_method) as group:
        _poll_until(group, lambda: (buf.committed()[:2] > 0).all(), 30, "actors to write")
        procs_ = [a.proc for a in group._actors]
        pids = group.pids
        t0 = time.monotonic()
        group.stop(timeout=0.3)
        took = time.monotonic() - t0
        want = -signal.SIGKILL if ignore_sigterm else -signal.SIGTERM
        assert [p.exitcode for p in procs_] == [want, want]
        assert 0.25 <= took < 3 * 0.3 + 1.0, f"stop took {took:.2f}s"
        assert procs.wait_dead(pids, 1) == []


def test_stop_ends_actors_blocked_by_the_rate_limiter(start_method):
    """Actors waiting in ``extend`` on a rate limiter (no learner consumes) are stopped
    gracefully: the wait itself watches ``ctx.stopping``, so ``stop()`` ends them at once with
    exit code 0 (not by SIGTERM after the timeout, nor after their insert timeout)."""
    from workers import SamplerPool

    with procs.new_buffer(capacity=512, lanes=2, rows=16) as buf, \
         SamplerPool(buf, batch_size=8, limit=RateLimit(32, 4.0, 32), workers=0) as pool:
        assert pool.n_workers == 0
        with ActorGroup(functools.partial(procs.lane_writer, chunk=2), 2, buf,
                        start_method=start_method) as group:
            blocked_at = None
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until inserts stop: both actors blocked
                committed = buf.committed().copy()
                time.sleep(0.3)
                group.poll()
                if (buf.committed() == committed).all() and committed.sum() > 32:
                    blocked_at = committed
                    break
            assert blocked_at is not None, "the limiter never held the actors back"
            procs_ = [a.proc for a in group._actors]
            t0 = time.monotonic()
            group.stop(timeout=5.0)
            took = time.monotonic() - t0
            assert [p.exitcode for p in procs_] == [0, 0], "stopped gracefully, not killed"
            assert took < 2.0, f"stop took {took:.2f}s"


def test_actors_exit_when_their_parent_dies(start_method):
    """A parent process (spawned) runs an ActorGroup and is SIGKILLed: its actors notice and
    exit by themselves within a few seconds; the parent's buffer is then found leaked."""
    spawn = multiprocess.get_context("spawn")
    parent_end, child_end = spawn.Pipe()
    parent = spawn.Process(target=procs.actor_parent_main, args=(child_end, start_method, 2))
    parent.start()
    child_end.close()
    info = None
    family: list[int] = []
    try:
        assert parent_end.poll(60), "the actors' parent never reported"
        info = parent_end.recv()
        assert all(c > 0 for c in info["committed"])
        family = procs.descendants(parent.pid)
        assert set(info["actors"]) <= set(family)
        os.kill(parent.pid, signal.SIGKILL)
        parent.join(10)
        left = procs.wait_dead(info["actors"], 5)
        assert left == [], f"actors {left} outlived their parent by 5s"
        assert procs.wait_dead(family, 5) == []
        seg = {s.name: s for s in scan()}[info["buffer"]]
        assert not seg.alive
        # The orphaned lanes are free: a new writer takes each over.
        with shmbuf.ReplayBuffer.attach(info["buffer"]) as orphan:
            for lane in range(2):
                with orphan.writer(lane=lane, timeout=1) as w:
                    assert w.committed == int(orphan.committed(lane)) > 0
                rows = _lane_rows(orphan, lane)
                assert not procs.bad_rows(rows).any()
    finally:
        procs.kill_quietly(family)
        if parent.is_alive():
            parent.kill()
        parent.join(5)
        if info is not None:
            unlink(info["buffer"])


def test_bad_arguments(buf, own_shm_entries):
    lock = threading.Lock()

    def locked_actor(ctx):
        with lock:
            pass

    before = own_shm_entries()
    with pytest.raises(TypeError, match=r"locked_actor cannot be serialised"):
        ActorGroup(locked_actor, 1, buf)
    with pytest.raises(TypeError, match="actor_fn must be callable"):
        ActorGroup(None, 1, buf)
    with pytest.raises(ValueError, match="n_actors must be a positive int, got 0"):
        ActorGroup(procs.bounded_writer, 0, buf)
    with pytest.raises(ValueError, match=r"4 actors need 4 distinct lanes in \[0, 3\)"):
        ActorGroup(procs.bounded_writer, 4, buf)
    with pytest.raises(ValueError, match=r"distinct lanes"):
        ActorGroup(procs.bounded_writer, 2, buf, lanes=[1, 1])
    with pytest.raises(ValueError, match="restart must be one of"):
        ActorGroup(procs.bounded_writer, 1, buf, restart="always")
    assert multiprocess.active_children() == []
    assert own_shm_entries() == before
    assert not buf.closed
