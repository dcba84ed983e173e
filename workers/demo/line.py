"""The demos' live line (on one machine and on Ray nodes): how often it is drawn, the rates over
the interval since the last one, its leading columns and the summary's opening; each demo
appends the columns of its own stats.
"""

from __future__ import annotations

import sys
import time


class LiveLine:
    """A line of inserts/s, batches/s and GB/s to the learner, drawn every 0.5 s on a terminal
    (rewritten in place) or every 2 s elsewhere (one line each, for logs), each rate over the
    interval since the last line.

    Args:
        batch_bytes: bytes of one batch (for GB/s).
        tty: whether stdout is a terminal (default: ask it).

    Example:
        >>> line = LiveLine(batch_bytes)
        >>> while line.elapsed() < seconds:
        ...     batches += 1  # a batch, a train step
        ...     if line.due() is not None:
        ...         line.show(batches, inserts, f"buffer {len(buf):,}")
        >>> line.close()
    """

    def __init__(self, batch_bytes: int, tty: bool | None = None) -> None:
        self.batch_bytes = batch_bytes
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.every = 0.5 if self.tty else 2.0
        self.start = self.last_t = self.now = time.monotonic()
        self.last_batches = self.last_inserts = 0

    def elapsed(self) -> float:
        """Seconds since the line was made (the run's start)."""
        return time.monotonic() - self.start

    def due(self) -> float | None:
        """The seconds since the last line if the next one is due, else None."""
        self.now = time.monotonic()
        dt = self.now - self.last_t
        return dt if dt >= self.every else None

    def show(self, batches: int, inserts: int, columns: str) -> None:
        """Draw the line for ``batches`` and ``inserts`` so far (at the time of the last
        ``due()``), with the demo's own ``columns`` after the rates."""
        dt = self.now - self.last_t
        bps = (batches - self.last_batches) / dt
        line = (f"inserts/s {(inserts - self.last_inserts) / dt:9,.0f} | batches/s {bps:7,.0f} "
                f"| {bps * self.batch_bytes / 1e9:5.2f} GB/s | {columns}")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)
        self.last_t, self.last_batches, self.last_inserts = self.now, batches, inserts

    def close(self) -> None:
        """End a terminal's line, which is drawn in place."""
        if self.tty:
            print()

    def summary(self, batches: int, elapsed: float) -> str:
        """The summary's opening, left open for the demo's own figures:
        ``summary: N batches in S s (R/s, G GB/s to the learner``."""
        return (f"summary: {batches:,} batches in {elapsed:.1f} s ({batches / elapsed:,.0f}/s, "
                f"{batches * self.batch_bytes / elapsed / 1e9:.2f} GB/s to the learner")
