"""Rate limiting with Reverb's semantics.

``shmbuf.limiter.RateLimit`` is checked against a transcription of Reverb's
``RateLimiter::CanSample`` / ``CanInsert`` (reverb/cc/rate_limiter.cc, no deletes), with
hypothesis property tests. Then the limiter at work between processes: sampling "blocks, then
unblocks" on ``min_size`` and on the ratio, writers block when actors run ahead and raise
``RateLimitTimeout`` with nothing written, "close cancels a pending wait", a limiter whose pool
was SIGKILLed blocks nobody, and a short run holds the ratio within its tolerance.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf.limiter import RateLimit
from tests import pool_procs as procs
from tests._helpers.threads import blocked_in_thread, in_thread
from workers import SamplerPool
from workers.config import Workers

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------------------------
# Pure math against Reverb
# --------------------------------------------------------------------------------------------
def reverb_can_sample(spi, min_size, min_diff, inserts, samples, n):
    """Reverb's RateLimiter::CanSample (deletes = 0)."""
    if inserts < min_size:
        return False
    return inserts * spi - samples - n >= min_diff


def reverb_can_insert(spi, min_size, max_diff, inserts, samples, n):
    """Reverb's RateLimiter::CanInsert (deletes = 0)."""
    if inserts + n <= min_size:
        return True
    return (n + inserts) * spi - samples <= max_diff


def reverb_sample_to_insert_ratio(spi, min_size, error_buffer):
    """reverb.rate_limiters.SampleToInsertRatio's (min_diff, max_diff)."""
    offset = spi * min_size
    return offset - error_buffer, offset + error_buffer


ratios = st.one_of(
    st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 32.0, 0.1, 1 / 3]),
    st.floats(min_value=0.01, max_value=64.0, allow_nan=False, allow_infinity=False),
)
limits = st.builds(
    RateLimit,
    min_size=st.integers(1, 2000),
    samples_per_insert=ratios,
    tolerance=st.one_of(st.integers(0, 5000).map(float),
                        st.floats(0.0, 5000.0, allow_nan=False)),
)
counts = st.integers(0, 100_000)


def test_reverb_offsets():
    """min_diff/max_diff are Reverb's SampleToInsertRatio offsets."""
    lim = RateLimit(min_size=100, samples_per_insert=4.0, tolerance=64)
    assert (lim.min_diff, lim.max_diff) == reverb_sample_to_insert_ratio(4.0, 100, 64)
    free = RateLimit(min_size=10)
    assert free.min_diff == -math.inf and free.max_diff == math.inf


@settings(max_examples=400, deadline=None)
@given(limits, counts, counts, st.integers(1, 5000))
def test_can_sample_and_can_insert_match_reverb(lim, inserts, samples, n):
    spi = lim.samples_per_insert
    assert lim.can_sample(inserts, samples, n) == reverb_can_sample(
        spi, lim.min_size, lim.min_diff, inserts, samples, n)
    assert lim.can_insert(inserts, samples, n) == reverb_can_insert(
        spi, lim.min_size, lim.max_diff, inserts, samples, n)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 2000), counts, counts, st.integers(1, 5000))
def test_min_size_only_is_reverbs_min_size_limiter(min_size, inserts, samples, n):
    """Without a ratio (Reverb's MinSize): sampling waits for min_size inserts, inserting never
    waits."""
    lim = RateLimit(min_size=min_size)
    assert lim.can_sample(inserts, samples, n) == (inserts >= min_size)
    assert lim.can_insert(inserts, samples, n)
    assert lim.inserts_allowed(inserts, samples) >= 1 << 40
    assert lim.max_insert_chunk() >= 1 << 40


