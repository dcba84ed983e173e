"""Prioritized replay and retirement counts (``selection=Prioritized(...)``, ``Counted(k, of)``)
on a ``SamplerPool``, in-process and with workers.

What is proved here:
- draws follow the priorities: a chi-square goodness-of-fit test at a fixed seed (which also
  rejects uniform draws, so it has the power to notice a wrong sampler), and a row whose
  priority is zero is never drawn;
- new transitions enter at the running maximum priority, which a dropped update never raises;
- an update for a row overwritten since it was sampled is dropped (``updates_dropped`` counts
  it) and never reaches the row now in that slot;
- ``batch.weights`` equal ``(N P_i)^-beta / max_j (N P_j)^-beta`` computed in NumPy from the
  priorities the test set, for a fixed beta, a linear schedule and a callable;
- NaN, infinite and negative priorities raise ``InvalidPriorityError`` naming the index, and
  change nothing;
- multi-lane buffers: lanes found from a recent batch's ``indices`` (or given with ``lanes=``);
- a worker SIGKILLed during prioritized sampling is restarted and the tree stays consistent;
- ``Counted(k)``: every row of a static buffer is delivered exactly k times, then the
  pool runs dry (``Timeout``); rows written later become available; a row is never delivered
  more than k times, also when its slot is overwritten while a worker gathers it.

The chi-square p-value is computed here (regularised incomplete gamma), because SciPy is not a
test dependency; it is checked against SciPy where SciPy is installed.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import numpy as np
import pytest

import shmbuf
from shmbuf.priority import PriorityTable
from shmbuf.sampling import Plan, sumtree
from tests import pool_procs as procs
from tests._helpers.threads import running
from workers import SamplerPool
from workers.config import Workers
from workers.selection import Counted, CountedSelection, Prioritized, Uniform

pytestmark = pytest.mark.timeout(90)


# --------------------------------------------------------------------------------------------
# Statistics helpers
# --------------------------------------------------------------------------------------------
def _gamma_q(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x) (series / Lentz continued fraction)."""
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = 0
        while abs(term) > abs(total) * 1e-15 and n < 10_000:
            n += 1
            term *= x / (a + n)
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df)."""
    return _gamma_q(df / 2.0, x / 2.0)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness-of-fit p-value of ``counts`` against ``probs`` (cells with probs > 0)."""
    n = counts.sum()
    expected = n * probs
    stat = float(((counts - expected) ** 2 / expected).sum())
    return chi2_sf(stat, counts.size - 1)


def test_chi2_sf_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 41, 100, 1000):
        for x in (0.01, 0.5, df * 0.5, df - 1, df, df + 3 * math.sqrt(2 * df), 3 * df + 50):
            assert math.isclose(chi2_sf(x, df), stats.chi2.sf(x, df), rel_tol=1e-9,
                                abs_tol=1e-300), (x, df)


def test_chi2_sf_known_values():
    """Textbook critical values (no SciPy needed): P(chi2_1 >= 3.841) = 0.05, etc."""
    assert math.isclose(chi2_sf(3.841458820694124, 1), 0.05, rel_tol=1e-9)
    assert math.isclose(chi2_sf(18.307038053275146, 10), 0.05, rel_tol=1e-9)
    assert math.isclose(chi2_sf(2.0, 2), math.exp(-1.0), rel_tol=1e-12)


# --------------------------------------------------------------------------------------------
# Pool helpers
# --------------------------------------------------------------------------------------------
ALPHA, EPS = 0.7, 0.0
PRIORITIZED = Prioritized(alpha=ALPHA, eps=EPS)


def _pool(buf, n_workers: int, start_method: str | None = None, *,
          selection: Prioritized | Counted = PRIORITIZED, ordered: bool = True,
          staging: int | None = None, max_restarts_per_minute: float = 10.0,
          **kw) -> SamplerPool:
    """A pool of ``selection`` (``PRIORITIZED`` by default) over ``buf``; with workers, batches
    leave in assignment order unless ``ordered=False`` (see _skip_inflight), two staging slots
    per worker unless ``staging`` says otherwise."""
    kw.setdefault("seed", 0)
    workers = Workers(n_workers, staging=staging or (2 * n_workers if n_workers else None),
                      start_method=start_method, ordered=bool(n_workers) and ordered,
                      max_restarts_per_minute=max_restarts_per_minute)
    return SamplerPool(buf, selection=selection, workers=workers, **kw)


