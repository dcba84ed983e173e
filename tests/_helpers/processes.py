"""Child processes seen from the outside: liveness, state and descendants read from /proc, killing
and reaping, and collecting what children report (for the tests of ``shmbuf`` and ``workers``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, which no parent has reaped yet, counts as dead)."""
    return proc_state(pid) not in ("", "Z", "X")


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc ("R", "S", "T" stopped, "Z" zombie...; "" if gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return ""
    return data[data.rindex(b")") + 2 : data.rindex(b")") + 3].decode()


def wait_dead(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` for every pid to end; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` in the process tree (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        ppid = int(data[data.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_quietly(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def collect(queue: Any, n: int, procs: list, timeout: float) -> list:
    """Take ``n`` results from ``queue``; fail fast if a process died without reporting."""
    import queue as _queue

    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        try:
            got.append(queue.get(timeout=0.2))
            continue
        except _queue.Empty:
            pass
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead:
            raise AssertionError(
                "child process(es) died before reporting: "
                + ", ".join(f"{p.name} pid {p.pid} exitcode {p.exitcode}" for p in dead)
            )
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {n - len(got)} result(s)")
    return got


@contextmanager
def reporting_child(ctx: Any, target: Callable[..., Any], *args: Any, what: str = "the child",
                    timeout: float = 60.0) -> Iterator[tuple[Any, Any, Any]]:
    """Start ``target(conn, *args)`` in a process of the multiprocessing context ``ctx`` and wait
    for the first thing it sends on ``conn`` (its report); yields (process, parent end of the
    pipe, report). On the way out the process is killed if still alive and joined, and the
    pipe closed."""
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child_end, *args))
    proc.start()
    child_end.close()
    try:
        assert parent_end.poll(timeout), f"{what} never reported"
        yield proc, parent_end, parent_end.recv()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        parent_end.close()


def reap(procs: list, timeout: float = 10.0) -> None:
    """Join each process within ``timeout``; SIGKILL and join whatever is still running."""
    deadline = time.monotonic() + timeout
    for p in procs:
        if p.pid is None:
            continue
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join(5)


def release_sync() -> None:
    """Finalize dropped multiprocessing primitives now: under spawn/forkserver their named
    semaphores stay in /dev/shm until then, and reference cycles delay it past the test."""
    import gc

    gc.collect()
