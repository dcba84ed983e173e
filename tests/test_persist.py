"""Persistence: save/load through a directory of ``.npy`` files, state dicts, and progress.

Rows carry their own logical index (``idx``) and a payload derived from it, so every restored or
saved row proves where it came from; a writer process writing during a save proves the seqlock.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from collections.abc import Callable

import multiprocess
import numpy as np
import pytest

import shmbuf
from shmbuf import layout as L
from shmbuf import persist
from shmbuf._progress import AUTO_THRESHOLD, Progress
from shmbuf.errors import CheckpointError, LaneBusyError, SpecMismatchError

D = 8  # payload width
SPEC = shmbuf.Spec(
    {
        "idx": ((), "int64"),
        "lane": ((), "int16"),
        "obs/camera": ((D,), "float64"),
        "done": ((), "bool"),
    }
)


def rows_for(lane: int, indices: np.ndarray) -> dict[str, np.ndarray]:
    """Rows that encode (lane, index): any mix-up or torn row shows in ``check_rows``."""
    idx = np.asarray(indices, dtype=np.int64)
    return {
        "idx": idx.copy(),
        "lane": np.full(idx.shape, lane, np.int16),
        "obs/camera": idx[:, None] * 1000.0 + lane + np.arange(D) / 10.0,
        "done": idx % 3 == 0,
    }


def check_rows(data: dict[str, np.ndarray], lane: int, first: int, count: int) -> None:
    """``data`` holds exactly indices [first, first+count) of ``lane``, every field consistent."""
    expected = rows_for(lane, np.arange(first, first + count))
    for name in SPEC:
        np.testing.assert_array_equal(np.asarray(data[name]), expected[name], err_msg=name)


def fill(buf: shmbuf.ReplayBuffer, lane: int, n: int, episode_every: int = 0) -> None:
    """Append n self-checking rows to ``lane`` (ending an episode every ``episode_every``)."""
    with buf.writer(lane=lane) as w:
        start = w.committed
        if not episode_every:
            w.extend(rows_for(lane, np.arange(start, start + n)))
            return
        for i in range(start, start + n):
            w.add(**{k: v[0] for k, v in rows_for(lane, np.array([i])).items()})
            if (i + 1) % episode_every == 0:
                w.end_episode()


def lane_state(buf: shmbuf.ReplayBuffer) -> list[tuple[int, int, int, int]]:
    """(lo, hi, episode, episode_start) of every lane."""
    win = buf.windows()
    words = buf.storage.lane_words
    return [
        (
            int(win.lo[k]),
            int(win.hi[k]),
            int(words[k, L.LANE_EPISODE, 0]),
            int(words[k, L.LANE_EPISODE_START, 0]),
        )
        for k in range(buf.lanes)
    ]


def contents(buf: shmbuf.ReplayBuffer) -> dict[int, tuple[dict[str, np.ndarray], np.ndarray]]:
    """Every lane's held rows (via get) and their _meta words."""
    out = {}
    C = buf.capacity
    for k, (lo, hi, _, _) in enumerate(lane_state(buf)):
        idx = np.arange(lo, hi)
        out[k] = (buf.get(idx, k), buf.storage.meta[k * C + idx % C].copy())
    return out


def assert_same_contents(a: shmbuf.ReplayBuffer, b: shmbuf.ReplayBuffer) -> None:
    ca, cb = contents(a), contents(b)
    for k in ca:
        for name in SPEC:
            np.testing.assert_array_equal(ca[k][0][name], cb[k][0][name], f"lane {k}: {name}")
        np.testing.assert_array_equal(ca[k][1], cb[k][1], f"lane {k}: _meta")


