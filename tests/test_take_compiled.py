"""The compiled common case of ``SamplerPool.next()`` (``workers._take_c.Taker``, behind
``LearnerRing.take``): driven through the same random script of worker hand-backs, waiting
words, releases, stale batches, deaths and takes as ``LearnerRing._take`` (the Python steps), it
returns the same batches, lets go of the same ones and leaves the same ring words, records
(tickets, statuses, places, per-worker counts) and wake-ups. Bad calls raise and change nothing;
records written wrong cannot make it write out of bounds.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import weakref
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from shmbuf.errors import ClosedError
from tests import pool_procs as procs
from workers import Batch, SamplerPool, learner_ring
from workers.batch import BatchFields
from workers.config import Workers
from workers.learner_ring import RECORD_FIELDS, STATUSES, H, LearnerRing, compiled_taker
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
    """A staging ring of its own and its ``LearnerRing`` (no workers: the test stores what they
    would), taking with the compiled steps or the Python ones."""

    def __init__(self, n_slots: int, n_workers: int, ordered: bool, compiled: bool) -> None:
        self.ring = StagingRing.create(slot_arrays([("x", (2,), "float32")], 4, ()), n_slots,
                                       {}, n_workers=n_workers)
        self.woken: list[int] = []
        self.slots = LearnerRing(self.ring, n_workers, ordered, self.woken.append)
        for slot in range(n_slots):
            self.slots.hand_out(slot)
        self.views = [self.ring.slot(s) for s in range(n_slots)]
        self.released: list[int] = []  # slots of batches let go by Batch.release
        self.slots.deliver_as([Batch({"x": v["x"]}, v[INDICES], v[LANES], v[WEIGHTS],
                                     self.release_batch, s, 0, None)
                               for s, v in enumerate(self.views)])
        if not compiled:
            self.slots.take = self.slots._take
        self.n_workers = n_workers

    def close(self) -> None:
        """As the delivery's teardown: the records and views dropped, then the ring closed."""
        self.slots.close()
        self.views = []
        self.ring.close()

    def release_batch(self, batch: Batch) -> None:
        self.released.append(batch.slot)

    def record(self) -> dict[str, Any]:
        ring = self.ring
        words = [[ring.get(s, w) for w in (W_STATE, W_GENERATION, W_OWNER)]
                 for s in range(ring.n_slots)]
        batches, waited = (ring.words[w] for w in ring.stats.delivered_words)
        assert waited >= 0
        return {"words": words, "batches": batches, "records": self.slots.records.tolist(),
                "woken": list(self.woken), "released": list(self.released)}


def same_batch(learner: Learner, batch: Batch | None) -> tuple[Any, ...]:
    """What ``batch`` is, for comparing across learners: its slot, generation, fields, state,
    and that its arrays are the slot's views in ``learner``'s ring."""
    if batch is None:
        return (None,)
    views = learner.views[batch.slot]
    assert type(batch) is Batch and not batch.released
    assert batch["x"] is learner.slots.templates[batch.slot]["x"]
    for name, view in (("x", batch["x"]), (INDICES, batch.indices), (LANES, batch.lanes),
                       (WEIGHTS, batch.weights)):
        assert np.shares_memory(view, views[name])
    assert batch.generation == learner.slots.generation(batch.slot)
    return (batch.slot, batch.generation, list(batch), batch.epoch, batch.ends_epoch,
            batch._to_fn is None)


def needs_compiled() -> None:
    if learner_ring.Taker is None:
        pytest.skip("workers._take_c was not built")


@pytest.fixture
def twins(request):
    """A learner whose steps are compiled and one whose steps are Python, alike so far."""
    needs_compiled()
    n_slots, n_workers, ordered = getattr(request, "param", (6, 2, False))
    made = [Learner(n_slots, n_workers, ordered, compiled) for compiled in (True, False)]
    try:
        yield made
    finally:
        for learner in made:
            learner.close()


@pytest.mark.parametrize("twins, steps", [((6, 2, False), 3000), ((6, 2, True), 3000),
                                          ((3, 3, False), 1000), ((300, 7, False), 1500),
                                          ((40, 7, True), 1500)], indirect=["twins"])
