"""Property tests: episode-aware sampling (sequences, frame stacks, n-step, derived next_obs)
returns exactly what a plain-Python model of the written episodes says, for every delivered row.

Hypothesis generates per-lane episode structures (lengths; terminated, truncated, abandoned by a
writer takeover; an open last episode, possibly with its terminal step already written), small
capacities so lanes wrap, one to three lanes, written with ``Writer.add``/``extend`` or a
``VectorWriter``, in stored and derived next_obs modes. ``tests.episode_model`` computes from the
episode list alone what each plan must return for each (lane, anchor), or that the anchor is not
drawable; every row of every batch is compared with it, and over many draws the set of anchors
seen must equal the drawable set. Runs are derandomized, so CI sees the same examples each time.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf.errors import EmptyBufferError, SamplingError
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
    reward_value,
    tag,
    transition,
    untag,
    write,
)

pytestmark = pytest.mark.timeout(120)

B = 16  # rows per batch
BATCHES = 30  # batches per example: ~480 draws over at most 36 window positions
PROPS = settings(max_examples=100, derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------
LENGTHS = st.integers(1, 6)


@st.composite
def lane_episodes(draw: Any) -> list[Episode]:
    """Ended and abandoned episodes, then maybe an open one (maybe with its terminal step)."""
    ends = st.sampled_from([TERMINATED, TRUNCATED, ABANDONED])
    eps = [Episode(draw(LENGTHS), draw(ends)) for _ in range(draw(st.integers(0, 5)))]
    tail = draw(st.sampled_from(["none", "open", "open_terminated"]))
    if tail != "none":
        eps.append(Episode(draw(LENGTHS), OPEN, last_terminated=tail == "open_terminated"))
    return eps


@st.composite
def vector_episodes(draw: Any, n_envs: int) -> list[list[Episode]]:
    """Per env, episodes that add up to the same number of steps (envs step together)."""
    steps = draw(st.integers(1, 24))
    per_env = []
    for _ in range(n_envs):
        cuts = sorted(draw(st.sets(st.integers(1, steps - 1), max_size=6))) if steps > 1 else []
        bounds = [0, *cuts, steps]
        ends = st.sampled_from([TERMINATED, TRUNCATED])
        eps = [Episode(b - a, draw(ends)) for a, b in zip(bounds, bounds[1:])]
        last = draw(st.sampled_from([OPEN, TERMINATED, TRUNCATED]))
        eps[-1] = Episode(eps[-1].length, last, last == OPEN and draw(st.booleans()))
        per_env.append(eps)
    return per_env


@dataclass(frozen=True)
class Scenario:
    capacity: int
    episodes: list[list[Episode]]
    vector: bool
    extend: list[bool]  # per lane: whole episodes with extend() instead of add()


@st.composite
def scenarios(draw: Any) -> Scenario:
    lanes = draw(st.integers(1, 3))
    capacity = draw(st.integers(4, 12))
    if draw(st.booleans()):
        return Scenario(capacity, draw(vector_episodes(lanes)), True, [False] * lanes)
    episodes = [draw(lane_episodes()) for _ in range(lanes)]
    return Scenario(capacity, episodes, False, [draw(st.booleans()) for _ in range(lanes)])


MODES = st.sampled_from(["stored", "derived"])


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
@contextmanager
def written(sc: Scenario, mode: str):
    """A buffer holding the scenario's episodes, and the model of what it holds."""
    derived = mode == "derived"
    buf = shmbuf.ReplayBuffer.create(make_spec(derived), sc.capacity, lanes=len(sc.episodes),
                                     next_obs=mode)
    try:
        write(buf, sc.episodes, vector=sc.vector, extend=sc.extend)
        model = Model(sc.episodes, derived, sc.capacity)
        check_layout(buf, model)
        yield buf, model
    finally:
        buf.close()


def check_layout(buf: shmbuf.ReplayBuffer, model: Model) -> None:
    """The buffer's windows and each held row's (episode, step, FINAL) are the model's."""
    win = buf.windows()
    for k, lm in enumerate(model.lanes):
        assert (int(win.lo[k]), int(win.hi[k])) == (lm.lo, lm.hi), f"lane {k} window"
        if lm.hi == lm.lo:
            continue
        rows = buf.get(np.arange(lm.lo, lm.hi), k, with_episode=True)
        got = list(zip(rows["_episode"].tolist(), rows["_step"].tolist(), rows["_final"].tolist()))
        want = [(r.episode, r.step, r.final) for r in lm.rows[lm.lo : lm.hi]]
        assert got == want, f"lane {k}: rows (episode, step, final)"


