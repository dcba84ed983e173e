"""The /dev/shm guard of ``tests/conftest.py`` beside another program: it ignores what the test did
not make and still fails a test that leaks (issue 27).

``ProcessTree`` must know a test's processes after they died (recorded as they start, or by
the watcher) and after they left the tree (orphans, by the session token), and nothing else. Then whole pytest sessions run beside ``tests/_helpers/churn_shm.py``,
which is not one of their processes (a sibling of the inner session) and churns semaphores,
scratch files, live and dead-owner shmbuf segments: the clean tests pass, each leaking test
fails naming exactly its own entry, ``own_shm_entries`` lists none of the churner's, and the
same clean tests with ``--shm-guard=strict`` fail (the control: the churn does reach the
guard).
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._helpers.processes import (
    TREE_ENV,
    ProcessTree,
    descendants,
    pid_alive,
    process_start,
    wait_dead,
)

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
CHURN = ROOT / "tests" / "_helpers" / "churn_shm.py"
SHM_DIR = "/dev/shm"


# --------------------------------------------------------------------------------------------
# ProcessTree
# --------------------------------------------------------------------------------------------
def _report_and_exit(conn: Any) -> None:
    conn.send((os.getpid(), process_start(os.getpid())))
    conn.close()
    os._exit(0)  # at once: a forked child may live a millisecond, less than the watcher's tick


@pytest.mark.timeout(90)
def test_the_tree_knows_its_children_after_they_died(mp, process_tree):
    """Five children in a row report (pid, start time) and exit at once; once dead, each is
    still the tree's (a pid reused by another start time is not)."""
    children = []
    for _ in range(5):
        parent_end, child_end = mp.Pipe()
        p = mp.Process(target=_report_and_exit, args=(child_end,))
        p.start()
        child_end.close()
        assert parent_end.poll(60), "the child never reported"
        children.append(parent_end.recv())
        p.join(30)
        parent_end.close()
        assert p.exitcode == 0
    for pid, start in children:
        assert not pid_alive(pid)
        assert process_tree.owns(pid, start), f"dead child {pid} is not known"
        assert not process_tree.owns(pid, start + 1)


def _wait_for_go(conn: Any) -> None:
    conn.recv()


@pytest.mark.timeout(90)
def test_the_tree_records_a_child_as_it_starts(mp, process_tree):
    """``Process.start`` and ``subprocess.Popen`` record the child before they return, so a
    child that dies at once is known even where the watcher never saw it."""
    parent_end, child_end = mp.Pipe()
    p = mp.Process(target=_wait_for_go, args=(child_end,))
    p.start()
    assert (p.pid, process_start(p.pid)) in process_tree.records()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert (child.pid, process_start(child.pid)) in process_tree.records()
    parent_end.send("go")
    p.join(30)
    child.wait(30)
    parent_end.close()
    child_end.close()


@pytest.mark.timeout(30)
def test_a_bare_fork_is_recorded_by_the_at_fork_hook(process_tree):
    """A child of ``os.fork()`` (neither ``Process.start`` nor ``Popen``) that exits at once,
    with the watcher stopped meanwhile: only the at-fork hook can have recorded it."""
    watcher = process_tree.watcher_pid
    assert watcher is not None
    read_end, write_end = os.pipe()
    os.kill(watcher, signal.SIGSTOP)
    try:
        pid = os.fork()
        if pid == 0:
            os.write(write_end, str(process_start(os.getpid())).encode())
            os._exit(0)
        os.close(write_end)
        try:
            start = int(os.read(read_end, 64))
        finally:
            os.close(read_end)
            os.waitpid(pid, 0)
        assert process_tree.owns(pid, start), f"dead forked child {pid} is not known"
    finally:
        os.kill(watcher, signal.SIGCONT)


def _grandchild_that_ends(conn: Any) -> None:
    """Start a grandchild (exec'd) that lives a second, report it, and wait until it ended."""
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    conn.send((grandchild.pid, process_start(grandchild.pid)))
    grandchild.wait(30)
    conn.send("ended")