@settings(max_examples=1000, deadline=None)
@given(limits, counts, counts)
def test_inserts_allowed_is_the_largest_n_that_can_insert(lim, inserts, samples):
    """``inserts_allowed`` is exactly the largest n with ``can_insert(n)``: n may be inserted,
    n + 1 may not (and can_insert holds for every smaller n: it is monotone)."""
    n = lim.inserts_allowed(inserts, samples)
    assert n >= 0
    if n > 0:
        assert lim.can_insert(inserts, samples, n), (n, lim)
        assert lim.can_insert(inserts, samples, 1)
        assert lim.can_insert(inserts, samples, max(1, n // 2))
    assert not lim.can_insert(inserts, samples, n + 1), (n, lim)


@settings(max_examples=500, deadline=None)
@given(limits, st.data())
def test_max_insert_chunk_always_gets_through(lim, data):
    """Whenever samplers that take batches of up to ``tolerance`` rows cannot take another
    one (before min_size, or past it with the balance below ``min_diff + batch``), a chunk of
    ``max_insert_chunk`` rows can be inserted: writers and samplers never wait on each other."""
    assume(lim.tolerance >= max(1.0, lim.samples_per_insert))
    chunk = lim.max_insert_chunk()
    assert chunk >= 1 and chunk * lim.samples_per_insert <= lim.tolerance + 1e-9
    # Before min_size (nothing can have been sampled yet).
    inserts = data.draw(st.integers(0, lim.min_size - 1), label="inserts before min_size")
    assert lim.can_insert(inserts, 0, chunk)
    # Past min_size, samplers stuck.
    batch = data.draw(st.integers(1, int(lim.tolerance)), label="batch")
    inserts = lim.min_size + data.draw(st.integers(0, 100_000), label="inserts past min_size")
    lowest = math.floor(inserts * lim.samples_per_insert - lim.min_diff - batch) + 1
    samples = max(0, lowest) + data.draw(st.integers(0, 1000), label="extra samples")
    assume(not lim.can_sample(inserts, samples, batch))
    assert lim.can_insert(inserts, samples, chunk), (inserts, samples, batch, chunk)


@settings(max_examples=300, deadline=None)
@given(limits, st.data(), st.integers(0, 400))
def test_a_serialised_run_keeps_the_ratio_within_tolerance(lim, data, steps):
    """Alternate greedy samplers (batches of up to ``tolerance`` rows) and inserters (chunks of
    up to ``max_insert_chunk`` rows) under the limiter: neither side ever deadlocks, and once
    past min_size the balance inserts*ratio - samples stays within [min_diff - batch,
    max_diff]."""
    assume(lim.tolerance >= max(1.0, lim.samples_per_insert))
    batch = data.draw(st.integers(1, min(64, int(lim.tolerance))), label="batch")
    chunk = data.draw(st.integers(1, min(64, lim.max_insert_chunk())), label="chunk")
    inserts = samples = 0
    for _ in range(steps):
        moved = False
        if lim.can_insert(inserts, samples, chunk):
            inserts += chunk
            moved = True
        while lim.can_sample(inserts, samples, batch):
            samples += batch
            moved = True
        assert moved, f"deadlock at inserts={inserts} samples={samples}"
        if inserts >= lim.min_size:
            diff = inserts * lim.samples_per_insert - samples
            assert lim.min_diff - batch - 1e-6 <= diff <= lim.max_diff + 1e-6


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_size": 0}, "min_size must be >= 1, got 0"),
        ({"samples_per_insert": 0.0}, "ratio must be finite and > 0, got 0.0"),
        ({"samples_per_insert": -2.0}, "got -2.0"),
        ({"samples_per_insert": float("nan")}, "got nan"),
        ({"samples_per_insert": float("inf")}, "got inf"),
        ({"samples_per_insert": 1.0, "tolerance": -1.0}, "tolerance must be >= 0, got -1.0"),
        ({"samples_per_insert": 1.0, "tolerance": float("nan")}, "tolerance must be >= 0"),
    ],
)
def test_rate_limit_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RateLimit(**kwargs)


