"""Issue 13: the learner's READY path makes no system call. ``next()`` over slots that are
already READY reads their STATE words only; handing a slot back to a worker that is not waiting
is a word store; a worker (or the learner) that blocks is still woken through the waiting-word
handshake of ``workers.staging``.

Channel calls are counted by wrapping, in the learner, every worker's channel end and the
supervisor's poller (``delivery.workers()[i].chan``, ``delivery.children.poller``): any receive,
send, poll or wait the learner makes goes through one of them.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import multiprocess.connection
import pytest

from shmbuf.errors import ClosedError
from tests import pool_procs as procs
from workers import SamplerPool, learner_ring, selection
from workers.config import Workers
from workers.delivery import ring as delivery_ring
from workers.staging import FILLING, HELD, LEARNER, READY, StagingRing, slot_arrays

pytestmark = pytest.mark.timeout(90)


class Counted:
    """Forwards everything to ``inner``; counts calls of ``names`` in ``counts``."""

    def __init__(self, inner: Any, counts: collections.Counter[str], names: tuple[str, ...]
                 ) -> None:
        self._inner, self._counts, self._names = inner, counts, names

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name not in self._names:
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counts[name] += 1
            return value(*args, **kwargs)

        return counted


@contextlib.contextmanager
def counting_channel_calls(pool: SamplerPool) -> Iterator[collections.Counter[str]]:
    """Count the learner's channel calls (receive, send, wait, poll) while inside."""
    delivery = pool._delivery
    counts: collections.Counter[str] = collections.Counter()
    workers = delivery.workers()
    chans = [w.chan for w in workers]
    poller = delivery.children.poller
    for w in workers:
        w.chan = Counted(w.chan, counts, ("send", "send_text", "receive", "wait", "wake"))
    delivery.children.poller = Counted(poller, counts, ("poll",))
    try:
        yield counts
    finally:
        for w, chan in zip(workers, chans):
            w.chan = chan
        delivery.children.poller = poller


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def freeze_mid_fill(pid: int, ring: StagingRing, slot: int, timeout: float = 20.0) -> None:
    """SIGSTOP ``pid`` while ``slot`` is FILLING (re-checked once it is really stopped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ring.state(slot) != FILLING:
            time.sleep(0.0005)
            continue
        os.kill(pid, signal.SIGSTOP)
        stop_by = time.monotonic() + 2
        while procs.proc_state(pid) not in ("T", "t", "") and time.monotonic() < stop_by:
            time.sleep(0.0005)
        if ring.state(slot) == FILLING:
            return
        os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"slot {slot} never seen FILLING")


@pytest.fixture
def buf():
    b = procs.new_buffer(capacity=128, lanes=2)
    yield b
    b.close()


N_STAGING = 6


@pytest.fixture(params=["compiled", "python"])
def taker(request, monkeypatch):
    """``LearnerRing.take`` compiled (``workers._take_c``, skipped where it was not built), or
    in Python, as where no compiler was at hand."""
    if request.param == "compiled" and learner_ring.Taker is None:
        pytest.skip("workers._take_c was not built")
    if request.param == "python":
        monkeypatch.setattr(learner_ring, "Taker", None)
    return request.param


@pytest.fixture
def pool(buf, start_method, taker, monkeypatch):
    """One slow worker (50 ms per batch) and ``N_STAGING`` slots; the periodic death check
    (a poll every ``CHECK_EVERY_NS`` while batches keep coming) moved out of the way."""
    monkeypatch.setattr(delivery_ring, "CHECK_EVERY_NS", 3600 * 10**9)
    with SamplerPool(buf, 8, workers=Workers(1, staging=N_STAGING, start_method=start_method),
                     seed=0, transform=procs.Sleep(0.05)) as p:
        procs.assert_batch_ok(p.next(timeout=30), 8)  # the one periodic check happens here
        yield p


def states(ring: StagingRing) -> list[int]:
    return [ring.state(s) for s in range(ring.n_slots)]


def test_next_over_ready_slots_and_release_to_a_busy_worker_make_no_channel_call(pool):
    """The worker is frozen mid-fill (not waiting): N ``next()`` calls over N READY slots, each
    releasing the previous batch to that worker, make no channel call at all."""
    ring = pool._delivery.ring
    wait_for(lambda: states(ring).count(READY) == N_STAGING - 1, what="every other slot READY")
    held = states(ring).index(HELD)
    procs.assert_batch_ok(pool.next(timeout=10), 8)  # hands ``held`` back: the worker refills it
    pid = pool.worker_pids[0]
    freeze_mid_fill(pid, ring, held)
    try:
        assert not ring.waiting(1)  # a worker mid-fill is not waiting: no wake-up is needed
        ready = states(ring).count(READY)
        assert ready == N_STAGING - 2
        with counting_channel_calls(pool) as counts:
            for _ in range(ready):
                procs.assert_batch_ok(pool.next(timeout=10), 8)
        assert dict(counts) == {}, f"the READY path made channel calls: {dict(counts)}"
    finally:
        os.kill(pid, signal.SIGCONT)
    procs.assert_batch_ok(pool.next(timeout=30), 8)  # the worker goes on, nothing was lost


def test_a_plain_pool_takes_ready_slots_in_its_common_case_not_its_wait(pool):
    """Over READY slots, ``next()`` of a plain pool (uniform rows, NumPy views) is
    ``RingDelivery.take_ready`` alone: the delivery's waiting ``next`` is never entered, and
    every batch is whole and its own slot's."""
    delivery = pool._delivery
    assert delivery.quick
    ring = delivery.ring
    wait_for(lambda: states(ring).count(READY) == N_STAGING - 1, what="every other slot READY")
    entered = []
    waiting_next = delivery.next
    delivery.next = lambda *args: entered.append(args) or waiting_next(*args)
    seen = set()
    for _ in range(N_STAGING - 1):
        batch = pool.next(timeout=10)
        procs.assert_batch_ok(batch, 8)
        assert ring.state(batch.slot) == HELD
        assert batch.generation == delivery.slots.generation(batch.slot)
        seen.add(batch.slot)
    assert entered == [] and len(seen) == N_STAGING - 1
    assert states(ring).count(HELD) == 1  # each next() handed the previous slot back
    assert pool.stats()["workers"][0]["batches"] >= N_STAGING


