"""Progress display for long saves and loads: tqdm when it is installed, else one stderr line.

Nothing is shown for work under ``AUTO_THRESHOLD`` bytes unless asked; tqdm is never required.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from .segment import fmt_bytes

AUTO_THRESHOLD = 256 << 20  # bytes; ``enabled=None`` shows progress only above this


class Progress:
    """Counts bytes done out of ``total``; a no-op unless shown.

    Args:
        total: bytes the whole job moves.
        desc: a short label, e.g. ``"saving shmbuf-buf-..."``.
        enabled: True shows progress, False never does, None shows it when
            ``total > AUTO_THRESHOLD``.
        file: where to draw (default: ``sys.stderr`` at construction time).

    Example:
        >>> with Progress(total=n_bytes, desc="saving") as bar:
        ...     for chunk in chunks:
        ...         bar.update(chunk.nbytes)
    """

    def __init__(
        self, total: int, desc: str, enabled: bool | None = None, file: TextIO | None = None
    ) -> None:
        self.total = max(int(total), 0)
        self.desc = desc
        self.done = 0
        self._file = file if file is not None else sys.stderr
        self._bar: Any = None
        self._plain = False
        self._shown_pct = -1
        show = self.total > AUTO_THRESHOLD if enabled is None else bool(enabled)
        if not show:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._plain = True
            self._draw()
        else:
            self._bar = tqdm(
                total=self.total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=self._file, leave=True, dynamic_ncols=True,
            )

    @property
    def shown(self) -> bool:
        return self._bar is not None or self._plain

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
        elif self._plain and self._percent() != self._shown_pct:
            self._draw()

    def _percent(self) -> int:
        return 100 if self.total == 0 else min(100, self.done * 100 // self.total)

    def _draw(self) -> None:
        self._shown_pct = self._percent()
        self._file.write(f"\r{self.desc}: {self._shown_pct:3d}% of {fmt_bytes(self.total)}")
        self._file.flush()

    def close(self) -> None:
        """Finish the display (idempotent)."""
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.close()
        elif self._plain:
            self._plain = False
            self._file.write("\n")
            self._file.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

