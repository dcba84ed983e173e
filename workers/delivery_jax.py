"""Deprecated: ``workers.delivery_jax`` is ``workers.delivery.jax`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.delivery import jax as _new

moved(__name__, _new)
