"""Epoch iteration (``SamplerPool(selection=Epoch(...))``): every held transition, or every start
a sequence or frame-stack plan may draw, exactly once per epoch, in a seeded random order, split
across workers (fork, forkserver, spawn and in-process); the rows short of a whole batch make a
shorter last batch (``Epoch(drop_last=False)``), are skipped (``drop_last=True``) or carried
into the next batch (``carry_remainder=True``); ``pool.epoch()`` and ``batch.epoch`` show where
epochs end. Episode-aware rows are checked against ``tests.episode_model``, which knows nothing
of shmbuf's index math."""

from __future__ import annotations

import numpy as np
import pytest

import shmbuf
from shmbuf.errors import ShmbufError
from shmbuf.sampling import Plan
from tests.episode_model import OPEN, TERMINATED, TRUNCATED, Episode, Model, make_spec, write
from workers import SamplerPool
from workers.config import Workers
from workers.selection import Counted, Epoch

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


def _row_ids(batch) -> list[tuple[int, int]]:
    """(lane, index) of each row of a plain batch, checked against its data."""
    lanes, indices = np.asarray(batch.lanes), np.asarray(batch.indices)
    assert (np.asarray(batch["obs"]) == np.stack([lanes, indices], 1)).all()
    return list(zip(lanes.tolist(), indices.tolist()))


def _rows(pool: SamplerPool, n_batches: int) -> list[list[tuple[int, int]]]:
    """(lane, index) of the rows of ``n_batches`` batches, each checked against its data."""
    return [_row_ids(pool.next(timeout=30)) for _ in range(n_batches)]


ALL_ROWS = {(lane, i) for lane, n in enumerate(HELD) for i in range(n)}


