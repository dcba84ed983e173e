"""``clear()`` while another process (or handle) has a writer open on a lane (issue 12 item 8):
the lane's "cleared below" floor hides every older row from ``len``, ``sample``, episode
records, pools (past the batches already prefetched) and checkpoints, while the writer goes on
untouched; queue mode and ``min_size`` count from the floor; restores reset it.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import pytest

import shmbuf
from shmbuf import layout as L
from tests import clear_procs
from tests._helpers.processes import reporting_child
from tests.pool_procs import SPEC, assert_batch_ok, bad_rows, fill, make_row
from workers.config import Workers

pytestmark = pytest.mark.timeout(120)
C = 512


@contextlib.contextmanager
def writer_child(mp, target, *args, what="the writer"):
    """The child ``target(conn, *args)`` after its first report: (process, pipe, report)."""
    with reporting_child(mp, target, *args, what=what, timeout=60) as started:
        yield started


def rows_of(buf, lane):
    """(lane, index) of every row ``lane`` holds, checked whole."""
    win = buf.windows()
    idx = np.arange(win.lo[lane], win.hi[lane])
    rows = buf.get(idx, lanes=lane)
    assert not bad_rows(rows, np.full(idx.size, lane), idx).any()
    return idx


# --------------------------------------------------------------------------------------------
# A writer process adding rows all through the clears
# --------------------------------------------------------------------------------------------
def test_clear_under_a_streaming_writer_hides_every_older_row(mp):
    """Lane 0's writer (another process) keeps adding; lane 1 has no writer. Right after each
    clear(): len(buf) counts exactly the rows lane 0 published since the floor, sample() never
    returns a row below it nor any lane-1 row, and no row is torn."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=C, lanes=2) as buf:
        fill(buf, 100, lanes=[1])
        with writer_child(mp, clear_procs.streaming_writer, buf.name, 0, 3 * C) as (_, conn, _r):
            rng = np.random.default_rng(0)
            for _ in range(20):
                before = buf.committed(0)
                buf.clear()
                floor = int(buf.storage.cleared_below[0])
                assert before <= floor <= buf.committed(0)
                h1 = buf.committed(0)
                n = len(buf)
                h2 = buf.committed(0)
                assert h1 - floor <= n <= min(h2 - floor, C), (h1, n, h2, floor)
                assert buf.windows().sizes[1] == 0
                for _ in range(5):
                    if len(buf) == 0:
                        continue
                    batch = buf.sample(64, rng=rng)
                    assert not bad_rows(batch).any()
                    assert (batch["lane"] == 0).all() and (batch["index"] >= floor).all()
                if len(buf):
                    assert (rows_of(buf, 0) >= floor).all()
            conn.send("stop")
            assert conn.poll(30)
            written = conn.recv()
        assert buf.committed(0) == written
        assert len(buf) == min(written - int(buf.storage.cleared_below[0]), C)


