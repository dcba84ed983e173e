"""Checkpoints keep actor priorities: ``save``/``load`` and ``state_dict``/``load_state_dict`` of a
buffer made with ``actor_priorities=True``.

What is proved here:
- a restored buffer keeps actor priorities iff the saved one did, and a fresh learner's priority
  table enters every restored row exactly as it entered it before the save: a row given a
  priority at ``p ** alpha``, a row written without one (or whose slot's tag named another
  row) at the maximum; the draws of a prioritized pool on the restored buffer fit those
  priorities (chi-square, with the power to reject uniform draws); the restored tags name the
  rows at their restored indices, and stale tags of the target buffer's own rows at the same
  indices are gone; a smaller capacity keeps each lane's newest rows with their priorities;
- restored priorities raise the maximum as the originals did: rows written afterwards without
  one enter at the same maximum as on the original buffer;
- a checkpoint from before actor priorities (no priority column) loads: its rows have none;
- a NaN, infinite or negative priority, a ``given`` flag that is not 0 or 1, a column of the
  wrong length or dtype, a missing or stray section, or a non-bool ``actor_priorities`` is a
  ``CheckpointError`` naming the entry and the fix, in both forms, before anything is created
  or written (/dev/shm and the target buffer's bytes are as they were); a state with
  priorities is refused by a buffer that would drop them (``SpecMismatchError``);
- a save while a writer process keeps giving priorities to every other batch (under fork,
  forkserver and spawn) holds, for every saved row, exactly the priority its writer gave it,
  or none where it gave none.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmbuf
from shmbuf import layout as L
from shmbuf.errors import CheckpointError, SpecMismatchError
from shmbuf.storage import BufferStorage
from tests import pool_procs as procs
from tests.test_actor_priorities import ALPHA, _pool, _stop, leaves, new_buffer
from tests.test_persist import V1_FILES, V1_MANIFEST
from tests.test_prioritized import chi_square_p
from workers.selection import Prioritized

pytestmark = pytest.mark.timeout(120)

C = 24
ZERO = (0, 20)  # (lane, index) given priority 0: with eps 0 it is never drawn


def priority(lane: int, index: Any) -> np.ndarray:
    """The priority row ``index`` of ``lane`` is given: 0.25 .. 5.25, a function of both."""
    index = np.asarray(index)
    p = 0.25 + ((7 * index + 3 * lane) % 11) * 0.5
    return np.where(index == ZERO[1], 0.0, p) if lane == ZERO[0] else p


# Per lane: the runs written, (first, stop, with a priority?), and so which rows end up held
# with one. Lane 0 laps the ring (rows 24..29 over the slots of 0..5); in lane 1, rows 24..29
# are written without one over slots whose tags name rows 0..5, which had one: none for them.
RUNS = {0: [(0, 10, True), (10, 18, False), (18, 30, True)],
        1: [(0, 16, True), (16, 30, False), (30, 34, True)]}


def fill(buf: shmbuf.ReplayBuffer, runs: dict[int, list[tuple[int, int, bool]]] = RUNS,
         given: Any = priority) -> None:
    for lane, lane_runs in runs.items():
        with buf.writer(lane=lane) as w:
            for first, stop, prioritized in lane_runs:
                rows = procs.make_batch(lane, np.arange(first, stop))
                if prioritized:
                    w.extend(rows, priorities=given(lane, np.arange(first, stop)))
                else:
                    w.extend(rows)


def expected_entry(lane: int, index: np.ndarray) -> np.ndarray:
    """The priority a fresh table enters row ``index`` of ``lane`` at (``RUNS``): the one its
    writer gave, or the initial maximum, 1.0."""
    out = np.ones(index.shape)
    for first, stop, prioritized in RUNS[lane]:
        here = (index >= first) & (index < stop)
        if prioritized:
            out[here] = priority(lane, index[here])
    return out


@pytest.fixture
def saved_buffer():
    with new_buffer(C, lanes=2) as buf:
        fill(buf)
        yield buf


def held(buf: shmbuf.ReplayBuffer) -> list[np.ndarray]:
    win = buf.windows()
    return [np.arange(int(win.lo[k]), int(win.hi[k])) for k in range(buf.lanes)]


def entered_leaves(buf: shmbuf.ReplayBuffer) -> list[np.ndarray]:
    """Each lane's held rows' leaves in the tree of a fresh prioritized pool (alpha, eps 0)."""
    with _pool(buf, 4) as pool:
        pool.next()
        return [leaves(pool, k, index) for k, index in enumerate(held(buf))]


def tags_name_rows(buf: shmbuf.ReplayBuffer, lane: int, index: np.ndarray) -> np.ndarray:
    """Whether the tag of each row's slot names that row."""
    assert buf.storage.priority_row is not None
    tags = buf.storage.priority_row[lane * buf.capacity + index % buf.capacity]  # (a copy)
    return tags == L.priority_row_tag(index)


