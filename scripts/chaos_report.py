"""A chaos run's settings (``ChaosConfig``), what it did and found (``Summary``: the FAIL lines,
the summary line), and its accounting of /dev/shm: the segments of its buffer, counted after
every learner start, and what is left of them after ``shmbuf gc``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shmbuf.scan import scan

SHM_DIR = "/dev/shm"
SHMBUF_CLI = str(Path(sys.executable).parent / "shmbuf")
MAX_FAIL_LINES = 12  # FAIL lines printed per mode (all are counted)
KINDS = ("actor", "worker", "learner")  # the processes chaos hits


@dataclass(frozen=True)
class ChaosConfig:
    """One mode's run (``stress.py``'s options)."""

    mode: str
    seconds: float
    actors: int = 3
    workers: int = 2
    batch_size: int = 64
    capacity: int = 2048
    payload: int = 1024
    max_extend: int = 64
    longest_episode: int = 200
    kill_every: float = 0.5  # a random actor or worker SIGKILLed (0: never)
    chaos: bool = True  # SIGSTOPs and learner kills
    stop_every: float = 1.0  # a random process SIGSTOPped (chaos only)
    stop_for: tuple[float, float] = (0.1, 3.0)
    learner_kill_every: tuple[float, float] | None = (20.0, 40.0)  # after its pool is open
    hang_timeout: float = 30.0
    drain_wait: float = 3.0
    train_step: float = 0.0  # seconds the learner sleeps after reporting each batch
    max_segments: int | None = None
    seed: int = 0
    start_method: str | None = None
    log_events: bool = False  # print every signal sent and every learner start


@dataclass
class Summary:
    """What one mode's run did and found; ``fail`` records (and prints) a failure."""

    mode: str
    rows_written: int = 0
    batches: int = 0
    rows_verified: int = 0
    bad_rows: int = 0
    kills: Counter = field(default_factory=Counter)  # by process kind
    stops: Counter = field(default_factory=Counter)
    learner_restarts: int = 0
    hangs: int = 0
    duplicates: int = 0
    excused_duplicates: int = 0
    gaps: int = 0
    lost: int = 0
    tail: int = 0
    segments: list[int] = field(default_factory=list)  # after each learner start
    left_after_gc: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def quiet(self) -> bool:
        """Enough FAIL lines were printed: the rest are only counted."""
        return len(self.failures) >= MAX_FAIL_LINES

    def fail(self, line: str) -> None:
        if not self.quiet:
            print(f"FAIL [{self.mode}]: {line}", flush=True)
        self.failures.append(line)

    def line(self) -> str:
        def kinds(c: Counter) -> str:
            return ", ".join(f"{c[k]} {k}" for k in KINDS)

        seg = f"max {max(self.segments)}, final {self.segments[-1]}" if self.segments else "none"
        return (f"summary [{self.mode}]: {self.rows_written:,} rows written; {self.batches:,} "
                f"batches ({self.rows_verified:,} rows) verified, {self.bad_rows} bad; kills: "
                f"{kinds(self.kills)}; SIGSTOPs: {kinds(self.stops)}; learner restarts "
                f"{self.learner_restarts}; hangs {self.hangs}; duplicates {self.duplicates} "
                f"(+{self.excused_duplicates} of batches held by killed learners); gaps "
                f"{self.gaps} (lost while no learner: {self.lost:,}, tail {self.tail}); "
                f"segments of the buffer after learner starts: {seg}; left after gc: "
                f"{len(self.left_after_gc)}")


def segments_of(buffer: str) -> list[str]:
    """The /dev/shm segments of a buffer: itself and those whose header names it (staging
    rings, priority tables), live or leaked."""
    return sorted(i.name for i in scan() if i.name == buffer or (
        i.header is not None and i.header.doc.get("buffer") == buffer))


def gc_and_check(buffer: str, shm_before: set[str], summary: Summary) -> None:
    """Run ``shmbuf gc`` on the buffer's segments (after its owner closed it); fail on any left.

    New /dev/shm entries that are not shmbuf segments are only noted: /dev/shm is shared, and
    nothing says which process made them."""
    ours = segments_of(buffer)
    if ours:  # (gc removes only those whose owner died, and says so of the others: quiet)
        subprocess.run([SHMBUF_CLI, "gc", *ours], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60, check=False)
    deadline = time.monotonic() + 5.0
    left = segments_of(buffer)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = segments_of(buffer)
    summary.left_after_gc = left
    if left:
        summary.fail(f"{len(left)} segment(s) of the buffer left in {SHM_DIR} after shmbuf gc: "
                     f"{left}")
    segments = {i.name for i in scan()}
    other = sorted(n for n in set(os.listdir(SHM_DIR)) - shm_before if n not in segments)
    if other:
        print(f"note [{summary.mode}]: new entries in {SHM_DIR} that are not shmbuf segments, "
              f"not necessarily this run's: {other}", flush=True)
