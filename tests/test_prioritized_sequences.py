"""Prioritized sequences (R2D2): ``SamplerPool(selection=Prioritized(...),
plan=Plan(sequence_length=T))``.

What is proved here:
- windows come up in proportion to their start's priority (chi-square at a fixed seed, with the
  power to reject uniform draws), and a window crossing an episode end never comes up;
- ``batch.weights`` are ``(P_i / P_min)^-beta`` of the window starts' priorities;
- ``update_priorities`` with ``[B, T]`` priorities stores ``eta * max + (1 - eta) * mean`` per
  window (against a NumPy reference, for the default eta and another), ``[B]`` priorities are
  kept as they are, bad steps or shapes change nothing; with ``mask=batch["mask"]`` the
  reduction runs over the steps of the window's first episode only;
- an update for a window whose start was overwritten since is dropped;
- with workers under every start method, and writers lapping the ring meanwhile: no raise,
  every row of every window whole (self-checking rows), consecutive, and inside one episode
  (or, with ``cross_episodes``, masked from the first step of another on);
- the same works for frame stacks (one priority per stacked step).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import pytest

import shmbuf
from shmbuf.sampling import Plan
from shmbuf.window_priority import WindowPriorityTable, reduce_windows
from tests import pool_procs as procs
from tests.test_prioritized import chi_square_p
from workers import ActorGroup, SamplerPool
from workers.config import Workers
from workers.selection import Prioritized

pytestmark = pytest.mark.timeout(120)

EPISODE = 13  # every episode holds 13 steps: step i is in episode i // EPISODE


def write_episodes(buf: shmbuf.ReplayBuffer, rows_per_lane: int) -> None:
    """Self-checking rows into every lane, an episode ending after every ``EPISODE`` steps."""
    for lane in range(buf.lanes):
        with buf.writer(lane=lane, timeout=5) as w:
            for first in range(int(w.committed), int(w.committed) + rows_per_lane, EPISODE):
                w.extend(procs.make_batch(lane, np.arange(first, first + EPISODE)))
                w.end_episode()


def episode_writer(ctx: Any) -> None:
    """An actor: episodes of ``EPISODE`` self-checking steps, flat out, until asked to stop."""
    w, lane = ctx.writer, ctx.lane
    while not ctx.stopping:
        first = int(w.committed)
        w.extend(procs.make_batch(lane, np.arange(first, first + EPISODE)))
        w.end_episode()


def strict_starts(committed: int, length: int, lo: int = 0) -> np.ndarray:
    """Window starts in [lo, committed) whose ``length`` steps lie inside one episode."""
    starts = np.arange(lo, committed - length + 1)
    return starts[starts // EPISODE == (starts + length - 1) // EPISODE]


def assert_windows_ok(batch: Any, length: int, cross_episodes: bool = False) -> None:
    """Every step of every window is whole and the (lane, index) the batch names; steps are
    consecutive; a window stays in its start's episode (cross: masked from the next one on)."""
    indices, lanes = np.asarray(batch.indices), np.asarray(batch.lanes)
    assert indices.shape == (lanes.size, length), indices.shape
    np.testing.assert_array_equal(indices - indices[:, :1], np.arange(length)[None, :].repeat(
        lanes.size, 0))
    same_episode = indices // EPISODE == indices[:, :1] // EPISODE
    mask = np.asarray(batch["mask"]) if cross_episodes else np.ones(indices.shape, bool)
    if cross_episodes:
        np.testing.assert_array_equal(mask, same_episode)  # masked exactly past the episode
        assert (np.asarray(batch["index"])[~mask] == 0).all()  # zero-padded
    else:
        assert same_episode.all(), indices[~same_episode.all(axis=1)]
    rows = {k: np.asarray(batch[k])[mask] for k in procs.FIELDS}
    bad = procs.bad_rows(rows, np.repeat(lanes, length).reshape(indices.shape)[mask],
                         indices[mask])
    assert not bad.any(), f"{int(bad.sum())} torn or foreign rows"


