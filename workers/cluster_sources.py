"""Deprecated: ``workers.cluster_sources`` is ``workers.cluster.sources`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.cluster import sources as _new

moved(__name__, _new)
