"""``NodeHost``: the Ray actor of one ``ReplayCluster`` node. It owns that node's replay buffer
(creating it, or re-adopting it after a restart) and the sampler pools that gather the node's
rows for a learner on another node, one reply of many rows per call.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from typing import Any

import numpy as np
import ray

from shmbuf import ReplayBuffer
from shmbuf.errors import SegmentExistsError, SegmentNotFoundError, SpecMismatchError
from shmbuf.limiter import RateLimit
from shmbuf.reclaim import remove_dead_segments
from shmbuf.scan import SegmentInfo, scan
from shmbuf.storage import BufferStorage

from .rate import Report
from .sources import NodePool

ADOPT_WAIT_S = 10.0  # how long a restarted host waits for its dead predecessor's lease to drop
CONTROL = "control"  # the host's second thread: reports only (``NodeHost.report``)


def open_node_buffer(name: str, spec: Any, capacity: int, lanes: int,
                     buffer_kwargs: dict[str, Any]) -> tuple[ReplayBuffer, bool]:
    """The node's buffer: adopted if a dead owner left it in /dev/shm (same spec, capacity and
    lanes), else created. Returns ``(buffer, adopted)``."""
    deadline = time.monotonic() + ADOPT_WAIT_S
    while True:
        try:
            buf = ReplayBuffer(BufferStorage.adopt(name))
        except SegmentNotFoundError:
            return ReplayBuffer.create(spec, capacity, lanes, name, **buffer_kwargs), False
        except SegmentExistsError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)  # the old host is still exiting
            continue
        if (buf.spec != spec or buf.capacity != capacity or buf.lanes != lanes):
            got = (buf.spec, buf.capacity, buf.lanes)
            buf.close()
            raise SpecMismatchError(
                f"segment {name!r} left by a dead host holds spec/capacity/lanes {got}, not "
                f"{(spec, capacity, lanes)}: it was unlinked. Fix: use another cluster name")
        remove_leaked_segments(name)  # the dead host's pools over it
        return buf, True


def _of_prefix(prefix: str, info: SegmentInfo) -> bool:
    """``info`` is a node buffer named with ``prefix``, or a pool's segment over one (a staging
    ring's or priority table's layout names its buffer)."""
    of = info.header.doc.get("buffer") if info.header is not None and \
        isinstance(info.header.doc, dict) else None
    return info.name.startswith(prefix) or (isinstance(of, str) and of.startswith(prefix))


def remove_leaked_segments(prefix: str) -> list[str]:
    """Unlink the dead-owner segments of ``prefix`` in this machine's /dev/shm: node buffers
    named with it, and the staging rings and priority tables of pools over them, each claimed
    first (``shmbuf.reclaim``, the mechanism a restarted learner's pool uses for its buffer)."""
    return list(remove_dead_segments(functools.partial(_of_prefix, prefix)).names)


def sweep_segments(prefix: str, wait_s: float = 0.0) -> tuple[list[str], list[str]]:
    """``remove_leaked_segments(prefix)`` on this machine, again every 0.1 s for up to
    ``wait_s`` while segments of ``prefix`` are left (owners still exiting, e.g. a host that
    ``ray.kill`` was sent to). Returns ``(removed, left)``; run on each node as a Ray task."""
    deadline = time.monotonic() + wait_s
    removed = remove_leaked_segments(prefix)
    while True:
        left = [i.name for i in scan() if _of_prefix(prefix, i)]
        if not left or time.monotonic() >= deadline:
            return removed, left
        time.sleep(0.1)
        removed += remove_leaked_segments(prefix)


class NodeHost:
    """Runs on one Ray node (node affinity): creates or re-adopts the node's ``ReplayBuffer``
    and serves its rows to learners elsewhere, one ``NodePool`` per learner's sampler.

    Concurrency: the actor handles one call at a time (its default concurrency group), so a
    pool's batch is still held when its reply is serialised into the object store (before the
    next call runs); only ``report`` runs beside it, in the ``CONTROL`` group's thread, and
    touches nothing but the node's ``NodeLimit`` (which takes a lock). Writers on the node
    attach to the buffer by name and never talk to the host; if the host dies, they go on
    writing, and its restart re-adopts the segment (``BufferStorage.adopt``) with their rows.
    """

    def __init__(self, name: str, spec: Any, capacity: int, lanes: int,
                 buffer_kwargs: dict[str, Any] | None = None) -> None:
        self.buffer, self.adopted = open_node_buffer(name, spec, capacity, lanes,
                                                     dict(buffer_kwargs or {}))
        self.pools: dict[str, NodePool] = {}

    # -- what the cluster asks ------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Where this host runs and what its buffer holds."""
        buf = self.buffer
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "name": buf.name, "adopted": self.adopted, "size": len(buf),
                "committed": int(np.sum(buf.committed())), "pools": sorted(self.pools)}

    def open_pool(self, pool_id: str, pool_kwargs: dict[str, Any], limit: RateLimit | None = None,
                  report: Report | None = None) -> dict[str, Any]:
        """Start the pool ``pool_id`` (idempotent), holding the node's writers to the cluster's
        ``limit`` from the learner's ``report`` on; its counts, this host's pid and whether the
        buffer was adopted."""
        if pool_id not in self.pools:
            self.pools[pool_id] = NodePool(self.buffer, pool_kwargs, limit, report)
        else:
            self.pools[pool_id].report(report)
        return {**self.pools[pool_id].counts(), "pid": os.getpid(), "adopted": self.adopted}

    def fetch(self, pool_id: str, wait_s: float, report: Report | None = None) -> dict[str, Any]:
        """One batch of the pool's rows (``rows`` 0 if none came within ``wait_s``) with the
        node's counts; the learner's ``report`` first sets the node's rate limit. The arrays are
        the pool's staging views: Ray copies them into the object store when this call returns,
        before the slot can be refilled."""
        pool = self.pools.get(pool_id)
        if pool is None:  # e.g. this host restarted: the learner opens it again
            return {"rows": 0, "missing": True, "pid": os.getpid()}
        pool.report(report)
        return pool.next_reply(wait_s)

    @ray.method(concurrency_group=CONTROL)
    def report(self, pool_id: str, report: Report) -> None:
        """Set the node's rate limit from the learner's ``report`` now, beside a ``fetch`` that
        waits for rows (this method has a thread of its own: ``CONTROL``); a report older
        than one applied already is ignored."""
        pool = self.pools.get(pool_id)
        if pool is not None:
            pool.report(report)

    def counts(self, pool_id: str, report: Report | None = None) -> dict[str, Any]:
        """The pool's node counts (for the split), without rows; ``report`` as in ``fetch``."""
        pool = self.pools.get(pool_id)
        if pool is not None:
            pool.report(report)
        out = {} if pool is None else pool.counts()
        return {**out, "pid": os.getpid()}

    def update_priorities(self, pool_id: str, lanes: Any, indices: Any, priorities: Any) -> int:
        pool = self.pools.get(pool_id)
        return 0 if pool is None else pool.update_priorities(lanes, indices, priorities)

    def close_pool(self, pool_id: str, timeout: float = 5.0) -> None:
        pool = self.pools.pop(pool_id, None)
        if pool is not None:
            pool.close(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Close every pool and the buffer (unlinking it: the node's rows are gone)."""
        for pool_id in list(self.pools):
            self.close_pool(pool_id, timeout)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            self.buffer.close()
