"""Supervision helpers shared by the sampler pool and actor groups: restart budgets and exits."""

from __future__ import annotations

import collections
import signal
import time


class RestartBudget:
    """Allows at most ``per_minute`` restarts in any sliding 60-second window.

    A rate, not a total: a days-long run that loses a process now and then never runs out, while a
    process that dies in a loop exhausts it within seconds.
    """

    def __init__(self, per_minute: float, window: float = 60.0) -> None:
        if per_minute < 0:
            raise ValueError(f"max_restarts_per_minute must be >= 0, got {per_minute}")
        self.per_minute = per_minute
        self.window = window
        self._times: collections.deque[float] = collections.deque()
        self.total = 0

    def recent(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()
        return len(self._times)

    def try_spend(self, now: float | None = None) -> bool:
        """Record a restart if the budget allows it; False if exhausted."""
        now = time.monotonic() if now is None else now
        if self.recent(now) + 1 > self.per_minute * self.window / 60.0:
            return False
        self._times.append(now)
        self.total += 1
        return True


def describe_exit(exitcode: int | None) -> str:
    """'killed by SIGKILL (signal 9)', 'exited with code 1', or 'still running'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name} (signal {-exitcode})"
    return f"exited with code {exitcode}"


_EXTERNAL_SIGNALS = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def self_inflicted(exitcode: int | None) -> bool:
    """Did a process die of its own doing (an error exit or a crash signal such as SIGSEGV)?

    SIGKILL, SIGTERM, SIGINT and SIGHUP come from outside (an operator, the OOM killer, a test)
    and say nothing about whether a restart would work.
    """
    if exitcode is None or exitcode == 0:
        return False
    return exitcode > 0 or -exitcode not in _EXTERNAL_SIGNALS


def stop_process(proc, timeout: float) -> None:
    """Join ``proc``; SIGTERM it after ``timeout``, SIGKILL it after as long again."""
    proc.join(timeout)
    if proc.exitcode is None:
        proc.terminate()
        proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join(timeout)
