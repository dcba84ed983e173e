"""Processes dying at the worst moment, and the lifecycle rules that keep /dev/shm clean.

A writer SIGKILLed mid-``extend`` (50 times in a row), owners ending by close / exit / signals /
SIGKILL, unrelated attachers, a full /dev/shm, closing with views alive, forked children that
inherit writers and leases. Every process started here is bounded by a timeout and killed on
failure.
"""

from __future__ import annotations

import errno
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import multiprocess
import numpy as np
import pytest

import shmbuf
import shmbuf.scan
import shmbuf.segment
import shmbuf.shmdir
from shmbuf import layout as L
from tests import storage_procs as procs

SHM = "/dev/shm"


def _path(name: str) -> str:
    return os.path.join(SHM, name)


def _snapshot(buf: shmbuf.ReplayBuffer) -> bytes:
    with open(_path(buf.name), "rb") as f:
        return f.read()


# --------------------------------------------------------------------------------------------
# SIGKILL mid-extend
# --------------------------------------------------------------------------------------------
KILL_CAPACITY = 4096
KILL_MAX_ROWS = 3000  # < capacity, so a lane stays readable while an extend is in flight


def _verify_window(buf: shmbuf.ReplayBuffer) -> tuple[int, int]:
    """With no writer running, every index in lane 0's window must be held and whole."""
    win = buf.windows()
    lo, hi = int(win.lo[0]), int(win.hi[0])
    idx = np.arange(lo, hi)
    rows = buf.get(idx, 0)  # StaleIndexError here = the window offers a slot it does not hold
    bad = procs.bad_rows(rows, 0, idx)
    assert not bad.any(), f"torn rows in the window: indices {idx[bad][:10].tolist()}"
    return lo, hi


def _kill_mid_extend(buf, ctx, rng, seed: int) -> dict:
    """Start a child extending big batches on lane 0, SIGKILL it at a random moment, take the
    lane over and check the aftermath. Returns what the kill left behind."""
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    child = ctx.Process(target=procs.extend_forever,
                        args=(buf, 0, child_conn, KILL_MAX_ROWS, seed), name="extender")
    child.start()
    child_conn.close()
    w = None
    try:
        assert parent_conn.poll(60), "the writer child never took its lane"
        _, pid, start = parent_conn.recv()
        time.sleep(rng.uniform(0.0, 0.015))  # a random kill point (not synchronisation)
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        w = buf.writer(lane=0, timeout=1.0)
        took = time.monotonic() - t_kill
        assert took < 1.0, f"took {took:.3f}s to take the lane over"
        child.join(10)
        assert child.exitcode == -signal.SIGKILL

        committed = int(buf.committed(0))
        reserved = int(buf.storage.reserved[0])
        left = {
            "took": took,
            "mid_extend": reserved > committed,  # it had claimed rows it never published
            "odd_slots": int((buf.storage.stamps[:KILL_CAPACITY] % 2 == 1).sum()),  # being written
        }
        assert committed >= start
        assert w.committed == committed, "the new writer must continue at committed"
        _verify_window(buf)
        # Continue from committed with a short batch: fewer rows than the dead writer claimed,
        # so some slots it left odd are still odd; they must stay out of the window.
        k = int(rng.integers(1, 200))
        r = w.extend(procs.make_batch(0, np.arange(committed, committed + k)))
        assert r == range(committed, committed + k)
        lo, hi = _verify_window(buf)
        assert hi == committed + k
        w.add(**procs.make_row(0, hi))
        _verify_window(buf)
        return left
    finally:
        if w is not None:
            w.close()
        if child.exitcode is None:
            child.kill()
            child.join(10)
        parent_conn.close()


def _ping(conn, what: str) -> dict:
    conn.send(what)
    assert conn.poll(10), "the checking reader did not answer within 10s: it hangs"
    return conn.recv()


def test_writer_sigkilled_mid_extend_50_times_never_tears_or_hangs():
    """50 times: a writer extending big batches is SIGKILLed at a random moment. Each time a new
    writer takes the lane over within one second and continues at ``committed``; the window
    never offers a slot the dead writer left half-written (get() of every index in it returns
    whole rows); a reader sampling all along never accepts a torn row and never stalls."""
    ctx = multiprocess.get_context("fork")
    rng = np.random.default_rng(2024)
    buf = shmbuf.ReplayBuffer.create(procs.SPEC, capacity=KILL_CAPACITY, lanes=1)
    reader = None
    try:
        with buf.writer(lane=0) as w:
            w.extend(procs.make_batch(0, np.arange(KILL_CAPACITY)))
        conn, child_conn = ctx.Pipe()
        reader = ctx.Process(target=procs.checking_reader, args=(buf, child_conn, 5),
                             name="checking-reader")
        reader.start()
        child_conn.close()
        calls = _ping(conn, "ping")["calls"]
        left = []
        for it in range(50):
            left.append(_kill_mid_extend(buf, ctx, rng, seed=1000 + it))
            rep = _ping(conn, "ping")
            assert rep["corrupt"] == 0, rep["examples"]
            assert rep["errors"] == [], rep["errors"]
            assert rep["calls"] > calls, "the reader made no progress"
            calls = rep["calls"]
        final = _ping(conn, "stop")
        reader.join(10)
        assert reader.exitcode == 0
        assert final["corrupt"] == 0 and final["errors"] == []
        assert final["checked"] > 50_000
        assert final["max_call_s"] < 1.0, f"a sample took {final['max_call_s']:.2f}s"
        mid = sum(x["mid_extend"] for x in left)
        odd = sum(x["odd_slots"] > 0 for x in left)
        worst = max(x["took"] for x in left)
        print(f"{mid}/50 kills mid-extend, {odd} left odd slots; slowest takeover {worst:.3f}s; "
              f"reader checked {final['checked']} rows")
        # The test is only worth something if many kills really landed inside extend().
        assert mid >= 10 and odd >= 5, (mid, odd)
    finally:
        if reader is not None and reader.exitcode is None:
            reader.kill()
            reader.join(10)
        buf.close()


def test_writer_sigkilled_mid_extend_of_more_rows_than_capacity():
    """A writer killed inside extend() of 1.5-3x the lane's capacity has every slot of the lane
    half-written. The next writer takes over, and the rows it commits are readable at once (the
    dead writer's claim must not hide them), whole, and nothing older is offered."""
    ctx = multiprocess.get_context("fork")
    rng = np.random.default_rng(99)
    C = 256
    buf = shmbuf.ReplayBuffer.create(procs.SPEC, capacity=C, lanes=1)
    mid = 0
    try:
        for it in range(10):
            conn, child_conn = ctx.Pipe(duplex=False)
            child = ctx.Process(target=procs.extend_forever,
                                args=(buf, 0, child_conn, 3 * C, it), name="extender")
            child.start()
            child_conn.close()
            try:
                assert conn.poll(60)
                _, pid, _ = conn.recv()
                time.sleep(rng.uniform(0.0, 0.005))  # a random kill point
                os.kill(pid, signal.SIGKILL)
                with buf.writer(lane=0, timeout=1.0) as w:
                    c = w.committed
                    mid += int(buf.storage.reserved[0]) > c
                    w.extend(procs.make_batch(0, np.arange(c, c + 10)))
                idx = np.arange(c, c + 10)
                rows = buf.get(idx, 0)  # StaleIndexError = committed rows hidden by the claim
                assert not procs.bad_rows(rows, 0, idx).any()
                _verify_window(buf)
                child.join(10)
            finally:
                if child.exitcode is None:
                    child.kill()
                    child.join(10)
                conn.close()
        print(f"{mid}/10 kills landed inside extend()")
    finally:
        buf.close()


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_writer_sigkilled_mid_extend_other_start_methods(method):
    """The same kill-and-take-over cycle, a few times, with writers started by forkserver and
    spawn (which attach by name instead of inheriting the mapping)."""
    ctx = multiprocess.get_context(method)
    rng = np.random.default_rng(7)
    buf = shmbuf.ReplayBuffer.create(procs.SPEC, capacity=KILL_CAPACITY, lanes=1)
    try:
        with buf.writer(lane=0) as w:
            w.extend(procs.make_batch(0, np.arange(KILL_CAPACITY // 2)))
        for it in range(3):
            _kill_mid_extend(buf, ctx, rng, seed=it)
    finally:
        buf.close()


# --------------------------------------------------------------------------------------------
# Subprocess helpers
# --------------------------------------------------------------------------------------------
def _python(code: str, **kw) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw,
    )
    # Lines arrive through a thread: select() on a buffered text pipe misses lines already
    # read into Python's buffer.
    proc.lines = queue.Queue()  # type: ignore[attr-defined]
    proc.out_lines = []  # type: ignore[attr-defined]
    proc.eof = threading.Event()  # type: ignore[attr-defined]

    def pump() -> None:
        for line in proc.stdout:
            proc.out_lines.append(line)
            proc.lines.put(line)
        proc.lines.put(None)
        proc.eof.set()

    threading.Thread(target=pump, daemon=True).start()
    return proc


def _readline(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    try:
        line = proc.lines.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        proc.wait(10)
        raise AssertionError(
            f"no output from the child within {timeout}s; stderr: {proc.stderr.read()}"
        ) from None
    if line is None:
        proc.wait(10)
        raise AssertionError(f"child exited ({proc.returncode}): {proc.stderr.read()}")
    return line.strip()


def _finish(proc: subprocess.Popen, timeout: float = 30.0) -> tuple[str, str]:
    """Close stdin, wait for the exit; return (all stdout, stderr)."""
    try:
        proc.stdin.close()
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise
    err = proc.stderr.read()
    proc.eof.wait(10)
    return "".join(proc.out_lines), err


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    for f in (proc.stdin, proc.stderr):
        if f is not None and not f.closed:
            f.close()


# An interactive shell gives Python SIGINT's default handler; background jobs of a
# non-interactive shell (CI runners, nohup) start with SIGINT ignored. Restore the default so
# the child behaves as a user's script would.
_OWNER = """
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy as np, shmbuf
    b = shmbuf.ReplayBuffer.create({"x": ((4,), "float32")}, capacity=16)
    with b.writer() as w:
        w.add(x=np.arange(4, dtype=np.float32))
    print(b.name, flush=True)
"""


# --------------------------------------------------------------------------------------------
# Unrelated processes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["close", "exit-without-close", "sigterm", "writer"])
def test_unrelated_process_attaches_and_exits_segment_and_data_survive(how):
    """A plain ``python -c`` attaches by name, reads, and ends (closing, exiting without
    closing, by SIGTERM while attached, or after writing on its own lane): the owner's segment
    and every byte of its data survive, and the attacher never loads multiprocessing's resource
    tracker (which unlinks segments it does not own)."""
    buf = shmbuf.ReplayBuffer.create(procs.SPEC, capacity=128, lanes=2)
    proc = None
    try:
        with buf.writer(lane=0) as w:
            w.extend(procs.make_batch(0, np.arange(100)))
        before = _snapshot(buf)
        code = f"""
            import sys, numpy as np, shmbuf
            b = shmbuf.ReplayBuffer.attach({buf.name!r})
            rows = b.get(np.arange(100), 0)
            sample = b.sample(16)
            print(int(rows["index"].sum()), b.is_owner, len(b), int(sample["lane"].max()),
                  "multiprocessing.resource_tracker" in sys.modules, flush=True)
            how = {how!r}
            if how == "close":
                b.close()
            elif how == "sigterm":
                print("waiting", flush=True)
                sys.stdin.read()
            elif how == "writer":
                w = b.writer(lane=1)
                w.add(lane=1, index=0, payload=np.zeros(32, np.uint64),
                      mirror=np.zeros(32, np.uint64), check=0)
        """
        proc = _python(code)
        assert _readline(proc).split() == [str(sum(range(100))), "False", "100", "0", "False"]
        if how == "sigterm":
            assert _readline(proc) == "waiting"
            proc.send_signal(signal.SIGTERM)
            _finish(proc)
            assert proc.returncode == -signal.SIGTERM
        else:
            _, err = _finish(proc)
            assert proc.returncode == 0, err
        assert os.path.exists(_path(buf.name))
        assert buf.stats()["owner_alive"]
        after = _snapshot(buf)
        if how == "writer":
            # Its row landed in lane 1, its lane is free again, lane 0 is untouched.
            assert buf.committed(1) == 1 and not buf.writer_alive(1)
            lay = buf._layout
            c0 = lay.columns[0]
            lane0 = slice(c0.offset, c0.offset + 128 * 8)
            assert after[lane0] == before[lane0]
            assert buf.get(np.arange(100), 0)["index"].tolist() == list(range(100))
        else:
            assert after == before
        # The owner still owns it: closing it unlinks the name.
        buf.close()
        assert not os.path.exists(_path(buf.name))
    finally:
        if proc is not None:
            _stop(proc)
        buf.close()


def test_attaching_never_resizes_or_writes_the_segment():
    """attach() maps the existing size (never passes a size that would truncate the owner's
    file) and writes nothing: the file's size, mtime-independent bytes and data are unchanged."""
    with shmbuf.ReplayBuffer.create(procs.SPEC, capacity=64) as buf:
        with buf.writer() as w:
            w.extend(procs.make_batch(0, np.arange(64)))
        size = os.path.getsize(_path(buf.name))
        before = _snapshot(buf)
        other = shmbuf.ReplayBuffer.attach(buf.name)
        assert other.nbytes == size and not other.is_owner
        assert other.get(np.arange(64))["index"].tolist() == list(range(64))
        other.close()
        other.close()  # idempotent
        assert os.path.getsize(_path(buf.name)) == size
        assert _snapshot(buf) == before


# --------------------------------------------------------------------------------------------
# Owner lifecycle
# --------------------------------------------------------------------------------------------
def test_owner_unlinks_on_close():
    buf = shmbuf.ReplayBuffer.create(procs.SPEC, capacity=8)
    name = buf.name
    assert os.path.exists(_path(name))
    buf.close()
    assert not os.path.exists(_path(name))
    buf.close()  # idempotent
    with pytest.raises(shmbuf.SegmentNotFoundError, match=name):
        shmbuf.ReplayBuffer.attach(name)


@pytest.mark.parametrize("ending", ["return", "exception", "sys.exit(3)"])
def test_owner_unlinks_at_normal_interpreter_exit(ending):
    """An owner that never calls close() still unlinks when its interpreter exits normally
    (end of script, an uncaught exception, sys.exit)."""
    tail = {"return": "", "exception": "raise RuntimeError('boom')", "sys.exit(3)": "sys.exit(3)"}
    proc = _python(_OWNER + "\n    " + tail[ending] + "\n")
    try:
        name = _readline(proc)
        _finish(proc)
        assert proc.returncode == {"return": 0, "exception": 1, "sys.exit(3)": 3}[ending]
        assert not os.path.exists(_path(name)), "the owner exited and left its segment"
    finally:
        _stop(proc)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_owner_unlinks_on_signal(sig):
    """An owner waiting for input is sent SIGTERM / SIGINT / SIGHUP: its segment is gone and
    the process still dies of (or exits because of) that signal."""
    # The signal's default action, as a shell gives it (an inherited SIG_IGN, e.g. under nohup,
    # is kept by design: shmbuf installs its handler only where the default would kill).
    proc = _python(_OWNER + "\n    sys.stdin.read()\n    print('stdin closed', flush=True)\n",
                   preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    try:
        name = _readline(proc)
        assert os.path.exists(_path(name))
        proc.send_signal(sig)
        _, err = _finish(proc)
        assert not os.path.exists(_path(name)), f"segment left after {sig.name}; stderr: {err}"
        if sig == signal.SIGINT:
            assert "KeyboardInterrupt" in err and proc.returncode != 0
        else:
            assert proc.returncode == -sig, err
    finally:
        _stop(proc)


def test_owner_created_in_a_thread_unlinks_on_sigterm():
    """Signal handlers can only be installed from the main thread: ``import shmbuf`` there
    installs the cleanup handler (where the default action would kill), so an owner created
    later in any thread is covered (was a strict xfail: the handler was installed only by a
    create() on the main thread)."""
    code = """
    import sys, threading, shmbuf
    box = {}
    t = threading.Thread(target=lambda: box.setdefault(
        "b", shmbuf.ReplayBuffer.create({"x": ((4,), "float32")}, capacity=16)))
    t.start()
    t.join(30)
    assert not t.is_alive(), "creating a buffer in a thread hung"
    print(box["b"].name, flush=True)
    sys.stdin.read()
    """
    proc = _python(code)
    name = None
    try:
        name = _readline(proc)
        proc.send_signal(signal.SIGTERM)
        _finish(proc)
        assert proc.returncode == -signal.SIGTERM
        assert not os.path.exists(_path(name)), "owner created in a thread leaked on SIGTERM"
    finally:
        _stop(proc)
        if name is not None:
            shmbuf.shmdir.unlink(name)


def test_signal_while_the_owner_registry_lock_is_held_does_not_deadlock():
    """SIGTERM can land while the main thread holds the owner-registry lock (inside create(),
    close() or the atexit cleanup). The handler runs on that same thread: it must not wait for
    the lock it interrupted (the process would hang forever and leak its segment)."""
    code = _OWNER + """
    import os
    import shmbuf.cleanup as S
    with S._owned_lock:  # as register_owned / forget_owned / _unlink_owned hold it
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):  # the Python-level handler runs here, inside the lock
            pass
    print("survived SIGTERM", flush=True)
    """
    proc = _python(code)
    name = None
    try:
        name = _readline(proc)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            raise AssertionError("the owner hung in its SIGTERM handler (deadlock)") from None
        assert proc.returncode == -signal.SIGTERM
        assert not os.path.exists(_path(name))
    finally:
        _stop(proc)
        if name is not None:
            shmbuf.shmdir.unlink(name)


def test_owner_sigkilled_leaves_a_segment_scan_reports_dead():
    """SIGKILL runs no cleanup: the segment stays, but ``scan()`` sees its owner lease free
    (alive=False) so ``shmbuf gc`` may remove it; while the owner lived it was alive=True."""
    proc = _python(_OWNER + "\n    sys.stdin.read()\n")
    name = None
    try:
        name = _readline(proc)
        info = {s.name: s for s in shmbuf.scan.scan()}
        assert info[name].alive and info[name].header.owner_pid == proc.pid
        proc.kill()
        _finish(proc)
        assert os.path.exists(_path(name))
        info = {s.name: s for s in shmbuf.scan.scan()}
        assert name in info and info[name].alive is False
        # Its data is intact and readable by anyone who attaches.
        with shmbuf.ReplayBuffer.attach(name) as b:
            assert b.get([0])["x"].tolist() == [[0.0, 1.0, 2.0, 3.0]]
            assert b.stats()["owner_alive"] is False
    finally:
        _stop(proc)
        if name is not None:
            shmbuf.shmdir.unlink(name)
    assert not os.path.exists(_path(name))


def test_forked_child_does_not_keep_a_dead_owner_alive():
    """The owner forks a child (which inherits its lease and writer descriptors), then is
    SIGKILLed. While the child lives on, scan() reports the owner dead and the writer's lane is
    free: the at-fork hook closed the child's copies of both leases. The child could not use the
    inherited writer either."""
    code = _OWNER + """
    import os
    w = b.writer(lane=0)
    r, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            w.add(x=np.zeros(4, np.float32))
            os.write(wr, b"no-error")
        except shmbuf.ClosedError:
            os.write(wr, b"ClosedError")
        os.close(wr)
        sys.stdin.read()
        os._exit(0)
    os.close(wr)
    print(pid, os.read(r, 100).decode(), flush=True)
    sys.stdin.read()
    """
    proc = _python(code)
    name = child = None
    try:
        name = _readline(proc)
        child, child_saw = _readline(proc).split()
        child = int(child)
        assert child_saw == "ClosedError"
        info = {s.name: s for s in shmbuf.scan.scan()}
        assert info[name].alive
        proc.kill()
        proc.wait(10)
        assert os.path.exists(f"/proc/{child}"), "the forked child should still be running"
        info = {s.name: s for s in shmbuf.scan.scan()}
        assert info[name].alive is False, "a forked child keeps a dead owner looking alive"
        with shmbuf.ReplayBuffer.attach(name) as b:
            assert not b.writer_alive(0)
            with b.writer(lane=0, timeout=1.0) as w:
                assert w.committed == 1
    finally:
        _stop(proc)
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if name is not None:
            shmbuf.shmdir.unlink(name)


def test_forked_child_exiting_normally_does_not_unlink_the_owners_segment():
    """A child forked by the owner inherits its atexit hook and its ReplayBuffer object. When
    the child exits normally (atexit and finalizers run) or by SIGTERM (the inherited handler
    runs), the parent's segment must survive: only the creating process unlinks."""
    code = _OWNER + """
    import os, signal
    for how in ("exit", "sigterm"):
        pid = os.fork()
        if pid == 0:
            if how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            del b  # the child's copy of the owner's handle is finalized too
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print(how, os.waitstatus_to_exitcode(status), os.path.exists("/dev/shm/" + b.name),
              flush=True)
    b.close()
    print("closed", os.path.exists("/dev/shm/" + b.name), flush=True)
    """
    proc = _python(code)
    try:
        name = _readline(proc)
        assert _readline(proc) == "exit 0 True"
        assert _readline(proc) == f"sigterm {-signal.SIGTERM} True"
        assert _readline(proc) == "closed False"
        _, err = _finish(proc)
        assert proc.returncode == 0, err
        assert not os.path.exists(_path(name))
    finally:
        _stop(proc)


def test_forked_child_cannot_use_an_inherited_writer():
    """A child forked while the parent holds a Writer gets ClosedError from add, extend and
    end_episode, cannot take the parent's lane (LaneBusyError), but can open its own writer on a
    free lane; the parent's writer is unaffected."""
    ctx = multiprocess.get_context("fork")
    buf = shmbuf.ReplayBuffer.create(procs.SPEC, capacity=32, lanes=2)
    p = None
    try:
        w = buf.writer(lane=0)
        w.add(**procs.make_row(0, 0))
        results = ctx.Queue()
        p = ctx.Process(target=procs.use_inherited_writer, args=(buf, w, results))
        p.start()
        [report] = procs.collect(results, 1, [p], timeout=60)
        procs.reap([p], timeout=10)
        assert p.exitcode == 0
        for op in ("add", "extend", "end_episode"):
            assert report[op].startswith("ClosedError") and "forked child" in report[op], report
        assert report["steal"] == "LaneBusyError"
        assert report["other_lane_index"] == 0
        # The parent's writer goes on, and the child wrote nothing to lane 0.
        assert w.add(**procs.make_row(0, 1)) == 1
        assert buf.committed().tolist() == [2, 1]
        rows = buf.get([0, 1], 0)
        assert not procs.bad_rows(rows, 0, [0, 1]).any()
        w.close()
    finally:
        if p is not None:
            procs.reap([p], timeout=5)
        buf.close()


# --------------------------------------------------------------------------------------------
# /dev/shm too small
# --------------------------------------------------------------------------------------------
BIG = {"obs": ((4, 84, 84), "uint8")}  # 28 KB a row


def _expected_size(capacity: int) -> int:
    spec = shmbuf.Spec(BIG)
    doc = {"kind": "buffer", "spec": spec.to_json(), "capacity": capacity, "lanes": 1}
    fields = [(f.name, f.shape, f.dtype) for f in spec.values()]
    return L.buffer_layout(fields, capacity, 1, len(L.encode_layout(doc))).total_size


def test_capacity_error_when_statvfs_reports_too_little_room(monkeypatch):
    """statvfs says /dev/shm has 40 KiB free: create() raises CapacityError naming the size
    asked, the space free and --shm-size, before any segment exists."""
    real = os.statvfs(SHM)
    fake = os.statvfs_result((4096, 4096, real.f_blocks, 10, 10, real.f_files, real.f_ffree,
                              real.f_favail, real.f_flag, real.f_namemax))
    monkeypatch.setattr(os, "statvfs", lambda path: fake if path == SHM else real)
    before = set(os.listdir(SHM))
    with pytest.raises(shmbuf.CapacityError) as ei:
        shmbuf.ReplayBuffer.create(BIG, capacity=1000, name="shmbuf-test-too-small")
    msg = str(ei.value)
    assert shmbuf.segment.fmt_bytes(_expected_size(1000)) in msg  # the size asked
    assert "40.0 KiB" in msg  # the space free
    assert "--shm-size" in msg
    assert set(os.listdir(SHM)) == before


def test_capacity_error_when_shm_free_bytes_is_small(monkeypatch):
    monkeypatch.setattr(shmbuf.segment, "shm_free_bytes", lambda: 1 << 20)
    before = set(os.listdir(SHM))
    with pytest.raises(shmbuf.CapacityError, match="--shm-size") as ei:
        shmbuf.ReplayBuffer.create(BIG, capacity=1000)
    assert "1.0 MiB" in str(ei.value)
    assert isinstance(ei.value, OSError) and isinstance(ei.value, shmbuf.ShmbufError)
    assert set(os.listdir(SHM)) == before


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EFBIG])
def test_capacity_error_when_fallocate_fails_and_no_segment_is_left(monkeypatch, err):
    """statvfs said yes but posix_fallocate ran out of room (a race with another process):
    CapacityError, the half-made segment is unlinked, and its name is free for a retry."""
    calls = []

    def no_room(fd, offset, length):
        calls.append(length)
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    before = set(os.listdir(SHM))
    with pytest.raises(shmbuf.CapacityError, match="--shm-size") as ei:
        shmbuf.ReplayBuffer.create(BIG, capacity=10, name="shmbuf-test-fallocate")
    assert calls == [_expected_size(10)]
    assert shmbuf.segment.fmt_bytes(_expected_size(10)) in str(ei.value)
    assert set(os.listdir(SHM)) == before
    monkeypatch.undo()
    with shmbuf.ReplayBuffer.create(BIG, capacity=10, name="shmbuf-test-fallocate") as buf:
        assert buf.capacity == 10


def test_other_fallocate_errors_propagate_and_leave_no_segment(monkeypatch):
    def io_error(fd, offset, length):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "posix_fallocate", io_error)
    before = set(os.listdir(SHM))
    with pytest.raises(OSError) as ei:
        shmbuf.ReplayBuffer.create(BIG, capacity=10)
    assert ei.value.errno == errno.EIO and not isinstance(ei.value, shmbuf.CapacityError)
    assert set(os.listdir(SHM)) == before


# --------------------------------------------------------------------------------------------
# Closing with views alive
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("then", ["close-again", "exit-with-view"])
def test_close_with_numpy_views_alive_raises_and_never_crashes(then):
    """In a subprocess: close() while a column() view is alive raises BufferInUseError with a
    message that says what to do; the segment is already unlinked, the handle is closed, the view
    still reads the right data, and the process exits with 0 (after deleting the view and closing
    again, or with the view still alive at interpreter exit)."""
    code = f"""
    import os, numpy as np, shmbuf
    b = shmbuf.ReplayBuffer.create({{"obs": ((8,), "float32")}}, capacity=32)
    with b.writer() as w:
        w.extend({{"obs": np.arange(256, dtype=np.float32).reshape(32, 8)}})
    v = b.column("obs")
    path = "/dev/shm/" + b.name
    try:
        b.close()
        print("close: no error")
    except shmbuf.BufferInUseError as e:
        print("close: BufferInUseError:", e)
    print("exists:", os.path.exists(path))
    print("sum:", float(v.sum()))
    try:
        b.sample(1)
    except shmbuf.ClosedError:
        print("sample: ClosedError")
    if {then!r} == "close-again":
        del v
        b.close()
        print("closed again")
    """
    proc = _python(code)
    try:
        out, err = _finish(proc, timeout=60)
    finally:
        _stop(proc)
    assert proc.returncode == 0, f"rc {proc.returncode}; stderr: {err}"
    lines = out.splitlines()
    assert lines[0].startswith("close: BufferInUseError:"), out
    assert "del" in lines[0] and "view" in lines[0]
    assert lines[1:4] == ["exists: False", f"sum: {float(sum(range(256)))}", "sample: ClosedError"]
    if then == "close-again":
        assert lines[4] == "closed again"
    assert "Error" not in err and "Segmentation" not in err, err
