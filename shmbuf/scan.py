"""Discovery: the shmbuf segments of this user in /dev/shm, read without attaching them.

What ``shmbuf ls`` lists and ``shmbuf gc`` chooses from. Anyone can put anything in /dev/shm:
only regular files are opened, never blocking, and a malformed one is listed with the reason.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass

from . import layout as L
from .errors import SegmentFormatError
from .lease import is_locked
from .segment import Header, read_header
from .shmdir import DEFAULT_PREFIX, SHM_DIR


@dataclass(frozen=True)
class SegmentInfo:
    """One file of ``scan()``: what its header says and whether its owner lives."""

    name: str
    size: int
    header: Header | None  # None: not (yet) initialised, or unreadable
    alive: bool  # owner lease held
    age: float  # seconds since the file was last changed
    error: str | None = None  # why it is unreadable (malformed, or not ours): gc keeps it

    @property
    def kind_name(self) -> str:
        if self.error is not None:
            return "unknown"
        if self.header is None:
            return "uninitialised"
        return L.kind_name(self.header.kind)


def open_regular(path: str) -> int | None:
    """Open ``path`` read-only if it is a regular file of this user; None otherwise.

    Never blocks and never follows a link: anyone can put a FIFO, a device node or a symlink
    in /dev/shm, and a plain ``open`` of a FIFO waits forever for a writer. ``lstat`` skips
    them without opening; ``O_NONBLOCK | O_NOFOLLOW`` and an ``fstat`` check cover a file
    swapped in between.
    """
    uid = os.getuid()
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _inspect_file(fd: int, entry: str) -> tuple[Header | None, str | None, bool]:
    """(header, why it is unreadable, whether it is ours) of the open /dev/shm file ``entry``."""
    header, error = None, None
    try:
        header = read_header(fd, entry)
    except SegmentFormatError as e:
        error = str(e)
    except OSError as e:
        error = f"segment {entry!r} cannot be read: {e}"
    ours = entry.startswith(DEFAULT_PREFIX) or os.pread(fd, len(L.MAGIC), 0) == L.MAGIC
    if ours and header is None and error is None:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & 0o077:
            error = (f"{entry!r} has no shmbuf header and mode {mode:04o}; shmbuf creates its "
                     f"segments with mode 0600, so it is not one of them")
    return header, error, ours


def scan() -> list[SegmentInfo]:
    """Every shmbuf segment of this user in /dev/shm: alive, leaked, being created, or
    unreadable (a malformed file named ``shmbuf-*`` or carrying the magic; ``error`` says why).

    Opens only regular files, without blocking; one bad file never stops the scan.
    """
    out: list[SegmentInfo] = []
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return out
    for entry in entries:
        fd = open_regular(os.path.join(SHM_DIR, entry))
        if fd is None:
            continue
        try:
            st = os.fstat(fd)
            header, error, ours = _inspect_file(fd, entry)
            if not ours:
                continue
            try:
                alive = is_locked(fd, L.LOCK_OWNER)
            except OSError as e:
                alive, error = False, error or f"cannot probe {entry!r}'s owner lease: {e}"
            age = time.time() - st.st_mtime
            out.append(SegmentInfo(entry, st.st_size, None if error else header, alive, age,
                                   error))
        except OSError:
            continue  # vanished or unreadable between the listing and now
        finally:
            os.close(fd)
    return out