def _pool(buf: shmbuf.ReplayBuffer, n_workers: int = 0, start_method: str | None = None,
          **kw: Any) -> SamplerPool:
    """A prioritized pool (alpha 1, eps 0) of windows of 4, in process, unless ``kw`` says
    otherwise."""
    args: dict[str, Any] = dict(batch_size=32, selection=Prioritized(alpha=1.0, eps=0.0),
                                plan=Plan(sequence_length=4), seed=0, timeout=30)
    args.update(kw)
    return SamplerPool(buf, workers=Workers(n_workers, start_method=start_method), **args)


# --------------------------------------------------------------------------------------------
# Proportional draws and importance weights (in-process: no batch is prefetched)
# --------------------------------------------------------------------------------------------
def test_windows_come_up_in_proportion_to_their_start_priority():
    """Valid starts get priorities 1..4; 400 batches of 32 windows: counts fit those
    priorities (and not uniform ones), and no window crossing an episode end comes up."""
    with procs.new_buffer(capacity=256, lanes=1, rows=0) as buf:
        write_episodes(buf, 13 * 10)
        with _pool(buf) as pool:
            pool.next()
            starts = strict_starts(130, 4)
            priorities = 1.0 + starts % 4
            assert pool.update_priorities(starts, priorities, lanes=0) == starts.size
            counts = np.zeros(130, np.int64)
            for _ in range(400):
                batch = pool.next()
                assert_windows_ok(batch, 4)
                np.add.at(counts, np.asarray(batch.indices)[:, 0], 1)
    invalid = np.setdiff1d(np.arange(130), starts)
    assert counts[invalid].sum() == 0, np.flatnonzero(counts[invalid])
    assert chi_square_p(counts[starts], priorities / priorities.sum()) > 1e-3
    assert chi_square_p(counts[starts], np.full(starts.size, 1 / starts.size)) < 1e-6


def test_importance_weights_of_windows():
    """``weights = (P_i / P_min)^-beta`` from the priorities the test set, beta = 0.5."""
    with procs.new_buffer(capacity=256, lanes=1, rows=0) as buf:
        write_episodes(buf, 13 * 6)
        with _pool(buf, selection=Prioritized(alpha=1.0, beta=0.5, eps=0.0)) as pool:
            pool.next()
            starts = strict_starts(78, 4)
            # all above the 1.0 new starts enter with: a start entered but never valid would
            # make the smallest probability (and so every weight) wrong
            priorities = 2.0 + starts.astype(np.float64)
            pool.update_priorities(starts, priorities, lanes=0)
            for _ in range(5):
                batch = pool.next()
                drawn = priorities[np.searchsorted(starts, np.asarray(batch.indices)[:, 0])]
                np.testing.assert_allclose(np.asarray(batch.weights),
                                           (drawn / priorities.min()) ** -0.5, rtol=1e-6)


def test_starts_enter_once_their_window_is_written_and_only_if_it_is_valid():
    """The table itself: a start whose window crosses an episode end holds zero, a valid one
    the maximum priority; the newest T - 1 starts wait (zero) until their window is written."""
    with procs.new_buffer(capacity=256, lanes=1, rows=0) as buf:
        write_episodes(buf, 13 * 3)
        table = WindowPriorityTable.create_for(buf, buf.compile(sequence_length=4), 1.0, 0.0)
        try:
            table.sync(buf)
            starts = np.arange(39)
            expected = np.isin(starts, strict_starts(39, 4)).astype(float)
            np.testing.assert_array_equal(table.leaf_values(np.zeros(39, np.int64), starts),
                                          expected)
            assert table.total() == expected.sum()
            with buf.writer(lane=0, timeout=5) as w:
                w.extend(procs.make_batch(0, np.arange(39, 41)))  # episode 3 begins: 2 rows
                table.sync(buf)
                np.testing.assert_array_equal(
                    table.leaf_values(np.zeros(41, np.int64), np.arange(41)),
                    np.r_[expected, 0.0, 0.0])
                w.extend(procs.make_batch(0, np.arange(41, 45)))  # windows at 39..41 written
                table.sync(buf)
            assert table.leaf_values(np.zeros(4, np.int64), np.arange(39, 43)).tolist() == [
                1.0, 1.0, 1.0, 0.0]
            assert table.total() == expected.sum() + 3
            # an update for a start no batch can be read at leaves it at zero
            invalid = np.array([10, 11, 12, 42])
            assert table.update(np.zeros(4, np.int64), invalid, np.full(4, 7.0)) == 0
            assert (table.leaf_values(np.zeros(4, np.int64), invalid) == 0).all()
        finally:
            table.close()