def describe(model: Model, lane: int, index: int) -> str:
    lm = model.lanes[lane]
    where = f"lane {lane} index {index} (window [{lm.lo}, {lm.hi}))"
    if not lm.lo <= index < lm.hi:
        return f"{where}: not held"
    row = lm.rows[index]
    ep = lm.episodes[row.episode]
    kind = "FINAL row" if row.final else f"step {row.step}"
    return f"{where}: {kind} of episode {row.episode} ({ep})"


def assert_rows_match(model: Model, expected: dict, plan: Any, lanes: np.ndarray,
                      indices: np.ndarray, arrays: dict[str, np.ndarray]) -> list[tuple[int, int]]:
    """Every delivered row is a drawable anchor and holds exactly what the model says."""
    anchors = indices[:, 0] if indices.ndim == 2 else indices
    if indices.ndim == 2:
        T = plan.sequence_length
        assert (indices == anchors[:, None] + np.arange(T)).all(), "sequence indices"
    keys = list(zip(lanes.tolist(), anchors.tolist()))
    for key in keys:
        assert key in expected, f"drew a non-drawable anchor: {describe(model, *key)}"
    assert sorted(arrays) == sorted(expected[keys[0]]), "output arrays"
    for name, got in arrays.items():
        want = np.stack([expected[k][name] for k in keys])
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if name in ("reward", "discount") and plan.n_step > 1:
            close = np.isclose(got, want, rtol=1e-6, atol=0)
        else:
            close = got == want
        row_ok = close.reshape(len(keys), -1).all(axis=1)
        if not row_ok.all():
            b = int(np.flatnonzero(~row_ok)[0])
            raise AssertionError(
                f"{name!r} of {describe(model, *keys[b])}: got {got[b].tolist()}, expected "
                f"{want[b].tolist()}"
            )
    return keys


def sample_and_check(buf: shmbuf.ReplayBuffer, model: Model, compiled: Any,
                     batches: int = BATCHES, seed: int = 0,
                     extra: Callable[[dict[str, np.ndarray], Any], None] | None = None) -> dict:
    """Sample ``batches`` batches with ``compiled``; check every row against the model, and that
    the anchors seen are exactly the drawable ones. Returns the model's expectations."""
    expected = model.drawable(compiled)
    n = len(expected)
    event("drawable anchors: " + ("0" if n == 0 else "1-5" if n <= 5 else
                                  "6-15" if n <= 15 else ">15"))
    if any(lm.lo > 0 for lm in model.lanes):
        event("a lane wrapped")
    out = compiled.allocate(B)
    rng = np.random.default_rng(seed)
    if not expected:
        with pytest.raises((SamplingError, EmptyBufferError)):
            buf.sample_into(out, rng, plan=compiled)
        return expected
    seen: set[tuple[int, int]] = set()
    for _ in range(batches):
        try:
            draw = buf.sample_into(out, rng, plan=compiled)
        except SamplingError:
            # Legitimate only where usable anchors are a sliver of the window (rejection sampling
            # gives up after a bounded number of rounds, so the cost stays bounded).
            assert len(expected) / model.window_total() < 0.1, "SamplingError with many anchors"
            event("SamplingError: few usable anchors")
            return expected
        seen.update(assert_rows_match(model, expected, compiled.plan, draw.lanes, draw.indices,
                                      out))
        if extra is not None:
            extra(out, draw)
    missing = sorted(set(expected) - seen)
    assert not missing, f"never drew {[describe(model, *k) for k in missing[:3]]}"
    return expected


# --------------------------------------------------------------------------------------------
# (a) strict sequences, (b) crossing sequences
# --------------------------------------------------------------------------------------------
SEQ_FIELDS = st.sampled_from([None, ["obs", "action", "reward"]])


