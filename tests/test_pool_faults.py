"""The reason shmbuf exists: any sampler worker, learner or actor can die at any moment (SIGKILL
included) and nobody hangs, nothing torn is delivered, nothing leaks in /dev/shm.

Every test runs under fork, forkserver and spawn, kills what it starts, and leaves /dev/shm as it
found it (the autouse fixture in conftest.py checks). Kills that must land "mid-fill" or
"mid-extend" freeze the victim with SIGSTOP first, check from the outside that it really is in the
middle of writing, and only then SIGKILL it, so the tests do not depend on luck.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import multiprocess
import pytest

import shmbuf
from shmbuf import RateLimit
from shmbuf.scan import scan
from shmbuf.shmdir import unlink
from tests import pool_procs as procs
from workers import ActorGroup, SamplerPool
from workers.config import Workers
from workers.staging import FILLING, W_GENERATION, W_OWNER, W_STATE

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def buf():
    b = procs.new_buffer(capacity=128, lanes=2)
    yield b
    b.close()


def _freeze_when(pid: int, predicate, timeout: float = 20.0, nudge=None) -> bool:
    """Spin until ``predicate()`` holds, SIGSTOP ``pid`` and re-check; resume and retry when it
    no longer holds. Returns True with ``pid`` stopped while ``predicate()`` is true.
    ``nudge()``, if given, runs every 50 ms while it does not hold (e.g. take a batch, so that
    workers whose slots are all ready fill again)."""
    deadline = time.monotonic() + timeout
    nudge_at = time.monotonic() + 0.05
    while time.monotonic() < deadline:
        if not predicate():
            if nudge is not None and time.monotonic() >= nudge_at:
                nudge()
                nudge_at = time.monotonic() + 0.05
            time.sleep(0)
            continue
        os.kill(pid, signal.SIGSTOP)
        stop_by = time.monotonic() + 2
        while procs.proc_state(pid) not in ("T", "t", "") and time.monotonic() < stop_by:
            time.sleep(0.0005)  # judge the state only once the victim is really frozen
        if predicate():
            return True
        os.kill(pid, signal.SIGCONT)
    return False


# --------------------------------------------------------------------------------------------
# (1) a sampler worker killed mid-fill
# --------------------------------------------------------------------------------------------
def test_worker_killed_mid_fill_is_replaced_and_learner_goes_on(buf, start_method):
    """SIGKILL a worker three times while it fills a slot: each death is handled within a second
    (restart counted, slot reclaimed), the learner keeps getting whole batches, and the killed
    worker's half-filled slot is never delivered before it was filled again."""
    kills = 3
    with SamplerPool(buf, 8, workers=Workers(2, staging=4, start_method=start_method,
                                             max_restarts_per_minute=60),
                     seed=0, transform=procs.Sleep(0.02)) as pool:
        ring = pool._delivery.ring
        procs.assert_batch_ok(pool.next(timeout=30), 8)
        delivered = 1

        def take_one() -> None:  # once every slot is ready, nobody fills until one is taken
            nonlocal delivered
            procs.assert_batch_ok(pool.next(timeout=10), 8)
            delivered += 1

        for k in range(kills):
            wid = k % 2
            pid = pool.stats()["workers"][wid]["pid"]

            def filling() -> bool:
                return any(ring.get(s, W_STATE) == FILLING and ring.get(s, W_OWNER) == wid  # noqa: B023
                           for s in range(ring.n_slots))

            assert _freeze_when(pid, filling, nudge=take_one), f"worker {wid} never seen mid-fill"
            lost = [s for s in range(ring.n_slots)
                    if ring.get(s, W_STATE) == FILLING and ring.get(s, W_OWNER) == wid]
            gen_before = {s: ring.get(s, W_GENERATION) for s in lost}
            os.kill(pid, signal.SIGKILL)
            for s in lost:  # what a worker dying mid-copy leaves: a torn slot
                view = ring.slot(s)
                view["lane"][::2] = -1
                view["payload"][1::2] ^= 0x5A5A
                del view
            t_kill = time.monotonic()
            restarts = pool.stats()["restarts"]
            while pool.stats()["restarts"] == restarts:
                procs.assert_batch_ok(pool.next(timeout=10), 8)
                delivered += 1
                assert time.monotonic() - t_kill < 10, "the death was never noticed"
            noticed = time.monotonic() - t_kill
            assert noticed < 1.0, f"worker death noticed after {noticed:.2f}s"
            assert pid not in pool.worker_pids
            for s in lost:  # reclaimed: a new generation, never the dead worker's
                assert ring.get(s, W_GENERATION) > gen_before[s]
        for _ in range(20):
            procs.assert_batch_ok(pool.next(timeout=30), 8)
            delivered += 1
        stats = pool.stats()
        assert stats["restarts"] == kills
        assert all(w["alive"] for w in stats["workers"])
        assert stats["batches"] == delivered