# --------------------------------------------------------------------------------------------
# update_priorities: the R2D2 reduction, shapes, bad values, overwritten starts
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eta", [None, 0.3])
def test_updates_of_shape_b_t_store_the_r2d2_reduction(eta):
    kw = {} if eta is None else {"eta": eta}
    with procs.new_buffer(capacity=256, lanes=2, rows=0) as buf:
        write_episodes(buf, 13 * 8)
        with _pool(buf, plan=Plan(sequence_length=5),
                   selection=Prioritized(alpha=0.7, eps=1e-3, **kw)) as pool:
            table = pool._table
            assert isinstance(table, WindowPriorityTable)
            batch = pool.next()
            td = np.random.default_rng(1).exponential(2.0, (32, 5))
            assert pool.update_priorities(batch.indices, td) == 32
            e = 0.9 if eta is None else eta
            expected = {}  # NumPy reference, the last of repeated windows wins
            for lane, start, steps in zip(batch.lanes, np.asarray(batch.indices)[:, 0], td):
                expected[(int(lane), int(start))] = (
                    (e * np.max(steps) + (1 - e) * np.sum(steps) / steps.size + 1e-3) ** 0.7)
            keys = np.array(list(expected))
            np.testing.assert_allclose(table.leaf_values(keys[:, 0], keys[:, 1]),
                                       list(expected.values()), rtol=1e-12)
            # [B] priorities are taken as they are (for batch.indices or their starts)
            batch = pool.next()
            per_window = np.linspace(0.5, 3.0, 32)
            pool.update_priorities(batch.indices, per_window)
            last = {(int(k), int(s)): p for k, s, p in
                    zip(batch.lanes, np.asarray(batch.indices)[:, 0], per_window)}
            keys = np.array(list(last))
            np.testing.assert_allclose(table.leaf_values(keys[:, 0], keys[:, 1]),
                                       (np.array(list(last.values())) + 1e-3) ** 0.7)


def test_a_mask_keeps_the_steps_past_an_episode_end_out_of_the_reduction():
    """``update_priorities(..., mask=batch["mask"])`` with ``cross_episodes=True``: each window's
    max and mean run over the steps of its first episode only, whatever the others hold (NaN
    included); bad masks and masks without per-step priorities change nothing."""
    with procs.new_buffer(capacity=256, lanes=2, rows=0) as buf:
        write_episodes(buf, 13 * 8)
        with _pool(buf, plan=Plan(sequence_length=5, cross_episodes=True),
                   selection=Prioritized(alpha=0.7, eps=1e-3)) as pool:
            table = pool._table
            assert isinstance(table, WindowPriorityTable)
            batch = pool.next()
            mask = np.asarray(batch["mask"]).copy()
            assert not mask.all() and mask[:, 0].all()  # some windows cross an episode end
            td = np.random.default_rng(2).exponential(2.0, (32, 5))
            td[~mask] = np.nan  # past the end: not the window's, never read
            before = table.sums.copy()
            with pytest.raises(ValueError, match="bool array of shape"):
                pool.update_priorities(batch.indices, td, mask=mask.astype(np.int8))
            empty = mask.copy()
            empty[3] = False
            with pytest.raises(ValueError, match="no step of window 3"):
                pool.update_priorities(batch.indices, td, mask=empty)
            with pytest.raises(ValueError, match="per-step priorities"):
                pool.update_priorities(batch.indices, np.ones(32), mask=mask)
            with pytest.raises(shmbuf.InvalidPriorityError):  # no mask: NaN steps are read
                pool.update_priorities(batch.indices, td)
            np.testing.assert_array_equal(table.sums, before)
            assert pool.update_priorities(batch.indices, td, mask=mask) == 32
            expected = {}  # NumPy reference over the kept steps, the last of repeats wins
            for lane, start, steps, keep in zip(batch.lanes, np.asarray(batch.indices)[:, 0],
                                                td, mask):
                kept = steps[keep]
                expected[(int(lane), int(start))] = (
                    (0.9 * kept.max() + 0.1 * kept.mean() + 1e-3) ** 0.7)
            keys = np.array(list(expected))
            np.testing.assert_allclose(table.leaf_values(keys[:, 0], keys[:, 1]),
                                       list(expected.values()), rtol=1e-12)
    with procs.new_buffer(capacity=64, lanes=1) as buf, \
         SamplerPool(buf, batch_size=8, selection=Prioritized(), workers=0, seed=0) as pool:
        batch = pool.next()
        with pytest.raises(ValueError, match="not sequences"):
            pool.update_priorities(batch.indices, np.ones(8), mask=np.ones(8, bool))


