"""``samples_per_insert`` over a whole ``ReplayCluster``, on the writers' side: each node's
``Limiter`` is held to the cluster-wide counts that the learner reports to it (``NodeLimit``),
and the learner splits the room for inserts fairly between the nodes (``RoomShares``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from shmbuf import ReplayBuffer
from shmbuf.limiter import RateLimit

if TYPE_CHECKING:
    from shmbuf.lease import Lease

Report = tuple[int, ...]
"""What the learner tells a node: ``(inserts_elsewhere, samples[, seq])``: the rows the node's
writers count as inserted on the *other* nodes (their rows as last seen, plus the room set
aside for them: ``RoomShares``), the rows sampled from the whole cluster, and the report's
number (a node applies a report only if it is newer than the last one it applied)."""

STARVE_S = 0.1  # a learner held back this long with no insert anywhere pools the room


def cluster_report(committed: Sequence[int], node: int, samples: int) -> Report:
    """The plain report for node ``node``, from every node's rows committed as the learner last
    saw them (0 for a dropped node: its rows no longer count, as in the learner's own check):
    the node may use all of the cluster's room."""
    return int(sum(committed)) - int(committed[node]), int(samples)


class RoomShares:
    """The learner's split of the cluster's room for inserts between the nodes.

    The cluster may hold ``allowed = (max_diff + samples) / ratio`` inserts; the room is that
    minus the rows inserted. Each node gets a cap on its own inserts, and every row of new
    room (the learner sampled) raises each live node's cap by ``1 / nodes``: a node that hears
    late still gets its share when it does, and the node that hears first (the learner's,
    set every 10 ms) cannot take the others'. A node's report then counts, as inserted
    elsewhere, ``allowed - cap``: its writers see exactly the room up to their cap.

    Before the cluster holds ``min_size`` rows every node gets the plain report (it may use
    all the room, ``cluster_report``: no writer waits then). A stall: the learner is held back
    by the limit with no insert anywhere for ``STARVE_S`` (a node's share may be smaller than
    one of its writer's ``extend``, or its writers slow or gone). Then the whole room goes to
    one node, the one with the fewest rows first, and on to the next after each further
    ``STARVE_S`` without an insert: the room is at least ``tolerance / ratio`` rows while the
    learner is held back, so some writer's ``extend`` fits (``RateLimit.max_insert_chunk``).
    The caps are set afresh (the room split evenly) once the learner samples again.

    Concurrency: the learner's, used from one thread.
    """

    def __init__(self, limit: RateLimit, n_nodes: int) -> None:
        assert limit.samples_per_insert is not None
        self.limit = limit
        self.caps = np.zeros(n_nodes)
        self.allowed = 0.0
        self.alive: tuple[int, ...] = ()
        self.shared = False  # caps in force (else plain reports)
        self.pooled = 0  # stalls: times the whole room went to one node
        self.favored: int | None = None  # the node holding the whole room in a stall
        self._stalled: tuple[float, int] | None = None  # (since, inserts then)
        self._turn = 0  # stalls since the learner last sampled
        self._seen: list[int | None] = []
        self.seq = 0

    def _allowed(self, samples: int) -> float:
        ratio = self.limit.samples_per_insert
        assert ratio is not None
        return (self.limit.max_diff + samples) / ratio

    def update(self, committed: Sequence[int | None], samples: int) -> None:
        """Take in the nodes' rows as last seen (None: dropped) and the rows sampled."""
        if len(committed) > len(self.caps):  # a node joined (its cap is set below)
            self.caps = np.append(self.caps, np.zeros(len(committed) - len(self.caps)))
        alive = tuple(k for k, c in enumerate(committed) if c is not None)
        total = sum(int(committed[k] or 0) for k in alive)
        allowed = self._allowed(samples)
        self._seen = list(committed)
        if not alive or total < self.limit.min_size or self.favored is not None:
            self.shared = False
        elif not self.shared or alive != self.alive:  # (re)start: the room split evenly
            room = max(allowed - total, 0.0)
            self.caps[:] = 0.0
            for k in alive:
                self.caps[k] = int(committed[k] or 0) + room / len(alive)
            self.shared = True
        elif allowed > self.allowed:
            self.caps[list(alive)] += (allowed - self.allowed) / len(alive)
        self.alive, self.allowed = alive, allowed

    def report(self, committed: Sequence[int | None], k: int, samples: int) -> Report:
        """Node ``k``'s report (after ``update``), numbered."""
        self.seq += 1
        if self.favored is not None and k != self.favored:  # no room: another node's turn
            return max(0, math.floor(self.allowed) - int(committed[k] or 0)), int(samples), \
                self.seq
        if not self.shared:
            rows = [int(c or 0) for c in committed]
            return (*cluster_report(rows, k, samples), self.seq)
        elsewhere = max(0, math.floor(self.allowed) - math.floor(self.caps[k]))
        return elsewhere, int(samples), self.seq

    def held_back(self, inserts: int) -> None:
        """The learner is held back by the ratio (the cluster holds ``inserts`` rows): after
        ``STARVE_S`` with no insert anywhere, the whole room goes to one node (the fewest rows
        first), then to the next, until the learner samples again."""
        now = time.monotonic()
        if self._stalled is None or self._stalled[1] != inserts:
            self._stalled = (now, inserts)
            return
        if now - self._stalled[0] < STARVE_S or not self.alive:
            return
        order = sorted(self.alive, key=lambda k: (int(self._seen[k] or 0), k))
        self.favored = order[self._turn % len(order)]
        self._turn += 1
        self.shared = False
        self.pooled += 1
        self._stalled = (now, inserts)  # the favored node's time to insert

    def sampled(self) -> None:
        """The learner took a batch: back to fair caps after a stall."""
        self._stalled = None
        self.favored = None
        self._turn = 0


class NodeLimit:
    """Holds one node's rate limiter to the cluster's ``samples_per_insert``.

    The node's writers see the cluster's inserts as their node's rows (live, from the lanes'
    ``committed`` words) plus the ``inserts_elsewhere`` of the learner's last report, and the
    learner's samples as last reported, and wait as ``Limiter.wait_for_insert`` makes any
    writer wait: with the writer's timeout and ``RateLimitTimeout``. The learner reports the
    other nodes' rows plus the room it set aside for them (``RoomShares``), so the node's
    writers see only the node's share of the room. Reports lag: a late one holds writers back
    a little longer than needed, never past the cap it gave. Before any report the node counts
    only its own rows. ``min_size`` holds cluster-wide: the count a node sees is never above
    the cluster's before ``min_size``, so no writer waits before the cluster holds it.

    Concurrency: ``LOCK_LIMITER`` is taken here (``Limiter.take``; a second rate-limiting
    sampler on the node is refused), so this process is the only writer of the limiter's
    words until ``release``; reports may come from two threads of the host (a fetch and a
    report call), so ``apply`` and ``release`` take a lock and a numbered report older than
    the last one applied is dropped. If this process dies, writers treat the limit as lifted
    (as for a dead ``SamplerPool``) until a restarted host takes it again at the learner's
    next call.
    """

    def __init__(self, buffer: ReplayBuffer, limit: RateLimit,
                 report: Report | None = None) -> None:
        self.limiter = buffer.storage.limiter
        self.seq = -1  # the newest report applied
        self._lock = threading.Lock()  # reports come from a host's two threads
        self.lease: Lease | None = self.limiter.take()
        try:
            self.limiter.configure(limit, n_samplers=1)
            self.limiter.set_counts(0, 0)
            if report is not None:
                self.apply(report)
        except BaseException:
            self.release()
            raise

    def apply(self, report: Report) -> None:
        """Count the cluster's inserts and samples of ``report`` from now on (unless a newer
        numbered report was applied already: reports may overtake each other)."""
        inserts_elsewhere, samples, *numbered = report
        with self._lock:
            if numbered:
                if numbered[0] <= self.seq:
                    return
                self.seq = numbered[0]
            if self.lease is not None:
                self.limiter.set_counts(inserts_elsewhere, samples)

    def release(self) -> None:
        """Lift the limit (writers resume at once) and let the lock go. Idempotent."""
        with self._lock:
            if self.lease is not None:
                try:
                    self.limiter.deactivate()
                finally:
                    self.lease.close()
                    self.lease = None