@PROPS
@given(sc=scenarios(), mode=MODES, T=st.integers(2, 4), fields=SEQ_FIELDS)
def test_strict_sequences_stay_inside_one_episode_of_one_lane(sc, mode, T, fields):
    """No strict window crosses an episode or lane boundary or holds a FINAL, overwritten or
    unwritten row; the mask is all true; derived windows also need every step's next obs."""
    with written(sc, mode) as (buf, model):
        compiled = buf.compile(fields=fields, sequence_length=T)

        def one_episode(out, draw):
            assert out["mask"].all()
            for b in range(B):
                tags = [untag(a) for a in out["action"][b]]
                assert {t[0] for t in tags} == {int(draw.lanes[b])}, "window left its lane"
                assert len({t[1] for t in tags}) == 1, "window crossed an episode boundary"
                steps = [t[2] for t in tags]
                assert steps == list(range(steps[0], steps[0] + T)), "steps not consecutive"
            rows = buf.get(draw.indices.reshape(-1), np.repeat(draw.lanes, T), with_episode=True)
            assert not rows["_final"].any(), "a FINAL row in a strict window"

        sample_and_check(buf, model, compiled, extra=one_episode)


@PROPS
@given(sc=scenarios(), mode=MODES, T=st.integers(2, 5), fields=SEQ_FIELDS)
def test_crossing_sequences_mask_exactly_the_first_episodes_written_steps(sc, mode, T, fields):
    """With cross_episodes=True the mask is a prefix: the window's first episode's written
    steps (with a known next obs where next_obs is derived); every padded step is zero."""
    with written(sc, mode) as (buf, model):
        compiled = buf.compile(fields=fields, sequence_length=T, cross_episodes=True)

        def padded_zero(out, draw):
            mask = out["mask"]
            assert mask[:, 0].all()
            assert (np.logical_and.accumulate(mask, axis=1) == mask).all(), "mask is not a prefix"
            for name, arr in out.items():
                if name != "mask":
                    assert not arr[~mask].any(), f"padded steps of {name!r} are not zero"

        sample_and_check(buf, model, compiled, extra=padded_zero)


# --------------------------------------------------------------------------------------------
# (c) frame stacks
# --------------------------------------------------------------------------------------------
@PROPS
@given(sc=scenarios(), mode=MODES, k=st.integers(1, 3), lookahead=st.integers(0, 2),
       stack_fields=st.sampled_from([("obs",), ("obs", "action")]),
       n_step=st.sampled_from([1, 1, 2, 3]))
def test_frame_stacks_mask_exactly_the_frames_of_the_steps_episode(sc, mode, k, lookahead,
                                                                    stack_fields, n_step):
    """``<field>_mask`` marks exactly the frames inside the step's episode; padded frames are
    zero; look-ahead frames stop at the episode's last step (in both modes, for every stacked
    field); ``next_obs`` is the obs stack one step after the transition's last step."""
    if k == 1 and lookahead == 0:
        lookahead = 1  # a plan that stacks
    with written(sc, mode) as (buf, model):
        compiled = buf.compile(frame_stack=k, frame_lookahead=lookahead,
                               stack_fields=stack_fields, n_step=n_step, gamma=0.9)

        def structure(out, draw):
            for f in stack_fields:
                assert not out[f][~out[f"{f}_mask"]].any(), f"padded frames of {f!r} not zero"
            assert not out["next_obs"][~out["next_obs_mask"]].any()
            if n_step == 1:  # next_obs stack == the obs look-back stack shifted by one step
                np.testing.assert_array_equal(out["next_obs"][:, :-1], out["obs"][:, 1:k])
                np.testing.assert_array_equal(out["next_obs_mask"][:, :-1], out["obs_mask"][:, 1:k])
            assert out["next_obs_mask"][:, -1].all()

        sample_and_check(buf, model, compiled, extra=structure)


# --------------------------------------------------------------------------------------------
# (d) n-step
# --------------------------------------------------------------------------------------------
@PROPS
@given(sc=scenarios(), mode=MODES, n=st.integers(2, 4), gamma=st.sampled_from([0.5, 0.9, 1.0]))
def test_nstep_targets_equal_the_reference(sc, mode, n, gamma):
    """reward (discounted sum), discount (0 at termination, gamma^m otherwise), steps (m) and
    next_obs (the true observation after the last step) equal the reference: m stops at
    termination, at truncation, at the newest written step of an open episode, and (derived)
    before a step whose next observation is not written yet."""
    with written(sc, mode) as (buf, model):
        compiled = buf.compile(n_step=n, gamma=gamma)

        def bounds(out, draw):
            assert ((out["steps"] >= 1) & (out["steps"] <= n)).all()
            term = out["discount"] == 0
            assert (out["terminated"] == term).all(), "discount 0 exactly where it terminated"

        sample_and_check(buf, model, compiled, extra=bounds)


