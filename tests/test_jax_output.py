"""``output="jax"``: zero-copy DLPack arrays over the staging slot, deleted on release, and a slot
refilled only once JAX has finished the computations already dispatched on it.

JAX dispatches asynchronously, so a computation may read a batch after the learner took the next
one. The check here runs behind a slow computation it depends on; with the fence removed (the
control) it sees rows of later batches. Skipped where JAX is not installed.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import shmbuf
from workers import SamplerPool
from workers.config import Workers
from workers.device import SlotFences

jax = pytest.importorskip("jax")
jnp = jax.numpy

pytestmark = [pytest.mark.timeout(120), pytest.mark.jax]

B = 32
WIDTH = 256


@pytest.fixture
def buf():
    spec = shmbuf.Spec(frame=((WIDTH,), "uint8"), index=((), "int32"))
    b = shmbuf.ReplayBuffer.create(spec, capacity=2048)
    i = np.arange(2048)
    with b.writer() as w:
        w.extend({"frame": np.repeat((i % 251).astype(np.uint8)[:, None], WIDTH, axis=1),
                  "index": i.astype(np.int32)})
    yield b
    b.close()


@jax.jit
def _slow(seed):
    m = jnp.full((400, 400), seed, jnp.float32)
    for _ in range(4):
        m = m @ m / 400.0
    return m.sum()


@jax.jit
def _bad_rows(frame, index, after):
    want = (index % 251).astype(jnp.uint8)[:, None]
    return (frame != want).any(axis=1).sum() + (after * 0).astype(jnp.int32)


def test_jax_arrays_are_zero_copy_views_that_keep_their_slot(buf):
    """Arrays are zero-copy views; one the learner keeps past ``next()`` stays valid (its slot is
    not refilled while it lives) and its slot returns to the ring once it is dropped."""
    with SamplerPool(buf, B, workers=Workers(1, staging=3, start_method="forkserver"), seed=0,
                     output="jax") as pool:
        batch = pool.next(timeout=30)
        frame, index, slot = batch["frame"], batch["index"], batch.slot
        assert isinstance(frame, jax.Array)
        assert frame.unsafe_buffer_pointer() == pool._delivery.ring.slot(slot)["frame"].ctypes.data
        before = np.asarray(frame).copy()
        for _ in range(10):
            assert pool.next(timeout=30).slot != slot
        assert pool._delivery.fences.busy(slot)
        assert (np.asarray(frame) == before).all() and int(_bad_rows(frame, index, 0.0)) == 0
        del frame, index
        slots = {pool.next(timeout=30).slot for _ in range(10)}
        assert slot in slots and not pool._delivery.fences.busy(slot)


def test_a_learner_that_keeps_every_batch_gets_a_timeout_that_says_so(buf):
    with SamplerPool(buf, B, workers=Workers(1, staging=2, start_method="forkserver"), seed=0,
                     output="jax") as pool:
        kept = [pool.next(timeout=30)["frame"]]
        kept.append(pool.next(timeout=30)["frame"])
        with pytest.raises(shmbuf.Timeout, match="arrays of earlier batches"):
            pool.next(timeout=1)
        kept.clear()
        assert pool.next(timeout=30) is not None


_GO = threading.Event()


def _gate(_):
    _GO.wait(20)  # the "slow kernel": JAX executes this program only once the test says go
    return np.int32(1)


@jax.jit
def _gated_bad_rows(frame, index):
    g = jax.pure_callback(_gate, jax.ShapeDtypeStruct((), jnp.int32), 0)
    frame = jnp.where(g > 0, frame, 0)  # the frame is read after the gate opens
    want = (index % 251).astype(jnp.uint8)[:, None]
    return (frame != want).any(axis=1).sum()


def _run(buf, start_method: str) -> int:
    """A computation on batch 0 (dispatched from another thread, which holds its arrays while
    it runs) is held up while the learner takes 8 more batches; then it reads batch 0's slot.
    JAX on the CPU mostly executes at dispatch, so this is the arrays-still-alive half of the
    fence; that JAX also holds an imported buffer for work it dispatched asynchronously after
    the Python arrays are gone was checked by hand (jax 0.10.2: the view's finalizer runs after
    the computation completes)."""
    _GO.clear()
    result: dict[str, int] = {}
    with SamplerPool(buf, B, workers=Workers(2, staging=3, start_method=start_method), seed=0,
                     output="jax") as pool:
        batch = pool.next(timeout=30)
        frame, index = batch["frame"], batch["index"]
        # Dispatched from a thread: were JAX to run it inline, only that thread waits.
        t = threading.Thread(target=lambda f=frame, i=index: result.update(
            bad=int(_gated_bad_rows(f, i))), daemon=True)
        t.start()
        time.sleep(0.2)
        del frame, index
        for _ in range(8):
            pool.next(timeout=30)  # the slot of batch 0 would be refilled by now
        _GO.set()
        t.join(30)
    return result["bad"]


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])  # JAX is multithreaded:
def test_dispatched_computations_finish_before_the_slot_is_refilled(buf, start_method):
    """(no fork: JAX warns that forking its threads can deadlock.)"""
    assert _run(buf, start_method) == 0


def test_control_without_the_fence_rows_are_corrupt(buf, monkeypatch):
    monkeypatch.setattr(SlotFences, "add", lambda self, slot, fence: None)
    assert _run(buf, "forkserver") > 0


def test_jax_in_process_and_priority_updates(buf):
    with SamplerPool(buf, B, workers=0, seed=0, output="jax", selection="prioritized") as pool:
        results = []
        for k in range(20):
            batch = pool.next(timeout=30)
            results.append(_bad_rows(batch["frame"], batch["index"], _slow(float(k % 3))))
            assert pool.update_priorities(batch.indices, jnp.full((B,), 2.0)) > 0
        assert sum(int(r) for r in results) == 0


def test_prioritized_with_x64_indices_do_not_hold_their_slots(buf):
    """With ``jax_enable_x64`` int64 indices would import without a copy; the pool keeps recent
    ``batch.indices`` for ``update_priorities``, so they must be copies or every slot stays
    fenced (it raised Timeout after n_staging batches, and close() leaked the ring)."""
    jax.config.update("jax_enable_x64", True)
    try:
        with SamplerPool(buf, B, workers=Workers(1, staging=3, start_method="forkserver"),
                         seed=0, output="jax", selection="prioritized") as pool:
            for _ in range(12):
                batch = pool.next(timeout=10)
                assert batch.indices.dtype == jnp.int64
                pool.update_priorities(batch.indices, jnp.full((B,), 2.0))
            t0 = time.monotonic()
        assert time.monotonic() - t0 < 2.0  # close() did not wait for fenced slots
    finally:
        jax.config.update("jax_enable_x64", False)


def test_ordered_delivery_keeps_its_order_when_slots_come_back_late(buf):
    """A slot held back by a kept array re-enters the ring in its turn, so a seeded ordered run
    delivers the same rows whether or not the learner keeps arrays for a while."""
    def run(keep: bool) -> list[list[int]]:
        seen, kept = [], []
        with SamplerPool(buf, B, workers=Workers(2, start_method="forkserver", ordered=True),
                         seed=7, output="jax") as pool:
            for k in range(14):
                batch = pool.next(timeout=30)
                seen.append(np.asarray(batch["index"]).tolist())
                if keep and k in (2, 3):
                    kept.append(batch["frame"])
                if k == 7:
                    kept.clear()
        return seen

    assert run(keep=True) == run(keep=False)
