"""``PriorityTable``: proportional priorities for a buffer's rows, in shared memory.

Per lane, a float64 sum tree and min tree over the lane's ``capacity`` slots, and per slot the
*generation* its priority belongs to (the logical index of the row it was set for, -1 for none).
Layout after the common header page: ``sums [lanes, 2P]``, ``mins [lanes, 2P]`` (f8),
``gen [lanes * capacity]`` (i8), each 64-byte aligned (P = capacity rounded up to a power of 2).

Concurrency: the process that creates the table (the learner) is the only writer of every word:
it enters new rows at the running maximum priority (``sync``), applies ``update`` and
``retire``. Sampler workers ``attach`` and only read: they descend the trees without locks and
keep a drawn leaf only if its generation is a row the buffer holds now; the row's stamp is then
checked as for any read. So a leaf changed under a reader, or a row overwritten after its
priority was set, is redrawn, never delivered with a stale priority's data. Writers (actors)
never touch the table: a dead actor or worker cannot leave it inconsistent, and nobody waits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from . import layout as L
from .errors import EmptyBufferError, InvalidPriorityError, SamplingError
from .sampling import Draw, Windows
from .sampling import sumtree
from .segment import Segment

if TYPE_CHECKING:
    from .buffer import ReplayBuffer

DRAW_ROUNDS = 64


def _priority_layout(lanes: int, capacity: int, json_len: int) -> dict[str, Any]:
    P = sumtree.tree_size(capacity)
    off = L.header_size(json_len)
    sums = off
    mins = L.align(sums + lanes * 2 * P * 8)
    gen = L.align(mins + lanes * 2 * P * 8)
    total = L.align(gen + lanes * capacity * 8, L.PAGE)
    return {"P": P, "sums": sums, "mins": mins, "gen": gen, "total": total}


class PriorityTable:
    """Priorities of one buffer's rows. ``create`` in the learner, ``attach`` in workers.

    Priorities are stored as ``(p + eps) ** alpha``; draws are proportional to them. Every sum
    stays finite: a stored value is at most ``float64 max / (2 * lanes * capacity)``, so even a
    table full of rows entered at the largest priority (``sync``) sums to at most half the
    float64 range; ``update`` refuses priorities above ``max_allowed``.
    """

    def __init__(self, segment: Segment, owner: bool) -> None:
        doc = segment.header.doc
        self.seg = segment
        self.owner = owner
        self.lanes, self.capacity = int(doc["lanes"]), int(doc["capacity"])
        self.alpha, self.eps = float(doc["alpha"]), float(doc["eps"])
        self.max_allowed = _max_priority(self.alpha, self.eps, self.lanes * self.capacity)
        lay = _priority_layout(self.lanes, self.capacity, len(L.encode_layout(doc)))
        P = lay["P"]
        mm = segment.buf
        self.sums = np.frombuffer(mm, "<f8", self.lanes * 2 * P, lay["sums"]).reshape(self.lanes, 2 * P)
        self.mins = np.frombuffer(mm, "<f8", self.lanes * 2 * P, lay["mins"]).reshape(self.lanes, 2 * P)
        self.gen = np.frombuffer(mm, "<i8", self.lanes * self.capacity, lay["gen"])
        # Learner-side state (private to the owner).
        self.max_priority = 1.0
        self.synced = np.zeros(self.lanes, np.int64)
        self.updates_dropped = 0

    @classmethod
    def create(cls, buf: ReplayBuffer, alpha: float = 0.6, eps: float = 1e-6) -> PriorityTable:
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be finite and >= 0, got {alpha!r}")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
        doc = {"kind": "priorities", "buffer": buf.name, "lanes": buf.lanes,
               "capacity": buf.capacity, "alpha": float(alpha), "eps": float(eps)}
        seg = Segment.create(None, L.KIND_PRIORITY, doc,
                             lambda n: _priority_layout(buf.lanes, buf.capacity, n)["total"])
        table = cls(seg, owner=True)
        table.mins[...] = np.inf
        table.gen[...] = -1
        # Rows already in the buffer enter at the initial maximum priority on the first sync.
        table.synced[...] = buf.windows().lo
        return table

    @classmethod
    def attach(cls, name: str) -> PriorityTable:
        return cls(Segment.attach(name, L.KIND_PRIORITY), owner=False)

    @property
    def name(self) -> str:
        return self.seg.name

    def _value(self, p: np.ndarray) -> np.ndarray:
        return (p + self.eps) ** self.alpha

    # -- learner side: the only writer -----------------------------------------------------------------
    def sync(self, buf: ReplayBuffer, initial: float | None = None) -> int:
        """Enter rows committed since the last sync at the maximum priority (``initial`` if
        given, e.g. 1.0 for uniform tables); FINAL rows (not transitions) at zero."""
        committed = buf.committed()
        new = committed > self.synced
        if not new.any():
            return 0
        C = self.capacity
        lanes, idx = [], []
        for k in np.flatnonzero(new):  # per lane, not per row
            first = max(int(self.synced[k]), int(committed[k]) - C)
            idx.append(np.arange(first, committed[k], dtype=np.int64))
            lanes.append(np.full(idx[-1].size, k, np.int64))
        self.synced[new] = committed[new]
        lanes_a, idx_a = np.concatenate(lanes), np.concatenate(idx)
        slots = lanes_a * C + idx_a % C
        final = (buf.storage.meta[slots] & L.FLAG_FINAL) != 0
        value = self._value(np.float64(self.max_priority)) if initial is None else initial
        self.gen[slots] = idx_a  # generation first: a reader that sees it finds the new row
        sumtree.update(self.sums, self.mins, lanes_a, idx_a % C, np.where(final, 0.0, value))
        return int(idx_a.size)

    def update(self, lanes: np.ndarray, indices: np.ndarray, priorities: Any) -> int:
        """Set new priorities for rows sampled at ``(lanes, indices)``; rows overwritten since
        are skipped. Returns how many were applied.

        Raises:
            InvalidPriorityError: a priority is NaN, infinite, negative or above
                ``max_allowed``, where a sum of the tree could overflow (nothing is applied).
        """
        p = np.asarray(priorities, np.float64).reshape(-1)
        indices = np.asarray(indices, np.int64).reshape(-1)
        lanes = np.broadcast_to(np.asarray(lanes, np.int64), indices.shape).reshape(-1)
        if p.shape != indices.shape:
            raise ValueError(f"{p.size} priorities for {indices.size} indices")
        bad = ~np.isfinite(p) | (p < 0)
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            raise InvalidPriorityError(
                f"priority {p[b]!r} at position {b} (index {int(indices[b])} of lane "
                f"{int(lanes[b])}) is not allowed: priorities must be finite and >= 0 "
                f"({int(bad.sum())} bad of {p.size}); nothing was updated"
            )
        big = p > self.max_allowed
        if big.any():
            b = int(np.flatnonzero(big)[0])
            raise InvalidPriorityError(
                f"priority {float(p[b])!r} at position {b} (index {int(indices[b])} of lane "
                f"{int(lanes[b])}) is too large: with alpha={self.alpha} and "
                f"{self.lanes * self.capacity} rows the sum tree could overflow to inf. "
                f"Priorities must be at most {self.max_allowed!r}; nothing was updated. Fix: "
                f"rescale or clip them (e.g. clip TD errors)"
            )
        if ((lanes < 0) | (lanes >= self.lanes)).any():
            raise ValueError(f"lanes must be in [0, {self.lanes})")
        if (indices < 0).any():  # -1 is the generation of a slot never written
            b = int(np.flatnonzero(indices < 0)[0])
            raise ValueError(
                f"index {int(indices[b])} at position {b} is not a row: indices are the logical "
                f"positions in batch.indices (>= 0); nothing was updated"
            )
        slots = lanes * self.capacity + indices % self.capacity
        current = self.gen[slots] == indices
        self.updates_dropped += int((~current).sum())
        if current.any():
            sumtree.update(self.sums, self.mins, lanes[current], indices[current] % self.capacity,
                           self._value(p[current]))
            self.max_priority = max(self.max_priority, float(p[current].max()))
        return int(current.sum())

    def retire(self, lanes: np.ndarray, indices: np.ndarray) -> None:
        """Priority zero: the rows are never drawn again (unless overwritten and re-entered)."""
        slots = lanes * self.capacity + indices % self.capacity
        current = self.gen[slots] == indices
        sumtree.update(self.sums, self.mins, lanes[current], indices[current] % self.capacity,
                       np.zeros(int(current.sum())))

    # -- anyone: read-only draws ----------------------------------------------------------------------------
    def draw(self, windows: Windows, batch: int, rng: np.random.Generator) -> Draw:
        """``batch`` rows drawn in proportion to their priorities, each a row the buffer holds
        (by its generation); with their probabilities and the smallest probability."""
        C = self.capacity
        lanes = np.empty(batch, np.int64)
        indices = np.empty(batch, np.int64)
        probs = np.empty(batch, np.float64)
        todo = np.arange(batch)
        for _ in range(DRAW_ROUNDS):
            try:
                ln, leaves, total = sumtree.sample(self.sums, todo.size, rng)
            except ValueError:
                raise EmptyBufferError(
                    "no row has a positive priority: nothing written yet (or every row retired)"
                ) from None
            leaves = np.minimum(leaves, C - 1)
            slots = ln * C + leaves
            value = self.sums[ln, self.sums.shape[1] // 2 + leaves]
            gen = self.gen[slots]
            ok = (value > 0) & (gen >= windows.lo[ln]) & (gen < windows.hi[ln])
            lanes[todo[ok]], indices[todo[ok]] = ln[ok], gen[ok]
            probs[todo[ok]] = value[ok] / total
            todo = todo[~ok]
            if not todo.size:
                pmin = float(self.mins[:, 1].min()) / total
                return Draw(lanes, indices, probs, min(pmin, float(probs.min())))
        raise SamplingError(
            f"{todo.size} of {batch} prioritized draws kept landing on rows no longer held: "
            f"the learner's priority table lags the writers (it syncs in next())"
        )

    def close(self) -> None:
        self.sums = self.mins = self.gen = None  # type: ignore[assignment]
        self.seg.close()


def _max_priority(alpha: float, eps: float, rows: int) -> float:
    """The largest priority p whose stored value ``(p + eps) ** alpha`` keeps a sum over
    ``rows`` such values within half the float64 range (inf if every finite p does)."""
    if alpha == 0:
        return math.inf
    value = float(np.finfo(np.float64).max) / (2 * rows)
    try:
        return value ** (1.0 / alpha) - eps
    except OverflowError:
        return math.inf


def importance_weights(probs: np.ndarray, pmin: float, beta: float) -> np.ndarray:
    """``w_i = (N P_i)^-beta / max_j (N P_j)^-beta = (P_i / P_min)^-beta`` (at most 1)."""
    if pmin <= 0:
        return np.ones_like(probs)
    return (probs / pmin) ** (-beta)
