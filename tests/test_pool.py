"""``SamplerPool`` basics under fork, forkserver and spawn: batches hold exactly the rows they claim
(every row checks itself against ``batch.lanes`` / ``batch.indices``), the ``Batch`` life cycle,
zero-copy torch output, in-process mode, field subsets, more staging slots than a POSIX message
queue holds, argument checks, transforms, and seeded reproducibility."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

import shmbuf
from shmbuf import RateLimit
from shmbuf.scan import scan
from tests import pool_procs as procs
from workers import Batch, SamplerPool
from workers.config import Transform, Workers

pytestmark = pytest.mark.timeout(60)

B = 16


@pytest.fixture
def buf():
    b = procs.new_buffer(capacity=128, lanes=2)
    yield b
    b.close()


# --------------------------------------------------------------------------------------------
# Batches: shapes, dtypes, values
# --------------------------------------------------------------------------------------------
def test_batches_hold_the_rows_they_claim(buf, start_method):
    """Shapes and dtypes follow the spec; every delivered row is whole and is the (lane, index)
    that ``batch.lanes`` / ``batch.indices`` name; both lanes are drawn from; weights are ones."""
    with SamplerPool(buf, B, workers=Workers(2, start_method=start_method), seed=0) as pool:
        assert pool.start_method == start_method
        lanes_seen = set()
        for _ in range(40):
            batch = pool.next(timeout=30)
            assert isinstance(batch, Batch)
            assert list(batch) == procs.FIELDS
            for name, field in procs.SPEC.items():
                assert batch[name].shape == (B, *field.shape)
                assert batch[name].dtype == field.dtype
            assert batch.indices.dtype == np.int64 and batch.lanes.dtype == np.int64
            assert batch.weights.shape == (B,) and (batch.weights == 1.0).all()
            assert batch.batch_size == B
            procs.assert_batch_ok(batch, B)
            assert (batch.indices >= 0).all() and (batch.indices < 128).all()
            lanes_seen.update(batch.lanes.tolist())
        assert lanes_seen == {0, 1}
        stats = pool.stats()
        assert stats["batches"] == 40 and stats["restarts"] == 0
        assert len(pool.worker_pids) == 2


def test_iteration_and_next_timeout(buf, start_method):
    """The pool is an iterator (``for batch in pool``) beside ``next(timeout=...)``."""
    with SamplerPool(buf, B, workers=Workers(1, start_method=start_method), seed=0) as pool:
        assert iter(pool) is pool
        n = 0
        for batch in itertools.islice(pool, 10):
            procs.assert_batch_ok(batch, B)
            n += 1
        assert n == 10
        procs.assert_batch_ok(next(pool), B)
        procs.assert_batch_ok(pool.next(timeout=5), B)


def test_batch_is_released_by_the_next_batch_and_by_release(buf, start_method):
    """A Batch is valid until the next one is taken or ``release()``: after that every method
    raises ClosedError, ``copy()`` taken before survives, and the slot goes back to the ring."""
    with SamplerPool(buf, B, workers=Workers(1, staging=2, start_method=start_method),
                     seed=0) as pool:
        first = pool.next(timeout=30)
        kept = first.copy()
        assert set(kept) == {*procs.FIELDS, "indices", "lanes", "weights"}
        assert not first.released
        second = pool.next(timeout=30)
        assert first.released and not second.released
        for use in (lambda: first["obs"], lambda: first.indices, lambda: first.lanes,
                    lambda: first.weights, lambda: list(first), lambda: len(first),
                    lambda: "obs" in first, first.copy, lambda: first.batch_size):
            with pytest.raises(shmbuf.ClosedError, match="released"):
                use()
        assert "released" in repr(first)
        # The copy is owned memory: still whole after the slot was refilled many times.
        for _ in range(6):
            pool.next(timeout=30)
        assert not procs.bad_rows(kept, kept["lanes"], kept["indices"]).any()
        # Explicit release hands the slot back (the pool has only 2 slots: without it, taking
        # more batches would starve) and is idempotent.
        for _ in range(10):
            b = pool.next(timeout=30)
            b.release()
            b.release()
            assert b.released
            with pytest.raises(shmbuf.ClosedError):
                b["lane"]
        last = pool.next(timeout=30)
    # Closing the pool invalidates the batch it still held.
    assert last.released
    with pytest.raises(shmbuf.ClosedError):
        last["obs"]


def test_more_staging_slots_than_a_posix_message_queue_holds(buf, start_method):
    """24 staging slots (Linux's default POSIX mqueue limit is 10 messages): more than 10 batches
    sit ready at once, every slot is used, every row checks."""
    with SamplerPool(buf, 4, workers=Workers(2, staging=24, start_method=start_method),
                     seed=0) as pool:
        assert pool.n_staging == 24
        batch = pool.next(timeout=30)
        procs.assert_batch_ok(batch, 4)
        seq = [batch.slot]
        deadline = time.monotonic() + 20
        ready = 0
        while time.monotonic() < deadline:
            time.sleep(0.05)
            batch = pool.next(timeout=30)  # takes the announcements queued meanwhile
            seq.append(batch.slot)
            ready = max(ready, pool.stats()["staging_ready"])
            if ready >= 20:
                break
        assert ready > 10, f"at most {ready} batches were ready at once"
        for _ in range(60):
            batch = pool.next(timeout=30)
            procs.assert_batch_ok(batch, 4)
            seq.append(batch.slot)
        assert set(seq) == set(range(24)), f"slots delivered in this order: {seq}"


def test_fields_subset(buf, start_method):
    """``fields=`` gathers only those fields; they still hold the rows the batch names."""
    with SamplerPool(buf, B, workers=Workers(1, start_method=start_method), seed=0,
                     fields=["index", "lane", "payload"]) as pool:
        batch = pool.next(timeout=30)
        assert list(batch) == ["index", "lane", "payload"]
        assert "obs" not in batch
        with pytest.raises(KeyError):
            batch["obs"]
        procs.assert_batch_ok(batch, B)


# --------------------------------------------------------------------------------------------
# In-process mode
# --------------------------------------------------------------------------------------------
def test_in_process_mode_has_the_same_api(buf, own_shm_entries):
    """``n_workers=0`` samples in this process behind the same API: no process, no staging
    segment, the same Batch life cycle, stats, a Timeout naming min_size."""
    before = own_shm_entries()
    with SamplerPool(buf, B, workers=0, seed=0) as pool:
        assert pool.worker_pids == [] and pool.staging_name is None
        assert own_shm_entries() == before  # no staging ring
        first = pool.next(timeout=5)
        procs.assert_batch_ok(first, B)
        kept = first.copy()
        for batch in itertools.islice(pool, 20):
            procs.assert_batch_ok(batch, B)
        assert first.released
        with pytest.raises(shmbuf.ClosedError):
            first["obs"]
        assert not procs.bad_rows(kept, kept["lanes"], kept["indices"]).any()
        assert pool.stats()["batches"] == 21
    with shmbuf.ReplayBuffer.create(procs.SPEC, capacity=16) as empty:
        with SamplerPool(empty, 4, workers=0, limit=RateLimit(3)) as pool:
            with pytest.raises(shmbuf.Timeout, match="min_size=3"):
                pool.next(timeout=0.2)


def test_in_process_mode_transform_and_fields(buf):
    """In-process mode applies the transform and the field subset like the workers do."""
    with SamplerPool(buf, B, workers=0, seed=0, transform=procs.double_index) as pool:
        batch = pool.next(timeout=5)
        assert list(batch) == ["lane", "index", "twice", "grid"]
        assert (batch["index"] == batch.indices).all() and (batch["lane"] == batch.lanes).all()
        assert (batch["twice"] == 2.0 * batch.indices).all()
        assert batch["grid"].shape == (B, 2, 2) and batch["grid"].dtype == np.uint8
    with SamplerPool(buf, B, workers=0, fields=["lane", "index", "obs"]) as pool:
        batch = pool.next(timeout=5)
        assert list(batch) == ["lane", "index", "obs"]
        procs.assert_batch_ok(batch, B)


# --------------------------------------------------------------------------------------------
# torch output
# --------------------------------------------------------------------------------------------
def test_torch_output_is_a_view_of_the_staging_slot(buf, start_method):
    """``output="torch"`` returns tensors over the staging slot's memory, not copies: each
    tensor's data pointer is the slot array's address, and a write through the tensor is seen
    by another mapping of the staging segment."""
    torch = pytest.importorskip("torch")
    from workers.staging import StagingRing

    with SamplerPool(buf, B, workers=Workers(1, start_method=start_method), seed=0,
                     output="torch") as pool:
        batch = pool.next(timeout=30)
        assert isinstance(batch["obs"], torch.Tensor) and isinstance(batch.indices, torch.Tensor)
        assert batch["obs"].dtype == torch.float32 and tuple(batch["obs"].shape) == (B, 2, 3)
        assert batch["lane"].dtype == torch.int64
        bad = procs.bad_rows({k: batch[k].numpy() for k in batch}, batch.lanes.numpy(),
                             batch.indices.numpy())
        assert not bad.any()
        slot_arrays = pool._delivery.ring.slot(batch.slot)  # the learner's own mapping of the slot
        for name in procs.FIELDS:
            assert batch[name].data_ptr() == slot_arrays[name].ctypes.data
        assert batch.indices.data_ptr() == slot_arrays["_indices"].ctypes.data
        other = StagingRing.attach(pool.staging_name)  # a second, independent mapping
        try:
            mirror = other.slot(batch.slot)["obs"]
            assert mirror.ctypes.data != batch["obs"].data_ptr()
            batch["obs"][0, 0, 0] = -12345.0
            assert mirror[0, 0, 0] == -12345.0
            del mirror
        finally:
            other.close()
        kept = batch.copy()
        assert kept["obs"].data_ptr() != batch["obs"].data_ptr()
        assert isinstance(kept["indices"], torch.Tensor)


def test_torch_output_in_process():
    """``output="torch"`` with ``n_workers=0`` gives tensors too."""
    torch = pytest.importorskip("torch")
    with procs.new_buffer(capacity=64, lanes=1) as buf:
        with SamplerPool(buf, 8, workers=0, output="torch", seed=0) as pool:
            batch = pool.next(timeout=5)
            assert isinstance(batch["payload"], torch.Tensor)
            bad = procs.bad_rows({k: batch[k].numpy() for k in batch}, batch.lanes.numpy(),
                                 batch.indices.numpy())
            assert not bad.any()


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [  # (lambdas: an option object refuses bad input when it is made, inside the test)
        (lambda: {"batch_size": 0}, r"batch_size must be a positive int, got 0"),
        (lambda: {"batch_size": -3}, r"batch_size must be a positive int, got -3"),
        (lambda: {"batch_size": True}, r"batch_size must be a positive int, got True"),
        (lambda: {"batch_size": 2.5}, r"batch_size must be a positive int, got 2.5"),
        (lambda: {"workers": Workers(-1)}, r"Workers\(n=-1\): n must be an int in \[0, 64\]"),
        (lambda: {"workers": Workers(65)}, r"Workers\(n=65\): n must be an int in \[0, 64\]"),
        (lambda: {"workers": Workers(1.5)}, r"Workers\(n=1.5\)"),
        (lambda: {"workers": Workers(2, staging=2)},
         r"Workers\(staging=2\): at least n \+ 1 = 3 slots"),
        (lambda: {"workers": Workers(0, staging=0)},
         r"Workers\(staging=0\): at least n \+ 1 = 1 slots"),
        (lambda: {"output": "tensorflow"},
         r"Output\('tensorflow'\): the kind is 'numpy', 'torch' or 'jax'"),
        (lambda: {"timeout": 0}, r"timeout must be > 0 seconds, got 0"),
        (lambda: {"timeout": -1}, r"timeout must be > 0 seconds, got -1"),
        (lambda: {"timeout": float("nan")}, r"timeout must be > 0 seconds, got nan"),
        (lambda: {"timeout": "soon"}, r"timeout must be a number of seconds, got 'soon'"),
        (lambda: {"limit": RateLimit(0)}, r"min_size must be >= 1, got 0"),
        (lambda: {"limit": RateLimit(1, 4.0, 2)}, r"tolerance 2 is smaller than batch_size 4"),
        (lambda: {"limit": RateLimit(1, 0.0, 64)}, r"ratio must be finite and > 0, got 0.0"),
        (lambda: {"limit": RateLimit(1, -1.0, 64)}, r"ratio must be finite and > 0, got -1.0"),
        (lambda: {"fields": ["obs", "nope"]}, r"unknown field\(s\) \['nope'\]"),
        (lambda: {"workers": Workers(1, max_restarts_per_minute=-1)},
         r"Workers\(max_restarts_per_minute=-1\) must be >= 0"),
        (lambda: {"workers": Workers(1, start_method="telepathy")}, r"telepathy"),
    ],
)
def test_bad_arguments_raise_clear_value_errors(buf, kwargs, match, own_shm_entries):
    """Each bad argument raises a ValueError that names it and the value given, and nothing is
    left behind: no segment, no process."""
    import multiprocess

    before = own_shm_entries()
    with pytest.raises(ValueError, match=match):
        SamplerPool(buf, **{"batch_size": 4, "workers": 1, **kwargs()})
    assert own_shm_entries() == before
    assert multiprocess.active_children() == []
    assert not buf.closed  # the caller's buffer is untouched


def test_bad_next_timeout(buf):
    with SamplerPool(buf, 4, workers=0) as pool:
        for bad in (0, -1, float("nan"), "x"):
            with pytest.raises(ValueError, match="timeout"):
                pool.next(timeout=bad)
        procs.assert_batch_ok(pool.next(timeout=5), 4)


def test_unknown_buffer_name_and_closed_pool():
    """A name that is not a buffer raises SegmentNotFoundError; a closed pool raises
    ClosedError from next() and iteration; close() is idempotent."""
    with pytest.raises(shmbuf.SegmentNotFoundError):
        SamplerPool("shmbuf-no-such-buffer", 4, workers=1)
    with procs.new_buffer(capacity=32, lanes=1) as buf:
        pool = SamplerPool(buf.name, 4, workers=Workers(1, start_method="fork"))
        procs.assert_batch_ok(pool.next(timeout=30), 4)
        pool.close()
        pool.close()
        with pytest.raises(shmbuf.ClosedError):
            pool.next(timeout=1)
        with pytest.raises(shmbuf.ClosedError):
            next(pool)
        assert not buf.closed  # the pool attached its own handle and closed only that


# --------------------------------------------------------------------------------------------
# Transforms
# --------------------------------------------------------------------------------------------
def test_lambda_transform(buf, start_method):
    """A lambda (pickled by value with cloudpickle) runs in every worker under every start
    method; it may capture local values."""
    offset = 1000
    with SamplerPool(buf, B, workers=Workers(2, start_method=start_method), seed=0,
                     transform=lambda b: dict(b, index=b["index"] + offset)) as pool:
        for _ in range(5):
            batch = pool.next(timeout=30)
            assert (batch["index"] == batch.indices + offset).all()
            assert (batch["lane"] == batch.lanes).all()
            assert (batch["payload"] == procs.payload_for(batch.lanes, batch.indices)).all()


def test_transform_output_may_differ_from_the_buffer(buf, start_method):
    """Output fields, shapes and dtypes come from the transform (inferred by a dry run)."""
    with SamplerPool(buf, B, workers=Workers(1, start_method=start_method), seed=0,
                     transform=procs.double_index) as pool:
        batch = pool.next(timeout=30)
        assert list(batch) == ["lane", "index", "twice", "grid"]
        assert batch["twice"].dtype == np.float64 and batch["twice"].shape == (B,)
        assert batch["grid"].dtype == np.uint8 and batch["grid"].shape == (B, 2, 2)
        assert (batch["index"] == batch.indices).all() and (batch["lane"] == batch.lanes).all()
        assert (batch["twice"] == 2.0 * batch.indices).all()
        assert (batch["grid"] == batch.lanes[:, None, None]).all()


def test_transform_editing_in_place_and_returning_none(buf, start_method):
    """A transform may edit the batch in place and return None."""
    with SamplerPool(buf, B, workers=Workers(1, start_method=start_method), seed=0,
                     transform=procs.negate_obs_in_place) as pool:
        batch = pool.next(timeout=30)
        assert list(batch) == procs.FIELDS
        assert (batch["obs"] == -procs.obs_for(batch.lanes, batch.indices)).all()
        assert (batch["payload"] == procs.payload_for(batch.lanes, batch.indices)).all()


def test_transform_changing_its_output_shape_is_reported(buf):
    """A transform whose output shape differs from its dry run's fails in the worker with a
    WorkerError that says shapes must stay fixed."""
    with SamplerPool(buf, 8, workers=Workers(1, start_method="fork"),
                     transform=procs.ShrinkInWorker()) as pool:
        with pytest.raises(shmbuf.WorkerError, match="must keep shapes and dtypes fixed"):
            pool.next(timeout=30)


def test_a_forked_child_cannot_use_the_parents_pool(buf):
    """A pool inherited by a forked child is closed there (ClosedError), and the child's exit
    neither stops the parent's workers nor unlinks the parent's staging ring."""
    import multiprocess

    ctx = multiprocess.get_context("fork")
    with SamplerPool(buf, 4, workers=Workers(1, start_method="fork")) as pool:
        procs.assert_batch_ok(pool.next(timeout=30), 4)
        q = ctx.Queue()

        def child():
            try:
                pool.next(timeout=1)
                q.put("got a batch")
            except shmbuf.ClosedError as e:
                q.put(f"ClosedError: {e}")
            except BaseException as e:  # noqa: BLE001
                q.put(f"{type(e).__name__}: {e}")

        p = ctx.Process(target=child)
        p.start()
        p.join(10)
        assert p.exitcode == 0
        assert q.get(timeout=5).startswith("ClosedError")
        assert pool.staging_name in {s.name for s in scan()}
        for _ in range(10):
            procs.assert_batch_ok(pool.next(timeout=30), 4)


def test_transform_spec_skips_the_dry_run(buf):
    """With ``transform_spec`` the transform is not called in the parent."""
    calls = []

    def transform(b):
        calls.append(1)
        return {"index": b["index"]}

    with SamplerPool(buf, B, workers=Workers(1, start_method="fork"),
                     transform=Transform(transform, {"index": ((), "int64")})) as pool:
        assert calls == []
        batch = pool.next(timeout=30)
        assert list(batch) == ["index"] and (batch["index"] == batch.indices).all()


def test_unpicklable_transform_fails_in_the_constructor(buf, own_shm_entries):
    """A transform closing over a lock fails in ``SamplerPool(...)`` with a TypeError naming it
    and the cause; no segment and no process is left."""
    import multiprocess

    lock = threading.Lock()

    def guarded_transform(batch):
        with lock:
            return batch

    before = own_shm_entries()
    with pytest.raises(TypeError, match=r"guarded_transform.*cannot be serialised.*lock"):
        SamplerPool(buf, 4, workers=Workers(2, start_method="spawn"), transform=guarded_transform)
    assert own_shm_entries() == before
    assert multiprocess.active_children() == []
    with pytest.raises(TypeError, match="transform must be callable"):
        SamplerPool(buf, 4, workers=1, transform=42)


def test_transform_that_fails_its_dry_run(buf):
    """A transform that cannot handle the example batch fails at the call site, by name."""

    def broken(batch):
        return {"x": batch["no_such_field"]}

    with pytest.raises(TypeError, match=r"broken failed on a zero-filled example batch"):
        SamplerPool(buf, 4, workers=1, transform=broken)
    with pytest.raises(TypeError, match=r"returned 'x' with shape \(\)"):
        SamplerPool(buf, 4, workers=1, transform=lambda b: {"x": 1.0})


def test_transform_raising_in_the_worker_surfaces_as_worker_error(buf, start_method):
    """An exception in the transform comes back from ``next()`` as WorkerError carrying the
    worker's traceback, promptly."""
    t0 = time.monotonic()
    with SamplerPool(buf, 4, workers=Workers(1, start_method=start_method),
                     transform=procs.RaiseInWorker("transform-exploded-42")) as pool:
        with pytest.raises(shmbuf.WorkerError) as info:
            pool.next(timeout=30)
        msg = str(info.value)
        assert "transform-exploded-42" in msg and "Traceback" in msg and "ValueError" in msg
        assert "pool_procs.py" in msg  # the frame of the user's code
        with pytest.raises(shmbuf.WorkerError):  # it stays failed
            pool.next(timeout=1)
    assert time.monotonic() - t0 < 20


# --------------------------------------------------------------------------------------------
# Reproducibility
# --------------------------------------------------------------------------------------------
def _index_sequence(buf, start_method, seed, n_workers=2, batches=12):
    with SamplerPool(buf, 8, workers=Workers(n_workers, start_method=start_method, ordered=True),
                     seed=seed) as pool:
        out = []
        for _ in range(batches):
            batch = pool.next(timeout=30)
            out.append(np.stack([batch.lanes.copy(), batch.indices.copy()]))
        return np.stack(out)


def test_ordered_seeded_pools_are_reproducible(buf, start_method):
    """Two pools with the same seed and ``ordered=True`` over the same static buffer deliver the
    same sequence of (lane, index) batches; another seed gives another sequence."""
    a = _index_sequence(buf, start_method, seed=123)
    b = _index_sequence(buf, start_method, seed=123)
    c = _index_sequence(buf, start_method, seed=124)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_in_process_seeded_pools_are_reproducible(buf):
    a = _index_sequence(buf, None, seed=7, n_workers=0)
    b = _index_sequence(buf, None, seed=7, n_workers=0)
    c = _index_sequence(buf, None, seed=8, n_workers=0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
