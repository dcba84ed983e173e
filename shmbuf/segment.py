"""POSIX shared-memory segments: create, attach, validate the header, map, close.

A ``Segment`` is one ``/dev/shm`` file mapped into this process. Its creator is its owner: the
owner holds the ``LOCK_OWNER`` lease (``lease.py``) for as long as it lives, and unlinks the
segment on ``close()``, or at exit and on a fatal signal (``cleanup.py``). A segment whose owner
lease is free was leaked by a dead owner; ``shmbuf gc`` (``scan.py``) removes only those.

Concurrency: the header is written once, by the creator, before the magic; after that only the
owner pid/start change (``BufferStorage.adopt``). Leases are OFD locks on a description opened
by this process (``/proc/self/fd``), so they die with it, even by SIGKILL, and are never shared
with a forked child: children close inherited lease descriptors at fork.

Headers are untrusted input (any process of the user can write /dev/shm): ``read_header``
bounds every length before reading and validates every field, so a malformed file is a
``SegmentFormatError`` naming it, never a hang, a crash or an exhausted memory.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import posix_ipc  # type: ignore[import-not-found]  # a C extension without stubs

from . import layout as L
from .checks import timeout_seconds
from .cleanup import forget_owned, register_owned
from .errors import (
    BufferInUseError,
    CapacityError,
    SegmentExistsError,
    SegmentFormatError,
    SegmentNotFoundError,
)
from .lease import Lease, is_locked
from .shmdir import SHM_DIR, new_name, normalize_name, shm_free_bytes, unlink
from .slots import check_platform


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB`` ... ``2.0 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def _capacity_error(name: str, size: int, free: int) -> CapacityError:
    return CapacityError(
        f"segment {name!r} needs {fmt_bytes(size)} of shared memory but {SHM_DIR} has "
        f"{fmt_bytes(free)} free. Fix: lower capacity, or give {SHM_DIR} more room (Docker: "
        f"`docker run --shm-size=<size>`; Kubernetes: an emptyDir with medium: Memory), or "
        f"remove leaked segments with `shmbuf gc`"
    )


def _no_room_for_a_file(name: str) -> CapacityError:
    return CapacityError(
        f"cannot create segment {name!r}: {SHM_DIR} has no room for another file (its inodes "
        f"are used up, or it is full). Fix: remove leaked segments with `shmbuf gc` and unused "
        f"files in {SHM_DIR}, or give {SHM_DIR} more room (Docker: `docker run "
        f"--shm-size=<size>`; Kubernetes: an emptyDir with medium: Memory; a tmpfs mount: "
        f"size= and nr_inodes=)"
    )


def process_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 if unknown); tells pids apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


# --------------------------------------------------------------------------------------------
# Headers
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Header:
    """The fixed part of a segment header plus its decoded layout document."""

    version: int
    kind: int
    total_size: int
    owner_pid: int
    owner_start: int
    created: float
    owner_uid: int
    doc: dict[str, Any]


def _magic_so_far(magic: bytes) -> bool:
    """True if ``magic`` is all zero or part of the real one: a creator may be writing it."""
    return all(b == 0 or b == m for b, m in zip(magic, L.MAGIC))


def read_header(fd: int, name: str = "?") -> Header | None:
    """Read and validate the header of segment ``name`` through ``fd``.

    Returns None while the segment is not initialised yet (empty, or a page-sized file whose
    magic is not complete: its creator is still writing it, or died doing so). Raises
    ``SegmentFormatError`` naming ``name`` for anything else that is not a valid header of this
    format: too short, wrong magic, another format version, an unknown kind, a length, size or
    time out of range, a layout JSON that is corrupt, too long or too deep, or a file whose size
    differs from the one its header records. Reads at most ``MAX_LAYOUT_JSON`` bytes.
    """
    def bad(why: str) -> SegmentFormatError:
        return SegmentFormatError(
            f"segment {name!r} is not a valid shmbuf segment: {why}. If it is a leftover, "
            f"remove it by hand (rm {os.path.join(SHM_DIR, name)}); `shmbuf gc` never removes "
            f"files it cannot validate"
        )

    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise bad("not a regular file")
    if st.st_size == 0:
        return None  # created, not sized yet
    raw = os.pread(fd, L.H_JSON, 0)
    if len(raw) < L.H_JSON:
        raise bad(f"{st.st_size} bytes, shorter than a header ({L.H_JSON} bytes)")
    magic, version, kind, size, pid, start, created, uid, jlen = L.HEADER.unpack_from(raw)
    if magic != L.MAGIC:
        if _magic_so_far(magic) and st.st_size % L.PAGE == 0:
            return None
        raise SegmentFormatError(
            f"segment {name!r} is not an initialised shmbuf segment: it starts with "
            f"{magic!r}, not the shmbuf magic {L.MAGIC!r}. It is not ours; `shmbuf gc` leaves it"
        )
    if version != L.FORMAT_VERSION:
        raise SegmentFormatError(
            f"segment {name!r} has format version {version}; this shmbuf reads version "
            f"{L.FORMAT_VERSION}. Fix: use the same shmbuf version in every process"
        )
    if kind not in L.KIND_NAMES:
        raise bad(f"unknown kind {kind} (known: {L.KIND_NAMES})")
    if jlen > L.MAX_LAYOUT_JSON or L.header_size(jlen) > size:
        raise bad(f"a layout JSON of {jlen} bytes (at most {L.MAX_LAYOUT_JSON}, within the "
                  f"segment's {size} bytes)")
    if size != st.st_size:
        raise bad(f"its header says {size} bytes but the file has {st.st_size}: truncated or "
                  f"corrupt")
    if not (math.isfinite(created) and 0 <= created <= L.MAX_CREATED):
        raise bad(f"creation time {created!r} is out of range")
    if not 0 < pid < 2**31:
        raise bad(f"owner pid {pid} is out of range")
    payload = os.pread(fd, jlen, L.H_JSON)
    if len(payload) != jlen:
        raise bad(f"its layout JSON is cut short ({len(payload)} of {jlen} bytes)")
    try:
        doc = json.loads(payload)
        L.check_layout_doc(kind, doc, size)
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as e:
        raise bad(f"its layout is corrupt ({type(e).__name__}: {str(e)[:200]})") from None
    return Header(version, kind, size, pid, start, created, uid, doc)


# --------------------------------------------------------------------------------------------
# Segment
# --------------------------------------------------------------------------------------------
class Segment:
    """One mapped shmbuf segment.

    Use ``Segment.create`` (owner) or ``Segment.attach``. ``buf`` is the mmap; wrap it with
    ``np.frombuffer`` (never ``np.ndarray(buffer=...)``) so close() can tell views still exist.

    Concurrency: only the creator writes the header, once, magic last; every process then reads
    it. Who writes which word of the body is the business of the modules above (``slots.py``,
    ``storage.py``); a ``Segment`` itself only maps, leases, unlinks and unmaps.
    """

    def __init__(self, name: str, fd: int, mm: mmap.mmap, header: Header, owner: bool) -> None:
        self.name = name
        self.fd: int | None = fd
        self.buf: mmap.mmap | None = mm
        self.header = header
        self.owner = owner
        self.pid = os.getpid()
        self.owner_lease: Lease | None = None

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str | None, kind: int, doc: dict[str, Any],
               size_of: Callable[[int], int]) -> Segment:
        """Create, size and initialise a segment; the caller becomes its owner.

        ``size_of(json_len)`` returns the total size for a layout JSON of that many bytes.

        Raises:
            CapacityError: /dev/shm has too little room, or no inode left for a new file.
            SegmentExistsError: ``name`` is taken.
            UnsupportedPlatformError: not 64-bit x86 (see ``check_platform``).
        """
        check_platform()
        bare = normalize_name(name) if name is not None else new_name(L.KIND_TAGS[kind])
        payload = L.encode_layout(doc)
        if len(payload) > L.MAX_LAYOUT_JSON:
            raise ValueError(
                f"the layout of segment {bare!r} is {len(payload)} bytes of JSON, more than "
                f"{L.MAX_LAYOUT_JSON}. Fix: fewer fields (group small ones into arrays)"
            )
        size = int(size_of(len(payload)))
        free = shm_free_bytes()
        if size > free:
            raise _capacity_error(bare, size, free)
        try:
            shm = posix_ipc.SharedMemory("/" + bare, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.ExistentialError:
            raise SegmentExistsError(
                f"a shared-memory segment named {bare!r} already exists. Fix: pick another "
                f"name, attach to it with ReplayBuffer.attach({bare!r}), or remove a leaked one "
                f"with `shmbuf gc`"
            ) from None
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _no_room_for_a_file(bare) from None
            raise
        fd = shm.fd
        lease = None
        mm = None
        try:
            lease = Lease(fd)
            if not lease.try_lock(L.LOCK_OWNER):  # nobody else can have it: fresh file
                raise RuntimeError("could not take the owner lease of a fresh segment")
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENOMEM):
                    raise _capacity_error(bare, size, shm_free_bytes()) from None
                raise
            mm = _map(fd, size)
            now = time.time()
            pid = os.getpid()
            start = process_start_time(pid)
            # Everything but the magic first; the magic last marks the header complete.
            L.HEADER.pack_into(mm, 0, b"\0" * 8, L.FORMAT_VERSION, kind, size, pid, start, now,
                           os.getuid(), len(payload))
            mm[L.H_JSON : L.H_JSON + len(payload)] = payload
            mm[0:8] = L.MAGIC
            header = Header(L.FORMAT_VERSION, kind, size, pid, start, now, os.getuid(), doc)
        except BaseException:
            if mm is not None:
                mm.close()
            if lease is not None:
                lease.close()
            unlink(bare)
            os.close(fd)
            raise
        seg = cls(bare, fd, mm, header, owner=True)
        seg.owner_lease = lease
        register_owned(bare)
        return seg

    @classmethod
    def attach(cls, name: str, kind: int | None = None, timeout: float = 5.0) -> Segment:
        """Map an existing segment; never resizes it. Waits up to ``timeout`` seconds for its
        creator to finish initialising it.

        Raises:
            SegmentNotFoundError: no segment of that name.
            SegmentFormatError: not a valid shmbuf segment of this format (of ``kind``, if
                given), or another user's; nothing stays open or mapped.
            UnsupportedPlatformError: not 64-bit x86 (see ``check_platform``).
            ValueError: a bad ``timeout`` (NaN, infinite, negative, not a number).
        """
        wait = timeout_seconds("timeout", timeout)
        check_platform()
        bare = normalize_name(name)
        try:
            shm = posix_ipc.SharedMemory("/" + bare)  # size 0: never truncates the owner's file
        except posix_ipc.ExistentialError:
            raise SegmentNotFoundError(
                f"no shared-memory segment named {bare!r} (it was never created, or its owner "
                f"closed it). `shmbuf ls` lists the live ones"
            ) from None
        except posix_ipc.PermissionsError:
            raise SegmentFormatError(
                f"segment {bare!r} belongs to another user; shmbuf attaches only its own "
                f"user's segments (they are created with mode 0600)"
            ) from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise SegmentFormatError(
                    f"{bare!r} in {SHM_DIR} is not a shmbuf segment ({e.strerror})"
                ) from None
            raise
        fd = shm.fd
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise SegmentFormatError(
                    f"segment {bare!r} is owned by uid {st.st_uid}, not {os.getuid()}"
                )
            deadline = time.monotonic() + wait
            while True:
                header = read_header(fd, bare)
                if header is not None:
                    break
                if time.monotonic() >= deadline:
                    raise SegmentFormatError(
                        f"{bare!r} is not an initialised shmbuf segment (no magic after "
                        f"{wait}s): its creator died while creating it, or it is not ours. "
                        f"`shmbuf gc` removes leaked ones"
                    )
                time.sleep(0.01)
            if kind is not None and header.kind != kind:
                raise SegmentFormatError(
                    f"segment {bare!r} is a {L.kind_name(header.kind)}, not a "
                    f"{L.kind_name(kind)}"
                )
            if header.owner_uid != os.getuid():
                raise SegmentFormatError(f"segment {bare!r} was created by uid {header.owner_uid}")
            size = os.fstat(fd).st_size
            if size != header.total_size:
                raise SegmentFormatError(
                    f"segment {bare!r} is {size} bytes but its header says {header.total_size}: "
                    f"truncated or corrupt"
                )
            mm = _map(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(bare, fd, mm, header, owner=False)

    @classmethod
    def adopt(cls, name: str, kind: int | None = None, timeout: float = 5.0) -> Segment:
        """Attach to a segment whose owner died and become its owner: take the owner lease,
        record this process in the header, and unlink the segment at close/exit as its creator
        would. Its contents are untouched.

        Raises:
            SegmentNotFoundError: no segment of that name (it is gone: create a new one).
            SegmentExistsError: its owner is alive (the lease is held); nothing changed.
        """
        seg = cls.attach(name, kind, timeout=timeout)
        lease = seg.lease()
        if not lease.try_lock(L.LOCK_OWNER):
            lease.close()
            seg.close()
            raise SegmentExistsError(
                f"segment {seg.name!r} has a live owner (pid {seg.header.owner_pid}); only a "
                f"segment whose owner died can be adopted. Fix: attach to it instead")
        if not seg._still_named():  # a reclaim (``shmbuf.reclaim``) unlinked it meanwhile
            lease.close()
            seg.close()
            raise SegmentNotFoundError(f"segment {seg.name!r} was removed while being adopted")
        pid, start = os.getpid(), process_start_time(os.getpid())
        assert seg.buf is not None
        seg.buf[L.H_OWNER_PID:L.H_OWNER_START + 8] = struct.pack("<QQ", pid, start)
        seg.header = dataclasses.replace(seg.header, owner_pid=pid, owner_start=start)
        seg.owner, seg.owner_lease, seg.pid = True, lease, pid
        register_owned(seg.name)
        return seg

    def _still_named(self) -> bool:
        """Whether this segment's name still names the file this process has mapped."""
        if self.fd is None:
            return False
        try:
            named = os.stat(os.path.join(SHM_DIR, self.name), follow_symlinks=False)
        except OSError:
            return False
        mine = os.fstat(self.fd)
        return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)

    # -- liveness ----------------------------------------------------------------------------------
    def owner_alive(self) -> bool:
        """True while the creating process lives (its owner lease is held)."""
        if self.owner and self.pid == os.getpid() and self.owner_lease is not None:
            return True
        return self.probe(L.LOCK_OWNER)

    def probe(self, offset: int) -> bool:
        """True if some file description holds the OFD lock at ``offset``."""
        if self.fd is None:
            raise ValueError("segment is closed")
        return is_locked(self.fd, offset)

    def lease(self) -> Lease:
        if self.fd is None:
            raise ValueError("segment is closed")
        return Lease(self.fd)

    # -- teardown ---------------------------------------------------------------------------------
    def unlink(self) -> None:
        """Remove the name (owner only); mappings stay valid until they are closed."""
        if self.owner and self.pid == os.getpid():
            unlink(self.name)
            forget_owned(self.name)

    def close(self) -> None:
        """Unlink (owner), drop leases, unmap. Idempotent.

        Raises:
            BufferInUseError: NumPy arrays still view the mapping. Everything else was done;
                the memory is unmapped when those arrays are freed, and close() may be called
                again.
        """
        if self.owner and self.pid == os.getpid():
            self.unlink()
            self.owner = False
        if self.owner_lease is not None:
            self.owner_lease.close()
            self.owner_lease = None
        if self.buf is not None:
            try:
                self.buf.close()
            except BufferError:
                raise BufferInUseError(
                    f"segment {self.name!r} was closed but stays mapped: NumPy arrays still view "
                    f"its memory (e.g. from column() or a Batch). Delete them (del arr) and the "
                    f"memory is unmapped; copy what you keep with np.array(view)"
                ) from None
            self.buf = None
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


def _map(fd: int, size: int) -> mmap.mmap:
    """Map a segment shared, read-write. Huge pages are requested: on a 4 KiB-page /dev/shm
    every process pays a page fault per page it first touches (about 7 us each measured on a
    VM), which transparent huge pages for shmem (``shmem_enabled=advise``) cut 512-fold."""
    mm = mmap.mmap(fd, size)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:
            pass
    return mm
