"""``workers=0``: batches are drawn, gathered and transformed in the learner's own process, into
one private slot that is reused, and delivered behind the same interface as the staging ring.
"""

from __future__ import annotations

import time

import numpy as np

from shmbuf.errors import Timeout

from ..filler import Backoff, BatchFiller, Wait
from ..staging import WEIGHTS, slot_arrays, write_rows
from .base import HostDelivery, PoolParts


class InProcessDelivery(HostDelivery):
    """One private slot (slot 0), filled by ``wait_slot`` itself with the workers'
    ``BatchFiller``.

    Concurrency: this process only; the slot is refilled once the previous batch's device copies
    (``device=``, ``Batch.to``) have completed. Sampled rows are counted in the buffer's limiter
    under sampler 0, the only word this pool writes there.
    """

    copies_for_jax = True

    def __init__(self, parts: PoolParts) -> None:
        super().__init__(parts)
        cfg, batch_size = parts.cfg, parts.cfg.batch_size
        self.local = {name: np.zeros(shape, dtype) for name, shape, dtype
                      in slot_arrays(parts.out_arrays, batch_size, parts.compiled.index_shape)}
        self.local[WEIGHTS][...] = 1.0
        self.filler = BatchFiller(
            parts.buf, parts.compiled, [self.local], batch_size, self.out_fields, cfg.transform,
            cfg.min_size, cfg.limit is not None, sampler=0, table=parts.selection.draws_from)
        self.rng = np.random.default_rng(cfg.seed)

    def start(self) -> None:
        self.make_views([self.local])

    def slot_arrays(self, slot: int) -> dict[str, np.ndarray]:
        return self.local

    def ready_slot(self, step: int) -> int | None:
        return None  # (filled only when asked: wait_slot)

    def give_back(self, slot: int) -> None:
        """Nothing to hand back: the next ``wait_slot`` refills the slot once its fences
        passed."""

    def wait_slot(self, step: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout

        def wait(backoff: Backoff) -> None:
            now = time.monotonic()
            if now >= deadline:
                raise Timeout(f"no batch within {timeout}s: {self.waiting_for()}")
            backoff.sleep(deadline - now)
            self.check_open()  # close() from another thread ends the wait
            # In-process the learner is the table's writer: rows the writers added meanwhile
            # (those a prioritized draw found overwritten) enter now, else it would wait in vain.
            # Last, right before the next draw: entered before the sleep, they would be lapped
            # again by writers that fill a lane within one backoff.
            self.selection.enter_new_rows()

        self._wait_local_copies(deadline, timeout)
        if self.selection.learner_selects:
            self._select_and_gather(wait)
        else:
            self.filler.wait_until_drawable(wait)
            self.filler.draw(0, self.rng, wait)
        return 0

    def _select_and_gather(self, wait: Wait) -> None:
        """Fill the slot with rows the selection chooses (``max_times_sampled``, the queue)."""
        backoff = Backoff()
        while True:
            rows = (self.selection.select(self.batch_size, self.selection_rng)
                    if self.may_select() else None)
            if rows is None:
                wait(backoff)
                continue
            write_rows(self.local, *rows)
            if self.filler.gather(0):
                return
            self.selection.stale(rows)  # overwritten meanwhile: select again

    def _wait_local_copies(self, deadline: float, timeout: float) -> None:
        """The slot is reused: gather again only after the copies that read the last batch
        (``device=``, ``Batch.to``) have completed."""
        backoff = Backoff(5e-5, 1e-3)
        while len(self.fences):
            self.fences.completed()
            if not len(self.fences):
                return
            if time.monotonic() >= deadline:
                raise Timeout(f"no batch within {timeout}s: device copies of the previous batch "
                              f"have not completed")
            backoff.sleep()

    def close(self, settled: bool, timeout: float) -> None:
        super().close(settled, timeout)
        self.filler.close()
        self.local = {}
