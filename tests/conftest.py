"""Shared fixtures: every test leaves /dev/shm as it found it and leaves no child process behind.

The /dev/shm guard (``no_leaked_segments``) judges only what the test's own processes made, so
the suite passes beside training jobs and other programs that use /dev/shm. ``ProcessTree``
(``tests/_helpers/processes.py``) records every process this session started, dead ones
included. A new entry counts as the test's if

- it is a shmbuf segment whose header names an owner of the tree (alive or dead: a dead-owner
  segment that another program made is its business, not ours),
- it has no readable header but a shmbuf name with its creator's pid (``shmdir.new_name``)
  and the process with that pid when the file was made is of the tree, or
- it has no owner record (a ``sem.mp-*`` semaphore, a malformed or hand-written file) and a
  live process of the tree maps it or holds it open.

An entry with no owner record that no process of the tree holds (e.g. a semaphore left by a
process that died) cannot be told from another program's and is not counted, unless the run
says ``--shm-guard=strict`` (count every new entry without another owner: for a machine where
nothing else uses /dev/shm). The guard removes only the shmbuf segments of the test's own
processes, never another program's. ``start_method`` runs a test under fork, forkserver and
spawn.
"""

from __future__ import annotations

import os
import re
import signal
import time

import multiprocess
import pytest

from shmbuf.scan import scan
from shmbuf.shmdir import unlink
from tests._helpers.processes import ProcessTree

SHM_DIR = "/dev/shm"
START_METHODS = ["fork", "forkserver", "spawn"]
GRACE = 3.0  # seconds the guard waits for processes still exiting to remove their entries
_CREATOR = re.compile(r"shmbuf-[a-z]+-(\d+)-[0-9a-f]{8}")  # shmdir.new_name: kind, pid, random


def pytest_addoption(parser):
    group = parser.getgroup("shmbuf")
    group.addoption("--shm-guard", choices=["owned", "strict"], default="owned",
                    help="owned (default): fail a test for the /dev/shm entries its processes "
                         "made; strict: also for new entries nobody can be named for")
    group.addoption("--shm-guard-grace", type=float, default=GRACE,
                    help=f"seconds to wait for exiting processes to remove their /dev/shm "
                         f"entries before failing a test (default {GRACE})")


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def _held_by(pids: list[int], names: list[str]) -> set[str]:
    """The entries of ``names`` that one of ``pids`` maps or holds open (matched by inode: a
    POSIX semaphore is mapped under the temporary name it was made as)."""
    inodes: dict[tuple[int, int], str] = {}
    for name in names:
        try:
            st = os.lstat(os.path.join(SHM_DIR, name))
        except OSError:
            continue
        inodes[(st.st_dev, st.st_ino)] = name
    if not inodes:
        return set()
    dev = next(iter(inodes))[0]
    held: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
                        name = inodes.get((dev, int(parts[4])))
                        if name is not None:
                            held.add(name)
            fds = os.listdir(f"/proc/{pid}/fd")
        except (OSError, ValueError):
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            name = inodes.get((st.st_dev, st.st_ino))
            if name is not None:
                held.add(name)
    return held


def leaked_entries(new: set[str], tree: ProcessTree, strict: bool = False) -> list[str]:
    """The entries of ``new`` (names in /dev/shm) that the processes of ``tree`` made and left
    (see the module docstring); ``strict`` adds those that nobody can be named for."""
    infos = {info.name: info for info in scan()}
    ours, unowned = [], []
    for name in sorted(new):
        info = infos.get(name)
        path = os.path.join(SHM_DIR, name)
        if info is not None and info.header is not None:
            h = info.header
            if (tree.owns(h.owner_pid, h.owner_start) if h.owner_start
                    else tree.owned_when(h.owner_pid, h.created)):
                ours.append(name)
            continue  # another program's segment, its owner alive or dead
        if info is not None and info.error is None and info.age <= 2.0:
            continue  # uninitialised: its creator is writing the header right now
        creator = _CREATOR.fullmatch(name)
        if info is not None and creator is not None:
            try:
                made = os.stat(path).st_ctime
            except OSError:
                continue  # removed meanwhile
            if tree.owned_when(int(creator.group(1)), made):
                ours.append(name)
            continue
        if os.path.exists(path):
            unowned.append(name)
    if unowned:
        held = _held_by(tree.live_members(), unowned)
        ours.extend(name for name in unowned if strict or name in held)
    return sorted(ours)


@pytest.fixture(scope="session", autouse=True)
def process_tree():
    """Every process this session starts, alive or dead (``ProcessTree``)."""
    tree = ProcessTree.start()
    yield tree
    tree.close()


@pytest.fixture
def own_shm_entries(process_tree):
    """A function listing the /dev/shm entries this session's processes made (as the guard
    judges them): compare it before and after, not ``scan()``, which lists other programs'
    segments too."""
    return lambda: set(leaked_entries(_shm_entries(), process_tree))


@pytest.fixture(autouse=True)
def no_leaked_segments(process_tree, request):
    """Fail any test that leaves an entry of its own in /dev/shm (after a grace period for
    processes still exiting); remove the shmbuf segments it left so later tests start clean."""
    strict = request.config.getoption("--shm-guard") == "strict"
    grace = request.config.getoption("--shm-guard-grace")
    before = _shm_entries()
    yield
    deadline = time.monotonic() + grace
    leaked = leaked_entries(_shm_entries() - before, process_tree, strict)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = leaked_entries(_shm_entries() - before, process_tree, strict)
    # Only segments of the test's own processes are removed; anything else is only reported
    # (under --shm-guard=strict, leaked may name another program's files).
    mine = leaked_entries(set(leaked), process_tree) if strict else leaked
    infos = {info.name for info in scan()}
    for name in mine:
        if name in infos:
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
    with the learner's node first; skips where Ray is not installed."""
    pytest.importorskip("ray")  # (a test of a module that runs without Ray asks for it too)
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
