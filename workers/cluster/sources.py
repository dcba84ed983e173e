"""Where a ``ClusterSampler`` gets each node's rows: ``LocalSource`` (a ``SamplerPool`` in the
learner's process over its own node's buffer) and ``RemoteSource`` (the host's pool on another
node, replies of many rows shipped as Ray objects, several calls in flight). ``NodePool`` is
what both run on their node: the pool, plus what its priority table says about the rows.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from shmbuf import ReplayBuffer
from shmbuf.errors import Timeout
from shmbuf.limiter import RateLimit
from shmbuf.priority import PriorityTable
from shmbuf.sampling import Plan

from ..errors import HostRestartedWarning
from ..pool import SamplerPool
from ..selection import Uniform
from .nodes import call_actor, current_node_id, node_alive
from .rate import NodeLimit, Report

_NO_ROWS = np.empty(0, np.int64)
_NO_PRIORITIES = np.empty(0, np.float64)
STALL_S = 20.0  # a call unanswered this long (beyond its own wait) means a host in trouble
COUNTS_EVERY_S = 0.02  # how often a remote node's counts are asked for between its replies
# How often a node judges its window starts again (uniform sequences), and how many anchors
# each time (all of them in a buffer this small): about 1% of a core on a 1M-row node with
# R2D2's windows (80 steps, stride 40: 10 ms a time), 0.4% without a stride.
STARTS_EVERY_S = 1.0
STARTS_DRAWS = 1024
REPORT_EVERY_S = 0.01  # how often a remote node's rate limit is set beside its fetches


class NodePool:
    """A ``SamplerPool`` over a node's buffer and the counts the learner splits batches by;
    with a cluster-wide ``limit``, the ``NodeLimit`` that holds the node's writers to it.

    For a prioritized pool it also reads (never writes) the pool's priority table: each drawn
    row's stored priority ``(p + eps) ** alpha``, the node's total and smallest one, so the
    learner can split by totals and weight rows against the smallest priority of all nodes.
    For a uniform pool with a plan (sequences, stacks, n-step) the split weight is the node's
    window starts (``WindowStarts``), which uniform draws choose among, not its rows.

    Concurrency: the pool's own process (the learner, or the host) is its table's only writer;
    this view loads words of it, as the pool's workers do.
    """

    def __init__(self, buffer: ReplayBuffer | str, pool_kwargs: dict[str, Any],
                 limit: RateLimit | None = None, report: Report | None = None) -> None:
        self.pool = SamplerPool(buffer, **pool_kwargs)
        self.buffer = self.pool.buffer
        self.table: PriorityTable | None = None
        self.limit: NodeLimit | None = None
        self.starts: WindowStarts | None = None
        try:
            own = self.pool._table  # (the pool's; a view of our own reads its totals)
            if own is not None:
                self.table = PriorityTable.attach(own.name)
            plan = pool_kwargs.get("plan")
            if (own is None and isinstance(pool_kwargs.get("selection"), Uniform)
                    and plan is not None and not plan.is_plain):
                self.starts = WindowStarts(self.buffer, plan, pool_kwargs.get("fields"),
                                           pool_kwargs.get("seed"))
            if limit is not None:
                self.limit = NodeLimit(self.buffer, limit, report)
        except BaseException:
            self.close()
            raise

    def report(self, report: Report | None) -> None:
        """The learner's cluster-wide counts, for the node's writers (None: no limit)."""
        if report is not None and self.limit is not None:
            self.limit.apply(report)

    def counts(self) -> dict[str, Any]:
        """Rows held, rows ever committed, the split weight (rows, or total priority) and the
        smallest stored priority (inf for none). New rows enter the priority table first (at
        the maximum priority), as the pool's own ``next()`` would: a node the learner has not
        drawn from lately still shows them."""
        size = len(self.buffer)
        out = {"size": size, "committed": int(np.sum(self.buffer.committed())),
               "weight": float(size), "vmin": np.inf}
        if self.table is not None:
            self.pool.update_priorities(_NO_ROWS, _NO_PRIORITIES, lanes=_NO_ROWS)  # the sync
            out["weight"] = self.table.total()
            out["vmin"] = self.table.smallest()
        elif self.starts is not None:
            out["weight"] = self.starts.count()
        return out

    def next_reply(self, wait: float) -> dict[str, Any]:
        """The pool's next batch as a reply (``rows`` 0 if none came within ``wait``). Its
        arrays are the pool's staging views, valid until the next call."""
        reply: dict[str, Any] = {"rows": 0, "pid": os.getpid()}
        try:
            batch = self.pool.next(timeout=max(wait, 1e-3))
        except Timeout:
            reply.update(self.counts())
            return reply
        reply.update(self.counts())  # after next(): new rows are in the table
        reply.update(rows=batch.batch_size, fields={k: batch[k] for k in batch},
                     indices=batch.indices, lanes=batch.lanes, values=None, epoch=batch.epoch,
                     ends_epoch=batch.ends_epoch, epoch_rows=None)
        if batch.epoch is not None:  # (a node epoch of Epoch(drop_last=False))
            reply["epoch_rows"] = self.pool.epoch_size(batch.epoch)
        if self.table is not None:  # each row's, or each window start's
            starts = batch.indices[:, 0] if batch.indices.ndim == 2 else batch.indices
            reply["values"] = self.table.leaf_values(batch.lanes, starts)
        return reply

    def update_priorities(self, lanes: Any, indices: Any, priorities: Any) -> int:
        return self.pool.update_priorities(indices, priorities, lanes=lanes)

    def close(self, timeout: float = 5.0) -> None:
        if self.limit is not None:  # before the pool, which closes the buffer it attached
            self.limit.release()
            self.limit = None
        if self.table is not None:
            self.table.close()
            self.table = None
        self.pool.close(timeout)


