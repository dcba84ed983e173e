"""Reclaiming what dead processes left in /dev/shm: segments whose owner lease is free.

One mechanism for everyone who removes a dead owner's segment or takes it over: ``shmbuf gc``,
a ``SamplerPool`` that opens on a buffer whose earlier learner was killed (its staging ring and
priority table), and a cluster host that re-adopts its node's buffer. Each first *claims* the
segment by taking its owner lease (``layout.LOCK_OWNER``), the proof of death ``gc`` uses and
an atomic one: of two processes reclaiming at once, one gets the lease and the other leaves the
segment alone. A claimant unlinks while it holds the lease; one that adopts instead
(``Segment.adopt``) checks that the name still names the file it locked.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from . import layout as L
from .errors import SegmentFormatError
from .lease import try_lock
from .scan import SegmentInfo, scan
from .segment import read_header
from .shmdir import SHM_DIR, unlink


@dataclass(frozen=True)
class Reclaimed:
    """What a reclaim removed: the segments' names and their bytes."""

    names: tuple[str, ...] = ()
    nbytes: int = 0

    def __len__(self) -> int:
        return len(self.names)


def claim_dead(name: str) -> int | None:
    """Take the owner lease of segment ``name`` if its owner is dead: an open descriptor that
    holds it (close it to let go), or None if the owner lives, someone else claimed it first,
    or ``name`` is not a regular file of this user that is (or is becoming) a shmbuf segment."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name),
                     os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise SegmentFormatError(name)
        read_header(fd, name)  # (None: uninitialised, whose creator died before the magic)
        if try_lock(fd, L.LOCK_OWNER):
            return fd
    except (SegmentFormatError, OSError):
        pass
    os.close(fd)
    return None


def remove_dead(name: str) -> bool:
    """Unlink segment ``name`` if its owner is dead (claimed first); True if it was removed."""
    fd = claim_dead(name)
    if fd is None:
        return False
    try:
        return unlink(name)
    finally:
        os.close(fd)


def remove_dead_segments(match: Callable[[SegmentInfo], bool]) -> Reclaimed:
    """Unlink every dead-owner shmbuf segment of this user for which ``match`` is true (its
    header is read: never an unreadable file, a live one, or one being created)."""
    names, nbytes = [], 0
    for info in scan():
        if info.header is None or info.alive or not match(info):
            continue
        if remove_dead(info.name):
            names.append(info.name)
            nbytes += info.size
    return Reclaimed(tuple(names), nbytes)


POOL_KINDS = (L.KIND_STAGING, L.KIND_PRIORITY)  # the segments a pool makes for its buffer


def serves_buffer(info: SegmentInfo, buffer: str) -> bool:
    """Whether ``info`` is a segment of a pool over buffer ``buffer``: a staging ring or a
    priority table (``POOL_KINDS``) whose layout names the buffer. Nothing else ever is, so a
    restarted learner's pool never removes another kind (a weight store its actors read, whose
    owner died with the learner, waits for that learner to adopt it)."""
    header = info.header
    if header is None or header.kind not in POOL_KINDS:
        return False
    return isinstance(header.doc, dict) and header.doc.get("buffer") == buffer
