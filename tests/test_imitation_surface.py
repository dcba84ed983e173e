"""imitation's ``Buffer`` surface on ``ReplayBuffer``: ``from_data``, ``store``, ``size``,
``sample(n)`` with its semantics and errors (empty data, unequal lengths, more rows than capacity
without ``truncate_ok``), plus ``clear``/``reset`` and ``is_full``.

Rows carry their own position (``idx``), so every read says which stored row it is.
"""

from __future__ import annotations

import numpy as np
import pytest

import shmbuf
from shmbuf.errors import EmptyBufferError, SpecMismatchError, StaleIndexError

pytestmark = pytest.mark.timeout(60)


def data(first: int, n: int) -> dict[str, np.ndarray]:
    """Rows ``first .. first+n``: ``obs`` and ``acts`` derived from ``idx``."""
    idx = np.arange(first, first + n, dtype=np.int64)
    return {
        "idx": idx,
        "obs": (idx[:, None] * 10 + np.arange(3)).astype(np.float32),
        "acts": (idx % 4).astype(np.uint8),
    }


def held(buf: shmbuf.ReplayBuffer) -> list[int]:
    """The ``idx`` of every row lane 0 holds, oldest first; each row's other fields must be the
    ones its ``idx`` implies."""
    win = buf.windows()
    rows = buf.get(np.arange(win.lo[0], win.hi[0]))
    idx = rows["idx"]
    obs = (idx[:, None] * 10 + np.arange(3)).astype(np.float32)
    np.testing.assert_array_equal(rows["obs"], obs)
    np.testing.assert_array_equal(rows["acts"], (idx % 4).astype(np.uint8))
    return idx.tolist()


# --------------------------------------------------------------------------------------------
# from_data
# --------------------------------------------------------------------------------------------
def test_from_data_infers_the_spec_and_is_full_at_the_data_size():
    with shmbuf.ReplayBuffer.from_data(data(0, 10)) as buf:
        assert buf.capacity == 10 and buf.lanes == 1
        assert buf.spec == shmbuf.Spec({"idx": ((), "int64"), "obs": ((3,), "float32"),
                                        "acts": ((), "uint8")})
        assert buf.size() == len(buf) == 10
        assert buf.is_full
        assert held(buf) == list(range(10))


def test_from_data_with_a_larger_capacity_is_not_full():
    with shmbuf.ReplayBuffer.from_data(data(0, 10), capacity=100) as buf:
        assert (buf.capacity, buf.size(), buf.is_full) == (100, 10, False)
        assert held(buf) == list(range(10))


def test_from_data_accepts_lists():
    lists = {"x": [[1, 2], [3, 4], [5, 6]], "y": [0.5, 1.5, 2.5]}
    with shmbuf.ReplayBuffer.from_data(lists) as buf:
        assert buf.spec["x"].shape == (2,) and buf.size() == 3
        np.testing.assert_array_equal(buf.get([1])["x"], [[3, 4]])


def test_from_data_with_too_small_a_capacity_needs_truncate_ok():
    """Without truncate_ok, more rows than capacity is a ValueError (and no buffer is left
    behind); with it, the last ``capacity`` rows are kept."""
    with pytest.raises(ValueError, match="truncate_ok"):
        shmbuf.ReplayBuffer.from_data(data(0, 10), capacity=4)
    with shmbuf.ReplayBuffer.from_data(data(0, 10), capacity=4, truncate_ok=True) as buf:
        assert buf.size() == 4 and buf.is_full
        assert held(buf) == [6, 7, 8, 9]


@pytest.mark.parametrize("bad, match", [
    ({}, "empty"),
    ({"idx": np.zeros(0, np.int64), "obs": np.zeros((0, 3))}, "empty"),
    ({"idx": np.arange(3), "obs": np.zeros((4, 3))}, "differ"),
], ids=["no-fields", "zero-rows", "length-mismatch"])
def test_from_data_rejects_bad_data_with_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        shmbuf.ReplayBuffer.from_data(bad)


# --------------------------------------------------------------------------------------------
# store
# --------------------------------------------------------------------------------------------
def test_store_appends_fifo_and_replaces_the_oldest():
    with shmbuf.ReplayBuffer.from_data(data(0, 3), capacity=6) as buf:
        buf.store(data(3, 2))
        assert held(buf) == [0, 1, 2, 3, 4] and not buf.is_full
        buf.store(data(5, 3))
        assert held(buf) == [2, 3, 4, 5, 6, 7] and buf.is_full
        assert buf.size() == 6


def test_store_more_rows_than_capacity():
    """n > capacity: ValueError without truncate_ok and nothing changes; with it, only the last
    ``capacity`` rows are stored."""
    with shmbuf.ReplayBuffer.from_data(data(0, 2), capacity=4) as buf:
        with pytest.raises(ValueError, match="truncate_ok"):
            buf.store(data(2, 5))
        assert held(buf) == [0, 1]
        buf.store(data(2, 5), truncate_ok=True)
        assert held(buf) == [3, 4, 5, 6]
        buf.store(data(7, 4))  # exactly capacity: fine without truncate_ok
        assert held(buf) == [7, 8, 9, 10]


