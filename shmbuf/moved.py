"""``moved``: what a module that moved leaves at its old path for one release.

The old module calls ``moved(__name__, new_module)`` and holds nothing else: importing it warns
once, with a ``DeprecationWarning`` naming the new path, and gives the new module itself
(``sys.modules`` maps the old name to it), so every name, private ones and monkeypatches
included, is the same object under both names (``tests/test_moved_modules.py``).
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType


def moved(old: str, new: ModuleType) -> None:
    warnings.warn(f"{old} is deprecated and goes in the next release: import {new.__name__}",
                  DeprecationWarning, stacklevel=3)
    sys.modules[old] = new
