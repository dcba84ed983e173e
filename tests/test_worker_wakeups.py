"""Issue 13: how sampler workers wake.

- They run under ``SCHED_BATCH`` (``sampler_proc.run_as_batch``), so a worker that wakes on the
  learner's CPU (from a nap, or for a slot handed to it) waits for the learner to block instead
  of preempting it in the middle of ``next()``. Restarted workers too; the learner's own policy
  and every worker's nice value are left as they were.
- The learner wakes a blocked worker through the eventfd of its channel (``Channel.wake``), not
  a record: each worker holds its channel's eventfd once and no other worker's, under every
  start method and after a restart, and the learner's are closed with the pool.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests import pool_procs as procs
from workers import SamplerPool
from workers.channel import Channel
from workers.config import Workers

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's"),
]


def policy_becomes(pid: int, policy: int, timeout: float = 20.0) -> bool:
    """Whether ``pid``'s policy reads ``policy`` within ``timeout`` (a worker sets it at start)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.sched_getscheduler(pid) == policy:
            return True
        time.sleep(0.005)
    return False


@pytest.fixture
def buf():
    b = procs.new_buffer(capacity=128, lanes=2)
    yield b
    b.close()


def test_workers_run_as_batch_and_so_do_restarted_ones(buf, start_method):
    learner_policy = os.sched_getscheduler(0)
    learner_nice = os.getpriority(os.PRIO_PROCESS, 0)
    with SamplerPool(buf, 8, workers=Workers(2, start_method=start_method,
                                          max_restarts_per_minute=60), seed=0) as pool:
        procs.assert_batch_ok(pool.next(timeout=30), 8)
        pids = pool.worker_pids
        assert len(pids) == 2
        for pid in pids:
            assert policy_becomes(pid, os.SCHED_BATCH), \
                f"worker {pid} runs under policy {os.sched_getscheduler(pid)}"
            assert os.getpriority(os.PRIO_PROCESS, pid) == learner_nice
        assert os.sched_getscheduler(0) == learner_policy

        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while pids[0] in pool.worker_pids or len(pool.worker_pids) < 2:
            procs.assert_batch_ok(pool.next(timeout=10), 8)
            assert time.monotonic() < deadline, "the killed worker was never restarted"
        (new,) = set(pool.worker_pids) - set(pids)
        assert policy_becomes(new, os.SCHED_BATCH), \
            f"restarted worker {new} runs under policy {os.sched_getscheduler(new)}"
        assert pool.stats()["restarts"] == 1
    assert os.sched_getscheduler(0) == learner_policy


def test_a_refused_policy_leaves_the_worker_running(monkeypatch):
    """Where the policy cannot be set (a container's seccomp filter, say), the worker goes on
    under the policy it was started with."""
    from workers import sampler_proc

    def refuse(*_args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    before = os.sched_getscheduler(0)
    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    sampler_proc.run_as_batch()  # does not raise
    assert os.sched_getscheduler(0) == before


def eventfd_ids(pid: int | str) -> list[int]:
    """The ``eventfd-id`` of every eventfd ``pid`` holds open."""
    ids = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:[eventfd]":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                info = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except FileNotFoundError:  # closed meanwhile (another thread's)
            continue
        if "eventfd-id" not in info:
            pytest.skip("this kernel's fdinfo shows no eventfd-id")
        ids.append(int(info["eventfd-id"], 16))
    return ids


def learner_side_ids(pool: SamplerPool) -> dict[int, int]:
    """worker pid -> the eventfd-id of its channel's wake-up in the learner."""
    out = {}
    for w in pool._delivery.workers():
        with open(f"/proc/self/fdinfo/{w.chan.wake_fd}") as f:
            info = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        out[w.proc.pid] = int(info["eventfd-id"], 16)
    return out


def assert_each_holds_its_own(wanted: dict[int, int], timeout: float = 20.0) -> None:
    """Each worker holds its channel's eventfd, once, and no other worker's. (Under fork it
    also inherits whatever other eventfds the test process holds: not ours to check.) Read
    until it holds or ``timeout``: a just-forked child closes the parent's copies in its
    at-fork hook, which may not have run yet when the learner already lists its pid."""
    deadline = time.monotonic() + timeout
    for pid, eid in wanted.items():
        others = set(wanted.values()) - {eid}
        while True:
            ids = eventfd_ids(pid)
            if ids.count(eid) == 1 and not others & set(ids):
                break
            assert time.monotonic() < deadline, \
                f"worker {pid} holds eventfds {ids}; its own is {eid}, the others' {others}"
            time.sleep(0.005)


def test_each_worker_waits_on_its_channels_eventfd(buf, start_method):
    stray = os.eventfd(0)  # the test process's own (as Ray's or gRPC's): a fork passes it on
    try:
        before = set(eventfd_ids("self"))
        with SamplerPool(buf, 8, workers=Workers(2, start_method=start_method,
                                              max_restarts_per_minute=60), seed=0) as pool:
            procs.assert_batch_ok(pool.next(timeout=30), 8)
            wanted = learner_side_ids(pool)
            assert len(set(wanted.values())) == 2
            assert_each_holds_its_own(wanted)
            assert set(eventfd_ids("self")) - before == set(wanted.values())

            old = pool.worker_pids[0]
            first = set(wanted.values())
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while old in pool.worker_pids or len(pool.worker_pids) < 2:
                procs.assert_batch_ok(pool.next(timeout=10), 8)
                assert time.monotonic() < deadline, "the killed worker was never restarted"
            wanted = learner_side_ids(pool)
            assert_each_holds_its_own(wanted)  # the restarted one's too (ids are reused: its
            # new eventfd may read the dead one's id)
            # the dead worker's was closed: the learner holds exactly the live channels' ones
            assert set(eventfd_ids("self")) - before == set(wanted.values())
            ours = first | set(wanted.values())
        assert not ours & set(eventfd_ids("self"))  # all closed with the pool
    finally:
        os.close(stray)


def test_channel_wake_ends_a_wait_once_and_a_closed_end_ignores_it():
    parent, end = Channel.pair()
    child = end.channel()
    try:
        assert not child.wait(0)
        parent.wake()
        parent.wake()  # two before the wait: one wait returns, the count is drained
        assert child.wait(5)
        assert not child.wait(0)
        parent.send(11)  # a record still wakes it, as before
        assert child.wait(5) and child.receive() == ([(11, 0, 0, b"")], False)
    finally:
        parent.close()
        child.close()
    parent.wake()  # closed: nothing, no error
    assert parent.wake_fd == child.wake_fd == -1 and parent.closed and child.closed
