"""Deprecated: ``workers.cluster_batch`` is ``workers.cluster.batch`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.cluster import batch as _new

moved(__name__, _new)
