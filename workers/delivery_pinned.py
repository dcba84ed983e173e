"""Deprecated: ``workers.delivery_pinned`` is ``workers.delivery.pinned`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.delivery import pinned as _new

moved(__name__, _new)