@pytest.fixture
def buf():
    """3 lanes of 16: lane 0 wrapped (40 rows, episodes of 7), lane 1 partly filled (10), lane 2
    empty."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=16, lanes=3) as b:
        fill(b, 0, 40, episode_every=7)
        fill(b, 1, 10)
        yield b


# --------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------
def test_round_trip_preserves_rows_indices_and_episode_words(buf, tmp_path):
    buf.save(tmp_path / "ck")
    with shmbuf.ReplayBuffer.load(tmp_path / "ck") as loaded:
        assert (loaded.capacity, loaded.lanes, loaded.spec) == (16, 3, SPEC)
        expected = [(24, 40, 5, 35), (0, 10, 0, 0), (0, 0, 0, 0)]  # (lo, hi, episode, start)
        assert lane_state(loaded) == lane_state(buf) == expected
        assert_same_contents(buf, loaded)
        check_rows(loaded.get(np.arange(24, 40), 0), 0, 24, 16)
        check_rows(loaded.get(np.arange(0, 10), 1), 1, 0, 10)
        # A new writer continues each lane at its saved logical index.
        fill(loaded, 1, 3)
        check_rows(loaded.get(np.arange(0, 13), 1), 1, 0, 13)


def test_saved_npy_files_open_with_plain_numpy(buf, tmp_path):
    buf.save(tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["format"] == "shmbuf-checkpoint" and manifest["rows"] == 26
    files = {f["name"]: f["file"] for f in manifest["fields"]}
    assert files["obs/camera"] == "002_obs__camera.npy"
    arrays = {
        name: np.load(tmp_path / "ck" / file, mmap_mode="r") for name, file in files.items()
    }
    lanes = manifest["per_lane"]
    placed = [(r["first"], r["count"], r["offset"]) for r in lanes]
    assert placed == [(24, 16, 0), (0, 10, 16), (0, 0, 26)]
    for r in lanes:
        rows = {name: a[r["offset"] : r["offset"] + r["count"]] for name, a in arrays.items()}
        check_rows(rows, r["lane"], r["first"], r["count"])
    meta = np.load(tmp_path / "ck" / "_meta.npy", mmap_mode="r")
    assert meta.dtype == np.int64 and meta.shape == (26,)
    # Lane 0 index i belongs to episode i // 7 at step i % 7.
    i = np.arange(24, 40)
    np.testing.assert_array_equal(meta[:16], (i // 7) << 32 | (i % 7))
    del arrays, meta


def test_load_with_smaller_capacity_keeps_each_lanes_newest_rows(buf, tmp_path):
    buf.save(tmp_path / "ck")
    with shmbuf.ReplayBuffer.load(tmp_path / "ck", capacity=4) as small:
        assert lane_state(small) == [(36, 40, 5, 35), (6, 10, 0, 0), (0, 0, 0, 0)]
        check_rows(small.get(np.arange(36, 40), 0), 0, 36, 4)
        check_rows(small.get(np.arange(6, 10), 1), 1, 6, 4)


def test_load_with_larger_capacity_holds_only_the_saved_rows(buf, tmp_path):
    """The window starts at the first saved index, not at committed - capacity."""
    buf.save(tmp_path / "ck")
    with shmbuf.ReplayBuffer.load(tmp_path / "ck", capacity=1000) as big:
        assert lane_state(big)[0][:2] == (24, 40)
        assert len(big) == 26
        batch = big.sample(2000, rng=0)  # would hit empty slots (and fail) without the fix
        assert set(batch["idx"][batch["lane"] == 0]) == set(range(24, 40))
        # A writer that takes lane 0 over fills the empty slots before overwriting saved rows.
        fill(big, 0, 900)
        check_rows(big.get(np.arange(24, 940), 0), 0, 24, 916)


def test_save_to_an_existing_path_needs_overwrite(buf, tmp_path):
    path = tmp_path / "ck"
    buf.save(path)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        buf.save(path)
    fill(buf, 1, 5)
    buf.save(path, overwrite=True)
    with shmbuf.ReplayBuffer.load(path) as loaded:
        assert lane_state(loaded)[1][:2] == (0, 15)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp dirs left behind
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="todo.txt"):
        buf.save(tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes" / "todo.txt").exists()


def test_rows_overwritten_during_a_save_are_dropped_oldest_first(tmp_path, monkeypatch):
    """A writer laps the copy after its first chunk: the rows it overwrote (and everything
    older) are left out, the rest is saved whole, and the manifest appears only at the end."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=64) as b:
        fill(b, 0, 100)  # window [36, 100)
        row_bytes = SPEC.row_nbytes + 8
        monkeypatch.setattr(persist.snapshot, "CHUNK_BYTES", 16 * row_bytes)  # chunks of 16 rows
        path = tmp_path / "ck"
        manifest_seen = []
        pending = []  # writes to make after the next chunk is copied

        class Intruder(Progress):
            def update(self, nbytes: int) -> None:
                super().update(nbytes)
                manifest_seen.append((path / "manifest.json").exists())
                while pending:
                    pending.pop()()

        monkeypatch.setattr(persist.snapshot, "Progress", Intruder)
        with b.writer(lane=0) as w:
            # After chunk [36, 52): indices 100..139 overwrite the slots of 36..75.
            pending.append(lambda: w.extend(rows_for(0, np.arange(100, 140))))
            b.save(path)
        assert manifest_seen and not any(manifest_seen)
        manifest = json.loads((path / "manifest.json").read_text())
        (lane,) = manifest["per_lane"]
        assert (lane["first"], lane["count"], manifest["rows"]) == (76, 24, 24)
        arrays = {f["name"]: np.load(path / f["file"], mmap_mode="r") for f in manifest["fields"]}
        check_rows(arrays, 0, 76, 24)
        del arrays
        with shmbuf.ReplayBuffer.load(path) as loaded:
            assert lane_state(loaded)[0][:2] == (76, 100)
            check_rows(loaded.get(np.arange(76, 100)), 0, 76, 24)

        # state_dict takes the same path: window [76, 140); after chunk [76, 92), indices
        # 140..179 overwrite the slots of 76..115.
        with b.writer(lane=0) as w:
            pending.append(lambda: w.extend(rows_for(0, np.arange(140, 180))))
            state = b.state_dict()
        (lane,) = state["per_lane"]
        assert (lane["first"], lane["count"], lane["offset"]) == (116, 24, 0)
        check_rows(state["fields"], 0, 116, 24)
        assert state["meta"].shape == (24,)


