"""``layered``: a pool's delivery, its host delivery under the layer its settings ask for."""

from __future__ import annotations

import warnings

from .base import Delivery, HostDelivery, PoolParts
from .device import DeviceDelivery
from .jax import JaxDelivery
from .pinned import PinnedDelivery


def layered(host: HostDelivery, parts: PoolParts) -> Delivery:
    """``host`` as it is (NumPy or torch views), or under device copies (``device=``), JAX
    arrays (``output="jax"``) or page-locked releases (``Output("torch", pin_memory=True)``). Raises
    ``ImportError`` (with the fix) before anything starts if the layer's library is missing."""
    cfg = parts.cfg
    if parts.backend is not None:  # (device= implies output="torch")
        return DeviceDelivery(host, parts.backend)
    if cfg.pin_memory and cfg.output != "torch":
        warnings.warn("Output(pin_memory=True) only applies to Output('torch')", stacklevel=4)
    if cfg.output == "jax":
        return JaxDelivery(host)
    if cfg.pin_memory and cfg.output == "torch":
        return PinnedDelivery(host)
    return host
