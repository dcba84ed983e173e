"""``Output("torch", pin_memory=True)``: the host delivery's staging ring page-locked,
and each released batch's slot fenced on the current CUDA stream (``PinnedDelivery``).
"""

from __future__ import annotations

from typing import Any

from ..batch import Batch
from ..device import Backend, page_lock, page_unlock
from .base import DeliveryLayer, HostDelivery, device_backend


class PinnedDelivery(DeliveryLayer):
    """Host batches (torch views, ``Batch.to``) over a page-locked staging ring, so that the
    learner's ``batch["obs"].to("cuda", non_blocking=True)`` copies asynchronously. A slot goes
    back to be refilled only once an event recorded on the current stream when its batch was
    released has passed: copies the learner queued on that stream read the slot first. Where
    the ring cannot be page-locked (no CUDA, private in-process slots), batches are released
    as a host delivery's.

    Concurrency: learner thread only (see ``Delivery``). The ring stays page-locked until the
    teardown has seen every fence pass; if they did not pass in time, it stays locked and mapped
    until the process exits.
    """

    def __init__(self, host: HostDelivery) -> None:
        super().__init__(host)
        self.pinned: tuple[Any, int] | None = None  # (torch, pointer) to unregister
        self.backend: Backend | None = None  # releases are fenced on its current stream

    def start(self) -> None:
        super().start()
        import torch  # (the host's output="torch" imported it)

        self.pinned = page_lock(torch, self.host.shared_memory())
        if self.pinned is not None:
            self.backend = device_backend("cuda")

    def next(self, timeout: float, step: int) -> Batch:
        host = self.host
        slot = host.wait_slot(step, timeout)
        return self.deliver(host.batch_of(slot, step, self.release_batch))

    def fence_released(self, batch: Batch) -> None:
        """A copy the learner issued on its current stream may still be reading the slot."""
        if self.backend is not None:
            self.host.fence(batch.slot, self.backend.record_current())

    def close(self, settled: bool, timeout: float) -> None:
        if settled:  # (else it stays page-locked with its mapping)
            page_unlock(self.pinned)
        self.pinned = None
        super().close(settled, timeout)