# --------------------------------------------------------------------------------------------
# (e) derived next_obs == stored next_obs
# --------------------------------------------------------------------------------------------
def stored_next_obs(buf: shmbuf.ReplayBuffer) -> dict[int, np.ndarray]:
    """action tag -> next_obs of every transition a stored buffer holds."""
    out = {}
    win = buf.windows()
    for k in range(buf.lanes):
        if win.hi[k] > win.lo[k]:
            rows = buf.get(np.arange(win.lo[k], win.hi[k]), k)
            out.update(zip(rows["action"].tolist(), rows["next_obs"]))
    return out


@PROPS
@given(sc=scenarios(), plan=st.sampled_from([{}, {"n_step": 3, "gamma": 0.9},
                                             {"frame_stack": 2}]))
def test_derived_next_obs_equals_the_stored_one(sc, plan):
    """The same episodes written to a stored and a derived buffer: every transition the derived
    buffer delivers is held by the stored one with the same next_obs (not full, across
    truncation, after wraps), and the newest step of an episode without end_episode() is never
    drawn from the derived buffer."""
    with written(sc, "stored") as (stored, stored_model), \
            written(sc, "derived") as (derived, model):
        truth = stored_next_obs(stored)
        newest_unended = {
            (k, lm.rows[-1].episode, lm.rows[-1].step)
            for k, lm in enumerate(model.lanes) if lm.rows and not lm.rows[-1].final
        }
        compiled = derived.compile(**plan)

        def same_as_stored(out, draw):
            for b in range(B):
                t = untag(out["action"][b])
                assert t not in newest_unended, f"drew the newest step {t} of an open episode"
                if not plan:  # one-step transitions: derived next_obs == the stored row's
                    a = int(out["action"][b])
                    assert a in truth, f"derived delivered {t}, which the stored buffer lost"
                    np.testing.assert_array_equal(out["next_obs"][b], truth[a], err_msg=str(t))

        sample_and_check(derived, model, compiled, extra=same_as_stored)
        sample_and_check(stored, stored_model, stored.compile(**plan))


@contextmanager
def both_modes(capacity: int, episodes: list[Episode]):
    """(stored, derived) one-lane buffers holding the same episodes."""
    sc = Scenario(capacity, [episodes], False, [False])
    with written(sc, "stored") as (stored, _), written(sc, "derived") as (derived, _):
        yield stored, derived


def _drawn(buf: shmbuf.ReplayBuffer, n: int = 400) -> dict[int, np.ndarray]:
    """tag -> next_obs over n one-step draws."""
    batch = buf.sample(n, np.random.default_rng(1))
    return dict(zip(batch["action"].tolist(), batch["next_obs"]))


def test_derived_next_obs_when_the_buffer_is_not_full():
    eps = [Episode(4, TERMINATED), Episode(3, OPEN)]
    with both_modes(64, eps) as (stored, derived):
        s, d = _drawn(stored), _drawn(derived)
        assert len(s) == 7 and len(d) == 6  # derived cannot know the open episode's newest next
        for a, nxt in d.items():
            np.testing.assert_array_equal(nxt, s[a])
        np.testing.assert_array_equal(d[3], obs_value(0, 0, 4))  # the true final observation


def test_derived_next_obs_across_a_truncation_is_the_true_final_observation():
    """The last step of a truncated episode bootstraps from its own final observation, never
    from the first observation of the next episode (which follows it in the ring)."""
    eps = [Episode(3, TRUNCATED), Episode(2, TRUNCATED)]
    with both_modes(64, eps) as (stored, derived):
        d = _drawn(derived)
        assert sorted(d) == [tag(0, 0, 0), tag(0, 0, 1), tag(0, 0, 2), tag(0, 1, 0), tag(0, 1, 1)]
        np.testing.assert_array_equal(d[tag(0, 0, 2)], obs_value(0, 0, 3))
        np.testing.assert_array_equal(d[tag(0, 1, 1)], obs_value(0, 1, 2))
        n = derived.sample(200, 2, n_step=5, gamma=0.5)
        first = n["action"] == 0
        assert first.any()
        np.testing.assert_array_equal(n["steps"][first], 3)
        np.testing.assert_allclose(n["discount"][first], 0.125)  # truncated: bootstrap
        assert (n["next_obs"][first] == obs_value(0, 0, 3)).all()
        assert _drawn(stored).keys() == d.keys()


