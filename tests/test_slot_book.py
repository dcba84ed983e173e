"""The learner's record of its staging slots (``workers/slot_book.py``): which slots are out with
a worker, which are back, the order ordered delivery keeps, and what a dead worker lost."""

from __future__ import annotations

from workers.slot_book import SlotBook
from workers.staging import ASSIGNED, FILLING, HELD, READY, STALE


def test_handed_back_takes_only_ready_or_stale_slots_in_assignment_order():
    book = SlotBook(ordered=False)
    for slot in (3, 0, 2, 1):
        book.handed_out(slot, requeue=True)
    words = [HELD, 0, 0, 0, 0, 0, 0, 0]
    state_at = [4, 5, 6, 7]  # slot s's STATE word is words[4 + s]
    words[4:8] = [READY, FILLING, STALE, READY]
    assert book.handed_back(words, state_at) == [3, 0, 2]
    assert list(book.assigned) == [1]  # still out with its worker
    words[5] = ASSIGNED
    assert book.handed_back(words, state_at) == []


def test_ordered_delivery_waits_for_the_oldest_assignment():
    book = SlotBook(ordered=True)
    for slot in (0, 1, 2):
        book.handed_out(slot, requeue=True)
    book.append(2)
    book.append(1)
    assert book.pop() is None  # slot 0 was assigned first and is not back yet
    book.append(0)
    assert [book.pop(), book.pop(), book.pop(), book.pop()] == [0, 1, 2, None]


def test_unordered_delivery_takes_slots_as_they_came_back():
    book = SlotBook(ordered=False)
    for slot in (0, 1):
        book.handed_out(slot, requeue=True)
    book.append(1)
    book.append(0)
    assert [book.pop(), book.pop(), book.pop()] == [1, 0, None]


def test_a_dead_workers_slots_are_lost_in_the_order_they_were_assigned():
    book = SlotBook(ordered=True)
    for slot in (4, 1, 2, 0):  # worker 0 of 2 fills slots 0, 2, 4
        book.handed_out(slot, requeue=True)
    assert book.lose([0, 2, 4]) == [4, 2, 0]
    assert list(book.assigned) == [1]
    book.handed_out(2, requeue=False)  # re-assigned after the death: it keeps its place
    assert list(book.order) == [4, 1, 2, 0]
