"""The compiled common case of ``SamplerPool.next()`` (``workers._take_c.Taker``, made by
``delivery_ring.make_taker``): driven through the same random sequence of worker hand-backs,
waiting words and takes as ``PythonTaker`` (RingDelivery's own ``_assign``, ``_collect`` and
``_pop_ready``), it returns the same slots and leaves the same control words, book, generations,
per-worker counts and wake-ups. Bad calls raise and change nothing.
"""

from __future__ import annotations

import itertools
import os
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests import pool_procs as procs
from workers import SamplerPool, delivery_ring
from workers.delivery_ring import PythonTaker, RingDelivery, make_taker
from workers.slot_book import SlotBook
from workers.staging import (
    ASSIGNED,
    FILLING,
    HELD,
    READY,
    STALE,
    W_GENERATION,
    W_OWNER,
    W_STATE,
    StagingRing,
    slot_arrays,
)


class Learner:
    """The records ``take_ready``'s steps change, on a staging ring of its own (no workers: the
    test stores what they would). The Python steps are RingDelivery's methods on these."""

    _assign = RingDelivery._assign
    _collect = RingDelivery._collect
    _pop_ready = RingDelivery._pop_ready
    _live_ring = RingDelivery._live_ring

    def __init__(self, n_slots: int, n_workers: int) -> None:
        self.ring = StagingRing.create(slot_arrays([("x", (2,), "float32")], 4, ()), n_slots,
                                       {}, n_workers=n_workers)
        self.cfg = SimpleNamespace(ordered=False)
        self.book = SlotBook(False)
        self.gen = [0] * n_slots
        self.tickets = itertools.count(1)
        self.filled = [0] * n_workers
        self.n_workers, self.selects = n_workers, False
        self.woken: list[tuple[int, int, int]] = []
        self.children = SimpleNamespace(children=[
            SimpleNamespace(wake=lambda slot, gen, w=w: self.woken.append((w, slot, gen)))
            for w in range(n_workers)])
        for slot in range(n_slots):
            self._assign(slot)

    def record(self) -> dict[str, Any]:
        ring = self.ring
        words = [[ring.get(s, w) for w in (W_STATE, W_GENERATION, W_OWNER)]
                 for s in range(ring.n_slots)]
        batches, waited = (ring.words[w] for w in ring.stats.delivered_words)
        assert waited >= 0
        return {"words": words, "batches": batches, "assigned": list(self.book.assigned),
                "ready": list(self.book.ready), "gen": list(self.gen),
                "filled": list(self.filled), "woken": list(self.woken)}


@pytest.fixture
def twins(request):
    """A learner whose steps are compiled and one whose steps are Python, alike so far."""
    if delivery_ring.Taker is None:
        pytest.skip("workers._take_c was not built")
    n_slots, n_workers = getattr(request, "param", (6, 2))
    made = [Learner(n_slots, n_workers) for _ in range(2)]
    compiled, python = made
    try:
        yield (compiled, make_taker(compiled, compiled.ring)), (python, PythonTaker(python))
    finally:
        for learner in made:
            learner.ring.close()


@pytest.mark.parametrize("twins, steps", [((6, 2), 3000), ((3, 3), 1000), ((300, 7), 1500)],
                         indirect=["twins"])
def test_the_compiled_steps_do_what_the_python_steps_do(twins, steps):
    """Both takers through one random script: workers hand slots back (READY, STALE), start
    filling, block and wake; the learner takes, releasing what it holds (or let go of it
    before, as ``Batch.release`` does). Every result and every record match."""
    (compiled, fast), (python, slow) = twins
    assert type(fast) is delivery_ring.Taker
    rng = np.random.default_rng(0)
    held: int | None = None
    taken = set()
    for _ in range(steps):
        op = rng.integers(6)
        slot = int(rng.integers(compiled.ring.n_slots))
        if op <= 1 and compiled.ring.state(slot) == ASSIGNED:  # a worker hands it back
            state = READY if op == 0 or rng.random() < .9 else STALE
            for learner in (compiled, python):
                learner.ring.set_state(slot, state)
        elif op == 2 and compiled.ring.state(slot) == ASSIGNED:
            for learner in (compiled, python):
                learner.ring.set_state(slot, FILLING)
        elif op == 3:  # a worker starts or stops waiting
            waiter = 1 + int(rng.integers(compiled.n_workers))
            for learner in (compiled, python):
                learner.ring.set_waiting(waiter, not learner.ring.waiting(waiter))
        elif op == 4 and held is not None:  # Batch.release() before the next take
            for learner in (compiled, python):
                learner._assign(held)
            held = None
        else:
            release = -1 if held is None else held
            got = [taker.take(learner.ring.words, release, time.perf_counter_ns())
                   for learner, taker in ((compiled, fast), (python, slow))]
            assert got[0] == got[1]
            held = got[0]
            if held is not None:
                assert compiled.ring.state(held) == HELD
                taken.add(held)
        for slot in range(compiled.ring.n_slots):  # what a worker finished, it fills again
            if compiled.ring.state(slot) == FILLING and rng.random() < .3:
                for learner in (compiled, python):
                    learner.ring.set_state(slot, READY)
        assert compiled.record() == python.record()
    record = compiled.record()
    assert len(taken) > compiled.ring.n_slots // 2 and record["woken"] and sum(record["filled"])
    assert record["batches"] > steps // 20


