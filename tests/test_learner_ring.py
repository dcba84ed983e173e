"""The learner's half of the staging ring (``workers/learner_ring.py``), on a ring of its own with
no workers (the tests store what a worker would): which slots are out and back, the order they
leave in (ordered and not), what a dead worker's reclaim and a stale batch keep, the words it
stores, and the wake-up it sends only to a worker that sleeps.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from workers.learner_ring import (
    BACK,
    BACK_STALE,
    OUT,
    RECORD_FIELDS,
    WITH_LEARNER,
    H,
    LearnerRing,
)
from workers.staging import (
    ASSIGNED,
    ASSIGNED_ROWS,
    FILLING,
    FREE,
    HELD,
    LEARNER,
    READY,
    STALE,
    W_GENERATION,
    W_OWNER,
    W_STATE,
    StagingRing,
    slot_arrays,
)


@pytest.fixture
def ring() -> Iterator[StagingRing]:
    r = StagingRing.create(slot_arrays([("x", (2,), "float32")], 4, ()), 6, {}, n_workers=2)
    yield r
    r.close()


def learner(ring: StagingRing, ordered: bool = False) -> tuple[LearnerRing, list[int]]:
    woken: list[int] = []
    return LearnerRing(ring, 2, ordered, woken.append), woken


def statuses(slots: LearnerRing) -> list[int]:
    return slots.status.tolist()


def test_the_records_are_where_the_header_says(ring):
    """One int64 array: the header names each column's start; the columns hold the ring's
    word indices, and the memoryviews the Python steps use are views of the same memory."""
    slots, _ = learner(ring)
    rec = slots.records
    assert rec.dtype == np.int64 and rec.flags.c_contiguous
    assert rec[H["n_slots"]] == 6 and rec[H["n_workers"]] == 2
    assert list(rec[H["assigned"]:H["held"] + 1]) == [ASSIGNED, READY, STALE, HELD]
    assert tuple(rec[[H["batches_at"], H["wait_at"]]]) == ring.stats.delivered_words
    state_at = rec[H["state_at"]]
    assert list(rec[state_at:state_at + 6]) == [ring.layout.word(s, W_STATE) for s in range(6)]
    waiter_at = rec[H["waiter_at"]]
    assert list(rec[waiter_at:waiter_at + 3]) == [ring.layout.waiter_word(w) for w in range(3)]
    assert min(rec[H[f]] for f in ("state_at", "status", "filled")) >= len(RECORD_FIELDS)
    assert np.shares_memory(np.asarray(slots.status), rec)
    slots.status[4] = BACK
    assert rec[rec[H["status"]] + 4] == BACK


def test_hand_out_stores_generation_owner_then_state_and_wakes_only_a_sleeper(ring):
    """The learner's hand-over stores a new ticket as the generation, the owner, and the state
    last; it wakes the slot's worker only while that worker's waiting word is set."""
    slots, woken = learner(ring)
    slots.hand_out(0)
    assert [ring.get(0, w) for w in (W_STATE, W_GENERATION, W_OWNER)] == [ASSIGNED, 1, 0]
    assert woken == [] and statuses(slots)[0] == OUT
    with ring.sleeping(1 + 1):  # worker 1 blocks
        slots.hand_out(1, ASSIGNED_ROWS)
        slots.hand_out(2)  # worker 0 is awake
    slots.hand_out(3)
    assert woken == [1]
    assert [ring.get(s, W_GENERATION) for s in range(4)] == [1, 2, 3, 4]
    assert ring.get(1, W_STATE) == ASSIGNED_ROWS and ring.get(3, W_OWNER) == 1


def test_take_up_takes_only_ready_or_stale_slots_and_counts_the_ready(ring):
    slots, _ = learner(ring)
    for slot in range(4):
        slots.hand_out(slot)
    for slot, state in enumerate((READY, FILLING, STALE, READY)):
        ring.set_state(slot, state)
    assert slots.take_up() == 3
    assert statuses(slots)[:4] == [BACK, OUT, BACK_STALE, BACK]
    assert slots.filled.tolist() == [1, 1]  # slot 0 (worker 0), slot 3 (worker 1); not stale
    assert slots.ready_count == 2 and slots.out_count == 1
    assert slots.take_up() == 0  # nothing more came back


def test_unordered_slots_leave_oldest_hand_out_first_among_those_back(ring):
    slots, _ = learner(ring)
    for slot in (3, 0, 1):
        slots.hand_out(slot)
    ring.set_state(1, READY)
    ring.set_state(0, READY)
    slots.take_up()
    assert [slots.pop(), slots.pop(), slots.pop()] == [0, 1, None]  # 3 is still out
    assert ring.state(0) == HELD and statuses(slots)[0] == WITH_LEARNER


def test_ordered_delivery_waits_for_the_oldest_place(ring):
    slots, _ = learner(ring, ordered=True)
    for slot in (0, 1, 2):
        slots.hand_out(slot)
    ring.set_state(2, READY)
    ring.set_state(1, READY)
    slots.take_up()
    assert slots.pop() is None  # slot 0 was handed out first and is not back yet
    ring.set_state(0, READY)
    slots.take_up()
    assert [slots.pop(), slots.pop(), slots.pop(), slots.pop()] == [0, 1, 2, None]


def test_a_dead_workers_slots_are_reclaimed_in_hand_out_order_and_keep_their_places(ring):
    slots, _ = learner(ring, ordered=True)
    for slot in (4, 1, 2, 0):  # worker 0 of 2 fills slots 0, 2, 4
        slots.hand_out(slot)
    ring.set_state(2, READY)  # finished before the death: delivered
    slots.take_up()
    generations = [ring.get(s, W_GENERATION) for s in range(5)]
    assert slots.reclaim([0, 2, 4]) == [4, 0]
    for slot in (0, 4):
        assert ring.state(slot) == FREE and ring.get(slot, W_OWNER) == -1
        assert ring.get(slot, W_GENERATION) > max(generations)  # bumped
    assert statuses(slots)[:5] == [WITH_LEARNER, OUT, BACK, 0, WITH_LEARNER]
    for slot in (4, 0):  # the restarted worker refills them, in their places
        slots.hand_out(slot, requeue=False)
    for slot in (0, 1, 4):
        ring.set_state(slot, READY)
    slots.take_up()
    assert [slots.pop() for _ in range(5)] == [4, 1, 2, 0, None]


def test_stale_slots_keep_their_place_or_go_to_the_back(ring):
    slots, _ = learner(ring, ordered=True)
    for slot in (0, 1, 2):
        slots.hand_out(slot, ASSIGNED_ROWS)
    ring.set_state(1, STALE)
    ring.set_state(0, STALE)
    slots.take_up()
    assert slots.pop() is None  # the oldest (0) is stale: the delivery decides first
    assert slots.stale() == [0, 1] and slots.stale() == []
    slots.hand_out(0, ASSIGNED_ROWS, requeue=False)  # replaced in its place (epochs)
    slots.hand_out(1, ASSIGNED_ROWS)  # a new batch, after those handed out before it
    for slot in (0, 1, 2):
        ring.set_state(slot, READY)
    slots.take_up()
    assert [slots.pop() for _ in range(4)] == [0, 2, 1, None]


def test_a_freed_slot_waits_with_the_learner_and_takes_a_new_place(ring):
    slots, _ = learner(ring, ordered=True)
    for slot in (0, 1):
        slots.hand_out(slot)
    slots.reclaim([0])
    slots.free(0)
    assert ring.state(0) == FREE and statuses(slots)[0] == WITH_LEARNER
    slots.hand_out(0)  # (rows found later: retried from next())
    for slot in (0, 1):
        ring.set_state(slot, READY)
    slots.take_up()
    assert [slots.pop(), slots.pop()] == [1, 0]


def test_the_learners_sleep_is_seen_by_a_worker(ring):
    """``sleeping`` is the learner's half of the handshake: its waiting word set inside."""
    slots, _ = learner(ring)
    assert not ring.wake_needed(LEARNER)
    with slots.sleeping():
        assert ring.wake_needed(LEARNER)
    assert not ring.waiting(LEARNER)
