"""ReplayBuffer and Writer in one process: what add/extend/sample/get promise, and that every bad
input is refused with a typed error that names the field, before a single byte changes."""

from __future__ import annotations

import os
import pickle
import threading
import time

import numpy as np
import posix_ipc
import pytest

import shmbuf
from shmbuf import layout as L

SPEC = shmbuf.Spec(
    obs=((3,), "float32"),
    action=((), "int64"),
    pix=((2,), "uint8"),
    done=((), "bool"),
    small=((), "int8"),
    ids=((2,), "int16"),
    reward=((), "float32"),
)


def good_row(i: int = 0) -> dict:
    return {
        "obs": np.full(3, i, np.float32),
        "action": i,
        "pix": np.array([i % 256, 1], np.uint8),
        "done": False,
        "small": i % 100,
        "ids": [i, -i],
        "reward": float(i),
    }


def good_batch(n: int, start: int = 0) -> dict:
    i = np.arange(start, start + n)
    return {
        "obs": np.repeat(i[:, None], 3, axis=1).astype(np.float32),
        "action": i.astype(np.int64),
        "pix": np.stack([i % 256, np.ones_like(i)], axis=1).astype(np.uint8),
        "done": np.zeros(n, bool),
        "small": (i % 100).astype(np.int8),
        "ids": np.stack([i, -i], axis=1).astype(np.int16),
        "reward": i.astype(np.float32),
    }


def snapshot(buf: shmbuf.ReplayBuffer) -> tuple[bytes, list, list]:
    """Every byte of the segment (header, lane words, stamps, meta, columns) plus the counters."""
    with open(os.path.join("/dev/shm", buf.name), "rb") as f:
        data = f.read()
    return data, buf.storage.committed.tolist(), buf.storage.reserved.tolist()


@pytest.fixture
def wrapped():
    """A buffer whose lane 0 has wrapped (11 rows in a ring of 8) and whose writer is open, so
    the next slot holds a live row that any partial write would destroy."""
    buf = shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=2)
    w = buf.writer(lane=0)
    for i in range(5):
        w.add(**good_row(i))
    w.extend(good_batch(6, start=5))
    yield buf, w
    buf.close()


# --------------------------------------------------------------------------------------------
# Bad input: typed error naming the field, nothing written
# --------------------------------------------------------------------------------------------
def _without(key):
    def f(row):
        del row[key]
    return f


def _rename(old, new):
    def f(row):
        row[new] = row.pop(old)
    return f


def _set(**kv):
    def f(row):
        row.update(kv)
    return f


ADD_CASES = {
    "missing key": (_without("done"), ["missing", "'done'"]),
    "misspelt key": (_rename("action", "actoin"), ["'actoin'", "did you mean 'action'"]),
    "extra key": (_set(rewrd=1.0), ["'rewrd'", "did you mean 'reward'"]),
    "wrong shape": (_set(obs=np.zeros(4, np.float32)), ["'obs'", "(3,)", "(4,)"]),
    "wrong shape list": (_set(obs=[1.0, 2.0]), ["'obs'", "(3,)", "(2,)"]),
    "a batch given to add": (_set(obs=np.zeros((1, 3), np.float32)), ["'obs'", "extend"]),
    "scalar for an array field": (_set(obs=1.0), ["'obs'", "(3,)"]),
    "float into int": (_set(action=1.5), ["'action'", "int64", "float"]),
    "numpy float into int": (_set(action=np.float64(2.0)), ["'action'", "int64"]),
    "0-d float array into int": (_set(action=np.array(2.0)), ["'action'", "float64"]),
    "int64 array into uint8": (_set(pix=np.array([1, 2], np.int64)), ["'pix'", "uint8", "int64"]),
    "float into bool": (_set(done=0.0), ["'done'", "bool"]),
    "numpy float into bool": (_set(done=np.float32(1.0)), ["'done'", "bool"]),
    "int into bool": (_set(done=1), ["'done'", "bool"]),
    "complex into float": (_set(reward=1j), ["'reward'", "float32"]),
    "python int above int8": (_set(small=128), ["'small'", "128", "127"]),
    "python int below int8": (_set(small=-129), ["'small'", "-129"]),
    "python int beyond int64": (_set(action=2**63), ["'action'", str(2**63)]),
    "python int too big for any float": (_set(reward=10**400), ["'reward'"]),
    "python ints out of range in a list": (_set(ids=[1, 40000]), ["'ids'", "40000", "32767"]),
    "python ints for uint8": (_set(pix=[256, 0]), ["'pix'", "uint8"]),
    "negative python int for uint8": (_set(pix=[-1, 0]), ["'pix'"]),
    "object array": (_set(obs=np.array([1.0, None, 2.0], dtype=object)), ["'obs'", "object"]),
    "ragged list": (_set(obs=[[1.0], [2.0, 3.0]]), ["'obs'"]),
    "string": (_set(obs="abc"), ["'obs'"]),
    "None": (_set(reward=None), ["'reward'"]),
}


