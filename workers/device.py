"""Batches delivered to a device (a GPU), with event fences instead of global synchronizes.

Two hazards, one rule each:

- A staging slot is read by an asynchronous host-to-device copy (DMA) after the learner has
  issued it. The slot goes back to the workers (FREE) only once every copy known to read it has
  completed: ``SlotFences`` holds one fence per copy and hands a slot back when all have passed.
- A device buffer that the pool recycles may still be read by kernels the learner queued on its
  stream. It is refilled only after an event recorded on the learner's stream at release time:
  the copy stream waits for that event on the GPU, so the learner never blocks for it.

The CUDA specifics sit behind a small ``Backend`` (allocate, copy on the copy stream, record and
wait for events), so the fencing logic runs in CI against a fake device whose copies happen
later, exactly when a real DMA would (see tests/test_device.py). The deliveries that use them:
``delivery.device`` (``device=``), ``delivery.pinned`` (``Output("torch", pin_memory=True)``), and ``Batch.to``
(``delivery.HostDelivery.batch_to``).

Concurrency: everything here runs in the learner's thread (the pool's owner). Workers never see
device state; they only see a slot come back to them later than before.
"""

from __future__ import annotations

import collections
import time
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from .errors import DeviceUnavailableError


class Fence(Protocol):
    """A point in a device stream: ``query()`` is True once all work before it has completed."""

    def query(self) -> bool: ...


class SlotFences:
    """Copies still reading each staging slot; a slot is reusable once all its fences passed.

    ``completed(in_order=True)`` hands slots back only in the order they were fenced (a slot
    whose fences passed waits behind an earlier one still pending), which ordered delivery
    needs; fences that have always passed (``DONE``) are not kept at all.
    """

    def __init__(self) -> None:
        # slot -> its fences not known to have passed (read it to ask "any?" without a call)
        self.pending: collections.OrderedDict[int, list[Fence]] = collections.OrderedDict()

    def add(self, slot: int, fence: Fence) -> None:
        if fence is not DONE:
            self.pending.setdefault(slot, []).append(fence)

    def busy(self, slot: int) -> bool:
        return slot in self.pending

    def __len__(self) -> int:
        return len(self.pending)

    def completed(self, in_order: bool = False) -> list[int]:
        """Slots whose every fence has passed (removed from the pending set), oldest first;
        with ``in_order``, only those fenced before the oldest slot still pending."""
        done = []
        for slot, fences in self.pending.items():
            if all(f.query() for f in fences):
                done.append(slot)
            elif in_order:
                break
        for slot in done:
            del self.pending[slot]
        return done

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every pending copy (teardown); True if all completed.

        Polls ``query()`` (fences have no blocking wait here), so a hung device cannot hang
        close(); what is still pending after the timeout is reported by the caller.
        """
        deadline = time.monotonic() + timeout
        pause = 1e-4
        while self.pending:
            self.completed()
            if not self.pending or time.monotonic() >= deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        return not self.pending


def page_lock(torch: Any, span: tuple[Any, int, int] | None) -> tuple[Any, int] | None:
    """Page-lock staging memory ``span`` (mapping, offset, length) for async copies: (torch,
    pointer) to unregister at close, or None (with a warning where CUDA or the registration
    failed). Private in-process slots (``span`` None) are not pinned: copies from them are
    synchronous, and they are refilled only after their fences pass anyway."""
    if not torch.cuda.is_available():
        warnings.warn("Output(pin_memory=True) but CUDA is not available; staging stays pageable",
                      stacklevel=7)
        return None
    if span is None:
        return None
    mem, offset, length = span
    ptr = np.frombuffer(mem, np.uint8, count=length, offset=offset).ctypes.data
    err = torch.cuda.cudart().cudaHostRegister(ptr, length, 0)
    if int(err) != 0:
        warnings.warn(f"cudaHostRegister of the staging ring failed ({err}); staying pageable",
                      stacklevel=7)
        return None
    return torch, ptr


def page_unlock(pinned: tuple[Any, int] | None) -> None:
    """Undo ``page_lock`` (``pinned`` as it returned); nothing for None."""
    if pinned is not None:
        torch, ptr = pinned
        torch.cuda.cudart().cudaHostUnregister(ptr)


class Backend(Protocol):
    """What device delivery needs from a device runtime (torch CUDA, torch CPU, a test fake)."""

    device: Any

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype) -> Any: ...

    def copy(self, dst: Any, src: Any) -> None:
        """Enqueue ``dst <- src`` on the copy stream (asynchronous where the device is)."""

    def record_copy(self) -> Fence:
        """A fence after everything enqueued on the copy stream so far."""

    def record_current(self) -> Fence:
        """A fence after everything the caller's current stream has enqueued so far."""

    def copy_waits_for(self, fence: Fence) -> None:
        """Later copies start only after ``fence`` (device-side wait, the host does not block)."""

    def current_waits_for(self, fence: Fence) -> None:
        """The caller's current stream waits for ``fence`` (device-side)."""

    def copy_now(self, src: Any) -> Any:
        """A new device tensor holding ``src``, copied on the current stream (non-blocking)."""


