"""Issue 13: sampler workers run under ``SCHED_BATCH`` (``sampler_proc.run_as_batch``), so a
worker that wakes on the learner's CPU (from a nap, or for a slot handed to it) waits for the
learner to block instead of preempting it in the middle of ``next()``. Restarted workers too;
the learner's own policy and every worker's nice value are left as they were."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests import pool_procs as procs
from workers import SamplerPool

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
    with SamplerPool(buf, batch_size=8, n_workers=2, start_method=start_method, seed=0,
                     max_restarts_per_minute=60) as pool:
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
