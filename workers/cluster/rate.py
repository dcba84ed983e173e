"""``samples_per_insert`` over a whole ``ReplayCluster``, on the writers' side: each node's
``Limiter`` is held to the cluster-wide counts that the learner reports with every call it
makes to the node anyway (``NodeLimit``, and the report ``cluster_report`` computes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shmbuf import ReplayBuffer
from shmbuf.limiter import RateLimit

if TYPE_CHECKING:
    from shmbuf.lease import Lease

Report = tuple[int, int]
"""What the learner tells a node: (rows inserted on the *other* nodes, as it last saw them;
rows it has sampled from the whole cluster)."""


def cluster_report(committed: Sequence[int], node: int, samples: int) -> Report:
    """The report for node ``node``, from every node's rows committed as the learner last saw
    them (0 for a dropped node: its rows no longer count, as in the learner's own check)."""
    return int(sum(committed)) - int(committed[node]), int(samples)


def node_report(limit: RateLimit | None, sources: Sequence[Any], node: int,
                samples: int) -> Report | None:
    """The report for node ``node`` from the learner's sources (each with ``committed()``;
    None once dropped), or None without a limit. Sources not opened yet count nothing."""
    if limit is None:
        return None
    committed = [0 if src is None else src.committed() for src in sources]
    committed += [0] * (node + 1 - len(committed))
    return cluster_report(committed, node, samples)


class NodeLimit:
    """Holds one node's rate limiter to the cluster's ``samples_per_insert``.

    The node's writers see the cluster's inserts as their node's rows (live, from the lanes'
    ``committed`` words) plus the other nodes' as last reported, and the learner's samples as
    last reported, and wait as ``Limiter.wait_for_insert`` makes any writer wait: with the
    writer's timeout and ``RateLimitTimeout``. Both reported counts lag: lagging samples hold
    writers back a little longer than needed; lagging inserts of other nodes let each node
    spend, until the next report, the room that the others see too. So the cluster may run
    ahead of the limit by up to (nodes - 1) x the room left at the last report, and never for
    long: the next report counts it. Before any report the node counts only its own rows.
    ``min_size`` holds cluster-wide: the count a node sees is never above the cluster's, so no
    writer waits before the cluster holds ``min_size`` rows.

    Concurrency: ``LOCK_LIMITER`` is taken here (``Limiter.take``; a second rate-limiting
    sampler on the node is refused), so this process is the only writer of the limiter's
    words until ``release``; if it dies, writers treat the limit as lifted (as for a dead
    ``SamplerPool``) until a restarted host takes it again at the learner's next call.
    """

    def __init__(self, buffer: ReplayBuffer, limit: RateLimit,
                 report: Report | None = None) -> None:
        self.limiter = buffer.storage.limiter
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
        """Count the cluster's inserts and samples of ``report`` from now on."""
        inserts_elsewhere, samples = report
        self.limiter.set_counts(inserts_elsewhere, samples)

    def release(self) -> None:
        """Lift the limit (writers resume at once) and let the lock go. Idempotent."""
        if self.lease is not None:
            try:
                self.limiter.deactivate()
            finally:
                self.lease.close()
                self.lease = None
