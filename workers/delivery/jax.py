"""``output="jax"``: batches of JAX arrays imported by DLPack over a host delivery's staging slots,
each slot fenced by the lifetime of its arrays (``JaxDelivery``, ``JaxViews``).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..batch import Batch
from ..device import Fence
from ..staging import INDICES, LANES, WEIGHTS
from .base import DeliveryLayer, HostDelivery


class _ViewsFreed:
    """A fence that passes once every NumPy view exported to JAX has been freed.

    JAX keeps an imported DLPack buffer (and so the view behind it) alive until the last
    computation reading it has completed, even after ``Array.delete()``; the view's finalizer
    therefore marks the moment the staging memory is no longer read.
    """

    def __init__(self, n: int) -> None:
        self.alive = n

    def _freed(self) -> None:
        self.alive -= 1  # under the GIL, from whichever thread dropped the buffer

    def query(self) -> bool:
        return self.alive <= 0


class JaxViews:
    """Zero-copy JAX arrays over a staging slot, fenced by their lifetime.

    ``wrap`` imports a fresh view of each array through DLPack (no copy: the slot's arrays are
    64-byte aligned) and returns the fence that passes once JAX has let go of all of them: once
    the learner has dropped every array of the batch and every computation dispatched on them
    has completed (JAX holds an imported buffer until then). Arrays are not deleted on release:
    ``Array.delete()`` blocks until pending computations finish, which would make ``next()``
    wait for the learner's own work. A slot whose arrays the learner keeps stays out of the
    ring until they are dropped.
    """

    def __init__(self) -> None:
        try:
            import jax
        except ImportError:
            raise ImportError("output='jax' needs JAX: pip install jax") from None
        self.jax = jax

    def wrap(self, arrays: dict[str, np.ndarray], copy: bool = False,
             host_keys: tuple[str, ...] = ()) -> tuple[dict[str, Any], Fence | None]:
        """JAX arrays of ``arrays`` and the fence of the memory they alias (None if copied);
        ``host_keys`` are always copied (small arrays the pool itself keeps referring to)."""
        if copy:  # private memory that is reused at once (in-process pools): JAX gets copies
            return {n: self.jax.numpy.array(a) for n, a in arrays.items()}, None
        fence = _ViewsFreed(len(arrays))
        out = {}
        for name, arr in arrays.items():
            if name in host_keys:  # kept by the pool (update_priorities), so never aliased
                fence._freed()
                out[name] = self.jax.numpy.array(arr)
                continue
            view = arr[...]  # a fresh object per batch, so its death is this batch's fence
            weakref.finalize(view, fence._freed)
            out[name] = self.jax.dlpack.from_dlpack(view)
        return out, fence


class JaxDelivery(DeliveryLayer):
    """``output="jax"``: each host slot's fields, indices, lanes and weights as JAX arrays.
    The fields and weights alias the slot (copies where the host refills its one private slot
    at once, ``copies_for_jax``); indices and lanes are always copies. A released slot goes
    back only once JAX has let go of its arrays (``JaxViews``), so async dispatch needs no
    ``block_until_ready``, and arrays kept past the next batch stay valid.

    Concurrency: learner thread only (see ``Delivery``); the fence passes from whichever thread
    drops the last array, under the GIL.
    """

    def __init__(self, host: HostDelivery) -> None:
        super().__init__(host)
        self.jax = JaxViews()  # (ImportError with the fix, before anything starts)
        self.held_fence: Fence | None = None  # of the held batch's arrays

    def next(self, timeout: float, step: int) -> Batch:
        host = self.host
        slot = host.wait_slot(step, timeout)
        views, info = host.host_arrays(slot, step)
        names = [*host.out_fields, INDICES, LANES, WEIGHTS]
        arrays, self.held_fence = self.jax.wrap({n: views[n] for n in names},
                                                copy=host.copies_for_jax,
                                                host_keys=(INDICES, LANES))
        return self.deliver(Batch({n: arrays[n] for n in host.out_fields}, arrays[INDICES],
                                  arrays[LANES], arrays[WEIGHTS], self.release_batch, slot,
                                  host.generation(slot), None, info))

    def fence_released(self, batch: Batch) -> None:
        """The slot of a released batch waits until JAX has let go of its arrays."""
        if self.held_fence is not None:
            self.host.fence(batch.slot, self.held_fence)
            self.held_fence = None