def restored(form: str, buf: shmbuf.ReplayBuffer, path: Path, capacity: int | None = None
             ) -> shmbuf.ReplayBuffer:
    """``buf`` saved and restored in ``form``; "state" loads into a new actor-priorities buffer
    whose lanes first held rows at the same indices, every one given priority 9.0 (stale tags
    that name those very indices)."""
    if form == "directory":
        buf.save(path)
        return shmbuf.ReplayBuffer.load(path, capacity=capacity)
    state = buf.state_dict()
    other = new_buffer(capacity or buf.capacity, lanes=2)
    try:
        fill(other, {0: [(0, 30, True)], 1: [(0, 34, True)]}, lambda lane, i: np.full(i.shape, 9.))
        other.load_state_dict(state)
    except BaseException:
        other.close()
        raise
    return other


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["directory", "state"])
def test_restored_rows_enter_at_their_saved_actor_priorities(saved_buffer, tmp_path, form):
    """A fresh table enters the restored rows exactly as it entered the saved ones (and as
    ``RUNS`` says: no stale 9.0, no priority of a row a slot held before), the restored tags
    name the rows given one, and 30,720 draws fit ``p ** alpha`` (chi-square)."""
    before = entered_leaves(saved_buffer)
    index = held(saved_buffer)
    for k in range(2):
        np.testing.assert_array_equal(before[k], expected_entry(k, index[k]) ** ALPHA)
    with restored(form, saved_buffer, tmp_path / "ck") as buf:
        assert buf.actor_priorities
        assert [i.tolist() for i in held(buf)] == [i.tolist() for i in index]
        after = entered_leaves(buf)
        for k in range(2):
            np.testing.assert_array_equal(after[k], before[k], err_msg=f"lane {k}")
            given = np.zeros(index[k].shape, bool)
            for first, stop, prioritized in RUNS[k]:
                given |= prioritized & (index[k] >= first) & (index[k] < stop)
            np.testing.assert_array_equal(tags_name_rows(buf, k, index[k]), given)
        counts = [np.zeros(C), np.zeros(C)]
        with _pool(buf, 256) as pool:
            for _ in range(120):
                batch = pool.next(timeout=30)
                procs.assert_batch_ok(batch, 256)
                for k in range(2):
                    mine = np.asarray(batch.lanes) == k
                    np.add.at(counts[k], np.asarray(batch.indices)[mine] - index[k][0], 1)
    drawn = np.concatenate([counts[k][: len(index[k])] for k in range(2)])
    value = np.concatenate(before)
    live = value > 0
    assert (~live).sum() == 1 and drawn[~live].sum() == 0, "the zero-priority row was drawn"
    p_value = chi_square_p(drawn[live], value[live] / value.sum())
    assert p_value > 1e-3, f"draws do not follow the restored priorities (p={p_value:.2e})"
    assert chi_square_p(drawn[live], np.full(live.sum(), 1 / live.sum())) < 1e-12  # power


