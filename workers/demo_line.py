"""Deprecated: ``workers.demo_line`` is ``workers.demo.line`` now; the old name stays for one
release (``shmbuf.moved``).
"""

from __future__ import annotations

from shmbuf.moved import moved
from workers.demo import line as _new

moved(__name__, _new)