def test_worker_dying_halfway_through_copying_a_slot_is_never_delivered(buf, start_method):
    """Workers that SIGKILL themselves halfway through copying a batch into their staging slot
    (the slot's first fields new, the rest stale) again and again: the learner only ever sees
    whole batches and the pool keeps going."""
    with SamplerPool(buf, 8, workers=Workers(2, staging=6, start_method=start_method,
                                             max_restarts_per_minute=1000),
                     seed=0, transform=procs.DieMidCopy(every=3)) as pool:
        deadline = time.monotonic() + 40
        n = 0
        while pool.stats()["restarts"] < 4 or n < 30:
            procs.assert_batch_ok(pool.next(timeout=30), 8)
            n += 1
            assert time.monotonic() < deadline, f"only {pool.stats()['restarts']} restarts"


# --------------------------------------------------------------------------------------------
# (2) restart budget
# --------------------------------------------------------------------------------------------
def test_worker_that_always_dies_exhausts_the_budget(buf, start_method):
    """A worker killed by SIGKILL on every batch: after the budget (2 restarts a minute),
    ``next()`` raises WorkerDiedError naming the pid and the signal, long before its timeout."""
    t0 = time.monotonic()
    with SamplerPool(buf, 4,
                     workers=Workers(1, start_method=start_method, max_restarts_per_minute=2),
                     transform=procs.DieInWorker("sigkill")) as pool:
        first = pool.worker_pids[0]
        with pytest.raises(shmbuf.WorkerDiedError) as info:
            pool.next(timeout=60)
        elapsed = time.monotonic() - t0
        msg = str(info.value)
        assert "killed by SIGKILL (signal 9)" in msg and "restart budget exhausted" in msg
        assert "max_restarts_per_minute" in msg  # the fix
        last = pool.stats()["workers"][0]["pid"]  # the third process; not restarted
        assert f"(pid {last})" in msg and last != first
        assert not procs.pid_alive(last)
        assert pool.stats()["restarts"] == 2
        with pytest.raises(shmbuf.WorkerDiedError):  # it stays failed
            pool.next(timeout=1)
    assert elapsed < 20, f"WorkerDiedError after {elapsed:.1f}s"


@pytest.mark.parametrize("how, words", [(3, "exited with code 3"),
                                        ("sigkill", "killed by SIGKILL")])
def test_zero_restart_budget_reports_the_first_death(buf, how, words):
    """With ``max_restarts_per_minute=0`` the first death is reported, with its exit status."""
    with SamplerPool(buf, 4, workers=Workers(1, start_method="fork", max_restarts_per_minute=0),
                     transform=procs.DieInWorker(how)) as pool:
        pid = pool.worker_pids[0]
        t0 = time.monotonic()
        with pytest.raises(shmbuf.WorkerDiedError, match=f"pid {pid}\\) {words}"):
            pool.next(timeout=60)
        assert time.monotonic() - t0 < 2.0


def test_worker_that_dies_on_start_up_is_reported_at_once(buf, start_method):
    """A worker that dies before it is set up (here: unpickling its transform exits the process)
    is not restarted in a loop: the second start-up death is reported."""
    t0 = time.monotonic()
    with SamplerPool(buf, 4,
                     workers=Workers(1, start_method=start_method, max_restarts_per_minute=100),
                     transform=procs.ExitOnUnpickle(7)) as pool:
        with pytest.raises(shmbuf.WorkerDiedError, match=r"exited with code 7 during start-up"):
            pool.next(timeout=60)
    assert time.monotonic() - t0 < 15