def test_derived_next_obs_right_after_a_wrap():
    """Capacity 5: episode A (4 steps + FINAL) fills the lane; B's first step overwrites A's
    first. A's steps 1..3 still read their next obs (step 3's from A's FINAL row); B's newest
    step is not drawable until end_episode writes its FINAL row over A's step 1."""
    a, b = Episode(4, TERMINATED), Episode(1, TRUNCATED)
    with shmbuf.ReplayBuffer.create(make_spec(True), 5, next_obs="derived") as buf:
        with buf.writer() as w:
            for s in range(4):
                w.add(**transition(0, 0, a, s))
            w.end_episode()
            w.add(**transition(0, 1, b, 0))
            assert (int(buf.windows().lo[0]), int(buf.windows().hi[0])) == (1, 6)
            d = _drawn(buf)
            assert sorted(d) == [1, 2, 3]
            for s in (1, 2, 3):
                np.testing.assert_array_equal(d[s], obs_value(0, 0, s + 1))
            w.end_episode(truncated=True)
        assert (int(buf.windows().lo[0]), int(buf.windows().hi[0])) == (2, 7)
        d = _drawn(buf)
        assert sorted(d) == [2, 3, tag(0, 1, 0)]
        np.testing.assert_array_equal(d[tag(0, 1, 0)], obs_value(0, 1, 1))
        np.testing.assert_array_equal(d[3], obs_value(0, 0, 4))


def test_newest_step_of_an_open_episode_is_never_drawn_in_derived_mode():
    eps = [Episode(2, OPEN)]
    with both_modes(16, eps) as (stored, derived):
        assert sorted(_drawn(stored)) == [0, 1]
        assert sorted(_drawn(derived)) == [0]
        with derived.writer(lane=0) as w:  # a takeover abandons the episode: still not drawn
            assert w.episode == 1
        assert sorted(_drawn(derived)) == [0]


# --------------------------------------------------------------------------------------------
# (f) drawable anchors, any plan; sample() == sample_into()
# --------------------------------------------------------------------------------------------
PLANS = st.sampled_from([
    {},
    {"sequence_length": 3},
    {"sequence_length": 3, "cross_episodes": True},
    {"frame_stack": 3, "frame_lookahead": 1},
    {"n_step": 3, "gamma": 0.9},
    {"frame_stack": 2, "n_step": 2, "gamma": 0.5},
])


FIELD_NAMES = ["obs", "action", "reward", "terminated", "truncated", "next_obs"]


@settings(PROPS, max_examples=80)
@given(sc=scenarios(), mode=MODES, plan=PLANS,
       fields=st.none() | st.lists(st.sampled_from(FIELD_NAMES), min_size=1, unique=True))
def test_every_drawable_anchor_is_drawn_and_no_other(sc, mode, plan, fields):
    """Over 60 batches (960 draws over at most 36 window positions), every anchor the model
    calls drawable shows up and nothing else does; any subset of fields may be asked for (in
    derived buffers, leaving next_obs out makes an open episode's newest step drawable)."""
    if fields is not None and plan.get("n_step", 1) > 1 and "next_obs" not in fields:
        fields = [*fields, "next_obs"]  # n-step needs its bootstrap observation
    with written(sc, mode) as (buf, model):
        compiled = buf.compile(fields=fields, **plan)
        assert {n for n, _, _ in compiled.outputs} >= set(fields or FIELD_NAMES)
        sample_and_check(buf, model, compiled, batches=60, seed=7)


@settings(PROPS, max_examples=25)
@given(sc=scenarios(), mode=MODES, plan=PLANS)
def test_sample_returns_what_sample_into_returns(sc, mode, plan):
    with written(sc, mode) as (buf, model):
        compiled = buf.compile(**plan)
        if not model.drawable(compiled):
            return
        out = compiled.allocate(B)
        buf.sample_into(out, np.random.default_rng(3), plan=compiled)
        batch = buf.sample(B, np.random.default_rng(3), **plan)
        assert sorted(batch) == sorted(out)
        for name in out:
            np.testing.assert_array_equal(batch[name], out[name], err_msg=name)


