"""Threads for the tests: run a call in the background and collect its result, or keep a loop
running for the body of a ``with`` block."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn`` in a daemon thread; the returned list gets its result or exception."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@contextmanager
def running(loop: Callable[[threading.Event], None], join_timeout: float = 10.0
            ) -> Iterator[threading.Thread]:
    """Run ``loop(stop)`` in a daemon thread for the body of the ``with`` block; on the way out
    set ``stop`` and join the thread (up to ``join_timeout`` seconds)."""
    stop = threading.Event()
    thread = threading.Thread(target=loop, args=(stop,), daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(join_timeout)


def blocked_in_thread(fn: Callable[[], Any], what: str, settle: float = 0.3
                      ) -> tuple[threading.Thread, list[Any]]:
    """``in_thread(fn)``, then assert that ``fn`` has not returned ``settle`` seconds later
    (``what`` says what it should be waiting for)."""
    thread, out = in_thread(fn)
    time.sleep(settle)
    assert not out, what
    return thread, out