def test_the_compiled_steps_do_what_the_python_steps_do(twins, steps):
    """Both learners through one random script: workers hand slots back (READY, STALE), start
    filling, block and wake, die (their slots reclaimed and handed out again in their
    places); the learner takes, releasing what it holds (or let go of it before, as
    ``Batch.release`` does), and hands stale slots out again. Every result and record match."""
    compiled, python = twins
    assert type(compiled.slots.take.__self__) is learner_ring.Taker
    assert python.slots.take == python.slots._take
    rng = np.random.default_rng(0)
    held: list[Any] = [None, None]  # each learner's batch
    taken, both = set(), (compiled, python)
    for _ in range(steps):
        op = rng.integers(8)
        slot = int(rng.integers(compiled.ring.n_slots))
        if op <= 1 and compiled.ring.state(slot) == ASSIGNED:  # a worker hands it back
            state = READY if op == 0 or rng.random() < .9 else STALE
            for learner in both:
                learner.ring.set_state(slot, state)
        elif op == 2 and compiled.ring.state(slot) == ASSIGNED:
            for learner in both:
                learner.ring.set_state(slot, FILLING)
        elif op == 3:  # a worker starts or stops waiting
            waiter = 1 + int(rng.integers(compiled.n_workers))
            for learner in both:
                learner.ring.set_waiting(waiter, not learner.ring.waiting(waiter))
        elif op == 4 and held[0] is not None and not held[0].released:
            for learner, batch in zip(both, held):  # Batch.release() first
                batch.release()
                learner.slots.hand_out(batch.slot)
                assert batch.released
            if rng.random() < .5:  # the next take is given None; else the released batch,
                held = [None, None]  # whose slot it must not hand out again
        elif op == 5 and rng.random() < .2:  # a worker died: its slots out are reclaimed
            worker = int(rng.integers(compiled.n_workers))
            mine = list(range(worker, compiled.ring.n_slots, compiled.n_workers))
            lost = [learner.slots.reclaim(mine) for learner in both]
            assert lost[0] == lost[1]
            for learner in both:
                for s in lost[0]:  # the restarted worker refills them, in their places
                    learner.slots.hand_out(s, requeue=False)
        elif op == 6:  # stale batches: out again, in their places or at the back
            stale = [learner.slots.stale() for learner in both]
            assert stale[0] == stale[1]
            for s in stale[0]:
                requeue = bool(rng.random() < .5)
                for learner in both:
                    learner.slots.hand_out(s, requeue=requeue)
        else:
            t0 = time.perf_counter_ns()
            got = [learner.slots.take(batch, t0) for learner, batch in zip(both, held)]
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
        for s in range(compiled.ring.n_slots):  # what a worker finished, it fills again
            if compiled.ring.state(s) == FILLING and rng.random() < .3:
                for learner in both:
                    learner.ring.set_state(s, READY)
        assert compiled.record() == python.record()
    record = compiled.record()
    assert len(taken) > compiled.ring.n_slots // 2 and record["woken"]
    assert sum(compiled.slots.filled) and record["batches"] > steps // 20 and record["released"]


def test_bad_calls_raise_and_change_nothing(twins):
    learner, _ = twins
    take = learner.slots.take
    learner.ring.set_state(1, READY)
    before = learner.record()
    for slot in (6, -2):  # a batch of no slot of the ring: not let go of
        stray = Batch({"x": 0}, None, None, None, learner.release_batch, slot)
        with pytest.raises(IndexError, match=f"held: slot {slot} of 6"):
            take(stray, 0)
        assert not stray.released and stray["x"] == 0
    fields = BatchFields()  # not a Batch made on the compiled fields
    fields.slot = 0
    for held in (0, "0", fields):
        with pytest.raises(TypeError, match="held: a Batch or None"):
            take(held, 0)
    with pytest.raises(TypeError):
        take(None, "now")
    assert learner.record() == before
    with pytest.raises(TypeError):
        take(None)
    with pytest.raises(ValueError, match="not made"):
        learner_ring.Taker.__new__(learner_ring.Taker).take(None, 0)
    assert learner.record() == before
    t0 = time.perf_counter_ns()
    assert take(None, t0).slot == 1
    waited = learner.ring.words[learner.ring.stats.delivered_words[1]]
    assert 0 <= waited <= time.perf_counter_ns() - t0


def test_a_closed_ring_raises_value_error(twins):
    """The words of a ring closed (by another thread's close) raise ValueError, as the Python
    steps do; ``SamplerPool.next`` says ClosedError."""
    for learner in twins:
        take = learner.slots.take
        learner.close()  # (its views dropped: the ring is unmapped, the take keeps no view)
        assert learner.ring.seg.buf is None
        with pytest.raises(ValueError):
            take(None, 0)


