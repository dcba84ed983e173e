"""Queue mode (``SamplerPool(selection=Queue())``): every transition delivered exactly once, oldest
first within its lane, with writers waiting while a lane holds ``capacity`` undelivered rows.

What is proved here, under fork, forkserver and spawn where a process is involved:
- several actor processes write self-checking rows (lane, index, checksum) while two sampler
  workers gather them, and sampler workers and actors are SIGKILLed at random (a restarted
  actor takes its lane over): no row is delivered twice, none is torn, each lane's rows come
  in order with no gap, and at the end every committed row but a last partial batch came out;
- a writer "blocks, then unblocks": it waits while the queue is full (and, timing out, writes
  nothing), and goes on as the learner takes batches;
- a writer blocked by a full queue is released when the pool closes; when the learner process
  is SIGKILLed the queue outlives it: the writer waits until a new queue pool resumes it;
- a new learner resumes the queue after the rows an earlier one released (SIGKILLed, closed
  cleanly, or left by an exception): only the batch in a killed learner's hands comes again;
- a ratio (``RateLimit(samples_per_insert=...)``), a retirement count (``Counted``) or a
  sequence plan with ``Queue()`` is a clear error.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import numpy as np
import pytest

import shmbuf
from shmbuf import RateLimit
from shmbuf.sampling import Plan
from tests import pool_procs as procs
from tests._helpers.threads import blocked_in_thread
from workers import ActorGroup, SamplerPool
from workers.config import Workers
from workers.selection import Counted, Queue

pytestmark = pytest.mark.timeout(90)


def _add_one(w) -> int:
    i = w.committed
    w.add(**procs.make_row(w.lane, i))
    return i


def _fill_until_full(w, limit: int = 10_000) -> int:
    """Add rows until the queue holds the writer back (RateLimitTimeout); return how many were
    written. The timed-out call wrote nothing."""
    wrote = 0
    with pytest.raises(shmbuf.RateLimitTimeout, match="queue is full") as info:
        while True:
            _add_one(w)
            wrote += 1
            assert wrote < limit, "the writer was never held back"
    assert "Nothing was written" in str(info.value)
    return wrote


class Ledger:
    """What the learner received, checked as it arrives: whole rows, each (lane, index) once,
    each lane's indices consecutive from where the queue started."""

    def __init__(self, lanes: int, start: np.ndarray | None = None) -> None:
        self.next = np.zeros(lanes, np.int64) if start is None else np.array(start, np.int64)
        self.start = self.next.copy()
        self.rows = 0

    def take(self, batch, batch_size: int) -> None:
        procs.assert_batch_ok(batch, batch_size)  # not torn, and the (lane, index) it claims
        for ln, i in zip(np.asarray(batch.lanes).tolist(), np.asarray(batch.indices).tolist()):
            assert i == self.next[ln], (
                f"lane {ln}: got index {i}, expected {int(self.next[ln])} "
                f"({'a duplicate' if i < self.next[ln] else 'a gap'} or out of order)")
            self.next[ln] += 1
        self.rows += len(np.asarray(batch.indices))

    def drain(self, pool: SamplerPool, batch_size: int, timeout: float = 1.0,
              batches: int | None = None) -> None:
        """Take batches until none comes within ``timeout`` (or ``batches`` were taken)."""
        taken = 0
        while batches is None or taken < batches:
            try:
                self.take(pool.next(timeout=timeout), batch_size)
            except shmbuf.Timeout:
                return
            taken += 1


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, error, match", [
    (lambda: {"limit": RateLimit(1, 1.0, 64)}, ValueError, r"Queue\(\) is its own rate limiter"),
    (lambda: {"selection": Counted(2, Queue())}, TypeError,
     r"Counted\(of=Queue\(\)\): counts rows drawn by Uniform\(\) or Prioritized"),
    (lambda: {"plan": Plan(sequence_length=4)}, ValueError,
     r"Queue\(\) delivers single stored transitions.*Uniform\(\) or Prioritized\(\)"),
], ids=["ratio", "counted", "sequences"])
def test_queue_rejects_options_it_cannot_honour(kw, error, match):
    """``Queue()`` is its own rate limiter: a ratio with it is a clear error naming the fix; so
    is a retirement count (a queue delivers each row once: ``Counted`` counts only uniform or
    prioritized draws), and a sequence plan."""
    with procs.new_buffer(capacity=32, lanes=1) as buf:
        with pytest.raises(error, match=match):
            SamplerPool(buf, batch_size=8, **{"selection": Queue(), "workers": 0, **kw()})
        # nothing stayed configured: writers are not held back
        with buf.writer(lane=0, insert_timeout=0.5) as w:
            for _ in range(100):
                _add_one(w)


