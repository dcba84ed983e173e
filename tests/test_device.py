"""Device delivery without a GPU: the fencing of ``SamplerPool(device=...)``, ``Batch.to`` and
pinned releases, proven against a fake device whose copies run late, as a real DMA does.

The fake device has two in-order streams (copies, and the learner's "current" stream) executed
by a background thread in a random interleaving with random delays. A copy reads its source
when it executes, not when it is issued, so a staging slot refilled before its copy ran, or a
device buffer overwritten before the learner's queued kernel read it, shows up as rows that do
not check out. Each race test runs a control with the fence removed and requires it to see
corrupt rows: the test can fail.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from typing import Any

import numpy as np
import pytest

from tests import pool_procs as procs
from workers import SamplerPool
from workers import device as device_mod
from workers.config import Device, Output, Workers
from workers.delivery import base as delivery_base
from workers.delivery import pinned as delivery_pinned
from workers.device import DeviceStage, DeviceUnavailableError, SlotFences

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(90)

B = 16


# --------------------------------------------------------------------------------------------
# A fake device: two streams, events, copies that read their source when they run
# --------------------------------------------------------------------------------------------
class FakeStream:
    def __init__(self) -> None:
        self.ops: collections.deque[tuple[str, Any]] = collections.deque()
        self.enqueued = 0
        self.executed = 0


class FakeEvent:
    def __init__(self, stream: FakeStream, pos: int) -> None:
        self.stream, self.pos = stream, pos

    def query(self) -> bool:
        return self.stream.executed >= self.pos


class FakeDevice:
    """Runs both streams in a background thread; ``lazy`` names a stream that runs late."""

    def __init__(self, lazy: str, seed: int = 0, thread: bool = True) -> None:
        self.copy, self.current = FakeStream(), FakeStream()
        self.lazy = lazy
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.failed: list[BaseException] = []
        self.paused = threading.Event()  # a device busy with other work: nothing executes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run if thread else self._stop.wait,
                                        daemon=True)
        self._thread.start()

    def run_eager_first(self) -> None:
        """Without the thread: run the eager stream as far as it can go, then the late one."""
        lazy = self.copy if self.lazy == "copy" else self.current
        eager = self.current if lazy is self.copy else self.copy
        while self._step(eager) or self._step(lazy):
            pass

    def enqueue(self, stream: FakeStream, kind: str, arg: Any) -> int:
        with self.lock:
            stream.ops.append((kind, arg))
            stream.enqueued += 1
            return stream.enqueued

    def _step(self, stream: FakeStream) -> bool:
        with self.lock:
            if not stream.ops:
                return False
            kind, arg = stream.ops[0]
            if kind == "wait" and not arg.query():
                return False
            stream.ops.popleft()
        try:
            if kind == "op":
                arg()
        except BaseException as e:  # surfaced by the test
            self.failed.append(e)
        with self.lock:
            stream.executed += 1
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.paused.is_set():
                time.sleep(1e-3)
                continue
            lazy = self.copy if self.lazy == "copy" else self.current
            eager = self.current if lazy is self.copy else self.copy
            while self._step(eager):
                pass
            if self.rng.random() < 0.3:  # the late stream moves now and then, a few ops at once
                for _ in range(self.rng.randint(1, 6)):
                    self._step(lazy)
            time.sleep(self.rng.uniform(0, 0.002))

    def busy(self) -> bool:
        """Ops enqueued and not yet finished (one may be running outside the lock)."""
        with self.lock:
            return any(s.executed < s.enqueued for s in (self.copy, self.current))

    def idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.busy() and time.monotonic() < deadline:
            time.sleep(1e-3)
        assert not self.busy(), "fake device did not drain"

    def stop(self) -> None:
        self.idle()
        self._stop.set()
        self._thread.join(5)


class FakeBackend:
    """The ``workers.device.Backend`` interface over ``FakeDevice``; arrays are NumPy."""

    cuda = False  # nothing to page-lock

    def __init__(self, dev: FakeDevice) -> None:
        self.dev = dev
        self.device = "fake"

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np.zeros(shape, dtype)

    def copy(self, dst: Any, src: Any) -> None:
        self.dev.enqueue(self.dev.copy, "op", lambda: np.copyto(dst, np.asarray(src)))

    def record_copy(self) -> FakeEvent:
        with self.dev.lock:
            return FakeEvent(self.dev.copy, self.dev.copy.enqueued)

    def record_current(self) -> FakeEvent:
        with self.dev.lock:
            return FakeEvent(self.dev.current, self.dev.current.enqueued)

    def copy_waits_for(self, fence: Any) -> None:
        if isinstance(fence, FakeEvent):
            self.dev.enqueue(self.dev.copy, "wait", fence)

    def current_waits_for(self, fence: Any) -> None:
        if isinstance(fence, FakeEvent):
            self.dev.enqueue(self.dev.current, "wait", fence)

    def copy_now(self, src: Any) -> np.ndarray:
        src = src if isinstance(src, np.ndarray) else src.numpy()
        dst = np.zeros_like(src)
        self.dev.enqueue(self.dev.current, "op", lambda: np.copyto(dst, src))
        return dst

    def launch(self, fn: Any) -> None:
        """A "kernel" on the learner's current stream."""
        self.dev.enqueue(self.dev.current, "op", fn)


