"""Deprecated: ``workers.delivery_local`` is ``workers.delivery.local`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.delivery import local as _new

moved(__name__, _new)