def _skip_inflight(pool: SamplerPool) -> int:
    """Drop the batches assigned before the last priority update: workers may have drawn them
    from the old tree. With ordered delivery they are exactly the next ``n_staging - 1``
    (the slot the learner held is assigned again only on the next ``next()``)."""
    n = max(0, pool.n_staging - 1) if pool.n_workers else 0
    for _ in range(n):
        procs.assert_batch_ok(pool.next(timeout=30))
    return n


def _all_rows(buf) -> tuple[np.ndarray, np.ndarray]:
    w = buf.windows()
    lanes = np.concatenate([np.full(h - lo, k) for k, (lo, h) in enumerate(zip(w.lo, w.hi))])
    idx = np.concatenate([np.arange(lo, h) for lo, h in zip(w.lo, w.hi)])
    return lanes.astype(np.int64), idx.astype(np.int64)


def _leaves(table: PriorityTable, lanes: np.ndarray, indices: np.ndarray) -> np.ndarray:
    return table.leaf_values(lanes, indices)


def _tree_snapshot(table: PriorityTable) -> tuple[np.ndarray, ...]:
    return table.sums.copy(), table.mins.copy(), table.gen.copy()


def _assert_tree_consistent(table: PriorityTable, buf) -> None:
    """Every internal node is exactly the sum / min of its children, and every row the buffer
    holds has its generation recorded in its slot."""
    sums, mins = table.sums.copy(), table.mins.copy()
    rebuilt_sums, rebuilt_mins = sums.copy(), mins.copy()
    sumtree.rebuild(rebuilt_sums, rebuilt_mins)  # every parent from its children, leaves up
    np.testing.assert_array_equal(sums, rebuilt_sums)
    np.testing.assert_array_equal(mins, rebuilt_mins)
    lanes, idx = _all_rows(buf)
    np.testing.assert_array_equal(table.gen[lanes * table.capacity + idx % table.capacity], idx)


def _set_priorities(pool: SamplerPool, buf, priorities: np.ndarray) -> tuple[np.ndarray, ...]:
    """Give every row of the buffer a priority (in ``_all_rows`` order); return (lanes, idx)."""
    lanes, idx = _all_rows(buf)
    assert pool.update_priorities(idx, priorities, lanes=lanes) == idx.size
    return lanes, idx


def _keep_writing(buf, lane: int, rows: int, pause: float):
    """A loop for ``running``: extends ``lane`` by ``rows`` self-checking rows every ``pause``
    seconds until stopped, lapping the buffer."""
    def write(stop: threading.Event) -> None:
        with buf.writer(lane=lane, timeout=5) as w:
            while not stop.is_set():
                w.extend(procs.make_batch(lane, np.arange(w.committed, w.committed + rows)))
                time.sleep(pause)

    return write


# --------------------------------------------------------------------------------------------
# Sampling frequencies
# --------------------------------------------------------------------------------------------
def _frequency_case(n_workers: int, start_method: str | None) -> None:
    B, n_batches = 256, 120
    with procs.new_buffer(capacity=24, lanes=2) as buf, \
         _pool(buf, n_workers, start_method, batch_size=B) as pool:
        procs.assert_batch_ok(pool.next(timeout=30), B)  # enters every row's priority
        rng = np.random.default_rng(123)
        lanes, idx = _all_rows(buf)
        p = rng.uniform(0.05, 4.0, idx.size)
        zero = rng.choice(idx.size, 6, replace=False)
        p[zero] = 0.0  # eps = 0: these rows must never be drawn
        _set_priorities(pool, buf, p)
        _skip_inflight(pool)
        counts = np.zeros((2, 24))
        for _ in range(n_batches):
            batch = pool.next(timeout=30)
            procs.assert_batch_ok(batch, B)
            np.add.at(counts, (batch.lanes, batch.indices), 1)
        value = p ** ALPHA
        drawn = counts[lanes, idx]
        assert drawn[zero].sum() == 0, "a zero-priority row was drawn"
        live = value > 0
        p_value = chi_square_p(drawn[live], value[live] / value.sum())
        assert p_value > 1e-3, f"draws do not follow the priorities (chi-square p={p_value:.2e})"
        # The test has power: the same counts reject uniform sampling outright.
        assert chi_square_p(drawn[live], np.full(live.sum(), 1 / live.sum())) < 1e-12