@pytest.mark.parametrize("case", list(ADD_CASES))
def test_bad_add_raises_naming_the_field_and_changes_nothing(wrapped, case):
    buf, w = wrapped
    mutate, needles = ADD_CASES[case]
    row = good_row(11)
    mutate(row)
    before = snapshot(buf)
    with pytest.raises(shmbuf.SpecMismatchError) as ei:
        w.add(**row)
    msg = str(ei.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    assert snapshot(buf) == before
    # The writer's own state did not move either: the next good row gets index 11.
    assert w.committed == 11
    assert w.add(**good_row(11)) == 11
    assert buf.get([11])["action"].tolist() == [11]


def _batch_set(**kv):
    def f(batch):
        batch.update(kv)
    return f


N = 4
EXTEND_CASES = {
    "missing key": (_without("done"), ["missing", "'done'"]),
    "misspelt key": (_rename("action", "actoin"), ["'actoin'", "did you mean 'action'"]),
    "extra key": (_batch_set(rewrd=np.zeros(N)), ["'rewrd'", "did you mean 'reward'"]),
    "wrong row shape": (_batch_set(obs=np.zeros((N, 4), np.float32)), ["'obs'", "(4, 4)"]),
    "no batch axis": (_batch_set(obs=np.zeros(3, np.float32)), ["'obs'", "(3,)"]),
    "extra axis on a scalar field": (_batch_set(action=np.zeros((N, 1), np.int64)), ["'action'"]),
    "row counts disagree": (_batch_set(action=np.zeros(N + 1, np.int64)),
                            ["'obs'", "'action'", "4", "5"]),
    "float into int": (_batch_set(action=np.zeros(N)), ["'action'", "int64", "float64"]),
    "int64 into uint8": (_batch_set(pix=np.zeros((N, 2), np.int64)), ["'pix'", "uint8"]),
    "float into bool": (_batch_set(done=np.zeros(N, np.float32)), ["'done'", "bool"]),
    "python floats into bool": (_batch_set(done=[0.0] * N), ["'done'", "bool"]),
    "python ints out of range": (_batch_set(small=[1, 2, 300, 4]), ["'small'", "300"]),
    "python ints beyond int64": (_batch_set(action=[2**63] * N), ["'action'", str(2**63)]),
    "nested python ints out of range": (_batch_set(ids=[[0, 0]] * 3 + [[-40000, 0]]),
                                        ["'ids'", "-40000"]),
    "object array": (_batch_set(obs=np.empty((N, 3), object)), ["'obs'", "object"]),
    "ragged list": (_batch_set(obs=[[1.0] * 3, [1.0] * 2, [1.0] * 3, [1.0] * 3]), ["'obs'"]),
}


@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_bad_extend_raises_naming_the_field_and_changes_nothing(wrapped, case):
    buf, w = wrapped
    mutate, needles = EXTEND_CASES[case]
    batch = good_batch(N, start=11)
    mutate(batch)
    before = snapshot(buf)
    with pytest.raises(shmbuf.SpecMismatchError) as ei:
        w.extend(batch)
    msg = str(ei.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    assert snapshot(buf) == before
    assert w.committed == 11
    assert w.extend(good_batch(N, start=11)) == range(11, 11 + N)
    assert buf.get(np.arange(11, 15))["action"].tolist() == list(range(11, 15))


def test_extend_of_a_non_mapping_changes_nothing(wrapped):
    buf, w = wrapped
    before = snapshot(buf)
    with pytest.raises(shmbuf.SpecMismatchError, match="mapping"):
        w.extend([good_row(11)])
    assert snapshot(buf) == before


def test_closed_writer_raises_closed_error_and_changes_nothing(wrapped):
    buf, w = wrapped
    w.close()
    before = snapshot(buf)
    for call in (lambda: w.add(**good_row(11)), lambda: w.extend(good_batch(2, 11)),
                 w.end_episode):
        with pytest.raises(shmbuf.ClosedError, match="lane 0"):
            call()
    w.close()  # idempotent
    assert snapshot(buf) == before


def test_closed_buffer_raises_closed_error_and_changes_nothing(wrapped):
    """A second handle (attached in this process) is closed: its writer and every call on it
    raise ClosedError; the segment, seen through the owner's handle, is untouched."""
    buf, _ = wrapped
    h = shmbuf.ReplayBuffer.attach(buf.name)
    hw = h.writer(lane=1)
    hw.add(**good_row(0))
    h.close()
    before = snapshot(buf)
    calls = {
        "add": lambda: hw.add(**good_row(1)),
        "extend": lambda: hw.extend(good_batch(2, 1)),
        "sample": lambda: h.sample(2),
        "get": lambda: h.get([0]),
        "writer": lambda: h.writer(lane=1, timeout=0),
        "len": lambda: len(h),
        "stats": h.stats,
        "column": lambda: h.column("obs"),
        "pickle": lambda: pickle.dumps(h),
    }
    for call in calls.values():
        with pytest.raises(shmbuf.ClosedError):
            call()
    assert snapshot(buf) == before
    assert buf.committed().tolist() == [11, 1]
    assert not buf.writer_alive(1)  # closing the handle released its writer's lane


def test_float_overflow_during_the_store_leaves_the_ring_consistent(wrapped):
    """A value that passes validation but makes the store raise (here float64 1e300 into a
    float32 column with warnings turned into errors, as ``-W error`` does) must not leave a
    row that readers deliver, nor break the writer: the next good add gets the same index."""
    import warnings

    buf, w = wrapped
    row = good_row(11)
    row["reward"] = np.float64(1e300)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            w.add(**row)
        except (RuntimeWarning, FloatingPointError, shmbuf.SpecMismatchError):
            pass
    win = buf.windows()
    idx = np.arange(win.lo[0], win.hi[0])
    assert buf.get(idx)["action"].tolist() == idx.tolist()  # every offered row is whole
    assert w.committed == 11 and w.add(**good_row(11)) == 11


@pytest.mark.parametrize("reward", [np.float64(1e300), 1e300, -1e39, np.array(1e300)])
def test_float_overflow_under_warnings_as_errors_changes_nothing(wrapped, reward):
    """A value a float32 field cannot hold (it would become inf, warning during the store) is
    refused before the store, so even with warnings as errors nothing changes."""
    import warnings

    buf, w = wrapped
    before = snapshot(buf)
    row = good_row(11)
    row["reward"] = reward
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(shmbuf.SpecMismatchError, match="reward.*range"):
            w.add(**row)
    assert snapshot(buf) == before


def test_float_overflow_in_extend_is_refused_before_the_store(wrapped):
    buf, w = wrapped
    before = snapshot(buf)
    batch = good_batch(3)
    batch["reward"] = np.array([1.0, 1e300, 2.0])  # float64 into float32
    with pytest.raises(shmbuf.SpecMismatchError, match="reward.*1e\\+300"):
        w.extend(batch)
    assert snapshot(buf) == before
    batch["reward"] = np.array([1.0, np.inf, np.nan])  # inf and nan store as they are
    w.extend(batch)


# --------------------------------------------------------------------------------------------
# Semantics
# --------------------------------------------------------------------------------------------
def test_add_extend_get_round_trip_with_casts():
    """Values come back exactly, safe casts (same_kind) are applied, indices are logical."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=16) as buf:
        with buf.writer() as w:
            assert w.add(**good_row(0)) == 0
            row = good_row(1)
            row.update(obs=np.array([1.5, 2.5, 3.5]), small=np.int64(7) * 0 + np.int8(7),
                       done=True, reward=2)  # float64 -> float32, Python int -> float32
            assert w.add(**row) == 1
            assert w.extend(good_batch(3, start=2)) == range(2, 5)
        got = buf.get([0, 1, 2, 3, 4])
        assert got["obs"].dtype == np.float32 and got["obs"][1].tolist() == [1.5, 2.5, 3.5]
        assert got["action"].tolist() == [0, 1, 2, 3, 4]
        assert got["done"].tolist() == [False, True, False, False, False]
        assert got["small"].tolist() == [0, 7, 2, 3, 4]
        assert got["reward"].tolist() == [0.0, 2.0, 2.0, 3.0, 4.0]
        assert got["pix"].dtype == np.uint8 and got["pix"][:, 1].tolist() == [1] * 5


def test_wrap_around_keeps_the_last_capacity_rows():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8) as buf:
        with buf.writer() as w:
            for i in range(13):
                w.add(**good_row(i))
            w.extend(good_batch(6, start=13))  # crosses the end of the ring
        assert buf.committed(0) == 19 and len(buf) == 8 and buf.is_full
        win = buf.windows()
        assert (int(win.lo[0]), int(win.hi[0])) == (11, 19)
        assert buf.get(np.arange(11, 19))["action"].tolist() == list(range(11, 19))
        with pytest.raises(shmbuf.StaleIndexError, match="index 10 of lane 0"):
            buf.get([10, 11])  # overwritten
        with pytest.raises(shmbuf.StaleIndexError, match=r"\[11, 19\)"):
            buf.get([19])  # not written yet
        with pytest.raises(shmbuf.StaleIndexError):
            buf.get([-1])
        for _ in range(20):
            assert set(buf.sample(8)["action"].tolist()) <= set(range(11, 19))


@pytest.mark.parametrize("start", [0, 5])
def test_extend_with_more_rows_than_capacity_keeps_the_last_rows(start):
    """extend() of 21 rows into a lane of 8 keeps rows 13..20 of the batch, and logical indices
    still advance by 21; episode steps count every row, kept or not."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8) as buf:
        with buf.writer() as w:
            if start:
                w.extend(good_batch(start))
            r = w.extend(good_batch(21, start=start))
            assert r == range(start, start + 21)
            assert w.committed == start + 21 and w.step == start + 21
            assert w.add(**good_row(start + 21)) == start + 21
        win = buf.windows()
        assert (int(win.lo[0]), int(win.hi[0])) == (start + 14, start + 22)
        idx = np.arange(start + 14, start + 22)
        assert buf.get(idx)["action"].tolist() == idx.tolist()
        steps = buf.storage.meta[idx % 8] & L.STEP_MASK  # fancy indexing: a copy
        assert steps.tolist() == idx.tolist()  # one episode, step == index


def test_extend_of_zero_rows_changes_nothing(wrapped):
    buf, w = wrapped
    before = snapshot(buf)
    assert w.extend(good_batch(0)) == range(11, 11)
    assert snapshot(buf) == before


def test_sample_is_reproducible_with_a_seed_and_only_returns_held_rows():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=64, lanes=2) as buf:
        for lane, n in ((0, 100), (1, 30)):
            with buf.writer(lane=lane) as w:
                w.extend(good_batch(n))
        a = buf.sample(256, rng=np.random.default_rng(3))
        b = buf.sample(256, rng=3)
        assert all(np.array_equal(a[k], b[k]) for k in a)
        sub = buf.sample(16, rng=1, fields=["action"])
        assert list(sub) == ["action"]
        out = {"action": np.empty(512, np.int64)}
        draw = buf.sample_into(out, np.random.default_rng(0))
        held = np.where(draw.lanes == 0, (draw.indices >= 36) & (draw.indices < 100),
                        (draw.indices >= 0) & (draw.indices < 30))
        assert held.all()
        assert np.array_equal(out["action"], draw.indices)
        with pytest.raises(shmbuf.SpecMismatchError, match="bogus"):
            buf.sample(4, fields=["bogus"])
        with pytest.raises(ValueError):
            buf.sample(0)


def test_sample_of_an_empty_buffer_raises():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8) as buf:
        with pytest.raises(shmbuf.EmptyBufferError):
            buf.sample(4)
        assert len(buf) == 0 and not buf.is_full