def test_clear_under_an_idle_writer_and_its_episodes(mp):
    """A writer process holding lane 0 between adds: clear() empties the lane at once (no wait,
    no error); the next rows are held with indices going on; episodes finished before the clear,
    and the one open across it, read as not held; later ones are held."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=C, lanes=1, episode_capacity=64) as buf:
        with writer_child(mp, clear_procs.commanded_writer, buf.name, 0) as (_, conn, first):
            assert first == 0

            def say(*cmd):
                conn.send(cmd)
                assert conn.poll(30)
                return conn.recv()

            assert say("add", 10) == 10
            assert say("end") == 0
            assert say("add", 5) == 15  # episode 1 is open across the clear
            assert buf.writer_alive(0)
            buf.clear(timeout=0.0)  # no wait for the writer: it is not needed
            assert len(buf) == 0 and buf.episodes()["episode"].size == 0
            with pytest.raises(shmbuf.EmptyBufferError):
                buf.sample(1)
            with pytest.raises(shmbuf.StaleIndexError):
                buf.get([14])
            with pytest.raises(shmbuf.StaleIndexError):
                buf.episode(0)
            assert say("add", 3) == 18
            assert len(buf) == 3 and rows_of(buf, 0).tolist() == [15, 16, 17]
            assert set(buf.sample(100)["index"].tolist()) == {15, 16, 17}
            assert say("end") == 1  # began at 10, below the floor: cleared
            with pytest.raises(shmbuf.StaleIndexError):
                buf.episode(1)
            assert say("add", 4) == 22
            assert say("end") == 2
            rec = buf.episode(2)
            assert (rec["start"], rec["length"]) == (18, 4)
            assert buf.episodes()["episode"].tolist() == [2]
            assert say("stop") == 22
        assert buf.stats()["size"] == 7  # stats and top count from the floor too


def test_clear_with_a_writer_of_this_process_does_not_touch_it():
    """The same with a second handle in this process: the writer's next add is held, and a
    clear() of an already cleared lane keeps the floor at committed."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=1) as buf:
        with buf.writer(lane=0) as w:
            for i in range(20):
                w.add(**make_row(0, i))
            buf.clear()
            buf.clear()
            assert len(buf) == 0 and int(buf.storage.cleared_below[0]) == 20
            w.add(**make_row(0, 20))
            assert rows_of(buf, 0).tolist() == [20]
        buf.clear()  # no writer now: emptied as before (window at committed, floor kept)
        assert len(buf) == 0 and buf.storage.reserved[0] == 21 + 8


# --------------------------------------------------------------------------------------------
# A pool running across the clear
# --------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_a_pool_across_the_clear_delivers_older_rows_only_in_prefetched_batches(mp,
                                                                                start_method):
    """Batches gathered before clear() returned may hold older rows: at most ``n_staging`` of
    them (every staging slot holds one batch). Every later batch holds only rows at or above
    the floor; none is torn."""
    from workers import SamplerPool

    n_staging = 3
    with shmbuf.ReplayBuffer.create(SPEC, capacity=C, lanes=2) as buf:
        fill(buf, C, lanes=[1])
        with writer_child(mp, clear_procs.streaming_writer, buf.name, 0, 2 * C) as (_, conn, _r):
            with SamplerPool(buf, batch_size=32,
                             workers=Workers(1, staging=n_staging, start_method=start_method),
                             seed=0, timeout=60) as pool:
                for _ in range(10):
                    assert_batch_ok(next(pool), 32)
                for _ in range(3):
                    buf.clear()
                    floor = int(buf.storage.cleared_below[0])
                    older = []
                    for k in range(4 * n_staging):
                        batch = next(pool)
                        assert_batch_ok(batch, 32)
                        lanes, idx = np.asarray(batch.lanes), np.asarray(batch.indices)
                        if ((lanes == 1) | (idx < floor)).any():
                            older.append(k)
                    assert older == list(range(len(older))) and len(older) <= n_staging, older
            conn.send("stop")
            assert conn.poll(30)
            conn.recv()


def test_a_clear_between_the_drawable_check_and_the_draw_waits_for_rows(monkeypatch):
    """The clear() lands after the fill saw a drawable buffer and before it drew: the draw
    finds the buffer empty, waits for rows (a writer adds them 50 ms later) and delivers them,
    instead of failing the pool with EmptyBufferError (a race a live pool across clears hit)."""
    from workers import SamplerPool

    with shmbuf.ReplayBuffer.create(SPEC, capacity=C, lanes=1) as buf:
        fill(buf, C)
        with SamplerPool(buf, batch_size=8, workers=0, seed=0, timeout=10) as pool:
            assert_batch_ok(pool.next(), 8)
            draw, cleared = buf.sample_into, []

            def cleared_first(*args, **kwargs):
                if not cleared:
                    buf.clear()
                    cleared.append(int(buf.storage.cleared_below[0]))
                    threading.Timer(0.05, fill, (buf, 16)).start()
                return draw(*args, **kwargs)

            monkeypatch.setattr(buf, "sample_into", cleared_first)
            batch = pool.next()
            assert_batch_ok(batch, 8)
            assert cleared and (np.asarray(batch.indices) >= cleared[0]).all()


