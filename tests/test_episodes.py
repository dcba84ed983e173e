"""Episodes on lanes: per-episode records (``end_episode(truncated, **data)``, ``buf.episode``,
``buf.episodes``), their validation and ring overwrite, the (episode, step, FINAL) of each row,
writer takeover, ``VectorWriter`` (one lane per env), and how sampling splits a batch over lanes.

Rows are the self-describing transitions of ``tests.episode_model``: each names its (lane,
episode, step), so a row in the wrong lane or episode shows.
"""

from __future__ import annotations

import os
import signal

import multiprocess
import numpy as np
import pytest

import shmbuf
from shmbuf import layout as L
from shmbuf.errors import SpecMismatchError, StaleIndexError
from tests.episode_model import (
    OPEN,
    Episode,
    make_spec,
    obs_value,
    tag,
    transition,
    untag,
)

pytestmark = pytest.mark.timeout(60)

EPISODE_SPEC = shmbuf.Spec({"return": ((), "float32"), "seed": ((), "int64"),
                            "info": ((2,), "float32")})
MODES = ["stored", "derived"]


def new_buffer(mode: str = "stored", capacity: int = 32, lanes: int = 1,
               episode_spec: shmbuf.Spec | None = EPISODE_SPEC, **kw) -> shmbuf.ReplayBuffer:
    return shmbuf.ReplayBuffer.create(make_spec(mode == "derived"), capacity, lanes,
                                      next_obs=mode, episode_spec=episode_spec, **kw)


def add_steps(w: shmbuf.Writer, lane: int, episode: int, n: int, first: int = 0) -> None:
    ep = Episode(first + n, OPEN)
    for s in range(first, first + n):
        w.add(**transition(lane, episode, ep, s))


def snapshot(buf: shmbuf.ReplayBuffer, w) -> tuple:
    """Everything end_episode() may change: committed counts, the writer's episode and step,
    every lane word and every episode record."""
    step = w.step if isinstance(w, shmbuf.Writer) else w._step  # a VectorWriter's, per env
    records = {k: v.tolist() for k, v in buf.episodes().items()}
    return (buf.committed().tolist(), np.asarray(w.episode).tolist(), np.asarray(step).tolist(),
            buf.storage.lane_words.tolist(), records)


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_end_episode_records_start_length_truncation_and_data(mode):
    """Each finished episode's record holds its first logical index, its length in transitions,
    whether it was truncated and its episode data; ``episodes()`` lists them by lane then id.
    In derived buffers the FINAL row after each episode shifts the next episode's start."""
    final = 1 if mode == "derived" else 0
    with new_buffer(mode, lanes=2) as buf:
        with buf.writer(lane=1) as w:
            add_steps(w, 1, 0, 3)
            assert w.end_episode(truncated=False, **{"return": 1.5, "seed": 7,
                                                     "info": [0.5, -1]}) == 0
            add_steps(w, 1, 1, 2)
            assert w.end_episode(truncated=True, **{"return": -2.0}) == 1
        with buf.writer(lane=0) as w:
            add_steps(w, 0, 0, 4)
            assert w.end_episode(True, seed=3) == 0
        rec = buf.episode(0, lane=1)
        info = rec.pop("info")
        assert rec == {"episode": 0, "lane": 1, "start": 0, "length": 3, "truncated": False,
                       "return": 1.5, "seed": 7}
        assert info.dtype == np.float32 and info.tolist() == [0.5, -1.0]
        rec = buf.episode(1, 1)
        assert (rec["start"], rec["length"], rec["truncated"]) == (3 + final, 2, True)
        assert (rec["return"], rec["seed"], rec["info"].tolist()) == (-2.0, 0, [0.0, 0.0])
        everything = buf.episodes()
        assert everything["lane"].tolist() == [0, 1, 1]
        assert everything["episode"].tolist() == [0, 0, 1]
        assert everything["length"].tolist() == [4, 3, 2]
        assert everything["truncated"].tolist() == [True, False, True]
        assert everything["seed"].tolist() == [3, 7, 0]
        assert everything["info"].shape == (3, 2)
        lane1 = buf.episodes(lane=1)
        assert lane1["episode"].tolist() == [0, 1] and lane1["return"].tolist() == [1.5, -2.0]
        # The record's start and length name exactly the episode's rows.
        rows = buf.get(np.arange(rec["start"], rec["start"] + rec["length"]), 1, with_episode=True)
        assert [untag(a) for a in rows["action"]] == [(1, 1, 0), (1, 1, 1)]
        assert rows["_episode"].tolist() == [1, 1] and not rows["_final"].any()


