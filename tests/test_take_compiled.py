"""The compiled common case of ``SamplerPool.next()`` (``workers._take_c.Taker``, made by
``delivery_ring.make_taker``): driven through the same random sequence of worker hand-backs,
waiting words and takes as ``PythonTaker`` (RingDelivery's own ``_assign``, ``_collect`` and
``_pop_ready``, and ``Delivery.hold``), it returns the same batches, lets go of the same ones and
leaves the same control words, book, generations, per-worker counts and wake-ups. Bad calls
raise and change nothing.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
import weakref
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from shmbuf.errors import ClosedError
from tests import pool_procs as procs
from workers import Batch, SamplerPool, delivery_ring
from workers.batch import BatchFields
from workers.delivery import Delivery
from workers.delivery_ring import PythonTaker, RingDelivery, make_taker
from workers.slot_book import SlotBook
from workers.staging import (
    ASSIGNED,
    FILLING,
    HELD,
    INDICES,
    LANES,
    READY,
    STALE,
    W_GENERATION,
    W_OWNER,
    W_STATE,
    WEIGHTS,
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
    hold = Delivery.hold
    cache_views = Delivery.cache_views

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
        self.plain, self.jax, self.weighted, self.to_device = True, None, False, False
        self.out_fields = ["x"]
        self.views = [self.ring.slot(s) for s in range(n_slots)]
        self.batch_views: dict[int, Any] = {}
        self.released: list[int] = []  # slots of batches let go by Batch.release
        self.held = None

    def close(self) -> None:
        """As the delivery's teardown: the views dropped, then the ring closed."""
        self.views, self.held = [], None
        self.batch_views.clear()
        self.ring.close()

    def release_batch(self, batch: Batch) -> None:
        self.released.append(batch.slot)

    def batch_to(self, batch: Batch, device: Any) -> dict[str, Any]:
        return {}

    def record(self) -> dict[str, Any]:
        ring = self.ring
        words = [[ring.get(s, w) for w in (W_STATE, W_GENERATION, W_OWNER)]
                 for s in range(ring.n_slots)]
        batches, waited = (ring.words[w] for w in ring.stats.delivered_words)
        assert waited >= 0
        return {"words": words, "batches": batches, "assigned": list(self.book.assigned),
                "ready": list(self.book.ready), "gen": list(self.gen),
                "filled": list(self.filled), "woken": list(self.woken),
                "released": list(self.released)}


def same_batch(learner: Learner, batch: Batch) -> tuple[Any, ...]:
    """What ``batch`` is, for comparing across learners: its slot, generation, fields, state,
    and that its arrays are the slot's views in ``learner``'s ring."""
    if batch is None:
        return (None,)
    views = learner.views[batch.slot]
    assert type(batch) is Batch and not batch.released
    assert all(batch[k] is learner.batch_views[batch.slot][0][k] for k in batch)
    for name, view in (("x", batch["x"]), (INDICES, batch.indices), (LANES, batch.lanes),
                       (WEIGHTS, batch.weights)):
        assert np.shares_memory(view, views[name])
    return (batch.slot, batch.generation, list(batch), batch.epoch, batch.ends_epoch,
            batch._to_fn is None)


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
            learner.close()


@pytest.mark.parametrize("twins, steps", [((6, 2), 3000), ((3, 3), 1000), ((300, 7), 1500)],
                         indirect=["twins"])