def _check_epochs_with_drop_last(batches: list[list[tuple[int, int]]]) -> None:
    per_epoch = sum(HELD) // B  # 10 batches, 7 rows skipped
    assert len(batches) % per_epoch == 0
    for e in range(len(batches) // per_epoch):
        rows = [r for b in batches[e * per_epoch:(e + 1) * per_epoch] for r in b]
        assert len(rows) == len(set(rows)) == per_epoch * B  # none twice
        assert set(rows) <= ALL_ROWS


def test_each_row_once_per_epoch_across_workers(buf, start_method):
    with SamplerPool(buf, batch_size=B, selection=Epoch(),
                     workers=Workers(2, start_method=start_method), seed=1) as pool:
        _check_epochs_with_drop_last(_rows(pool, 30))


def test_each_row_once_per_epoch_in_process(buf):
    with SamplerPool(buf, batch_size=B, selection=Epoch(), workers=0, seed=1) as pool:
        _check_epochs_with_drop_last(_rows(pool, 20))


def test_epoch_size_is_what_the_epoch_began_with(buf):
    with SamplerPool(buf, batch_size=B, selection=Epoch(), workers=0, seed=1) as pool:
        batch = pool.next(timeout=30)
        assert pool.epoch_size(batch.epoch) == sum(HELD)
        with buf.writer(lane=1) as w:  # rows written now belong to the next epoch
            w.extend({"obs": np.stack([np.full(5, 1), np.arange(HELD[1], HELD[1] + 5)], 1)})
        while not pool.next(timeout=30).ends_epoch:
            pass
        assert pool.epoch_size(batch.epoch) == sum(HELD)
        assert pool.epoch_size(pool.next(timeout=30).epoch) == sum(HELD) + 5
        assert pool.epoch_size(99) is None


def test_seeded_order_is_reproducible_and_random(buf):
    def order(seed: int, n_workers: int) -> list[list[tuple[int, int]]]:
        with SamplerPool(buf, batch_size=B, selection=Epoch(), workers=n_workers,
                         seed=seed) as pool:
            return _rows(pool, 15)

    first = order(3, 2)
    assert order(3, 2) == first
    assert order(3, 0) == first  # the learner chooses the rows: workers do not matter
    assert order(4, 2) != first
    flat = [r for b in first[:10] for r in b]
    assert flat != sorted(flat)  # shuffled, not in storage order


def test_carry_remainder_opens_the_next_batch_with_the_rest(buf, start_method):
    """87 rows in batches of 8: 87 batches are exactly 8 epochs, every row in each, the last
    batch of each epoch finished with the next epoch's first rows."""
    with SamplerPool(buf, batch_size=B, selection=Epoch(drop_last=False, carry_remainder=True),
                     workers=Workers(2, start_method=start_method), seed=0) as pool:
        rows = [r for b in _rows(pool, sum(HELD)) for r in b]
    n = sum(HELD)
    for e in range(B):
        assert set(rows[e * n:(e + 1) * n]) == ALL_ROWS


def _epochs(pool: SamplerPool, n_epochs: int, check, first: int = 0
            ) -> list[list[tuple[int, ...]]]:
    """``n_epochs`` epochs through ``pool.epoch()`` (the first is epoch ``first``): per epoch,
    the ids ``check(batch)`` gives for its rows. Checks the epoch tags and that only an epoch's
    last batch may be short."""
    out = []
    for e in range(first, first + n_epochs):
        ids, sizes = [], []
        for batch in pool.epoch(timeout=30):
            assert batch.epoch == e
            n = batch.batch_size
            fields = [batch[k] for k in batch]
            assert all(len(a) == n for a in [*fields, batch.indices, batch.lanes, batch.weights])
            ids += check(batch)
            sizes.append((n, batch.ends_epoch))
        assert all(n == B and not ends for n, ends in sizes[:-1]) and sizes[-1][1]
        out.append(ids)
    return out


def test_short_last_batch_holds_the_remainder(buf, start_method):
    """drop_last=False: 87 rows are 10 batches of 8 and one of 7 per epoch (every field, the
    indices, lanes and weights 7 long), every row once; the order is seeded, and another
    each epoch."""
    def run(seed: int) -> list[list[tuple[int, ...]]]:
        with SamplerPool(buf, batch_size=B, selection=Epoch(drop_last=False),
                         workers=Workers(2, start_method=start_method), seed=seed) as pool:
            epochs = _epochs(pool, 3, _row_ids)
            last = pool.next(timeout=30)  # the next epoch goes on after the short batch
            assert last.epoch == 3 and last.batch_size == B
            return epochs

    epochs = run(5)
    for ids in epochs:
        assert len(ids) == len(set(ids)) == len(ALL_ROWS) and set(ids) == ALL_ROWS
    assert epochs[0] != epochs[1]
    assert run(5) == epochs


@pytest.mark.parametrize("where", [{"output": "torch"}, {"device": "cpu"}],
                         ids=["torch", "device"])
def test_short_last_batch_as_torch_tensors(buf, where):
    """Host tensors, and device tensors (``device=``: copied through the device stage, whose
    batches carry their epoch tags too), in-process and from workers: the same batches."""
    pytest.importorskip("torch")
    with SamplerPool(buf, batch_size=B, selection=Epoch(drop_last=False), workers=0, seed=2,
                     **where) as pool:
        batches = [b.copy() for b in pool.epoch()]
        assert [len(b["obs"]) for b in batches] == [B] * 10 + [7]
        assert [b["weights"].shape[0] for b in batches][-1] == 7
    with SamplerPool(buf, batch_size=B, selection=Epoch(drop_last=False), workers=2, seed=2,
                     **where) as workers:
        same = [b.copy() for b in workers.epoch()]
    for a, b in zip(batches, same, strict=True):
        assert (a["obs"] == b["obs"]).all() and (a["indices"] == b["indices"]).all()


def test_an_epoch_smaller_than_a_batch_is_one_short_batch():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=64, lanes=1) as b:
        with b.writer(lane=0) as w:
            w.extend({"obs": np.stack([np.zeros(5, np.int64), np.arange(5)], 1)})
        with SamplerPool(b, batch_size=B, selection=Epoch(drop_last=False), workers=0,
                         seed=0) as pool:
            for e in range(3):
                batch = pool.next(timeout=10)
                assert (batch.epoch, batch.ends_epoch, batch.batch_size) == (e, True, 5)
                assert sorted(np.asarray(batch.indices).tolist()) == list(range(5))


def test_an_epoch_waits_for_a_whole_batch():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=64, lanes=1) as b:
        with b.writer(lane=0) as w:
            w.extend({"obs": np.zeros((5, 2), np.int64)})
            with SamplerPool(b, batch_size=B, selection=Epoch(), workers=0, seed=0) as pool:
                with pytest.raises(shmbuf.Timeout):
                    pool.next(timeout=0.3)
                w.extend({"obs": np.zeros((5, 2), np.int64)})
                assert len(pool.next(timeout=10)["obs"]) == B