def test_episode_records_without_an_episode_spec_hold_the_basics():
    with new_buffer(episode_spec=None) as buf:
        assert buf.episode_spec is None
        with buf.writer() as w:
            add_steps(w, 0, 0, 2)
            w.end_episode()
        assert buf.episode(0) == {"episode": 0, "lane": 0, "start": 0, "length": 2,
                                  "truncated": False}


@pytest.mark.parametrize("bad", [
    {"retrun": 1.0},  # unknown field (typo)
    {"return": 1.0, "extra": 2},
    {"return": "high"},  # not a number
    {"seed": 1.5},  # float into int64
    {"info": [1.0, 2.0, 3.0]},  # wrong shape
], ids=["typo", "extra", "string", "float-into-int", "shape"])
@pytest.mark.parametrize("mode", MODES)
def test_bad_episode_data_raises_and_changes_nothing(mode, bad):
    """Invalid episode data raises SpecMismatchError before anything is stored: no record, no
    FINAL row, the episode stays open with its steps, and ending it properly still works."""
    with new_buffer(mode) as buf, buf.writer() as w:
        add_steps(w, 0, 0, 3)
        before = snapshot(buf, w)
        with pytest.raises(SpecMismatchError):
            w.end_episode(truncated=True, **bad)
        assert snapshot(buf, w) == before
        with pytest.raises(StaleIndexError):
            buf.episode(0)
        assert w.end_episode(truncated=True, **{"return": 4.0}) == 0
        assert buf.episode(0)["return"] == 4.0 and buf.episode(0)["length"] == 3


@pytest.mark.parametrize("mode", MODES)
def test_episode_data_without_an_episode_spec_raises_and_changes_nothing(mode):
    with new_buffer(mode, episode_spec=None) as buf, buf.writer() as w:
        add_steps(w, 0, 0, 2)
        before = snapshot(buf, w)
        with pytest.raises(SpecMismatchError, match="episode_spec"):
            w.end_episode(**{"return": 1.0})
        assert snapshot(buf, w) == before
        assert w.end_episode() == 0


def test_records_older_than_episode_capacity_are_stale():
    """episode_capacity=3: after five episodes only the last three records are held; older ids,
    the open episode's id and ids never reached raise StaleIndexError."""
    with new_buffer(capacity=64, episode_capacity=3) as buf, buf.writer() as w:
        for e in range(5):
            add_steps(w, 0, e, 1 + e)
            w.end_episode(**{"seed": 100 + e})
        add_steps(w, 0, 5, 2)  # open
        for e in (0, 1, 5, 6, 99):
            with pytest.raises(StaleIndexError, match="episode_capacity"):
                buf.episode(e)
        assert [buf.episode(e)["seed"] for e in (2, 3, 4)] == [102, 103, 104]
        assert [buf.episode(e)["length"] for e in (2, 3, 4)] == [3, 4, 5]
        assert buf.episodes()["episode"].tolist() == [2, 3, 4]
        with pytest.raises(ValueError, match="lane"):
            buf.episode(2, lane=1)


def test_default_episode_capacity():
    with new_buffer(capacity=8) as small, new_buffer(capacity=4096) as big:
        assert small._layout.episode_capacity == 64
        assert big._layout.episode_capacity == 512


@pytest.mark.parametrize("mode", MODES)
def test_end_episode_without_steps_is_a_no_op(mode):
    """Ending an episode that has no steps records nothing, writes no FINAL row and does not use
    up the id (even with episode data, which is still validated)."""
    with new_buffer(mode) as buf, buf.writer() as w:
        before = snapshot(buf, w)
        assert w.end_episode(truncated=True, **{"return": 1.0}) == 0
        assert snapshot(buf, w) == before
        with pytest.raises(SpecMismatchError):
            w.end_episode(bogus=1)
        add_steps(w, 0, 0, 2)
        assert w.end_episode() == 0
        after_first = snapshot(buf, w)
        assert w.end_episode() == 1 and w.end_episode() == 1
        assert snapshot(buf, w) == after_first
        assert buf.episodes()["episode"].tolist() == [0]
        assert w.episode == 1


