"""``python -m workers.demo``: the demo without the ``shmbuf`` command."""

from __future__ import annotations

from .command import main

if __name__ == "__main__":
    raise SystemExit(main())