# --------------------------------------------------------------------------------------------
# The Limiter over a buffer's segment, in one process
# --------------------------------------------------------------------------------------------
def test_limiter_contract_in_one_process():
    """Inactive, only ``min_size`` holds sampling back; ``take`` is exclusive; ``configure``
    activates the ratio (with the credit of rows already present), ``record_samples`` counts,
    ``can_sample``, ``blocked_reason`` and ``stats`` agree; a caller that is not the limiting
    pool (``limited=False``) sees min_size only; ``deactivate`` lifts it, bumping the
    generation writers compare against."""
    with procs.new_buffer(capacity=64, lanes=2, rows=8) as buf:  # 16 rows
        lim = buf.storage.limiter
        gen0 = lim.stats()["generation"]
        assert lim.stats() == {"generation": gen0, "active": False, "queue": False}
        assert lim.can_sample(8, 16) and not lim.can_sample(8, 17)
        assert lim.blocked_reason(8, 16) is None
        assert "holds 16 of min_size=17" in lim.blocked_reason(8, 17)
        lease = lim.take()
        try:
            with pytest.raises(shmbuf.ShmbufError, match="already rate-limits"):
                lim.take()
            assert lim.configure(RateLimit(16, 1.0, 8), n_samplers=2, credit=16) == 16
            assert buf.storage.words[lim.generation_index] == gen0 + 1
            assert lim.can_sample(8, 16)  # 16 inserts - 0 samples - 8 >= min_diff 8
            lim.record_samples(1, 8)
            assert not lim.can_sample(8, 16) and lim.can_sample(8, 16, limited=False)
            reason = lim.blocked_reason(8, 16)
            assert "rate limiter holds sampling back (inserts 16, samples 8" in reason, reason
            assert lim.blocked_reason(8, 16, limited=False) is None
            stats = lim.stats()
            assert stats["active"] and (stats["inserts"], stats["samples"]) == (16, 8)
            assert (stats["min_size"], stats["samples_per_insert"], stats["tolerance"]) == (
                16, 1.0, 8.0)
            lim.deactivate()
            assert not lim.stats()["active"] and lim.can_sample(8, 16)
            assert buf.storage.words[lim.generation_index] == gen0 + 2
        finally:
            lease.close()
        lim.take().close()  # free again


# --------------------------------------------------------------------------------------------
# Helpers for the process tests
# --------------------------------------------------------------------------------------------
def _add_rows(w: shmbuf.Writer, n: int, **kw) -> None:
    w.extend(procs.make_batch(w.lane, np.arange(w.committed, w.committed + n)), **kw)


def _take(pool: SamplerPool, n: int, timeout: float = 10) -> None:
    for _ in range(n):
        procs.assert_batch_ok(pool.next(timeout=timeout))


def _blocks(pool: SamplerPool, timeout: float = 0.4) -> str:
    """Assert ``next`` times out; return the Timeout's message."""
    with pytest.raises(shmbuf.Timeout) as info:
        pool.next(timeout=timeout)
    return str(info.value)


# --------------------------------------------------------------------------------------------
# min_size
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_workers", [0, 2])
def test_min_size_blocks_then_unblocks(n_workers, start_method):
    """Sampling waits until ``min_size`` transitions exist: ``next`` times out naming min_size
    while the buffer holds fewer, and delivers once a writer added enough."""
    if n_workers == 0 and start_method != "fork":
        pytest.skip("in-process mode starts no process")
    with shmbuf.ReplayBuffer.create(procs.SPEC, capacity=256, lanes=2) as buf:
        with SamplerPool(buf, batch_size=8, limit=RateLimit(100),
                         workers=Workers(n_workers, start_method=start_method)) as pool, \
             buf.writer(lane=1) as w:
            assert "holds 0 of min_size=100" in _blocks(pool)
            _add_rows(w, 60)
            assert "holds 60 of min_size=100" in _blocks(pool)
            t, out = blocked_in_thread(lambda: pool.next(timeout=20).copy(),
                                       "next() returned before min_size was reached", settle=0.2)
            _add_rows(w, 40)
            t.join(20)
            assert out and isinstance(out[0], dict), out
            assert not procs.bad_rows(out[0], out[0]["lanes"], out[0]["indices"]).any()
            assert (out[0]["lanes"] == 1).all()