def test_frequencies_match_priorities_in_process():
    """30,720 in-process draws over 48 rows with random priorities (6 of them zero): counts fit
    ``p_i^alpha / sum_j p_j^alpha`` (chi-square, 41 degrees of freedom, fixed seed), and the
    zero-priority rows are never drawn."""
    _frequency_case(0, None)


def test_frequencies_match_priorities_with_workers(start_method):
    """The same with two worker processes drawing from the shared tree."""
    _frequency_case(2, start_method)


# --------------------------------------------------------------------------------------------
# New rows, stale updates
# --------------------------------------------------------------------------------------------
def test_new_transitions_enter_at_the_maximum_priority():
    """Rows written after priorities were set enter at the largest priority applied so far
    (``(max + eps) ** alpha``) once the learner takes its next batch, in every lane; FINAL
    records of ``end_episode`` do not exist as rows and are never drawn."""
    alpha, eps = 0.6, 0.01
    with procs.new_buffer(capacity=32, lanes=2, rows=8) as buf, \
         _pool(buf, 0, batch_size=8, selection=Prioritized(alpha=alpha, eps=eps)) as pool:
        table = pool._table
        pool.next(timeout=5)
        lanes, idx = _all_rows(buf)
        np.testing.assert_allclose(_leaves(table, lanes, idx), (1.0 + eps) ** alpha)  # initial
        p = np.linspace(0.1, 5.0, idx.size)
        _set_priorities(pool, buf, p)
        np.testing.assert_allclose(_leaves(table, lanes, idx), (p + eps) ** alpha)
        procs.fill(buf, 4, lanes=[1])
        procs.fill(buf, 2, lanes=[0])
        pool.next(timeout=5)
        new_l = np.array([1, 1, 1, 1, 0, 0])
        new_i = np.array([8, 9, 10, 11, 8, 9])
        np.testing.assert_allclose(_leaves(table, new_l, new_i), (5.0 + eps) ** alpha)
        np.testing.assert_allclose(_leaves(table, lanes, idx), (p + eps) ** alpha)  # untouched
        _assert_tree_consistent(table, buf)


def test_stale_updates_are_dropped_and_never_reach_the_new_rows():
    """Every row gets priority 3; a batch is sampled, then half of its rows are overwritten by
    a writer before the learner sends their priorities (without taking another batch in
    between). Those updates are dropped and counted in ``updates_dropped``; the others apply.
    The rows now in the overwritten slots keep the priority they entered with (the maximum,
    3): the dropped updates, huge on purpose, neither reach them nor raise the maximum."""
    with procs.new_buffer(capacity=16, lanes=1) as buf, \
         _pool(buf, 0, batch_size=16, selection=Prioritized(alpha=1.0, eps=0.0), seed=3) as pool:
        table = pool._table
        pool.next(timeout=5)
        _set_priorities(pool, buf, np.full(16, 3.0))
        batch = pool.next(timeout=5)
        idx = batch.indices.copy()
        procs.fill(buf, 8)  # indices 16..23 overwrite the rows 0..7
        stale = idx < 8
        assert stale.any() and (~stale).any()
        applied = pool.update_priorities(idx, np.where(stale, 1000.0, 2.0))
        assert applied == int((~stale).sum())
        assert table.updates_dropped == int(stale.sum())
        assert table.max_priority == 3.0
        new_rows = (np.zeros(8, np.int64), np.arange(16, 24))
        np.testing.assert_array_equal(_leaves(table, *new_rows), 3.0)
        np.testing.assert_array_equal(_leaves(table, np.zeros(16, np.int64), idx)[~stale], 2.0)
        pool.next(timeout=5)  # the learner's next batch changes nothing of that
        np.testing.assert_array_equal(_leaves(table, *new_rows), 3.0)
        # Once more: updates for the old rows 0..7 stay dropped.
        before = _tree_snapshot(table)
        assert pool.update_priorities(np.arange(8), np.full(8, 50.0)) == 0
        assert table.updates_dropped == int(stale.sum()) + 8
        for a, b in zip(before, _tree_snapshot(table)):
            np.testing.assert_array_equal(a, b)
        _assert_tree_consistent(table, buf)


