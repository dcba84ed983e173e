"""Deprecated: ``workers.cluster_demo`` is ``workers.demo.ray_nodes`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.demo import ray_nodes as _new

moved(__name__, _new)