# --------------------------------------------------------------------------------------------
# samples_per_insert: samplers wait when they run ahead
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_workers", [0, 1, 2])
def test_samplers_wait_when_they_run_ahead_then_unblock_after_inserts(n_workers, start_method):
    """A ratio of 1 sample per insert with a tolerance of two batches over a pre-filled buffer:
    the samplers take two batches, then wait (the Timeout names the rate limiter); every 8
    inserts let one more batch through. Reverb's serialised limiter allows exactly
    floor((inserts * ratio - min_diff) / batch) batches; workers that check concurrently may
    each take one more, never more than that."""
    if n_workers == 0 and start_method != "fork":
        pytest.skip("in-process mode starts no process")
    B, min_size, ratio, tol = 8, 64, 1.0, 16
    min_diff = min_size * ratio - tol
    with procs.new_buffer(capacity=256, lanes=1, rows=min_size) as buf:
        with SamplerPool(buf, batch_size=B, limit=RateLimit(min_size, ratio, tol),
                         workers=Workers(n_workers, start_method=start_method), seed=0) as pool, \
             buf.writer(lane=0) as w:
            got = 0
            for step in range(4):
                if step:
                    _add_rows(w, B)
                inserts = min_size + step * B
                allowed = math.floor((inserts * ratio - min_diff) / B)
                while True:
                    try:
                        procs.assert_batch_ok(pool.next(timeout=5 if got < allowed else 0.3), B)
                    except shmbuf.Timeout as e:
                        assert "rate limiter" in str(e), e
                        break
                    got += 1
                    assert got <= allowed + max(0, n_workers - 1), "ran past the limiter"
                assert got >= allowed, f"step {step}: {got} batches, {allowed} allowed"
            if n_workers <= 1:
                assert got == allowed == 5


# --------------------------------------------------------------------------------------------
# samples_per_insert: writers wait when actors run ahead
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["add", "extend"])
def test_writers_wait_when_they_run_ahead_then_unblock_when_the_learner_samples(op, start_method):
    """With 4 samples per insert and a tolerance of 64, a writer may insert only a few rows
    beyond what has been sampled: the next ``add``/``extend`` blocks, then completes once the
    learner takes batches (which lets the workers sample more). A blocked call that runs out of
    time raises RateLimitTimeout and writes nothing."""
    B = 16
    with procs.new_buffer(capacity=512, lanes=2, rows=32) as buf:
        with SamplerPool(buf, batch_size=B, limit=RateLimit(64, 4.0, 64),
                         workers=Workers(1, staging=2, start_method=start_method),
                         seed=0) as pool, \
             buf.writer(lane=0, insert_timeout=0.3) as w:
            # Hold one batch: the worker then fills the other slot and samples no more, so the
            # room the writer has is settled.
            procs.assert_batch_ok(pool.next(timeout=30), B)

            def write_one() -> None:
                if op == "add":
                    w.add(**procs.make_row(0, w.committed))
                else:
                    _add_rows(w, 1)

            wrote = 0
            with pytest.raises(shmbuf.RateLimitTimeout, match="Nothing was written") as info:
                while True:
                    write_one()
                    wrote += 1
                    assert wrote < 500, "the writer was never held back"
            assert "samples_per_insert 4.0" in str(info.value)
            committed = buf.committed()
            with pytest.raises(shmbuf.RateLimitTimeout):  # nothing was written, again
                write_one()
            assert (buf.committed() == committed).all()
            assert len(buf) == int(committed.sum())
            # Blocks, then unblocks when the learner samples.
            w.timeout = 20
            t, out = blocked_in_thread(lambda: write_one() or "wrote", "the writer did not wait")
            deadline = time.monotonic() + 20
            while not out and time.monotonic() < deadline:
                try:  # one insert is worth a quarter batch: sampling may stall again after
                    procs.assert_batch_ok(pool.next(timeout=0.2), B)
                except shmbuf.Timeout:
                    pass
            t.join(5)
            assert out == ["wrote"]
            assert int(buf.committed(0)) == int(committed[0]) + 1