def test_bad_calls_raise_and_change_nothing(twins):
    (learner, taker), _ = twins
    learner.ring.set_state(1, READY)
    before = learner.record()
    with pytest.raises(IndexError, match="release: slot 6 of 6"):
        taker.take(learner.ring.words, 6, 0)
    with pytest.raises(IndexError):
        taker.take(learner.ring.words, -2, 0)
    with pytest.raises(ValueError, match="too short"):
        taker.take(learner.ring.words[:4], -1, 0)
    with pytest.raises(TypeError):
        taker.take(learner.ring.words, "0", 0)
    with pytest.raises(BufferError):
        taker.take(bytes(len(learner.ring.words) * 8), -1, 0)  # not writable
    assert learner.record() == before
    with pytest.raises(TypeError):
        taker.take(learner.ring.words, -1)
    assert learner.record() == before
    t0 = time.perf_counter_ns()
    assert taker.take(learner.ring.words, -1, t0) == 1
    waited = learner.ring.words[learner.ring.stats.delivered_words[1]]
    assert 0 <= waited <= time.perf_counter_ns() - t0


def test_a_closed_ring_raises_value_error(twins):
    """The words of a ring closed (by another thread's close) raise ValueError, as the Python
    steps do; ``SamplerPool.next`` says ClosedError."""
    (learner, taker), (python, slow) = twins
    for one, steps in ((learner, taker), (python, slow)):
        words = one.ring.words
        one.ring.close()
        with pytest.raises(ValueError):
            steps.take(words, -1, 0)


def test_a_close_during_a_wake_up_raises_value_error_on_both(twins):
    """A close() in another thread can land while the learner sends a wake-up (the send lets
    other threads run): the ring closes (nothing holds its words) and the take raises
    ValueError on both paths, which ``SamplerPool.next`` reports as ClosedError."""
    for learner, steps in twins:
        first = steps.take(learner.ring.words, -1, 0)
        assert first is None  # nothing handed back yet
        learner.ring.set_state(0, READY)
        assert steps.take(learner.ring.words, -1, 0) == 0
        learner.ring.set_waiting(1, True)  # slot 0's worker sleeps
        ring = learner.ring
        learner.children.children[0].wake = lambda slot, gen, ring=ring: ring.close()
        with pytest.raises(ValueError):
            steps.take(ring.words, 0, 0)
        assert learner.gen[0] > 0 and 0 in learner.book.assigned  # handed out before the wake


def test_an_ordered_pool_takes_its_steps_in_python(twins):
    """Ordered delivery takes slots in assignment order: ``make_taker`` gives it the Python
    steps (the compiled ones take them as they come)."""
    (learner, _), _ = twins
    learner.cfg.ordered = True
    assert type(make_taker(learner, learner.ring)) is PythonTaker


def test_made_with_mismatched_records_it_refuses(twins):
    (learner, _), _ = twins
    ring, book = learner.ring, learner.book
    args = [ring.state_words, ring.generation_words, ring.owner_words, ring.waiter_words,
            ring.stats.delivered_words, (ASSIGNED, READY, STALE, HELD), book.assigned, book.ready, learner.gen,
            learner.filled, learner.tickets, print]
    for i, bad, error in [(1, ring.generation_words[:-1], ValueError),
                          (3, ring.waiter_words[:-1], ValueError),
                          (8, learner.gen[:-1], ValueError), (9, [], ValueError),
                          (0, [-1] * ring.n_slots, ValueError), (4, (0, -1), ValueError),
                          (6, [], TypeError)]:
        with pytest.raises(error):
            delivery_ring.Taker(*args[:i], bad, *args[i + 1:])
    made = delivery_ring.Taker(*args)
    with pytest.raises(TypeError, match="made once"):
        made.__init__(*args)
    half = delivery_ring.Taker.__new__(delivery_ring.Taker)
    with pytest.raises(ValueError):  # its records taken, then the counts refused
        half.__init__(*args[:9], [], *args[10:])
    with pytest.raises(TypeError, match="made once"):
        half.__init__(*args)


@pytest.mark.timeout(60)
def test_ci_builds_the_compiled_take():
    """Where ``SHMBUF_REQUIRE_COMPILED`` is set (``.ci/run``), ``_take_c`` must have been built
    and a quick pool must take its steps with it."""
    if not os.environ.get("SHMBUF_REQUIRE_COMPILED"):
        pytest.skip("SHMBUF_REQUIRE_COMPILED is not set")
    assert delivery_ring.Taker is not None
    with procs.new_buffer(capacity=64) as buf, \
            SamplerPool(buf, batch_size=4, n_workers=1, start_method="fork", seed=0) as pool:
        procs.assert_batch_ok(pool.next(timeout=30), 4)
        assert type(pool._delivery.taker) is delivery_ring.Taker
