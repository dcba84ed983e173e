"""Epoch iteration (``SamplerPool(sampler="epoch")``): every held transition exactly once per
epoch, in a seeded random order, split across workers (fork, forkserver, spawn and in-process);
the rows short of a whole batch skipped (``drop_last``) or carried into the next batch."""

from __future__ import annotations

import numpy as np
import pytest

import shmbuf
from workers import SamplerPool

pytestmark = pytest.mark.timeout(90)

SPEC = shmbuf.Spec({"obs": ((2,), "int64")})
HELD = (50, 37)  # rows written to lanes 0 and 1: 87 in all
B = 8


@pytest.fixture
def buf():
    """A buffer whose row (lane, index) holds obs = [lane, index]."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=64, lanes=2) as b:
        for lane, n in enumerate(HELD):
            with b.writer(lane=lane) as w:
                w.extend({"obs": np.stack([np.full(n, lane), np.arange(n)], 1)})
        yield b


def _rows(pool: SamplerPool, n_batches: int) -> list[list[tuple[int, int]]]:
    """(lane, index) of the rows of ``n_batches`` batches, each checked against its data."""
    out = []
    for _ in range(n_batches):
        batch = pool.next(timeout=30)
        lanes, indices = np.asarray(batch.lanes), np.asarray(batch.indices)
        assert (np.asarray(batch["obs"]) == np.stack([lanes, indices], 1)).all()
        out.append(list(zip(lanes.tolist(), indices.tolist())))
    return out


ALL_ROWS = {(lane, i) for lane, n in enumerate(HELD) for i in range(n)}


def _check_epochs_with_drop_last(batches: list[list[tuple[int, int]]]) -> None:
    per_epoch = sum(HELD) // B  # 10 batches, 7 rows skipped
    assert len(batches) % per_epoch == 0
    for e in range(len(batches) // per_epoch):
        rows = [r for b in batches[e * per_epoch:(e + 1) * per_epoch] for r in b]
        assert len(rows) == len(set(rows)) == per_epoch * B  # none twice
        assert set(rows) <= ALL_ROWS


def test_each_row_once_per_epoch_across_workers(buf, start_method):
    with SamplerPool(buf, batch_size=B, n_workers=2, sampler="epoch", seed=1,
                     start_method=start_method) as pool:
        _check_epochs_with_drop_last(_rows(pool, 30))


def test_each_row_once_per_epoch_in_process(buf):
    with SamplerPool(buf, batch_size=B, n_workers=0, sampler="epoch", seed=1) as pool:
        _check_epochs_with_drop_last(_rows(pool, 20))


def test_seeded_order_is_reproducible_and_random(buf):
    def order(seed: int, n_workers: int) -> list[list[tuple[int, int]]]:
        with SamplerPool(buf, batch_size=B, n_workers=n_workers, sampler="epoch",
                         seed=seed) as pool:
            return _rows(pool, 15)

    first = order(3, 2)
    assert order(3, 2) == first
    assert order(3, 0) == first  # the learner chooses the rows: workers do not matter
    assert order(4, 2) != first
    flat = [r for b in first[:10] for r in b]
    assert flat != sorted(flat)  # shuffled, not in storage order


def test_without_drop_last_the_rest_opens_the_next_batch(buf, start_method):
    """87 rows in batches of 8: 87 batches are exactly 8 epochs, every row in each, the last
    batch of each epoch finished with the next epoch's first rows."""
    with SamplerPool(buf, batch_size=B, n_workers=2, sampler="epoch", seed=0,
                     drop_last=False, start_method=start_method) as pool:
        rows = [r for b in _rows(pool, sum(HELD)) for r in b]
    n = sum(HELD)
    for e in range(B):
        assert set(rows[e * n:(e + 1) * n]) == ALL_ROWS


def test_an_epoch_waits_for_a_whole_batch():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=64, lanes=1) as b:
        with b.writer(lane=0) as w:
            w.extend({"obs": np.zeros((5, 2), np.int64)})
            with SamplerPool(b, batch_size=B, n_workers=0, sampler="epoch", seed=0) as pool:
                with pytest.raises(shmbuf.Timeout):
                    pool.next(timeout=0.3)
                w.extend({"obs": np.zeros((5, 2), np.int64)})
                assert len(pool.next(timeout=10)["obs"]) == B


def test_epoch_refuses_what_it_cannot_do(buf):
    with pytest.raises(ValueError, match="max_times_sampled"):
        SamplerPool(buf, batch_size=B, n_workers=0, sampler="epoch", max_times_sampled=2)
    with pytest.raises(ValueError, match="sampler='epoch'"):
        SamplerPool(buf, batch_size=B, n_workers=0, sampler="epoch", sequence_length=4)