def test_rows_overwritten_mid_epoch_are_lost_to_it_and_the_rest_come_once():
    """The writer laps 16 rows of a 64-row lane during epoch 0: the epoch still ends with a
    tagged last batch and delivers every row it began with that was not overwritten, once;
    the rows written meanwhile wait for epoch 1, which holds exactly the lane's window."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=64, lanes=1) as b, b.writer(lane=0) as w:
        def write(first: int, n: int) -> None:
            w.extend({"obs": np.stack([np.zeros(n, np.int64), np.arange(first, first + n)], 1)})

        write(0, 50)
        with SamplerPool(b, batch_size=B, selection=Epoch(drop_last=False), workers=0,
                         seed=3) as pool:
            batches = pool.epoch()
            seen = _row_ids(next(batches)) + _row_ids(next(batches))
            write(50, 30)  # rows 0..15 are overwritten
            seen += [r for batch in batches for r in _row_ids(batch)]
            assert len(seen) == len(set(seen))
            assert {(0, i) for i in range(16, 50)} <= set(seen) <= {(0, i) for i in range(50)}
            (epoch1,) = _epochs(pool, 1, _row_ids, first=1)
            assert sorted(epoch1) == [(0, i) for i in range(16, 80)]


# -- sequences and frame stacks -------------------------------------------------------------------
EPISODES = [  # lane 0 wraps its 24-row lanes (the first 2 rows are overwritten)
    [Episode(5, TERMINATED), Episode(3, TRUNCATED), Episode(9, TERMINATED), Episode(9, OPEN)],
    [Episode(7, TRUNCATED), Episode(1, TERMINATED), Episode(6, OPEN, last_terminated=True)],
]
CAPACITY = 24
PLANS = [
    {"sequence_length": 4},
    {"sequence_length": 4, "cross_episodes": True},
    {"frame_stack": 3, "frame_lookahead": 1},
]


def _check_against_model(expected: dict):
    """A ``check`` for ``_epochs``: each row equals the model's arrays for its anchor."""
    def check(batch) -> list[tuple[int, int]]:
        lanes, indices = np.asarray(batch.lanes), np.asarray(batch.indices)
        anchors = indices[:, 0] if indices.ndim > 1 else indices
        ids = list(zip(lanes.tolist(), anchors.tolist()))
        for b, key in enumerate(ids):
            for name, want in expected[key].items():
                got = np.asarray(batch[name][b])
                assert np.allclose(got, want) if got.dtype.kind == "f" else (got == want).all(), (
                    key, name, got, want)
        return ids

    return check


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_every_start_of_a_plan_once_per_epoch(plan, start_method):
    """Every (lane, start) the model says the plan may draw comes exactly once per epoch, with
    the model's data and masks; the last batch is short by the remainder; seeded order."""
    with shmbuf.ReplayBuffer.create(make_spec(False), CAPACITY, lanes=2) as b:
        write(b, EPISODES)
        expected = Model(EPISODES, False, CAPACITY).drawable(b.compile(**plan))
        starts = set(expected)
        assert len(starts) % B  # the epochs end with a short batch

        def run(seed: int) -> list[list[tuple[int, ...]]]:
            with SamplerPool(b, batch_size=B, selection=Epoch(drop_last=False),
                             workers=Workers(2, start_method=start_method), seed=seed,
                             plan=Plan(**plan)) as pool:
                return _epochs(pool, 2, _check_against_model(expected))

        epochs = run(7)
        for ids in epochs:
            assert len(ids) == len(set(ids)) == len(starts) and set(ids) == starts
        assert epochs[0] != epochs[1] and run(7) == epochs


@pytest.mark.parametrize("plan", [{"n_step": 3, "gamma": 0.9}, {"sequence_length": 3}],
                         ids=["n_step", "sequence"])
def test_derived_next_obs_and_n_step_epochs_in_process(plan):
    with shmbuf.ReplayBuffer.create(make_spec(True), CAPACITY, lanes=2, next_obs="derived") as b:
        write(b, EPISODES)
        expected = Model(EPISODES, True, CAPACITY).drawable(b.compile(**plan))
        with SamplerPool(b, batch_size=B, selection=Epoch(drop_last=False), workers=0, seed=1,
                         plan=Plan(**plan)) as pool:
            (ids,) = _epochs(pool, 1, _check_against_model(expected))
        assert len(ids) == len(set(ids)) and set(ids) == set(expected)


def test_anchors_and_gather_at_on_the_buffer():
    """The buffer's own surface: ``anchors`` lists the plan's starts, ``gather_at`` reads them
    as ``sample_into`` would, and refuses a start that is not valid (any more)."""
    with shmbuf.ReplayBuffer.create(make_spec(False), CAPACITY, lanes=2) as b:
        write(b, EPISODES)
        compiled = b.compile(sequence_length=4)
        found = b.anchors(compiled)
        assert set(zip(found.lanes.tolist(), found.indices.tolist())) == set(
            Model(EPISODES, False, CAPACITY).drawable(compiled))
        out = compiled.allocate(found.lanes.size)
        assert b.gather_at(out, found.lanes, found.indices, plan=compiled)
        bad = np.array([CAPACITY + 20])  # lane 0: the last 4 steps run past the newest row
        assert not b.gather_at(compiled.allocate(1), np.zeros(1, np.int64), bad, plan=compiled)
        assert b.anchors(compiled, among=shmbuf.sampling.Draw(np.zeros(1, np.int64), bad)
                         ).lanes.size == 0


