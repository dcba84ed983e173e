"""A pool's delivery is its host delivery under at most one layer (``workers.delivery.layers``):
which layer each setting gives, that a layer's surface is its host's (the ring, fences,
closing, workers, stats), and that a layer hands its batches out and back the way the host
does: the queue's rows are consumed when the learner lets a layered batch go, on a clean close
too, and not when the pool's ``with`` block is left by an exception.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from tests import pool_procs as procs
from workers import SamplerPool
from workers.config import Workers
from workers.delivery.device import DeviceDelivery
from workers.delivery.jax import JaxDelivery
from workers.delivery.local import InProcessDelivery
from workers.delivery.pinned import PinnedDelivery
from workers.delivery.ring import RingDelivery

pytestmark = pytest.mark.timeout(90)
B = 8


@pytest.mark.parametrize("output, device, layer, needs", [
    (None, None, None, None),  # (the default: NumPy views)
    ("torch", None, None, "torch"),
    ("jax", None, JaxDelivery, "jax"),
    ("torch", "cpu", DeviceDelivery, "torch"),
])
def test_each_setting_gets_its_layer_over_the_host(output, device, layer, needs):
    """Host batches (NumPy or torch views) are the host delivery's own; JAX arrays and device
    copies are a layer over it."""
    if needs:
        pytest.importorskip(needs)
    kwargs = {} if output is None else {"output": output}
    with procs.new_buffer(capacity=64) as buf, \
            SamplerPool(buf, B, workers=0, device=device, seed=0, **kwargs) as pool:
        delivery = pool._delivery
        if layer is None:
            assert type(delivery) is InProcessDelivery
        else:
            assert type(delivery) is layer and type(delivery.host) is InProcessDelivery
        batch = pool.next(timeout=30)
        if output != "jax":  # (JAX without x64 narrows the rows' 64-bit checksums)
            procs.assert_batch_ok(_host(batch), B)
        assert batch.indices.shape == (B,) and batch.slot == 0


def test_pin_memory_is_a_layer_for_torch_and_a_warning_for_numpy():
    torch = pytest.importorskip("torch")
    from workers.config import Output

    with procs.new_buffer(capacity=64) as buf:
        # (private in-process slots are never page-locked; without CUDA it says so)
        no_cuda = pytest.warns(UserWarning, match="CUDA is not available")
        with no_cuda if not torch.cuda.is_available() else contextlib.nullcontext():
            with SamplerPool(buf, B, workers=0, output=Output("torch", pin_memory=True),
                             seed=0) as pool:
                assert type(pool._delivery) is PinnedDelivery
                assert pool._delivery.pinned is None and pool._delivery.backend is None
                procs.assert_batch_ok(_host(pool.next(timeout=30)), B)
        with pytest.warns(UserWarning, match="only applies to Output"):
            with SamplerPool(buf, B, workers=0, output=Output("numpy", pin_memory=True),
                             seed=0) as pool:
                assert type(pool._delivery) is InProcessDelivery


def test_a_layers_surface_is_its_hosts(start_method):
    pytest.importorskip("torch")
    with procs.new_buffer(capacity=64) as buf, \
            SamplerPool(buf, B, workers=Workers(2, start_method=start_method), device="cpu",
                        seed=0) as pool:
        layer = pool._delivery
        host = layer.host
        assert type(layer) is DeviceDelivery and type(host) is RingDelivery
        assert layer.ring is host.ring and layer.ring.name == pool.staging_name
        assert layer.fences is host.fences and layer.workers() == host.workers()
        for _ in range(5):
            procs.assert_batch_ok(_host(pool.next(timeout=30)), B)
        stats = pool.stats()
        assert stats["batches"] == 5 and len(stats["workers"]) == 2
        assert sum(w["batches"] for w in stats["workers"]) >= 5  # the host's per-worker counts
        assert not layer.closing
        layer.closing = True  # (as the pool's teardown sets it)
        assert host.closing
        layer.closing = False


def _host(batch):
    """A batch's arrays as NumPy, for ``procs.assert_batch_ok`` (device tensors on "cpu")."""
    class View(dict):
        pass

    view = View({k: _np(batch[k]) for k in batch})
    view.lanes, view.indices, view.weights = (_np(batch.lanes), _np(batch.indices),
                                              _np(batch.weights))
    return view


def _np(x):
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _queue_rows(pool: SamplerPool, n: int) -> list[tuple[int, int]]:
    rows = []
    for _ in range(n):
        batch = pool.next(timeout=30)
        rows += zip(_np(batch.lanes).tolist(), _np(batch.indices).tolist())
    return rows


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_layered_queue_consumes_what_the_learner_let_go(start_method, device):
    """Queue batches through the device layer (and the host alone, as the control): a clean
    close consumes the batch in hand, so the next queue pool starts after it; left by an
    exception, the batch in hand comes again."""
    if device:
        pytest.importorskip("torch")
    with procs.new_buffer(capacity=64, lanes=1) as buf:
        def pool() -> SamplerPool:
            return SamplerPool(buf, B, selection="queue", device=device, seed=0,
                               workers=Workers(1, start_method=start_method))

        with pool() as p:
            assert (type(p._delivery) is DeviceDelivery) == (device is not None)
            first = _queue_rows(p, 2)
        assert first == [(0, i) for i in range(2 * B)]
        with pytest.raises(RuntimeError, match="in the learner's hands"):
            with pool() as p:
                second = _queue_rows(p, 2)
                raise RuntimeError("an error in the learner's hands")
        assert second == [(0, i) for i in range(2 * B, 4 * B)]
        with pool() as p:  # the batch in hand when the exception left the block, again
            assert _queue_rows(p, 1) == second[B:]