# --------------------------------------------------------------------------------------------
# Limits, checkpoints, locks, format
# --------------------------------------------------------------------------------------------
def test_queue_mode_counts_undelivered_rows_from_the_floor():
    """In queue mode a full lane blocks its writer; clear() with the writer open frees it."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=1) as buf:
        limiter = buf.storage.limiter
        lease = limiter.take()
        try:
            limiter.open_queue()
            with buf.writer(lane=0, insert_timeout=0.2) as w:
                for i in range(8):
                    w.add(**make_row(0, i))
                with pytest.raises(shmbuf.RateLimitTimeout):
                    w.add(**make_row(0, 8))
                buf.clear()
                w.add(**make_row(0, 8))  # nothing undelivered above the floor
                assert rows_of(buf, 0).tolist() == [8]
            limiter.close_queue()
        finally:
            lease.close()


def test_min_size_counts_rows_above_the_floor():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=64, lanes=1) as buf:
        with buf.writer(lane=0) as w:
            for i in range(40):
                w.add(**make_row(0, i))
            limiter = buf.storage.limiter
            assert limiter.can_sample(1, min_size=10, limited=False)
            buf.clear()
            assert not limiter.can_sample(1, min_size=10, limited=False)
            assert "holds 0 of min_size=10" in limiter.blocked_reason(1, 10, limited=False)
            for i in range(40, 50):
                w.add(**make_row(0, i))
            assert limiter.can_sample(1, min_size=10, limited=False)


@pytest.mark.parametrize("form", ["state_dict", "directory"])
def test_checkpoint_after_a_clear_holds_only_rows_above_the_floor(form, tmp_path):
    """A checkpoint taken after a clear under a live writer holds the rows and episodes after
    the floor only; it restores them with every floor back at 0. Restoring a checkpoint from
    before the clear into the cleared buffer brings the old rows back (the floor is reset)."""
    spec = SPEC
    with shmbuf.ReplayBuffer.create(spec, capacity=C, lanes=2, episode_capacity=16) as buf:
        fill(buf, 30, lanes=[1])
        with buf.writer(lane=0) as w:
            for i in range(100):
                w.add(**make_row(0, i))
                if i % 10 == 9:
                    w.end_episode()
            before = buf.state_dict()
            w.add(**make_row(0, 100))  # episode 10 begins below the floor
            buf.clear()
            for i in range(101, 110):
                w.add(**make_row(0, i))
            assert w.end_episode() == 10
            for i in range(110, 115):
                w.add(**make_row(0, i))
            assert w.end_episode() == 11
            if form == "state_dict":
                state = buf.state_dict()
                assert [(r["first"], r["count"]) for r in state["per_lane"]] == [(101, 14),
                                                                                  (30, 0)]
                copy = shmbuf.ReplayBuffer.create(spec, capacity=C, lanes=2, episode_capacity=16)
                copy.load_state_dict(state)
            else:
                buf.save(tmp_path / "ckpt")
                copy = shmbuf.ReplayBuffer.load(tmp_path / "ckpt")
        with copy:
            assert copy.storage.cleared_below.tolist() == [0, 0]
            assert rows_of(copy, 0).tolist() == list(range(101, 115))
            assert copy.windows().sizes[1] == 0
            assert copy.episodes()["episode"].tolist() == [11]
        buf.load_state_dict(before)  # needs the writers closed; resets the floors
        assert buf.storage.cleared_below.tolist() == [0, 0]
        assert rows_of(buf, 0).tolist() == list(range(100))
        assert rows_of(buf, 1).tolist() == list(range(30))
        assert buf.episodes()["episode"].tolist() == list(range(10))


def test_a_clear_waits_for_another_clear_or_restore_and_changes_nothing_past_its_timeout():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=2) as buf:
        fill(buf, 5)
        other = shmbuf.ReplayBuffer.attach(buf.name)
        try:
            holder = other.storage.lock_all_lanes()  # a restore in progress, say
            try:
                with pytest.raises(shmbuf.LaneBusyError, match="another clear"):
                    buf.clear(timeout=0.1)
                assert len(buf) == 10 and buf.storage.cleared_below.tolist() == [0, 0]
            finally:
                holder.close()
        finally:
            other.close()
        buf.clear(timeout=0.1)
        assert len(buf) == 0


def test_clear_lock_and_floor_word_fit_the_layout():
    """LOCK_CLEAR is a lock offset of its own; the floor sits in the LANE_EPOCH line, which
    only a writer taking the lane stores word 0 of; the format version says so."""
    others = [L.LOCK_OWNER, L.LOCK_LIMITER] + [L.lock_sampler(j) for j in range(L.MAX_SAMPLERS)]
    others += [L.lock_lane(k) for k in range(L.MAX_LANES)]
    assert L.LOCK_CLEAR not in others and L.LOCK_CLEAR > L.LOCK_OWNER
    assert L.FORMAT_VERSION == 2
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=3) as buf:
        lay = buf.storage.layout
        for k in range(3):
            at = lay.cleared_below(k)
            assert at == lay.lane_word(k, L.LANE_EPOCH) + 8 and at % 8 == 0
        assert lay.total_size == L.buffer_layout(
            [(n, f.shape, f.dtype) for n, f in SPEC.items()], 8, 3,
            len(L.encode_layout(buf.storage.segment.header.doc)),
            episode_capacity=lay.episode_capacity).total_size


def test_a_buffer_of_format_version_1_is_refused():
    """Version 1 shmbufs know no floor (they would show cleared rows): versions must match."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=1) as buf:
        path = os.path.join("/dev/shm", buf.name)
        with open(path, "r+b") as f:
            f.seek(L.H_VERSION)
            f.write((1).to_bytes(4, "little"))
        with pytest.raises(shmbuf.SegmentFormatError, match="format version 1"):
            shmbuf.ReplayBuffer.attach(buf.name, timeout=0.5)