class WindowStarts:
    """How many starts of a plan's windows a node's buffer holds: its anchor rows (each lane's
    readable rows less the tail a whole window needs) times the share of them a batch could
    start at (``PlanReader.start_share``, the pool's own checks). The share is judged again
    every ``STARTS_EVERY_S``, and sooner while the buffer fills (whenever its anchor rows
    have doubled since): exactly while it holds ``STARTS_DRAWS`` anchor rows or fewer, else
    from that many uniform draws, averaged with the last estimate. Between judgements the
    count follows the rows the writers add, at the last share.

    A node whose windows all cross an episode end counts 0 and gets no rows of a batch; split
    by rows it would get them, and its pool would find no start to give.
    """

    def __init__(self, buffer: ReplayBuffer, plan: Plan, fields: list[str] | None,
                 seed: Any) -> None:
        from shmbuf.reader import PlanReader  # (as window_priority: only where plans are read)

        self.reader = PlanReader(buffer.storage, buffer.compile(plan, fields))
        if not isinstance(seed, np.random.SeedSequence):
            seed = np.random.SeedSequence(seed)
        self.rng = np.random.default_rng(seed.spawn(1)[0])  # (after the pool's own children)
        self.share = 0.0
        self.judged_at, self.judged_rows = -np.inf, 0

    def count(self) -> float:
        rows = self.reader.anchor_windows(self.reader.storage.windows()).total
        now = time.monotonic()
        if rows > 2 * self.judged_rows or now - self.judged_at >= STARTS_EVERY_S:
            estimated = self.judged_rows > STARTS_DRAWS
            rows, share = self.reader.start_share(self.rng, STARTS_DRAWS)
            if estimated and rows > STARTS_DRAWS:  # two estimates: average them
                share = 0.5 * (self.share + share)
            self.share, self.judged_at, self.judged_rows = share, now, rows
        return float(rows * self.share)


class Chunk:
    """Rows of one node not yet delivered: field arrays, indices, lanes, stored priorities;
    for epochs, the node epoch they belong to, its size, and whether they end it."""

    __slots__ = ("fields", "indices", "lanes", "values", "offset", "rows", "epoch",
                 "epoch_rows", "ends_epoch")

    def __init__(self, reply: dict[str, Any]) -> None:
        self.fields = reply["fields"]
        self.indices, self.lanes, self.values = reply["indices"], reply["lanes"], reply["values"]
        self.rows = int(reply["rows"])
        self.offset = 0
        self.epoch: int | None = reply.get("epoch")
        self.epoch_rows: int | None = reply.get("epoch_rows")
        self.ends_epoch = bool(reply.get("ends_epoch"))

    def keep(self, mask: np.ndarray) -> None:
        """Only the rows of ``mask`` (copies; the queue drops rows seen before)."""
        self.fields = {k: v[mask] for k, v in self.fields.items()}
        self.indices, self.lanes = self.indices[mask], self.lanes[mask]
        if self.values is not None:
            self.values = self.values[mask]
        self.rows = int(mask.sum())


class NodeLost(Exception):
    """Internal: a remote node cannot supply rows any more."""

    def __init__(self, node_id: str, why: str) -> None:
        super().__init__(why)
        self.node_id = node_id


