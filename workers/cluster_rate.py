"""Deprecated: ``workers.cluster_rate`` is ``workers.cluster.rate`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.cluster import rate as _new

moved(__name__, _new)