@pytest.mark.parametrize("bad, error, match", [
    ({}, ValueError, "empty"),
    ({k: v[:0] for k, v in data(0, 2).items()}, ValueError, "empty"),
    ({**data(0, 2), "obs": np.zeros((3, 3), np.float32)}, ValueError, "differ"),
    ({**data(0, 2), "obs": np.zeros((2, 4), np.float32)}, SpecMismatchError, "obs"),
    ({k: v for k, v in data(0, 2).items() if k != "acts"}, SpecMismatchError, "acts"),
], ids=["no-fields", "zero-rows", "length-mismatch", "wrong-shape", "missing-field"])
def test_store_rejects_bad_data_and_changes_nothing(bad, error, match):
    """imitation raises ValueError for empty data, unequal lengths and wrong shapes: so does
    store (SpecMismatchError is a ValueError)."""
    with shmbuf.ReplayBuffer.from_data(data(0, 3), capacity=8) as buf:
        with pytest.raises(error, match=match):
            buf.store(bad)
        assert issubclass(error, ValueError)
        assert held(buf) == [0, 1, 2]


def test_store_into_a_created_buffer():
    spec = shmbuf.Spec({"idx": ((), "int64"), "obs": ((3,), "float32"), "acts": ((), "uint8")})
    with shmbuf.ReplayBuffer.create(spec, capacity=5) as buf:
        assert buf.size() == 0 and not buf.is_full
        buf.store(data(0, 2))
        buf.store(data(2, 1))
        assert held(buf) == [0, 1, 2]


# --------------------------------------------------------------------------------------------
# sample
# --------------------------------------------------------------------------------------------
def test_sample_returns_n_held_rows_with_replacement():
    with shmbuf.ReplayBuffer.from_data(data(0, 10), capacity=4, truncate_ok=True) as buf:
        batch = buf.sample(1000)
        assert set(batch) == {"idx", "obs", "acts"}
        assert batch["obs"].shape == (1000, 3) and batch["acts"].dtype == np.uint8
        assert set(batch["idx"].tolist()) == {6, 7, 8, 9}  # with replacement: all, repeatedly
        np.testing.assert_array_equal(batch["obs"], data(0, 10)["obs"][batch["idx"]])
        small = buf.sample(2)
        assert small["idx"].shape == (2,)


def test_sample_of_an_empty_buffer_is_a_value_error():
    spec = shmbuf.Spec({"x": ((), "float32")})
    with shmbuf.ReplayBuffer.create(spec, capacity=4) as buf:
        with pytest.raises(ValueError, match="no transitions"):
            buf.sample(1)
        assert issubclass(EmptyBufferError, ValueError)


def test_sample_rejects_a_bad_count():
    with shmbuf.ReplayBuffer.from_data(data(0, 3)) as buf:
        for n in (0, -1, 1.5):
            with pytest.raises(ValueError):
                buf.sample(n)


# --------------------------------------------------------------------------------------------
# clear / reset / is_full
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["clear", "reset"])
def test_clear_empties_every_lane_and_old_indices_go_stale(method):
    """After clear() (reset is the same) the buffer is empty, sampling is a ValueError, old
    logical indices are stale, and new rows get indices after the old ones (never reused)."""
    with shmbuf.ReplayBuffer.from_data(data(0, 6), capacity=6) as buf:
        assert buf.is_full
        getattr(buf, method)()
        assert (buf.size(), len(buf), buf.is_full) == (0, 0, False)
        with pytest.raises(ValueError):
            buf.sample(1)
        with pytest.raises(StaleIndexError):
            buf.get([5])
        buf.store(data(100, 2))
        win = buf.windows()
        assert (int(win.lo[0]), int(win.hi[0])) == (6, 8)  # indices keep growing
        assert buf.get([6, 7])["idx"].tolist() == [100, 101]
        assert set(buf.sample(200)["idx"].tolist()) == {100, 101}
        buf.store(data(102, 5))
        assert held(buf) == [101, 102, 103, 104, 105, 106] and buf.is_full


def test_clear_of_a_multi_lane_buffer_and_is_full_needs_every_lane_full():
    spec = shmbuf.Spec({"x": ((), "int64")})
    with shmbuf.ReplayBuffer.create(spec, capacity=3, lanes=2) as buf:
        with buf.writer(lane=0) as w:
            w.extend({"x": np.arange(5)})
        assert not buf.is_full and buf.size() == 3
        with buf.writer(lane=1) as w:
            w.extend({"x": np.arange(3)})
        assert buf.is_full and buf.size() == 6
        buf.clear()
        assert buf.size() == 0 and buf.committed().tolist() == [5, 3]
        with buf.writer(lane=1) as w:
            assert w.add(x=7) == 3
        assert buf.size() == 1 and buf.get([3], 1)["x"].tolist() == [7]


def test_clear_with_a_live_writer_of_another_handle_empties_its_lane_under_it():
    """clear() works while another handle holds a writer: the lane's floor is set to its
    committed count, so its rows are gone at once, and what the writer adds next (it is neither
    closed nor waited for) is held as usual. (store()'s own writer is released by clear().)"""
    spec = shmbuf.Spec({"idx": ((), "int64"), "obs": ((3,), "float32"), "acts": ((), "uint8")})
    with shmbuf.ReplayBuffer.create(spec, capacity=4) as buf:
        other = shmbuf.ReplayBuffer.attach(buf.name)
        try:
            with other.writer(lane=0) as w:
                w.extend(data(0, 3))
                buf.clear(timeout=0.1)
                assert buf.size() == 0 and held(buf) == [] and len(other) == 0
                with pytest.raises(StaleIndexError):
                    buf.get([2])
                w.extend(data(3, 2))  # the writer goes on at its index: only these are held
                assert held(buf) == [3, 4] and buf.committed(0) == 5
        finally:
            other.close()
        buf.store(data(5, 1))
        buf.clear()
        assert buf.size() == 0
        buf.store(data(6, 1))  # store() opens its writer again after clear()
        assert held(buf) == [6]
