"""Issue 8, hardening of values: narrowing (items 2, 4), derived-next_obs recording (12),
episode records (15), priority bounds (15) and output recycling (16).

Every refused value must raise ``SpecMismatchError`` before the first byte of the segment
changes; the tests compare the segment's bytes before and after.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest

import shmbuf
from shmbuf.priority import PriorityTable

SPEC = shmbuf.Spec(
    small=((), "int8"),
    u8=((), "uint8"),
    i64=((), "int64"),
    half=((), "float16"),
    f32=((), "float32"),
    c64=((), "complex64"),
    vec=((3,), "float16"),
    ivec=((2,), "int8"),
)


def good_row(i: int) -> dict:
    return {"small": i % 100, "u8": i % 200, "i64": i, "half": float(i), "f32": float(i),
            "c64": complex(i, -i), "vec": np.full(3, i, np.float16),
            "ivec": np.array([i % 100, -(i % 100)], np.int8)}


def good_batch(n: int, start: int = 0) -> dict:
    i = np.arange(start, start + n)
    return {"small": (i % 100).astype(np.int8), "u8": (i % 200).astype(np.uint8), "i64": i,
            "half": i.astype(np.float16), "f32": i.astype(np.float32),
            "c64": (i - 1j * i).astype(np.complex64),
            "vec": np.repeat(i[:, None], 3, axis=1).astype(np.float16),
            "ivec": np.stack([i % 100, -(i % 100)], axis=1).astype(np.int8)}


def snapshot(buf: shmbuf.ReplayBuffer) -> bytes:
    """Every byte of the segment: header, lane words, stamps, meta, columns, episode table."""
    with open(os.path.join("/dev/shm", buf.name), "rb") as f:
        return f.read()


@pytest.fixture
def wrapped():
    """Lane 0 has wrapped (6 rows in a ring of 4) and its writer is open: the next slot holds
    the lane's oldest live row, which any partial write would destroy."""
    buf = shmbuf.ReplayBuffer.create(SPEC, capacity=4, lanes=1)
    w = buf.writer()
    for i in range(6):
        w.add(**good_row(i))
    yield buf, w
    w.close()
    buf.close()


