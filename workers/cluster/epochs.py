"""``ClusterEpochs``: ``selection=Epoch(...)`` over a cluster: every row of every node once per
epoch, the nodes' rows interleaved by a seeded draw in proportion to what each has left.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from shmbuf.errors import ShmbufError, Timeout

from .batch import BatchBuffer
from .sources import Chunk


class ClusterEpochs:
    """Epochs over the union of the nodes' rows.

    Each node's pool runs ``Epoch(drop_last=False)`` over its own buffer: node epochs, each a
    permutation (seeded per node) of the rows, or a plan's window starts, the node held when it
    began, shipped in chunks that say their node epoch, its size and whether they end it. Epoch
    ``e`` of the cluster takes one whole node epoch from every node that holds rows when it
    begins (the next one that node's stream brings), and each batch is split among the nodes by
    a seeded multivariate hypergeometric draw on the rows each still has to give: as if the
    union's rows were one random permutation in which each node's rows keep their node's order.
    The rows an epoch ends with, fewer than a batch, are dropped, delivered as a short batch or
    carried into the next epoch's first batch, as ``Epoch`` decides on one machine. Within a
    batch, each draw's rows sit at random positions.

    A node epoch that lost rows (overwritten before its pool gathered them) ends early: its
    stream then brings a chunk of a later node epoch, which waits for the next cluster epoch,
    and the draw takes the other nodes' rows. A node whose host Ray restarted begins its epochs
    again; a dropped node gives no more rows. A ``next()`` that times out with its batch part
    filled loses those rows to the epoch.

    What it draws on is the sampler's: its output ``out``, ``rng``, ``node_ids``, and three
    calls: ``sizes()`` (rows each node holds; 0 for a dropped node), ``poll()`` (take in the
    nodes' replies, pausing a moment) and ``chunk(k, wait)`` (node k's current chunk with rows
    left or its next one; None if none came in ``wait`` s, or node k is dropped: found lost
    there, it is dropped by the sampler, which calls ``drop``).

    Concurrency: the learner's, as the ``ClusterSampler`` that holds it.
    """

    def __init__(self, remainder: str, out: BatchBuffer, rng: np.random.Generator,
                 node_ids: list[str], min_size: int, sizes: Callable[[], np.ndarray],
                 poll: Callable[[], None], chunk: Callable[[int, float], Chunk | None]) -> None:
        self.out, self.rng, self.node_ids, self.min_size = out, rng, node_ids, min_size
        self._sizes, self._poll, self._next_chunk = sizes, poll, chunk
        n_nodes = len(node_ids)
        self.remainder = remainder  # "drop", "short" or "carry" (``Epoch.remainder``)
        self.epoch = -1  # the cluster epoch begun last
        self.left = np.zeros(n_nodes, np.int64)  # rows each node has still to give to it
        self.node_epoch = np.full(n_nodes, -1, np.int64)  # the node epoch each node gives
        self.given = np.zeros(n_nodes, np.int64)  # rows of that node epoch given so far
        self.sizes: list[int] = []  # rows each cluster epoch began with (the last few)
        self.dropped_rows = 0  # epochs' last rows left out (drop_last)
        self.gone: set[int] = set()  # nodes dropped

    def add_node(self) -> None:
        """A node joined: it gives rows from the next epoch on."""
        self.left = np.append(self.left, 0)
        self.node_epoch = np.append(self.node_epoch, -1)
        self.given = np.append(self.given, 0)

    def drop(self, k: int) -> None:
        """Node k was lost: its rows not given yet are lost to the running epoch."""
        self.left[k] = 0
        self.gone.add(k)

    # -- one batch ----------------------------------------------------------------------------------
    def fill(self, deadline: float, wait: float) -> list[int]:
        """Fill the output batch; returns its ``staging.INFO`` words (rows if short, epoch + 1,
        ends its epoch)."""
        size = self.out.size
        placed = np.zeros(size, bool)  # positions holding a row of this batch
        epoch: int | None = None  # the epoch of the batch's first rows
        ends = False
        while not placed.all():
            if not self.left.any():  # the running epoch has given every row
                if placed.any():
                    ends = True
                    if self.remainder == "short":
                        break
                    if self.remainder == "drop":  # (rows were lost: fewer than a batch came)
                        self.dropped_rows += int(placed.sum())
                        placed[:] = False
                        epoch, ends = None, False
                self._begin(deadline, wait)
                epoch = self.epoch if epoch is None else epoch
                continue
            if self.remainder == "drop" and not placed.any() and self.left.sum() < size:
                self._skip_rest(deadline)  # the epoch's last rows: another few each epoch
                continue
            epoch = self.epoch if epoch is None else epoch
            free = self.rng.permutation(np.flatnonzero(~placed))
            split = self.rng.multivariate_hypergeometric(self.left, min(free.size,
                                                                      int(self.left.sum())))
            start = 0
            for k in np.flatnonzero(split):
                pos = free[start:start + int(split[k])]
                start += pos.size
                got = self._give(int(k), pos, deadline)
                placed[pos[:got]] = True
                self.out.nodes[pos[:got]] = k
        rows = int(placed.sum())
        if rows < size:  # an epoch's short last batch: its rows to the front
            self.out.compact(np.flatnonzero(placed))
        if epoch == self.epoch:
            ends = ends or not self.left.any() or (self.remainder == "drop"
                                                   and self.left.sum() < size)
        assert epoch is not None
        return [rows if rows < size else 0, epoch + 1, int(ends)]

    # -- the nodes' streams -------------------------------------------------------------------------
    def _begin(self, deadline: float, wait: float) -> None:
        """Begin the next epoch: every node holding rows gives its next node epoch (waits until
        the cluster holds ``min_size`` rows, and for each such node's first chunk)."""
        while True:
            sizes = self._sizes()
            if sizes.sum() >= max(self.min_size, 1):
                break
            if time.monotonic() >= deadline:
                raise Timeout(f"no batch after {wait}s: the cluster holds {int(sizes.sum())} rows "
                              f"(min_size {self.min_size})")
            self._poll()
        self.epoch += 1
        for k in np.flatnonzero(sizes):
            chunk = self._chunk(int(k), deadline)
            if chunk is None:  # the node was dropped
                continue
            assert chunk.epoch is not None
            if chunk.epoch != self.node_epoch[k]:
                self.node_epoch[k], self.given[k] = chunk.epoch, 0
            if chunk.epoch_rows is None:
                raise ShmbufError(f"node {self.node_ids[k][:12]} sent rows of its epoch "
                                  f"{chunk.epoch} without its size (its pool ran far ahead)")
            self.left[k] = max(chunk.epoch_rows - self.given[k], 0)
        self.sizes = [*self.sizes[-7:], int(self.left.sum())]

    def _chunk(self, k: int, deadline: float) -> Chunk | None:
        """Node k's current chunk with rows left, or its next one (None: the node was
        dropped); ``Timeout`` if none comes before ``deadline``."""
        while True:
            chunk = self._next_chunk(k, min(0.2, max(deadline - time.monotonic(), 0.0)))
            if chunk is not None and chunk.offset < chunk.rows:
                return chunk
            if k in self.gone:
                return None
            if time.monotonic() >= deadline:
                raise Timeout(f"Epoch(): node {self.node_ids[k][:12]} holds "
                              f"{int(self._sizes()[k])} rows but sent none of its epoch in "
                              f"time (with a plan: it may hold no whole window yet)")

    def _give(self, k: int, pos: np.ndarray, deadline: float,
              copy: bool = True) -> int:
        """Up to ``pos.size`` rows of node k's running node epoch, copied to positions ``pos``
        (or passed over: ``copy=False``); fewer if that node epoch ends first."""
        done = 0
        while done < pos.size and self.left[k]:
            chunk = self._chunk(k, deadline)
            if chunk is None:
                self.left[k] = 0
                break
            if chunk.epoch != self.node_epoch[k]:  # its epoch lost rows, and ended early
                self.left[k] = 0
                break
            want = min(pos.size - done, int(self.left[k]))
            if copy:
                m = self.out.copy_rows(chunk, pos[done:], want)
            else:
                m = min(want, chunk.rows - chunk.offset)
                chunk.offset += m
            done += m
            self.given[k] += m
            self.left[k] -= m
            if chunk.ends_epoch and chunk.offset == chunk.rows:
                self.left[k] = 0
        return done

    def _skip_rest(self, deadline: float) -> None:
        """Pass over the rows the running epoch has left (fewer than a batch: drop_last)."""
        for k in np.flatnonzero(self.left):
            n = int(self.left[k])
            self.dropped_rows += self._give(int(k), np.zeros(n, np.int64), deadline,
                                            copy=False)
            self.left[k] = 0
