"""Deprecated: ``shmbuf.fill`` is ``shmbuf.imitation`` now; the old name stays for one
release (``shmbuf.moved``).

It held ``ImitationSurface``, a mixin of ``ReplayBuffer``: its methods are ``ReplayBuffer``'s
own now, and ``check_data`` is in ``shmbuf.imitation``.
"""

from __future__ import annotations

from shmbuf import imitation as _new
from shmbuf.moved import moved

moved(__name__, _new)