@pytest.mark.parametrize("form", ["directory", "state"])
def test_a_smaller_capacity_keeps_the_newest_rows_with_their_priorities(saved_buffer, tmp_path,
                                                                          form):
    """Capacity 12: lane 0 keeps rows 18..29 (all given one), lane 1 rows 22..33 (30..33)."""
    with restored(form, saved_buffer, tmp_path / "ck", capacity=12) as buf:
        index = held(buf)
        assert [(int(i[0]), int(i[-1])) for i in index] == [(18, 29), (22, 33)]
        after = entered_leaves(buf)
        for k in range(2):
            np.testing.assert_array_equal(after[k], expected_entry(k, index[k]) ** ALPHA)


@pytest.mark.parametrize("form", ["directory", "state"])
def test_rows_without_a_priority_enter_at_the_maximum_the_restored_ones_raise(saved_buffer,
                                                                             tmp_path, form):
    """Restored rows raise the table's maximum to the largest restored priority, as the saved
    ones did; rows written afterwards without one enter at it, on both buffers alike."""
    def after_more_rows(buf: shmbuf.ReplayBuffer) -> tuple[float, np.ndarray]:
        with _pool(buf, 4, selection=Prioritized(alpha=1.0, eps=0.0)) as pool:
            pool.next()
            with buf.writer(lane=0) as w:
                first = w.committed
                w.extend(procs.make_batch(0, np.arange(first, first + 5)))
            pool.next()
            return pool._table.max_priority, leaves(pool, 0, np.arange(first, first + 5))

    largest = max(float(expected_entry(k, i).max()) for k, i in enumerate(held(saved_buffer)))
    assert largest > 1.0  # (above the initial maximum)
    with restored(form, saved_buffer, tmp_path / "ck") as buf:
        peak, new_rows = after_more_rows(buf)
    assert peak == largest
    np.testing.assert_array_equal(new_rows, np.full(5, largest))
    original_peak, original_rows = after_more_rows(saved_buffer)
    assert original_peak == peak
    np.testing.assert_array_equal(original_rows, new_rows)


def test_a_buffer_without_actor_priorities_saves_and_loads_as_before(tmp_path):
    """No column, no key: the restored buffer keeps none either."""
    with shmbuf.ReplayBuffer.create(procs.SPEC, capacity=8) as buf:
        fill(buf, {0: [(0, 5, False)]})
        buf.save(tmp_path / "ck")
        state = buf.state_dict()
    doc = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert "actor_priorities" not in doc and "priorities" not in doc
    assert "actor_priorities" not in state and "priorities" not in state
    assert not any("priority" in p.name for p in (tmp_path / "ck").iterdir())
    with shmbuf.ReplayBuffer.load(tmp_path / "ck") as loaded:
        assert not loaded.actor_priorities and len(loaded) == 5


# --------------------------------------------------------------------------------------------
# Checkpoints from before actor priorities
# --------------------------------------------------------------------------------------------
def test_an_old_checkpoint_directory_loads_without_priorities(saved_buffer, tmp_path):
    """The version 1 checkpoint of commit 6efd403 (written with plain NumPy), and a new one with
    the priority entries and files taken out: both load, as buffers without the column."""
    old = tmp_path / "v1"
    old.mkdir()
    for file, values in V1_FILES.items():
        np.save(old / file, values)
    (old / "manifest.json").write_text(json.dumps(V1_MANIFEST))
    with shmbuf.ReplayBuffer.load(old) as buf:
        assert not buf.actor_priorities and len(buf) == 5
    path = tmp_path / "ck"
    saved_buffer.save(path)
    doc = json.loads((path / "manifest.json").read_text())
    assert doc.pop("actor_priorities") is True
    for entry in doc.pop("priorities").values():
        os.unlink(path / entry["file"])
    (path / "manifest.json").write_text(json.dumps(doc))
    with shmbuf.ReplayBuffer.load(path) as buf:
        assert not buf.actor_priorities
        for k, index in enumerate(held(saved_buffer)):
            got = buf.get(index, k)
            np.testing.assert_array_equal(got["index"], index)


