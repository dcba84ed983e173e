"""Shared fixtures: every test leaves /dev/shm as it found it and leaves no child process behind.

The leak check only judges what this test run could have made: shmbuf segments owned by this
process or its descendants, or whose owner is dead, and other new /dev/shm files created by our
process tree. It never deletes a live segment of an unrelated process (a training job running
beside the tests). ``start_method`` runs a test under fork, forkserver and spawn.
"""

from __future__ import annotations

import os
import signal
import time

import multiprocess
import pytest

from shmbuf.scan import scan
from shmbuf.shmdir import unlink
from tests.pool_procs import descendants

SHM_DIR = "/dev/shm"
START_METHODS = ["fork", "forkserver", "spawn"]


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def _ours(new: set[str]) -> list[str]:
    """The subset of new /dev/shm entries this test run is answerable for."""
    mine = {os.getpid(), *descendants(os.getpid())}
    infos = {info.name: info for info in scan()}
    out = []
    for name in sorted(new):
        info = infos.get(name)
        if info is None:
            out.append(name)  # not a shmbuf segment (e.g. a semaphore) that appeared meanwhile
        elif info.header is None:
            if info.age > 2.0:  # uninitialised and not being created right now
                out.append(name)
        elif not info.alive or info.header.owner_pid in mine:
            out.append(name)
    return out


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Fail any test that leaves an entry of its own in /dev/shm (after a short grace period for
    processes still exiting); remove what it left so later tests start clean."""
    before = _shm_entries()
    yield
    deadline = time.monotonic() + 3.0
    leaked = _ours(_shm_entries() - before)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = _ours(_shm_entries() - before)
    infos = {info.name for info in scan()}
    for name in leaked:
        if name in infos:  # only our own segments are removed; anything else is only reported
            unlink(name)
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


@pytest.fixture(scope="module")
def nodes():
    """A local 3-node Ray cluster for one test module (``tests/cluster_procs``), its node ids
    with the learner's node first. Only modules that skip without Ray ask for it."""
    from tests import cluster_procs

    with cluster_procs.learner_first_nodes(3) as ids:
        yield ids


@pytest.fixture(params=START_METHODS)
def start_method(request) -> str:
    return request.param


@pytest.fixture
def mp(start_method):
    """A multiprocess context for the parametrised start method."""
    return multiprocess.get_context(start_method)


def pytest_collection_modifyitems(config, items):
    """Run the JAX tests last: once JAX has started its thread pools, every later ``fork()`` in
    this process forks a multithreaded program (JAX warns that this can deadlock), and most of
    the suite forks."""
    items.sort(key=lambda item: item.get_closest_marker("jax") is not None)