@pytest.mark.timeout(90)
def test_the_watcher_knows_a_grandchild_after_it_died(mp, process_tree):
    """Under spawn and forkserver the child is a fresh interpreter without the start hooks:
    only the watcher can know its (now dead) child."""
    parent_end, child_end = mp.Pipe()
    p = mp.Process(target=_grandchild_that_ends, args=(child_end,))
    p.start()
    child_end.close()
    try:
        assert parent_end.poll(60), "the child never reported"
        pid, start = parent_end.recv()
        assert parent_end.poll(60) and parent_end.recv() == "ended"
        assert not pid_alive(pid)
        assert process_tree.owns(pid, start), f"dead grandchild {pid} is not known"
    finally:
        p.join(30)
        parent_end.close()


def _orphan_a_grandchild(conn: Any) -> None:
    """Start a sleeping grandchild (exec'd), report it, and exit: the grandchild is orphaned,
    reparented out of the test's tree."""
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    conn.send((grandchild.pid, process_start(grandchild.pid)))
    conn.close()
    os._exit(0)


@pytest.mark.timeout(90)
def test_the_tree_knows_an_orphaned_grandchild_by_its_token(mp, process_tree):
    parent_end, child_end = mp.Pipe()
    p = mp.Process(target=_orphan_a_grandchild, args=(child_end,))
    p.start()
    child_end.close()
    assert parent_end.poll(60), "the child never reported"
    pid, start = parent_end.recv()
    p.join(30)
    parent_end.close()
    try:
        assert pid not in descendants(os.getpid()), "the grandchild is still in the tree"
        assert process_tree.owns(pid, start)
        # Without the watcher's and the at-fork records, only the token says it is ours.
        bare = ProcessTree(os.getpid(), process_tree.token, str(Path(process_tree.log) / "x"))
        assert bare.owns(pid, start)
        stranger = ProcessTree(os.getpid(), "another-session", bare.log)
        assert not stranger.owns(pid, start)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        assert wait_dead([pid], 10) == []


def test_processes_outside_the_tree_are_not_its_own(process_tree):
    me = os.getpid()
    assert process_tree.owns(me, process_start(me))
    assert os.environ[TREE_ENV] == process_tree.token
    outsider = os.getppid()  # whoever started pytest
    assert not process_tree.owns(outsider, process_start(outsider))
    assert not process_tree.owns(1)
    assert not process_tree.owns(0)
    # A record with a pid but no start time: the process that had the pid then.
    assert process_tree.owned_when(me, time.time())
    assert not process_tree.owned_when(me, time.time() - 86400 * 365)  # before it started
    assert not process_tree.owned_when(outsider, time.time())


# --------------------------------------------------------------------------------------------
# Whole sessions beside a churning program
# --------------------------------------------------------------------------------------------
LIFETIME = (0.05, 0.4)  # seconds the churner keeps an entry
DWELL = 0.6  # each inner test lasts longer: every churn entry there at its teardown is new

INNER_TESTS = f'''
import os
import signal
import time

import multiprocess
import numpy as np
import pytest

import shmbuf

SPEC = shmbuf.Spec(x=((4,), "float32"))
DWELL = {DWELL}
KEEP = []  # what the leaking tests keep alive past their end


def _record(name):
    with open("leaked.txt", "a") as f:
        f.write(f"{{os.environ['PYTEST_CURRENT_TEST'].split()[0]}} {{name}}\\n")


def _write_a_row(conn, name):
    with shmbuf.ReplayBuffer.attach(name) as buf, buf.writer() as w:
        w.add(x=np.ones(4, np.float32))
    conn.send("written")


def _own_buffer(conn):
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8) as buf:
        conn.send(buf.name)


def _create_and_die(conn):
    buf = shmbuf.ReplayBuffer.create(SPEC, capacity=8)
    conn.send(buf.name)
    os.kill(os.getpid(), signal.SIGKILL)


def _run(mp, target, *args):
    parent, child = mp.Pipe()
    p = mp.Process(target=target, args=(child, *args))
    p.start()
    child.close()
    try:
        assert parent.poll(60), "the child never reported"
        return parent.recv(), p
    finally:
        p.join(30)
        parent.close()


@pytest.mark.timeout(90)
def test_clean(mp):
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8) as buf:
        _run(mp, _write_a_row, buf.name)
        _run(mp, _own_buffer)
        time.sleep(DWELL)
        assert len(buf) == 1


def test_leaks_its_own_live_buffer():
    KEEP.append(shmbuf.ReplayBuffer.create(SPEC, capacity=8))
    _record(KEEP[-1].name)
    time.sleep(DWELL)


@pytest.mark.timeout(90)
def test_a_child_leaks_a_dead_owner_buffer(mp):
    name, p = _run(mp, _create_and_die)
    assert p.exitcode == -signal.SIGKILL
    _record(name)
    time.sleep(DWELL)


def test_own_shm_entries_lists_this_runs_segments_only(own_shm_entries):
    before = own_shm_entries()
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8) as buf:
        for _ in range(12):  # over half a second of churn
            assert own_shm_entries() - before == {{buf.name}}
            time.sleep(0.05)
    assert own_shm_entries() == before


def test_holds_a_semaphore():
    KEEP.append(multiprocess.get_context("spawn").Lock())  # sem.mp-*, mapped by this process
    _record("sem." + KEEP[-1]._semlock.name.lstrip("/"))
    time.sleep(DWELL)
'''