# --------------------------------------------------------------------------------------------
# The SB3 adapter's reset()
# --------------------------------------------------------------------------------------------
def test_sb3_reset_keeps_its_writer_and_samples_like_sb3_after_it():
    """reset() no longer closes and reopens the writer; afterwards the adapter and SB3's own
    buffer, fed the same transitions (past a wrap), return the same batches."""
    pytest.importorskip("stable_baselines3")
    th = pytest.importorskip("torch")
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer as Sb3ReplayBuffer

    from shmbuf.integrations.sb3 import ReplayBuffer

    obs_space, act_space = spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(3)
    ours = ReplayBuffer(40, obs_space, act_space, device="cpu", n_envs=2)
    theirs = Sb3ReplayBuffer(40, obs_space, act_space, device="cpu", n_envs=2)
    rng = np.random.default_rng(0)

    def feed(steps):
        for _ in range(steps):
            obs = rng.random((2, 3), dtype=np.float32)
            nxt = rng.random((2, 3), dtype=np.float32)
            act = rng.integers(0, 3, (2, 1))
            rew = rng.random(2).astype(np.float32)
            done = rng.random(2) < 0.1
            infos = [{"TimeLimit.truncated": bool(d)} for d in done]
            for b in (ours, theirs):
                b.add(obs, nxt, act, rew, done, infos)

    def same(rounds=4):
        for r in range(rounds):
            np.random.seed(r)
            a = ours.sample(16)
            np.random.seed(r)
            b = theirs.sample(16)
            for x, y in zip(a, b):
                assert (x is None and y is None) or th.equal(x, y)

    try:
        feed(27)
        writer = ours._writer
        ours.reset()
        theirs.reset()
        assert ours._writer is writer and not writer.closed and len(ours) == 0
        feed(3)
        same()
        feed(30)  # past a wrap of the 20-row lanes
        same()
    finally:
        ours.close()
