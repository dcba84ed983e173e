"""File I/O for checkpoints: ``.npy`` files written with plain ``pwrite`` calls into space reserved
up front, new directories moved into place atomically, and reads that open only regular files and
never block.

Writes never go through a shared memory map: on a full disk a mapped store is a SIGBUS that kills
the process, a ``pwrite`` is an ``OSError(ENOSPC)`` that the caller turns into a CapacityError.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import math
import os
import secrets
import shutil
import stat
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError

NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # errnos that mean "the disk is full"
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # fallocate/renameat2 not here
_NPY_ALIGN = 64  # numpy pads .npy headers to this many bytes
_NPY_MAGIC = b"\x93NUMPY\x01\x00"  # format version 1.0: a u16 header length follows
COMPACT_CHUNK_BYTES = 64 << 20  # NpyWriter.compact moves rows this many bytes at a time


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
def free_space(directory: Path) -> tuple[int, int]:
    """(bytes, inodes) an unprivileged process may still use on ``directory``'s filesystem;
    inodes are unlimited (a huge number) where the filesystem does not count them."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize, st.f_favail if st.f_files else 1 << 62


def npy_header(dtype: np.dtype, shape: tuple[int, ...], length: int = 0) -> bytes:
    """The .npy (version 1.0) header numpy writes for a C-ordered ``shape`` ``dtype`` array,
    padded with spaces to at least ``length`` bytes (a multiple of 64 either way)."""
    descr = np.lib.format.dtype_to_descr(dtype)
    body = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    core = len(_NPY_MAGIC) + 2 + len(body) + 1  # + the final newline
    total = max(length, -(-core // _NPY_ALIGN) * _NPY_ALIGN)
    if total - len(_NPY_MAGIC) - 2 > 0xFFFF:
        raise ValueError(f"a .npy header of {total} bytes does not fit format version 1.0")
    return (_NPY_MAGIC + struct.pack("<H", total - len(_NPY_MAGIC) - 2) + body.encode("latin1")
            + b" " * (total - core) + b"\n")


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` (bytes or a C-contiguous array) at ``offset`` of ``fd``."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def pread_all(fd: int, n: int, offset: int) -> bytes:
    parts = []
    while n > 0:
        chunk = os.pread(fd, n, offset)
        if not chunk:
            raise OSError(errno.EIO, f"short read at offset {offset}: the file shrank")
        parts.append(chunk)
        n -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def reserve(fd: int, nbytes: int) -> None:
    """Allocate ``nbytes`` of ``fd`` now (ENOSPC here, not mid-write); a filesystem that cannot
    reserve space is left to report ENOSPC from the writes themselves."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise


class NpyWriter:
    """One ``.npy`` file being written row range by row range: ``w[a:b] = rows``.

    The header is written at creation, then rows go in with ``pwrite`` at their offset, so the
    file can be filled in any order, and ``compact`` can drop rows in place afterwards.
    """

    def __init__(self, path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(d) for d in shape)
        self.row_nbytes = self.dtype.itemsize * math.prod(self.shape[1:])
        self.header = npy_header(self.dtype, self.shape)
        self.nbytes = len(self.header) + self.shape[0] * self.row_nbytes
        self.fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                      0o666)
        try:
            reserve(self.fd, self.nbytes)
            pwrite_all(self.fd, self.header, 0)
        except BaseException:
            self.close()
            raise

    def __setitem__(self, rows: slice, values: np.ndarray) -> None:
        start = rows.start or 0
        if values.dtype.itemsize * math.prod(values.shape[1:]) != self.row_nbytes:
            raise ValueError(f"{self.path}: rows of {values.dtype} {values.shape[1:]} do not fit "
                             f"{self.dtype} {self.shape[1:]}")
        pwrite_all(self._fd(), values, len(self.header) + start * self.row_nbytes)

    def compact(self, moves: Sequence[tuple[int, int, int]], rows: int,
                chunk_bytes: int = COMPACT_CHUNK_BYTES) -> None:
        """Move row runs ``(src, dst, count)`` (``dst <= src``, ascending) and cut the file to
        ``rows`` rows. Each chunk is read whole before it is written, and later chunks read from
        beyond where earlier ones were written, so overlapping moves are safe."""
        fd, hdr, row = self._fd(), len(self.header), self.row_nbytes
        if row:
            step = max(1, chunk_bytes // row)
            for src, dst, count in moves:
                if src == dst:
                    continue
                for j in range(0, count, step):
                    m = min(step, count - j)
                    data = pread_all(fd, m * row, hdr + (src + j) * row)
                    pwrite_all(fd, data, hdr + (dst + j) * row)
        self.shape = (rows, *self.shape[1:])
        pwrite_all(fd, npy_header(self.dtype, self.shape, length=hdr), 0)
        os.ftruncate(fd, hdr + rows * row)

    def finish(self) -> None:
        """Flush to disk and close."""
        os.fsync(self._fd())
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def _fd(self) -> int:
        if self.fd is None:
            raise ValueError(f"{self.path} is closed")
        return self.fd


def write_file(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist) holding ``data``, flushed to disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        reserve(fd, len(data))
        pwrite_all(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# New directories, moved into place atomically (Linux renameat2)
# --------------------------------------------------------------------------------------------
@contextmanager
def new_directory(final: Path, check_replaceable: Callable[[Path], None]) -> Iterator[Path]:
    """A new hidden directory beside ``final`` to fill (``.<name>.saving-<pid>-<random>``: same
    parent, so the same filesystem), made ``final`` in one step when the block ends without an
    exception, and removed when it raises (``final`` is then as it was).

    The directory is locked (``flock``) while it is filled, so ``remove_dead_saves`` tells a
    live one from one whose process was killed. Its files and itself are fsynced before the
    move (``_move_into_place``).
    """
    tmp = final.with_name(f".{final.name}.saving-{os.getpid()}-{secrets.token_hex(4)}")
    lock, made = None, False
    try:
        tmp.mkdir()
        made = True
        lock = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "a save is writing here"
        yield tmp
        fsync_dir(tmp)
        _move_into_place(tmp, final, check_replaceable)
        fsync_dir(final.parent)
    except BaseException:
        if made:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _move_into_place(tmp: Path, final: Path, check_replaceable: Callable[[Path], None]
                     ) -> None:
    """Make the complete directory ``tmp`` the one at ``final``.

    Onto a new ``final`` by a rename that replaces nothing. Over an existing one (if
    ``check_replaceable(final)`` does not raise) by exchanging the two atomically
    (``renameat2(RENAME_EXCHANGE)``), so ``final`` is whole at every instant, and the old one,
    now at ``tmp``, is deleted after. Where the filesystem cannot exchange, the old one is
    renamed aside (``.<name>.old-<pid>-<random>``), the new one renamed in, then the old one
    deleted; a failure between the two renames moves the old one back.
    """
    if not (final.exists() or final.is_symlink()):
        try:
            if not renameat2(tmp, final, RENAME_NOREPLACE):
                os.rename(tmp, final)  # no renameat2: replaces at most an empty directory
        except FileExistsError:
            raise FileExistsError(
                f"{final} appeared while the buffer was being saved; it was left alone. Fix: "
                f"save again (with overwrite=True to replace it)"
            ) from None
        return
    check_replaceable(final)  # again: it may have changed while we wrote
    if renameat2(tmp, final, RENAME_EXCHANGE):
        shutil.rmtree(tmp, ignore_errors=True)  # the previous one, now at the temp name
        return
    old = final.with_name(f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def remove_dead_saves(final: Path) -> None:
    """Remove the hidden directories of ``new_directory`` s for ``final`` whose process was
    killed midway: the ones whose lock nobody holds (a live one keeps its directory locked)."""
    prefix = f".{final.name}.saving-"
    try:
        entries = [e for e in os.scandir(final.parent) if e.name.startswith(prefix)]
    except OSError:
        return
    for dead in entries:
        try:
            fd = os.open(dead.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live save
            continue
        try:
            shutil.rmtree(dead.path, ignore_errors=True)
        finally:
            os.close(fd)


RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = None


def renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the C library or the filesystem lacks it (the
    caller falls back to plain renames), OSError for any other failure."""
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                           ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (AttributeError, OSError):
            _renameat2 = False
    if _renameat2 is False:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


# --------------------------------------------------------------------------------------------
# Reading: regular files only, never blocking
# --------------------------------------------------------------------------------------------
def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return f"file type {stat.S_IFMT(mode):o}"


def open_regular(path: Path, what: str) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only without blocking; CheckpointError unless it is a regular file
    (a FIFO would block forever, a device could be read without end). Symlinks are followed and
    judged by their target. FileNotFoundError passes through."""
    st = os.stat(path)  # refuse a device before opening it (opening some has side effects)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, what, st.st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)  # what was opened, if the name was swapped meanwhile
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, what, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _not_regular(path: Path, what: str, mode: int) -> CheckpointError:
    return CheckpointError(
        f"{path}: {what} is {_kind(mode)}, not a regular file; refusing to read it. Fix: point "
        f"load() at a directory written by buf.save(), or replace the file with the saved one"
    )


def read_bounded(path: Path, what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path``; CheckpointError past ``limit`` bytes."""
    fd, st = open_regular(path, what)
    try:
        if st.st_size > limit:
            raise _too_large(path, what, st.st_size, limit)
        parts: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)
            total += len(chunk)
            if total > limit:  # it grew while we read
                raise _too_large(path, what, total, limit)
    finally:
        os.close(fd)


def _too_large(path: Path, what: str, size: int, limit: int) -> CheckpointError:
    return CheckpointError(
        f"{path}: {what} is {size} bytes, more than the {limit >> 20} MiB a manifest can be; "
        f"it is not one written by buf.save(). Fix: save the buffer again"
    )


def open_npy(path: Path, shape: tuple[int, ...], dtype: np.dtype, what: str) -> np.ndarray:
    """Map the ``.npy`` file ``path`` read-only and check that it holds ``shape`` ``dtype``.

    The header is read from the same descriptor that is mapped (a name swapped to a FIFO in
    between cannot block the mapping). Raises CheckpointError naming the file for anything else:
    missing, not a regular file, a corrupt header, another shape or dtype, truncated.
    """
    expected = f"shape {shape} {dtype}"
    try:
        fd, st = open_regular(path, what)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing; the manifest lists it for {what} ({expected}). The checkpoint "
            f"is incomplete. Fix: save the buffer again, or restore the file from a copy"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be opened for {what} ({e})") from None
    with os.fdopen(fd, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                found_shape, fortran, found_dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                found_shape, fortran, found_dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy format version {version}")
            offset = f.tell()
        except Exception as e:  # noqa: BLE001 - any header numpy cannot parse is corrupt
            raise CheckpointError(
                f"{path}: truncated or corrupt ({st.st_size} bytes on disk; numpy says: {e}); "
                f"expected {what} as {expected}. Fix: save the buffer again, or restore the file "
                f"from a copy"
            ) from None
        if tuple(found_shape) != shape or found_dtype != dtype:
            raise CheckpointError(
                f"{path}: expected {what} as {expected}, found shape {tuple(found_shape)} "
                f"{found_dtype}. The file does not belong to this manifest. Fix: save the buffer "
                f"again"
            )
        need = offset + math.prod(shape) * dtype.itemsize
        if st.st_size < need:
            raise CheckpointError(
                f"{path}: truncated ({st.st_size} bytes on disk, {need} needed for {what} as "
                f"{expected}). Fix: save the buffer again, or restore the file from a copy"
            )
        return np.memmap(f, dtype=dtype, mode="r", shape=shape, offset=offset,
                         order="F" if fortran else "C")
