"""Deprecated: ``workers.cluster_actors`` is ``workers.cluster.actors`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.cluster import actors as _new

moved(__name__, _new)