def test_reduce_windows_matches_its_definition():
    td = np.array([[1.0, 3.0, 2.0], [0.0, 0.0, 6.0]])
    np.testing.assert_allclose(reduce_windows(td, 0.9), [0.9 * 3 + 0.1 * 2, 0.9 * 6 + 0.1 * 2])
    np.testing.assert_allclose(reduce_windows(td, 0.0), [2.0, 2.0])


def test_bad_window_priorities_change_nothing():
    with procs.new_buffer(capacity=256, lanes=1, rows=0) as buf:
        write_episodes(buf, 13 * 4)
        with _pool(buf) as pool:
            batch = pool.next()
            before = pool._table.sums.copy()
            td = np.ones((32, 4))
            td[7, 2] = -1.0  # a negative step a max over the window would hide
            with pytest.raises(shmbuf.InvalidPriorityError, match="step 2 of window 7"):
                pool.update_priorities(batch.indices, td)
            td[7, 2] = np.nan
            with pytest.raises(shmbuf.InvalidPriorityError, match="nan"):
                pool.update_priorities(batch.indices, td)
            with pytest.raises(ValueError, match="per step"):
                pool.update_priorities(batch.indices, np.ones((32, 3)))
            np.testing.assert_array_equal(pool._table.sums, before)


def test_updates_for_overwritten_starts_are_dropped():
    """A batch taken, then the lane lapped: its update applies to nothing, and the windows
    now in those slots keep the priority they entered with."""
    with procs.new_buffer(capacity=128, lanes=1, rows=0) as buf:
        write_episodes(buf, 13 * 9)
        with _pool(buf) as pool:
            indices = np.array(pool.next().indices)
            write_episodes(buf, 13 * 11)  # every slot rewritten
            pool.next()
            table = pool._table
            dropped = table.updates_dropped
            assert pool.update_priorities(indices, np.full((32, 4), 50.0), lanes=0) == 0
            assert table.updates_dropped == dropped + 32
            w = buf.windows()
            held = strict_starts(int(w.hi[0]), 4, int(w.lo[0]))
            np.testing.assert_array_equal(table.leaf_values(np.zeros(held.size, np.int64), held),
                                          1.0)


# --------------------------------------------------------------------------------------------
# Workers, episodes, lapping writers
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cross_episodes", [False, True])
def test_windows_with_workers_are_whole_and_respect_episodes(start_method, cross_episodes):
    with procs.new_buffer(capacity=256, lanes=2, rows=0) as buf:
        write_episodes(buf, 13 * 12)
        with _pool(buf, n_workers=2, start_method=start_method,
                   plan=Plan(sequence_length=6, cross_episodes=cross_episodes)) as pool:
            rng = np.random.default_rng(0)
            crossed = 0
            for _ in range(40):
                batch = pool.next()
                assert_windows_ok(batch, 6, cross_episodes)
                crossed += int((~np.asarray(batch["mask"])).any(axis=1).sum())
                pool.update_priorities(batch.indices, rng.exponential(1.0, (32, 6)))
    assert (crossed > 0) == cross_episodes