def test_a_close_during_a_wake_up_raises_value_error_on_both(twins):
    """A close() in another thread can land while the learner wakes a worker (the wake-up lets
    other threads run): the ring closes (nothing holds its words) and the take raises
    ValueError on both paths, which ``SamplerPool.next`` reports as ClosedError."""
    for learner in twins:
        take = learner.slots.take
        assert take(None, 0) is None  # nothing handed back yet
        learner.ring.set_state(0, READY)
        batch = take(None, 0)
        assert batch.slot == 0
        learner.ring.set_waiting(1, True)  # slot 0's worker sleeps
        learner.slots.wake = lambda worker, learner=learner: learner.close()
        if type(take.__self__) is learner_ring.Taker:  # (it was given the wake-up when made)
            learner.slots.deliver_as(learner.slots.templates)
            take = learner.slots.take
        with pytest.raises(ValueError):
            take(batch, 0)
        assert batch.released and learner.ring.seg.buf is None  # nothing kept the ring mapped
        assert learner.slots.status[0] == learner_ring.OUT  # handed out before the wake-up


def test_made_with_mismatched_records_it_refuses(twins):
    """The records are checked when a Taker is made: their header, where each column lies, the
    word indices, one template per slot (each a Batch); a Taker is made once."""
    learner, _ = twins
    slots = learner.slots
    templates = list(slots.templates)
    args = (learner.ring.words, slots.records, templates, print)

    def bad_records(field: str, value: int) -> np.ndarray:
        records = slots.records.copy()
        records[H[field]] = value
        return records

    n = slots.n_slots
    for records, error in [
        (slots.records[:len(RECORD_FIELDS) - 1], ValueError),  # no room for the header
        (bad_records("n_slots", 0), ValueError), (bad_records("n_workers", 0), ValueError),
        (bad_records("ordered", 2), ValueError),
        (bad_records("status", len(slots.records) - n + 1), ValueError),  # past the end
        (bad_records("state_at", 3), ValueError),  # inside the header
        (bad_records("place", -5), ValueError),
        (slots.records.astype(np.int32), TypeError),
        (slots.records[::2], (BufferError, ValueError)),  # not contiguous
        (slots.records.tobytes(), BufferError),  # not writable
    ]:
        with pytest.raises(error):
            learner_ring.Taker(args[0], records, *args[2:])
    negative = slots.records.copy()
    negative[slots.records[H["owner_at"]] + 1] = -1
    with pytest.raises(ValueError, match="owner_at holds a bad word index"):
        learner_ring.Taker(args[0], negative, *args[2:])
    for bad, error in [(templates[:-1], ValueError), ([*templates[:-1], 0], TypeError),
                       (tuple(templates), TypeError)]:
        with pytest.raises(error):
            learner_ring.Taker(args[0], args[1], bad, args[3])
    made = learner_ring.Taker(*args)
    with pytest.raises(TypeError, match="made once"):
        made.__init__(*args)
    half = learner_ring.Taker.__new__(learner_ring.Taker)
    with pytest.raises(ValueError):
        half.__init__(args[0], bad_records("n_slots", 0), *args[2:])
    with pytest.raises(TypeError, match="made once"):
        half.__init__(*args)
    templates.clear()  # (the views they hold: the ring closes unmapped)


def test_its_word_indices_are_its_own_and_bad_records_stay_in_bounds(twins):
    """The compiled take copies the word indices when it is made, and reads the statuses,
    places and counts where they lie: records overwritten with nonsense later (a bug elsewhere)
    change what it delivers, never where it writes."""
    learner, python = twins
    slots = learner.slots
    state_at = slots.records[H["state_at"]]
    slots.records[state_at:state_at + slots.n_slots] = 10**12  # nowhere in the ring
    learner.ring.set_state(2, READY)
    assert slots.take(None, 0).slot == 2  # still the ring's STATE words
    status = slots.records[H["status"]]
    slots.records[status:status + slots.n_slots] = [7, -1, 2**40, 3, 2, 1]  # not statuses
    slots.records[H["ticket"]] = 2**63 - 1  # the next ticket would overflow
    for _ in range(3):
        batch = slots.take(None, 0)
        assert batch is None or 0 <= batch.slot < slots.n_slots
    assert python.slots.take(None, 0) is None  # (the twin is untouched)