# --------------------------------------------------------------------------------------------
# (3) the learner killed
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("starved", [False, True], ids=["sampling", "waiting-for-min-size"])
def test_learner_killed_workers_exit_by_themselves(start_method, starved):
    """A learner (a spawned process owning a buffer and a pool of workers started with each
    start method) is SIGKILLed, while its workers sample or while they wait for min_size:
    every worker, and every other process it started, exits by itself within a few seconds;
    its segments are then found leaked (owner not alive) and are removed."""
    spawn = multiprocess.get_context("spawn")
    parent_end, child_end = spawn.Pipe()
    learner = spawn.Process(target=procs.learner_main,
                            args=(child_end, start_method, 2, starved))
    learner.start()
    child_end.close()
    family: list[int] = []
    info = None
    try:
        assert parent_end.poll(60), "the learner never reported"
        info = parent_end.recv()
        family = procs.descendants(learner.pid)
        assert set(info["workers"]) <= set(family)
        live = {s.name: s for s in scan()}
        assert live[info["buffer"]].alive and live[info["staging"]].alive
        t0 = time.monotonic()
        os.kill(learner.pid, signal.SIGKILL)
        left = procs.wait_dead(info["workers"], timeout=5)
        assert left == [], f"workers {left} still alive 5s after the learner died"
        took = time.monotonic() - t0
        learner.join(10)
        assert learner.exitcode == -signal.SIGKILL
        left = procs.wait_dead(family, timeout=5)
        assert left == [], f"processes {left} started by the learner outlived it"
        segs = {s.name: s for s in scan()}
        for name in (info["buffer"], info["staging"]):
            assert name in segs, f"{name} vanished: nothing should unlink a dead owner's segment"
            assert not segs[name].alive, f"{name} still looks alive after its owner died"
            assert segs[name].header is not None and segs[name].header.owner_pid == info["pid"]
        print(f"workers exited {took:.2f}s after the learner was killed")
    finally:
        procs.kill_quietly(family)
        if learner.is_alive():
            learner.kill()
        learner.join(5)
        if info is not None:  # what `shmbuf gc` would do
            for name in (info["buffer"], info["staging"]):
                unlink(name)
    names = {s.name for s in scan()}
    assert info["buffer"] not in names and info["staging"] not in names


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def test_children_hold_no_parent_side_channel_end(buf, start_method):
    """No worker or actor keeps the learner's end of any channel open (a forked child inherits
    every descriptor): otherwise a dead learner is never seen as end-of-file and children
    only notice it by polling, if at all."""
    with SamplerPool(buf, 4, workers=Workers(2, start_method=start_method)) as pool, \
         ActorGroup(functools.partial(procs.lane_writer, chunk=1, pause=0.01), 2, buf,
                    start_method=start_method) as group:
        # Wait until every child runs its own code (at-fork hooks done): each worker has
        # delivered a batch and each actor has written.
        deadline = time.monotonic() + 30
        while not all(w["batches"] for w in pool.stats()["workers"]) or \
                (buf.committed() < 130).any():
            procs.assert_batch_ok(pool.next(timeout=30), 4)
            group.poll()
            assert time.monotonic() < deadline, "children did not start"
        parent_side = {os.fstat(w.chan.fd).st_ino for w in pool._delivery.workers()}
        parent_side |= {os.fstat(a.chan.fd).st_ino for a in group._actors}
        assert len(parent_side) == 4
        for pid in pool.worker_pids + group.pids:
            held = _socket_inodes(pid) & parent_side
            assert not held, f"child {pid} holds parent-side channel end(s) {sorted(held)}"


