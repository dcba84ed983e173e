"""``Epoch(...)``: every row the buffer holds when an epoch begins (or every start a plan may
draw) exactly once per epoch, in a seeded random order (offline RL, behaviour cloning)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shmbuf import ReplayBuffer
from shmbuf.sampling import Draw

from .base import Rows, Selection, SelectionSpec

KEEP_SIZES = 64  # epochs whose sizes are kept (a small buffer's pool runs epochs ahead)


@dataclass(frozen=True)
class Epoch(SelectionSpec):
    """Epochs, each a permutation of what the buffer holds when it begins; ``batch.epoch`` and
    ``batch.ends_epoch`` say where they end, ``pool.epoch()`` iterates one. The ``N %
    batch_size`` rows an epoch ends with: skipped (``drop_last=True``, the default), a shorter
    last batch (``drop_last=False``), or the first rows of the next batch
    (``drop_last=False, carry_remainder=True``: every batch whole, none left out).

    Example:
        >>> with SamplerPool(buf, 256, selection=Epoch(drop_last=False), seed=0) as pool:
        ...     for batch in pool.epoch():
        ...         loss = bc_step(batch)
    """

    drop_last: bool = True
    carry_remainder: bool = False
    ordered = True

    def __post_init__(self) -> None:
        for name in ("drop_last", "carry_remainder"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"Epoch({name}={value!r}): {name} must be a bool")
        if self.carry_remainder and self.drop_last:
            raise ValueError("Epoch(carry_remainder=True) carries an epoch's last rows into the "
                             "next batch instead of dropping them: pass drop_last=False with it")

    @property
    def remainder(self) -> str:
        """What happens to an epoch's last rows: "drop", "short" or "carry"."""
        return "carry" if self.carry_remainder else "drop" if self.drop_last else "short"

    def open(self, buf: ReplayBuffer, compiled: Any) -> Selection:
        return EpochSelection(buf, compiled, self.remainder)