def test_the_compiled_steps_do_what_the_python_steps_do(twins, steps):
    """Both takers through one random script: workers hand slots back (READY, STALE), start
    filling, block and wake; the learner takes, releasing what it holds (or let go of it
    before, as ``Batch.release`` does). Every result and every record match."""
    (compiled, fast), (python, slow) = twins
    assert type(fast) is delivery_ring.Taker
    rng = np.random.default_rng(0)
    held: list[Any] = [None, None]  # each learner's batch
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
        elif op == 4 and held[0] is not None and not held[0].released:
            for learner, batch in zip((compiled, python), held):  # Batch.release() first
                batch.release()
                learner._assign(batch.slot)
                assert batch.released
            if rng.random() < .5:  # the next take is given None; else the released batch,
                held = [None, None]  # whose slot it must not hand out again
        else:
            got = [taker.take(learner.ring.words, batch, time.perf_counter_ns())
                   for learner, taker, batch in ((compiled, fast, held[0]), (python, slow, held[1]))]
            for batch in held:  # let go of: it raises, and holds no views
                if batch is not None:
                    assert batch.released and batch._data == {} and batch._indices is None
                    with pytest.raises(ClosedError):
                        batch["x"]
            assert same_batch(compiled, got[0]) == same_batch(python, got[1])
            held = got
            if got[0] is not None:
                assert compiled.ring.state(got[0].slot) == HELD
                taken.add(got[0].slot)
        for slot in range(compiled.ring.n_slots):  # what a worker finished, it fills again
            if compiled.ring.state(slot) == FILLING and rng.random() < .3:
                for learner in (compiled, python):
                    learner.ring.set_state(slot, READY)
        assert compiled.record() == python.record()
    record = compiled.record()
    assert len(taken) > compiled.ring.n_slots // 2 and record["woken"] and sum(record["filled"])
    assert record["batches"] > steps // 20 and record["released"]


def test_bad_calls_raise_and_change_nothing(twins):
    (learner, taker), _ = twins
    learner.ring.set_state(1, READY)
    before = learner.record()
    for slot in (6, -2):  # a batch of no slot of the ring: not let go of
        stray = Batch({"x": 0}, None, None, None, learner.release_batch, slot)
        with pytest.raises(IndexError, match=f"held: slot {slot} of 6"):
            taker.take(learner.ring.words, stray, 0)
        assert not stray.released and stray["x"] == 0
    with pytest.raises(ValueError, match="too short"):
        taker.take(learner.ring.words[:4], None, 0)
    fields = BatchFields()  # not a Batch made on the compiled fields
    fields.slot = 0
    for held in (0, "0", fields):
        with pytest.raises(TypeError, match="held: a Batch or None"):
            taker.take(learner.ring.words, held, 0)
    with pytest.raises(BufferError):
        taker.take(bytes(len(learner.ring.words) * 8), None, 0)  # not writable
    assert learner.record() == before
    with pytest.raises(TypeError):
        taker.take(learner.ring.words, None)
    with pytest.raises(ValueError, match="not made"):
        delivery_ring.Taker.__new__(delivery_ring.Taker).take(learner.ring.words, None, 0)
    assert learner.record() == before
    t0 = time.perf_counter_ns()
    assert taker.take(learner.ring.words, None, t0).slot == 1
    waited = learner.ring.words[learner.ring.stats.delivered_words[1]]
    assert 0 <= waited <= time.perf_counter_ns() - t0


def test_a_closed_ring_raises_value_error(twins):
    """The words of a ring closed (by another thread's close) raise ValueError, as the Python
    steps do; ``SamplerPool.next`` says ClosedError."""
    (learner, taker), (python, slow) = twins
    for one, steps in ((learner, taker), (python, slow)):
        words = one.ring.words
        one.close()
        with pytest.raises(ValueError):
            steps.take(words, None, 0)


