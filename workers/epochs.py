"""``EpochIteration``: the epoch part of ``SamplerPool``'s surface (``selection=Epoch(drop_last,
carry_remainder)``, ``epoch()``); the rows are chosen by ``EpochSelection``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from shmbuf.errors import ShmbufError

from .batch import Batch

if TYPE_CHECKING:
    from .config import PoolConfig
    from .selection import Selection


class EpochIteration:
    """Epochs for offline RL and behaviour cloning (a mixin of ``SamplerPool``).

    ``SamplerPool(buf, batch_size, selection=Epoch(), seed=...)`` delivers every transition the
    buffer holds when an epoch begins (with a sequence, frame-stack or n-step plan: every start
    the plan may draw, ``ReplayBuffer.anchors``) exactly once per epoch, in an order that
    depends only on ``seed``, not on the workers. Each batch says its ``batch.epoch`` (from 0)
    and whether it ``ends_epoch``. The ``N % batch_size`` rows an epoch ends with:

    - ``Epoch(drop_last=True)`` (the default): skipped, another random few each epoch;
    - ``Epoch(drop_last=False)``: a shorter last batch, as PyTorch's DataLoader gives (every
      field, ``indices``, ``lanes`` and ``weights`` have that many rows);
    - ``Epoch(drop_last=False, carry_remainder=True)``: the first rows of the next batch, filled up
      from the next epoch, so every batch has ``batch_size`` rows (fixed shapes for compiled
      steps) and none is left out; that batch has the epoch of its first rows.

    Concurrency: learner thread only, as ``SamplerPool.next``.
    """

    _config: PoolConfig
    _selection: Selection
    _pending: Batch | None  # a batch taken but not handed out yet (by ``epoch()``)
    if TYPE_CHECKING:  # provided by SamplerPool
        def _check_open(self) -> None: ...
        def next(self, timeout: float | None = None) -> Batch: ...

    def epoch(self, timeout: float | None = None) -> Iterator[Batch]:
        """The batches of one epoch: from the next batch to the one that ends its epoch
        (``batch.ends_epoch``), each valid until the next is taken; ``timeout`` as ``next``'s.
        Where writers overwrote an epoch's last batch before it was gathered, the epoch ends
        before the first batch of the next one, which the next ``next()`` (or ``epoch()``)
        returns.

        Raises:
            ShmbufError: the pool's selection is not ``Epoch(...)`` (raised here, not when
                iterating).
        """
        self._check_open()
        if not self._selection.tags_batches:
            raise ShmbufError(f"epoch() needs SamplerPool(..., selection=Epoch(...)); this "
                              f"pool's selection is {self._config.selection!r}")
        return self._epoch_batches(timeout)

    def _epoch_batches(self, timeout: float | None) -> Iterator[Batch]:
        return one_epoch(lambda: self.next(timeout), self._hold)

    def _hold(self, batch: Batch) -> None:
        self._pending = batch

    def epoch_size(self, epoch: int) -> int | None:
        """The rows (anchors) epoch ``epoch`` began with, while it is one of the last few
        begun (``batch.epoch`` of a batch just taken is), else None. With ``drop_last`` its
        batches hold ``size // batch_size`` of them; fewer where writers overwrote rows first."""
        sizes = getattr(self._selection, "sizes", None)
        return None if sizes is None else sizes.get(int(epoch))


def one_epoch(next_batch: Callable[[], Any], hold: Callable[[Any], None]) -> Iterator[Any]:
    """The batches ``next_batch()`` returns, from the next one to the one that ends its epoch
    (``batch.ends_epoch``). A batch of a later epoch met first (the epoch's last batch was lost:
    its rows overwritten before they were gathered) ends it too, given to ``hold`` for the next
    ``next()``. (``SamplerPool.epoch`` and ``ClusterSampler.epoch``.)"""
    first = None
    while True:
        batch = next_batch()
        if first is None:
            first = batch.epoch
        elif batch.epoch is not None and first is not None and batch.epoch > first:
            hold(batch)
            return
        yield batch
        if batch.ends_epoch:
            return
