"""The two halves of a selection strategy (``SamplerPool(selection=...)``): the object a user
passes (``SelectionSpec``: its options, checked when it is made) and what it opens in the
learner for one pool (``Selection``: which rows each batch holds). One module per strategy.

Workers draw their own rows for uniform and prioritized selection (from a ``PriorityTable`` the
learner keeps). A retirement count and the queue need every draw counted exactly once, so
there the learner (the single writer of the counts, the priority table and the queue cursors)
picks the rows and writes them into the staging slot, and a worker only gathers them; epochs
too (their order is the learner's). The pool asks for a batch only when the rate limit allows
one (``Delivery.may_select``), as workers check before they draw.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    from shmbuf import ReplayBuffer
    from shmbuf.limiter import RateLimit
    from shmbuf.priority import PriorityTable

# Rows a learner-side selection chose: (lanes, indices, probabilities or None, smallest
# probability overall[, the batch's ``staging.INFO`` words]).
Rows = (tuple[np.ndarray, np.ndarray, "np.ndarray | None", float]
        | tuple[np.ndarray, np.ndarray, "np.ndarray | None", float, np.ndarray])


class SelectionSpec:
    """A selection strategy as the user passes it: ``Uniform()``, ``Prioritized(...)``,
    ``Counted(k)``, ``Queue()`` or ``Epoch(...)``. Immutable; each checks its own options when
    it is made, and ``check`` says whether it can serve a pool's plan and rate limit.

    ``ordered``: batches leave in the order the learner chose them (the queue's FIFO, epochs).
    ``paces_writers``: it is its own rate limiter (the queue: writers wait while it is full),
    so the pool takes the buffer's limiter lock for it.
    """

    ordered: ClassVar[bool] = False
    paces_writers: ClassVar[bool] = False

    def check(self, compiled: Any, limit: RateLimit | None) -> None:
        """Raise ``ValueError`` (naming the fix) if this strategy cannot serve a pool of the
        compiled plan ``compiled`` under the ratio ``limit`` (None: no ratio)."""

    def table_to_adopt(self, buf: ReplayBuffer, compiled: Any) -> dict[str, Any] | None:
        """The layout document of a dead learner's priority table this strategy would take
        over (``open``), or None: the pool's reclaim leaves such a table for it."""
        return None

    def beta_at(self, step: int) -> float:
        """The importance-weight exponent after ``step`` batches (prioritized strategies)."""
        return 0.0

    def open(self, buf: ReplayBuffer, compiled: Any) -> Selection:
        """This strategy's learner side for one pool over ``buf``."""
        raise NotImplementedError


def windowed(compiled: Any) -> bool:
    """Whether priorities over ``compiled`` are one per window start (sequences, frame stacks,
    n-step, derived next_obs): a ``WindowPriorityTable``."""
    return not compiled.plan.is_plain or compiled.derived_next_obs


def refuse_plans(name: str, compiled: Any) -> None:
    """``ValueError`` unless ``compiled`` reads single stored transitions (for the learner-side
    strategies that count each row: the queue and retirement counts)."""
    if windowed(compiled):
        raise ValueError(
            f"{name} delivers single stored transitions; sequence, frame-stack and n-step plans "
            f"(and derived next_obs) sample with Uniform() or Prioritized()")


class Selection:
    """How the rows of each batch are chosen; one instance per pool, in the learner.

    ``learner_selects``: the learner chooses rows (``select``) and workers gather them; else the
    workers draw, in proportion to ``draws_from`` when it is set. ``table``: the priorities
    behind the draws, if any; batches then carry importance weights.

    Concurrency: learner thread only. The learner is the only writer of ``table``; workers
    attach it by name and only read it.
    """

    learner_selects: ClassVar[bool] = False
    prioritized = False  # takes new priorities (``update``)
    rate_limits: ClassVar[bool] = False  # paces writers itself: holds the buffer's limiter lock
    tags_batches: ClassVar[bool] = False  # writes ``staging.INFO`` (epochs, short batches)
    enters_rows: ClassVar[bool] = False  # enter_new_rows does something: call it per batch
    consumes: ClassVar[bool] = False  # released does something: call it per released batch
    table: PriorityTable | None = None

    @property
    def draws_from(self) -> PriorityTable | None:
        """The priority table workers draw from (None: uniform draws, or learner-chosen rows)."""
        return None

    def enter_new_rows(self) -> None:
        """Before a batch: rows committed since enter the table workers draw from."""

    def select(self, batch_size: int, rng: np.random.Generator) -> Rows | None:
        """``batch_size`` rows, or None if that many cannot be chosen now (nothing is spent)."""
        raise NotImplementedError(f"{type(self).__name__}: workers draw their own rows")

    def released(self, lanes: Any, indices: Any) -> None:
        """The learner released a batch of these rows; only where ``consumes``."""

    def stale(self, rows: Rows) -> bool:
        """Rows overwritten before a worker gathered them. True: the next ``select`` replaces
        that batch (its slot keeps its place in delivery order); False: the slot gets a new
        batch and goes to the back."""
        return False

    def update(self, lanes: Any, indices: Any, priorities: Any) -> int:
        """New priorities for delivered rows (``SamplerPool.update_priorities``); only where
        ``prioritized``. Returns how many were applied."""
        raise NotImplementedError(f"{type(self).__name__} keeps no priorities")

    def close(self) -> None:
        """Close the table (the pool's teardown). Idempotent."""
        if self.table is not None:
            self.table.close()


