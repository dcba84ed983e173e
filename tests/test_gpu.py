"""The GPU race, on a real GPU: batches copied asynchronously and the next batch taken without a
synchronize never mix rows of two batches. Skipped without CUDA (CI has none); the same fencing
is covered on the CPU by tests/test_device.py with a fake device.

Rows check themselves: every byte of row i's frame is ``i % 251`` and the row carries ``i``.
The checks run on the device, queued behind the training loop's copies, and are summed once
at the end, so the loop itself never synchronizes.
"""

from __future__ import annotations

import numpy as np
import pytest

import shmbuf
from workers import SamplerPool

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)"),
]

B = 256
FRAME = (4, 84, 84)
CAPACITY = 4096
BATCHES = 400


@pytest.fixture(scope="module")
def buf():
    spec = shmbuf.Spec(frame=(FRAME, "uint8"), index=((), "int64"))
    b = shmbuf.ReplayBuffer.create(spec, capacity=CAPACITY)
    i = np.arange(CAPACITY)
    frames = np.broadcast_to((i % 251).astype(np.uint8)[:, None, None, None],
                             (CAPACITY, *FRAME)).copy()
    with b.writer() as w:
        w.extend({"frame": frames, "index": i})
    yield b
    b.close()


def _bad_rows(frame: "torch.Tensor", index: "torch.Tensor") -> "torch.Tensor":
    """Rows (on the device) whose bytes are not all ``index % 251``; no synchronize."""
    want = (index % 251).to(torch.uint8).view(-1, 1, 1, 1)
    return (frame != want).flatten(1).any(dim=1).sum()


def _loop(pool: SamplerPool, take: str) -> int:
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(BATCHES):
        batch = pool.next(timeout=60)
        if take == "device":  # the pool copied it
            frame, index = batch["frame"], batch["index"]
        elif take == "batch.to":
            on_device = batch.to("cuda")
            frame, index = on_device["frame"], on_device["index"]
        else:  # the user's own async copies from the pinned ring
            frame = batch["frame"].to("cuda", non_blocking=True)
            index = batch["index"].to("cuda", non_blocking=True)
        bad += _bad_rows(frame, index)
        # A training step would follow; none synchronizes, and neither does next().
    torch.cuda.synchronize()
    return int(bad.item())


@pytest.mark.parametrize("n_workers", [2, 4, 8])
@pytest.mark.parametrize("take", ["device", "batch.to", "pinned .to"])
def test_no_corrupt_rows_without_synchronize(buf, n_workers, take):
    kwargs = dict(device="cuda") if take == "device" else dict(output="torch", pin_memory=True)
    with SamplerPool(buf, batch_size=B, n_workers=n_workers, seed=0, start_method="fork",
                     **kwargs) as pool:
        assert _loop(pool, take) == 0


def test_device_batches_are_on_the_current_stream_device(buf):
    with SamplerPool(buf, batch_size=B, n_workers=2, seed=0, device="cuda:0") as pool:
        batch = pool.next(timeout=60)
        assert batch["frame"].is_cuda and batch.weights.is_cuda
        assert not batch.indices.is_cuda  # host-side, for update_priorities
        assert int(_bad_rows(batch["frame"], batch["index"]).item()) == 0