def test_stale_updates_with_workers_and_a_live_writer(start_method):
    """The same under load: a writer thread laps lane 0 of a small buffer while two workers
    sample and the learner sends a priority for every row it gets. Every update is applied or
    counted as dropped, and afterwards each row's leaf is the last priority sent for exactly
    that (lane, index), or, if none was, the maximum it entered with (10, which no update in
    [1, 2) can raise): no update ever landed on a row it was not meant for."""
    with procs.new_buffer(capacity=32, lanes=2) as buf, \
         _pool(buf, 2, start_method, batch_size=16, selection=Prioritized(alpha=1.0, eps=0.0),
               ordered=False) as pool:
        table = pool._table
        pool.next(timeout=30)
        _set_priorities(pool, buf, np.full(64, 10.0))
        last: dict = {}
        applied = total = 0
        with running(_keep_writing(buf, lane=0, rows=3, pause=0.001)):
            # At least 150 steps, and on until the writer has overwritten a sampled row before
            # its update came (a loaded machine can starve the writer thread for a while).
            step, deadline = 0, time.monotonic() + 45
            while step < 150 or table.updates_dropped == 0:
                assert time.monotonic() < deadline, "the writer never overwrote a sampled row"
                step += 1
                batch = pool.next(timeout=30)
                procs.assert_batch_ok(batch, 16)
                p = 1.0 + (step % 1000) / 1000 + np.arange(16) / 1e6  # recognisable, in [1, 2)
                keys = list(zip(batch.lanes.tolist(), batch.indices.tolist()))
                applied += pool.update_priorities(batch.indices, p)
                total += 16
                last.update(zip(keys, p.tolist()))  # duplicates: the last one wins
        assert applied + table.updates_dropped == total
        assert table.max_priority == 10.0
        pool.next(timeout=30)
        lanes, idx = _all_rows(buf)
        got = _leaves(table, lanes, idx)
        want = np.array([last.get(key, 10.0) for key in zip(lanes.tolist(), idx.tolist())])
        np.testing.assert_array_equal(got, want)
        _assert_tree_consistent(table, buf)


# --------------------------------------------------------------------------------------------
# Importance weights
# --------------------------------------------------------------------------------------------
BETAS = {
    "fixed": (0.4, lambda t: 0.4),
    "linear": ((0.2, 1.0, 10), lambda t: 0.2 + 0.8 * min(1.0, t / 10)),
    "callable": (lambda t: min(1.0, 0.05 * t), lambda t: min(1.0, 0.05 * t)),
}


