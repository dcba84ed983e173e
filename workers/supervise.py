"""Supervision shared by ``SamplerPool`` and ``ActorGroup``: one set of child processes, each with
its own ``Channel``, whose parent-side ends are closed in every forked child, restarted within a
per-minute budget, and whose exits are described in words. Also the one check that no process is
started while a child re-runs the main module (``refuse_main_reimport``).
"""

from __future__ import annotations

import collections
import os
import select
import signal
import sys
import time
import weakref
from types import FrameType
from typing import Any, Callable, Generic, TypeVar

from shmbuf.scan import scan
from shmbuf.shmdir import unlink

from .channel import OP_STOP, Channel
from .errors import MainModuleReimportError

READABLE = select.POLLIN | select.POLLHUP | select.POLLERR


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

    def exhausted(self) -> str:
        """Why a restart was refused, for an error message."""
        return (f"restart budget exhausted ({self.recent()} restarts in the last minute, max "
                f"{self.per_minute:g}/min)")


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


def stop_process(proc: Any, timeout: float) -> None:
    """Join ``proc``; SIGTERM it after ``timeout``, SIGKILL it after as long again."""
    proc.join(timeout)
    if proc.exitcode is None:
        proc.terminate()
        proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join(timeout)


# -- the one at-fork hook -----------------------------------------------------------------------
# Parent-side channel ends and wake-up fds: a forked child (a worker, an actor, anything) must not
# keep them open, or a dead parent's children would never see end-of-file. Objects registered
# here get ``_close_in_child()`` called in every forked child.
_PARENT_ONLY: weakref.WeakSet[Any] = weakref.WeakSet()


def parent_only(obj: Any) -> None:
    """Have ``obj._close_in_child()`` run in every child forked from now on (until ``forget``)."""
    _PARENT_ONLY.add(obj)


def forget(obj: Any) -> None:
    _PARENT_ONLY.discard(obj)


def _close_parent_only_in_child() -> None:
    for obj in list(_PARENT_ONLY):
        try:
            obj._close_in_child()
        except Exception:
            pass


os.register_at_fork(after_in_child=_close_parent_only_in_child)


# -- the main module re-run by a child ----------------------------------------------------------
# What a ChildSet's name starts, in the user's words.
_STARTERS = {"shmbuf-sampler": "SamplerPool(workers > 0)", "shmbuf-actor": "ActorGroup"}
_CHILD_MAIN = "__mp_main__"  # the main module's name while a spawned (or forkserver) child runs it


def _bootstrapping() -> bool:
    """True while multiprocessing starts this process (the spawn and forkserver bootstraps set
    the flag while they import the main module, and clear it before the target runs)."""
    for name in ("multiprocess", "multiprocessing"):
        module = sys.modules.get(name)
        if module is not None and getattr(module.current_process(), "_inheriting", False):
            return True
    return False


def _importing_main() -> str | None:
    """The file of the main module if this process is re-running it for a child's start (a
    calling frame is that module's top level, named ``__mp_main__``, or multiprocessing says
    this process is still bootstrapping); None otherwise. A function of ``__mp_main__`` called
    after the start (an actor's, a worker's target) is not a re-run."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == _CHILD_MAIN:
            return str(frame.f_globals.get("__file__", frame.f_code.co_filename))
        frame = frame.f_back
    if _bootstrapping():
        main = sys.modules.get(_CHILD_MAIN)
        return str(getattr(main, "__file__", None) or "the main module")
    return None


def _unlink_segments_of_this_process() -> None:
    """A child failing its start: unlink the segments it created, all in its re-run of the main
    script (it has run nothing else yet). A forkserver child ends with ``os._exit`` after the
    error, which skips the owner cleanup that a normal exit runs."""
    pid = os.getpid()
    for info in scan():
        if info.header is not None and info.header.owner_pid == pid:
            unlink(info.name)


def refuse_main_reimport(what: str) -> None:
    """Raise ``MainModuleReimportError`` if this process is re-running the main module for a
    child's start: ``what`` (a pool, an actor group, a cluster) would start processes, or a
    second Ray cluster, from inside that child, once per child, instead of the program.

    Called before ``what`` starts or creates anything. In a child still being started, the
    segments its re-run of the script created are unlinked first: the child dies of the error.
    """
    main = _importing_main()
    if main is not None:
        if _bootstrapping():
            _unlink_segments_of_this_process()
        raise MainModuleReimportError(
            f"{what} was created while {main} runs as {_CHILD_MAIN!r} in process {os.getpid()}: "
            f"the spawn and forkserver start methods re-run the main script in every process "
            f"they start, so its top-level code would start processes again from inside the "
            f"child. Fix: put the code that starts processes under "
            f"`if __name__ == \"__main__\":` in {main}")


class Child:
    """The parent's record of one supervised child; its ``child_id`` survives restarts."""

    def __init__(self, child_id: int) -> None:
        self.child_id = child_id
        self.proc: Any = None
        self.chan: Channel | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def describe_exit(self) -> str:
        return describe_exit(self.proc.exitcode if self.proc is not None else None)

    def send(self, op: int, a: int = 0, b: int = 0) -> None:
        """Send the child one record; OSError if it was never started or is gone."""
        if self.chan is None:
            raise OSError(f"child {self.child_id} was never started")
        self.chan.send(op, a, b)

    def receive(self) -> list[tuple[int, int, int, bytes]]:
        """Every record the child has sent and this end has not read yet (never blocks)."""
        return self.chan.receive()[0] if self.chan is not None else []