def test_epoch_refuses_what_it_cannot_do(buf):
    """Epochs deliver each row once per epoch (no retirement count), ``carry_remainder`` needs
    ``drop_last=False``, ``drop_last`` is a bool; ``epoch()`` needs an epoch pool. Each refused
    by the object that holds the option, before the pool touches the buffer."""
    with pytest.raises(TypeError, match=r"Counted\(of=Epoch\(.*Uniform\(\) or Prioritized"):
        SamplerPool(buf, batch_size=B, selection=Counted(2, Epoch()), workers=0)
    with pytest.raises(ValueError, match=r"Epoch\(carry_remainder=True\).*drop_last=False"):
        SamplerPool(buf, batch_size=B, selection=Epoch(carry_remainder=True), workers=0)
    with pytest.raises(TypeError, match=r"Epoch\(drop_last='no'\): drop_last must be a bool"):
        SamplerPool(buf, batch_size=B, selection=Epoch(drop_last="no"), workers=0)
    with SamplerPool(buf, batch_size=B, workers=0) as pool:
        with pytest.raises(ShmbufError, match=r"selection=Epoch\(\.\.\.\)"):
            pool.epoch()
        assert pool.next().epoch is None and not pool.next().ends_epoch


def _gather_after_overwriting(nth: int, gather):
    """A ``BatchFiller.gather`` that, at its ``nth`` call (in the worker), first overwrites the
    whole of lane 0 (rows whose obs still names their (lane, index)): that batch's lane-0 rows
    are gone before it is gathered, so the worker hands its slot back STALE."""
    calls = [0]

    def gather_late(self, slot):
        calls[0] += 1
        if calls[0] == nth:
            with self.buf.writer(lane=0) as w:
                first = w.committed
                w.extend({"obs": np.stack([np.zeros(64, np.int64), np.arange(first, first + 64)], 1)})
        return gather(self, slot)
    return gather_late


@pytest.mark.parametrize("drop_last", [True, False])
def test_an_epochs_last_batch_overwritten_before_it_was_gathered(buf, monkeypatch, drop_last):
    """The worker finds an epoch's last batch overwritten (lane 0 lapped) while the learner has
    handed out batches of the next epoch already (the chaos stress found this: ``batch.epoch``
    went back). Batches never go back to an earlier epoch and no row comes twice in an epoch.
    With ``drop_last=False`` the batch is replaced in its place by its rows still held, a short
    batch that ends the epoch; with ``drop_last=True`` (whole batches only) they are lost to
    the epoch and ``epoch()`` ends it before the first batch of the next one, which the next
    ``epoch()`` starts with. (fork only: the worker inherits the patched gather.)"""
    from workers import filler

    per_epoch = sum(HELD) // B + (0 if drop_last else 1)  # the last gather of epoch 0
    monkeypatch.setattr(filler.BatchFiller, "gather",
                        _gather_after_overwriting(per_epoch, filler.BatchFiller.gather))
    with SamplerPool(buf, batch_size=B, selection=Epoch(drop_last=drop_last),
                     workers=Workers(1, staging=4, start_method="fork"), seed=3) as pool:
        epochs = []
        for _ in range(3):
            rows, tags, ends = [], [], []
            for batch in pool.epoch(timeout=30):
                rows += _row_ids(batch)
                tags.append(batch.epoch)
                ends.append(batch.ends_epoch)
            epochs.append((rows, tags, ends))
    (rows0, tags0, ends0), (rows1, tags1, ends1), _ = epochs
    assert tags0 == [0] * len(tags0) and tags1 == [1] * len(tags1)
    assert len(rows0) == len(set(rows0)) and len(rows1) == len(set(rows1))
    lost = {r for r in ALL_ROWS if r[0] == 0} - set(rows0)
    if drop_last:  # the last batch is gone: the epoch ended without it
        assert len(tags0) == per_epoch - 1 and not any(ends0)
    else:  # replaced in its place by its lane-1 rows
        assert len(tags0) == per_epoch and ends0[-1] and not any(ends0[:-1])
        assert rows0[-(len(rows0) - (per_epoch - 1) * B):]  # a short last batch
        assert set(rows0) | lost == ALL_ROWS
    assert lost, "no row of lane 0 was overwritten: the test did not test"
    # Epoch 1 began before lane 0 was lapped: its lane-0 rows are lost to it too, and with
    # whole batches only its last one may be; an epoch ends at most once, at its end.
    assert not any(ends1[:-1]) and (ends1[-1] or drop_last)