def test_a_due_death_check_runs_inside_the_common_case(pool, monkeypatch):
    """With the periodic look at messages and deaths due at every call, ``next()`` over READY
    slots still never enters the delivery's waiting ``next``: it polls, notices a worker that
    was SIGKILLed meanwhile, restarts it, and delivers a READY batch in the same call."""
    monkeypatch.setattr(delivery_ring, "CHECK_EVERY_NS", 0)
    delivery = pool._delivery
    delivery.next_check = 0  # (the fixture's first next() put it an hour ahead)
    ring = delivery.ring
    wait_for(lambda: states(ring).count(READY) == N_STAGING - 1, what="every other slot READY")
    entered = []
    waiting_next = delivery.next
    delivery.next = lambda *args: entered.append(args) or waiting_next(*args)
    pid, sentinel = pool.worker_pids[0], delivery.workers()[0].proc.sentinel
    os.kill(pid, signal.SIGKILL)
    # (under forkserver the sentinel says so a little after the process is gone)
    wait_for(lambda: multiprocess.connection.wait([sentinel], timeout=0), what="the death")
    with counting_channel_calls(pool) as counts:
        procs.assert_batch_ok(pool.next(timeout=10), 8)
    assert entered == [] and counts["poll"] >= 1, (entered, dict(counts))
    assert pool.stats()["restarts"] == 1 and pool.worker_pids[0] != pid
    for _ in range(N_STAGING):  # the restarted worker refills what its predecessor lost
        procs.assert_batch_ok(pool.next(timeout=30), 8)


@pytest.mark.parametrize("kwargs, quick", [
    ({}, True),
    ({"output": "torch"}, True),
    ({"selection": "prioritized"}, False),  # importance weights are computed per batch
    ({"selection": selection.Counted(1)}, False),  # the learner chooses the rows
])
def test_which_pools_take_the_common_case(buf, kwargs, quick):
    if kwargs.get("output") == "torch":
        pytest.importorskip("torch")
    with SamplerPool(buf, 8, workers=Workers(1, start_method="fork"), seed=0, **kwargs) as p:
        assert p._delivery.quick is quick
        for _ in range(3):
            procs.assert_batch_ok(p.next(timeout=30), 8)