class LocalSource:
    """The learner's own node: a ``NodePool`` in this process (rows through shared memory)."""

    remote = False
    known = True  # its counts are read live

    def __init__(self, node_id: str, buffer_name: str, pool_kwargs: dict[str, Any],
                 limit: RateLimit | None, report: Callable[[], Report | None]) -> None:
        self.node_id = node_id
        self.report = report
        self.node = NodePool(buffer_name, pool_kwargs, limit, report())
        self.calls = 0
        self.bytes = self.restarts = 0
        self.blocked_s = 0.0  # in the pool's next(): waiting for a batch (or taking one)

    def counts(self) -> dict[str, Any]:
        return self.node.counts()

    def committed(self) -> int:
        return int(np.sum(self.node.buffer.committed()))

    def next_chunk(self, wait: float) -> Chunk | None:
        """The pool's next batch (views, valid until the next call), or None."""
        t0 = time.perf_counter()
        self.node.report(self.report())
        reply = self.node.next_reply(wait)
        self.blocked_s += time.perf_counter() - t0
        if not reply["rows"]:
            return None
        self.calls += 1
        return Chunk(reply)

    def poll(self) -> None:
        self.node.report(self.report())

    def update_priorities(self, lanes: Any, indices: Any, priorities: Any) -> Any:
        return self.node.update_priorities(lanes, indices, priorities)

    def close(self) -> None:
        self.node.close()


class RemoteSource:
    """Another node: its host's pool, ``depth`` calls of ``rows_per_call`` rows in flight."""

    remote = True

    def __init__(self, node_id: str, host: Any, pool_id: str, pool_kwargs: dict[str, Any],
                 depth: int, wait: float, limit: RateLimit | None,
                 report: Callable[[], Report | None]) -> None:
        self.node_id, self.host, self.pool_id = node_id, host, pool_id
        self.pool_kwargs, self.depth, self.wait = pool_kwargs, depth, wait
        self.limit, self.report = limit, report  # every call carries a report (None: no limit)
        self.inflight: deque[Any] = deque()
        self.sent: deque[float] = deque()  # when each call in flight was made
        self.ready: deque[Chunk] = deque()
        self.last: dict[str, Any] = {"size": 0, "committed": 0, "weight": 0.0, "vmin": np.inf}
        self.calls = self.bytes = self.restarts = 0
        self.blocked_s = 0.0  # waiting for the oldest call's reply to arrive
        self.pid: int | None = None
        self.counting: Any = None  # a counts() call in flight
        self.counted = 0.0
        self.reporting: Any = None  # a report() call in flight (one at a time)
        self.reported = 0.0
        self.opened = host.open_pool.remote(pool_id, pool_kwargs, limit, report())

    @property
    def known(self) -> bool:
        """True once the node's counts came in (its pool opened)."""
        return self.pid is not None

    def started(self, info: dict[str, Any]) -> None:
        """The host opened the pool (``info``: its ``open_pool`` answer): start fetching."""
        self.pid = info["pid"]
        self.last.update({k: info[k] for k in self.last})
        self.refill()

    def refill(self) -> None:
        """Keep ``depth`` calls' rows in flight or ready, no more (a node drawn from rarely
        does not pile up replies)."""
        while len(self.inflight) + len(self.ready) < self.depth:
            self.inflight.append(self.host.fetch.remote(self.pool_id, self.wait, self.report()))
            self.sent.append(time.monotonic())

    def counts(self) -> dict[str, Any]:
        return self.last

    def committed(self) -> int:
        return int(self.last["committed"])

    def poll(self) -> None:
        """Take in whatever replies have arrived, without waiting; ask for fresh counts when
        the last ones are older than ``COUNTS_EVERY_S`` (a node not drawn from sends no rows,
        but its counts must still move for the split)."""
        if self.inflight:
            done, _ = ray.wait(list(self.inflight), num_returns=len(self.inflight), timeout=0)
            self.take(set(done))
        now = time.monotonic()
        if self.counting is not None:
            done, _ = ray.wait([self.counting], timeout=0)
            if done:
                ref, self.counting = self.counting, None
                try:
                    c = ray.get(ref, timeout=10.0)
                except ray.exceptions.RayError:  # a dead host: with no fetch in flight to
                    self.recover()  # tell, this is where it is found (restarted, or lost)
                    return
                if c is not None and c.get("pid") == self.pid and "size" in c:
                    self.last.update({k: c[k] for k in self.last})
                    self.counted = now
        elif now - self.counted > COUNTS_EVERY_S and not self.inflight:  # (a reply has them)
            self.counting = self.host.counts.remote(self.pool_id, self.report())
        self.send_report(now)
        self.refill()

    def send_report(self, now: float) -> None:
        """With a limit, set the node's limit now and then by a call of its own, which the
        host runs beside the fetch it is waiting in (a fetch's report was made when the call
        was, a few calls ago). One in flight at a time."""
        if self.limit is None or now - self.reported < REPORT_EVERY_S:
            return
        if self.reporting is not None:
            done, _ = ray.wait([self.reporting], timeout=0)
            if not done:
                return
        self.reported = now
        self.reporting = self.host.report.remote(self.pool_id, self.report())

    def next_chunk(self, wait: float) -> Chunk | None:
        if not self.ready:
            self.refill()
            t0 = time.perf_counter()
            done, _ = ray.wait([self.inflight[0]], timeout=max(wait, 0.0))
            self.blocked_s += time.perf_counter() - t0
            self.take(set(done))
            if not done and time.monotonic() - self.sent[0] > STALL_S + self.wait:
                self.recover()  # a call made while Ray restarted the host can stay unanswered
            self.refill()
        return self.ready.popleft() if self.ready else None

    def take(self, done: set[Any]) -> None:
        """Take in the replies of ``done`` at the head of the calls in flight, in the order the
        calls were made (a queue's rows must stay in order)."""
        while self.inflight and self.inflight[0] in done:
            ref = self.inflight.popleft()
            self.sent.popleft()
            try:
                reply = ray.get(ref, timeout=10.0)  # ready: only deserialised here
            except ray.exceptions.RayError:  # the host died, or the node with its objects
                self.recover()
                return
            if reply.get("missing") or reply["pid"] != self.pid:
                self.recover()  # a restarted host that we had not noticed yet
                return
            self.last.update({k: reply[k] for k in self.last})
            self.counted = time.monotonic()
            if reply["rows"]:
                self.calls += 1
                self.bytes += sum(a.nbytes for a in reply["fields"].values())
                self.ready.append(Chunk(reply))

    def recover(self, timeout: float = 30.0) -> None:
        """The host died (calls in flight failed): if Ray restarted it, open the pool again; if
        the node or the host is gone for good, raise ``NodeLost``."""
        self.inflight.clear()
        self.sent.clear()
        self.counting = self.reporting = None
        if not node_alive(self.node_id):
            raise NodeLost(self.node_id, f"node {self.node_id[:12]} is gone")
        try:
            info = call_actor(self.host.open_pool, self.pool_id, self.pool_kwargs, self.limit,
                              self.report(), timeout=timeout)
        except ray.exceptions.RayError as e:  # dead for good, unschedulable, timed out
            raise NodeLost(self.node_id, f"the host of node {self.node_id[:12]} is gone "
                           f"({type(e).__name__})") from None
        if info["pid"] != self.pid:
            self.restarts += 1
            warnings.warn(HostRestartedWarning(
                f"the host of node {self.node_id[:12]} was restarted by Ray (pid {info['pid']}); "
                f"it re-adopted the node's buffer ({info['size']} rows)"), stacklevel=5)
        self.started(info)

    def update_priorities(self, lanes: Any, indices: Any, priorities: Any) -> Any:
        """Sent to the host (applied there after the fetches already queued); a Ray ref."""
        return self.host.update_priorities.remote(self.pool_id, lanes, indices, priorities)

    def close(self) -> None:
        self.inflight.clear()
        self.sent.clear()
        self.ready.clear()
        try:
            self.host.close_pool.remote(self.pool_id)
        except Exception:  # noqa: BLE001 - the host is gone
            pass


