"""Deprecated: ``workers.cluster_nodes`` is ``workers.cluster.nodes`` now; the old name stays for
one release.

Importing it warns once, with a ``DeprecationWarning`` naming the new path. Every name of the new
module, private ones included, reads through this one (the same objects); so do the errors and
warnings once defined here (``NodeLostError``, ``NodeLostWarning``, ``NoHostOnNodeError``,
``HostRestartedWarning``), which are in ``workers.errors`` now. Unlike the other shims it is not
the new module itself, since that one no longer holds them: a name set here is not set there.
"""

from __future__ import annotations

import warnings
from typing import Any

from workers.cluster import nodes as _new
from workers.errors import (  # noqa: F401 - the old path's names
    HostRestartedWarning,
    NodeLostError,
    NodeLostWarning,
    NoHostOnNodeError,
)

warnings.warn(f"{__name__} is deprecated and goes in the next release: import {_new.__name__}",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """Any other name, from ``workers.cluster.nodes``."""
    return getattr(_new, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *dir(_new)})
