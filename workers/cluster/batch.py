"""What a ``ClusterSampler`` assembles batches with: ``BatchBuffer`` (the reused output arrays
rows of every node are copied into, and their importance weights), ``ClusterBatch`` (the
learner's view of one), ``QueueCursors`` (each queue row once per node and lane) and
``PriorityRouter`` (priority updates sent to each row's node).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray

from shmbuf.errors import InvalidPriorityError
from shmbuf.window_priority import reduce_windows

from ..batch import Batch
from .sources import Chunk


class ClusterBatch(Batch):
    """A ``Batch`` assembled from several nodes; ``nodes[i]`` is the index (into
    ``sampler.node_ids``) of the node row i came from. Valid until the next batch."""

    __slots__ = ("_nodes",)

    def __init__(self, data: dict[str, Any], indices: Any, lanes: Any, weights: Any,
                 nodes: np.ndarray, release_fn: Any, info: list[int] | None = None) -> None:
        super().__init__(data, indices, lanes, weights, release_fn, info=info)
        self._nodes = nodes[:info[0]] if info is not None and info[0] else nodes

    @property
    def nodes(self) -> np.ndarray:
        self._check()
        return self._nodes

    def copy(self) -> dict[str, Any]:
        out = super().copy()
        out["nodes"] = self._nodes.copy()
        return out


class BatchBuffer:
    """One batch's arrays, reused from batch to batch (no page faults on fresh memory). The
    fields and indices take the shapes of the first rows copied in: a plan's (``[B, T, ...]``
    sequences, frame stacks, a mask) as the nodes' pools deliver them."""

    def __init__(self, batch_size: int) -> None:
        self.size = batch_size
        self.fields: dict[str, np.ndarray] = {}
        self.indices = np.empty(batch_size, np.int64)
        self.lanes = np.empty(batch_size, np.int64)
        self.values = np.ones(batch_size, np.float64)  # stored priorities (prioritized)
        self.weights = np.ones(batch_size, np.float32)
        self.nodes = np.zeros(batch_size, np.int16)

    def _shape_like(self, chunk: Chunk) -> None:
        self.fields = {f: np.empty((self.size, *a.shape[1:]), a.dtype)
                       for f, a in chunk.fields.items()}
        self.indices = np.empty((self.size, *chunk.indices.shape[1:]), np.int64)

    def copy_rows(self, chunk: Chunk, pos: Any, want: int) -> int:
        """Copy up to ``want`` rows of ``chunk`` to positions ``pos``; how many it copied."""
        if not self.fields:
            self._shape_like(chunk)
        m = min(want, chunk.rows - chunk.offset)
        a, p = chunk.offset, pos[:m]
        for f, out in self.fields.items():
            out[p] = chunk.fields[f][a:a + m]
        self.indices[p] = chunk.indices[a:a + m]
        self.lanes[p] = chunk.lanes[a:a + m]
        if chunk.values is not None:
            self.values[p] = chunk.values[a:a + m]
        chunk.offset += m
        return m

    def weigh(self, vmin: float, beta: float) -> None:
        """Importance weights ``(P_i / P_min) ** -beta`` with ``P = value / total``: the total
        cancels, so the smallest stored priority of all nodes is all it takes."""
        np.power(self.values / vmin, -beta, out=self.values)
        self.weights[...] = self.values

    def compact(self, rows: np.ndarray) -> None:
        """Move the rows at positions ``rows`` (ascending) to the front (a short batch)."""
        n = rows.size
        for out in (*self.fields.values(), self.indices, self.lanes, self.values, self.nodes):
            out[:n] = out[rows]

    def batch(self, release_fn: Any, info: list[int] | None = None) -> ClusterBatch:
        """The learner's view; ``info`` as a slot's ``staging.INFO`` words (epochs)."""
        return ClusterBatch(dict(self.fields), self.indices, self.lanes, self.weights,
                            self.nodes, release_fn, info)