def test_multi_lane_sampling_is_proportional_to_lane_fill():
    """Uniform over transitions: with lanes holding 100, 300, 600 (and one empty), a lane's share
    of 40,000 draws is its share of the rows (within 1%), every row of the small lane is drawn,
    and each drawn row is the one that lane holds at that index."""
    spec = shmbuf.Spec(lane=((), "int64"), index=((), "int64"))
    with shmbuf.ReplayBuffer.create(spec, capacity=1000, lanes=4) as buf:
        fills = [100, 300, 600, 0]
        for lane, n in enumerate(fills):
            with buf.writer(lane=lane) as w:
                w.extend({"lane": np.full(n, lane), "index": np.arange(n)})
        out = {"lane": np.empty(40_000, np.int64), "index": np.empty(40_000, np.int64)}
        draw = buf.sample_into(out, np.random.default_rng(12345))
        assert np.array_equal(out["lane"], draw.lanes)
        assert np.array_equal(out["index"], draw.indices)
        share = np.bincount(draw.lanes, minlength=4) / 40_000
        np.testing.assert_allclose(share, np.array(fills) / 1000, atol=0.01)
        assert set(draw.indices[draw.lanes == 0].tolist()) == set(range(100))


def test_len_is_full_and_stats():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=10, lanes=2) as buf:
        assert (len(buf), buf.is_full, buf.capacity, buf.lanes) == (0, False, 10, 2)
        with buf.writer(lane=0) as w0:
            w0.extend(good_batch(25))
            st = buf.stats()
            assert st["per_lane"][0]["writer_alive"] and not st["per_lane"][1]["writer_alive"]
            assert st["per_lane"][0]["writer_pid"] == os.getpid()
        assert (len(buf), buf.is_full) == (10, False)
        with buf.writer(lane=1) as w1:
            w1.extend(good_batch(10))
        assert (len(buf), buf.is_full) == (20, True)
        st = buf.stats()
        assert st["owner_pid"] == os.getpid() and st["owner_alive"]
        assert [p["committed"] for p in st["per_lane"]] == [25, 10]
        assert [p["size"] for p in st["per_lane"]] == [10, 10]
        assert st["committed"] == 35 and st["size"] == 20
        assert st["inserts_per_s"] > 0 and st["nbytes"] == buf.nbytes
        assert not any(p["writer_alive"] for p in st["per_lane"])
        assert "20/20" in repr(buf)