@pytest.fixture
def churner(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """``churn_shm.py`` running beside the test, with this session's token taken out of its
    environment; yields its summary (filled in when it stopped) and checks it removed all."""
    report = tmp_path / "churn.json"
    env = {k: v for k, v in os.environ.items() if k != TREE_ENV}
    proc = subprocess.Popen(
        [sys.executable, str(CHURN), "--duration", "240", "--watch-pid", str(os.getpid()),
         "--population", "8", "--lifetime", *map(str, LIFETIME), "--report", str(report)],
        stdout=subprocess.PIPE, env=env, start_new_session=True)
    summary: dict[str, Any] = {"pid": proc.pid}
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(b"ready"), "the churner did not start"
        yield summary
    finally:
        proc.terminate()
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise
        finally:
            assert proc.stdout is not None
            proc.stdout.close()
    summary.update(json.loads(report.read_text()))
    assert rc == 0 and summary["not_removed"] == [], summary
    assert all(n > 0 for n in summary["made"].values()), summary


def _run_inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
               *args: str) -> pytest.RunResult:
    """Run ``INNER_TESTS`` in a pytest subprocess with this suite's conftest as a plugin."""
    pytester.makepyfile(test_inner=INNER_TESTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return pytester.runpytest_subprocess(
        "-p", "tests.conftest", "-p", "no:cacheprovider", "--shm-guard-grace", "0.5", *args,
        timeout=240)


def _teardown_errors(output: str) -> dict[str, list[str]]:
    """test id -> the entries its teardown error names."""
    out = {}
    for test, listed in re.findall(
            r"ERROR at teardown of (\S+) _+\n(?:.*\n)*?test left \d+ entr\(y/ies\) in /dev/shm: "
            r"(\[.*\])", output):
        out[test] = ast.literal_eval(listed)
    return out


@pytest.mark.timeout(300)
def test_beside_a_churning_program_clean_tests_pass_and_leaks_still_fail(pytester, monkeypatch,
                                                                         churner):
    result = _run_inner(pytester, monkeypatch)
    text = result.stdout.str()
    recorded = dict(line.split() for line in
                    (pytester.path / "leaked.txt").read_text().splitlines())
    errors = _teardown_errors(text)
    leaking = {f"test_{which}" for which in ("leaks_its_own_live_buffer",
                                             "holds_a_semaphore")} | {
        f"test_a_child_leaks_a_dead_owner_buffer[{m}]" for m in ("fork", "forkserver", "spawn")}
    assert set(errors) == leaking, text  # no clean test failed, every leaking one did
    for test, names in errors.items():
        assert names == [recorded[f"test_inner.py::{test}"]], (test, names, text)
    result.assert_outcomes(passed=9, errors=5)
    left = [name for name in recorded.values() if os.path.exists(os.path.join(SHM_DIR, name))]
    assert left == [], "a leaked entry outlived the inner session (its guard removes segments)"


@pytest.mark.timeout(300)
def test_control_strict_mode_counts_the_churn(pytester, monkeypatch, churner):
    """``--shm-guard=strict`` counts entries that nobody can be named for, as the guard used to
    count every new entry: the same clean tests then fail on the churner's scratch files (and
    semaphores), so the test above proves something. (The churner always holds two files, each
    younger than a test.)"""
    result = _run_inner(pytester, monkeypatch, "-k", "test_clean", "--shm-guard=strict")
    errors = _teardown_errors(result.stdout.str())
    assert len(errors) == 3, result.stdout.str()
    for names in errors.values():
        assert any(n.startswith(f"churn-{churner['pid']}-") for n in names), names

