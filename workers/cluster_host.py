"""Deprecated: ``workers.cluster_host`` is ``workers.cluster.host`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.cluster import host as _new

moved(__name__, _new)