# --------------------------------------------------------------------------------------------
# Through SamplerPool: the worker assembles the same batches
# --------------------------------------------------------------------------------------------
POOL_EPISODES = [
    [Episode(5, TERMINATED), Episode(2, TRUNCATED), Episode(6, ABANDONED), Episode(4, OPEN)],
    [Episode(3, TRUNCATED), Episode(7, TERMINATED), Episode(1, TERMINATED), Episode(3, OPEN, True)],
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["stored", "derived"])
@pytest.mark.parametrize("plan", [{"sequence_length": 3}, {"n_step": 3, "gamma": 0.9}],
                         ids=["sequence", "nstep"])
def test_sampler_pool_batches_match_the_reference(mode, plan):
    """A forked sampler worker delivers batches whose every row (per ``batch.lanes`` /
    ``batch.indices``) equals the reference, and whose anchors cover the drawable set."""
    from workers import SamplerPool
    from workers.config import Workers

    sc = Scenario(12, POOL_EPISODES, False, [False, True])
    with written(sc, mode) as (buf, model):
        compiled = buf.compile(**plan)
        expected = model.drawable(compiled)
        assert len(expected) >= 8  # both lanes wrapped; still plenty to draw
        seen: set[tuple[int, int]] = set()
        with SamplerPool(buf, B, plan=Plan(**plan), workers=Workers(1, start_method="fork"),
                         seed=0, timeout=30) as pool:
            for _ in range(40):
                batch = pool.next(timeout=30)
                arrays = {n: np.asarray(batch[n]) for n in batch}
                seen.update(assert_rows_match(model, expected, compiled.plan,
                                              np.asarray(batch.lanes), np.asarray(batch.indices),
                                              arrays))
        assert seen == set(expected)


# --------------------------------------------------------------------------------------------
# n-step stops at a terminal step even where end_episode() was not called after it
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["stored", "derived"])
def test_nstep_stops_at_a_terminated_step_inside_an_episode(mode):
    """A writer that marks step 1 terminated but keeps adding to the same episode: n-step
    returns from steps 0 and 1 stop there (discount 0) instead of running on into steps 2.."""
    ep = Episode(5, OPEN)
    with shmbuf.ReplayBuffer.create(make_spec(mode == "derived"), 16, next_obs=mode) as buf:
        with buf.writer() as w:
            for s in range(5):
                row = transition(0, 0, ep, s)
                row["terminated"] = s == 1
                w.add(**row)
            w.end_episode(truncated=True)
        batch = buf.sample(200, 0, n_step=4, gamma=0.5)
        r = [reward_value(0, 0, s) for s in range(5)]
        for s, m, ret in [(0, 2, r[0] + 0.5 * r[1]), (1, 1, r[1])]:
            rows = batch["action"] == tag(0, 0, s)
            assert rows.any()
            assert (batch["steps"][rows] == m).all() and (batch["discount"][rows] == 0).all()
            np.testing.assert_allclose(batch["reward"][rows], ret)
            assert batch["terminated"][rows].all()
            np.testing.assert_array_equal(batch["next_obs"][rows][0], obs_value(0, 0, 2))
        later = batch["action"] == tag(0, 0, 2)
        assert (batch["steps"][later] == 3).all()  # steps 2, 3, 4, then the episode's end


# --------------------------------------------------------------------------------------------
# A writer process laps the lanes while plans are read: no torn or mixed row is delivered
# --------------------------------------------------------------------------------------------
def lapping_episode(lane: int, episode: int) -> Episode:
    """The episodes the lapping writer writes, known to the reader from (lane, episode)."""
    end = TERMINATED if (episode + lane) % 3 == 0 else TRUNCATED
    return Episode(1 + (5 * episode + 3 * lane) % 6, end)


def _lapping_writer(buf: shmbuf.ReplayBuffer, started: Any, stop: Any) -> None:
    writers = [buf.writer(lane=k) for k in range(buf.lanes)]
    rounds = 0
    while not stop.is_set():
        for k, w in enumerate(writers):
            ep = lapping_episode(k, w.episode)
            w.add(**transition(k, w.episode, ep, w.step))
            if w.step == ep.length:
                w.end_episode(truncated=ep.end == TRUNCATED)
        rounds += 1
        if rounds == 4 * buf.capacity:
            started.set()
    for w in writers:
        w.close()


