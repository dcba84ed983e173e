"""Child processes seen from the outside: liveness, state and descendants read from /proc, killing
and reaping, collecting what children report, and ``ProcessTree``, the record of every process a
test session started (for the tests of ``shmbuf`` and ``workers``, and their /dev/shm guard).

``python tests/_helpers/processes.py watch ...`` is the tree's watcher process, so the module
imports only the standard library at the top (``multiprocess`` lazily, for the start hooks).
"""

from __future__ import annotations

import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
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


# --------------------------------------------------------------------------------------------
# The process tree of a test session, dead members included
# --------------------------------------------------------------------------------------------
TREE_ENV = "SHMBUF_TEST_TREE"  # the session's token, inherited by every process it execs
_tree_log: str | None = None  # where processes of the tree are recorded (``_record``)
_hooks_installed = False


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) of ``pid``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2 :].split()
        return int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def process_start(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot, as shmbuf headers record it (0: gone;
    ``shmbuf.segment.process_start_time``, without importing shmbuf, for the watcher)."""
    st = _stat(pid)
    return 0 if st is None else st[1]


def _carries(pid: int, token: str) -> bool:
    """Does ``pid``'s environment (as it was exec'd) hold ``TREE_ENV=token``?"""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return f"{TREE_ENV}={token}".encode() in env.split(b"\0")


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _ticks_after_boot(when: float) -> int:
    """Unix time ``when`` in clock ticks since boot, the unit of /proc start times."""
    with open("/proc/stat", "rb") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    return int((when - boot) * _TICKS_PER_S)


def _pids() -> set[int]:
    return {int(e) for e in os.listdir("/proc") if e.isdigit()}


def _record(pid: int) -> None:
    """Append "pid start" to the session's log (if one is being kept). Never raises."""
    log = _tree_log
    if log is None or pid is None:
        return
    start = process_start(pid)  # a child not waited for yet is a zombie: still there
    if not start:
        return
    try:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.write(fd, f"{pid} {start}\n".encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def _record_fork() -> None:
    """At-fork hook, in the child: record it before it runs anything."""
    _record(os.getpid())


def _install_start_hooks() -> None:
    """Record every child this process (or a process forked from it) starts: forked ones from
    an at-fork hook, and, as soon as they exist, those that ``multiprocess``/``multiprocessing``
    ``Process.start`` (spawn, forkserver) and ``subprocess.Popen`` start. Once per process; at-fork
    hooks cannot be removed, so ``ProcessTree.close`` turns recording off instead."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    os.register_at_fork(after_in_child=_record_fork)

    def after(method: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = method(self, *args, **kwargs)
            _record(self.pid)
            return out

        return recorded

    import multiprocessing.process

    classes: list[Any] = [multiprocessing.process.BaseProcess]
    try:
        import multiprocess.process

        classes.append(multiprocess.process.BaseProcess)
    except ImportError:
        pass
    for cls in classes:
        cls.start = after(cls.start)
    popen: Any = subprocess.Popen  # _execute_child is private: typeshed leaves it out
    popen._execute_child = after(popen._execute_child)


class ProcessTree:
    """Every process a test session started, alive or dead, as (pid, start time) pairs: what the
    /dev/shm guard (``tests/conftest.py``) attributes a segment's owner with.

    No one record sees every process, so three are kept:

    - alive: a process is ours if ``root`` is among its ancestors, or if its environment (as it
      was exec'd) carries this session's token ``TREE_ENV``, which every process exec'd below
      ``root`` inherits, even one orphaned since (its parent died, so it left the tree);
    - started: ``root`` and every process forked from it append to the log each child they
      start, before it can end: a forked child records itself from an at-fork hook, and
      ``Process.start`` (spawn, forkserver) and ``subprocess.Popen`` record theirs as they
      return (``_install_start_hooks``);
    - the rest: a watcher process lists /proc every ``interval`` seconds and appends each new
      process whose parent is ours or which carries the token: the children of exec'd
      processes (a spawned pool's workers), known after they died if they lived that long.

    Pid reuse is told apart by start time. Not recorded: a child of an exec'd process that
    lived less than ``interval`` and is dead by the time it is asked about.

    Concurrency: the at-fork hook (in each forked child) and the watcher append whole lines to
    the log with ``O_APPEND``; only the process that made the tree reads it.

    Example::

        tree = ProcessTree.start()
        ...  # start processes
        tree.owns(header.owner_pid, header.owner_start)
        tree.close()
    """

    def __init__(self, root: int, token: str, log: str, watcher: subprocess.Popen | None = None
                 ) -> None:
        self.root, self.token, self.log = root, token, log
        self.root_start = process_start(root)
        self._watcher = watcher
        self._records: set[tuple[int, int]] = set()
        self._gone: set[tuple[int, int]] = set()  # records seen dead: never asked about again
        self._read_to = 0
        self._previous_token: str | None = None

    @classmethod
    def start(cls, interval: float = 0.02, timeout: float = 30.0) -> ProcessTree:
        """Record the tree of this process from now on: set the token in ``os.environ``,
        install the at-fork hook, start the watcher (and wait until it has listed the processes
        already below this one). ``close()`` stops it."""
        global _tree_log
        root = os.getpid()
        token = f"{root}-{secrets.token_hex(8)}"
        log = os.path.join(tempfile.mkdtemp(prefix="shmbuf-test-tree-"), "pids")
        open(log, "wb").close()
        previous = os.environ.get(TREE_ENV)
        os.environ[TREE_ENV] = token
        _tree_log = log
        _install_start_hooks()
        watcher = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "watch", str(root), log, token,
             str(interval)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, close_fds=True)
        tree = cls(root, token, log, watcher)
        tree._previous_token = previous
        assert watcher.stdout is not None
        ready, _, _ = select.select([watcher.stdout], [], [], timeout)
        if not ready or watcher.stdout.readline() != b"ready\n":
            tree.close()
            raise RuntimeError(f"the process-tree watcher did not start within {timeout}s")
        return tree

    def close(self) -> None:
        """Stop the watcher and the at-fork records, remove the log; restore ``TREE_ENV``.
        Idempotent."""
        global _tree_log
        if _tree_log == self.log:
            _tree_log = None
        if os.environ.get(TREE_ENV) == self.token:
            if self._previous_token is None:
                del os.environ[TREE_ENV]
            else:
                os.environ[TREE_ENV] = self._previous_token
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.terminate()
            try:
                watcher.wait(10)
            except subprocess.TimeoutExpired:
                watcher.kill()
                watcher.wait(10)
            if watcher.stdout is not None:
                watcher.stdout.close()
            shutil.rmtree(os.path.dirname(self.log), ignore_errors=True)

    @property
    def watcher_pid(self) -> int | None:
        """The watcher process (None once closed): a test may stop it to isolate the hooks."""
        return None if self._watcher is None else self._watcher.pid

    def records(self) -> set[tuple[int, int]]:
        """The (pid, start) pairs recorded so far by the at-fork hook and the watcher."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._read_to)
                data = f.read()
        except OSError:
            return self._records
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        for line in data[:end].splitlines():
            pid, start = line.split()
            self._records.add((int(pid), int(start)))
        self._read_to += end
        return self._records

    def owns(self, pid: int, start: int = 0) -> bool:
        """Is (or was) ``pid``, started at ``start`` clock ticks after boot, a process of this
        tree? ``start`` 0 (unknown) asks about the process that has ``pid`` now."""
        if pid <= 0:
            return False
        if start and (pid, start) in self.records():
            return True
        now = process_start(pid)
        if now == 0 or (start and now != start):
            return False  # dead and unrecorded, or the pid was reused
        return self._alive_and_ours(pid)

    def owned_when(self, pid: int, when: float) -> bool:
        """Was the process that had ``pid`` at ``when`` (Unix seconds: when it made a file, for
        a record that names a pid but no start time) a process of this tree? Its creator is
        taken to be the last process with that pid started by then (pids are reused)."""
        if pid <= 0:
            return False
        by_then = _ticks_after_boot(when) + 2 * _TICKS_PER_S  # boot time is rounded to 1 s
        starts = {s for p, s in self.records() if p == pid and s <= by_then}
        now = process_start(pid)
        if 0 < now <= by_then:
            starts.add(now)
        return bool(starts) and self.owns(pid, max(starts))

    def _alive_and_ours(self, pid: int) -> bool:
        p = pid
        for _ in range(256):  # an ancestor chain, bounded
            if p == self.root:
                return process_start(p) == self.root_start
            st = _stat(p)
            if st is None or st[0] <= 1:
                break
            p = st[0]
        return _carries(pid, self.token)

    def live_members(self) -> list[int]:
        """The pids of the tree that are alive now: ``root``, its descendants, and recorded
        processes that have left it (orphans)."""
        out = {self.root, *descendants(self.root)}
        for pid, start in self.records() - self._gone:
            if process_start(pid) == start:
                out.add(pid)
            else:
                self._gone.add((pid, start))
        return sorted(out)


def watch_tree(root: int, log: str, token: str, interval: float) -> None:
    """The watcher of ``ProcessTree``: append "pid start" to ``log`` for every process below
    ``root`` now, then for each new one whose parent is recorded or which carries ``token``,
    until ``root`` ends. Prints "ready" once the processes already there are recorded."""
    root_start = process_start(root)
    tree: dict[int, int] = {}
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def note(pid: int, start: int) -> None:
        tree[pid] = start
        os.write(fd, f"{pid} {start}\n".encode())

    note(root, root_start)
    for pid in descendants(root):
        note(pid, process_start(pid))
    seen = _pids()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while process_start(root) == root_start:
        now = _pids()
        pending = sorted(now - seen)
        seen = now
        while pending:  # a child and its parent may both be new: repeat until nothing moves
            left = []
            for pid in pending:
                st = _stat(pid)
                if st is None:
                    continue
                parent, start = st
                if (parent in tree and process_start(parent) == tree[parent]) or _carries(
                        pid, token):
                    note(pid, start)
                else:
                    left.append(pid)
            if len(left) == len(pending):
                break
            pending = left
        time.sleep(interval)


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "watch":
        sys.exit("usage: processes.py watch ROOT_PID LOG TOKEN INTERVAL")
    watch_tree(int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5]))