def _weights_case(beta_name: str, n_workers: int, start_method: str | None) -> None:
    beta, beta_ref = BETAS[beta_name]
    alpha, eps = 0.6, 0.05
    with procs.new_buffer(capacity=16, lanes=2) as buf, \
         _pool(buf, n_workers, start_method, batch_size=64,
               selection=Prioritized(alpha=alpha, beta=beta, eps=eps)) as pool:
        t = 0
        pool.next(timeout=30)
        t += 1
        lanes, idx = _all_rows(buf)
        p = np.random.default_rng(7).exponential(1.0, idx.size)
        p[3] = 0.0  # smallest stored priority: eps ** alpha
        _set_priorities(pool, buf, p)
        t += _skip_inflight(pool)
        value = np.zeros((2, 16))
        value[lanes, idx] = (p + eps) ** alpha
        P = value / value.sum()
        p_min = P[P > 0].min()
        for _ in range(16):
            batch = pool.next(timeout=30)
            procs.assert_batch_ok(batch, 64)
            ref = (P[batch.lanes, batch.indices] / p_min) ** -beta_ref(t)
            # the definition, literally: (N P_i)^-beta / max_j (N P_j)^-beta
            N = idx.size
            lit = (N * P[batch.lanes, batch.indices]) ** -beta_ref(t) / (
                (N * P[P > 0]) ** -beta_ref(t)).max()
            np.testing.assert_allclose(ref, lit, rtol=1e-12)
            assert batch.weights.dtype == np.float32
            np.testing.assert_allclose(batch.weights, ref, rtol=2e-6, atol=0)
            assert (batch.weights <= 1.0).all()
            t += 1


@pytest.mark.parametrize("beta_name", list(BETAS))
def test_weights_match_numpy_reference_in_process(beta_name):
    """``batch.weights`` against NumPy, batch by batch, with beta taken at each batch's
    position in the schedule (batches delivered before it)."""
    _weights_case(beta_name, 0, None)


def test_weights_match_numpy_reference_with_workers(start_method):
    """The same with workers (probabilities come from the worker's draw, beta from the
    learner at delivery), for the linear schedule."""
    _weights_case("linear", 2, start_method)


# --------------------------------------------------------------------------------------------
# Invalid priorities and misuse
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), -1.0, -1e-300, float("inf"), float("-inf")])
def test_invalid_priorities_raise_naming_the_index_and_change_nothing(bad):
    with procs.new_buffer(capacity=16, lanes=2) as buf, _pool(buf, 0, batch_size=8) as pool:
        table = pool._table
        batch = pool.next(timeout=5)
        pool.update_priorities(batch.indices, np.full(8, 2.0))
        before, max_before = _tree_snapshot(table), table.max_priority
        p = np.full(8, 9.0)
        p[5] = bad
        with pytest.raises(shmbuf.InvalidPriorityError) as info:
            pool.update_priorities(batch.indices, p)
        msg = str(info.value)
        assert f"index {int(batch.indices[5])} of lane {int(batch.lanes[5])}" in msg, msg
        assert "position 5" in msg and "nothing was updated" in msg, msg
        assert isinstance(info.value, ValueError)
        for a, b in zip(before, _tree_snapshot(table)):
            np.testing.assert_array_equal(a, b)
        assert table.max_priority == max_before
        assert table.updates_dropped == 0


def test_update_arguments_are_checked_before_anything_changes():
    """A length mismatch, a negative index (never a row: slots not yet written carry
    generation -1, and a -1 must not give an empty slot a priority) or lanes that cannot be
    found raise ValueError; nothing changes and sampling goes on."""
    with procs.new_buffer(capacity=16, lanes=2, rows=4) as buf, \
         _pool(buf, 0, batch_size=8) as pool:
        table = pool._table
        for _ in range(3):
            batch = pool.next(timeout=5)
        before = _tree_snapshot(table)
        with pytest.raises(ValueError, match="priorities for"):
            pool.update_priorities(batch.indices, np.ones(7))
        with pytest.raises(ValueError, match="-1"):
            pool.update_priorities(np.array([-1]), np.array([1e6]), lanes=np.array([0]))
        with pytest.raises(ValueError, match="lanes=batch.lanes"):
            pool.update_priorities(batch.indices.copy(), np.ones(8))
        with pytest.raises(ValueError, match="lanes"):
            pool.update_priorities(batch.indices, np.ones(8), lanes=np.full(8, 2))
        for a, b in zip(before, _tree_snapshot(table)):
            np.testing.assert_array_equal(a, b)
        for _ in range(20):
            procs.assert_batch_ok(pool.next(timeout=5), 8)