def _refused_changes_nothing(buf, call) -> str:
    """``call`` raises SpecMismatchError, no RuntimeWarning even with warnings as errors, and
    not one byte of the segment changes (len stays, the oldest row is intact). Returns the
    message (not the exception: its traceback holds the writer's views of the segment)."""
    before, n, oldest = snapshot(buf), len(buf), buf.get([buf.windows().lo[0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(shmbuf.SpecMismatchError) as info:
            call()
    msg = str(info.value)
    del info
    assert snapshot(buf) == before
    assert len(buf) == n
    after = buf.get([buf.windows().lo[0]])
    assert all(np.array_equal(after[k], oldest[k]) for k in oldest)
    return msg


def _add_is_refused(buf, w, field: str, value) -> str:
    """``w.add`` of a good row with ``field`` set to ``value`` is refused as above, with a
    message naming the field, its dtype and a fix. Returns the message."""
    row = good_row(6)
    row[field] = value
    msg = _refused_changes_nothing(buf, lambda: w.add(**row))
    assert repr(field) in msg and str(buf.spec[field].dtype) in msg and "Fix" in msg
    return msg


# --------------------------------------------------------------------------------------------
# Item 2: out-of-range NumPy integers (scalars and arrays) are refused before any store
# --------------------------------------------------------------------------------------------
INT_OUT_OF_RANGE = [
    ("small", np.int64(300)),
    ("small", np.int16(-200)),
    ("small", np.int64(-2**63)),
    ("small", np.uint64(2**64 - 1)),
    ("small", np.array(300, np.int64)),
    ("small", np.array(-129, np.int32)),
    ("u8", np.uint16(256)),
    ("u8", np.uint64(2**64 - 1)),
    ("i64", np.uint64(2**63)),
    ("ivec", np.array([1, 128], np.int64)),
    ("ivec", np.array([1, -2**63], np.int64)),
    ("ivec", [1, 300]),
    ("small", 128),
    ("u8", -1),
]


@pytest.mark.parametrize("field,value", INT_OUT_OF_RANGE,
                         ids=[f"{f}-{v!r}" for f, v in INT_OUT_OF_RANGE])
def test_out_of_range_integer_is_refused_by_add_before_any_store(wrapped, field, value):
    buf, w = wrapped
    msg = _add_is_refused(buf, w, field, value)
    info = np.iinfo(buf.spec[field].dtype)
    bad = [int(x) for x in np.asarray(value).reshape(-1) if not info.min <= int(x) <= info.max]
    assert f"cannot hold {bad[0]}:" in msg and f"[{info.min}, {info.max}]" in msg
    assert w.add(**good_row(6)) == 6  # the writer goes on at the same index


@pytest.mark.parametrize("field,values", [
    ("small", np.array([1, 2, 300], np.int64)),
    ("u8", np.array([0, 256], np.uint16)),
    ("i64", np.array([0, 2**63], np.uint64)),
    ("small", np.array([0, -2**63], np.int64)),
])
def test_out_of_range_integer_array_is_refused_by_extend(wrapped, field, values):
    buf, w = wrapped
    batch = good_batch(values.shape[0], start=6)
    batch[field] = values
    _refused_changes_nothing(buf, lambda: w.extend(batch))


def test_numpy_integer_in_range_is_stored_exactly(wrapped):
    buf, w = wrapped
    row = good_row(6)
    row.update(small=np.int64(-128), u8=np.uint64(255), i64=np.uint64(2**63 - 1),
               ivec=np.array([127, -128], np.int64))
    i = w.add(**row)
    got = buf.get([i])
    assert (int(got["small"][0]), int(got["u8"][0]), int(got["i64"][0])) == (-128, 255, 2**63 - 1)
    assert got["ivec"][0].tolist() == [127, -128]


def _derived(episode_spec=None, obs_dtype="int8"):
    spec = shmbuf.Spec(obs=((2,), obs_dtype), action=((), "int64"))
    return shmbuf.ReplayBuffer.create(spec, capacity=4, next_obs="derived",
                                      episode_spec=episode_spec)


def _final_rows(buf) -> int:
    win = buf.windows()
    idx = np.arange(win.lo[0], win.hi[0])
    return int(buf.get(idx, with_episode=True)["_final"].sum())


def test_derived_end_episode_refuses_episode_data_before_the_final_row():
    """The reported case: end_episode(small=np.int64(300)) into an int8 episode field used to
    commit the FINAL row, then raise mid-write, leaving the episode open; every retry committed
    another FINAL row."""
    with _derived(episode_spec=shmbuf.Spec(small=((), "int8"))) as buf, buf.writer() as w:
        for i in range(5):  # wrapped: the next slot holds a live row
            w.add(obs=np.array([i, i], np.int8), action=i, next_obs=np.array([i + 1] * 2, np.int8))
        committed, episode = w.committed, w.episode
        for _ in range(2):  # a retry of the bad call changes nothing either
            _refused_changes_nothing(buf, lambda: w.end_episode(small=np.int64(300)))
        assert (w.committed, w.episode, w.step) == (committed, episode, 5)
        assert _final_rows(buf) == 0
        assert w.end_episode(small=np.int64(-7)) == episode  # the good retry: one FINAL row
        assert w.committed == committed + 1 and _final_rows(buf) == 1
        rec = buf.episode(episode)
        assert (rec["length"], rec["small"]) == (5, -7)


def test_derived_add_refuses_an_out_of_range_next_obs():
    """A derived buffer keeps next_obs for the FINAL row: an out-of-range one used to be stored
    wrapped (300 -> 44) after the row was committed."""
    with _derived() as buf, buf.writer() as w:
        for i in range(5):
            w.add(obs=np.array([i, i], np.int8), action=i, next_obs=np.array([i + 1] * 2, np.int8))
        _refused_changes_nothing(buf, lambda: w.add(obs=np.array([5, 5], np.int8), action=5,
                                                    next_obs=np.array([6, 300], np.int64)))
        w.add(obs=np.array([5, 5], np.int8), action=5, next_obs=np.array([6, 7], np.int64))
        w.end_episode()
        final = buf.get([w.committed - 1], with_episode=True)
        assert final["_final"][0] and final["obs"][0].tolist() == [6, 7]


def test_vector_writer_refuses_out_of_range_integers_before_any_store():
    spec = shmbuf.Spec(small=((), "int8"), obs=((2,), "int8"))
    with shmbuf.ReplayBuffer.create(spec, capacity=4, lanes=2, next_obs="derived",
                                    episode_spec=shmbuf.Spec(ret=((), "int8"))) as buf, \
            buf.writer(num_envs=2) as w:
        for i in range(5):
            w.add(small=np.array([i, i], np.int8), obs=np.full((2, 2), i, np.int8),
                  next_obs=np.full((2, 2), i + 1, np.int8))
        _refused_changes_nothing(buf, lambda: w.add(
            small=np.array([1, 300], np.int64), obs=np.zeros((2, 2), np.int8),
            next_obs=np.zeros((2, 2), np.int8)))
        _refused_changes_nothing(buf, lambda: w.end_episode([True, True], ret=np.array([1, 300])))
        assert w.end_episode([True, True], ret=np.array([1, -3])).tolist() == [0, 0]
        assert [buf.episode(0, lane)["ret"] for lane in w.lanes.tolist()] == [1, -3]


# --------------------------------------------------------------------------------------------
# Item 4: one narrowing rule for floats, for arrays, NumPy scalars and Python numbers alike
# --------------------------------------------------------------------------------------------
FLOAT_OVERFLOW = [
    ("half", 70000),
    ("half", np.int64(70000)),
    ("half", np.int64(-2**63)),
    ("half", np.uint64(2**64 - 1)),
    ("half", 65520.0),  # the first value float16 rounds to inf
    ("half", -np.float32(65520.0)),
    ("half", np.array(-1e6)),
    ("f32", 2**200),
    ("f32", -2**200),
    ("f32", 10**400),  # does not even fit a float64
    ("f32", np.float64(-1e300)),
    ("c64", np.float64(1e300)),
    ("c64", 1e300),
    ("c64", np.complex128(1e300j)),
    ("c64", complex(1.0, -1e300)),
    ("c64", np.array(1e300)),
    ("vec", np.array([1.0, 70000.0, 2.0])),
    ("vec", np.array([1, -70000, 2], np.int32)),
    ("vec", [1.0, 2.0, -1e5]),
]


@pytest.mark.parametrize("field,value", FLOAT_OVERFLOW,
                         ids=[f"{f}-{type(v).__name__}" for f, v in FLOAT_OVERFLOW])
def test_finite_value_a_float_field_would_turn_into_inf_is_refused(wrapped, field, value):
    _add_is_refused(*wrapped, field, value)


def test_float_overflow_in_extend_is_refused_including_complex(wrapped):
    buf, w = wrapped
    for field, values in [("c64", np.array([0, 1e300])), ("half", np.array([0, 70000])),
                          ("c64", np.array([0, 1e300j])), ("f32", np.array([1.0, -1e39]))]:
        batch = good_batch(2, start=6)
        batch[field] = values
        _refused_changes_nothing(buf, lambda b=batch: w.extend(b))


NON_FINITE = [float("inf"), float("-inf"), float("nan"), np.float64("inf"), np.float64("-inf"),
              np.float32("-inf"), np.array(-np.inf), np.array(np.nan)]


@pytest.mark.parametrize("field", ["half", "f32", "c64"])
@pytest.mark.parametrize("value", NON_FINITE, ids=[repr(v) for v in NON_FINITE])
def test_non_finite_input_is_stored_as_given_and_plus_minus_inf_alike(wrapped, field, value):
    buf, w = wrapped
    row = good_row(6)
    row[field] = value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        i = w.add(**row)
    got = complex(buf.get([i])[field][0]).real
    want = float(np.asarray(value))
    assert (np.isnan(got) and np.isnan(want)) or got == want


def test_values_that_round_to_the_largest_finite_value_are_stored(wrapped):
    """The rule is "finite stays finite", not "at most max": 65519 rounds to float16's 65504."""
    buf, w = wrapped
    row = good_row(6)
    row.update(half=65519.0, f32=np.float64(3.4028235e38), vec=np.array([-65519, 0, 1], np.int32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        i = w.add(**row)
    got = buf.get([i])
    assert float(got["half"][0]) == 65504.0 and np.isfinite(got["f32"][0])
    assert got["vec"][0].tolist() == [-65504.0, 0.0, 1.0]


DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]


def _extremes(dt: np.dtype) -> list:
    if dt.kind == "b":
        return [True, False]
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return [info.min, info.max, 0]
    part = np.finfo(dt)
    vals = [part.max, -part.max, np.inf, -np.inf, np.nan, 1.0]
    return vals + ([complex(part.max, -part.max), complex(np.inf, np.nan)] if dt.kind == "c" else [])


def _fits(arr0: np.ndarray, tdt: np.dtype) -> bool:
    """The rule, computed independently of shmbuf: integers must fit the target's range;
    every finite component must stay finite after the cast into a float or complex target."""
    if tdt.kind in "iu":
        return bool(np.iinfo(tdt).min <= int(arr0) <= np.iinfo(tdt).max)
    if tdt.kind == "b":
        return True
    with np.errstate(all="ignore"):
        cast = arr0.astype(tdt)
    parts_in = [arr0.real, arr0.imag] if arr0.dtype.kind == "c" else [arr0]
    parts_out = [cast.real, cast.imag] if tdt.kind == "c" else [cast]
    return all(np.isfinite(b) or not np.isfinite(a) for a, b in zip(parts_in, parts_out))


@pytest.mark.parametrize("target", DTYPES)
def test_every_dtype_pair_either_stores_exactly_or_refuses_without_a_warning(target):
    """Under warnings-as-errors (``python -W error``), no value of any source dtype, given as
    an array, a NumPy scalar or a Python number, makes a store warn: it is either refused
    before the store (segment unchanged) or stored as NumPy's cast gives it, with a finite value
    staying finite and an integer exact."""
    tdt = np.dtype(target)
    spec = shmbuf.Spec(x=((), target), v=((2,), target))
    zero = np.zeros((), tdt)[()]
    with shmbuf.ReplayBuffer.create(spec, capacity=4) as buf, buf.writer() as w:
        for _ in range(4):  # full: a partial write would destroy a live row
            w.add(x=zero, v=np.zeros(2, tdt))
        for source in DTYPES:
            sdt = np.dtype(source)
            if not np.can_cast(sdt, tdt, "same_kind"):
                continue
            for raw in _extremes(sdt):
                arr0 = np.array(raw, dtype=sdt)
                vec = np.array([raw, raw], dtype=sdt)
                fits = _fits(arr0, tdt)
                for given in (arr0[()], arr0, arr0.item()):
                    where = (source, raw, type(given).__name__)
                    before = snapshot(buf)
                    with warnings.catch_warnings():
                        warnings.simplefilter("error")
                        if not fits:
                            with pytest.raises(shmbuf.SpecMismatchError):
                                w.add(x=given, v=np.zeros(2, tdt))
                            with pytest.raises(shmbuf.SpecMismatchError):
                                w.add(x=zero, v=vec)
                            with pytest.raises(shmbuf.SpecMismatchError):
                                w.extend({"x": vec, "v": np.stack([vec, vec])})
                            assert snapshot(buf) == before, where
                            continue
                        i = w.add(x=given, v=vec)
                        j = w.extend({"x": vec, "v": np.stack([vec, vec])})[-1]
                    with np.errstate(all="ignore"):
                        want = arr0.astype(tdt)
                    got = buf.get([i, j])
                    for stored in (got["x"][0], got["v"][0][1], got["x"][1], got["v"][1][0]):
                        same = (stored == want) | (np.isnan(stored) & np.isnan(want))
                        if tdt.kind == "c":
                            same = all(a == b or (np.isnan(a) and np.isnan(b)) for a, b in
                                       [(stored.real, want.real), (stored.imag, want.imag)])
                        assert same, (*where, stored, want)


# --------------------------------------------------------------------------------------------
# Item 12: RecordEpisodes into a next_obs="derived" buffer
# --------------------------------------------------------------------------------------------
def test_record_episodes_into_a_derived_buffer_stores_obs_and_next_obs():
    gym = pytest.importorskip("gymnasium")
    from shmbuf.recording import RecordEpisodes

    env = gym.make("CartPole-v1")
    spec = shmbuf.Spec.from_spaces(env.observation_space, env.action_space, next_obs=False)
    with shmbuf.ReplayBuffer.create(spec, capacity=2000, next_obs="derived") as buf:
        rec = RecordEpisodes(env, buf)
        steps = []  # (obs, action, next_obs, reward, terminated, truncated) as the env gave them
        rng = np.random.default_rng(0)
        for ep in range(3):
            obs, _ = rec.reset(seed=ep)
            done = False
            while not done:
                action = int(rng.integers(2))
                nxt, reward, terminated, truncated, _ = rec.step(action)
                steps.append((obs.copy(), action, nxt.copy(), reward, terminated, truncated))
                obs, done = nxt, terminated or truncated
        rec.close()
        # Each episode: its steps, then one FINAL row (never sampled as a transition).
        assert buf.committed(0) == len(steps) + 3
        rows = buf.get(np.arange(buf.committed(0)), with_episode=True)
        transitions = np.flatnonzero(~rows["_final"])
        assert transitions.size == len(steps)
        batch = buf.sample(64, rng=1)
        for name in ("obs", "next_obs", "action", "reward", "terminated", "truncated"):
            assert name in batch
        by_obs = {tuple(s[0].tolist()): s for s in steps}
        for k in range(64):
            s = by_obs[tuple(batch["obs"][k].tolist())]
            assert batch["next_obs"][k].tolist() == s[2].tolist()
            assert batch["action"][k] == s[1] and batch["reward"][k] == np.float32(s[3])
        for j, r in enumerate(transitions):
            s = steps[j]
            assert rows["obs"][r].tolist() == s[0].tolist() and rows["action"][r] == s[1]
            assert rows["obs"][r + 1].tolist() == s[2].tolist()  # next row: next_obs or FINAL


# --------------------------------------------------------------------------------------------
# Item 15: episode ids, clear(), priorities that would overflow the sum tree
# --------------------------------------------------------------------------------------------
def _episodes_buffer(lanes: int = 1):
    spec = shmbuf.Spec(obs=((), "float32"))
    return shmbuf.ReplayBuffer.create(spec, capacity=16, lanes=lanes,
                                      episode_spec=shmbuf.Spec(ret=((), "float32")))


@pytest.mark.parametrize("episode_id", [-1, -2, -65, -2**62, 2**62, 2**63, 2**70])
def test_episode_with_an_impossible_id_is_an_error_not_a_made_up_record(episode_id):
    with _episodes_buffer() as buf:
        with buf.writer() as w:
            w.add(obs=1.0)
            w.end_episode(ret=3.0)
        assert buf.episode(0)["ret"] == 3.0
        with pytest.raises((shmbuf.StaleIndexError, ValueError), match=str(episode_id)):
            buf.episode(episode_id)


def test_episode_never_written_is_stale():
    with _episodes_buffer() as buf:
        for e in (0, 1, 63, 64):
            with pytest.raises(shmbuf.StaleIndexError, match=f"episode {e} of lane 0"):
                buf.episode(e)


def test_clear_drops_the_episode_records_of_the_rows_it_empties():
    with _episodes_buffer(lanes=2) as buf:
        for lane in (0, 1):
            with buf.writer(lane=lane) as w:
                for e in range(3):
                    w.add(obs=float(e))
                    w.end_episode(ret=float(10 * lane + e))
        assert len(buf.episodes()["episode"]) == 6
        buf.clear()
        assert len(buf) == 0
        assert len(buf.episodes()["episode"]) == 0
        for lane, e in [(0, 0), (0, 2), (1, 1)]:
            with pytest.raises(shmbuf.StaleIndexError):
                buf.episode(e, lane)
        with buf.writer(lane=0) as w:  # later episodes work: ids go on, records readable
            w.add(obs=7.0)
            w.add(obs=8.0)
            assert w.end_episode(ret=42.0) == 3
        rec = buf.episode(3, 0)
        assert (rec["ret"], rec["length"]) == (42.0, 2)
        assert buf.get([rec["start"]])["obs"][0] == 7.0
        held = buf.episodes()
        assert held["episode"].tolist() == [3] and held["lane"].tolist() == [0]


def _priority_buffer(rows: int = 8, lanes: int = 1):
    buf = shmbuf.ReplayBuffer.create(shmbuf.Spec(x=((), "int64")), capacity=8, lanes=lanes)
    for lane in range(lanes):
        with buf.writer(lane=lane) as w:
            w.extend({"x": np.arange(rows)})
    return buf


@pytest.mark.parametrize("priority", [1e308, 1.7e308, 1e307, 6e306])
def test_priority_that_would_overflow_the_sum_tree_is_refused(priority):
    """alpha=1: priorities near 1e308 made the root sum inf, and then every draw landed on one
    row. Refused (InvalidPriorityError, nothing applied), with the largest allowed value."""
    with _priority_buffer(lanes=2) as buf:
        table = PriorityTable.create(buf, alpha=1.0, eps=0.0)
        try:
            table.sync(buf)
            sums_before, mins_before = table.sums.copy(), table.mins.copy()
            lanes, idx = np.array([0, 1]), np.array([3, 5])
            with pytest.raises(shmbuf.InvalidPriorityError, match="at most"):
                table.update(lanes, idx, [1.0, priority])
            assert np.array_equal(table.sums, sums_before)
            assert np.array_equal(table.mins, mins_before)
            assert table.max_priority == 1.0
        finally:
            table.close()


def test_largest_allowed_priority_keeps_every_sum_finite_after_sync():
    """A priority at the bound is accepted; rows that enter later at that maximum priority
    (sync) still leave every sum finite, and draws follow the priorities."""
    with _priority_buffer(rows=8, lanes=2) as buf:
        table = PriorityTable.create(buf, alpha=1.0, eps=0.0)
        try:
            table.sync(buf)
            with pytest.raises(shmbuf.InvalidPriorityError) as info:
                table.update([0], [0], [1e308])
            limit = float(str(info.value).split("at most ")[1].split()[0].rstrip(",;."))
            assert table.update([0], [0], [limit]) == 1
            table.update([0, 1], [1, 2], [0.0, 0.0])
            assert np.isfinite(table.sums).all()
            with buf.writer(lane=1) as w:
                w.extend({"x": np.arange(8)})  # overwrites lane 1: enters at max priority
            table.sync(buf)
            assert np.isfinite(table.sums).all() and np.isfinite(table.total())
            draw = table.draw(buf.windows(), 4000, np.random.default_rng(0))
            assert len(set(zip(draw.lanes.tolist(), draw.indices.tolist()))) > 4
        finally:
            table.close()


def test_priority_overflow_after_alpha_is_refused():
    """With alpha > 1 even a moderate priority overflows once raised to alpha."""
    with _priority_buffer() as buf:
        table = PriorityTable.create(buf, alpha=2.0, eps=0.0)
        try:
            table.sync(buf)
            with pytest.raises(shmbuf.InvalidPriorityError):
                table.update([0], [0], [1e200])
            assert table.update([0], [0], [1e100]) == 1
        finally:
            table.close()


# --------------------------------------------------------------------------------------------
# Item 16: a batch the caller holds is never handed out again
# --------------------------------------------------------------------------------------------
ATARI = shmbuf.Spec(obs=((4, 84, 84), "uint8"), action=((), "int64"))


@pytest.fixture
def atari():
    buf = shmbuf.ReplayBuffer.create(ATARI, capacity=64)
    with buf.writer() as w:
        n = 64
        obs = np.repeat(np.arange(n, dtype=np.uint8)[:, None], 4 * 84 * 84, axis=1)
        w.extend({"obs": obs.reshape(n, 4, 84, 84), "action": np.arange(n)})
    yield buf
    buf.close()


def _take_more(buf, n: int = 12) -> None:
    for k in range(n):
        b = buf.sample(256, rng=k + 100)  # dropped at once: free to be recycled
        assert b["obs"].shape == (256, 4, 84, 84)
        del b


def test_a_held_batch_is_never_overwritten_by_later_samples(atari):
    held = atari.sample(256, rng=0)
    copy = {k: v.copy() for k, v in held.items()}
    kept = [atari.sample(256, rng=k) for k in range(1, 6)]  # more held batches
    _take_more(atari)
    assert all(np.array_equal(held[k], copy[k]) for k in copy)
    for b in kept:
        assert not np.shares_memory(b["obs"], held["obs"])
    addresses = {b["obs"].__array_interface__["data"][0] for b in [held, *kept]}
    assert len(addresses) == 1 + len(kept)


@pytest.mark.parametrize("hold", ["slice", "row", "reshape", "transpose", "memoryview", "torch"])
def test_holding_only_a_view_of_a_field_keeps_it_from_being_recycled(atari, hold):
    batch = atari.sample(256, rng=0)
    obs = batch["obs"]
    kept: object
    if hold == "slice":
        kept = obs[10:20, 1:]
    elif hold == "row":
        kept = obs[3]
    elif hold == "reshape":
        kept = obs.reshape(256, -1)[:, ::7]
    elif hold == "transpose":
        kept = obs.T
    elif hold == "memoryview":
        kept = memoryview(obs)
    else:
        torch = pytest.importorskip("torch")
        kept = torch.from_numpy(obs)[5:9]
    def as_array() -> np.ndarray:
        return kept.numpy() if hold == "torch" else np.asarray(kept)

    expected = as_array().copy()
    del batch, obs
    _take_more(atari)
    assert np.array_equal(as_array(), expected)


def test_recycling_does_not_depend_on_the_interpreters_reference_counts(atari, monkeypatch):
    """Python 3.14 borrows references on the stack, so ``sys.getrefcount`` reads one lower
    than on 3.11 for the same live objects. Simulate that: a held batch must stay intact."""
    real = sys.getrefcount
    monkeypatch.setattr(sys, "getrefcount", lambda obj: real(obj) - 2)
    held = atari.sample(256, rng=0)
    copy = held["obs"].copy()
    _take_more(atari)
    other = atari.sample(256, rng=1)
    assert not np.shares_memory(other["obs"], held["obs"])
    assert np.array_equal(held["obs"], copy)


def test_dropped_batches_are_recycled(atari):
    """The point of recycling: a batch dropped by the caller lends its memory to a later one."""
    addresses = set()
    for k in range(20):
        b = atari.sample(256, rng=k)
        addresses.add(b["obs"].__array_interface__["data"][0])
        del b
    assert len(addresses) <= 2


# --------------------------------------------------------------------------------------------
# Issue 30: an array of any memory layout is a value like any other (the one rule), in add,
# extend and vector writers, compiled store or not; its rows hold exactly its values
# --------------------------------------------------------------------------------------------
LAYOUT_SPEC = shmbuf.Spec(hwc=((84, 84, 3), "uint8"), chw=((3, 84, 84), "uint8"),
                          vec=((4, 5), "float32"), ids=((6,), "int16"), r=((), "float32"))


@pytest.fixture(params=["compiled", "numpy"])
def store_path(request, monkeypatch):
    """Writers with the compiled store (``_add_c``; skipped where it was not built), or with
    the NumPy one, as where no compiler was at hand."""
    from shmbuf import store

    if request.param == "compiled" and store.CompiledStore is None:
        pytest.skip("_add_c was not built")
    if request.param == "numpy":
        monkeypatch.setattr(store, "CompiledStore", None)
        monkeypatch.setattr(store, "CompiledAdd", None)
    return request.param


def _laid_out(x: np.ndarray, layout: str, lead: int) -> np.ndarray:
    """An array equal to ``x`` (its first ``lead`` axes: rows, envs) in memory laid out as
    ``layout`` says: a view whose strides are not C-contiguous (contiguous: the control)."""
    row_axes = tuple(range(lead, x.ndim))
    if layout == "contiguous":
        return x.copy()
    if layout == "reversed last axis":  # np.ones((84, 84, 3))[..., ::-1]
        return x[..., ::-1].copy()[..., ::-1]
    if layout == "negative strides" or layout == "transposed" and len(row_axes) < 2:
        # every axis reversed (a row of one axis has nothing to transpose)
        flip = (slice(None, None, -1),) * x.ndim
        return x[flip].copy()[flip]
    if layout == "transposed":  # SB3's VecTransposeImage: HWC frames seen as CHW
        perm = (*range(lead), *row_axes[1:], row_axes[0])  # the first row axis last ...
        back = np.argsort(perm)
        return x.transpose(perm).copy().transpose(back)  # ... and back: a permuted view
    if layout == "fortran order":
        return np.asfortranarray(x)
    if layout == "every other item":
        wide = np.zeros((*x.shape, 2), x.dtype)
        wide[..., 0] = x
        return wide[..., 0]
    if layout == "broadcast":  # stride 0: the same row (or item) repeated
        return np.broadcast_to(x[..., :1] if x.ndim > lead else x, x.shape)
    raise AssertionError(layout)


LAYOUTS = ["contiguous", "reversed last axis", "negative strides", "transposed", "fortran order",
           "every other item", "broadcast"]


def _values(rng: np.random.Generator, lead: tuple[int, ...], layout: str,
            cast: bool = False) -> dict[str, np.ndarray]:
    out = {}
    for name, f in LAYOUT_SPEC.items():
        x = (rng.random((*lead, *f.shape)) * 100).astype(f.dtype)
        if cast and f.dtype.kind == "i":  # a safe cast as well as a layout
            x = x.astype(np.int8)
        out[name] = _laid_out(x, layout, len(lead)) if x.ndim else x
    assert (layout == "contiguous") != any(not v.flags.c_contiguous for v in out.values())
    return out


def _assert_rows(buf: shmbuf.ReplayBuffer, indices: np.ndarray, lanes: np.ndarray | int,
                 given: list[dict[str, np.ndarray]]) -> None:
    rows = buf.get(indices, lanes)
    for j, values in enumerate(given):
        for name, v in values.items():
            np.testing.assert_array_equal(rows[name][j], v, err_msg=f"{name} row {j}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_add_stores_arrays_of_any_layout_as_their_values(layout, store_path):
    rng = np.random.default_rng(LAYOUTS.index(layout))
    with shmbuf.ReplayBuffer.create(LAYOUT_SPEC, capacity=4) as buf, buf.writer() as w:
        given = []
        for i in range(6):  # around the ring
            row = _values(rng, (), layout, cast=i % 2 == 1)
            assert w.add(**row) == i
            given.append(row)
        _assert_rows(buf, np.arange(2, 6), 0, given[2:])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_extend_stores_batches_of_any_layout_as_their_values(layout, store_path):
    """Batches crossing the ring's end and longer than the ring: the rows kept hold the
    batch's rows, however the batch is laid out (the batch axis included)."""
    rng = np.random.default_rng(10 + LAYOUTS.index(layout))
    with shmbuf.ReplayBuffer.create(LAYOUT_SPEC, capacity=8) as buf, buf.writer() as w:
        at = 0
        for n, cast in ((5, False), (6, True), (11, False)):
            batch = _values(rng, (n,), layout, cast)
            assert w.extend(batch) == range(at, at + n)
            at += n
            keep = min(n, 8)
            rows = [{k: v[j] for k, v in batch.items()} for j in range(n - keep, n)]
            _assert_rows(buf, np.arange(at - keep, at), 0, rows)


@pytest.mark.parametrize("num_envs", [1, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vector_writers_store_arrays_of_any_layout_as_their_values(layout, num_envs,
                                                                   store_path):
    rng = np.random.default_rng(20 + LAYOUTS.index(layout))
    with shmbuf.ReplayBuffer.create(LAYOUT_SPEC, capacity=4, lanes=num_envs) as buf, \
            buf.writer(num_envs=num_envs) as v:
        for i in range(6):
            step = _values(rng, (num_envs,), layout, cast=i % 2 == 1)
            assert v.add(**step).tolist() == [i] * num_envs
        lanes = np.arange(num_envs)
        _assert_rows(buf, np.full(num_envs, 5), lanes,
                     [{k: x[e] for k, x in step.items()} for e in range(num_envs)])