@pytest.mark.parametrize("mode", MODES)
def test_get_with_episode_reports_episode_step_and_final(mode):
    with new_buffer(mode) as buf:
        with buf.writer() as w:
            add_steps(w, 0, 0, 2)
            w.end_episode()
            add_steps(w, 0, 1, 2)
        n = buf.committed(0)
        rows = buf.get(np.arange(n), with_episode=True)
        if mode == "derived":
            assert rows["_episode"].tolist() == [0, 0, 0, 1, 1]
            assert rows["_step"].tolist() == [0, 1, 2, 0, 1]
            assert rows["_final"].tolist() == [False, False, True, False, False]
            np.testing.assert_array_equal(rows["obs"][2], obs_value(0, 0, 2))  # final obs
            assert rows["action"][2] == 0 and rows["reward"][2] == 0  # the rest is zero
        else:
            assert rows["_episode"].tolist() == [0, 0, 1, 1]
            assert rows["_step"].tolist() == [0, 1, 0, 1]
            assert not rows["_final"].any()
        plain = buf.get(np.arange(n))
        assert not {"_episode", "_step", "_final"} & set(plain)


# --------------------------------------------------------------------------------------------
# Takeover
# --------------------------------------------------------------------------------------------
def test_takeover_of_an_open_episode_starts_a_new_one_without_a_record():
    with new_buffer() as buf:
        with buf.writer() as w:
            add_steps(w, 0, 0, 3)  # closed mid-episode
        with buf.writer() as w:
            assert (w.episode, w.step, w.committed) == (1, 0, 3)
            add_steps(w, 0, 1, 2)
            w.end_episode()
        with pytest.raises(StaleIndexError):
            buf.episode(0)
        assert buf.episode(1)["start"] == 3 and buf.episode(1)["length"] == 2
        with buf.writer() as w:  # the last episode was ended: no id is skipped
            assert (w.episode, w.step) == (2, 0)


def _write_then_hang(buf: shmbuf.ReplayBuffer, ready) -> None:
    with buf.writer(lane=0) as w:
        add_steps(w, 0, 0, 3)
        ready.set()
        signal.pause()


def test_takeover_after_the_writer_is_killed_mid_episode_starts_a_new_episode():
    ctx = multiprocess.get_context("fork")
    with new_buffer() as buf:
        ready = ctx.Event()
        proc = ctx.Process(target=_write_then_hang, args=(buf, ready), daemon=True)
        proc.start()
        try:
            assert ready.wait(20)
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
            with buf.writer(lane=0, timeout=10) as w:
                assert (w.episode, w.step, w.committed) == (1, 0, 3)
                add_steps(w, 0, 1, 1)
            rows = buf.get(np.arange(4), with_episode=True)
            assert rows["_episode"].tolist() == [0, 0, 0, 1]
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


# --------------------------------------------------------------------------------------------
# VectorWriter
# --------------------------------------------------------------------------------------------
def env_rows(lanes: list[int], episodes: list[int], steps: list[int]) -> dict[str, np.ndarray]:
    rows = [transition(k, e, Episode(s + 1, OPEN), s) for k, e, s in zip(lanes, episodes, steps)]
    return {f: np.stack([np.asarray(r[f]) for r in rows]) for f in rows[0]}


@pytest.mark.parametrize("mode", MODES)
def test_vector_writer_rows_land_in_their_lanes(mode):
    with new_buffer(mode, lanes=4) as buf:
        with buf.writer(lanes=[3, 1]) as vw:  # env 0 -> lane 3, env 1 -> lane 1
            assert vw.num_envs == 2 and vw.lanes.tolist() == [3, 1]
            for s in range(3):
                assert vw.add(**env_rows([3, 1], [0, 0], [s, s])).tolist() == [s, s]
        assert buf.committed().tolist() == [0, 3, 0, 3]
        for lane in (1, 3):
            rows = buf.get(np.arange(3), lane, with_episode=True)
            assert [untag(a) for a in rows["action"]] == [(lane, 0, s) for s in range(3)]
            assert rows["_step"].tolist() == [0, 1, 2]
        with buf.writer(num_envs=2) as vw:  # any free lanes, in lane order
            lanes = vw.lanes.tolist()
            assert lanes == sorted(set(lanes)) and set(lanes) <= {0, 1, 2, 3}


