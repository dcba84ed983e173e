"""Deprecated: ``workers.cluster_sampler`` is ``workers.cluster.sampler`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.cluster import sampler as _new

moved(__name__, _new)