def check_lane(arrays: dict[str, np.ndarray], meta: np.ndarray, r: dict[str, int]) -> None:
    """Lane ``r["lane"]`` of a saved layout holds whole rows ``[first, first+count)``; with one
    writer from index 0 and no episode ends, each row's meta word is its index."""
    sl = slice(r["offset"], r["offset"] + r["count"])
    check_rows({k: v[sl] for k, v in arrays.items()}, r["lane"], r["first"], r["count"])
    np.testing.assert_array_equal(meta[sl], np.arange(r["first"], r["first"] + r["count"]))


def _write_forever(name: str, lane: int) -> None:
    """Child process: append self-checking rows to ``lane`` until killed, in bursts of up to a
    quarter of the capacity and runs of single adds."""
    buf = shmbuf.ReplayBuffer.attach(name)
    rng = np.random.default_rng(lane)
    with buf.writer(lane=lane) as w:
        while True:
            n = int(rng.integers(1, buf.capacity // 4))
            i = w.committed
            if n < 8:
                for j in range(i, i + n):
                    w.add(**{k: v[0] for k, v in rows_for(lane, np.array([j])).items()})
            else:
                w.extend(rows_for(lane, np.arange(i, i + n)))
            time.sleep(0.0002)  # an actor stepping its envs, not a tight loop


def test_save_while_writer_processes_write(tmp_path):
    """Two spawned writers append all the time while the buffer is saved and snapshotted again
    and again: every saved row is whole and in place, and each lane's rows are contiguous."""
    ctx = multiprocess.get_context("spawn")
    with shmbuf.ReplayBuffer.create(SPEC, capacity=4096, lanes=2) as b:
        procs = [ctx.Process(target=_write_forever, args=(b.name, k), daemon=True) for k in (0, 1)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + 60
            while (b.committed() < 3 * b.capacity).any():
                assert time.monotonic() < deadline, "writers did not start"
                assert all(p.is_alive() for p in procs), "a writer died"
                time.sleep(0.01)
            with pytest.raises(LaneBusyError):
                b.load_state_dict(b.state_dict())
            saved_rows = rounds = 0
            deadline = time.monotonic() + 30
            # At least 10 rounds; more while a busy machine starves the copy of CPU time.
            while rounds < 10 or (saved_rows <= 2 * b.capacity and time.monotonic() < deadline):
                rounds += 1
                path = tmp_path / f"ck{rounds}"
                b.save(path)
                manifest = json.loads((path / "manifest.json").read_text())
                arrays = {f["name"]: np.load(path / f["file"], mmap_mode="r")
                          for f in manifest["fields"]}
                meta = np.load(path / "_meta.npy", mmap_mode="r")
                for r in manifest["per_lane"]:
                    assert 0 <= r["count"] <= b.capacity
                    saved_rows += r["count"]
                    check_lane(arrays, meta, r)
                del arrays, meta
                state = b.state_dict()
                for r in state["per_lane"]:
                    check_lane(state["fields"], state["meta"], r)
            assert all(p.is_alive() for p in procs), "a writer died during the saves"
            print(f"saved {saved_rows} of {rounds * 2 * b.capacity} rows in {rounds} rounds")
            assert saved_rows > 2 * b.capacity  # the copy outruns the writers most of the time
        finally:
            for p in procs:
                if p.pid is not None and p.is_alive():
                    p.kill()
                p.join(10)
        with shmbuf.ReplayBuffer.load(tmp_path / f"ck{rounds}") as loaded:
            for k, (lo, hi, _, _) in enumerate(lane_state(loaded)):
                check_rows(loaded.get(np.arange(lo, hi), k), k, lo, hi - lo)


# --------------------------------------------------------------------------------------------
# Broken checkpoints
# --------------------------------------------------------------------------------------------
_OWN_ENTRIES: list[Callable[[], set[str]]] = []  # the running test's own_shm_entries


@pytest.fixture(autouse=True)
def _own_entries(own_shm_entries):
    _OWN_ENTRIES[:] = [own_shm_entries]


def _shm() -> set[str]:
    """The /dev/shm entries this session made (other programs' come and go meanwhile)."""
    return _OWN_ENTRIES[0]()


@pytest.fixture
def saved(buf, tmp_path):
    path = tmp_path / "ck"
    buf.save(path)
    return path


def _load_fails(path, match: str) -> CheckpointError:
    before = _shm()
    with pytest.raises(CheckpointError, match=match) as info:
        shmbuf.ReplayBuffer.load(path)
    assert _shm() <= before, "a failed load left a segment behind"
    return info.value


def test_truncated_npy_is_a_checkpoint_error(saved):
    f = saved / "002_obs__camera.npy"
    os.truncate(f, f.stat().st_size - 100)
    err = _load_fails(saved, "truncated")
    assert "002_obs__camera.npy" in str(err) and "field 'obs/camera'" in str(err)
    assert "save the buffer again" in str(err)


def test_missing_manifest_is_an_incomplete_save(saved):
    (saved / "manifest.json").unlink()
    err = _load_fails(saved, "incomplete save")
    assert "6 .npy file(s)" in str(err)  # 4 fields, _meta, _episodes


def test_corrupt_manifest_is_a_checkpoint_error(saved):
    (saved / "manifest.json").write_text('{"format": "shmbuf-checkpoint", "version": 1, ')
    _load_fails(saved, "corrupt")


def test_missing_npy_is_a_checkpoint_error(saved):
    (saved / "000_idx.npy").unlink()
    _load_fails(saved, "000_idx.npy: missing")


def test_npy_with_the_wrong_dtype_is_a_checkpoint_error(saved):
    np.save(saved / "000_idx.npy", np.zeros(26, np.int32))
    err = _load_fails(saved, "expected field 'idx' as shape \\(26,\\) int64")
    assert "found shape (26,) int32" in str(err)


def test_manifest_that_disagrees_with_itself_is_a_checkpoint_error(saved):
    doc = json.loads((saved / "manifest.json").read_text())
    doc["per_lane"][1]["count"] = 9
    (saved / "manifest.json").write_text(json.dumps(doc))
    _load_fails(saved, "lane 2's entry")


def test_failure_after_the_buffer_exists_closes_it(saved, monkeypatch, own_shm_entries):
    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(shmbuf.storage.BufferStorage, "restore_lane", boom)
    before = own_shm_entries()
    with pytest.raises(RuntimeError, match="disk on fire"):
        shmbuf.ReplayBuffer.load(saved)
    assert own_shm_entries() <= before


# --------------------------------------------------------------------------------------------
# state_dict
# --------------------------------------------------------------------------------------------
def test_state_dict_round_trips_through_pickle(buf):
    state = pickle.loads(pickle.dumps(buf.state_dict()))
    assert all(type(v) is np.ndarray for v in state["fields"].values())
    with shmbuf.ReplayBuffer.create(SPEC, capacity=16, lanes=3) as other:
        fill(other, 2, 5)  # replaced entirely
        other.load_state_dict(state)
        assert lane_state(other) == lane_state(buf)
        assert_same_contents(buf, other)


def test_load_state_dict_into_a_smaller_buffer_keeps_newest(buf):
    with shmbuf.ReplayBuffer.create(SPEC, capacity=5, lanes=3) as small:
        small.load_state_dict(buf.state_dict())
        assert lane_state(small) == [(35, 40, 5, 35), (5, 10, 0, 0), (0, 0, 0, 0)]
        check_rows(small.get(np.arange(35, 40), 0), 0, 35, 5)


def test_load_state_dict_rejects_another_spec_or_lane_count(buf):
    state = buf.state_dict()
    other_spec = shmbuf.Spec(idx=((), "int64"))
    with shmbuf.ReplayBuffer.create(other_spec, capacity=16, lanes=3) as other:
        with pytest.raises(SpecMismatchError, match="spec"):
            other.load_state_dict(state)
    with shmbuf.ReplayBuffer.create(SPEC, capacity=16, lanes=2) as other:
        with pytest.raises(SpecMismatchError, match="lanes=3"):
            other.load_state_dict(state)
    state["fields"]["idx"] = state["fields"]["idx"].astype(np.int32)
    with shmbuf.ReplayBuffer.create(SPEC, capacity=16, lanes=3) as other:
        with pytest.raises(CheckpointError, match="field 'idx'"):
            other.load_state_dict(state)


def test_load_state_dict_with_a_live_writer_changes_nothing(buf):
    state = buf.state_dict()
    with shmbuf.ReplayBuffer.create(SPEC, capacity=16, lanes=3) as other:
        fill(other, 0, 20)
        before = other.state_dict()
        with other.writer(lane=2), pytest.raises(LaneBusyError, match="lane 2"):
            other.load_state_dict(state)
        after = other.state_dict()
        assert after["per_lane"] == before["per_lane"]
        for name in SPEC:
            np.testing.assert_array_equal(after["fields"][name], before["fields"][name])
        np.testing.assert_array_equal(after["meta"], before["meta"])
        other.load_state_dict(state)  # the lanes are free again
        assert lane_state(other) == lane_state(buf)


# --------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------
def test_progress_falls_back_to_a_plain_line_without_tqdm(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    with Progress(1000, "saving x", enabled=True) as bar:
        for _ in range(4):
            bar.update(250)
    err = capsys.readouterr().err
    assert "\rsaving x:   0%" in err and "\rsaving x: 100%" in err and err.endswith("\n")


def test_progress_uses_tqdm_when_installed(capsys):
    pytest.importorskip("tqdm")
    with Progress(1000, "loading y", enabled=True) as bar:
        bar.update(1000)
    assert "loading y: 100%" in capsys.readouterr().err


def test_progress_is_silent_for_small_jobs_unless_forced(capsys):
    with Progress(AUTO_THRESHOLD, "small") as bar:
        bar.update(AUTO_THRESHOLD)
    assert not bar.shown and capsys.readouterr().err == ""
    with Progress(10, "off", enabled=False) as bar:
        bar.update(10)
    assert capsys.readouterr().err == ""


def test_save_and_load_show_progress_when_asked(buf, tmp_path, capsys):
    buf.save(tmp_path / "ck", progress=True)
    assert "saving" in capsys.readouterr().err
    with shmbuf.ReplayBuffer.load(tmp_path / "ck", progress=True):
        pass
    assert "loading ck" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Derived next_obs, episode specs and episode records
# --------------------------------------------------------------------------------------------
from tests.episode_model import OPEN, TERMINATED, TRUNCATED, Episode  # noqa: E402
from tests.episode_model import make_spec as episode_row_spec  # noqa: E402
from tests.episode_model import write as write_episodes  # noqa: E402

EP_SPEC = shmbuf.Spec({"return": ((), "float32"), "seed": ((), "int64"), "info": ((2,), "int16")})
EPISODES = [
    # lane 0 wraps (20 rows in 12 slots with the FINAL rows) and outgrows the 3-record ring
    [Episode(3, TERMINATED), Episode(4, TRUNCATED), Episode(2, TERMINATED),
     Episode(5, TRUNCATED), Episode(2, OPEN)],
    [Episode(2, TRUNCATED), Episode(3, OPEN)],
    [],
]


def episode_data(lane: int, episode: int) -> dict:
    return {"return": 10.0 * lane + episode + 0.5, "seed": 100 * lane + episode,
            "info": [lane, -episode]}


def make_episodic(mode: str = "derived", **kw) -> shmbuf.ReplayBuffer:
    options = {"capacity": 12, "lanes": 3, "next_obs": mode, "episode_spec": EP_SPEC,
               "episode_capacity": 3, **kw}
    return shmbuf.ReplayBuffer.create(episode_row_spec(mode == "derived"), **options)


@pytest.fixture
def episodic():
    """Derived next_obs, an episode spec, 3 records per lane: lane 0 wrapped with records
    overwritten, lane 1 with an open episode, lane 2 empty."""
    with make_episodic() as b:
        write_episodes(b, EPISODES, episode_data=episode_data)
        yield b


def assert_same_episodic(a: shmbuf.ReplayBuffer, b: shmbuf.ReplayBuffer) -> None:
    """Same options, windows, lane words, rows with their (episode, step, FINAL), episode
    records, and the same batches for the same seed under every kind of plan."""
    assert b.derived_next_obs == a.derived_next_obs
    assert b.episode_spec == a.episode_spec
    assert b._layout.episode_capacity == a._layout.episode_capacity
    assert lane_state(b) == lane_state(a)
    for k, (lo, hi, _, _) in enumerate(lane_state(a)):
        ra, rb = (x.get(np.arange(lo, hi), k, with_episode=True) for x in (a, b))
        for name in ra:
            np.testing.assert_array_equal(rb[name], ra[name], f"lane {k}: {name}")
    ea, eb = a.episodes(), b.episodes()
    assert sorted(ea) == sorted(eb)
    for name in ea:
        np.testing.assert_array_equal(eb[name], ea[name], name)
    for plan in ({}, {"n_step": 3, "gamma": 0.9}, {"sequence_length": 2},
                 {"frame_stack": 2, "frame_lookahead": 1}):
        sa, sb = a.sample(64, 5, **plan), b.sample(64, 5, **plan)
        for name in sa:
            np.testing.assert_array_equal(sb[name], sa[name], f"{plan}: {name}")


def test_episodic_buffer_state_is_what_the_tests_below_expect(episodic):
    assert lane_state(episodic) == [(8, 20, 4, 18), (0, 6, 1, 3), (0, 0, 0, 0)]
    rec = episodic.episodes()
    assert rec["lane"].tolist() == [0, 0, 0, 1]
    assert rec["episode"].tolist() == [1, 2, 3, 0]  # the ring of 3 dropped lane 0's episode 0
    assert rec["start"].tolist() == [4, 9, 12, 0]


def test_derived_buffer_with_episode_records_round_trips_through_save_and_load(episodic,
                                                                              tmp_path):
    episodic.save(tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["next_obs"] == "derived" and manifest["episode_capacity"] == 3
    assert shmbuf.Spec.from_json(manifest["episode_spec"]) == EP_SPEC
    with shmbuf.ReplayBuffer.load(tmp_path / "ck") as loaded:
        assert_same_episodic(episodic, loaded)
        rec, want = loaded.episode(2, 0), episodic.episode(2, 0)
        assert rec.pop("info").tolist() == want.pop("info").tolist() == [0, -2]
        assert rec == want
        with pytest.raises(shmbuf.StaleIndexError):
            loaded.episode(0, 0)
        # Writers continue where the saved lanes stopped: lane 0's open episode is taken over
        # (a new id), lane 2 starts at episode 0; records keep coming in the same ring.
        with loaded.writer(lane=0) as w0, episodic.writer(lane=0) as w1:
            assert (w0.episode, w0.committed) == (w1.episode, w1.committed) == (5, 20)
        with loaded.writer(lane=2) as w:
            assert w.episode == 0


def test_derived_buffer_with_episode_records_round_trips_through_state_dict(episodic):
    """Through pickle, into a buffer created with the same options that held other rows and
    episode records before: afterwards it holds exactly the state's."""
    state = pickle.loads(pickle.dumps(episodic.state_dict()))
    assert state["next_obs"] == "derived" and state["episode_capacity"] == 3
    with make_episodic() as other:
        write_episodes(other, [[Episode(7, TERMINATED)] * 4, [], [Episode(2, TRUNCATED)]],
                       episode_data=lambda lane, e: {"seed": -1})
        other.load_state_dict(state)
        assert_same_episodic(episodic, other)


def test_load_state_dict_into_a_smaller_episode_ring_keeps_each_lanes_newest_records(episodic):
    with make_episodic(episode_capacity=2) as small:
        small.load_state_dict(episodic.state_dict())
        rec = small.episodes()
        assert list(zip(rec["lane"].tolist(), rec["episode"].tolist())) == [(0, 2), (0, 3), (1, 0)]
        assert small.episode(3, 0)["seed"] == episodic.episode(3, 0)["seed"] == 3


def test_load_with_a_smaller_capacity_keeps_the_newest_rows_and_every_record(episodic, tmp_path):
    episodic.save(tmp_path / "ck")
    with shmbuf.ReplayBuffer.load(tmp_path / "ck", capacity=4) as small:
        assert lane_state(small)[0] == (16, 20, 4, 18)
        rows = small.get(np.arange(16, 20), 0, with_episode=True)
        assert rows["_final"].tolist() == [False, True, False, False]
        assert small.episodes()["episode"].tolist() == [1, 2, 3, 0]


@pytest.mark.parametrize("change", ["next_obs", "episode_spec"])
def test_load_state_dict_rejects_another_next_obs_mode_or_episode_spec(episodic, change):
    """The rows of a derived buffer mean something else in a stored one (FINAL rows), and
    records need the same episode fields: both raise SpecMismatchError and change nothing."""
    state = episodic.state_dict()
    if change == "next_obs":  # the very same spec (obs, no next_obs), but stored
        target = shmbuf.ReplayBuffer.create(episode_row_spec(True), 12, 3, next_obs="stored",
                                            episode_spec=EP_SPEC, episode_capacity=3)
    else:
        target = make_episodic(episode_spec=shmbuf.Spec({"return": ((), "float64")}))
    with target:
        rows = {n: np.ones((2, *f.shape), f.dtype) for n, f in target.spec.items()}
        if target.derived_next_obs:
            rows["next_obs"] = rows["obs"]
        with target.writer(lane=1) as w:
            w.extend(rows)
            w.end_episode(**{"return": 1.0})
        before = (lane_state(target), target.episodes()["episode"].tolist())
        with pytest.raises(SpecMismatchError, match=change):
            target.load_state_dict(state)
        assert (lane_state(target), target.episodes()["episode"].tolist()) == before


def _strip_episode_keys(doc: dict) -> list[str]:
    """Make a manifest or state look like one from before episodes existed; returns the files
    it no longer names."""
    files = []
    episodes = doc.pop("episodes", None)
    if isinstance(episodes, dict):
        files = [e["file"] for e in [episodes.get("records", {}), *episodes.get("fields", [])]
                 if isinstance(e, dict) and "file" in e]
    for key in ("next_obs", "episode_spec", "episode_capacity"):
        doc.pop(key, None)
    return files


def test_a_manifest_without_the_episode_keys_still_loads(buf, tmp_path):
    buf.save(tmp_path / "ck")
    path = tmp_path / "ck" / "manifest.json"
    doc = json.loads(path.read_text())
    for file in _strip_episode_keys(doc):
        (tmp_path / "ck" / file).unlink()
    path.write_text(json.dumps(doc))
    with shmbuf.ReplayBuffer.load(tmp_path / "ck") as loaded:
        assert not loaded.derived_next_obs and loaded.episode_spec is None
        assert loaded._layout.episode_capacity == 64  # create()'s default
        assert lane_state(loaded) == lane_state(buf)
        assert_same_contents(buf, loaded)
        assert loaded.episodes()["episode"].size == 0


def test_a_state_dict_without_the_episode_keys_still_loads(buf):
    state = buf.state_dict()
    _strip_episode_keys(state)
    with shmbuf.ReplayBuffer.create(SPEC, capacity=16, lanes=3) as other:
        other.load_state_dict(state)
        assert lane_state(other) == lane_state(buf)
        assert_same_contents(buf, other)


def test_a_stored_buffer_keeps_its_episode_records_too(buf, tmp_path):
    """The plain fixture (episodes of 7 on lane 0, no episode spec) saves its records."""
    assert buf.episodes()["episode"].tolist() == [0, 1, 2, 3, 4]
    buf.save(tmp_path / "ck")
    with shmbuf.ReplayBuffer.load(tmp_path / "ck") as loaded:
        for name, value in buf.episodes().items():
            np.testing.assert_array_equal(loaded.episodes()[name], value, name)


def test_a_manifest_with_a_broken_episode_section_is_a_checkpoint_error(episodic, tmp_path):
    episodic.save(tmp_path / "ck")
    path = tmp_path / "ck" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["episodes"]["fields"][0]["shape"] = [99]
    path.write_text(json.dumps(doc))
    _load_fails(tmp_path / "ck", "episode field 'return'")
    doc["episodes"]["fields"] = doc["episodes"]["fields"][1:]
    path.write_text(json.dumps(doc))
    _load_fails(tmp_path / "ck", "episode")
    doc = json.loads(path.read_text())
    doc["next_obs"] = "sideways"
    path.write_text(json.dumps(doc))
    _load_fails(tmp_path / "ck", "next_obs")


# --------------------------------------------------------------------------------------------
# The checkpoint format, pinned: what the writer before the persist split (commit 6efd403)
# wrote for this buffer, byte for byte in the arrays and key for key in the manifest
# --------------------------------------------------------------------------------------------
V1_SPEC = shmbuf.Spec({"idx": ((), "int64"), "obs/camera": ((2,), "float32")})
V1_EP_SPEC = shmbuf.Spec(ret=((), "float32"))
V1_MANIFEST = {  # less "created" and "source"
    "format": "shmbuf-checkpoint", "version": 1,
    "spec": [{"name": "idx", "shape": [], "dtype": "<i8"},
             {"name": "obs/camera", "shape": [2], "dtype": "<f4"}],
    "capacity": 4, "lanes": 2, "rows": 5,
    "per_lane": [
        {"lane": 0, "first": 2, "count": 4, "offset": 0, "episode": 1, "episode_start": 3},
        {"lane": 1, "first": 0, "count": 1, "offset": 4, "episode": 1, "episode_start": 1},
    ],
    "fields": [{"name": "idx", "file": "000_idx.npy", "shape": [5], "dtype": "<i8"},
               {"name": "obs/camera", "file": "001_obs__camera.npy", "shape": [5, 2],
                "dtype": "<f4"}],
    "meta": {"file": "_meta.npy", "shape": [5], "dtype": "<i8"},
    "next_obs": "stored",
    "episode_spec": [{"name": "ret", "shape": [], "dtype": "<f4"}],
    "episode_capacity": 2,
    "episodes": {"records": {"file": "_episodes.npy", "shape": [2, 5], "dtype": "<i8"},
                 "columns": ["lane", "episode", "start", "length", "flags"],
                 "fields": [{"name": "ret", "file": "_ep_000_ret.npy", "shape": [2],
                             "dtype": "<f4"}]},
}
V1_FILES = {
    "000_idx.npy": np.array([2, 3, 4, 5, 7], "<i8"),
    "001_obs__camera.npy": np.array([[2, -2], [3, -3], [4, -4], [5, -5], [7, -7]], "<f4"),
    "_meta.npy": np.array([2, 1 << 32, (1 << 32) + 1, (1 << 32) + 2, 0], "<i8"),
    "_episodes.npy": np.array([[0, 0, 0, 3, 0], [1, 0, 0, 1, 1]], "<i8"),
    "_ep_000_ret.npy": np.array([1.5, -2.0], "<f4"),
}


def v1_buffer() -> shmbuf.ReplayBuffer:
    """Lane 0: an episode of 3 ended, 3 rows of an open one (2 overwritten); lane 1: one row,
    truncated."""
    b = shmbuf.ReplayBuffer.create(V1_SPEC, capacity=4, lanes=2, episode_spec=V1_EP_SPEC,
                                   episode_capacity=2)
    i = np.arange(6)
    rows = {"idx": i, "obs/camera": np.stack([i, -i], 1).astype(np.float32)}
    with b.writer(lane=0) as w:
        w.extend({k: v[:3] for k, v in rows.items()})
        w.end_episode(ret=1.5)
        w.extend({k: v[3:] for k, v in rows.items()})
    with b.writer(lane=1) as w:
        w.add(**{"idx": 7, "obs/camera": np.array([7, -7], np.float32)})
        w.end_episode(truncated=True, ret=-2.0)
    return b


def test_save_and_state_dict_write_the_version_1_format(tmp_path):
    with v1_buffer() as b:
        b.save(tmp_path / "ck")
        state = b.state_dict()
    doc = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert doc.pop("source").startswith("shmbuf-") and isinstance(doc.pop("created"), float)
    assert list(doc) == list(V1_MANIFEST) and doc == V1_MANIFEST
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == sorted([*V1_FILES,
                                                                         "manifest.json"])
    for file, expected in V1_FILES.items():
        found = np.load(tmp_path / "ck" / file)
        assert found.dtype == expected.dtype and found.tolist() == expected.tolist(), file
    # the state dict holds the same, with arrays in place of file entries
    assert list(state) == ["format", "version", "spec", "capacity", "lanes", "per_lane",
                           "fields", "meta", "next_obs", "episode_spec", "episode_capacity",
                           "episodes"]
    assert state["format"] == "shmbuf-state"
    for key in ("version", "spec", "capacity", "lanes", "per_lane", "next_obs", "episode_spec",
                "episode_capacity"):
        assert state[key] == V1_MANIFEST[key], key
    arrays = {**{e["file"]: state["fields"][e["name"]] for e in V1_MANIFEST["fields"]},
              "_meta.npy": state["meta"], "_episodes.npy": state["episodes"]["records"],
              "_ep_000_ret.npy": state["episodes"]["fields"]["ret"]}
    for file, expected in V1_FILES.items():
        assert arrays[file].dtype == expected.dtype, file
        assert arrays[file].tolist() == expected.tolist(), file


def test_a_version_1_checkpoint_written_with_plain_numpy_loads(tmp_path):
    """A checkpoint in the format of commit 6efd403, made without shmbuf's writer."""
    path = tmp_path / "ck"
    path.mkdir()
    for file, values in V1_FILES.items():
        np.save(path / file, values)
    (path / "manifest.json").write_text(json.dumps({**V1_MANIFEST, "created": 0.0,
                                                    "source": "elsewhere"}))
    with shmbuf.ReplayBuffer.load(path) as loaded, v1_buffer() as original:
        assert loaded.episode_spec == V1_EP_SPEC and loaded.capacity == 4
        assert lane_state(loaded) == lane_state(original) == [(2, 6, 1, 3), (0, 1, 1, 1)]
        for k, (lo, hi, _, _) in enumerate(lane_state(original)):
            a, b = (x.get(np.arange(lo, hi), k, with_episode=True) for x in (original, loaded))
            for name in a:
                np.testing.assert_array_equal(b[name], a[name], f"lane {k}: {name}")
        for name, values in original.episodes().items():
            np.testing.assert_array_equal(loaded.episodes()[name], values, name)


SAME_RULE_CASES = [  # (entry, value) in a manifest; and in a state dict if that differs
    (("capacity", 0),), (("spec", 5),), (("next_obs", 5),), (("episode_capacity", "3"),),
    (("per_lane.0.episode", -1),), (("per_lane.1.offset", 3),), (("per_lane.0.count", 5),),
    (("fields.0.dtype", "<i4"), ("fields.idx", np.zeros(5, np.int32))),
    (("fields.1.shape", [5, 3]), ("fields.obs/camera", np.zeros((5, 3), np.float32))),
    (("meta.dtype", "<i4"), ("meta", np.zeros(5, np.int32))),
    (("episodes.records.dtype", "<f8"), ("episodes.records", np.zeros((2, 5)))),
    (("episodes.fields.0.shape", [3]), ("episodes.fields.ret", np.zeros(3, np.float32))),
]


def _set(doc: dict, where: str, value) -> None:
    *parents, last = where.split(".")
    for key in parents:
        doc = doc[int(key)] if isinstance(doc, list) else doc[key]
    doc[int(last) if isinstance(doc, list) else last] = value


@pytest.mark.parametrize("changes", SAME_RULE_CASES, ids=lambda c: c[0][0])
def test_a_manifest_and_a_state_dict_are_checked_by_the_same_rules(tmp_path, changes):
    """The same bad entry in a manifest and in a state dict: the same message after where."""
    manifest_change, state_change = changes[0], changes[-1]
    with v1_buffer() as b:
        b.save(tmp_path / "ck")
        doc = json.loads((tmp_path / "ck" / "manifest.json").read_text())
        _set(doc, *manifest_change)
        (tmp_path / "ck" / "manifest.json").write_text(json.dumps(doc))
        state = b.state_dict()
        _set(state, *state_change)
        errors = []
        with pytest.raises(CheckpointError) as info:
            shmbuf.ReplayBuffer.load(tmp_path / "ck")
        errors.append(str(info.value).split(": ", 1))
        with pytest.raises(CheckpointError) as info:
            b.load_state_dict(state)
        errors.append(str(info.value).split(": ", 1))
    assert errors[0][0] == str(tmp_path / "ck" / "manifest.json")
    assert errors[1][0] == "load_state_dict()"
    assert errors[0][1] == errors[1][1]
