"""Delivery: how filled batches reach the learner, one interface over layers.

``Delivery`` (``base.py``) is what the pool calls. A ``HostDelivery`` fills staging slots and
hands them out as host batches (NumPy views, or torch views with ``Batch.to``):
``InProcessDelivery`` (``local.py``) fills one slot in this process, ``RingDelivery``
(``ring.py``) takes slots that sampler workers filled. A ``DeliveryLayer`` wraps a host delivery
and makes its own batches of the host's slots: device copies (``device.py``), JAX arrays
(``jax.py``), page-locked releases (``pinned.py``); ``layers.layered`` picks the one a pool's
settings ask for.
"""

from __future__ import annotations

from .base import (
    Delivery,
    DeliveryLayer,
    HostDelivery,
    PoolParts,
    RecentBatches,
    device_backend,
)

__all__ = ["Delivery", "DeliveryLayer", "HostDelivery", "PoolParts", "RecentBatches",
           "device_backend"]