def test_takeover_after_clean_close_continues_at_committed_in_a_new_episode():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8) as buf:
        w1 = buf.writer(lane=0)
        w1.extend(good_batch(5))
        ep1 = w1.episode
        w1.close()
        w2 = buf.writer(lane=0)
        assert (w2.committed, w2.step, w2.episode) == (5, 0, ep1 + 1)
        assert w2.add(**good_row(5)) == 5
        meta = buf.storage.meta[:6].copy()
        assert (meta >> L.STEP_BITS).tolist() == [ep1] * 5 + [ep1 + 1]
        assert (meta & L.STEP_MASK).tolist() == [0, 1, 2, 3, 4, 0]
        # A writer that ended its episode before closing leaves no episode open: no bump.
        w2.end_episode()
        w2.close()
        w3 = buf.writer(lane=0)
        assert (w3.committed, w3.step, w3.episode) == (6, 0, ep1 + 2)
        w3.close()
        assert buf.stats()["per_lane"][0]["epoch"] == 3


def test_lane_busy_error_after_the_timeout():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=2) as buf:
        w0 = buf.writer(lane=0)
        t0 = time.monotonic()
        with pytest.raises(shmbuf.LaneBusyError, match=str(os.getpid())) as ei:
            buf.writer(lane=0, timeout=0.3)
        waited = time.monotonic() - t0
        assert 0.3 <= waited < 2.0
        assert "0.3" in str(ei.value) and isinstance(ei.value, TimeoutError)
        w1 = buf.writer()  # the free lane
        assert w1.lane == 1
        with pytest.raises(shmbuf.LaneBusyError):
            buf.writer(timeout=0)
        with pytest.raises(ValueError):
            buf.writer(lane=2)
        w0.close()
        w1.close()