def test_a_second_queue_on_the_same_buffer_is_refused():
    with procs.new_buffer(capacity=32, lanes=1) as buf, \
         SamplerPool(buf, batch_size=8, selection=Queue(), workers=0):
        with pytest.raises(shmbuf.ShmbufError, match="already rate-limits"):
            SamplerPool(buf, batch_size=8, selection=Queue(), workers=0)


# --------------------------------------------------------------------------------------------
# Exactly once, oldest first: in-process
# --------------------------------------------------------------------------------------------
def test_in_process_every_row_exactly_once_oldest_first():
    """Three lanes, rows written between batches in uneven amounts: every row is delivered
    once, each lane in index order; a last partial batch waits until enough rows exist."""
    B = 8
    with procs.new_buffer(capacity=32, lanes=3, rows=0) as buf, \
         SamplerPool(buf, batch_size=B, selection=Queue(), workers=0) as pool:
        ledger = Ledger(3)
        rng = np.random.default_rng(0)
        writers = [buf.writer(lane=k) for k in range(3)]
        try:
            for _ in range(60):
                for w in writers:
                    for _ in range(int(rng.integers(0, 5))):
                        _add_one(w)
                while int(buf.committed().sum()) - ledger.rows >= B:
                    ledger.take(pool.next(timeout=5), B)
            with pytest.raises(shmbuf.Timeout):  # fewer than a batch pending: it waits
                pool.next(timeout=0.1)
            committed = int(buf.committed().sum())
            assert committed - ledger.rows < B
            for _ in range((-committed) % B):  # top up to a whole batch: the rest comes out
                _add_one(writers[0])
            ledger.drain(pool, B, timeout=0.2)
            np.testing.assert_array_equal(ledger.next, buf.committed())
        finally:
            for w in writers:
                w.close()


def test_a_queue_started_on_a_wrapped_buffer_begins_at_its_oldest_row():
    """Rows already in the buffer are queued from the oldest still held: after 40 rows into
    a 16-row lane, the queue delivers 24..39 first."""
    with procs.new_buffer(capacity=16, lanes=1, rows=0) as buf:
        procs.fill(buf, 40)
        with SamplerPool(buf, batch_size=8, selection=Queue(), workers=0) as pool:
            ledger = Ledger(1, start=[24])
            ledger.drain(pool, 8, timeout=0.2)
            assert ledger.next[0] == 40