def check_self_consistent(plan: dict, out: dict[str, np.ndarray], lanes: np.ndarray) -> None:
    """Each delivered row against the schedule of the episode its anchor names. What the reader
    may legitimately choose (a crossing mask's length, look-ahead frames not written yet, an
    n-step m cut short by an episode still being written) is taken from the row and bounded;
    everything else must be exactly the schedule's."""
    gamma, n = plan.get("gamma", 0.99), plan.get("n_step", 1)
    T, k = plan.get("sequence_length", 1), plan.get("frame_stack", 1)
    la = plan.get("frame_lookahead", 0)
    want: dict[str, list] = {name: [] for name in out if not name.endswith("mask")}
    for b in range(len(lanes)):
        first = out["action"][b] if T == 1 else out["action"][b, 0]
        lane, e, s = untag(first)
        assert lane == lanes[b], "row from another lane"
        ep = lapping_episode(lane, e)
        L = ep.length
        assert s < L
        if T > 1:
            mask = out["mask"][b]
            assert mask[0] and (np.logical_and.accumulate(mask) == mask).all()
            assert plan.get("cross_episodes") or mask.all()
            assert mask.sum() <= L - s, "a window ran past its episode's last step"
            steps = [transition(lane, e, ep, s + j) if mask[j] else None for j in range(T)]
            for name in want:
                want[name].append([np.zeros_like(out[name][b, 0]) if r is None else r[name]
                                   for r in steps])
            continue
        m = int(out["steps"][b]) if n > 1 else 1
        assert 1 <= m <= min(n, L - s)
        last = s + m - 1
        row = transition(lane, e, ep, s)
        row["next_obs"] = obs_value(lane, e, s + m)
        row["terminated"] = ep.terminated_at(last)
        row["truncated"] = ep.truncated_at(last)
        if n > 1:
            row["reward"] = sum(gamma ** j * reward_value(lane, e, s + j) for j in range(m))
            row["discount"] = 0.0 if ep.terminated_at(last) else gamma ** m
            row["steps"] = m
        if k > 1 or la > 0:
            offsets = range(-(k - 1), la + 1)
            on = out["obs_mask"][b]
            back = [s + o >= 0 for o in offsets if o <= 0]
            assert on[: len(back)].tolist() == back, "look-back mask"
            assert all(s + o < L for o, v in zip(offsets, on) if o > 0 and v), "look-ahead mask"
            row["obs"] = [obs_value(lane, e, s + o) if v else np.zeros(3, np.float32)
                          for o, v in zip(offsets, on)]
            row["next_obs"] = [obs_value(lane, e, s + m + o) if s + m + o >= 0
                               else np.zeros(3, np.float32) for o in range(-(k - 1), 1)]
        for name in want:
            want[name].append(row[name])
    for name, rows in want.items():
        expected = np.asarray(rows, dtype=out[name].dtype)
        if name in ("reward", "discount"):
            np.testing.assert_allclose(out[name], expected, rtol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(out[name], expected, err_msg=name)


LAPPING_PLANS = [
    {"sequence_length": 4},
    {"sequence_length": 4, "cross_episodes": True},
    {"frame_stack": 3, "frame_lookahead": 1},
    {"n_step": 3, "gamma": 0.9},
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["stored", "derived"])
def test_plans_never_deliver_torn_or_mixed_rows_while_a_writer_laps_the_lanes(mode):
    """A forked writer fills two 64-row lanes with scheduled episodes as fast as it can (each
    lane is rewritten thousands of times a second) while this process reads every kind of plan:
    each delivered row is exactly the schedule's (lane, episode, step), so the plan reader's
    stamp checks keep out rows overwritten under it."""
    import multiprocess

    ctx = multiprocess.get_context("fork")
    buf = shmbuf.ReplayBuffer.create(make_spec(mode == "derived"), 64, lanes=2, next_obs=mode)
    proc = None
    try:
        started, stop = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=_lapping_writer, args=(buf, started, stop), daemon=True)
        proc.start()
        assert started.wait(30), "the writer did not start"
        rng = np.random.default_rng(5)
        for plan in LAPPING_PLANS:
            compiled = buf.compile(**plan)
            out = compiled.allocate(B)
            before = buf.committed()
            for _ in range(150):
                draw = buf.sample_into(out, rng, plan=compiled)
                check_self_consistent(plan, out, draw.lanes)
            laps = (buf.committed() - before).min() / buf.capacity
            assert laps > 10, f"{plan}: the writer lapped the lanes only {laps:.1f} times"
    finally:
        if proc is not None:
            stop.set()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        buf.close()
    assert proc.exitcode == 0