# --------------------------------------------------------------------------------------------
# (4) an actor killed mid-extend while the pool samples
# --------------------------------------------------------------------------------------------
def test_actor_killed_mid_extend_while_the_pool_samples(start_method):
    """Actors extend self-checking rows into their lanes while a pool samples. Actor 0 is frozen
    in the middle of an extend (its lane's reserved > committed), SIGKILLed, twice. The pool
    delivers only whole rows throughout and goes on; ``group.poll()`` restarts the actor, which
    takes its lane over (new writer pid, a new episode) and keeps committing."""
    buf = shmbuf.ReplayBuffer.create(procs.SPEC, capacity=512, lanes=2)
    actor = functools.partial(procs.lane_writer, chunk=200, pause=0.0)
    try:
        with ActorGroup(actor, 2, buf, start_method=start_method, seed=0,
                        max_restarts_per_minute=60) as group, \
             SamplerPool(buf, 32, workers=Workers(2, start_method=start_method),
                         limit=RateLimit(400), seed=0) as pool:
            checked = 0

            def sample(n: int) -> None:
                nonlocal checked
                for _ in range(n):
                    procs.assert_batch_ok(pool.next(timeout=30), 32)
                    checked += 32

            deadline = time.monotonic() + 30
            while (buf.committed() < 400).any() or buf.stats()["per_lane"][0]["writer_pid"] != \
                    group.pids[0]:
                group.poll()
                sample(1)
                assert time.monotonic() < deadline, "the actors never started writing"
            for kill in range(2):
                pid = group.pids[0]
                lane_stats = buf.stats()["per_lane"][0]
                assert lane_stats["writer_pid"] == pid
                episode = lane_stats["episode"]

                def mid_extend() -> bool:
                    return int(buf.storage.reserved[0]) > int(buf.storage.committed[0])

                assert _freeze_when(pid, mid_extend), "actor never seen mid-extend"
                os.kill(pid, signal.SIGKILL)
                frozen = int(buf.committed(0))
                assert int(buf.storage.reserved[0]) > frozen  # it died with an extend half-done
                sample(30)  # the pool goes on, every row whole
                deadline = time.monotonic() + 30
                while group.restarts == kill:
                    group.poll()
                    sample(1)
                    assert time.monotonic() < deadline, "the actor was not restarted"
                while int(buf.committed(0)) <= frozen + 400:
                    group.poll()
                    sample(1)
                    assert time.monotonic() < deadline, "the restarted actor does not write"
                new = buf.stats()["per_lane"][0]
                assert new["writer_pid"] == group.pids[0] != pid
                assert new["episode"] > episode
                sample(20)
            assert group.restarts == 2 and group.alive == 2
            assert pool.stats()["restarts"] == 0
            assert checked > 100 * 32
    finally:
        buf.close()


# --------------------------------------------------------------------------------------------
# (5) timeouts
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_workers", [0, 1])
def test_next_on_an_empty_buffer_times_out_naming_min_size(n_workers, start_method):
    """``next(timeout=0.5)`` on an empty buffer raises ``shmbuf.Timeout`` (a TimeoutError) in
    about half a second, saying the buffer is short of min_size."""
    if n_workers == 0 and start_method != "fork":
        pytest.skip("in-process mode starts no process")
    with shmbuf.ReplayBuffer.create(procs.SPEC, capacity=32) as empty:
        with SamplerPool(empty, 4, workers=Workers(n_workers, start_method=start_method),
                         limit=RateLimit(10)) as pool:
            t0 = time.monotonic()
            with pytest.raises(shmbuf.Timeout, match=r"holds 0 of min_size=10") as info:
                pool.next(timeout=0.5)
            assert isinstance(info.value, TimeoutError)
            assert 0.45 <= time.monotonic() - t0 < 1.5
            procs.fill(empty, 10)
            procs.assert_batch_ok(pool.next(timeout=30), 4)  # and it unblocks


def test_stalled_pool_times_out(buf, start_method):
    """Workers that are alive but produce nothing (a transform stuck for seconds): ``next``
    raises Timeout saying no worker has a batch ready; ``close`` still ends them promptly."""
    with SamplerPool(buf, 4, workers=Workers(1, start_method=start_method),
                     transform=procs.Sleep(30)) as pool:
        t0 = time.monotonic()
        with pytest.raises(shmbuf.Timeout, match=r"1 of 1 workers alive, none has a batch ready"):
            pool.next(timeout=0.5)
        assert time.monotonic() - t0 < 1.5
        pids = pool.worker_pids
        t0 = time.monotonic()
        pool.close(timeout=0.5)
        assert time.monotonic() - t0 < 3
        assert procs.wait_dead(pids, 1) == []