@pytest.mark.parametrize("selection", [Uniform(), Counted(2)], ids=["uniform", "counted"])
def test_update_priorities_needs_a_prioritized_pool(selection):
    """A uniform pool refuses priority updates, also with ``Counted(k)`` (which keeps a
    priority table internally, for retiring rows): they would silently make it non-uniform."""
    with procs.new_buffer(capacity=16, lanes=1) as buf, \
         SamplerPool(buf, batch_size=4, selection=selection, workers=0, seed=0) as pool:
        batch = pool.next(timeout=5)
        with pytest.raises(shmbuf.ShmbufError, match="needs a prioritized pool"):
            pool.update_priorities(batch.indices, np.ones(4))


SEQUENCES = {"plan": Plan(sequence_length=4)}


@pytest.mark.parametrize("options, error, match", [
    (lambda: {"selection": Prioritized(alpha=-0.5)}, ValueError,
     r"Prioritized\(alpha=-0.5\): alpha must be a finite number >= 0"),
    (lambda: {"selection": Prioritized(alpha=float("nan"))}, ValueError,
     r"Prioritized\(alpha=nan\): alpha must be a finite number"),
    (lambda: {"selection": Prioritized(eps=-1e-3)}, ValueError,
     r"Prioritized\(eps=-0.001\): eps must be a finite number >= 0"),
    (lambda: {"selection": Prioritized(beta=1.5)}, ValueError,
     r"Prioritized\(beta=1.5\): beta must be in \[0, 1\]"),
    (lambda: {"selection": Prioritized(beta=(0.4, 1.0, 0))}, ValueError,
     r"Prioritized\(beta=\(0.4, 1.0, 0\)\): n_batches must be > 0"),
    (lambda: {"selection": "rank"}, TypeError,
     r"selection='rank' is not a selection strategy: pass Uniform\(\), Prioritized"),
    (lambda: {"selection": Counted(2, Prioritized()), **SEQUENCES}, ValueError,
     r"Counted\(2\) delivers single stored transitions.*Uniform\(\) or Prioritized\(\)"),
    (lambda: {"selection": Prioritized(eta=1.5), **SEQUENCES}, ValueError,
     r"Prioritized\(eta=1.5\): eta must be in \[0, 1\]"),
], ids=["alpha<0", "alpha=nan", "eps<0", "beta>1", "beta schedule", "unknown strategy",
        "counted sequences", "eta>1"])
def test_bad_prioritized_arguments(options, error, match):
    """Each refused by the object that holds the option (or by the pool's check of how they
    combine), with a message naming the field, the value and what to pass instead."""
    with procs.new_buffer(capacity=16, lanes=1) as buf:
        with pytest.raises(error, match=match):
            SamplerPool(buf, batch_size=4, workers=0, **options())


# --------------------------------------------------------------------------------------------
# Several lanes
# --------------------------------------------------------------------------------------------
def _multilane_case(n_workers: int, start_method: str | None) -> None:
    """The learner's usual loop: take a batch, send its priorities with ``batch.indices`` (no
    lanes), many times over; the table then holds exactly the priorities sent, each for the
    (lane, index) it was sent for. Lanes are written in lockstep, so every index exists in
    every lane: an update applied to the wrong lane would still find a matching row there."""
    with procs.new_buffer(capacity=16, lanes=3) as buf, \
         _pool(buf, n_workers, start_method, batch_size=8,
               selection=Prioritized(alpha=1.0, eps=0.0)) as pool:
        table = pool._table
        model = np.ones((3, 16))
        rng = np.random.default_rng(5)
        for step in range(30):
            batch = pool.next(timeout=30)
            procs.assert_batch_ok(batch, 8)
            p = rng.uniform(0.5, 2.0, 8)
            assert pool.update_priorities(batch.indices, p) == 8
            model[batch.lanes, batch.indices] = p  # duplicates: the last one wins
            if step % 7 == 3:  # lanes given explicitly, with a copy of the indices
                q = rng.uniform(0.5, 2.0, 8)
                pool.update_priorities(batch.indices.copy(), q, lanes=batch.lanes.copy())
                model[batch.lanes, batch.indices] = q
            lanes, idx = _all_rows(buf)
            np.testing.assert_array_equal(_leaves(table, lanes, idx), model[lanes, idx])
        _assert_tree_consistent(table, buf)