def test_waiting_writer_gets_the_lane_when_it_is_released():
    """writer(timeout=10) blocks while the lane is held, then unblocks when it is released."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8) as buf:
        w0 = buf.writer(lane=0)
        w0.add(**good_row(0))
        got: dict = {}
        waiting = threading.Event()

        def take():
            waiting.set()
            t0 = time.monotonic()
            w = buf.writer(lane=0, timeout=10)
            got["waited"] = time.monotonic() - t0
            got["committed"] = w.committed
            w.close()

        t = threading.Thread(target=take)
        t.start()
        assert waiting.wait(10)
        t.join(0.2)
        assert t.is_alive(), "writer() returned while the lane was still held"
        w0.close()
        t.join(10)
        assert not t.is_alive()
        assert got["committed"] == 1 and got["waited"] >= 0.2


def test_writers_on_all_lanes_get_distinct_lanes():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=3) as buf:
        ws = [buf.writer(timeout=0) for _ in range(3)]
        assert sorted(w.lane for w in ws) == [0, 1, 2]
        with pytest.raises(shmbuf.LaneBusyError, match="3"):
            buf.writer(timeout=0)
    assert all(w.closed for w in ws)  # closing the buffer closed its writers


def test_pickling_a_buffer_reattaches_by_name():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8) as buf:
        with buf.writer() as w:
            w.extend(good_batch(3))
        clone = pickle.loads(pickle.dumps(buf))
        try:
            assert clone is not buf and clone.name == buf.name
            assert not clone.is_owner and clone.spec == buf.spec
            assert clone.get([0, 1, 2])["action"].tolist() == [0, 1, 2]
            with clone.writer() as w:
                w.add(**good_row(3))
            assert buf.get([3])["action"].tolist() == [3]
        finally:
            clone.close()
        assert os.path.exists(os.path.join("/dev/shm", buf.name))  # the clone did not unlink


def test_seqlock_never_delivers_a_row_whose_stamp_says_otherwise():
    """Readers trust a row only if its slot's stamp says "holds index i" before and after the
    copy. A slot stamped odd (being written) or stamped for another index (overwritten by i+C)
    is refused by get() and never returned by sample()."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8) as buf:
        with buf.writer() as w:
            w.extend(good_batch(8))
        stamps = buf.storage.stamps
        stamps[3] = L.stamp_writing(3)  # a writer is in the middle of index 3
        stamps[5] = L.stamp_held(13)  # index 5's slot now holds index 13
        with pytest.raises(shmbuf.StaleIndexError, match="index 3"):
            buf.get([2, 3])
        with pytest.raises(shmbuf.StaleIndexError, match="index 5"):
            buf.get([5])
        got = buf.sample(2000, rng=0)["action"]
        assert set(got.tolist()) == {0, 1, 2, 4, 6, 7}
        # With every slot unreadable, sampling gives up with a typed error instead of spinning.
        stamps[:] = 1
        del stamps  # views must be gone before close()
        with pytest.raises(shmbuf.SamplingError, match="capacity"):
            buf.sample(4)


