"""Deprecated: ``workers.plot`` is ``workers.demo.plot`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.demo import plot as _new

moved(__name__, _new)