@pytest.mark.parametrize("mode", MODES)
def test_vector_end_episode_per_env(mode):
    """end_episode(env_mask, truncated=..., **data) ends only the masked envs, with their own
    truncation flag and data (per env, or one value for all); envs with no steps are skipped;
    the result names each ended episode, -1 elsewhere. Derived buffers get one FINAL row per
    ended env, holding that env's last next_obs."""
    with new_buffer(mode, lanes=3) as buf, buf.writer(num_envs=3) as vw:
        vw.add(**env_rows([0, 1, 2], [0, 0, 0], [0, 0, 0]))
        vw.add(**env_rows([0, 1, 2], [0, 0, 0], [1, 1, 1]))
        ended = vw.end_episode([True, False, True], truncated=[False, False, True],
                               **{"return": [1.0, 2.0, 3.0], "seed": 9})
        assert ended.tolist() == [0, -1, 0]
        assert vw.episode.tolist() == [1, 0, 1]
        extra = 1 if mode == "derived" else 0
        assert buf.committed().tolist() == [2 + extra, 2, 2 + extra]
        r0, r2 = buf.episode(0, 0), buf.episode(0, 2)
        assert (r0["truncated"], r0["return"], r0["seed"], r0["length"]) == (False, 1.0, 9, 2)
        assert (r2["truncated"], r2["return"], r2["seed"], r2["length"]) == (True, 3.0, 9, 2)
        with pytest.raises(StaleIndexError):
            buf.episode(0, 1)
        if mode == "derived":
            for lane in (0, 2):
                final = buf.get([2], lane, with_episode=True)
                assert final["_final"].tolist() == [True]
                np.testing.assert_array_equal(final["obs"][0], obs_value(lane, 0, 2))
        # env 0 and 2 have no steps in their new episodes: skipped even when masked
        assert vw.end_episode(True).tolist() == [-1, 0, -1]
        assert buf.committed().tolist() == [2 + extra, 2 + extra, 2 + extra]
        assert buf.episodes()["lane"].tolist() == [0, 1, 2]


def test_vector_writer_validates_before_writing():
    """Wrong num_envs, unknown episode fields and per-env arguments of the wrong length raise
    SpecMismatchError and change nothing."""
    with new_buffer(lanes=3) as buf, buf.writer(num_envs=2) as vw:
        vw.add(**env_rows([0, 1], [0, 0], [0, 0]))
        before = snapshot(buf, vw)
        with pytest.raises(SpecMismatchError, match="num_envs=2"):
            vw.add(**env_rows([0, 1, 2], [0, 0, 0], [1, 1, 1]))
        with pytest.raises(SpecMismatchError, match="unknown episode field"):
            vw.end_episode(True, bogus=1)
        with pytest.raises(SpecMismatchError, match="return"):
            vw.end_episode(True, **{"return": [1.0, 2.0, 3.0]})
        with pytest.raises(SpecMismatchError, match="truncated"):
            vw.end_episode(True, truncated=[True, False, True])
        with pytest.raises(SpecMismatchError, match="env_mask"):
            vw.end_episode([True, False, True])
        assert snapshot(buf, vw) == before
    with new_buffer(lanes=2, episode_spec=None) as buf, buf.writer(num_envs=2) as vw:
        vw.add(**env_rows([0, 1], [0, 0], [0, 0]))
        before = snapshot(buf, vw)
        with pytest.raises(SpecMismatchError, match="episode spec"):
            vw.end_episode(True, **{"return": 1.0})
        assert snapshot(buf, vw) == before


