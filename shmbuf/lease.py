"""Leases: OFD locks on one byte each of a segment's file, held by a process's own file description.

Who holds which byte (``layout.LOCK_OWNER``, ``lock_lane(k)``, ``LOCK_LIMITER``) says who is
alive; ``is_locked`` asks without taking anything.

Concurrency: a lease is a file description this process opened itself (``/proc/self/fd``), so
its locks die with the process, even by SIGKILL, and are never shared with a forked child:
the at-fork hook closes the child's copies of every lease descriptor.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import weakref

# struct flock on Linux x86-64 and aarch64: short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid (l_pid must be 0 for OFD locks).
_FLOCK = struct.Struct("hhqqi4x")
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)


def try_lock(fd: int, offset: int) -> bool:
    """Take an exclusive OFD lock on one byte at ``offset``; False if someone else holds it."""
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def is_locked(fd: int, offset: int) -> bool:
    """True if an open file description other than ``fd``'s holds the lock at ``offset``."""
    res = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
    return _FLOCK.unpack(res)[0] != fcntl.F_UNLCK


class Lease:
    """A file description of this process's own on a segment, holding OFD locks.

    Closing it (or the process dying) releases every lock it holds. A forked child never
    inherits a live lease: the at-fork hook closes the child's copy of the descriptor.

    Concurrency: one process's; other processes see its locks only through ``is_locked``.
    """

    _live: weakref.WeakSet[Lease] = weakref.WeakSet()

    def __init__(self, segment_fd: int) -> None:
        # Re-opening through /proc gives a new open file description (dup() would share one),
        # and works even after the name was unlinked.
        self.fd: int | None = os.open(f"/proc/self/fd/{segment_fd}", os.O_RDWR | os.O_CLOEXEC)
        self.pid = os.getpid()
        Lease._live.add(self)

    def try_lock(self, offset: int) -> bool:
        if self.fd is None:
            raise ValueError("lease is closed")
        return try_lock(self.fd, offset)

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None and self.pid == os.getpid():
            os.close(fd)
        Lease._live.discard(self)

    def __del__(self) -> None:
        # Last resort, not the plan: a lease dropped unclosed (e.g. a Writer never closed) must
        # not hold its locks and descriptor for the rest of the process.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @classmethod
    def _after_fork_in_child(cls) -> None:
        for lease in list(cls._live):
            if lease.fd is not None:
                try:
                    os.close(lease.fd)
                except OSError:
                    pass
                lease.fd = None
        cls._live = weakref.WeakSet()


os.register_at_fork(after_in_child=Lease._after_fork_in_child)