class EpochSelection(Selection):
    """Epochs: each one a random permutation (from the pool's seeded selection rng) of the
    anchors the buffer holds when it begins (``ReplayBuffer.anchors``: every transition, or
    with a sequence or frame-stack plan every start the plan may draw), cut into batches that
    workers gather in turn. Each batch is tagged (``staging.INFO``) with its epoch, whether it
    ends it, and its rows when fewer than ``batch_size``.

    The ``N % batch_size`` anchors an epoch ends with (``remainder``, from ``drop_last`` and
    ``carry_remainder``): "short", a last batch of just those rows (PyTorch's
    ``drop_last=False``; the slot is filled up with repeats that the ``Batch`` leaves out);
    "drop", skipped (another random few each epoch); "carry", the first rows of the next batch,
    filled up from the next epoch, so every batch is whole and none is left out (epochs then
    meet inside a batch).

    A batch found overwritten before it was gathered (``stale``) is replaced in its place in
    delivery order by a batch of the same epoch with the same ``ends_epoch``: its anchors still
    usable, topped up from the anchors not yet handed out (those of the epoch being handed out
    now; any in "carry" mode). Where that cannot make a batch ("drop" and "carry" need whole
    ones; "short" one row), its anchors are lost to their epoch and the slot takes a new batch
    at the back: an epoch's last batch may then be missing, and ``epoch()`` ends the epoch at
    the first batch of a later one instead. So batches never go back to an earlier epoch.
    """

    learner_selects = True
    tags_batches = True

    def __init__(self, buf: ReplayBuffer, compiled: Any, remainder: str = "drop") -> None:
        self.buf, self.compiled, self.remainder = buf, compiled, remainder
        self.steps = compiled.index_shape[0] if compiled.index_shape else 0  # sequence length
        self.lanes = np.zeros(0, np.int64)  # this epoch's anchors, in delivery order
        self.anchors = np.zeros(0, np.int64)
        self.cursor = 0  # anchors of this epoch handed out so far
        self.epoch = -1  # the epoch begun last (from 0)
        self.sizes: dict[int, int] = {}  # anchors each of the last few epochs began with
        self.redo: Rows | None = None  # a stale batch's replacement, for the next select

    def _begin_epoch(self, found: Draw, rng: np.random.Generator) -> int:
        """Permute ``found`` (the anchors held now) into a new epoch; returns its size."""
        order = rng.permutation(found.lanes.size)
        self.lanes, self.anchors = found.lanes[order], found.indices[order]
        self.cursor, self.epoch = 0, self.epoch + 1
        self.sizes[self.epoch] = int(order.size)
        self.sizes.pop(self.epoch - KEEP_SIZES, None)
        return int(order.size)

    def _take(self, n: int) -> Draw:
        at, self.cursor = self.cursor, self.cursor + n
        return Draw(self.lanes[at:self.cursor], self.anchors[at:self.cursor])

    def select(self, batch_size: int, rng: np.random.Generator) -> Rows | None:
        if self.redo is not None:  # the slot of a stale batch: its replacement first
            rows, self.redo = self.redo, None
            return rows
        left, mode = self.lanes.size - self.cursor, self.remainder
        if left >= batch_size:
            after = left - batch_size
            ends = after == 0 or (mode == "drop" and after < batch_size)
            return self._rows(batch_size, [self._take(batch_size)], self.epoch, ends)
        if left and mode == "short":
            return self._rows(batch_size, [self._take(left)], self.epoch, True)
        found = self.buf.anchors(self.compiled)
        if found.lanes.size < (batch_size if mode == "drop" else 1):
            return None  # not a batch's worth (drop_last) or nothing at all: nothing is spent
        parts = [self._take(left)] if left and mode == "carry" else []  # else dropped
        epoch, ends = (self.epoch, True) if parts else (self.epoch + 1, False)
        have = left if parts else 0
        while have < batch_size:  # in "carry" mode an epoch smaller than a batch is begun again
            n = self._begin_epoch(found, rng)
            take = min(batch_size - have, n)
            parts.append(self._take(take))
            have += take
            ends = ends or take == n or (mode == "drop" and n - take < batch_size)
            if mode != "carry":
                break
        return self._rows(batch_size, parts, epoch, ends)

    def _rows(self, batch_size: int, parts: list[Draw], epoch: int, ends: bool) -> Rows:
        """The slot's rows: ``parts`` (filled up with repeats if fewer than ``batch_size``),
        sequences as ``[B, T]`` indices, with the batch's ``INFO`` words."""
        lanes = np.concatenate([p.lanes for p in parts])
        anchors = np.concatenate([p.indices for p in parts])
        n = lanes.size
        if n < batch_size:
            repeat = np.arange(batch_size) % n
            lanes, anchors = lanes[repeat], anchors[repeat]
        indices = anchors[:, None] + np.arange(self.steps) if self.steps else anchors
        info = np.array([n if n < batch_size else 0, epoch + 1, int(ends)], np.int64)
        return lanes, indices, None, 0.0, info

    def stale(self, rows: Rows) -> bool:
        """Anchors of an ungathered batch were overwritten: its replacement for the next
        ``select`` (the class docstring says which), if one can be made."""
        assert len(rows) == 5  # this selection's rows carry their INFO words
        batch_size = rows[0].size
        n, epoch, ends = int(rows[4][0]) or batch_size, int(rows[4][1]) - 1, bool(rows[4][2])
        anchors = rows[1][:n, 0] if self.steps else rows[1][:n]
        still = self.buf.anchors(self.compiled, among=Draw(rows[0][:n], anchors))
        parts = [still]
        mode, have = self.remainder, still.lanes.size
        whole = 1 if mode == "short" else batch_size  # rows a batch needs
        if epoch == self.epoch:  # top up from what is not handed out yet, still usable
            left = self.lanes.size - self.cursor
            while have < batch_size and self.cursor < self.lanes.size:
                more = self.buf.anchors(self.compiled, among=self._take(
                    min(batch_size - have, self.lanes.size - self.cursor)))
                parts.append(more)
                have += more.lanes.size
            # took the last of the epoch before the batch that would have ended it was made
            last = batch_size if mode == "drop" else 1
            ends = ends or left >= last > self.lanes.size - self.cursor
        if have < whole:
            return False  # lost to its epoch: the slot takes a new batch, at the back
        self.redo = self._rows(batch_size, parts, epoch, ends)
        return True