def test_release_to_a_blocked_worker_sends_one_wake_up_and_it_fills(pool):
    """A worker blocked on its channel (its waiting word set) gets exactly one wake-up (an
    eventfd write, no record) when the learner hands it a slot, and fills the slot; taking the
    batch still polls nothing."""
    ring = pool._delivery.ring
    wait_for(lambda: states(ring).count(READY) == N_STAGING - 1 and ring.waiting(1),
             what="every other slot READY and the worker blocked")
    held = states(ring).index(HELD)
    with counting_channel_calls(pool) as counts:
        procs.assert_batch_ok(pool.next(timeout=10), 8)
    assert dict(counts) == {"wake": 1}, dict(counts)
    wait_for(lambda: ring.state(held) == READY, timeout=10, what="the woken worker's fill")


def test_a_blocked_learner_is_woken_by_the_worker(pool):
    """With no READY slot the learner blocks (its waiting word set) and the worker's hand-back
    wakes it: ``next()`` returns long before the learner's own poll slice would end it."""
    ring = pool._delivery.ring
    wait_for(lambda: states(ring).count(READY) == N_STAGING - 1, what="every other slot READY")
    for _ in range(N_STAGING - 1):  # take every READY batch: the worker refills at 50 ms each
        pool.next(timeout=10)
    waits = []
    with counting_channel_calls(pool) as counts:
        for _ in range(3):
            t0 = time.monotonic()
            procs.assert_batch_ok(pool.next(timeout=10), 8)
            waits.append(time.monotonic() - t0)
    assert counts["poll"] >= 1 and counts["receive"] >= 1, dict(counts)  # it did block
    assert not ring.waiting(LEARNER)
    # A lost wake-up would leave the learner in its poll for POLL_SLICE (0.25 s) every time.
    assert min(waits) < delivery_ring.POLL_SLICE, waits


def test_waiting_word_handshake_in_one_process():
    """``sleeping`` sets the waiter's word (cleared on the way out, also after a close in
    another thread); ``wake_needed`` sees it only inside."""
    arrays = slot_arrays([("x", (2,), "float32")], 4, ())
    ring = StagingRing.create(arrays, 3, {}, n_workers=2)
    try:
        for waiter in (LEARNER, 1, 2):
            assert not ring.wake_needed(waiter)
            with ring.sleeping(waiter):
                assert ring.wake_needed(waiter)
                assert [ring.waiting(w) for w in (0, 1, 2)] == [w == waiter for w in (0, 1, 2)]
            assert not ring.wake_needed(waiter)
        with ring.sleeping(LEARNER):
            ring.close()  # as close() from another thread does; leaving must not raise
    finally:
        ring.close()


class SlowToStart:
    """A pass-through transform whose unpickling, in a worker, takes ``seconds``: the worker
    stays in its start-up (no HELLO yet) that long."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.parent = seconds, os.getpid()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if os.getpid() != self.parent:
            time.sleep(self.seconds)

    def __call__(self, batch: Any) -> Any:
        return batch


def test_closing_a_young_pool_does_not_wait_for_its_workers_to_start(buf, start_method):
    """Workers that have not said HELLO have nothing to finish: close() ends them at once
    instead of waiting out their start-up (a young spawn pool took 0.3-1.8 s to close)."""
    pool = SamplerPool(buf, 8, workers=Workers(2, start_method=start_method), seed=0,
                       transform=SlowToStart(5.0))
    pids = pool.worker_pids
    t0 = time.monotonic()
    pool.close()
    took = time.monotonic() - t0
    assert took < 2.0, f"close() of a young pool took {took:.2f}s"
    for pid in pids:
        assert procs.proc_state(pid) in ("", "Z"), f"worker {pid} still running"


STRACE_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    from tests import pool_procs as procs
    from workers import SamplerPool
    from workers.delivery import ring as delivery_ring
    from workers.config import Workers
    from workers.staging import FILLING, HELD, READY
    delivery_ring.CHECK_EVERY_NS = 3600 * 10**9
    buf = procs.new_buffer(capacity=128, lanes=2)
    pool = SamplerPool(buf, 8, workers=Workers(1, staging=6, start_method="fork"),
                       seed=0, transform=procs.Sleep(0.05))
    ring = pool._delivery.ring
    states = lambda: [ring.state(s) for s in range(ring.n_slots)]
    print(pool._delivery.slots.take == pool._delivery.slots._take)
    pool.next(timeout=30)
    while states().count(READY) != 5:
        time.sleep(0.001)
    held = states().index(HELD)
    pool.next(timeout=10)
    pid = pool.worker_pids[0]
    while True:
        while ring.state(held) != FILLING:
            time.sleep(0.0005)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.05)
        if ring.state(held) == FILLING:
            break
        os.kill(pid, signal.SIGCONT)
    batches = [None] * 4
    try:
        os.stat("/shmbuf-ready-path-begin")
    except OSError:
        pass
    for i in range(4):
        batches[i] = pool.next(timeout=10)
    try:
        os.stat("/shmbuf-ready-path-end")
    except OSError:
        pass
    os.kill(pid, signal.SIGCONT)
    pool.close()
    buf.close()
""")


