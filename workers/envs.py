"""Deprecated: ``workers.envs`` is ``workers.demo.envs`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.demo import envs as _new

moved(__name__, _new)