# --------------------------------------------------------------------------------------------
# Blocks, then unblocks
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_workers", [0, 1])
def test_writer_blocks_while_the_queue_is_full_then_unblocks(n_workers, start_method):
    """A lane of 32 rows: the writer fills the queue and is then held back (a timed-out add
    writes nothing). A row is consumed when the learner releases its batch (its next
    ``next()``), not when a worker stages it: the batch in the learner's hands still holds its
    rows back, and the one before it gives them up. The rows that come out are the oldest,
    each once."""
    if n_workers == 0 and start_method != "fork":
        pytest.skip("in-process mode starts no process")
    B = 8
    with procs.new_buffer(capacity=32, lanes=1, rows=0) as buf, \
         SamplerPool(buf, batch_size=B, selection=Queue(),
                     workers=Workers(n_workers, staging=2 if n_workers else None,
                                     start_method=start_method)) as pool, \
         buf.writer(lane=0, insert_timeout=0.3) as w:
        consumed = buf.storage.limiter.consumed
        ledger = Ledger(1)
        wrote = _fill_until_full(w)
        assert wrote == 32
        committed = w.committed
        with pytest.raises(shmbuf.RateLimitTimeout):
            _add_one(w)
        assert w.committed == committed == int(buf.committed(0))
        ledger.take(pool.next(timeout=30), B)  # held, not released: nothing consumed yet
        assert consumed()[0] == 0
        with pytest.raises(shmbuf.RateLimitTimeout):
            _add_one(w)
        ledger.take(pool.next(timeout=30), B)  # releases the first batch
        assert consumed()[0] == B
        wrote += _fill_until_full(w)
        assert wrote == 32 + B, wrote
        assert w.committed - consumed()[0] == 32
        # Blocks, then unblocks when the learner releases the batch it holds.
        w.timeout = 20
        t, out = blocked_in_thread(lambda: _add_one(w), "the writer did not wait for room")
        ledger.take(pool.next(timeout=30), B)
        t.join(10)
        assert out == [wrote], out
        w.timeout = 0.3
        ledger.drain(pool, B, timeout=0.5)
        assert ledger.next[0] == (w.committed // B) * B


def test_closing_the_pool_releases_a_writer_blocked_by_a_full_queue(start_method):
    """``close()`` lifts the queue: a writer blocked by it goes on at once, and afterwards the
    lane is an ordinary ring again (it overwrites undelivered rows without waiting)."""
    with procs.new_buffer(capacity=32, lanes=1, rows=0) as buf, \
         buf.writer(lane=0, insert_timeout=0.3) as w:
        pool = SamplerPool(buf, batch_size=8, selection=Queue(),
                           workers=Workers(1, staging=2, start_method=start_method))
        try:
            _fill_until_full(w)
            w.timeout = 20
            t, out = blocked_in_thread(lambda: _add_one(w), "the writer was not blocked")
        finally:
            t0 = time.monotonic()
            pool.close()
        t.join(5)
        assert out and isinstance(out[0], int), out
        assert time.monotonic() - t0 < 3
        w.timeout = 0.3
        for _ in range(100):
            _add_one(w)


def test_a_sigkilled_learners_queue_holds_its_writer_until_a_new_learner_resumes_it(
        start_method):
    """The learner's process dies by SIGKILL while a writer waits on its full queue. The queue
    outlives it: the writer goes on waiting (overwriting would lose rows nobody consumed) and
    the learner's workers exit. A new queue pool resumes it at the oldest row not consumed
    (the dead learner took nothing: row 0), and once it releases its first batch the writer
    goes on."""
    with procs.new_buffer(capacity=32, lanes=1, rows=0) as buf, \
         procs.pool_process(buf, start_method, batch_size=8, selection=Queue(),
                            workers=Workers(1, staging=2)) as (learner, info):
        with buf.writer(lane=0, insert_timeout=0.3) as w:
            deadline = time.monotonic() + 20  # the queue starts once the pool exists
            wrote = 0
            while True:
                try:
                    _add_one(w)
                    wrote += 1
                except shmbuf.RateLimitTimeout:
                    break
                assert time.monotonic() < deadline and wrote < 10_000
            w.timeout = 30
            t, out = blocked_in_thread(lambda: _add_one(w), "the writer was not blocked")
            os.kill(info["pid"], signal.SIGKILL)
            assert procs.wait_dead(info["workers"], 5) == []
            t.join(1.5)
            assert t.is_alive() and not out, "the writer overwrote rows nobody consumed"
            with SamplerPool(buf, batch_size=8, selection=Queue(), workers=0) as pool:
                ledger = Ledger(1)
                ledger.take(pool.next(timeout=5), 8)  # rows 0..7, held: still nothing consumed
                t.join(0.5)
                assert t.is_alive()
                ledger.take(pool.next(timeout=5), 8)  # releases 0..7: the writer goes on
                t.join(10)
                assert out == [32], out
                assert ledger.next[0] == 16


@pytest.mark.parametrize("n_workers", [0, 2])
def test_a_new_learner_resumes_after_a_sigkilled_one(n_workers, start_method):
    """Rows 0..199 in one lane, no writer. Learner A (its own process) takes three batches
    (rows 0..29, the last one still in its hands) and is SIGKILLed. Learner B opens a queue
    pool on the buffer: the batch A held comes again (at least once for that batch), then
    30.. onward; nothing A released comes again, and every row comes."""
    if n_workers == 0 and start_method != "fork":
        pytest.skip("the learners' own processes are spawned; B runs no worker")
    with procs.new_buffer(capacity=256, lanes=1, rows=0) as buf:
        procs.fill(buf, 200)
        with procs.pool_process(buf, start_method, take=3, batch_size=10, selection=Queue(),
                                workers=2) as (learner, info):
            assert [ix for _, ix in info["taken"]] == [list(range(k, k + 10))
                                                         for k in (0, 10, 20)]
            os.kill(info["pid"], signal.SIGKILL)
            learner.join(10)
        with SamplerPool(buf.name, batch_size=10, selection=Queue(),
                         workers=Workers(n_workers, start_method=start_method)) as pool:
            ledger = Ledger(1, start=[20])
            ledger.take(pool.next(timeout=30), 10)  # (workers starting up)
            ledger.drain(pool, 10, timeout=0.5)
            assert ledger.next[0] == 200


@pytest.mark.parametrize("n_workers", [0, 2])
def test_a_new_learner_resumes_after_a_clean_close(n_workers, start_method):
    """A clean ``close()`` consumes the batch in the learner's hands: the next queue pool starts
    right after it. Leaving the pool's ``with`` block by an exception does not: that batch
    comes again, as after a crash."""
    if n_workers == 0 and start_method != "fork":
        pytest.skip("in-process mode starts no process")
    kwargs = dict(batch_size=10, selection=Queue(),
                  workers=Workers(n_workers, start_method=start_method))
    with procs.new_buffer(capacity=256, lanes=1, rows=0) as buf:
        procs.fill(buf, 200)
        with SamplerPool(buf, **kwargs) as pool:
            Ledger(1).drain(pool, 10, timeout=30, batches=3)
        assert buf.storage.limiter.consumed().tolist() == [30]
        with pytest.raises(KeyError), SamplerPool(buf, **kwargs) as pool:
            ledger = Ledger(1, start=[30])
            ledger.take(pool.next(timeout=5), 10)
            raise KeyError("the training step failed")
        assert buf.storage.limiter.consumed().tolist() == [30]
        with SamplerPool(buf, **kwargs) as pool:
            ledger = Ledger(1, start=[30])
            ledger.take(pool.next(timeout=30), 10)  # (workers starting up)
            ledger.drain(pool, 10, timeout=0.5)
            assert ledger.next[0] == 200


# --------------------------------------------------------------------------------------------
# Exactly once under several writers, several workers and kills
# --------------------------------------------------------------------------------------------
def test_exactly_once_with_several_writers_workers_and_kills(start_method):
    """Three actor processes extend self-checking rows into their lanes while two sampler
    workers gather and the learner takes batches; every ~0.25 s a random sampler worker or
    actor is SIGKILLed (six kills, both kinds). Workers are restarted by the pool, actors by
    the group, a new actor taking its lane over at the lane's ``committed`` index. Checked as
    rows arrive: no row is torn, none comes twice, each lane's indices are consecutive from 0
    (oldest first, no gaps). At the end, with the actors stopped, every committed row except
    a last partial batch has been delivered."""
    B, lanes = 8, 3
    rng = np.random.default_rng(2024)
    with procs.new_buffer(capacity=64, lanes=lanes, rows=0) as buf, \
         SamplerPool(buf, batch_size=B, selection=Queue(),
                     workers=Workers(2, staging=4, start_method=start_method,
                                     max_restarts_per_minute=100)) as pool:
        ledger = Ledger(lanes)
        kills = {"worker": 0, "actor": 0}
        with ActorGroup(functools.partial(procs.lane_writer, chunk=4, pause=0.001), lanes, buf,
                        start_method=start_method, seed=0, max_restarts_per_minute=100) as group:
            deadline = time.monotonic() + 60
            next_kill = time.monotonic() + 0.3
            taken_over: dict[int, int] = {}  # lane of a killed actor -> its committed then

            def done() -> bool:
                return (sum(kills.values()) >= 6 and ledger.rows >= 1500
                        and all(ledger.next[k] > mark + 16 for k, mark in taken_over.items()))

            while not done():
                assert time.monotonic() < deadline, (ledger.rows, kills, taken_over)
                ledger.take(pool.next(timeout=30), B)
                group.poll()
                n_kills = sum(kills.values())
                if n_kills < 6 and time.monotonic() >= next_kill:
                    kind = ("worker", "actor")[n_kills % 2]
                    if kind == "worker":  # a started worker (not one still starting up)
                        ready = [w.proc.pid for w in pool._delivery.workers()
                                 if w.hello and w.proc.is_alive()]
                        victims = [(pid, None) for pid in ready]
                    else:
                        victims = [(pid, k) for k, pid in enumerate(group.pids)
                                   if pid and procs.pid_alive(pid)]
                    if victims:
                        pid, lane = victims[int(rng.integers(len(victims)))]
                        os.kill(pid, signal.SIGKILL)
                        kills[kind] += 1
                        if lane is not None:
                            taken_over[lane] = int(buf.committed(lane))
                        next_kill = time.monotonic() + 0.25
            group.stop()
            assert group.restarts >= kills["actor"] == 3
        ledger.drain(pool, B, timeout=1.0)
        committed = buf.committed()
        undelivered = committed - ledger.next
        assert (undelivered >= 0).all()
        assert int(undelivered.sum()) < B, (committed, ledger.next)
        assert pool.stats()["restarts"] == kills["worker"]