@pytest.mark.skipif(shutil.which("strace") is None or sys.platform != "linux",
                    reason="needs strace (Linux)")
@pytest.mark.parametrize("take", ["default", "python"])
def test_strace_sees_no_system_call_in_next_over_ready_slots(tmp_path, take):
    """The kernel's view: between two markers, four ``next()`` calls over READY slots (each
    releasing a batch to a worker that is not waiting) make no system call at all in the
    learner's thread, with the compiled take (where built) and the Python one."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "ready_path.py"
    script.write_text(STRACE_SCRIPT.format(root=root))
    log = tmp_path / "strace.log"
    env = {**os.environ, **({"SHMBUF_TAKE": "python"} if take == "python" else {})}
    run = subprocess.run(["strace", "-o", str(log), sys.executable, str(script)],
                         capture_output=True, text=True, timeout=80, env=env)
    if run.returncode != 0 and "ptrace" in run.stderr:
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [str(take == "python" or learner_ring.Taker is None)]
    lines = log.read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if "shmbuf-ready-path-begin" in line)
    end = next(i for i, line in enumerate(lines) if "shmbuf-ready-path-end" in line)
    between = lines[begin + 1:end]
    assert between == [], "system calls in next() over READY slots:\n" + "\n".join(between)


def test_batches_of_one_slot_share_its_views_but_not_their_validity():
    """Per-slot views are built once: a later batch of the same slot views the same memory, and
    the earlier batch stays released (``ClosedError``), its arrays untouched by the reuse."""
    with procs.new_buffer(capacity=64, lanes=2) as buf, \
            SamplerPool(buf, 4, workers=0, seed=0) as pool:
        first = pool.next()
        keys = sorted(first)
        kept = {k: first[k] for k in keys}
        second = pool.next()
        assert first.released and second.slot == first.slot
        with pytest.raises(ClosedError, match="released"):
            first[keys[0]]
        assert sorted(second) == keys
        for k in keys:
            assert second[k] is kept[k]  # the same slot's view object, built once


def test_a_close_from_another_thread_inside_the_common_case_raises_closed(buf, taker):
    """Another thread closes the pool while ``next()`` hands the held slot back: the learner
    gets ``ClosedError``, not whatever the torn-down ring raised."""
    with SamplerPool(buf, 8, workers=Workers(1, start_method="fork"), seed=0) as p:
        procs.assert_batch_ok(p.next(timeout=30), 8)
        delivery = p._delivery
        assert delivery.quick
        slots = delivery.slots
        take = slots.take
        assert (take == slots._take) == (taker == "python")

        ring = delivery.ring

        def closed_meanwhile(held: Any, t0: int) -> Any:
            closer = threading.Thread(target=p.close)
            closer.start()
            closer.join(timeout=30)
            assert delivery.ring is None and delivery.slots is None  # torn down under it
            return take(held, t0)

        slots.take = closed_meanwhile
        with pytest.raises(ClosedError, match="closed during next"):
            p.next(timeout=10)
        assert ring.seg.buf is None  # unmapped: the held batch was let go of by the close