@pytest.fixture
def fake(monkeypatch):
    """Patches the pool's backend factory; yields (backend, list of corrupt-row counts)."""
    made: list[FakeBackend] = []

    def factory(lazy: str, thread: bool = True) -> FakeBackend:
        be = FakeBackend(FakeDevice(lazy, thread=thread))
        made.append(be)
        monkeypatch.setattr(delivery_base, "make_backend", lambda device: be)
        return be

    yield factory
    for be in made:
        be.dev._stop.set()
        be.dev._thread.join(5)


def _checker(be: FakeBackend, arrays: dict[str, Any], lanes: Any, indices: Any,
             bad: list[int]) -> None:
    """Queue a kernel that checks the device rows against the host lanes/indices."""
    lanes, indices = (x.numpy().copy() if hasattr(x, "numpy") else np.array(x)
                      for x in (lanes, indices))

    def check() -> None:
        bad.append(int(procs.bad_rows(arrays, lanes, indices).sum()))

    be.launch(check)


@pytest.fixture
def buf():
    b = procs.new_buffer(capacity=256, lanes=2)
    yield b
    b.close()


# --------------------------------------------------------------------------------------------
# SlotFences and DeviceStage as units
# --------------------------------------------------------------------------------------------
class _Flag:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_slot_fences_free_a_slot_only_when_every_fence_passed():
    fences = SlotFences()
    a, b, c = _Flag(), _Flag(), _Flag()
    fences.add(3, a)
    fences.add(3, b)
    fences.add(1, c)
    assert fences.busy(3) and fences.busy(1) and not fences.busy(0) and len(fences) == 2
    a.done = True
    assert fences.completed() == [] and fences.busy(3)
    c.done = True
    assert fences.completed() == [1]
    b.done = True
    assert fences.completed() == [3] and len(fences) == 0


def test_slot_fences_drain_gives_up_after_its_timeout():
    """A device that never completes cannot hang teardown."""
    fences = SlotFences()
    fences.add(0, _Flag())
    t0 = time.monotonic()
    assert fences.drain(0.2) is False
    assert 0.15 < time.monotonic() - t0 < 2.0


def test_device_stage_waits_for_the_learner_before_reusing_a_buffer(fake):
    """The copy into a recycled device buffer is queued behind the learner's release event, so a
    kernel the learner queued on it still reads the old batch (control: without the wait it
    reads the new one)."""
    for fenced in (True, False):
        be = fake("current", thread=False)
        if not fenced:
            be.copy_waits_for = lambda fence: None
        stage = DeviceStage(be, [("x", (4,), np.int64)], depth=1)  # two buffers
        seen: list[np.ndarray] = []
        for k in range(3):  # the third batch lands in the first batch's buffer
            stage.submit({"x": np.full(4, k)})
            d, arrays, _ = stage.take()
            be.launch(lambda a=arrays["x"], seen=seen: seen.append(a.copy()))  # runs "later"
            stage.give_back(d)
        be.dev.run_eager_first()
        reads = [int(a[0]) for a in seen]
        assert (reads == [0, 1, 2]) is fenced, reads