class _Done:
    """A fence that has always passed (synchronous devices)."""

    def query(self) -> bool:
        return True


DONE = _Done()


class TorchBackend:
    """torch on CUDA (own copy stream, events) or on the CPU (synchronous copies, no fences)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.stream = torch.cuda.Stream(self.device)
        self._events: list[Any] = []  # recycled events (recording again is allowed once passed)

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        torch = self.torch
        return torch.empty(shape, dtype=_torch_dtype(torch, dtype), device=self.device)

    def copy(self, dst: Any, src: Any) -> None:
        if self.cuda:
            with self.torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
        else:  # NumPy's memcpy: torch's intra-op threads contend with the workers (8 ms vs 0.4)
            np.copyto(dst.numpy(), src.numpy())

    def _event(self, stream: Any) -> Fence:
        ev = self.torch.cuda.Event()
        ev.record(stream)
        return ev

    def record_copy(self) -> Fence:
        return self._event(self.stream) if self.cuda else DONE

    def record_current(self) -> Fence:
        if not self.cuda:
            return DONE
        return self._event(self.torch.cuda.current_stream(self.device))

    def copy_waits_for(self, fence: Fence) -> None:
        if self.cuda and fence is not DONE:
            self.stream.wait_event(self._recorded(fence))

    def current_waits_for(self, fence: Fence) -> None:
        if self.cuda and fence is not DONE:
            self.torch.cuda.current_stream(self.device).wait_event(self._recorded(fence))

    def _recorded(self, fence: Fence) -> Any:
        """``fence`` as the CUDA event it is: this backend waits only for fences it recorded."""
        if not isinstance(fence, self.torch.cuda.Event):
            raise TypeError(f"a CUDA stream can wait only for a CUDA event, got {fence!r}")
        return fence

    def copy_now(self, src: Any) -> Any:
        return src.to(self.device, non_blocking=self.cuda)


def _torch_dtype(torch: Any, dtype: np.dtype) -> Any:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def make_backend(device: Any) -> Backend:
    """The backend for ``device`` ("cuda", "cuda:1", a ``torch.device``, "cpu").

    Raises:
        DeviceUnavailableError: torch is missing, CUDA is not available, or the ordinal does
            not exist; the message says what this process has.
    """
    try:
        import torch
    except ImportError:
        raise DeviceUnavailableError(
            f"device={device!r} needs PyTorch: pip install 'shmbuf[torch]' (or torch)"
        ) from None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceUnavailableError(
            f"device={device!r} is not a torch device ({e}); pass e.g. 'cuda', 'cuda:1' or 'cpu'"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"device={device!r} but CUDA is not available to this process (torch "
                f"{torch.__version__}, built with CUDA {torch.version.cuda}). Fix: run on a "
                f"machine with a GPU and a CUDA build of torch, or drop device= to get host "
                f"batches"
            )
        n = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < n:
            raise DeviceUnavailableError(
                f"device={device!r} but this process sees {n} CUDA device(s): cuda:0 .. "
                f"cuda:{n - 1} (check CUDA_VISIBLE_DEVICES)"
            )
    elif dev.type != "cpu":
        raise DeviceUnavailableError(
            f"device={device!r}: shmbuf delivers to 'cuda' devices (or 'cpu'), not {dev.type!r}"
        )
    return TorchBackend(dev)


class DeviceStage:
    """A ring of device buffers that batches are copied into, ``depth`` copies ahead.

    ``submit(host_arrays)`` enqueues the copies of one staging slot on the copy stream (after
    the buffer's previous reader on the learner's stream has finished, device-side) and returns
    the fence that says when the staging slot may be refilled. ``take()`` hands the oldest
    submitted buffer to the learner, its stream made to wait for the copy; ``give_back(d)``
    records where the learner's stream stands so the buffer is not overwritten before that.

    Concurrency: learner thread only. Each device buffer is either free (with the fence of its
    last reader), in flight (with the fence of its copy) or held by the learner.
    """

    def __init__(self, backend: Backend, arrays: list[tuple[str, tuple[int, ...], Any]],
                 depth: int) -> None:
        self.backend = backend
        self.depth = depth
        # depth buffers in flight plus the one the learner holds.
        self._bufs = [{name: backend.alloc(tuple(shape), np.dtype(dtype))
                       for name, shape, dtype in arrays} for _ in range(depth + 1)]
        self._free: collections.deque[int] = collections.deque(range(depth + 1))
        self._reuse: list[Fence] = [DONE] * (depth + 1)
        self._inflight: collections.deque[tuple[int, Fence, Any]] = collections.deque()

    def __len__(self) -> int:
        """Buffers submitted and not yet taken."""
        return len(self._inflight)

    def can_submit(self) -> bool:
        return bool(self._free) and len(self._inflight) < self.depth

    def submit(self, host: dict[str, Any], tag: Any = None) -> Fence:
        """Copy ``host`` (name -> host tensor, all of the buffer's arrays) into a free buffer."""
        index = self._free.popleft()
        backend = self.backend
        try:
            backend.copy_waits_for(self._reuse[index])
            dst = self._bufs[index]
            for name, src in host.items():
                backend.copy(dst[name], src)
        except BaseException:
            self._free.appendleft(index)  # the caller fences the source with record_copy()
            raise
        fence = backend.record_copy()
        self._inflight.append((index, fence, tag))
        return fence

    def take(self) -> tuple[int, dict[str, Any], Any]:
        """The oldest submitted buffer: (id, name -> device tensor, tag); the learner's stream
        waits for its copy on the device, the host does not."""
        index, fence, tag = self._inflight.popleft()
        self.backend.current_waits_for(fence)
        return index, self._bufs[index], tag

    def give_back(self, index: int) -> None:
        """The learner is done with buffer ``index``: reusable once its stream passed here."""
        self._reuse[index] = self.backend.record_current()
        self._free.append(index)

    def drain(self, timeout: float) -> bool:
        """Wait for every copy in flight (teardown); True if all completed in time."""
        fences = SlotFences()
        for i, (_, fence, _) in enumerate(self._inflight):
            fences.add(i, fence)
        return fences.drain(timeout)

    def close(self) -> None:
        self._bufs = []
        self._free.clear()
        self._inflight.clear()


def fenced_copy(backend: Backend, arrays: dict[str, Any], on_fence: Callable[[Fence], None],
                host_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """``Batch.to(device)``: copy every array to the device on the caller's current stream, then
    fence the staging slot with an event after those copies (``on_fence``).

    Keys in ``host_keys`` are copied on the host instead (indices and lanes: priority updates
    are host-side, and a device copy would cost a synchronize to bring back).
    """
    out = {}
    try:
        for name, value in arrays.items():
            out[name] = value.clone() if name in host_keys else backend.copy_now(value)
    finally:  # copies enqueued before a failure still read the slot
        on_fence(backend.record_current())
    return out