def test_multi_lane_updates_find_their_lanes_in_process():
    _multilane_case(0, None)


def test_multi_lane_updates_find_their_lanes_with_workers(start_method):
    _multilane_case(2, start_method)


# --------------------------------------------------------------------------------------------
# A worker killed during prioritized sampling
# --------------------------------------------------------------------------------------------
def test_worker_sigkilled_during_prioritized_sampling(start_method):
    """The learner updates priorities after every batch while a writer thread keeps adding
    rows; a worker is SIGKILLed twice. The pool restarts it, every batch stays whole, and
    afterwards the tree is consistent: internal nodes match their children, every held row's
    generation is in its slot, and the leaves are the priorities the learner sent (or the
    maximum, for rows that entered later). Workers only ever read the tree, so a death cannot
    leave it half-written."""
    with procs.new_buffer(capacity=64, lanes=2) as buf, \
         _pool(buf, 2, start_method, batch_size=16, selection=Prioritized(alpha=1.0, eps=0.0),
               ordered=False, staging=4, max_restarts_per_minute=60) as pool:
        table = pool._table
        rng = np.random.default_rng(11)

        def take_batch() -> None:
            batch = pool.next(timeout=30)
            procs.assert_batch_ok(batch, 16)
            pool.update_priorities(batch.indices, rng.exponential(1.0, 16))

        with running(_keep_writing(buf, lane=1, rows=4, pause=0.002)):
            killed = []
            for step in range(90):
                take_batch()
                if step in (20, 50):
                    pid = pool.stats()["workers"][step % 2]["pid"]
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    # The learner sees a death only once the kernel has finished the process
                    # (its exit sentinel fires), and a fast learner served by the live worker
                    # can take many batches before that: sampling goes on until the worker is
                    # replaced, instead of assuming that a fixed number of batches suffices.
                    deadline = time.monotonic() + 30
                    while pid in pool.worker_pids:
                        assert time.monotonic() < deadline, f"worker {pid} was never replaced"
                        take_batch()
            assert pool.stats()["restarts"] == 2
            assert not set(killed) & set(pool.worker_pids)
        pool.next(timeout=30)  # a last sync: every row now held is in the table
        _assert_tree_consistent(table, buf)
        assert table.total() > 0


# --------------------------------------------------------------------------------------------
# max_times_sampled
# --------------------------------------------------------------------------------------------
def _deliveries(pool: SamplerPool, counts: dict, batch_size: int) -> int:
    """Take batches until the pool runs dry; count deliveries per (lane, index)."""
    n = 0
    while True:
        try:
            batch = pool.next(timeout=0.5 if n else 30)
        except shmbuf.Timeout:
            return n
        procs.assert_batch_ok(batch, batch_size)
        for ln, i in zip(batch.lanes.tolist(), batch.indices.tolist()):
            counts[(ln, i)] = counts.get((ln, i), 0) + 1
        n += 1


def _max_times_case(sampler: str, n_workers: int, start_method: str | None) -> None:
    k, B = 3, 8
    with procs.new_buffer(capacity=32, lanes=2) as buf, \
         _pool(buf, n_workers, start_method, batch_size=B, ordered=False,
               selection=Counted(k, PRIORITIZED if sampler == "prioritized" else Uniform())
               ) as pool:
        counts: dict = {}
        n = _deliveries(pool, counts, B)
        assert n == 2 * 32 * k // B
        assert set(counts) == {(ln, i) for ln in range(2) for i in range(32)}
        assert set(counts.values()) == {k}, "a row was delivered other than exactly k times"
        with pytest.raises(shmbuf.Timeout):  # dry, and stays dry
            pool.next(timeout=0.3)
        # Rows written later become available (they overwrite retired rows 0..7 of lane 0).
        procs.fill(buf, 8, lanes=[0])
        counts = {}
        n = _deliveries(pool, counts, B)
        assert n == 8 * k // B
        assert counts == {(0, i): k for i in range(32, 40)}


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_max_times_sampled_delivers_each_row_exactly_k_times_in_process(sampler):
    """Every row of a static buffer is delivered exactly k times, then ``next`` times out;
    after 8 more rows are written, exactly those are delivered k times each."""
    _max_times_case(sampler, 0, None)