def test_column_is_a_read_only_zero_copy_view():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=2) as buf:
        with buf.writer(lane=1) as w:
            w.extend(good_batch(3))
        col = buf.column("action")
        assert col.shape == (16,) and not col.flags.writeable
        assert col[8:11].tolist() == [0, 1, 2]
        with pytest.raises(ValueError):
            col[0] = 1
        with pytest.raises(shmbuf.SpecMismatchError):
            buf.column("nope")
        del col


def test_get_checks_lanes():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=2) as buf:
        with buf.writer(lane=1) as w:
            w.extend(good_batch(3))
        assert buf.get([0, 2], lanes=1)["action"].tolist() == [0, 2]
        assert buf.get([0, 1], lanes=[1, 1])["action"].tolist() == [0, 1]
        with pytest.raises(shmbuf.StaleIndexError, match="lane 0"):
            buf.get([0], lanes=0)
        with pytest.raises(ValueError, match="lanes"):
            buf.get([0], lanes=2)


def test_large_spec_with_a_multi_page_header():
    """A spec whose layout JSON does not fit one page still round-trips through attach."""
    spec = shmbuf.Spec({f"field_{i:03d}/with/a/long/name": ((2,), "float32") for i in range(150)})
    with shmbuf.ReplayBuffer.create(spec, capacity=4) as buf:
        assert buf._layout.header_size > L.PAGE
        with buf.writer() as w:
            w.add(**{n: np.full(2, k, np.float32) for k, n in enumerate(spec)})
        with shmbuf.ReplayBuffer.attach(buf.name) as other:
            assert other.spec == spec
            got = other.get([0])
            assert [float(got[n][0, 0]) for n in spec] == list(range(150))


