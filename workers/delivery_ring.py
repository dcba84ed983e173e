"""Deprecated: ``workers.delivery_ring`` is ``workers.delivery.ring`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.delivery import ring as _new

moved(__name__, _new)