def test_vector_writer_needs_as_many_lanes_as_envs():
    with new_buffer(lanes=2) as buf:
        with pytest.raises(ValueError, match="lanes >= num_envs"):
            buf.writer(num_envs=3)
        with pytest.raises(ValueError, match="num_envs=3"):
            buf.writer(num_envs=3, lanes=[0, 1])
        with buf.writer(num_envs=2):  # nothing was leaked by the failures: both lanes free
            pass


def test_a_writer_after_a_vector_writer_continues_its_episodes():
    """The VectorWriter keeps each lane's episode words: a later Writer on a lane whose episode
    was ended continues with the next id; on a lane left mid-episode it starts a new one."""
    with new_buffer(lanes=2) as buf:
        with buf.writer(num_envs=2) as vw:
            vw.add(**env_rows([0, 1], [0, 0], [0, 0]))
            vw.end_episode([True, False])
        with buf.writer(lane=0) as w:
            assert (w.episode, w.step) == (1, 0)
        with buf.writer(lane=1) as w:
            assert (w.episode, w.step) == (1, 0)  # episode 0 was left open: abandoned
        assert buf.storage.lane_words[0, L.LANE_EPISODE_START, 0] == 1


# --------------------------------------------------------------------------------------------
# Sampling splits a batch across lanes in proportion to what they hold
# --------------------------------------------------------------------------------------------
def _lane_counts(buf: shmbuf.ReplayBuffer, draws: int, **plan) -> np.ndarray:
    rng = np.random.default_rng(11)
    counts = np.zeros(buf.lanes, np.int64)
    for _ in range(draws // 500):
        if plan or buf.derived_next_obs:
            compiled = buf.compile(**plan)
            out = compiled.allocate(500)
            draw = buf.sample_into(out, rng, plan=compiled)
        else:
            draw = buf.sample_into({"action": np.empty(500, np.int64)}, rng)
        counts += np.bincount(draw.lanes, minlength=buf.lanes)
    return counts


def _assert_proportional(counts: np.ndarray, weights: list[int]) -> None:
    n = counts.sum()
    p = np.asarray(weights, float) / sum(weights)
    sigma = np.sqrt(n * p * (1 - p))
    assert (np.abs(counts - n * p) < 5 * sigma).all(), f"counts {counts}, expected {n * p}"


def test_sampling_splits_a_batch_across_lanes_in_proportion_to_what_they_hold():
    """Lanes holding 10, 30 and 60 transitions get about 10%, 30% and 60% of 40,000 draws
    (within 5 sigma); a full lane is weighted by its capacity, not by what it ever received."""
    with new_buffer(capacity=64, lanes=3) as buf:
        for lane, n in enumerate([10, 30, 60]):
            with buf.writer(lane=lane) as w:
                add_steps(w, lane, 0, n)
        _assert_proportional(_lane_counts(buf, 40_000), [10, 30, 60])
        with buf.writer(lane=0) as w:
            add_steps(w, 0, 1, 200)  # wraps: holds 64
        _assert_proportional(_lane_counts(buf, 40_000), [64, 30, 60])


def test_vector_writer_lanes_are_sampled_in_proportion_to_their_usable_steps():
    """Derived buffer written by a VectorWriter: env lanes end episodes at different times, so
    they hold different numbers of FINAL rows and usable transitions; draws follow the usable
    transitions (sequences: the usable windows)."""
    with new_buffer("derived", capacity=64, lanes=2) as buf:
        with buf.writer(num_envs=2) as vw:
            for s in range(20):
                vw.add(**env_rows([0, 1], [vw.episode[0], vw.episode[1]],
                                  [int(vw._step[0]), int(vw._step[1])]))
                vw.end_episode([True, s % 5 == 4])  # lane 0: 1-step episodes; lane 1: 5-step
        # lane 0: 20 episodes of one step, each with a FINAL row: 20 usable transitions
        # lane 1: 4 episodes of five steps: 20 usable transitions
        _assert_proportional(_lane_counts(buf, 20_000), [20, 20])
        # windows of 3 steps inside one episode: none in lane 0, 4 * 3 in lane 1
        counts = _lane_counts(buf, 5_000, sequence_length=3)
        assert counts.tolist() == [0, 5_000]
        assert tag(1, 0, 0) in buf.sample(200, 1, sequence_length=3)["action"][:, 0]
