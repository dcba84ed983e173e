"""Rewrites in place (``slots.rewrite_rows``, TorchRL's ``rb[i] = td``) under the seqlock: the
stamp gets a new rewrite version, so a reader whose copy spans a rewrite never accepts the torn
row (the ABA a stamp of the index alone would let through, shown by the control), ring writes
still stamp version 0 (their words are unchanged), every reader (checked gathers, the plan
reader, snapshots) reads rewritten rows, and a writer process rewriting rows while the parent
reads them in a loop never delivers a row whose entries disagree."""

from __future__ import annotations

import time

import numpy as np
import pytest

import shmbuf
from shmbuf import layout as L
from shmbuf import slots

SPEC = shmbuf.Spec(x=((), "int64"), obs=((3,), "float32"))
C = 8


def row(i: int) -> dict[str, object]:
    return {"x": i, "obs": np.full(3, i, np.float32)}


class CopyHook(dict):
    """``out`` for ``checked_gather`` that runs ``hook`` after copying the first column."""

    def __init__(self, out: dict[str, np.ndarray], hook) -> None:
        super().__init__(out)
        self.hook = hook

    def items(self):
        for k, (name, dst) in enumerate(super().items()):
            if k == 1:
                self.hook()
            yield name, dst


def gather_across(buf: shmbuf.ReplayBuffer, index: int, rewrite) -> tuple[bool, dict]:
    """A checked read of ``index`` whose copy spans ``rewrite()`` (between its two columns)."""
    st = buf.storage
    out = CopyHook({"x": np.zeros(1, np.int64), "obs": np.zeros((1, 3), np.float32)}, rewrite)
    slot = np.array([index % C])
    ok = slots.checked_gather(st.stamps, slot, np.array([index]), st.columns, out, st.meta)
    return bool(ok[0]), dict(out)


def rewrite_unversioned(buf: shmbuf.ReplayBuffer, index: int, value: int) -> None:
    """The control: a rewrite stamped with the index alone (what a versionless stamp gives)."""
    st, slot = buf.storage, np.array([index % C])
    slots.mark_writing(st.stamps, slot, np.array([index]))
    st.columns["x"][slot] = value
    st.columns["obs"][slot] = value
    slots.mark_held(st.stamps, slot, np.array([index]))


def rewrite(buf: shmbuf.ReplayBuffer, index: int, value: int) -> None:
    st, slot = buf.storage, np.array([index % C])
    slots.rewrite_rows(st.stamps, slot, np.array([index]), [st.columns["x"], st.columns["obs"]],
                       [np.array([value]), np.full((1, 3), value, np.float32)])


def test_a_copy_spanning_a_rewrite_is_refused_where_an_index_stamp_would_accept_it():
    with shmbuf.ReplayBuffer.create(SPEC, C) as buf, buf.writer(0) as w:
        for i in range(5):
            w.add(**row(i))
        ok, out = gather_across(buf, 3, lambda: rewrite_unversioned(buf, 3, 70))
        assert ok and out["x"][0] == 3 and out["obs"][0, 0] == 70  # the control: torn, accepted
        ok, out = gather_across(buf, 3, lambda: rewrite(buf, 3, 80))
        assert not ok  # versioned: the two loads differ
        ok, out = gather_across(buf, 3, lambda: None)
        assert ok and out["x"][0] == 80 and out["obs"][0].tolist() == [80.0] * 3
        assert buf.get([3])["x"].tolist() == [80]