def test_max_times_sampled_delivers_each_row_exactly_k_times_with_workers(start_method):
    _max_times_case("prioritized", 2, start_method)


def test_max_times_sampled_with_priority_updates_after_every_batch(start_method):
    """The learner sends priorities for every batch, including for rows that batch just
    retired (their k-th delivery): an update must not bring a retired row back. Every row is
    still delivered exactly k times and the pool then runs dry, in-process and with workers."""
    k, B = 2, 8
    for n_workers in (0, 2) if start_method == "fork" else (2,):
        with procs.new_buffer(capacity=32, lanes=2) as buf, \
             _pool(buf, n_workers, start_method, batch_size=B, selection=Counted(k, PRIORITIZED),
                   ordered=False) as pool:
            counts: dict = {}
            rng = np.random.default_rng(4)
            n = 0
            while True:
                try:
                    batch = pool.next(timeout=0.5 if n else 30)
                except shmbuf.Timeout:
                    break
                procs.assert_batch_ok(batch, B)
                for key in zip(batch.lanes.tolist(), batch.indices.tolist()):
                    counts[key] = counts.get(key, 0) + 1
                # Large priorities for the rows just delivered: if they came back, they
                # would take almost all of the draws.
                pool.update_priorities(batch.indices, rng.uniform(50.0, 100.0, B))
                n += 1
            assert n == 2 * 32 * k // B, (n_workers, n)
            assert set(counts.values()) == {k} and len(counts) == 64, n_workers
            _assert_tree_consistent(pool._table, buf)


def test_max_times_sampled_with_priorities_and_a_live_writer():
    """Prioritized draws with k=2 while a writer keeps overwriting a small buffer (so rows
    are retired by overwriting as well as by use): no (lane, index) is delivered more than
    twice, and priority updates for retired or overwritten rows are harmless."""
    with procs.new_buffer(capacity=32, lanes=2) as buf, \
         _pool(buf, 0, batch_size=8, selection=Counted(2, PRIORITIZED)) as pool:
        counts: dict = {}
        rng = np.random.default_rng(2)
        with buf.writer(lane=0) as w:
            for _ in range(150):
                w.extend(procs.make_batch(0, np.arange(w.committed, w.committed + 5)))
                try:
                    batch = pool.next(timeout=0.2)
                except shmbuf.Timeout:
                    continue
                procs.assert_batch_ok(batch, 8)
                for key in zip(batch.lanes.tolist(), batch.indices.tolist()):
                    counts[key] = counts.get(key, 0) + 1
                pool.update_priorities(batch.indices, rng.uniform(0.1, 3.0, 8))
        assert counts and max(counts.values()) <= 2, max(counts.values())
        _assert_tree_consistent(pool._table, buf)


def test_a_stale_report_after_the_slot_was_refilled_spends_no_extra_delivery():
    """The order of events in a pool with workers: the learner selects rows for a slot, a
    writer overwrites them, the learner selects for another slot (which enters the new rows
    with fresh counts), and only then does the worker report the gather as stale. Handing the
    stale draws back must not credit the *new* rows: with k=1 each new row is still delivered
    exactly once."""
    with procs.new_buffer(capacity=8, lanes=1) as buf:
        table = PriorityTable.create(buf, alpha=1.0, eps=0.0)
        try:
            sel = CountedSelection(buf, table, k=1, uniform=True)
            rng = np.random.default_rng(0)
            rows = sel.select(8, rng)
            assert sorted(rows[1].tolist()) == list(range(8))
            procs.fill(buf, 8)  # rows 8..15 overwrite them before the worker gathers
            sel.sync()  # the learner selected for another slot meanwhile
            sel.stale(rows)  # the worker's STALE report arrives
            got = []
            while (r := sel.select(1, rng)) is not None:
                got += r[1].tolist()
            assert sorted(got) == list(range(8, 16))
        finally:
            table.close()