# --------------------------------------------------------------------------------------------
# device= and Batch.to: no corrupt rows, and the controls show the tests can fail
# --------------------------------------------------------------------------------------------
def _run_device_pool(buf, be, start_method: str, batches: int, n_workers: int = 2) -> int:
    bad: list[int] = []
    with SamplerPool(buf, B, workers=Workers(n_workers, start_method=start_method), seed=0,
                     device=Device("fake", prefetch=2)) as pool:
        for _ in range(batches):
            batch = pool.next(timeout=30)
            arrays = {k: batch[k] for k in batch}
            _checker(be, arrays, batch.lanes, batch.indices, bad)
        be.dev.idle()
    be.dev.failed and pytest.fail(f"fake device raised {be.dev.failed[0]!r}")
    assert len(bad) == batches
    return sum(bad)


def test_device_pool_never_delivers_a_refilled_slot(buf, fake, start_method):
    """Copies run late (a busy copy engine): the slot is still not refilled before its copy
    ran, so every row on the device is the row the batch names."""
    be = fake("copy")
    assert _run_device_pool(buf, be, start_method, batches=120) == 0


def test_device_pool_never_overwrites_a_buffer_the_learner_still_reads(buf, fake):
    """The learner's kernels run late (a busy GPU): recycled device buffers are not overwritten
    before the kernels queued on them ran."""
    be = fake("current")
    assert _run_device_pool(buf, be, "fork", batches=120) == 0


def test_control_without_the_slot_fence_rows_are_corrupt(buf, fake, monkeypatch):
    """The same run with the staging-slot fence removed delivers mixed rows: the test above
    can fail."""
    monkeypatch.setattr(SlotFences, "add", lambda self, slot, fence: None)
    be = fake("copy")
    assert _run_device_pool(buf, be, "fork", batches=120, n_workers=4) > 0


def test_control_without_the_reuse_fence_rows_are_corrupt(buf, fake, monkeypatch):
    be = fake("current")
    monkeypatch.setattr(FakeBackend, "copy_waits_for", lambda self, fence: None)
    assert _run_device_pool(buf, be, "fork", batches=120) > 0


def test_device_pool_in_process_mode(buf, fake):
    """``n_workers=0`` with a device: one set of local arrays, gathered again only after the
    previous copy completed."""
    be = fake("copy")
    assert _run_device_pool(buf, be, "fork", batches=60, n_workers=0) == 0


def _run_batch_to(buf, be, start_method: str, batches: int) -> int:
    bad: list[int] = []
    with SamplerPool(buf, B, workers=Workers(2, start_method=start_method), seed=0,
                     output="torch") as pool:
        for _ in range(batches):
            batch = pool.next(timeout=30)
            on_device = batch.to("fake")
            assert set(on_device) == {*procs.FIELDS, "indices", "lanes", "weights"}
            _checker(be, {k: on_device[k] for k in procs.FIELDS}, on_device["lanes"],
                     on_device["indices"], bad)
        be.dev.idle()
    return sum(bad)


def test_batch_to_is_fenced(buf, fake, start_method):
    """``batch.to(device)`` then ``next()`` without a synchronize: the slot waits for the copy."""
    be = fake("current")
    assert _run_batch_to(buf, be, start_method, batches=100) == 0


def test_control_batch_to_without_its_fence(buf, fake, monkeypatch):
    be = fake("current")
    monkeypatch.setattr(SlotFences, "add", lambda self, slot, fence: None)
    assert _run_batch_to(buf, be, "fork", batches=100) > 0