@pytest.mark.parametrize("op", ["add", "extend"])
def test_a_writer_opened_before_the_pool_is_limited_at_once(op):
    """A writer that was already writing when a rate-limiting pool starts obeys the limit from
    its next insert on: it may not keep writing unchecked rows it was granted while no limit
    existed."""
    with procs.new_buffer(capacity=8192, lanes=1, rows=0) as buf, \
         buf.writer(lane=0, insert_timeout=0.2) as w:
        for _ in range(64):  # unlimited for now
            w.add(**procs.make_row(0, w.committed))
        with SamplerPool(buf, batch_size=8, limit=RateLimit(64, 4.0, 32), workers=0) as pool:
            assert pool.n_workers == 0
            allowed = RateLimit(64, 4.0, 32).inserts_allowed(64, 0)  # nothing sampled yet
            assert allowed == 8
            wrote = 0
            with pytest.raises(shmbuf.RateLimitTimeout):
                while wrote <= 10_000:
                    if op == "add":
                        w.add(**procs.make_row(0, w.committed))
                    else:
                        _add_rows(w, 1)
                    wrote += 1
            assert wrote == allowed, f"{wrote} rows written past a limit that allowed {allowed}"


def test_extend_larger_than_the_limiter_can_ever_allow_fails_at_once():
    """An extend of more rows than ``max_insert_chunk`` could never pass: ValueError at once,
    nothing written."""
    with procs.new_buffer(capacity=1024, lanes=1, rows=64) as buf:
        with SamplerPool(buf, batch_size=8, limit=RateLimit(64, 4.0, 32),
                         workers=0) as pool, buf.writer(lane=0) as w:
            assert pool is not None
            before = w.committed
            t0 = time.monotonic()
            with pytest.raises(ValueError, match=r"can never pass the rate limit.*at most 8 rows"):
                _add_rows(w, 100)
            assert time.monotonic() - t0 < 1
            assert w.committed == before == int(buf.committed(0))


@pytest.mark.parametrize(
    "ratio, tol, prefill, shrink",
    [
        (1.0, 16, 64, 0),  # steady state, the largest chunk the limiter accepts
        (1.0, 16, 64, 1),  # one row less: not a multiple of the batch
        (4.0, 64, 63, 0),  # the first chunk crosses min_size
    ],
)
def test_extends_the_limiter_accepts_never_deadlock(ratio, tol, prefill, shrink, start_method):
    """A writer extends chunks of up to ``max_insert_chunk`` rows (what the limiter promises
    can pass) while the learner keeps taking batches: every extend completes. A larger chunk
    would leave writers and samplers waiting on each other, so it is refused at once."""
    B, min_size = 16, 64
    chunk = RateLimit(min_size, ratio, tol).max_insert_chunk() - shrink
    with procs.new_buffer(capacity=2048, lanes=1, rows=prefill) as buf:
        with SamplerPool(buf, batch_size=B, limit=RateLimit(min_size, ratio, tol),
                         workers=Workers(1, start_method=start_method), seed=0) as pool, \
             buf.writer(lane=0, insert_timeout=5) as w:
            t, out = in_thread(lambda: [_add_rows(w, chunk) for _ in range(12)] and "done")
            deadline = time.monotonic() + 40
            while not out and time.monotonic() < deadline:
                try:
                    procs.assert_batch_ok(pool.next(timeout=0.2), B)
                except shmbuf.Timeout:
                    pass
            t.join(5)
            assert out == ["done"], f"chunks of {chunk} rows: {out}"
            assert int(buf.committed(0)) == prefill + 12 * chunk
            # Run ahead until the limiter holds the writer back: a chunk larger than
            # max_insert_chunk is then refused at once instead of waiting.
            with pytest.raises(shmbuf.RateLimitTimeout):
                for _ in range(1000):
                    _add_rows(w, 1, timeout=0.2)
            t0 = time.monotonic()
            with pytest.raises(ValueError, match="can never pass the rate limiter"):
                _add_rows(w, RateLimit(min_size, ratio, tol).max_insert_chunk() + 1)
            assert time.monotonic() - t0 < 1


def test_tolerance_below_the_ratio_is_refused():
    """As in Reverb (error_buffer >= max(1, samples_per_insert)): a tolerance smaller than the
    ratio can leave single inserts and whole-batch samples waiting on each other for ever."""
    with procs.new_buffer(capacity=64, lanes=1) as buf:
        with pytest.raises(ValueError, match=r"tolerance 16 is smaller than samples_per_insert"):
            SamplerPool(buf, batch_size=16, limit=RateLimit(1, 25.0, 16), workers=0)