class QueueCursors:
    """The next queue row expected from each node's lane: rows before it are dropped (a
    restarted host starts its queue again at the oldest rows held), rows skipped over counted
    (written over while a node's queue was down)."""

    def __init__(self, n_nodes: int, lanes: int) -> None:
        self.next = np.zeros((n_nodes, lanes), np.int64)
        self.gaps = 0
        self.repeats = 0

    def add_node(self) -> None:
        """A node joined: its lanes start at row 0."""
        self.next = np.vstack([self.next, np.zeros((1, self.next.shape[1]), np.int64)])

    def admit(self, k: int, chunk: Chunk) -> None:
        nxt = self.next[k]
        keep = chunk.indices >= nxt[chunk.lanes]
        if not keep.all():
            self.repeats += int((~keep).sum())
            chunk.keep(keep)
        for lane in np.unique(chunk.lanes):  # per lane, not per row
            idx = chunk.indices[chunk.lanes == lane]
            self.gaps += int(idx.min() - nxt[lane]) if nxt[lane] else 0
            nxt[lane] = idx.max() + 1


class PriorityRouter:
    """Sends priority updates to the node each row came from (``sources[k]``, None if dropped):
    the local pool applies them at once, a host after the fetches it has queued."""

    def __init__(self, sources: list[Any]) -> None:
        self.sources = sources
        self.refs: list[Any] = []
        self.sent = 0

    def send(self, indices: Any, priorities: Any, lanes: Any, nodes: Any) -> int:
        idx = np.asarray(_host(indices), np.int64).reshape(-1)
        prio = np.asarray(_host(priorities), np.float64).reshape(-1)
        ln = np.asarray(_host(lanes), np.int64).reshape(-1)
        nd = np.asarray(_host(nodes), np.int64).reshape(-1)
        if not (idx.size == prio.size == ln.size == nd.size):
            raise ValueError(f"indices, priorities, lanes and nodes differ in length: "
                             f"{idx.size}, {prio.size}, {ln.size}, {nd.size}")
        if not np.isfinite(prio).all() or (prio < 0).any():
            raise InvalidPriorityError("priorities must be finite and >= 0; nothing was sent")
        self.collect()
        for k in np.unique(nd):
            src = self.sources[int(k)]
            if src is None:
                continue
            m = nd == k
            out = src.update_priorities(ln[m], idx[m], prio[m])
            if src.remote:
                self.refs.append(out)
            self.sent += int(m.sum())
        return int(idx.size)

    def collect(self) -> None:
        """Raise a host's refusal of an earlier update here (and forget the done ones)."""
        if not self.refs:
            return
        done, self.refs = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for ref in done:
            try:
                ray.get(ref, timeout=10.0)
            except ray.exceptions.RayTaskError as e:
                raise e.as_instanceof_cause() from None
            except ray.exceptions.RayError:
                pass  # the host died: its node's priorities went with it


def window_updates(indices: Any, priorities: Any, mask: Any, eta: float
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Sequences' updates as one priority per window start: ``indices`` ``[B, T]`` to their
    column 0, ``[B, T]`` priorities reduced by ``reduce_windows`` (over the steps ``mask``
    keeps); ``[B]`` ones as they are. Raises ``InvalidPriorityError`` for a kept step that is
    NaN, infinite or negative."""
    idx = np.asarray(_host(indices), np.int64)
    prio = np.asarray(_host(priorities), np.float64)
    if mask is not None and prio.ndim != 2:
        raise ValueError(f"mask= selects steps of [B, T] priorities; these are of shape "
                         f"{prio.shape}: pass per-step priorities with it, or no mask")
    if idx.ndim == 2:
        if prio.ndim == 2 and prio.shape != idx.shape:
            raise ValueError(f"priorities of shape {prio.shape} for windows {idx.shape}: pass "
                             f"one per window ([{idx.shape[0]}]) or per step ({idx.shape})")
        idx = idx[:, 0]
    if prio.ndim == 2:
        steps = None if mask is None else np.asarray(_host(mask), bool)
        if steps is not None and (steps.shape != prio.shape or not steps.any(axis=1).all()):
            raise ValueError(f"mask of shape {steps.shape} must match the priorities "
                             f"{prio.shape} and keep a step of every window")
        kept = prio if steps is None else np.where(steps, prio, 0.0)
        if not np.isfinite(kept).all() or (kept < 0).any():
            raise InvalidPriorityError("priorities must be finite and >= 0; nothing was sent")
        prio = reduce_windows(kept, eta, steps)
    return idx, prio


def _host(value: Any) -> Any:
    """NumPy for priority updates: torch tensors (also on a device) come to the host."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu().numpy()
    return value