def test_zero_size_field():
    spec = shmbuf.Spec(empty=((0,), "float32"), action=((), "int64"))
    with shmbuf.ReplayBuffer.create(spec, capacity=4) as buf:
        with buf.writer() as w:
            w.add(empty=np.zeros(0, np.float32), action=1)
            w.extend({"empty": np.zeros((2, 0), np.float32), "action": np.array([2, 3])})
        assert buf.get([0, 1, 2])["action"].tolist() == [1, 2, 3]
        assert buf.sample(3)["empty"].shape == (3, 0)


def test_create_and_attach_errors():
    with pytest.raises(ValueError, match="capacity"):
        shmbuf.ReplayBuffer.create(SPEC, capacity=0)
    with pytest.raises(ValueError, match="lanes"):
        shmbuf.ReplayBuffer.create(SPEC, capacity=4, lanes=0)
    with pytest.raises(ValueError, match="lanes"):
        shmbuf.ReplayBuffer.create(SPEC, capacity=4, lanes=L.MAX_LANES + 1)
    with pytest.raises(shmbuf.SegmentNotFoundError, match="shmbuf-test-nothing"):
        shmbuf.ReplayBuffer.attach("shmbuf-test-nothing")
    with shmbuf.ReplayBuffer.create(SPEC, capacity=4, name="shmbuf-test-taken") as buf:
        with pytest.raises(shmbuf.SegmentExistsError, match="shmbuf-test-taken"):
            shmbuf.ReplayBuffer.create(SPEC, capacity=4, name="shmbuf-test-taken")
        assert buf.name == "shmbuf-test-taken"
    # Not a shmbuf segment: no magic, so attach gives up after its timeout with a clear error.
    shm = posix_ipc.SharedMemory("/shmbuf-test-foreign", posix_ipc.O_CREX, mode=0o600, size=8192)
    try:
        os.write(shm.fd, b"not a shmbuf segment")
        with pytest.raises(shmbuf.SegmentFormatError, match="not an initialised"):
            shmbuf.ReplayBuffer.attach("shmbuf-test-foreign", timeout=0.05)
    finally:
        shm.close_fd()
        shm.unlink()


