"""The chaos itself: random SIGKILLs of actors and sampler workers, and SIGSTOPs of any of them or
of the learner, each followed by a SIGCONT after a random pause.

Processes are signalled through pidfds, opened and then checked to be the child of the process
that should own them (the harness for an actor or a learner, the current learner for a worker):
a pid reused by an unrelated process is never signalled, and a pidfd keeps naming the process
it was opened for.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Target = tuple[str, int, int]  # (kind, pid, pid of its parent)


def parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (-1 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return -1
    return int(data[data.rindex(b")") + 2 :].split()[1])


def open_child(pid: int | None, parent: int) -> int | None:
    """A pidfd of ``pid`` if it is a live child of ``parent``; None otherwise. Opened before
    the check: if the pid is reused after the check, the pidfd still names the old process."""
    if not pid:
        return None
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    if parent_of(pid) != parent:
        os.close(fd)
        return None
    return fd


def signal_fd(fd: int, sig: int) -> bool:
    """Send ``sig`` through a pidfd; False if the process is gone."""
    try:
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False


@dataclass
class Pause:
    """A process SIGSTOPped, and when it gets SIGCONT."""

    pidfd: int
    kind: str
    pid: int
    until: float
    owner: Any  # the learner object if the learner itself was paused, else None


class Chaos:
    """SIGKILLs and SIGSTOPs of the targets the harness names, counted in ``kills`` and
    ``stops`` by kind; ``event`` is told of each signal."""

    def __init__(self, rng: random.Random, stop_for: tuple[float, float], kills: Counter,
                 stops: Counter, event: Callable[[str], None]) -> None:
        self.rng, self.stop_for = rng, stop_for
        self.kills, self.stops, self.event = kills, stops, event
        self.paused: list[Pause] = []

    def running(self, targets: list[Target]) -> list[Target]:
        """Those of ``targets`` not paused now."""
        paused = {p.pid for p in self.paused}
        return [t for t in targets if t[1] not in paused]

    def kill_one(self, targets: list[Target]) -> None:
        """SIGKILL one of ``targets`` (not a paused one), at random."""
        victims = self.running(targets)
        if not victims:
            return
        kind, pid, parent = self.rng.choice(victims)
        fd = open_child(pid, parent)
        if fd is None:
            return
        if signal_fd(fd, signal.SIGKILL):
            self.kills[kind] += 1
            self.event(f"SIGKILL {kind} pid {pid}")
        os.close(fd)

    def stop_one(self, targets: list[Target], learner: Any) -> None:
        """SIGSTOP one of ``targets`` at random for ``stop_for`` seconds; ``learner``: the
        learner object, remembered if the learner is the one paused."""
        victims = self.running(targets)
        if not victims:
            return
        kind, pid, parent = self.rng.choice(victims)
        fd = open_child(pid, parent)
        if fd is None:
            return
        if not signal_fd(fd, signal.SIGSTOP):
            os.close(fd)
            return
        pause = self.rng.uniform(*self.stop_for)
        self.stops[kind] += 1
        self.event(f"SIGSTOP {kind} pid {pid} for {pause:.2f} s")
        self.paused.append(Pause(fd, kind, pid, time.monotonic() + pause,
                                 learner if kind == "learner" else None))

    def resume_due(self, everything: bool = False) -> list[Any]:
        """SIGCONT the paused processes whose time is up (``everything``: all of them);
        returns the learners among them."""
        now = time.monotonic()
        keep, learners = [], []
        for p in self.paused:
            if everything or now >= p.until:
                signal_fd(p.pidfd, signal.SIGCONT)
                self.event(f"SIGCONT {p.kind} pid {p.pid}")
                os.close(p.pidfd)
                if p.owner is not None:
                    learners.append(p.owner)
            else:
                keep.append(p)
        self.paused = keep
        return learners

    def holds(self, learner: Any) -> bool:
        """True while ``learner`` is paused."""
        return any(p.owner is learner for p in self.paused)

    def forget(self, learner: Any) -> None:
        """Forget the pause of a learner that is gone."""
        for p in self.paused:
            if p.owner is learner:
                os.close(p.pidfd)
        self.paused = [p for p in self.paused if p.owner is not learner]
