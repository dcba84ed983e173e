"""Another program's /dev/shm traffic, to show that the test suite ignores what it did not make.

Churns /dev/shm as a training job or another test run beside the tests does: POSIX semaphores
named like multiprocessing's (``sem.mp-*``), scratch files nobody maps (``churn-<pid>-*``), live
shmbuf buffers, and shmbuf buffers whose owner was SIGKILLed (dead-owner segments). It keeps
``--population`` entries at once, as many of each kind, each for a random time in
``--lifetime`` seconds, then replaced by a new one of its kind; it removes everything it made
when it stops: SIGTERM, SIGINT, ``--duration`` over, or ``--watch-pid`` gone.

Run it beside a test module (the module must pass; ``--shm-guard=strict`` makes it fail, the
control)::

    .venv/bin/python tests/_helpers/churn_shm.py --duration 600 & CHURN=$!
    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_actors.py
    kill $CHURN; wait $CHURN

It prints ``ready <pid>`` once one entry of every kind exists, and with ``--report PATH``
writes a JSON summary on the way out: entries made per kind, and those it could not remove
(none, unless something else removed them first).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

KINDS = ("sem", "file", "live", "dead_owner")
SHM_DIR = "/dev/shm"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Churn:
    """Makes and removes entries; ``held`` maps a name to (deadline, remover, kind)."""

    def __init__(self) -> None:
        import numpy as np
        import posix_ipc

        import shmbuf

        self._np, self._posix_ipc, self._shmbuf = np, posix_ipc, shmbuf
        self.spec = shmbuf.Spec(x=((4,), "float32"))
        self.held: dict[str, tuple[float, Callable[[], None], str]] = {}
        self.made = dict.fromkeys(KINDS, 0)
        self.not_removed: list[str] = []

    def make(self, kind: str, lifetime: float) -> str:
        maker = {"sem": self._sem, "file": self._file, "live": self._live,
                 "dead_owner": self._dead_owner}[kind]
        name, remove = maker()
        self.held[name] = (time.monotonic() + lifetime, remove, kind)
        self.made[kind] += 1
        return name

    def expire(self, now: float | None = None) -> list[str]:
        """Remove the entries whose time is up (all of them if ``now`` is None); return their
        kinds."""
        kinds = []
        for name, (deadline, remove, kind) in list(self.held.items()):
            if now is None or deadline <= now:
                del self.held[name]
                kinds.append(kind)
                try:
                    remove()
                except Exception:  # noqa: BLE001 - reported in the summary
                    self.not_removed.append(name)
                if os.path.exists(os.path.join(SHM_DIR, name)):
                    self.not_removed.append(name)
        return kinds

    def _sem(self) -> tuple[str, Callable[[], None]]:
        """A named semaphore as multiprocessing makes them: /dev/shm/sem.mp-<random>."""
        sem = self._posix_ipc.Semaphore(f"/mp-{secrets.token_hex(4)}", self._posix_ipc.O_CREX,
                                        initial_value=1)

        def remove() -> None:
            sem.unlink()
            sem.close()

        return "sem." + sem.name[1:], remove

    def _file(self) -> tuple[str, Callable[[], None]]:
        """A scratch file, written and closed: nobody maps or holds it."""
        name = f"churn-{os.getpid()}-{secrets.token_hex(4)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.write(fd, b"x" * 4096)
        os.close(fd)
        return name, lambda: os.unlink(path)

    def _live(self) -> tuple[str, Callable[[], None]]:
        """A live shmbuf buffer of this process."""
        buf = self._shmbuf.ReplayBuffer.create(self.spec, capacity=16)
        with buf.writer() as w:
            w.add(x=self._np.arange(4, dtype=self._np.float32))
        return buf.name, buf.close

    def _dead_owner(self) -> tuple[str, Callable[[], None]]:
        """A shmbuf buffer whose owner (a forked child) was SIGKILLed: its owner lease is free
        and nothing unlinks it (``shmbuf gc`` would)."""
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: create, report, die without any cleanup
            try:
                os.close(read_end)
                buf = self._shmbuf.ReplayBuffer.create(self.spec, capacity=16)
                os.write(write_end, buf.name.encode())
            finally:
                os.kill(os.getpid(), signal.SIGKILL)
        os.close(write_end)
        try:
            name = os.read(read_end, 256).decode()
        finally:
            os.close(read_end)
            os.waitpid(pid, 0)
        if not name:
            raise RuntimeError("the dead-owner child died before it created its buffer")
        return name, lambda: self._shmbuf.shmdir.unlink(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="stop after this many seconds")
    ap.add_argument("--population", type=int, default=12, help="entries held at once")
    ap.add_argument("--lifetime", type=float, nargs=2, default=(0.05, 0.4),
                    metavar=("MIN", "MAX"), help="seconds an entry is kept")
    ap.add_argument("--watch-pid", type=int, default=0, help="stop when this process is gone")
    ap.add_argument("--report", default="", help="write a JSON summary here on the way out")
    args = ap.parse_args(argv)
    if args.population % len(KINDS) or not 0 <= args.lifetime[0] <= args.lifetime[1]:
        ap.error(f"--population must be a multiple of {len(KINDS)} and --lifetime MIN <= MAX, "
                 f"got {args.population} and {args.lifetime}")

    stopping = False

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    churn = Churn()
    rng = random.Random()
    end = time.monotonic() + args.duration
    try:
        for k in range(args.population):
            churn.make(KINDS[k % len(KINDS)], rng.uniform(*args.lifetime))
        print(f"ready {os.getpid()}", flush=True)
        while not stopping and time.monotonic() < end:
            if args.watch_pid and not _alive(args.watch_pid):
                break
            for kind in churn.expire(time.monotonic()):
                churn.make(kind, rng.uniform(*args.lifetime))
            time.sleep(0.005)
    finally:
        churn.expire()
        if args.report:
            with open(args.report, "w") as f:
                json.dump({"made": churn.made, "not_removed": churn.not_removed}, f)
    return 1 if churn.not_removed else 0


if __name__ == "__main__":
    sys.exit(main())