ChildT = TypeVar("ChildT", bound=Child)


class ChildSet(Generic[ChildT]):
    """Child processes that each run ``target(sock, *args)`` with a socket of their own.

    Made while the main module is re-run by a child (no ``if __name__ == "__main__":``), it
    raises ``MainModuleReimportError`` before anything starts.

    ``start`` (re)starts a child; ``wait`` blocks on messages, exits and ``wake()`` at once;
    ``exited`` finds dead children without blocking; ``retire`` forgets a dead process;
    ``may_restart`` spends the per-minute budget; ``stop`` asks, then terminates, then kills.

    Concurrency: each channel has two ends, the parent's (here) and the child's; a record on it
    has exactly one writer. The parent's end is set before the fork so the at-fork hook closes it
    in the child (and in any later child): a child then sees end-of-file when the parent dies.
    ``wake()`` may be called from another thread (it only writes the wake pipe).
    """

    def __init__(self, ctx: Any, target: Callable[..., Any], name: str,
                 max_restarts_per_minute: float) -> None:
        refuse_main_reimport(_STARTERS.get(name, f"a set of {name!r} processes"))
        self.budget = RestartBudget(max_restarts_per_minute)
        self.ctx, self.target, self.name = ctx, target, name
        self.children: list[ChildT] = []
        self.poller = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        self.poller.register(self._wake_r, READABLE)
        self._fd_owner: dict[int, tuple[str, ChildT | None]] = {self._wake_r: ("wake", None)}
        parent_only(self)

    def start(self, child: ChildT, *args: Any) -> None:
        """Start (or restart) ``child`` as ``target(its socket, *args)``."""
        chan, child_end = Channel.pair()
        proc = self.ctx.Process(target=self.target, args=(child_end, *args),
                                name=f"{self.name}-{child.child_id}", daemon=True)
        # Known before the fork, so the at-fork hook closes the parent's end in the child.
        child.chan = chan
        if child not in self.children:
            self.children.append(child)
        try:
            proc.start()
        finally:
            child_end.close()
        child.proc = proc
        for fd, kind in ((chan.fd, "msg"), (proc.sentinel, "exit")):
            self.poller.register(fd, READABLE)
            self._fd_owner[fd] = (kind, child)

    def wait(self, timeout: float) -> tuple[bool, list[ChildT], list[ChildT]]:
        """Wait up to ``timeout`` s: (woken, children with messages, children whose process
        ended). An exit is seen by its process sentinel, so it wakes the wait at once."""
        events = self.poller.poll(max(0, int(timeout * 1000)))
        woken, messages, exits = False, [], []
        for fd, _ in events:
            kind, child = self._fd_owner.get(fd, ("gone", None))
            if kind == "wake":
                woken = True
            elif kind == "msg" and child is not None:
                messages.append(child)
            elif kind == "exit" and child is not None:
                exits.append(child)
        return woken, messages, exits

    def exited(self) -> list[ChildT]:
        """Children whose process has ended (by ``waitpid``, not the sentinel: a grandchild
        that inherited the sentinel's write end would hide the exit). Never blocks."""
        return [c for c in self.children if c.proc is not None and c.chan is not None
                and not c.chan.closed and not c.proc.is_alive()]

    def retire(self, child: ChildT) -> None:
        """``child``'s process ended: reap it, stop watching it, close its channel."""
        if child.chan is None:  # never started
            return
        child.proc.join(1.0)
        for fd in (child.chan.fd, child.proc.sentinel):
            if self._fd_owner.pop(fd, None) is not None:
                self.poller.unregister(fd)
        child.chan.close()

    def may_restart(self) -> bool:
        """Spend one restart of the budget; False (nothing spent) if it is exhausted."""
        return self.budget.try_spend()

    @property
    def restarts(self) -> int:
        return self.budget.total

    def wake(self) -> None:
        """End a ``wait`` in progress (from another thread)."""
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass

    def stop(self, timeout: float) -> None:
        """Ask every child to stop; after ``timeout`` terminate, then kill. Idempotent."""
        for child in self.children:
            if child.chan is not None and not child.chan.closed:
                try:
                    child.chan.send(OP_STOP)
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for child in self.children:
            if child.proc is not None:
                stop_process(child.proc, max(0.1, deadline - time.monotonic()))
            if child.chan is not None:
                child.chan.close()
        self.children = []

    def close(self) -> None:
        """After ``stop``: close the wake pipe. Idempotent."""
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        forget(self)

    def _close_in_child(self) -> None:
        """In a forked child: close every parent-side end; this copy supervises nobody."""
        for child in self.children:
            if child.chan is not None:
                child.chan.close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1
        self.children = []
