"""POSIX shared-memory segments: create, attach, leases (OFD locks), cleanup and discovery.

A ``Segment`` is one ``/dev/shm`` file mapped into this process. Its creator is its owner: the
owner holds the ``LOCK_OWNER`` lease for as long as it lives, and unlinks the segment on
``close()``, at normal exit and on SIGTERM (and SIGINT where Python's KeyboardInterrupt is not in
charge). A segment whose owner lease is free was leaked by a dead owner; ``shmbuf gc`` removes
only those.

Concurrency: the header is written once, by the creator, before the magic; after that it is
read-only. Leases are OFD locks taken on a file description this process opened itself
(``/proc/self/fd``), so they die with the process, even by SIGKILL, and are never shared with a
forked child: children close inherited lease descriptors at fork.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import mmap
import os
import re
import secrets
import signal
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import posix_ipc

from . import layout as L
from .errors import (
    BufferInUseError,
    CapacityError,
    SegmentExistsError,
    SegmentFormatError,
    SegmentNotFoundError,
)

SHM_DIR = "/dev/shm"
DEFAULT_PREFIX = "shmbuf-"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")

# struct flock on Linux x86-64 and aarch64: short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid (l_pid must be 0 for OFD locks).
_FLOCK = struct.Struct("hhqqi4x")
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)


# --------------------------------------------------------------------------------------------
# OFD locks
# --------------------------------------------------------------------------------------------
def try_lock(fd: int, offset: int) -> bool:
    """Take an exclusive OFD lock on one byte at ``offset``; False if someone else holds it."""
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def unlock(fd: int, offset: int) -> None:
    fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, offset, 1, 0))


def is_locked(fd: int, offset: int) -> bool:
    """True if an open file description other than ``fd``'s holds the lock at ``offset``."""
    res = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
    return _FLOCK.unpack(res)[0] != fcntl.F_UNLCK