def test_versions_count_up_and_ring_writes_stay_at_version_0():
    with shmbuf.ReplayBuffer.create(SPEC, C) as buf, buf.writer(0) as w:
        for i in range(3):
            w.add(**row(i))
        stamps = buf.storage.stamps
        assert stamps[:3].tolist() == [L.stamp_held(i) for i in range(3)]  # ring: version 0
        for k in range(1, 4):
            rewrite(buf, 1, 10 + k)
            assert int(stamps[1]) >> slots.VERSION_SHIFT == k
            assert int(stamps[1]) & slots.INDEX_BITS == L.stamp_held(1)
        assert slots.holds(stamps[:3].copy(), np.arange(3)).all()
        for i in range(3, C + 2):  # the ring laps slot 1: version 0 again, for index 9
            w.add(**row(i))
        assert int(stamps[1]) == L.stamp_held(9)
        del stamps  # a view of the segment: it must go before close()


def test_version_wraps_within_its_bits():
    stamps = np.array([(slots.VERSION_MASK << slots.VERSION_SHIFT) | L.stamp_held(5)], np.int64)
    held = slots.mark_rewriting(stamps, np.array([0]), np.array([5]))
    assert int(stamps[0]) == L.stamp_writing(5) and int(held[0]) == L.stamp_held(5)


def test_every_reader_reads_rewritten_rows():
    with shmbuf.ReplayBuffer.create(SPEC, C) as buf, buf.writer(0) as w:
        for i in range(C):
            w.add(**row(i))
        for i in range(C):
            rewrite(buf, i, 100 + i)
        got = buf.get(np.arange(C))  # checked gathers
        assert got["x"].tolist() == list(range(100, 100 + C))
        batch = buf.sample(64, rng=0)  # the plan reader (probe, then stable)
        assert set(batch["x"].tolist()) <= set(range(100, 100 + C))
        assert np.array_equal(batch["obs"][:, 0], batch["x"].astype(np.float32))
        state = buf.state_dict()  # snapshots: rewritten rows are kept, not dropped as torn
        assert state["per_lane"][0]["count"] == C
        assert sorted(state["fields"]["x"][:C].tolist()) == list(range(100, 100 + C))


# --------------------------------------------------------------------------------------------
# Across processes: rewrites racing reads, self-checking rows
# --------------------------------------------------------------------------------------------
BIG = shmbuf.Spec(x=((), "int64"), obs=((4096,), "float32"))  # 16 KB rows: a wide copy window


def _rewriter(name: str, seconds: float) -> None:
    """Holds the lane (a writer lease) and rewrites rows 0-3 in place with value v, v+1, ..."""
    buf = shmbuf.ReplayBuffer.attach(name)
    try:
        with buf.writer(0):
            st, v, end = buf.storage, 1000, time.monotonic() + seconds
            at, index = np.arange(4), np.arange(4)
            while time.monotonic() < end:
                values = v + np.arange(4)
                slots.rewrite_rows(st.stamps, at, index, [st.columns["x"], st.columns["obs"]],
                                   [values, np.repeat(values[:, None], 4096, 1).astype(np.float32)])
                v += 4
    finally:
        buf.close()


@pytest.mark.timeout(120)
def test_rows_read_while_another_process_rewrites_them_are_whole(mp):
    with shmbuf.ReplayBuffer.create(BIG, 4) as buf:
        with buf.writer(0) as w:
            w.extend({"x": np.arange(4), "obs": np.repeat(np.arange(4.0)[:, None], 4096, 1)})
        p = mp.Process(target=_rewriter, args=(buf.name, 3.0))
        p.start()
        try:
            seen, refused = set(), 0
            end = time.monotonic() + 30
            while p.is_alive() and time.monotonic() < end:
                try:
                    got = buf.get(np.arange(4))
                except shmbuf.StaleIndexError:  # a row mid-rewrite: refused, as it must be
                    refused += 1
                    continue
                obs = got["obs"]
                assert (obs == obs[:, :1]).all(), "a torn row was delivered"
                assert np.array_equal(obs[:, 0], got["x"].astype(np.float32))
                seen.update(got["x"].tolist())
            p.join(30)
            assert p.exitcode == 0
            assert len(seen) > 8  # the reads did overlap the rewrites
        finally:
            if p.is_alive():
                p.kill()
                p.join(5)