def test_takeover_after_a_crash_mid_extend_of_more_than_capacity_rows_shows_new_rows():
    """A writer that died inside extend() of more rows than the lane holds leaves ``reserved``
    far ahead and every slot odd: nothing older survives. The next writer's rows are whole and
    committed, so they must be readable at once, not hidden until it has written past the dead
    writer's claim."""
    spec = shmbuf.Spec(x=((), "int64"))
    with shmbuf.ReplayBuffer.create(spec, capacity=8) as buf:
        with buf.writer() as w:
            w.extend({"x": np.arange(20)})
        # Exactly what a writer SIGKILLed inside extend() of 24 rows at index 20 leaves behind:
        # its claim published, all 8 slots stamped "being written" (rows 36..43), no commit.
        buf.storage.reserved[0] = 20 + 24
        stamps = buf.storage.stamps
        stamps[:] = [L.stamp_writing(36 + (s - 36 % 8) % 8) for s in range(8)]
        del stamps
        assert len(buf) == 0  # nothing old is readable: right
        with pytest.raises(shmbuf.StaleIndexError):
            buf.get([19])
        with buf.writer() as w:
            assert w.committed == 20
            assert w.extend({"x": np.arange(20, 25)}) == range(20, 25)
        assert buf.get(np.arange(20, 25))["x"].tolist() == list(range(20, 25))
        assert len(buf) == 5
        assert set(buf.sample(64, rng=0)["x"].tolist()) <= set(range(20, 25))


class _WriterActsBetweenLoads:
    """Stands in for the ``reserved`` word array: reading it first lets a writer finish one
    extend() and claim the next, i.e. the interleaving a descheduled reader can meet between
    its loads of ``committed`` and ``reserved``."""

    def __init__(self, real: np.ndarray, act) -> None:
        self._real, self._act = real, act

    def copy(self) -> np.ndarray:
        self._act()
        return self._real.copy()

    def __getitem__(self, k):
        return self._real[k]


def test_a_reader_racing_big_extends_never_sees_a_full_lane_as_empty():
    """A lane of 64 rows is full; its writer extends 40 rows at a time (always fewer than the
    lane holds, so at least 24 rows stay readable at every instant). A reader whose two loads
    (committed, reserved) straddle the end of one extend and the claim of the next must still
    see rows, not an EmptyBufferError "holds no transitions yet"."""
    spec = shmbuf.Spec(x=((), "int64"))
    with shmbuf.ReplayBuffer.create(spec, capacity=64) as buf:
        w = buf.writer()
        w.extend({"x": np.arange(100)})

        real = buf.storage.reserved

        def writer_moves_on():
            w.extend({"x": np.arange(w.committed, w.committed + 40)})  # finishes an extend
            real[0] = w.committed + 40  # and claims the next 40 rows

        buf.storage.reserved = _WriterActsBetweenLoads(real, writer_moves_on)
        try:
            win = buf.windows()
        finally:
            buf.storage.reserved = real
        assert win.total > 0, f"window {win} is empty though >= 24 rows were held throughout"
        # The window never offers a slot under the open claim: every offered row is held.
        idx = np.arange(win.lo[0], win.hi[0])
        assert buf.storage.reserved[0] - 64 <= idx.min() and idx.max() < w.committed
        real[0] = w.committed  # the claim is dropped (nothing was written for it)
        real = None  # drop the view before the buffer closes
        w.close()


def test_a_writer_dropped_without_close_releases_its_lane():
    """Context managers are the plan, but a Writer that is garbage-collected unclosed (e.g.
    ``buf.writer().add(...)``) must not keep its lane locked, and its descriptor open, for the
    rest of the process: the process's own next writer() would get LaneBusyError naming itself."""
    import gc

    with shmbuf.ReplayBuffer.create(SPEC, capacity=8) as buf:
        gc.collect()  # earlier tests' garbage closes its descriptors now, not in the loop
        fds = len(os.listdir("/proc/self/fd"))
        for i in range(3):
            buf.writer(timeout=1.0).add(**good_row(i))
            gc.collect()
        assert len(os.listdir("/proc/self/fd")) == fds
        with buf.writer(timeout=0.5) as w:
            assert w.committed == 3


def test_writer_of_a_closed_owner_buffer_raises_closed_error():
    buf = shmbuf.ReplayBuffer.create(SPEC, capacity=8)
    w = buf.writer()
    w.add(**good_row(0))
    buf.close()
    assert w.closed
    with pytest.raises(shmbuf.ClosedError):
        w.add(**good_row(1))
    with pytest.raises(shmbuf.ClosedError):
        w.extend(good_batch(1, 1))
    with pytest.raises(shmbuf.ClosedError, match="closed"):
        buf.sample(1)