def test_an_old_state_loads_into_an_actor_priorities_buffer_with_no_stale_priority(saved_buffer):
    """A state without the priority entries, loaded into a buffer whose slots hold tags that
    name the very indices it restores (priority 9.0): every row enters at the maximum, 1.0."""
    state = saved_buffer.state_dict()
    del state["actor_priorities"], state["priorities"]
    with new_buffer(C, lanes=2) as buf:
        fill(buf, {0: [(0, 30, True)], 1: [(0, 34, True)]}, lambda lane, i: np.full(i.shape, 9.0))
        buf.load_state_dict(state)
        for k, got in enumerate(entered_leaves(buf)):
            np.testing.assert_array_equal(got, np.ones(got.shape), err_msg=f"lane {k}")
            assert not tags_name_rows(buf, k, held(buf)[k]).any()


# --------------------------------------------------------------------------------------------
# Broken priority columns are refused before anything changes
# --------------------------------------------------------------------------------------------
def tamper(kind: str, doc: dict[str, Any], arrays: dict[str, np.ndarray]) -> str:
    """Break ``doc`` (a manifest or a state) or its priority ``arrays`` as ``kind`` says; return
    a pattern the error must match (the entry it names)."""
    values, given = arrays["values"], arrays["given"]
    if kind in ("nan", "inf", "negative"):
        values[3] = {"nan": np.nan, "inf": np.inf, "negative": -0.5}[kind]
        return (r"'priorities' 'values' \(the actor priorities\) holds "
                rf"{float(values[3])!r} at row 3")
    if kind == "given 2":
        given[5] = 2
        return r"'priorities' 'given' holds 2 at row 5"
    if kind == "short":
        arrays["values"] = values[:-1]
        return r"'priorities' 'values' \(the actor priorities\)"
    if kind == "float32":
        arrays["values"] = values.astype(np.float32)
        return r"'priorities' 'values' \(the actor priorities\)"
    if kind == "bool given":
        arrays["given"] = given.astype(bool)
        return r"'priorities' 'given' \(the actor priorities\)"
    if kind == "no section":
        del doc["priorities"]
        return r"the required entry 'priorities' is missing"
    if kind == "stray section":
        del doc["actor_priorities"]
        return r"'priorities' \(the actor priorities\) is there but 'actor_priorities' is not"
    if kind == "not a bool":
        doc["actor_priorities"] = "yes"
        return r"'actor_priorities' should be true or false, found 'yes'"
    raise AssertionError(kind)


TAMPERS = ["nan", "inf", "negative", "given 2", "short", "float32", "bool given", "no section",
           "stray section", "not a bool"]


