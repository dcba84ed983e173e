"""``device=``: batches in device buffers, copied from a host delivery's staging slots ahead of
the learner, with event fences instead of synchronizes (``DeviceDelivery``; the two hazards and
their fences are ``device``'s).
"""

from __future__ import annotations

import time
from typing import Any

from ..batch import Batch
from ..device import Backend, DeviceStage, page_lock, page_unlock
from ..staging import INDICES, LANES, WEIGHTS
from .base import DeliveryLayer, HostDelivery


class DeviceDelivery(DeliveryLayer):
    """Each slot the host fills is copied on the backend's copy stream into a buffer of a
    ``DeviceStage``, up to ``device_prefetch`` copies ahead of the learner; the slot goes back
    to be refilled once its copy's event has passed, and a device buffer once the learner's
    stream has passed the batch's release. Fields and weights arrive as device tensors the
    learner's current stream waits for; indices and lanes stay on the host (for
    ``update_priorities``). On CUDA the host's staging ring is page-locked, so the copies are
    asynchronous.

    Concurrency: learner thread only (see ``Delivery``). A slot is read by its copy until the
    copy's fence passes; a device buffer by the learner's kernels until its release fence does.
    """

    def __init__(self, host: HostDelivery, backend: Backend) -> None:
        super().__init__(host)
        self.backend = backend
        self.stage: DeviceStage | None = None  # set by start, dropped by settle
        self.pinned: tuple[Any, int] | None = None  # (torch, pointer) of a page-locked ring

    def start(self) -> None:
        super().start()
        host = self.host
        if getattr(self.backend, "cuda", False):
            import torch  # (device= means output="torch": the host imported it)

            self.pinned = page_lock(torch, host.shared_memory())
        first = host.slot_arrays(0)
        arrays = [(n, tuple(first[n].shape), first[n].dtype) for n in [*host.out_fields, WEIGHTS]]
        self.stage = DeviceStage(self.backend, arrays, host.cfg.device_prefetch)

    def next(self, timeout: float, step: int) -> Batch:
        stage = self.stage
        assert stage is not None  # started, and not torn down (the pool is open)
        while stage.can_submit():  # copies of the slots ready now, while buffers are free
            slot = self.host.ready_slot(step)
            if slot is None:
                break
            self._submit(stage, slot, step)
        if not len(stage):
            self._submit(stage, self.host.wait_slot(step, timeout), step)
        index, arrays, (generation, indices, lanes, info) = stage.take()
        return self.deliver(Batch({n: arrays[n] for n in self.host.out_fields}, indices, lanes,
                                  arrays[WEIGHTS], self.release_batch, index, generation,
                                  info=info))

    def _submit(self, stage: DeviceStage, slot: int, step: int) -> None:
        """Enqueue the copy of ``slot`` into a free device buffer; the slot goes back to the
        host fenced by it (also when the submit fails: copies enqueued before may read it)."""
        host = self.host
        views, info = host.host_arrays(slot, step)
        arrays = {n: views[n] for n in host.out_fields}
        arrays[WEIGHTS] = views[WEIGHTS]
        tag = (host.generation(slot), views[INDICES].clone(), views[LANES].clone(), info)
        try:
            host.fence(slot, stage.submit(arrays, tag))
        except BaseException:
            try:
                host.fence(slot, stage.backend.record_copy())
            finally:
                host.give_back(slot)
            raise
        host.give_back(slot)

    def release_batch(self, batch: Batch) -> None:
        """A device batch's release: its buffer goes back to the stage (reused once the
        learner's stream has passed this point)."""
        if self.let_go(batch) and self.stage is not None:  # (else torn down: buffers gone)
            self.stage.give_back(batch.slot)

    def settle(self, deadline: float) -> bool:
        settled = super().settle(deadline)
        if self.stage is not None:
            settled = self.stage.drain(max(0.1, deadline - time.monotonic())) and settled
            self.stage.close()
            self.stage = None
        return settled

    def close(self, settled: bool, timeout: float) -> None:
        if settled:  # (else it stays page-locked with its mapping)
            page_unlock(self.pinned)
        self.pinned = None
        super().close(settled, timeout)
