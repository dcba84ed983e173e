"""Deprecated: ``workers.delivery_layers`` is ``workers.delivery.layers`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.delivery import layers as _new

moved(__name__, _new)