@pytest.mark.parametrize("kind", TAMPERS)
def test_a_tampered_checkpoint_directory_is_refused_before_creating_anything(
        saved_buffer, tmp_path, own_shm_entries, monkeypatch, kind):
    """Refused by the checks, before a segment is even created (creating one fails the test)."""
    path = tmp_path / "ck"
    saved_buffer.save(path)
    doc = json.loads((path / "manifest.json").read_text())
    files = {name: path / e["file"] for name, e in doc["priorities"].items()}
    arrays = {name: np.load(f) for name, f in files.items()}
    match = tamper(kind, doc, arrays)
    for name, f in files.items():
        np.save(f, arrays[name])
    (path / "manifest.json").write_text(json.dumps(doc))
    before = own_shm_entries()

    def no_segment(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("load() created a segment for a checkpoint it then refused")

    monkeypatch.setattr(BufferStorage, "create", no_segment)
    with pytest.raises(CheckpointError, match=match) as info:
        shmbuf.ReplayBuffer.load(path)
    assert "Fix: " in str(info.value)
    assert own_shm_entries() == before, "a refused load left a segment behind"


@pytest.mark.parametrize("kind", TAMPERS)
def test_a_tampered_state_is_refused_and_changes_nothing(saved_buffer, own_shm_entries, kind):
    state = saved_buffer.state_dict()
    arrays = dict(state["priorities"])
    match = tamper(kind, state, arrays)
    if "priorities" in state:
        state["priorities"] = arrays
    with new_buffer(C, lanes=2) as buf:
        fill(buf, {0: [(0, 7, True)]})
        seg = buf.storage.segment.buf
        assert seg is not None
        before, shm = bytes(seg), own_shm_entries()
        with pytest.raises(CheckpointError, match=match) as info:
            buf.load_state_dict(state)
        assert "Fix: " in str(info.value)
        assert bytes(seg) == before, "a refused state changed the buffer"
        assert own_shm_entries() == shm


def test_a_state_with_priorities_is_refused_by_a_buffer_that_would_drop_them(saved_buffer):
    state = saved_buffer.state_dict()
    with shmbuf.ReplayBuffer.create(procs.SPEC, capacity=C, lanes=2) as buf:
        seg = buf.storage.segment.buf
        assert seg is not None
        before = bytes(seg)
        with pytest.raises(SpecMismatchError, match="actor_priorities=True"):
            buf.load_state_dict(state)
        assert bytes(seg) == before
        del state["actor_priorities"], state["priorities"]  # the fix the message names
        buf.load_state_dict(state)
        assert [i.tolist() for i in held(buf)] == [i.tolist() for i in held(saved_buffer)]


# --------------------------------------------------------------------------------------------
# A save while a writer gives priorities
# --------------------------------------------------------------------------------------------
BATCH = 50  # the writer's batches: rows index // BATCH even are given priority(lane, index)


def write_with_priorities_forever(buf: shmbuf.ReplayBuffer, lane: int) -> None:
    """Child: extends of ``BATCH`` rows on ``lane`` until killed, every other one with
    priorities (``priority(lane, index)``), lapping the ring again and again."""
    with buf.writer(lane=lane, timeout=10) as w:
        while True:
            index = np.arange(w.committed, w.committed + BATCH)
            rows = procs.make_batch(lane, index)
            if index[0] // BATCH % 2 == 0:
                w.extend(rows, priorities=priority(lane, index))
            else:
                w.extend(rows)
            time.sleep(0.0002)


def check_saved(per_lane: list[dict[str, int]], index_field: np.ndarray,
                priorities: dict[str, np.ndarray]) -> int:
    """Every saved row is the row of its logical index, with exactly the priority its writer
    gave it, or none (0.0, not given) where it gave none; returns the rows checked."""
    n = 0
    for r in per_lane:
        index = r["first"] + np.arange(r["count"])
        at = slice(r["offset"], r["offset"] + r["count"])
        np.testing.assert_array_equal(index_field[at], index)
        given = index // BATCH % 2 == 0
        np.testing.assert_array_equal(priorities["given"][at], given.astype(np.uint8))
        expected = np.where(given, priority(r["lane"], index), 0.0)
        np.testing.assert_array_equal(priorities["values"][at], expected)
        n += r["count"]
    return n


@pytest.mark.timeout(120)
def test_a_save_while_a_writer_gives_priorities_keeps_each_rows_own(mp, tmp_path):
    with new_buffer(1024, lanes=2) as buf:
        children = [mp.Process(target=write_with_priorities_forever, args=(buf, k), daemon=True)
                    for k in range(2)]
        try:
            for child in children:
                child.start()
            deadline = time.monotonic() + 60
            while (buf.committed() < 2 * buf.capacity).any():
                assert time.monotonic() < deadline, "the writers did not start"
                assert all(c.is_alive() for c in children), "a writer died"
                time.sleep(0.01)
            rows = 0
            for rounds in range(6):
                path = tmp_path / f"ck{rounds}"
                buf.save(path)
                doc = json.loads((path / "manifest.json").read_text())
                index_file = next(f["file"] for f in doc["fields"] if f["name"] == "index")
                rows += check_saved(doc["per_lane"], np.load(path / index_file),
                                    {n: np.load(path / e["file"])
                                     for n, e in doc["priorities"].items()})
                state = buf.state_dict()
                rows += check_saved(state["per_lane"], state["fields"]["index"],
                                    state["priorities"])
            assert all(c.is_alive() for c in children), "a writer died during the saves"
            assert rows > 2 * buf.capacity, rows
        finally:
            for child in children:
                _stop(child)
