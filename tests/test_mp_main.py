"""A script without ``if __name__ == "__main__":`` under the spawn and forkserver start methods:
each process they start re-runs the main script as ``__mp_main__``, and a ``SamplerPool`` with
workers, an ``ActorGroup`` or a ``ReplayCluster`` made there raises ``MainModuleReimportError``
(the message names the fix) before it starts anything. The script, run for real in a fresh
interpreter, exits promptly with that message in its stderr, and the guarded script works. The
two ways the re-run is seen (the main module's top-level frame, and multiprocessing's
bootstrapping flag) are each checked in-process, and so is a function of ``__mp_main__`` called
after start-up (a legitimate nested pool), which is not refused.
"""

from __future__ import annotations

import os
import re
import runpy
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import multiprocess
import numpy as np
import pytest

import shmbuf
from workers import SamplerPool, supervise
from workers.config import Workers
from workers.errors import MainModuleReimportError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_TIMEOUT = 90.0
FIX = 'if __name__ == "__main__":'

HEADER = '''\
import os, sys, time
import numpy as np
import shmbuf
from workers import ActorGroup, SamplerPool
from workers.config import Workers

with open(os.environ["RUN_MARKS"], "a") as f:  # every process that runs the top level
    f.write(f"{os.getpid()} {__name__}\\n")
spec = shmbuf.Spec(x=((4,), "float32"))

def actor(ctx):
    while not ctx.stopping:
        ctx.writer.add(x=np.ones(4, np.float32))
        time.sleep(0.01)
'''

STARTS = {
    "pool": '''\
buf = shmbuf.ReplayBuffer.create(spec, capacity=64)
with buf.writer(0) as w:
    w.extend({"x": np.ones((8, 4), np.float32)})
with SamplerPool(buf, batch_size=4, workers=Workers(1, start_method=sys.argv[1]), seed=0,
                 timeout=30) as pool:
    assert pool.next()["x"].sum() == 16
buf.close()
print("done")
''',
    "actors": '''\
buf = shmbuf.ReplayBuffer.create(spec, capacity=64)
group = ActorGroup(actor, n_actors=1, buffer=buf, start_method=sys.argv[1])
deadline = time.monotonic() + 30
while len(buf) < 8:
    assert time.monotonic() < deadline, "the actor wrote nothing"
    group.poll()
    time.sleep(0.02)
group.stop()
buf.close()
print("done")
''',
}


def script(starts: str, guarded: bool) -> str:
    body = STARTS[starts]
    if guarded:
        body = FIX + "\n" + textwrap.indent(body, "    ")
    return HEADER + "\n" + body