def test_pinned_release_fences_the_users_own_async_copy(buf, fake, monkeypatch):
    """The issue's race: ``x = batch["obs"].to("cuda", non_blocking=True)`` on the current
    stream, then ``next()`` without a synchronize. With a page-locked ring the release records
    an event on the current stream, so the slot is not refilled under the copy; the control
    (no fence) shows the race."""
    be = fake("current")

    pending_at_unpin: list[int] = []

    class _Cudart:
        def cudaHostUnregister(self, ptr: int) -> int:
            pending_at_unpin.append(be.dev.current.enqueued - be.dev.current.executed)
            return 0

    class _Torch:
        class cuda:  # noqa: N801 (mirrors torch.cuda)
            cudart = staticmethod(lambda: _Cudart())

    def fake_lock(torch_mod, span):  # page-locks the staging ring (shared memory) only
        return (_Torch, 0) if span is not None else None

    monkeypatch.setattr(delivery_pinned, "page_lock", fake_lock)

    def run() -> int:
        bad: list[int] = []
        with SamplerPool(buf, B, workers=Workers(4, start_method="fork"), seed=0,
                         output=Output("torch", pin_memory=True)) as pool:
            for _ in range(120):
                batch = pool.next(timeout=30)
                mine = {k: be.copy_now(batch[k]) for k in procs.FIELDS}  # the user's own copies
                _checker(be, mine, batch.lanes.numpy().copy(), batch.indices.numpy().copy(), bad)
            # close() with the last batch held and its copies queued behind a busy device (for
            # 1 s): the ring is unpinned (and unmapped) only after they ran.
            be.dev.paused.set()
            threading.Timer(1.0, be.dev.paused.clear).start()
        be.dev.idle()
        return sum(bad)

    assert run() == 0
    assert pending_at_unpin == [0]
    monkeypatch.setattr(SlotFences, "add", lambda self, slot, fence: None)
    assert run() > 0


def test_device_batch_shape_and_priority_updates(fake):
    """Fields and weights come from the device buffers, indices and lanes stay on the host, and
    ``update_priorities`` takes them (and tensors) as they are."""
    be = fake("copy")
    with procs.new_buffer(capacity=64, lanes=2) as buf:
        with SamplerPool(buf, B, workers=Workers(1, start_method="fork"), seed=0,
                         device="fake", selection="prioritized") as pool:
            batch = pool.next(timeout=30)
            assert isinstance(batch.indices, torch.Tensor) and batch.indices.device.type == "cpu"
            assert isinstance(batch["obs"], np.ndarray)  # the fake device's arrays
            be.dev.idle()
            assert batch["obs"].shape == (B, 2, 3) and batch.weights.shape == (B,)
            assert not procs.bad_rows({k: batch[k] for k in batch}, batch.lanes,
                                      batch.indices).any()
            n = pool.update_priorities(batch.indices, torch.full((B,), 2.0))
            assert 0 < n <= B


# --------------------------------------------------------------------------------------------
# Real torch devices available in CI: "cpu", and a clear error for "cuda" without CUDA
# --------------------------------------------------------------------------------------------
def test_device_cpu_delivers_owned_tensors(buf, start_method):
    with SamplerPool(buf, B, workers=Workers(2, start_method=start_method), seed=0,
                     device="cpu") as pool:
        for _ in range(30):
            batch = pool.next(timeout=30)
            assert isinstance(batch["obs"], torch.Tensor)
            assert batch["obs"].data_ptr() not in {
                a.ctypes.data for s in range(pool.n_staging)
                for a in pool._delivery.ring.slot(s).values()
            }
            assert not procs.bad_rows({k: batch[k].numpy() for k in batch},
                                      batch.lanes.numpy(), batch.indices.numpy()).any()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_fails_at_construction(buf, own_shm_entries):
    before = own_shm_entries()
    with pytest.raises(DeviceUnavailableError, match="CUDA is not available"):
        SamplerPool(buf, B, workers=2, device="cuda")
    assert own_shm_entries() == before  # no staging ring, no worker started


@pytest.mark.parametrize("device, match", [("tpu:0", "not 'tpu'|not a torch device"),
                                           ("not a device", "not a torch device"),
                                           (3.5, "not a torch device")])
def test_device_argument_errors(device, match):
    with pytest.raises(DeviceUnavailableError, match=match):
        device_mod.make_backend(device)


def test_batch_to_needs_torch_output(buf):
    with SamplerPool(buf, B, workers=0, seed=0) as pool:
        with pytest.raises(TypeError, match="output='torch'"):
            pool.next(timeout=5).to("cpu")