def test_a_close_during_a_wake_up_raises_value_error_on_both(twins):
    """A close() in another thread can land while the learner sends a wake-up (the send lets
    other threads run): the ring closes (nothing holds its words) and the take raises
    ValueError on both paths, which ``SamplerPool.next`` reports as ClosedError."""
    for learner, steps in twins:
        first = steps.take(learner.ring.words, None, 0)
        assert first is None  # nothing handed back yet
        learner.ring.set_state(0, READY)
        batch = steps.take(learner.ring.words, None, 0)
        assert batch.slot == 0
        learner.ring.set_waiting(1, True)  # slot 0's worker sleeps
        learner.children.children[0].wake = lambda slot, gen, learner=learner: learner.close()
        with pytest.raises(ValueError):
            steps.take(learner.ring.words, batch, 0)
        assert learner.gen[0] > 0 and 0 in learner.book.assigned  # handed out before the wake
        assert batch.released and learner.ring.seg.buf is None  # nothing kept the ring mapped


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
            learner.filled, learner.tickets, print, Batch, learner.batch_views,
            learner.cache_views, learner.release_batch, None]
    for i, bad, error in [(1, ring.generation_words[:-1], ValueError),
                          (3, ring.waiter_words[:-1], ValueError),
                          (8, learner.gen[:-1], ValueError), (9, [], ValueError),
                          (0, [-1] * ring.n_slots, ValueError), (4, (0, -1), ValueError),
                          (6, [], TypeError), (12, BatchFields, TypeError),
                          (12, dict, TypeError), (13, [], TypeError)]:
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


def test_a_taker_and_its_delivery_are_collected():
    """The Taker refers to its delivery's records and calls, which refer back to it: the
    collector sees the cycle (a Taker it could not see kept every closed pool's delivery)."""
    if delivery_ring.Taker is None:
        pytest.skip("workers._take_c was not built")
    learner = Learner(6, 2)
    gone = weakref.ref(learner)
    learner.taker = make_taker(learner, learner.ring)
    learner.close()
    del learner
    gc.collect()
    assert gone() is None


@pytest.mark.timeout(60)
def test_a_closed_pool_is_collected_with_its_batches_let_go():
    """A closed pool's delivery drops its Taker (whose wake-up and records refer back to it),
    is collected, and the last batch it gave raises."""
    with procs.new_buffer(capacity=64) as buf:
        with SamplerPool(buf, batch_size=4, n_workers=1, start_method="fork", seed=0) as pool:
            batch = pool.next(timeout=30)
            delivery = weakref.ref(pool._delivery)
        assert pool._delivery.taker is None
        with pytest.raises(ClosedError):
            batch.indices  # noqa: B018 (the property raises)
        del pool
        gc.collect()
        assert delivery() is None


@pytest.mark.timeout(120)
def test_without_the_extension_batches_are_made_in_python(tmp_path):
    """Where ``_take_c`` was not built, ``Batch`` is made on ``BatchFields`` and a quick pool
    takes with ``PythonTaker``: the same batches, released the same way."""
    script = tmp_path / "plain.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {os.getcwd()!r})
sys.modules["workers._take_c"] = None  # as if it were not built: its import raises
from shmbuf.errors import ClosedError
from tests import pool_procs as procs
from workers import SamplerPool
from workers.batch import Batch, BatchFields
from workers.delivery_ring import PythonTaker
assert Batch.__mro__[1] is BatchFields
with procs.new_buffer(capacity=64) as buf, \\
        SamplerPool(buf, batch_size=4, n_workers=1, start_method="fork", seed=0) as pool:
    assert type(pool._delivery.taker) is PythonTaker
    last = None
    for _ in range(20):
        batch = pool.next(timeout=30)
        procs.assert_batch_ok(batch, 4)
        assert last is None or (last.released and last._data == {{}})
        last = batch
    try:
        last.release()
        last["obs"]
    except ClosedError:
        print("ok")
""")
    import subprocess
    import sys
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0 and done.stdout.split() == ["ok"], done.stderr


def test_records_shortened_under_it_raise_not_crash(twins):
    """The records are Python lists the delivery owns: shortened (a bug elsewhere), the take
    raises IndexError instead of reading past them."""
    (learner, taker), _ = twins
    learner.ring.set_state(1, READY)
    del learner.filled[:]
    with pytest.raises(IndexError):
        taker.take(learner.ring.words, None, 0)
    learner.filled[:] = [0, 0]
    del learner.gen[:]
    with pytest.raises(IndexError):
        taker.take(learner.ring.words, None, 0)
