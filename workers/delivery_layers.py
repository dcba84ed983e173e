"""``layered``: a pool's delivery, its host delivery under the layer its settings ask for."""

from __future__ import annotations

import warnings

from .delivery import Delivery, HostDelivery, PoolParts
from .delivery_device import DeviceDelivery
from .delivery_jax import JaxDelivery
from .delivery_pinned import PinnedDelivery


def layered(host: HostDelivery, parts: PoolParts) -> Delivery:
    """``host`` as it is (NumPy or torch views), or under device copies (``device=``), JAX
    arrays (``output="jax"``) or page-locked releases (``pin_memory=True``). Raises
    ``ImportError`` (with the fix) before anything starts if the layer's library is missing."""
    cfg = parts.cfg
    if parts.backend is not None:  # (device= implies output="torch")
        return DeviceDelivery(host, parts.backend)
    if cfg.pin_memory and cfg.output != "torch":
        warnings.warn("pin_memory=True only applies to output='torch'", stacklevel=4)
    if cfg.output == "jax":
        return JaxDelivery(host)
    if cfg.pin_memory and cfg.output == "torch":
        return PinnedDelivery(host)
    return host
