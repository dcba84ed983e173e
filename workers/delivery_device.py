"""Deprecated: ``workers.delivery_device`` is ``workers.delivery.device`` now; the old name stays for one
release.

Importing it warns once, with a ``DeprecationWarning`` naming the new path, and gives the new
module itself (``sys.modules`` maps the old name to it), so every name, private ones and
monkeypatches included, is the same object under both names.
"""

from __future__ import annotations

import sys
import warnings

from workers.delivery import device as _new

warnings.warn(f"{__name__} is deprecated and goes in the next release: import {_new.__name__}",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _new