@pytest.mark.parametrize("n_workers", [0, 2])
def test_writers_lapping_during_sampling_never_make_it_raise(start_method, n_workers):
    """Two actors write 13-step episodes flat out into 256-row lanes (lapping them many times)
    while the learner takes windows of 8 and sends [B, 8] priorities: no exception, every
    window whole and inside one episode, and some updates dropped as their starts moved on."""
    with procs.new_buffer(capacity=256, lanes=2, rows=0) as buf:
        write_episodes(buf, 13 * 4)
        with ActorGroup(functools.partial(episode_writer), 2, buf,
                        start_method=start_method) as group, \
             _pool(buf, n_workers=n_workers, start_method=start_method,
                   plan=Plan(sequence_length=8)) as pool:
            start = buf.committed().copy()
            deadline = time.monotonic() + 60  # actors start slowly under spawn on a busy host
            while (buf.committed() - start < 256).any():
                assert time.monotonic() < deadline, "writers did not start"
                group.poll()
                time.sleep(0.01)
            rng = np.random.default_rng(0)
            applied = sent = batches = 0
            t_end = time.monotonic() + 2.0
            while time.monotonic() < t_end or batches < 30:
                batch = pool.next(timeout=30)
                assert_windows_ok(batch, 8)
                applied += pool.update_priorities(batch.indices, rng.exponential(1.0, (32, 8)))
                sent += 32
                batches += 1
                group.poll()
            lapped = buf.committed() - start
            group.stop(timeout=10)
    assert (lapped > 4 * 256).all(), lapped
    assert 0 < applied <= sent


def test_frame_stacks_draw_one_priority_per_stacked_step():
    """Prioritized frame stacks: [B] priorities per stacked step, draws follow them, stacks
    are whole, and the first steps of an episode are padded (never frames of another)."""
    with procs.new_buffer(capacity=256, lanes=1, rows=0) as buf:
        write_episodes(buf, 13 * 4)
        with _pool(buf, plan=Plan(frame_stack=3, stack_fields=("index",))) as pool:
            pool.next()
            steps = np.arange(52)
            pool.update_priorities(steps, 1.0 + (steps % 2) * 9, lanes=0)  # odd steps 10x
            counts = np.zeros(52, np.int64)
            for _ in range(100):
                batch = pool.next()
                drawn = np.asarray(batch.indices)
                np.add.at(counts, drawn, 1)
                stack, mask = np.asarray(batch["index"]), np.asarray(batch["index_mask"])
                frames = drawn[:, None] + np.arange(-2, 1)
                valid = frames // EPISODE == drawn[:, None] // EPISODE
                np.testing.assert_array_equal(mask, valid)
                np.testing.assert_array_equal(stack, np.where(valid, frames, 0))
    assert chi_square_p(counts, (1.0 + (steps % 2) * 9) / (1.0 + (steps % 2) * 9).sum()) > 1e-3


def test_n_step_with_derived_next_obs_is_prioritized_too():
    """n-step returns over a buffer that derives next_obs: rows are drawn from the table (the
    newest step waits for its next observation), [B] priorities apply, weights follow them."""
    spec = shmbuf.Spec(obs=((2,), "float32"), reward=((), "float32"),
                       terminated=((), "bool"))
    with shmbuf.ReplayBuffer.create(spec, capacity=128, lanes=1, next_obs="derived") as buf:
        with buf.writer(lane=0, timeout=5) as w:
            for step in range(60):
                last = step % 20 == 19
                w.add(obs=np.full(2, step, np.float32), reward=1.0, terminated=last,
                      next_obs=np.full(2, -1 if last else step + 1, np.float32))
                if last:
                    w.end_episode()
        with _pool(buf, plan=Plan(n_step=3, gamma=0.5),
                   selection=Prioritized(alpha=1.0, beta=1.0, eps=0.0)) as pool:
            batch = pool.next()
            steps = np.asarray(batch["obs"])[:, 0].astype(np.int64)
            np.testing.assert_array_equal(np.asarray(batch["reward"]),
                                          np.where(steps % 20 <= 17, 1.75,
                                                   np.where(steps % 20 == 18, 1.5, 1.0)))
            assert pool.update_priorities(batch.indices, np.full(32, 4.0)) == 32
            batch = pool.next()
            assert np.asarray(batch.weights).min() > 0