def node_seed(seed: int | None, k: int) -> np.random.SeedSequence:
    """Node k's pool seed: apart from every other node's and from the split's (child 0)."""
    return np.random.SeedSequence(seed).spawn(k + 2)[k + 1]


def make_source(cluster: Any, node: str, pool_id: str, pool_kwargs: dict[str, Any],
                seed: np.random.SeedSequence, depth: int, wait: float,
                limit: RateLimit | None, report: Callable[[], Report | None]) -> Any:
    """A source for ``node``: local for this process's node, remote for the others (a remote
    one's pool is opening: ``ray.get(src.opened)``, then ``src.started(info)``)."""
    kw = dict(pool_kwargs, seed=seed)
    if node == current_node_id():
        return LocalSource(node, cluster.buffer_names[node], kw, limit, report)
    return RemoteSource(node, cluster.hosts[node], pool_id, kw, depth, wait, limit, report)


def open_sources(cluster: Any, sources: list[Any], pool_id: str, pool_kwargs: dict[str, Any],
                 seed: int | None, depth: int, wait: float, timeout: float,
                 limit: RateLimit | None, report: Callable[[int], Report | None]) -> None:
    """Append a source per node of ``cluster`` to ``sources`` (local for this process's node,
    remote for the others, each pool seeded apart) and wait for the hosts' pools to open.
    With a ``limit``, each node's writers are held to it by the counts ``report(k)`` gives for
    node k, sent with every call."""
    for k, node in enumerate(cluster.node_ids):
        sources.append(make_source(cluster, node, pool_id, pool_kwargs, node_seed(seed, k),
                                   depth, wait, limit, functools.partial(report, k)))
    remote = [s for s in sources if s.remote]
    infos = ray.get([s.opened for s in remote], timeout=timeout)
    for src, info in zip(remote, infos):  # every node's counts first: the first reports use them
        src.last.update({k: info[k] for k in src.last})
    for src, info in zip(remote, infos):
        src.started(info)