def test_the_records_it_reads_are_the_learner_rings_own():
    """``compiled_taker`` gives the compiled take only where it reads these records: a build
    of another layout (or ``SHMBUF_TAKE=python``) gets the Python steps; CI's build matches."""
    module = SimpleNamespace(RECORD_FIELDS=RECORD_FIELDS, STATUSES=STATUSES, Taker=object)
    assert compiled_taker(module, {}) is object
    assert compiled_taker(module, {"SHMBUF_TAKE": "python"}) is None
    assert compiled_taker(None, {}) is None
    for wrong in ({"RECORD_FIELDS": RECORD_FIELDS[::-1]}, {"STATUSES": STATUSES[1:]}):
        assert compiled_taker(SimpleNamespace(**{**vars(module), **wrong}), {}) is None
    if learner_ring.Taker is not None:
        from workers import _take_c

        assert (_take_c.RECORD_FIELDS, _take_c.STATUSES) == (RECORD_FIELDS, STATUSES)


@pytest.mark.timeout(60)
def test_ci_builds_the_compiled_take():
    """Where ``SHMBUF_REQUIRE_COMPILED`` is set (``.ci/run``), ``_take_c`` must have been built
    and a quick pool, ordered or not, must take its steps with it."""
    if not os.environ.get("SHMBUF_REQUIRE_COMPILED"):
        pytest.skip("SHMBUF_REQUIRE_COMPILED is not set")
    assert learner_ring.Taker is not None
    for ordered in (False, True):
        with procs.new_buffer(capacity=64) as buf, \
                SamplerPool(buf, 4, workers=Workers(1, start_method="fork", ordered=ordered),
                            seed=0) as pool:
            procs.assert_batch_ok(pool.next(timeout=30), 4)
            assert type(pool._delivery.slots.take.__self__) is learner_ring.Taker


def test_a_taker_and_its_learner_ring_are_collected():
    """The Taker refers to its ring's words, the records, and templates whose release calls
    refer back to whoever holds the ``LearnerRing``: the collector sees the cycle."""
    needs_compiled()
    learner = Learner(6, 2, False, True)  # learner -> slots.take -> templates -> learner
    gone, ring = weakref.ref(learner), learner.ring
    del learner
    gc.collect()
    assert gone() is None
    ring.close()  # (nothing views it any more)
    assert ring.seg.buf is None


@pytest.mark.timeout(60)
def test_a_closed_pool_is_collected_with_its_batches_let_go():
    """A closed pool's delivery drops its ``LearnerRing`` (whose take and templates refer back
    to it), is collected, and the last batch it gave raises."""
    with procs.new_buffer(capacity=64) as buf:
        with SamplerPool(buf, 4, workers=Workers(1, start_method="fork"), seed=0) as pool:
            batch = pool.next(timeout=30)
            delivery = weakref.ref(pool._delivery)
        assert pool._delivery.slots is None
        with pytest.raises(ClosedError):
            batch.indices  # noqa: B018 (the property raises)
        del pool
        gc.collect()
        assert delivery() is None


PLAIN = """
import sys
sys.path.insert(0, {root!r})
{setup}
from shmbuf.errors import ClosedError
from tests import pool_procs as procs
from workers import SamplerPool
from workers.batch import Batch, BatchFields
from workers.config import Workers
print(Batch.__mro__[1] is BatchFields)
with procs.new_buffer(capacity=64) as buf, \\
        SamplerPool(buf, 4, workers=Workers(1, start_method="fork"), seed=0) as pool:
    slots = pool._delivery.slots
    assert slots.take == slots._take
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
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setup, env, on_fields", [
    ('sys.modules["workers._take_c"] = None', {}, True),  # as if it were not built
    ("", {"SHMBUF_TAKE": "python"}, False),  # built, and left out
])
def test_without_the_compiled_take_batches_are_taken_in_python(tmp_path, setup, env, on_fields):
    """Where ``_take_c`` was not built (``Batch`` is made on ``BatchFields`` then), or
    ``SHMBUF_TAKE=python``, a quick pool takes with ``LearnerRing._take``: the same batches,
    released the same way."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN.format(root=os.getcwd(), setup=setup))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=100, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(on_fields or learner_ring.Taker is None), "ok"]
