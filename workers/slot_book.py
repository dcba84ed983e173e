"""The learner's records of its staging slots: which are out with a worker and which are back
(``SlotBook``), and the rows it chose for them when it chooses (``SlotRows``). Learner-side
only; the slots' words and data live in ``staging``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from .selection import Rows, Selection
from .staging import HANDED_BACK


class SlotBook:
    """The learner's record of the slots it handed out: those out with a worker (``assigned``,
    in the order they were assigned: after a death, its lost slots are handed out again in that
    order) and those filled (``ready``, as they came; with ``ordered``, taken in the order they
    were assigned)."""

    def __init__(self, ordered: bool) -> None:
        self.ordered = ordered
        self.assigned: dict[int, None] = {}
        self.ready: collections.deque[int] = collections.deque()
        self.order: collections.deque[int] = collections.deque()  # slots in assignment order
        self.append = self.ready.append  # a filled slot (the deque's own method: no frame)

    def __len__(self) -> int:
        return len(self.ready)

    def handed_out(self, slot: int, requeue: bool) -> None:
        """``slot`` was assigned to a worker; with ``requeue`` and ``ordered`` it is delivered
        after those assigned before it (a slot handed out again keeps its place)."""
        self.assigned[slot] = None
        if requeue and self.ordered:
            self.order.append(slot)

    def handed_back(self, words: Any, state_at: list[int]) -> list[int]:
        """The assigned slots whose STATE word (``words[state_at[slot]]``) says their worker
        handed them back (READY or STALE), in assignment order; no longer ``assigned``."""
        back = []
        for slot in self.assigned:  # (a loop, not a comprehension: no frame of its own)
            if words[state_at[slot]] in HANDED_BACK:
                back.append(slot)
        for slot in back:
            del self.assigned[slot]
        return back

    def lose(self, slots: list[int]) -> list[int]:
        """Those of ``slots`` (a dead worker's) still assigned, in order; no longer assigned."""
        lost = [s for s in self.assigned if s in slots]
        for s in lost:
            del self.assigned[s]
        return lost

    def unassigned(self, slot: int) -> None:
        """``slot`` went back unfilled: it loses its place."""
        if slot in self.order:
            self.order.remove(slot)

    def pop(self) -> int | None:
        """The next slot to deliver, if it is ready."""
        if not self.ready:
            return None
        if self.ordered:  # the oldest assignment first, once it is ready
            if not self.order or self.order[0] not in self.ready:
                return None
            slot = self.order.popleft()
            self.ready.remove(slot)
            return slot
        return self.ready.popleft()


class SlotRows:
    """Rows the learner chose for its slots (``Selection.learner_selects``: queue, epochs,
    ``max_times_sampled``): those each slot out with a worker is to gather (kept after a worker
    death: queue mode still delivers each row exactly once), and the slots waiting for rows."""

    def __init__(self, selection: Selection) -> None:
        self.selection = selection
        self.by_slot: dict[int, Rows] = {}
        self.waiting: list[int] = []  # slots with no rows to select yet

    def rows_for(self, slot: int, select: Callable[[], Rows | None]) -> Rows | None:
        """The rows ``slot`` is to gather: those it had, else ``select()``'s; None (and the
        slot waits) if nothing can be selected now."""
        rows = self.by_slot.get(slot)
        if rows is None:
            rows = select()
            if rows is None:
                self.waiting.append(slot)
                return None
            self.by_slot[slot] = rows
        return rows

    def retry(self, assign: Callable[[int], None]) -> None:
        """``assign`` the slots waiting for rows again, until one still finds none."""
        waiting = self.waiting
        for slot in waiting[:]:
            waiting.remove(slot)
            assign(slot)
            if waiting and waiting[-1] == slot:
                break  # still nothing to select; the others would find nothing either

    def stale(self, slot: int) -> bool:
        """``slot``'s rows were overwritten before its worker gathered them; True if the slot
        keeps its place in delivery order (``Selection.stale``)."""
        return self.selection.stale(self.by_slot.pop(slot))

    def done(self, slot: int) -> None:
        """The learner is done with ``slot``'s rows."""
        if self.by_slot:
            self.by_slot.pop(slot, None)