# --------------------------------------------------------------------------------------------
# (6) close() from another thread
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_workers", [0, 2])
@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_close_from_another_thread_wakes_next(n_workers, delay, start_method):
    """A thread blocked in ``next()`` on an empty buffer gets ClosedError promptly when another
    thread closes the pool (also when close races with the call itself: delay 0)."""
    if n_workers == 0 and start_method != "fork":
        pytest.skip("in-process mode starts no process")
    with shmbuf.ReplayBuffer.create(procs.SPEC, capacity=32) as empty:
        pool = SamplerPool(empty, 4, workers=Workers(n_workers, start_method=start_method))
        outcome: list[BaseException | str] = []
        entered = threading.Event()

        def learner() -> None:
            entered.set()
            try:
                pool.next(timeout=30)
                outcome.append("returned a batch")
            except BaseException as e:  # noqa: BLE001 - reported to the test
                outcome.append(e)

        t = threading.Thread(target=learner, daemon=True)
        t.start()
        entered.wait(5)
        time.sleep(delay)
        t0 = time.monotonic()
        pool.close()
        t.join(5)
        woke = time.monotonic() - t0
        assert not t.is_alive(), "next() was not woken by close()"
        assert len(outcome) == 1 and isinstance(outcome[0], shmbuf.ClosedError), outcome
        assert woke < 2.0


@pytest.mark.parametrize("n_workers, rounds", [(0, 60), (2, 15)])
def test_close_from_another_thread_while_next_is_busy(n_workers, rounds):
    """A thread taking batches as fast as it can while another thread closes the pool ends with
    ClosedError (from ``next()`` or from the released batch), never with another error."""
    import random

    outcomes: dict[str, int] = {}
    with procs.new_buffer(capacity=64, lanes=1) as buf:
        for _ in range(rounds):
            pool = SamplerPool(buf, 4, workers=Workers(n_workers, start_method="fork"))
            out: list[BaseException] = []

            def learner() -> None:
                try:
                    while True:
                        batch = pool.next(timeout=30)  # noqa: B023 (this round's pool)
                        procs.assert_batch_ok(batch, 4)
                except BaseException as e:  # noqa: BLE001 - reported to the test
                    out.append(e)  # noqa: B023

            t = threading.Thread(target=learner, daemon=True)
            t.start()
            time.sleep(random.random() * 0.01)
            pool.close()
            t.join(5)
            assert not t.is_alive()
            key = type(out[0]).__name__
            outcomes[key] = outcomes.get(key, 0) + 1
            assert isinstance(out[0], shmbuf.ClosedError), repr(out[0])


class _ClosingPoller:
    """Wraps the pool's poll set: the first poll lets ``close()`` run first, as another thread
    would at the worst moment (the learner's wait then returns the closed descriptors)."""

    def __init__(self, pool: SamplerPool) -> None:
        self.pool, self.real, self.armed = pool, pool._delivery.children.poller, True

    def poll(self, ms: int):
        if self.armed:
            self.armed = False
            self.pool.close()
        return self.real.poll(ms)

    def register(self, *a):
        return self.real.register(*a)

    def unregister(self, *a):
        return self.real.unregister(*a)


def test_close_landing_inside_the_learners_wait_raises_closed_error():
    """Deterministic form of the race above: ``close()`` completes while the learner is inside
    its wait. ``next()`` raises ClosedError (not an OSError from a closed descriptor) and
    restarts no worker for the exits it then sees."""
    with shmbuf.ReplayBuffer.create(procs.SPEC, capacity=32) as empty:
        pool = SamplerPool(empty, 4, workers=Workers(2, start_method="fork"))
        pool._delivery.children.poller = _ClosingPoller(pool)
        with pytest.raises(shmbuf.ClosedError):
            pool.next(timeout=5)
        assert multiprocess.active_children() == []


# --------------------------------------------------------------------------------------------
# (7) no segment left behind: the autouse fixture checks /dev/shm after every test above.
# --------------------------------------------------------------------------------------------
def test_pool_close_leaves_no_segment_even_with_views_held(buf, start_method):
    """Arrays taken out of a Batch keep the staging memory mapped after close, but its name is
    gone from /dev/shm at once (a ResourceWarning says why the memory is still mapped)."""
    pool = SamplerPool(buf, 4, workers=Workers(1, start_method=start_method))
    name = pool.staging_name
    held = pool.next(timeout=30)["payload"]
    with pytest.warns(ResourceWarning, match="still view"):
        pool.close()
    assert name not in {s.name for s in scan()}
    assert held.shape == (4, procs.PAYLOAD_WORDS)  # still readable, not a crash
    del held
