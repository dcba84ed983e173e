"""Sequence windows with a stride between their starts, and frame stacks inside windows
(``Plan(sequence_length=T, stride=s, frame_stack=k)``, what R2D2 reads).

What is proved here:
- ``Plan`` refuses bad strides and the combinations it cannot do, with ``ValueError`` naming
  the field, the value and the fix;
- for generated episode structures (wrapping lanes, truncations, abandoned and open episodes,
  stored and derived next_obs), every window delivered equals a plain-Python model built from
  the episodes alone: it starts at a step of its episode that is a multiple of the stride,
  each step's stack is that step's last k frames of its episode (zero and masked before the
  episode's start and at the steps ``mask`` leaves out), and every such window is drawn;
- uniform draws are uniform over the strided starts (chi-square), prioritized draws come up
  in proportion to the starts' priorities and never at another step, epochs hold every
  strided start once, and sampler workers under every start method deliver the model's
  windows.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf.sampling import Plan
from tests.episode_model import (
    ABANDONED,
    OPEN,
    TERMINATED,
    TRUNCATED,
    Episode,
    Model,
    make_spec,
    obs_value,
    write,
)
from tests.test_prioritized import chi_square_p
from tests.test_sampling_props import MODES, PROPS, Scenario, sample_and_check, scenarios, written

pytestmark = pytest.mark.timeout(120)


class WindowModel(Model):
    """``Model`` with strides and stacked windows: what a window plan must deliver."""

    def _sequence(self, lane, index, outputs, plan, want_next):
        first = self.transition_at(lane, index)
        if first is None or first[1] % plan.stride:
            return None
        k = plan.frame_stack
        stacked = {n for n in outputs if k > 1 and (n in plan.stack_fields or (
            n == "next_obs" and plan.obs_field in plan.stack_fields))}
        plain = {n: o for n, o in outputs.items() if n not in stacked and not n.endswith("_mask")}
        out = super()._sequence(lane, index, plain, plan, want_next)
        if out is None or not stacked:
            return out
        e, s0 = first
        lo = self.lanes[lane].lo
        mask = out["mask"]
        for name in stacked:
            shape, dtype = outputs[name]
            arr, valid = np.zeros(shape, dtype), np.zeros(shape[:2], bool)
            shift = 1 if name == "next_obs" else 0  # next_obs: the stack one step on
            for j in np.flatnonzero(mask):
                for w in range(k):
                    step = s0 + j + shift - (k - 1) + w
                    if step < 0:
                        continue  # before the episode's start: zero
                    if step < s0 and index - (s0 - step) < lo:
                        return None  # a look-back frame of the episode was overwritten
                    valid[j, w] = True
                    arr[j, w] = (obs_value(lane, e, step) if name == "next_obs"
                                 else self.value(name, lane, e, step))
            out[name], out[f"{name}_mask"] = arr, valid
        return out


# --------------------------------------------------------------------------------------------
# Plan refuses what it cannot do
# --------------------------------------------------------------------------------------------
BAD_PLANS = {
    "stride 0": (dict(sequence_length=4, stride=0), r"stride must be an int >= 1, got 0"),
    "stride negative": (dict(sequence_length=4, stride=-2), r"stride must be an int >= 1, got -2"),
    "stride float": (dict(sequence_length=4, stride=2.0), r"stride must be an int >= 1, got 2\.0"),
    "stride bool": (dict(sequence_length=4, stride=True), r"stride must be an int >= 1, got True"),
    "stride str": (dict(sequence_length=4, stride="2"), r"stride must be an int >= 1, got '2'"),
    "stride without sequences": (dict(stride=4), r"stride=4 spaces the starts of sequence "
                                 r"windows, and sequence_length is 1\. Fix: pass "
                                 r"sequence_length=T > 1 with it, or drop stride"),
    "stride with frame stacks only": (dict(frame_stack=4, stride=2), r"stride=2 .* Fix"),
    "sequence and n-step": (dict(sequence_length=4, n_step=3),
                            r"sequence_length cannot be combined with n_step or frame_lookahead "
                            r"\(got n_step=3, frame_lookahead=0\).*Accumulate returns in the "
                            r"learner"),
    "sequence and lookahead": (dict(sequence_length=4, frame_stack=2, frame_lookahead=1),
                               r"\(got n_step=1, frame_lookahead=1\)"),
    "frame_stack 0 in a window": (dict(sequence_length=4, frame_stack=0),
                                  r"frame_stack must be an int >= 1, got 0"),
    "lookahead bool": (dict(frame_stack=2, frame_lookahead=True),
                       r"frame_lookahead must be an int >= 0, got True"),
    "stack_fields str": (dict(sequence_length=4, frame_stack=2, stack_fields="obs"),
                         r"stack_fields must be a tuple of field names, got 'obs'\. Fix: "
                         r"stack_fields=\('obs',\)"),
}


@pytest.mark.parametrize("name", list(BAD_PLANS))
def test_plan_refuses_bad_strides_and_combinations_naming_value_and_fix(name):
    kwargs, message = BAD_PLANS[name]
    with pytest.raises(ValueError, match=message) as info:
        Plan(**kwargs)
    assert type(info.value) is ValueError


def test_compiled_window_plan_names_its_arrays():
    """``[T, k, ...]`` stacks with ``[T, k]`` masks beside the plain ``[T, ...]`` fields."""
    with shmbuf.ReplayBuffer.create(make_spec(True), 32, next_obs="derived") as buf:
        compiled = buf.compile(sequence_length=5, stride=2, frame_stack=3)
        shapes = {n: (s, np.dtype(d)) for n, s, d in compiled.outputs}
        assert shapes == {
            "obs": ((5, 3, 3), np.dtype(np.float32)), "obs_mask": ((5, 3), np.dtype(bool)),
            "next_obs": ((5, 3, 3), np.dtype(np.float32)),
            "next_obs_mask": ((5, 3), np.dtype(bool)),
            "action": ((5,), np.dtype(np.int64)), "reward": ((5,), np.dtype(np.float32)),
            "terminated": ((5,), np.dtype(bool)), "truncated": ((5,), np.dtype(bool)),
            "mask": ((5,), np.dtype(bool))}
        assert compiled.index_shape == (5,)
        with pytest.raises(shmbuf.SpecMismatchError, match=r"frame_stack needs a 'pixels'"):
            buf.compile(sequence_length=5, frame_stack=3, stack_fields=("pixels",))


# --------------------------------------------------------------------------------------------
# Every delivered window equals the model, and every window the model allows is drawn
# --------------------------------------------------------------------------------------------
WINDOW_PLANS = st.fixed_dictionaries({
    "sequence_length": st.integers(2, 4), "stride": st.integers(1, 3),
    "frame_stack": st.integers(1, 3), "cross_episodes": st.booleans()})
FIELDS = st.sampled_from([None, ["obs", "action"], ["next_obs", "action"]])


@settings(PROPS, max_examples=80)
@given(sc=scenarios(), mode=MODES, plan=WINDOW_PLANS, fields=FIELDS)
def test_strided_stacked_windows_equal_the_model(sc, mode, plan, fields):
    with written(sc, mode) as (buf, _):
        model = WindowModel(sc.episodes, mode == "derived", sc.capacity)
        compiled = buf.compile(fields=fields, **plan)
        sample_and_check(buf, model, compiled, batches=60, seed=5)


@settings(PROPS, max_examples=25)
@given(sc=scenarios(), mode=MODES, plan=WINDOW_PLANS)
def test_sample_returns_what_sample_into_returns_for_windows(sc, mode, plan):
    with written(sc, mode) as (buf, _):
        model = WindowModel(sc.episodes, mode == "derived", sc.capacity)
        compiled = buf.compile(**plan)
        if not model.drawable(compiled):
            return
        out = compiled.allocate(8)
        buf.sample_into(out, np.random.default_rng(3), plan=compiled)
        batch = buf.sample(8, np.random.default_rng(3), **plan)
        assert sorted(batch) == sorted(out)
        for name in out:
            np.testing.assert_array_equal(batch[name], out[name], err_msg=name)


# --------------------------------------------------------------------------------------------
# Distributions: uniform over strided starts; prioritized per start; epochs
# --------------------------------------------------------------------------------------------
LONG = [[Episode(23, TERMINATED), Episode(9, TRUNCATED), Episode(30, ABANDONED),
         Episode(17, TERMINATED), Episode(12, OPEN)],
        [Episode(41, TRUNCATED), Episode(5, TERMINATED), Episode(26, OPEN, True)]]
LONG_PLAN = dict(sequence_length=6, stride=4, frame_stack=3, cross_episodes=True)


def _written(mode: str, capacity: int = 128):
    buf = shmbuf.ReplayBuffer.create(make_spec(mode == "derived"), capacity, lanes=len(LONG),
                                     next_obs=mode)
    write(buf, LONG, extend=[True, False])
    return buf, WindowModel(LONG, mode == "derived", capacity)


@pytest.mark.parametrize("cross_episodes", [True, False])
def test_uniform_draws_are_uniform_over_the_strided_starts(cross_episodes):
    """40 batches of 64 windows: every start is a drawable strided one, and their counts fit a
    uniform distribution over those starts (while a draw that favoured lanes or episodes by
    their number of rows would not)."""
    plan = {**LONG_PLAN, "cross_episodes": cross_episodes}
    buf, model = _written("derived")
    with buf:
        compiled = buf.compile(**plan)
        expected = model.drawable(compiled)
        keys = sorted(expected)
        assert all(k[1] >= 0 for k in keys) and len(keys) >= 15
        counts = dict.fromkeys(keys, 0)
        out, rng = compiled.allocate(64), np.random.default_rng(11)
        for _ in range(40):
            draw = buf.sample_into(out, rng, plan=compiled)
            for key in zip(draw.lanes.tolist(), draw.indices[:, 0].tolist()):
                counts[key] += 1  # a KeyError here: a start the model forbids
        got = np.array([counts[k] for k in keys])
        assert chi_square_p(got, np.full(len(keys), 1 / len(keys))) > 1e-3
        assert (got > 0).all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n_workers", [0, 1])
def test_prioritized_windows_come_up_by_their_start_priority_and_only_at_strides(n_workers):
    from workers import SamplerPool
    from workers.config import Workers
    from workers.selection import Prioritized

    buf, model = _written("derived")
    with buf:
        compiled = buf.compile(**LONG_PLAN)
        expected = model.drawable(compiled)
        # A start enters the table once its whole probe (T steps and the next row) is written:
        # the newest windows of the open episodes (masked short for uniform draws) wait.
        hi, lag = buf.windows().hi, LONG_PLAN["sequence_length"]
        keys = sorted(k for k in expected if k[1] + lag < hi[k[0]])
        assert len(expected) - len(keys) == 3
        lanes = np.array([k[0] for k in keys])
        starts = np.array([k[1] for k in keys])
        priorities = 1.0 + np.arange(len(keys)) % 5
        counts = dict.fromkeys(keys, 0)
        with SamplerPool(buf, 32, selection=Prioritized(alpha=1.0, beta=0.5, eps=0.0),
                         plan=Plan(**LONG_PLAN),
                         workers=Workers(n_workers, start_method="fork"), seed=0,
                         timeout=30) as pool:
            first = pool.next(timeout=30)
            first.release()
            assert pool.update_priorities(starts, priorities, lanes=lanes) == len(keys)
            for _ in range(3 * n_workers + 2):  # batches staged before the update
                pool.next(timeout=30).release()
            for _ in range(150):
                batch = pool.next(timeout=30)
                arrays = {n: np.asarray(batch[n]) for n in batch}
                for b, key in enumerate(zip(np.asarray(batch.lanes).tolist(),
                                            np.asarray(batch.indices)[:, 0].tolist())):
                    counts[key] += 1  # a KeyError: a start off the stride or not drawable
                    for name, want in expected[key].items():
                        np.testing.assert_array_equal(arrays[name][b], want, err_msg=name)
                drawn = priorities[[keys.index(k) for k in zip(
                    np.asarray(batch.lanes).tolist(), np.asarray(batch.indices)[:, 0].tolist())]]
                np.testing.assert_allclose(np.asarray(batch.weights),
                                           (drawn / priorities.min()) ** -0.5, rtol=1e-5)
        got = np.array([counts[k] for k in keys])
        assert chi_square_p(got, priorities / priorities.sum()) > 1e-3
        assert chi_square_p(got, np.full(len(keys), 1 / len(keys))) < 1e-6


def test_an_epoch_holds_every_strided_start_once():
    from workers import SamplerPool
    from workers.config import Workers
    from workers.selection import Epoch

    buf, model = _written("stored")
    with buf:
        expected = model.drawable(buf.compile(**LONG_PLAN))
        assert buf.anchors(buf.compile(**LONG_PLAN)).indices.size == len(expected)
        with SamplerPool(buf, 8, selection=Epoch(drop_last=False), plan=Plan(**LONG_PLAN),
                         workers=Workers(0), seed=1, timeout=30) as pool:
            seen: list[tuple[int, int]] = []
            for batch in pool.epoch():
                lanes, starts = np.asarray(batch.lanes), np.asarray(batch.indices)[:, 0]
                for b, key in enumerate(zip(lanes.tolist(), starts.tolist())):
                    seen.append(key)
                    np.testing.assert_array_equal(np.asarray(batch["obs"])[b],
                                                  expected[key]["obs"])
        assert sorted(seen) == sorted(expected)


@pytest.mark.timeout(90)
def test_sampler_workers_deliver_the_models_windows(start_method):
    """A worker started by each method assembles the same strided, stacked windows."""
    from workers import SamplerPool
    from workers.config import Workers

    buf, model = _written("derived", capacity=64)  # lanes wrapped: look-back frames lost
    with buf:
        expected = model.drawable(buf.compile(**LONG_PLAN))
        seen = set()
        with SamplerPool(buf, 16, plan=Plan(**LONG_PLAN),
                         workers=Workers(1, start_method=start_method), seed=2,
                         timeout=60) as pool:
            for _ in range(40):
                batch = pool.next(timeout=60)
                arrays = {n: np.asarray(batch[n]) for n in batch}
                keys = list(zip(np.asarray(batch.lanes).tolist(),
                                np.asarray(batch.indices)[:, 0].tolist()))
                for b, key in enumerate(keys):
                    assert key in expected, key
                    for name, want in expected[key].items():
                        np.testing.assert_array_equal(arrays[name][b], want, err_msg=name)
                seen.update(keys)
        assert seen == set(expected)


def test_windows_too_long_for_every_episode_fail_naming_the_stride():
    sc = Scenario(16, [[Episode(3, TERMINATED), Episode(3, TRUNCATED), Episode(3, OPEN)]],
                  False, [False])
    with written(sc, "stored") as (buf, _):
        with pytest.raises(shmbuf.errors.SamplingError, match=r"stride 2 .* Fix: "
                           r"cross_episodes=True, or a shorter sequence"):
            buf.sample(4, 0, sequence_length=4, stride=2)


@pytest.mark.parametrize("mode", ["stored", "derived"])
@pytest.mark.parametrize("cross_episodes", [True, False])
def test_start_share_counts_the_starts_uniform_draws_choose_among(mode, cross_episodes):
    """``PlanReader.start_share`` (a cluster splits uniform windows by it): judged whole, the
    anchor rows times the share are exactly the model's drawable starts, over two lanes with a
    stride; from a few draws at a time, the estimates average to the same count (unbiased)."""
    from shmbuf.reader import PlanReader

    buf, model = _written(mode)
    with buf:
        compiled = buf.compile(**{**LONG_PLAN, "cross_episodes": cross_episodes})
        want = len(model.drawable(compiled))
        reader = PlanReader(buf.storage, compiled)
        rng = np.random.default_rng(5)
        rows, share = reader.start_share(rng, draws=4096)
        assert rows <= 4096 and rows * share == pytest.approx(want)
        estimates = np.array([np.prod(reader.start_share(rng, draws=8)) for _ in range(400)])
        assert rows > 8 and estimates.std() > 0  # (estimated: not judged whole)
        assert abs(estimates.mean() - want) < 4 * estimates.std() / np.sqrt(estimates.size), \
            (estimates.mean(), want)
