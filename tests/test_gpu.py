"""The GPU race, on a real GPU: batches copied asynchronously and the next batch taken without a
synchronize deliver exactly the rows drawn, never a row of another batch nor a torn one. The
CUDA tests skip without CUDA (CI has none); the same fencing is covered on the CPU by
tests/test_device.py with a fake device.

Rows follow the self-checking scheme of ``tests/_helpers/rows.py``: each row's payload (a
4x84x84 frame's worth of bytes) is a function of its (lane, index). ``DrawnRows`` compares every
delivered row with the row the batch drew (``batch.lanes``/``batch.indices``): on the device,
queued behind the training loop's copies, each payload is compared with the scheme's payload of
the (lane, index) the row carries; after the loop, which never synchronizes, that (lane, index)
is compared with the one drawn. Both together: the row holds the drawn row's contents. The
comparison itself runs on the CPU here (``test_drawn_rows_*``) and through a pool on the "cpu"
device, so it is exercised where there is no GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

import shmbuf
from tests._helpers.rows import RowScheme
from workers import SamplerPool
from workers.config import Output, Workers

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(300)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA (none on this machine)")

B = 256
ROWS = RowScheme(payload_words=4 * 84 * 84, payload_dtype="uint8")  # a frame stack per row
LANES = 2
CAPACITY = 2048  # per lane
BATCHES = 400


class DrawnRows:
    """Finds delivered rows that are not the rows drawn, without synchronizing the device.

    The scheme's payload of every (lane, index) of a buffer filled with ``ROWS.batch(lane,
    range(capacity))`` sits on ``device`` once. ``add`` queues, on the device's current stream,
    the comparison of each delivered payload with the payload of the (lane, index) the row
    carries, and keeps that (lane, index) (on the device) and the one drawn (on the host).
    ``wrong_rows`` then reads them back once and says which rows are torn or are not the row
    drawn; a whole row of another batch carries another (lane, index) than the one drawn.

    Example::

        check = DrawnRows(ROWS, lanes=2, capacity=64, device="cuda")
        for batch in batches:
            check.add(batch.to("cuda"), batch.lanes, batch.indices)
        assert check.wrong_rows() == []
    """

    def __init__(self, scheme: RowScheme, lanes: int, capacity: int, device: Any) -> None:
        indices = np.arange(capacity)
        table = np.stack([scheme.payload(lane, indices) for lane in range(lanes)])
        self.payloads = torch.as_tensor(table).to(device)  # [lanes, capacity, payload_words]
        self.lanes, self.capacity = lanes, capacity
        self._whole: list[Any] = []  # per batch, on the device: row b's payload is its own
        self._carried: list[Any] = []  # per batch, on the device: [2, B] (lane, index) held
        self._drawn: list[tuple[np.ndarray, np.ndarray]] = []  # per batch, on the host

    @property
    def batches(self) -> int:
        """Batches queued for checking."""
        return len(self._drawn)

    def add(self, rows: Mapping[str, Any], lanes: Any, indices: Any) -> None:
        """Queue the check of one batch: ``rows`` (tensors on the device) were drawn as
        ``(lanes, indices)`` (host arrays or tensors, copied here)."""
        lane, index = rows["lane"].to(torch.int64), rows["index"].to(torch.int64)
        # A torn row may carry any lane and index: keep the lookup inside the table (the row
        # still fails, on its payload or against the draw).
        want = self.payloads[lane.clamp(0, self.lanes - 1), index.remainder(self.capacity)]
        self._whole.append((rows["payload"].flatten(1) == want).all(dim=1))
        self._carried.append(torch.stack([lane, index]))
        self._drawn.append((_host_copy(lanes), _host_copy(indices)))

    def wrong_rows(self, limit: int = 5) -> list[str]:
        """The first ``limit`` rows that are torn or not the row drawn (reads the device
        results back: call it after the loop)."""
        out: list[str] = []
        for k, (whole, carried, (lanes, indices)) in enumerate(
                zip(self._whole, self._carried, self._drawn, strict=True)):
            whole, carried = whole.cpu().numpy(), carried.cpu().numpy()
            for b in np.flatnonzero(~whole | (carried[0] != lanes) | (carried[1] != indices)):
                what = "torn" if not whole[b] else "another row"
                out.append(f"batch {k} row {b}: {what}, holds lane={carried[0, b]} "
                           f"index={carried[1, b]}, drawn as lane={lanes[b]} index={indices[b]}")
                if len(out) >= limit:
                    return out
        return out


def _host_copy(values: Any) -> np.ndarray:
    """An int64 copy of host ``values`` (an array, a list, a CPU tensor)."""
    if isinstance(values, torch.Tensor):
        values = values.numpy()
    return np.array(values, dtype=np.int64)


def _filled(capacity: int) -> shmbuf.ReplayBuffer:
    b = shmbuf.ReplayBuffer.create(shmbuf.Spec(ROWS.fields), capacity=capacity, lanes=LANES)
    try:
        for lane in range(LANES):
            with b.writer(lane=lane, timeout=5) as w:
                w.extend(ROWS.batch(lane, np.arange(capacity)))
    except BaseException:
        b.close()
        raise
    return b


@pytest.fixture(scope="module")
def buf():
    b = _filled(CAPACITY)
    yield b
    b.close()


def _pool_kwargs(take: str, device: str) -> dict[str, Any]:
    if take == "device":
        return {"device": device}
    return {"output": Output("torch", pin_memory=device.startswith("cuda"))}


def _loop(pool: SamplerPool, take: str, device: str, check: DrawnRows, batches: int) -> None:
    for _ in range(batches):
        batch = pool.next(timeout=60)
        rows: Mapping[str, Any]
        if take == "device":  # the pool copied it
            rows = batch
        elif take == "batch.to":
            rows = batch.to(device)
        else:  # the user's own async copies from the pinned ring
            rows = {k: batch[k].to(device, non_blocking=True) for k in ("lane", "index",
                                                                       "payload")}
        check.add(rows, batch.lanes, batch.indices)
        # A training step would follow; none synchronizes, and neither does next().
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n_workers", [2, 4, 8])
@pytest.mark.parametrize("take", ["device", "batch.to", "pinned .to"])
def test_no_corrupt_rows_without_synchronize(buf, n_workers, take):
    check = DrawnRows(ROWS, LANES, CAPACITY, "cuda")
    with SamplerPool(buf, batch_size=B, workers=Workers(n_workers, start_method="fork"), seed=0,
                     **_pool_kwargs(take, "cuda")) as pool:
        _loop(pool, take, "cuda", check, BATCHES)
    assert check.wrong_rows() == []


@pytest.mark.gpu
@needs_cuda
def test_device_batches_are_on_the_current_stream_device(buf):
    with SamplerPool(buf, batch_size=B, workers=2, seed=0, device="cuda:0") as pool:
        batch = pool.next(timeout=60)
        assert batch["payload"].is_cuda and batch.weights.is_cuda
        assert not batch.indices.is_cuda  # host-side, for update_priorities
        check = DrawnRows(ROWS, LANES, CAPACITY, "cuda:0")
        check.add(batch, batch.lanes, batch.indices)
        assert check.wrong_rows() == []


# --------------------------------------------------------------------------------------------
# The comparison itself, on the CPU
# --------------------------------------------------------------------------------------------
SMALL = 64


def _rows_of(lanes: list[int], indices: list[int]) -> dict[str, np.ndarray]:
    """The scheme's rows of ``(lanes[b], indices[b])``, as a batch holds them."""
    parts = [ROWS.batch(lane, [index]) for lane, index in zip(lanes, indices, strict=True)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _tensors(rows: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: torch.as_tensor(v) for k, v in rows.items()}


def _tampered(how: str, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rows = {k: v.copy() for k, v in rows.items()}
    if how == "a whole row of another batch":  # row 2 is (lane 0, index 9), a valid row
        for k, v in _rows_of([0], [9]).items():
            rows[k][2] = v[0]
    elif how == "two rows swapped":
        for v in rows.values():
            v[[0, 1]] = v[[1, 0]]
    elif how == "a torn row":  # row 3's payload half of another row's
        half = ROWS.payload_words // 2
        rows["payload"][3, :half] = _rows_of([1], [40])["payload"][0, :half]
    elif how == "a lane outside the buffer":
        rows["lane"][1] = 77
    return rows


DRAWN = ([0, 1, 0, 1], [5, 6, 7, 8])


def test_drawn_rows_passes_the_rows_drawn():
    check = DrawnRows(ROWS, LANES, SMALL, "cpu")
    check.add(_tensors(_rows_of(*DRAWN)), *DRAWN)
    check.add(_tensors(_rows_of([1, 1], [63, 0])), torch.tensor([1, 1]), torch.tensor([63, 0]))
    assert check.wrong_rows() == []


@pytest.mark.parametrize("how, wrong", [("a whole row of another batch", [2]),
                                        ("two rows swapped", [0, 1]),
                                        ("a torn row", [3]),
                                        ("a lane outside the buffer", [1])])
def test_drawn_rows_reports_rows_that_are_not_the_rows_drawn(how, wrong):
    """Each tampering is caught, and only in the rows it touched; a whole row of another batch
    checks out against itself (the old test's only check), so only the draw tells it apart."""
    rows = _tampered(how, _rows_of(*DRAWN))
    check = DrawnRows(ROWS, LANES, SMALL, "cpu")
    check.add(_tensors(rows), *DRAWN)
    reported = check.wrong_rows()
    assert [int(r.split()[3].rstrip(":")) for r in reported] == wrong, reported
    if how == "a whole row of another batch":
        assert reported == ["batch 0 row 2: another row, holds lane=0 index=9, drawn as lane=0 "
                            "index=7"]
        assert not ROWS.bad_rows(rows).any()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("take", ["device", "batch.to", "pinned .to"])
def test_drawn_rows_through_a_pool_on_the_cpu_device(take, start_method):
    """The GPU tests' loop and check, with the "cpu" device: every row delivered is the row
    drawn (this runs where the CUDA tests skip)."""
    check = DrawnRows(ROWS, LANES, SMALL, "cpu")
    with _filled(SMALL) as b:
        with SamplerPool(b, batch_size=16, workers=Workers(2, start_method=start_method), seed=0,
                         **_pool_kwargs(take, "cpu")) as pool:
            _loop(pool, take, "cpu", check, 40)
    assert check.batches == 40
    assert check.wrong_rows() == []