# --------------------------------------------------------------------------------------------
# close cancels a pending wait
# --------------------------------------------------------------------------------------------
def _limited_writer_setup(buf, start_method):
    pool = SamplerPool(buf, batch_size=8, limit=RateLimit(32, 8.0, 32),
                       workers=Workers(1, staging=2, start_method=start_method), seed=0)
    # Hold one batch: the worker then fills the other slot and samples no more.
    procs.assert_batch_ok(pool.next(timeout=30), 8)
    w = buf.writer(lane=0, insert_timeout=20)
    # Run ahead until an insert blocks.
    w.timeout = 0.2
    with pytest.raises(shmbuf.RateLimitTimeout):
        for _ in range(1000):
            w.add(**procs.make_row(0, w.committed))
    w.timeout = 20
    return pool, w


def test_closing_the_pool_releases_a_writer_blocked_by_its_limiter(start_method):
    """A writer blocked by the pool's rate limiter goes on as soon as the pool closes (the
    limit is lifted), long before its own timeout."""
    with procs.new_buffer(capacity=512, lanes=1, rows=32) as buf:
        pool, w = _limited_writer_setup(buf, start_method)
        with w:
            before = w.committed
            t, out = blocked_in_thread(lambda: w.add(**procs.make_row(0, w.committed)),
                                       "the writer was not blocked")
            t0 = time.monotonic()
            pool.close()
            t.join(5)
            assert out == [before], out
            assert time.monotonic() - t0 < 2
            for _ in range(200):  # no limit any more
                w.add(**procs.make_row(0, w.committed))


def test_closing_a_writer_cancels_its_pending_add(start_method):
    """A writer blocked in ``add`` raises ClosedError when another thread closes it; nothing was
    written and the lane is free for a new writer."""
    with procs.new_buffer(capacity=512, lanes=1, rows=32) as buf:
        pool, w = _limited_writer_setup(buf, start_method)
        with pool:
            before = int(buf.committed(0))
            t, out = blocked_in_thread(lambda: w.add(**procs.make_row(0, w.committed)),
                                       "the writer was not blocked")
            t0 = time.monotonic()
            w.close()
            t.join(5)
            assert len(out) == 1 and isinstance(out[0], shmbuf.ClosedError), out
            assert time.monotonic() - t0 < 2
            assert int(buf.committed(0)) == before
            with buf.writer(lane=0, timeout=1) as w2:
                assert w2.committed == before


def test_closing_a_writer_cancels_its_pending_extend(start_method):
    with procs.new_buffer(capacity=512, lanes=1, rows=32) as buf:
        pool, w = _limited_writer_setup(buf, start_method)
        with pool:
            before = int(buf.committed(0))
            t, out = blocked_in_thread(lambda: _add_rows(w, 2), "the writer was not blocked")
            w.close()
            t.join(5)
            assert len(out) == 1 and isinstance(out[0], shmbuf.ClosedError), out
            assert int(buf.committed(0)) == before


def test_a_second_limiting_pool_is_refused():
    with procs.new_buffer(capacity=64, lanes=1) as buf:
        with SamplerPool(buf, batch_size=8, limit=RateLimit(1, 1.0, 16), workers=0):
            with pytest.raises(shmbuf.ShmbufError, match="already rate-limits"):
                SamplerPool(buf, batch_size=8, limit=RateLimit(1, 1.0, 16), workers=0)
            # A pool without a ratio may sample beside it.
            with SamplerPool(buf, batch_size=8, workers=0) as free:
                procs.assert_batch_ok(free.next(timeout=5), 8)


