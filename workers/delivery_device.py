"""Deprecated: ``workers.delivery_device`` is ``workers.delivery.device`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.delivery import device as _new

moved(__name__, _new)
