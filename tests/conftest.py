"""Shared fixtures: every test leaves /dev/shm as it found it and leaves no child process behind.

``start_method`` runs a test under fork, forkserver and spawn.
"""

from __future__ import annotations

import os
import signal
import time

import multiprocess
import pytest

SHM_DIR = "/dev/shm"
START_METHODS = ["fork", "forkserver", "spawn"]


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leaked_segments(request):
    """Fail any test that leaves a new entry in /dev/shm (after a short grace period for
    processes that are still exiting), and remove what it left so later tests start clean."""
    before = _shm_entries()
    yield
    deadline = time.monotonic() + 3.0
    leaked = sorted(_shm_entries() - before)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = sorted(_shm_entries() - before)
    for name in leaked:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass
    if leaked:
        pytest.fail(f"test left {len(leaked)} entr(y/ies) in {SHM_DIR}: {leaked}", pytrace=False)


@pytest.fixture(autouse=True)
def no_stray_children():
    """Kill any multiprocess child a test left running."""
    yield
    for p in multiprocess.active_children():
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass
        p.join(5)


@pytest.fixture(params=START_METHODS)
def start_method(request) -> str:
    return request.param


@pytest.fixture
def mp(start_method):
    """A multiprocess context for the parametrised start method."""
    return multiprocess.get_context(start_method)