class Lease:
    """A file description of this process's own on a segment, holding OFD locks.

    Closing it (or the process dying) releases every lock it holds. A forked child never
    inherits a live lease: the at-fork hook closes the child's copy of the descriptor.
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

    def unlock(self, offset: int) -> None:
        if self.fd is not None:
            unlock(self.fd, offset)

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


# --------------------------------------------------------------------------------------------
# Owner cleanup: atexit and signals
# --------------------------------------------------------------------------------------------
_owned: dict[str, int] = {}  # segment name -> pid of the owner that must unlink it
# Re-entrant: the signal handler runs on the main thread, possibly while that thread is inside
# one of the critical sections below; a plain Lock would deadlock it (the process hangs).
_owned_lock = threading.RLock()
_prev_handlers: dict[int, Any] = {}


def _unlink_owned() -> None:
    pid = os.getpid()
    with _owned_lock:
        names = [n for n, p in _owned.items() if p == pid]
        for n in names:
            _owned.pop(n, None)
    for n in names:
        unlink(n)


def _on_signal(signum: int, frame: Any) -> None:
    _unlink_owned()
    prev = _prev_handlers.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_IGN:
        return
    else:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        current = signal.getsignal(sig)
        if current is _on_signal or current == signal.SIG_IGN:
            continue
        if sig == signal.SIGINT and current is signal.default_int_handler:
            continue  # KeyboardInterrupt unwinds to a normal exit, where atexit unlinks
        if current is None:  # installed from C; cannot chain to it
            continue
        _prev_handlers[sig] = current
        try:
            signal.signal(sig, _on_signal)
        except (ValueError, OSError):
            pass


atexit.register(_unlink_owned)


def _register_owned(name: str) -> None:
    with _owned_lock:
        _owned[name] = os.getpid()
    _install_signal_handlers()


def _forget_owned(name: str) -> None:
    with _owned_lock:
        _owned.pop(name, None)


# --------------------------------------------------------------------------------------------
# Names, sizes, headers
# --------------------------------------------------------------------------------------------
def normalize_name(name: str) -> str:
    """``'/shmbuf-x'`` or ``'shmbuf-x'`` -> ``'shmbuf-x'`` (the file name in /dev/shm)."""
    if not isinstance(name, str):
        raise TypeError(f"segment name must be a str, got {type(name).__name__}")
    bare = name[1:] if name.startswith("/") else name
    if not _NAME_RE.match(bare):
        raise ValueError(
            f"segment name {name!r} is not valid: use 1-200 letters, digits, '_', '.', '-'"
        )
    return bare


def new_name(kind: str) -> str:
    return f"{DEFAULT_PREFIX}{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


fmt_bytes = _fmt_bytes


def _capacity_error(name: str, size: int, free: int) -> CapacityError:
    return CapacityError(
        f"segment {name!r} needs {_fmt_bytes(size)} of shared memory but {SHM_DIR} has "
        f"{_fmt_bytes(free)} free. Fix: lower capacity, or give {SHM_DIR} more room (Docker: "
        f"`docker run --shm-size=<size>`; Kubernetes: an emptyDir with medium: Memory), or "
        f"remove leaked segments with `shmbuf gc`"
    )


def process_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 if unknown); tells pids apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


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


_HDR = struct.Struct("<8sIIQQQdII")  # magic, version, kind, size, pid, start, created, uid, jsonlen


def read_header(fd: int) -> Header | None:
    """Read a header through ``fd``; None if this is not (yet) an initialised shmbuf segment."""
    raw = os.pread(fd, L.H_JSON, 0)
    if len(raw) < L.H_JSON:
        return None
    magic, version, kind, size, pid, start, created, uid, jlen = _HDR.unpack_from(raw)
    if magic != L.MAGIC:
        return None
    if version != L.FORMAT_VERSION:
        raise SegmentFormatError(
            f"segment has format version {version}; this shmbuf reads version "
            f"{L.FORMAT_VERSION}. Fix: use the same shmbuf version in every process"
        )
    try:
        doc = json.loads(os.pread(fd, jlen, L.H_JSON))
    except ValueError as e:
        raise SegmentFormatError(f"segment header JSON is corrupt: {e}") from None
    return Header(version, kind, size, pid, start, created, uid, doc)


# --------------------------------------------------------------------------------------------
# Segment
# --------------------------------------------------------------------------------------------
class Segment:
    """One mapped shmbuf segment.

    Use ``Segment.create`` (owner) or ``Segment.attach``. ``buf`` is the mmap; wrap it with
    ``np.frombuffer`` (never ``np.ndarray(buffer=...)``) so close() can tell views still exist.
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
    def create(cls, name: str | None, kind: int, doc: dict[str, Any], size_of: Any) -> Segment:
        """Create, size and initialise a segment; the caller becomes its owner.

        ``size_of(json_len)`` returns the total size for a layout JSON of that many bytes.
        """
        bare = normalize_name(name) if name is not None else new_name(
            {L.KIND_BUFFER: "buf", L.KIND_STAGING: "staging"}.get(kind, "prio")
        )
        payload = L.encode_layout(doc)
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
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise _capacity_error(bare, size, shm_free_bytes()) from None
                raise
            mm = _map(fd, size)
            now = time.time()
            pid = os.getpid()
            start = process_start_time(pid)
            # Everything but the magic first; the magic last marks the header complete.
            _HDR.pack_into(mm, 0, b"\0" * 8, L.FORMAT_VERSION, kind, size, pid, start, now,
                           os.getuid(), len(payload))
            mm[L.H_JSON : L.H_JSON + len(payload)] = payload
            mm[0:8] = L.MAGIC
            header = Header(L.FORMAT_VERSION, kind, size, pid, start, now, os.getuid(), doc)
        except BaseException:
            if mm is not None:
                mm.close()
            if lease is not None:
                lease.close()
            try:
                posix_ipc.unlink_shared_memory("/" + bare)
            except posix_ipc.ExistentialError:
                pass
            os.close(fd)
            raise
        seg = cls(bare, fd, mm, header, owner=True)
        seg.owner_lease = lease
        _register_owned(bare)
        return seg

    @classmethod
    def attach(cls, name: str, kind: int | None = None, timeout: float = 5.0) -> Segment:
        """Map an existing segment; never resizes it. Waits up to ``timeout`` for its creator
        to finish initialising it."""
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
        fd = shm.fd
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise SegmentFormatError(
                    f"segment {bare!r} is owned by uid {st.st_uid}, not {os.getuid()}"
                )
            deadline = time.monotonic() + timeout
            while True:
                header = read_header(fd)
                if header is not None:
                    break
                if time.monotonic() >= deadline:
                    raise SegmentFormatError(
                        f"{bare!r} is not an initialised shmbuf segment (no magic after "
                        f"{timeout}s): its creator died while creating it, or it is not ours. "
                        f"`shmbuf gc` removes leaked ones"
                    )
                time.sleep(0.01)
            if kind is not None and header.kind != kind:
                raise SegmentFormatError(
                    f"segment {bare!r} is a {_KIND_NAMES.get(header.kind, header.kind)}, "
                    f"not a {_KIND_NAMES.get(kind, kind)}"
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
    @property
    def closed(self) -> bool:
        return self.fd is None

    def unlink(self) -> None:
        """Remove the name (owner only); mappings stay valid until they are closed."""
        if self.owner and self.pid == os.getpid():
            unlink(self.name)
            _forget_owned(self.name)

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


_KIND_NAMES = {L.KIND_BUFFER: "replay buffer", L.KIND_STAGING: "staging ring",
               L.KIND_PRIORITY: "priority table"}


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


def unlink(name: str) -> bool:
    """Unlink a segment name; False if it was already gone."""
    try:
        posix_ipc.unlink_shared_memory("/" + normalize_name(name))
        return True
    except posix_ipc.ExistentialError:
        return False


# --------------------------------------------------------------------------------------------
# Discovery (CLI)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SegmentInfo:
    name: str
    size: int
    header: Header | None  # None: not (yet) initialised
    alive: bool  # owner lease held
    age: float  # seconds since the file was last changed

    @property
    def kind_name(self) -> str:
        if self.header is None:
            return "uninitialised"
        return _KIND_NAMES.get(self.header.kind, f"kind {self.header.kind}")


def scan(include_foreign: bool = False) -> list[SegmentInfo]:
    """Every shmbuf segment of this user in /dev/shm, alive or leaked."""
    out = []
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return out
    uid = os.getuid()
    for entry in entries:
        path = os.path.join(SHM_DIR, entry)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != uid or not (st.st_mode & 0o170000 == 0o100000):
                continue
            try:
                header = read_header(fd)
            except SegmentFormatError:
                header = None
            if header is None and not entry.startswith(DEFAULT_PREFIX):
                continue  # not ours
            alive = is_locked(fd, L.LOCK_OWNER)
            out.append(SegmentInfo(entry, st.st_size, header, alive, time.time() - st.st_mtime))
        finally:
            os.close(fd)
    return out
