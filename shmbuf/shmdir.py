"""The /dev/shm directory: what a segment may be named, fresh names, unlinking one, room left.

A segment's name is its file name in ``SHM_DIR``; ``normalize_name`` accepts it with or without
the leading ``/`` that ``shm_open`` takes.
"""

from __future__ import annotations

import os
import re
import secrets
from typing import Any

import posix_ipc  # type: ignore[import-not-found]  # a C extension without stubs

SHM_DIR = "/dev/shm"
DEFAULT_PREFIX = "shmbuf-"
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")  # matched whole (fullmatch), "." and ".." refused


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


def new_name(kind_tag: str) -> str:
    """A fresh name no other process picks: ``shmbuf-<tag>-<pid>-<random>``."""
    return f"{DEFAULT_PREFIX}{kind_tag}-{os.getpid()}-{secrets.token_hex(4)}"


def unlink(name: str, _unlink: Any = posix_ipc.unlink_shared_memory,
           _gone: type[BaseException] = posix_ipc.ExistentialError) -> bool:
    """Unlink a segment name; False if it was already gone.

    ``posix_ipc``'s function and exception are bound at import (default arguments): a finalizer
    (``__del__``) may run this at interpreter shutdown, after the module's globals were cleared,
    where ``except posix_ipc.ExistentialError`` would raise TypeError instead."""
    try:
        _unlink("/" + normalize_name(name))
        return True
    except _gone:
        return False


def shm_free_bytes() -> int:
    """Bytes of /dev/shm that an unprivileged process may still allocate."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize
