"""Hardening (issue 8, items 10, 11, 13 and 14): selection modes, writers and the rate limiter.

What is proved here:
- ``min_size`` holds back every selection mode (uniform, ``max_times_sampled``, the queue), in
  process and with workers: ``next`` times out naming ``min_size`` while the buffer holds too
  few rows, and delivers once enough were added; ``samples_per_insert`` holds back
  ``max_times_sampled`` exactly as it holds back uniform sampling (item 10);
- a ``VectorWriter`` inherited by a forked child is closed there: the child's ``add`` raises
  ``ClosedError`` and the parent's lanes keep every byte (item 11);
- once the pool that rate-limited a buffer was SIGKILLed, a writer consults the limiter once per
  ``ROOM_CHECK_EVERY`` rows again, not on every row (item 13);
- a writer refused for a bad argument, or whose construction fails for any reason, leaves its
  lane free at once, even while the exception is still alive (item 14).
"""

from __future__ import annotations

import math
import os
import signal

import multiprocess
import numpy as np
import pytest

import shmbuf
import shmbuf.limiter as limiter_mod
from shmbuf import RateLimit
from shmbuf import layout as L
from shmbuf import vector as vector_mod
from tests import pool_procs as procs
from workers import SamplerPool
from workers.config import Workers
from workers.selection import Counted, Queue

pytestmark = pytest.mark.timeout(90)

MODES = {
    "uniform": {},
    "max_times_sampled": {"selection": Counted(2)},
    "queue": {"selection": Queue()},
}


def _add_rows(w: shmbuf.Writer, n: int) -> None:
    w.extend(procs.make_batch(w.lane, np.arange(w.committed, w.committed + n)))


def _times_out(pool: SamplerPool, timeout: float = 0.5) -> str:
    """Assert ``next`` raises ``Timeout``; return its message."""
    with pytest.raises(shmbuf.Timeout) as info:
        pool.next(timeout=timeout)
    return str(info.value)


def _skip_in_process_twice(n_workers: int, start_method: str) -> None:
    if n_workers == 0 and start_method != "fork":
        pytest.skip("in-process mode starts no process: run it once")


# --------------------------------------------------------------------------------------------
# Item 10: every selection mode honours min_size and samples_per_insert
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_workers", [0, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_min_size_holds_back_every_selection_mode(mode, n_workers, start_method):
    """20 rows and ``min_size=500``: no batch (a Timeout naming min_size); 500 rows more and
    a whole batch comes."""
    _skip_in_process_twice(n_workers, start_method)
    with procs.new_buffer(capacity=512, lanes=2, rows=10) as buf, \
         SamplerPool(buf, batch_size=8, limit=RateLimit(500),
                     workers=Workers(n_workers, start_method=start_method), seed=0,
                     **MODES[mode]) as pool:
        assert "holds 20 of min_size=500" in _times_out(pool)
        with buf.writer(lane=1, insert_timeout=10) as w:
            _add_rows(w, 500)
        procs.assert_batch_ok(pool.next(timeout=30), 8)


def _one_batch_then_held_back(pool: SamplerPool) -> None:
    """Exactly one more whole batch comes; the next ``next`` times out on the rate limiter."""
    procs.assert_batch_ok(pool.next(timeout=30), 8)
    msg = _times_out(pool)
    assert "rate limiter holds sampling back" in msg, msg


@pytest.mark.parametrize("n_workers", [0, 2])
def test_samples_per_insert_holds_back_max_times_sampled(n_workers, start_method):
    """``samples_per_insert=(1, 8)``, ``min_size=16`` on 16 rows: the limiter allows exactly one
    batch of 8 (``16 - 8 - 8 >= min_diff = 8``), although ``max_times_sampled=10`` would allow
    twenty; 8 inserts allow exactly one more."""
    _skip_in_process_twice(n_workers, start_method)
    with procs.new_buffer(capacity=64, lanes=2, rows=8) as buf, \
         SamplerPool(buf, batch_size=8, selection=Counted(10), limit=RateLimit(16, 1.0, 8),
                     workers=Workers(n_workers, start_method=start_method), seed=0) as pool:
        _one_batch_then_held_back(pool)
        with buf.writer(lane=1, insert_timeout=10) as w:
            _add_rows(w, 8)
        _one_batch_then_held_back(pool)


# --------------------------------------------------------------------------------------------
# Item 11: a VectorWriter inherited by a forked child is closed there
# --------------------------------------------------------------------------------------------
def _vector_rows(lanes: np.ndarray, index: np.ndarray) -> dict[str, np.ndarray]:
    rows = [procs.make_row(int(k), int(i)) for k, i in zip(lanes, index)]
    return {name: np.stack([r[name] for r in rows]) for name in rows[0]}


def test_vector_writer_inherited_by_a_forked_child_is_closed():
    """The child's ``add`` raises ``ClosedError`` and the segment keeps every byte; the parent's
    writer goes on writing."""
    ctx = multiprocess.get_context("fork")
    with procs.new_buffer(capacity=16, lanes=2, rows=0) as buf, buf.writer(num_envs=2) as vw:
        vw.add(**_vector_rows(vw.lanes, vw.committed))
        with open(os.path.join("/dev/shm", buf.name), "rb") as f:
            before = f.read()
        parent_end, child_end = ctx.Pipe()

        def child() -> None:
            try:
                vw.add(**_vector_rows(vw.lanes, vw.committed))
                child_end.send("add() succeeded")
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                child_end.send(f"{type(e).__name__}: {e}")

        proc = ctx.Process(target=child)
        proc.start()
        try:
            assert parent_end.poll(30), "the child never reported"
            said = parent_end.recv()
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        assert said.startswith("ClosedError") and "forked child" in said, said
        with open(os.path.join("/dev/shm", buf.name), "rb") as f:
            assert f.read() == before
        assert vw.add(**_vector_rows(vw.lanes, vw.committed)).tolist() == [1, 1]


# --------------------------------------------------------------------------------------------
# Item 13: after the limiting pool died, writers check the limiter once per interval again
# --------------------------------------------------------------------------------------------
def test_writes_after_a_killed_limiting_pool_take_the_fast_path(start_method, monkeypatch):
    """A pool in another process limits our writer until it runs out of room; the pool's
    process is SIGKILLed. Of the next 10,000 ``add`` calls only about one in
    ``ROOM_CHECK_EVERY`` may consult the limiter (``Limiter.wait_for_insert``), not every one."""
    with procs.new_buffer(capacity=512, lanes=1, rows=32) as buf, \
            procs.limiting_pool_process(buf, start_method) as (owner, info):
        row = procs.make_row(0, 0)
        with buf.writer(lane=0, insert_timeout=0.3) as w:
            with pytest.raises(shmbuf.RateLimitTimeout):
                for _ in range(1000):
                    w.add(**row)
            os.kill(info["pid"], signal.SIGKILL)
            owner.join(10)
            assert not buf.storage.segment.probe(L.LOCK_LIMITER), "the lock outlived its pool"
            w.add(**row)  # the first add after the death finds the owner gone
            calls = []
            real = limiter_mod.Limiter.wait_for_insert

            def counted(*args, **kwargs):
                calls.append(1)
                return real(*args, **kwargs)

            monkeypatch.setattr(limiter_mod.Limiter, "wait_for_insert", counted)
            n = 10_000
            for _ in range(n):
                w.add(**row)
            assert len(calls) <= math.ceil(n / limiter_mod.ROOM_CHECK_EVERY) + 1, len(calls)
        assert procs.wait_dead(info["workers"], 5) == []


# --------------------------------------------------------------------------------------------
# Item 14: a refused writer leaves its lane free
# --------------------------------------------------------------------------------------------
BAD_WRITER_ARGS = [
    {"insert_timeout": -1},
    {"insert_timeout": float("nan")},
    {"timeout": -1},
]


def _lane_is_free(buf: shmbuf.ReplayBuffer, lane: int) -> None:
    """``writer(lane=lane)`` succeeds at once (a held lane would raise LaneBusyError)."""
    assert not buf.writer_alive(lane)
    with buf.writer(lane=lane, timeout=0.5) as w:
        assert w.lane == lane


@pytest.mark.parametrize("kwargs", BAD_WRITER_ARGS, ids=lambda kw: ",".join(map(str, kw.items())))
@pytest.mark.parametrize("vector", [False, True], ids=["writer", "vector"])
def test_a_writer_refused_for_a_bad_argument_leaves_the_lane_free(kwargs, vector):
    """The ValueError names the argument; while it is still alive (its traceback holds every
    frame of the failed call), each lane can be taken at once."""
    with procs.new_buffer(capacity=16, lanes=2, rows=0) as buf:
        saved = None
        try:
            if vector:
                buf.writer(num_envs=2, **kwargs)
            else:
                buf.writer(lane=0, **kwargs)
        except ValueError as e:
            saved = e
        assert saved is not None and next(iter(kwargs)) in str(saved), saved
        for lane in range(buf.lanes):
            _lane_is_free(buf, lane)
        del saved


@pytest.mark.parametrize("vector", [False, True], ids=["writer", "vector"])
def test_a_writer_whose_construction_fails_releases_its_lanes(vector, monkeypatch):
    """Any failure after the leases were taken (here a RuntimeError from inside the
    constructor) releases them before it propagates."""

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    if vector:
        monkeypatch.setattr(vector_mod.VectorWriter, "__init__", boom)
    with procs.new_buffer(capacity=16, lanes=2, rows=0) as buf:
        if not vector:
            monkeypatch.setattr(buf.storage, "input_checker", boom)
        saved = None
        try:
            buf.writer(num_envs=2) if vector else buf.writer(lane=0)
        except RuntimeError as e:
            saved = e
        assert saved is not None
        monkeypatch.undo()
        for lane in range(buf.lanes):
            _lane_is_free(buf, lane)
        del saved


@pytest.mark.parametrize("lanes", [[0, 0], [], [0, 2]], ids=["repeated", "empty", "out-of-range"])
def test_vector_writer_lanes_are_checked_before_any_lane_is_taken(lanes):
    """A lane listed twice used to wait the whole ``timeout`` for itself and then report a
    busy lane; now every ``lanes`` list is refused at once, holding nothing."""
    with procs.new_buffer(capacity=16, lanes=2, rows=0) as buf:
        with pytest.raises(ValueError, match="lane"):
            buf.writer(lanes=lanes, timeout=30)
        for lane in range(buf.lanes):
            _lane_is_free(buf, lane)
