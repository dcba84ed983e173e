"""``n_workers=0``: batches are drawn, gathered and transformed in the learner's own process, into
one private slot that is reused, and delivered behind the same interface as the staging ring.
"""

from __future__ import annotations

import time

import numpy as np

from shmbuf.errors import Timeout

from .batch import Batch
from .delivery import Delivery, PoolParts
from .staging import WEIGHTS, slot_arrays, write_rows


class InProcessDelivery(Delivery):
    """One private slot (slot 0), filled by ``next()`` itself.

    Concurrency: this process only; the slot is refilled once the previous batch's device copies
    (``device=``, ``Batch.to``) have completed. Sampled rows are counted in the buffer's limiter
    under sampler 0, the only word this pool writes there.
    """

    copies_for_jax = True

    def __init__(self, parts: PoolParts) -> None:
        super().__init__(parts)
        cfg, compiled, b = parts.cfg, parts.compiled, parts.cfg.batch_size
        self.local = {name: np.zeros(shape, dtype) for name, shape, dtype
                      in slot_arrays(parts.out_arrays, b, compiled.index_shape)}
        self.local[WEIGHTS][...] = 1.0
        # Without a transform rows are gathered straight into the slot; with one, into scratch.
        self.scratch = compiled.allocate(b) if cfg.transform is not None else None
        self.rng = np.random.default_rng(cfg.seed)

    def start(self) -> None:
        self.views = self.make_views([self.local])

    def slot_arrays(self, slot: int) -> dict[str, np.ndarray]:
        return self.local

    def next(self, timeout: float, step: int) -> Batch:
        buf, cfg = self.buf, self.cfg
        deadline = time.monotonic() + timeout
        pause = 5e-5
        limiter = buf.storage.limiter
        target = self.local if cfg.transform is None else self.scratch
        self._wait_local_copies(deadline, timeout)
        out = {n: target[n] for n, _, _ in self.compiled.outputs}
        while True:
            rows = None
            if self.selection.learner_selects:
                rows = (self.selection.select(self.batch_size, self.selection_rng)
                        if self.may_select() else None)
                if rows is not None:
                    if buf.storage.gather(rows[0], rows[1], out).all():
                        self.selection.gathered(0)  # in our memory now: writers may reuse slots
                        break
                    self.selection.stale(rows)  # overwritten meanwhile: select again
                    continue
            elif limiter.can_sample(self.batch_size, cfg.min_size, cfg.limit is not None):
                break
            now = time.monotonic()
            if now >= deadline:
                raise Timeout(f"no batch within {timeout}s: {self.waiting_for()}")
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 2e-3)
            self.check_open()  # close() from another thread ends the wait
        if rows is not None:
            lanes, indices, probs, pmin = rows
        else:
            if self.selection.table is not None:
                draw = buf.sample_into(out, self.rng, sampler=self.selection.table.draw)
            else:
                draw = buf.sample_into(out, self.rng, plan=self.compiled)
            lanes, indices, probs, pmin = draw.lanes, draw.indices, draw.probs, draw.pmin
        local = self.local
        if cfg.transform is not None:
            batch = dict(self.scratch)  # type: ignore[arg-type]
            result = cfg.transform(batch)
            result = batch if result is None else result
            for name in self.out_fields:
                np.copyto(local[name], np.asarray(result[name]), casting="same_kind")
        write_rows(local, lanes, indices, probs, pmin)
        if cfg.limit is not None:
            limiter.record_samples(0, self.batch_size)
        if self.stage is not None:
            self.submit_slot(self.stage, 0, step)
            return self.hold_device(self.stage)
        return self.hold(0, step)

    def _wait_local_copies(self, deadline: float, timeout: float) -> None:
        """The slot is reused: gather again only after the copies that read the last batch
        (``device=``, ``Batch.to``) have completed."""
        pause = 5e-5
        while len(self.fences):
            self.fences.completed()
            if not len(self.fences):
                return
            if time.monotonic() >= deadline:
                raise Timeout(f"no batch within {timeout}s: device copies of the previous batch "
                              f"have not completed")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def close(self, settled: bool, timeout: float) -> None:
        super().close(settled, timeout)
        self.local = {}
        self.scratch = None
