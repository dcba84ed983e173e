"""Owner cleanup: the segments this process created are unlinked when it ends, however it ends.

A segment's creator registers it (``register_owned``) and forgets it when it unlinks it itself
(``forget_owned``). What is still registered is unlinked at normal exit (atexit), at a
multiprocessing child's exit (its ``util`` finalizers: such a child ends with ``os._exit``) and
when a signal whose default action would kill the process arrives. SIGKILL runs nothing: such a
segment's owner lease is free, and ``shmbuf gc`` removes it.

Signals: ``import shmbuf`` on the main thread replaces the default action (``SIG_DFL``) of
SIGTERM, SIGHUP and SIGINT (where Python's KeyboardInterrupt handler is not in charge) with a
handler that unlinks this process's own segments and then dies of the signal as before; a
process that owns nothing sees no difference but for ``signal.getsignal``. Handlers the user
installs, before or after, are left alone, and a handler that returns keeps the buffer alive.
See ``_install_signal_handlers``.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Any

from .shmdir import unlink

_owned: dict[str, int] = {}  # segment name -> pid of the owner that must unlink it
# Re-entrant: the signal handler runs on the main thread, possibly while that thread is inside
# one of the critical sections below; a plain Lock would deadlock it (the process hangs).
_owned_lock = threading.RLock()
# Signals whose default action ends the process without running atexit.
CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_signals_decided = False  # whether this process has looked at their dispositions yet
_exit_hooks: set[tuple[str, int]] = set()  # (multiprocessing util module, pid) hooked


def register_owned(name: str) -> None:
    """``name`` was just created by this process: unlink it when the process ends."""
    with _owned_lock:
        _owned[name] = os.getpid()
    _install_signal_handlers()
    _hook_multiprocessing_exit()


def forget_owned(name: str) -> None:
    """``name`` was unlinked (or handed over): nothing to do for it at exit any more."""
    with _owned_lock:
        _owned.pop(name, None)


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