def run_script(path: Path, start_method: str, marks: Path) -> tuple[int, str, str, float]:
    """Run ``path`` in a fresh interpreter in its own session; (exit code, stdout, stderr,
    seconds). On a timeout the whole session is killed and the test fails."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RUN_MARKS": str(marks)}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(path), start_method], cwd=path.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=SCRIPT_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the script hung past {SCRIPT_TIMEOUT}s:\n{out}\n{err}")
    finally:
        _end_session(proc.pid)
    return proc.returncode, out, err, time.monotonic() - t0


def _end_session(sid: int, grace: float = 10.0) -> None:
    """Wait for every process of the script's session to exit (its pool's workers, actors and
    forkserver go with it); SIGKILL what is left after ``grace`` seconds."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(sid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def segments_of(pids: set[int], before: set[str]) -> list[str]:
    """/dev/shm entries new since ``before`` named after one of ``pids`` (shmbuf names carry
    the creator's pid)."""
    names = set(os.listdir("/dev/shm")) - before
    return [n for n in names if any(re.search(rf"-{pid}-", n) for pid in pids)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("starts", ["pool", "actors"])
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_script_without_main_guard_fails_fast_naming_the_fix(tmp_path, method, starts):
    path, marks = tmp_path / f"train_{starts}.py", tmp_path / "marks"
    path.write_text(script(starts, guarded=False))
    before = set(os.listdir("/dev/shm"))
    rc, out, err, took = run_script(path, method, marks)
    assert rc != 0 and "done" not in out, (out, err)
    assert "MainModuleReimportError" in err and FIX in err and str(path) in err, err
    assert took < 60, f"took {took:.1f}s"
    runs = [line.split() for line in marks.read_text().splitlines()]
    parent = [int(pid) for pid, name in runs if name == "__main__"]
    children = [int(pid) for pid, name in runs if name == "__mp_main__"]
    assert len(parent) == 1 and children, runs
    # Each re-run stopped at the pool or group it was about to make: it started no process of
    # its own, and so none of its children re-ran the script in turn. The re-runs are the
    # starts the parent tried (a pool gives a worker two, an actor group its restart budget).
    assert len(children) <= (2 if starts == "pool" else 11), runs
    # The re-runs created buffers before they were refused; each unlinked its own before it
    # died (a forkserver child ends with os._exit, past every exit handler).
    assert not segments_of({*parent, *children}, before)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("starts", ["pool", "actors"])
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_same_script_with_the_guard_works(tmp_path, method, starts):
    path, marks = tmp_path / f"train_{starts}.py", tmp_path / "marks"
    path.write_text(script(starts, guarded=True))
    before = set(os.listdir("/dev/shm"))
    rc, out, err, _ = run_script(path, method, marks)
    assert rc == 0 and out.strip().endswith("done"), (out, err)
    assert "MainModuleReimportError" not in err, err
    pids = {int(line.split()[0]) for line in marks.read_text().splitlines()}
    assert not segments_of(pids, before)


# -- the detection, in this process ------------------------------------------------------------
def _run_as_child_main(tmp_path: Path, source: str) -> dict:
    """Run ``source`` as the main module is run in a spawned child: named ``__mp_main__``."""
    path = tmp_path / "main_script.py"
    path.write_text(textwrap.dedent(source))
    return runpy.run_path(str(path), run_name="__mp_main__")


def test_pool_made_by_the_main_module_top_level_is_refused(tmp_path):
    with shmbuf.ReplayBuffer.create({"x": ((2,), "float32")}, capacity=16) as buf:
        buf.writer(0).extend({"x": np.ones((4, 2), np.float32)})
        with pytest.raises(MainModuleReimportError, match=re.escape(FIX)) as info:
            _run_as_child_main(tmp_path, f"""
                from workers import SamplerPool
                from workers.config import Workers
                SamplerPool({buf.name!r}, batch_size=2, workers=Workers(1, start_method="fork"))
                """)
        assert isinstance(info.value, shmbuf.ShmbufError) and isinstance(info.value, RuntimeError)
        assert "SamplerPool(workers > 0)" in str(info.value)
        assert "main_script.py" in str(info.value)
        assert not multiprocess.active_children()  # nothing was started
        # Not a child being started: this process's own segments are left alone.
        shmbuf.ReplayBuffer.attach(buf.name).close()


def test_cluster_made_by_the_main_module_top_level_is_refused(tmp_path):
    pytest.importorskip("ray")
    # Before Ray is asked for anything: without the check this would say that Ray is not
    # initialised (or, in a real child, start hosts from inside it).
    with pytest.raises(MainModuleReimportError, match="ReplayCluster"):
        _run_as_child_main(tmp_path, """
            from workers.cluster import ReplayCluster
            ReplayCluster({"x": ((1,), "float32")}, capacity_per_node=4)
            """)


def test_pool_made_while_multiprocessing_bootstraps_is_refused(monkeypatch):
    """The flag the spawn and forkserver bootstraps set while they import the main module. A
    child being started also unlinks the segments it made (here: counted, not done, since this
    process is the test's)."""
    unlinks = []
    monkeypatch.setattr(supervise, "_unlink_segments_of_this_process",
                        lambda: unlinks.append(os.getpid()))
    with shmbuf.ReplayBuffer.create({"x": ((2,), "float32")}, capacity=16) as buf:
        buf.writer(0).extend({"x": np.ones((4, 2), np.float32)})
        process = multiprocess.current_process()
        process._inheriting = True
        try:
            with pytest.raises(MainModuleReimportError, match=re.escape(FIX)):
                SamplerPool(buf, batch_size=2, workers=Workers(1, start_method="fork"))
            assert unlinks == [os.getpid()]
            with SamplerPool(buf, batch_size=2, workers=0) as pool:  # no process: allowed
                assert pool.next()["x"].shape == (2, 2)
        finally:
            del process._inheriting
        assert not multiprocess.active_children()


@pytest.mark.timeout(60)
def test_function_of_the_main_module_called_after_start_up_may_start_a_pool(tmp_path):
    """An actor or a worker target defined in the script runs with ``__mp_main__`` globals in
    a spawned child; called after start-up (not from the module's top level), its pool starts."""
    with shmbuf.ReplayBuffer.create({"x": ((2,), "float32")}, capacity=16) as buf:
        buf.writer(0).extend({"x": np.ones((4, 2), np.float32)})
        namespace = _run_as_child_main(tmp_path, """
            from workers import SamplerPool
            from workers.config import Workers

            def sample_once(name):
                with SamplerPool(name, batch_size=2, workers=Workers(1, start_method="fork"),
                                 timeout=30) as pool:
                    return pool.next()["x"].sum()
            """)
        assert namespace["__name__"] == "__mp_main__"
        assert namespace["sample_once"](buf.name) == 4
