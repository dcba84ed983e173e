"""POSIX shared-memory segments: create, attach, leases (OFD locks), cleanup and discovery.

A ``Segment`` is one ``/dev/shm`` file mapped into this process. Its creator is its owner: the
owner holds the ``LOCK_OWNER`` lease for as long as it lives, and unlinks the segment on
``close()``, at normal exit (atexit, and a multiprocessing child's exit) and when a signal whose
default action would kill it arrives. A segment whose owner lease is free was leaked by a dead
owner; ``shmbuf gc`` removes only those.

Signals: ``import shmbuf`` on the main thread replaces the default action (``SIG_DFL``) of
SIGTERM, SIGHUP and SIGINT (where Python's KeyboardInterrupt handler is not in charge) with a
handler that unlinks this process's own segments and then dies of the signal as before; a
process that owns nothing sees no difference but for ``signal.getsignal``. Handlers the user
installs, before or after, are left alone, and a handler that returns keeps the buffer alive.
See ``_install_signal_handlers``.

Concurrency: the header is written once, by the creator, before the magic; after that only the
owner pid/start change (``BufferStorage.adopt``). Leases are OFD locks on a description opened
by this process (``/proc/self/fd``), so they die with it, even by SIGKILL, and are never shared
with a forked child: children close inherited lease descriptors at fork.

Headers are untrusted input (any process of the user can write /dev/shm): ``read_header``
bounds every length before reading and validates every field, so a malformed file is a
``SegmentFormatError`` naming it, never a hang, a crash or an exhausted memory.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import math
import mmap
import os
import re
import secrets
import signal
import stat
import struct
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import posix_ipc

from . import layout as L
from .checks import timeout_seconds
from .slots import check_platform
from .errors import (
    BufferInUseError,
    CapacityError,
    SegmentExistsError,
    SegmentFormatError,
    SegmentNotFoundError,
)

SHM_DIR = "/dev/shm"
DEFAULT_PREFIX = "shmbuf-"
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")  # matched whole (fullmatch), "." and ".." refused

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
# Owner cleanup: atexit, multiprocessing exits and signals
# --------------------------------------------------------------------------------------------
_owned: dict[str, int] = {}  # segment name -> pid of the owner that must unlink it
# Re-entrant: the signal handler runs on the main thread, possibly while that thread is inside
# one of the critical sections below; a plain Lock would deadlock it (the process hangs).
_owned_lock = threading.RLock()
# Signals whose default action ends the process without running atexit.
CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_signals_decided = False  # whether this process has looked at their dispositions yet
_exit_hooks: set[tuple[str, int]] = set()  # (multiprocessing util module, pid) hooked


def _unlink_owned() -> None:
    pid = os.getpid()
    with _owned_lock:
        names = [n for n, p in _owned.items() if p == pid]
        for n in names:
            _owned.pop(n, None)
    for n in names:
        unlink(n)


def _on_signal(signum: int, frame: Any) -> None:
    """Stands in for the default action of ``signum`` (terminate): unlink this process's own
    segments, then die of the signal as the default action would."""
    _unlink_owned()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_signal_handlers() -> None:
    """Put ``_on_signal`` in place of the default action of SIGTERM, SIGINT and SIGHUP.

    Policy (issue 8, items 8 and 9): only a signal whose disposition is ``SIG_DFL`` gets it,
    because only the default action ends the process without running atexit. A handler of the
    user's (installed before or after) is never wrapped or replaced: if it returns, the process
    goes on and so does its buffer (workers restarted later still attach by name); if it ends
    the process (``sys.exit``, an uncaught ``KeyboardInterrupt`` from Python's SIGINT handler),
    the normal exit path unlinks. ``SIG_IGN`` stays ignored. It runs once per process, from
    ``import shmbuf`` on the main thread (or, if shmbuf was first imported elsewhere, from the
    first ``create`` on the main thread), so an owner created in any thread is covered; a
    disposition the user sets afterwards, ``SIG_DFL`` included, is left as it is.
    """
    global _signals_decided
    if _signals_decided or threading.current_thread() is not threading.main_thread():
        return
    _signals_decided = True
    for sig in CLEANUP_SIGNALS:
        try:
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # not the main interpreter, or a signal we cannot catch
            pass


def _hook_multiprocessing_exit() -> None:
    """A multiprocessing child ends with ``os._exit``, skipping atexit, after running its
    ``util`` exit finalizers: register the cleanup there too (stdlib and ``multiprocess``)."""
    pid = os.getpid()
    for modname in ("multiprocessing.util", "multiprocess.util"):
        util = sys.modules.get(modname)
        if util is None or (modname, pid) in _exit_hooks:
            continue
        try:
            util.Finalize(None, _unlink_owned, exitpriority=0)
        except Exception:  # noqa: BLE001 - an unexpected util module: atexit still covers us
            continue
        _exit_hooks.add((modname, pid))


atexit.register(_unlink_owned)
_install_signal_handlers()


def _register_owned(name: str) -> None:
    with _owned_lock:
        _owned[name] = os.getpid()
    _install_signal_handlers()
    _hook_multiprocessing_exit()


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
    if not _NAME_RE.fullmatch(bare) or bare in (".", ".."):
        raise ValueError(
            f"segment name {name!r} is not valid: use 1-200 letters, digits, '_', '.', '-' "
            f"(not '.' or '..'), e.g. 'shmbuf-myrun'"
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


def scan(include_foreign: bool = False) -> list[SegmentInfo]:
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