# --------------------------------------------------------------------------------------------
# A limiter whose pool was SIGKILLed
# --------------------------------------------------------------------------------------------
def test_limiter_of_a_killed_pool_does_not_block_writers(start_method):
    """A pool in another process rate-limits our buffer, and our writer is held back. The pool's
    process is SIGKILLed (no cleanup runs, the limit stays configured in shared memory): the
    writer goes on at once instead of blocking forever, and the pool's workers exit."""
    with procs.new_buffer(capacity=512, lanes=1, rows=32) as buf, \
            procs.limiting_pool_process(buf, start_method) as (owner, info):
        with buf.writer(lane=0, insert_timeout=0.3) as w:
            with pytest.raises(shmbuf.RateLimitTimeout):
                for _ in range(1000):
                    w.add(**procs.make_row(0, w.committed))
            w.timeout = 30
            t, out = blocked_in_thread(lambda: w.add(**procs.make_row(0, w.committed)),
                                       "the writer was not blocked", settle=0.2)
            os.kill(info["pid"], signal.SIGKILL)
            t0 = time.monotonic()
            t.join(10)
            assert out and isinstance(out[0], int), out
            assert time.monotonic() - t0 < 2
            for _ in range(100):
                w.add(**procs.make_row(0, w.committed))
        assert procs.wait_dead(info["workers"], 5) == []


# --------------------------------------------------------------------------------------------
# The measured ratio
# --------------------------------------------------------------------------------------------
# The measured ratio
# --------------------------------------------------------------------------------------------
def test_measured_samples_per_insert_stays_within_tolerance(start_method):
    """Two actors write as fast as the limiter lets them while the learner takes batches for a
    second; then the actors stop and the learner drains what the limiter still allows. The
    ratio ``pool.stats()`` reports is the target's, and its error counted in samples is what
    Reverb's limiter leaves at rest: the samplers took everything the tolerance allows
    (error > tolerance - batch) and at most one batch more per extra sampler worker, which
    check the limiter concurrently (error <= tolerance + (workers - 1) * batch).

    (The numbers are read at rest because ``stats()`` reads inserts and samples one after the
    other: under load, thousands of rows can pass between the two reads.)"""
    import functools

    from workers import ActorGroup

    B, ratio, tol, W = 16, 2.0, 128, 2
    with procs.new_buffer(capacity=4096, lanes=2, rows=64) as buf:
        # The group stops while the pool still samples, so actors blocked by the limiter get
        # room to see ctx.stopping and return.
        with ActorGroup(functools.partial(procs.lane_writer, chunk=4), 2, buf,
                        start_method=start_method, seed=0) as group, \
             SamplerPool(buf, batch_size=B, limit=RateLimit(128, ratio, tol),
                         workers=Workers(W, start_method=start_method), seed=0) as pool:
            def inserted() -> float:
                st = pool.stats()
                return st["inserts_per_s"] * st["elapsed_s"]

            t0 = time.monotonic()
            # At least a second, and enough inserts: actors start slowly on a busy machine.
            while time.monotonic() < t0 + 1.0 or inserted() < 3000:
                procs.assert_batch_ok(pool.next(timeout=10), B)
                group.poll()
                assert time.monotonic() < t0 + 30, "the actors hardly write"
            stopper = threading.Thread(target=group.stop, kwargs={"timeout": 10}, daemon=True)
            stopper.start()
            while stopper.is_alive():
                try:
                    procs.assert_batch_ok(pool.next(timeout=0.1), B)
                except shmbuf.Timeout:
                    pass
            assert group.alive == 0
            while True:  # drain what the limiter still allows
                try:
                    procs.assert_batch_ok(pool.next(timeout=0.5), B)
                except shmbuf.Timeout as e:
                    assert "rate limiter" in str(e)
                    break
            stats = pool.stats()
            # Both are whole counts; stats() reports them as rates, so round the float products
            # back (at the bound itself float noise would otherwise decide the test).
            inserts = round(stats["inserts_per_s"] * stats["elapsed_s"])  # since the pool started
            assert inserts > 2000, f"only {inserts:.0f} inserts: the run proves nothing"
            samples = round(stats["samples_per_insert"] * inserts)
            assert round(samples) == stats["batches"] * B  # every sampled batch reached the learner
            err = samples - ratio * inserts
            assert tol - B < err <= tol + (W - 1) * B, (
                f"{samples:.0f} samples for {inserts:.0f} inserts: ratio "
                f"{stats['samples_per_insert']:.4f}, target {ratio} +/- {tol} samples")
            assert abs(stats["samples_per_insert"] - ratio) <= (tol + W * B) / inserts
