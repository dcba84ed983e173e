"""``ClusterSampler``: the learner's batches over the union of every node's rows: uniform or
prioritized (each batch split across nodes by a multinomial draw on the nodes' row counts or
total priorities; rows, or a plan's windows), a queue that delivers every row of every node
exactly once, or epochs that deliver each once per epoch (``epochs.ClusterEpochs``).

Each node supplies rows from a pool over its own buffer (``sources``): the learner's own
node through shared memory, the others gathered on their node and shipped as Ray objects, many
batches' worth per call, several calls in flight.

Each row of a uniform batch comes from node k with probability ``size_k / total`` and is then
drawn uniformly from node k: every row held is equally likely (with a plan: node k's window
starts, ``sources.WindowStarts``, for ``size_k``: every start is; prioritized: node k with
probability ``T_k / T``, then row i with ``p_i / T_k``: ``p_i / T`` in all; the importance
weights use the smallest priority of all nodes). The split uses the counts last reported; rows
prefetched from a node were drawn up to ``prefetch_calls * rows_per_call`` rows earlier. A
batch's rows sit at random positions.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import ray

from shmbuf.checks import positive_int, timeout_seconds
from shmbuf.errors import ClosedError, RateLimitTimeout, ShmbufError, Timeout
from shmbuf.limiter import RateLimit
from shmbuf.sampling import Plan

from ..config import Workers, legacy_options
from ..epochs import one_epoch
from ..errors import NodeLostError, NodeLostWarning
from ..selection import Epoch, Prioritized, Queue, SelectionSpec, Uniform, selection_spec
from .batch import BatchBuffer, ClusterBatch, PriorityRouter, QueueCursors, window_updates
from .epochs import ClusterEpochs
from .rate import Report, RoomShares, cluster_report
from .sources import Chunk, NodeLost, make_source, node_seed, open_sources

CALL_BYTES = 16 << 20  # default rows per remote call: about this many bytes,
CALL_BATCHES = 64  # and at most this many batches' rows
WAIT_S = 0.2  # how long a host waits for rows before answering "none yet"
POLL_EVERY_S = 0.01  # how often next() takes in every node's replies and counts


class ClusterSampler:
    """Batches over the union of all nodes' rows, for a learner on any node.

    Args:
        cluster: the ``ReplayCluster``.
        batch_size: rows per batch.
        selection: ``Uniform()`` (every row held equally likely, the default),
            ``Prioritized(alpha, beta, eps)`` (in proportion to priorities: per-node sum trees,
            ``update_priorities`` routed to each row's node), ``Queue()`` (every row of every
            node delivered exactly once, oldest first per lane, nodes in turn) or
            ``Epoch(drop_last, carry_remainder)`` (every row of every node once per epoch:
            ``epoch()``, ``ClusterEpochs``); the names "uniform", "prioritized", "queue" and
            "epoch" are short for them.
        limit: ``RateLimit(min_size, samples_per_insert, tolerance)`` over the whole cluster:
            sampling waits until the cluster holds ``min_size`` rows; with a ratio, the learner
            waits while its samples run ahead of all nodes' inserts, every node's writers while
            the inserts run ahead (``rate.NodeLimit``).
        plan: ``shmbuf.sampling.Plan``: sequences, frame stacks, n-step returns, read by each
            node's pool (not with ``Queue()``); prioritized sequences keep one priority per
            window start, and ``update_priorities`` takes ``[B]`` or ``[B, T]`` priorities.
        workers: each node's pool's sampler processes (a number or ``Workers(...)``; 0: in the
            host's process); its start method is "forkserver" unless given (Ray processes run
            threads, which ``fork`` must not copy).
        fields: buffer fields to sample (all by default).
        seed: seeds the split and every node's pool.
        timeout: default seconds ``next()`` waits.
        strict: a lost node raises ``NodeLostError`` (default: dropped, ``NodeLostWarning``).
        rows_per_call: rows a remote node ships per Ray call (default: about 16 MiB of rows,
            at least one batch and at most 64; one batch for the queue); also the batch size
            of every node's pool.
        prefetch_calls: calls kept in flight per remote node.

    The keywords of earlier releases (``sampler=``, ``alpha=``, ``beta=``, ``eps=``,
    ``min_size=``, ``samples_per_insert=``, ``workers_per_node=``, ``start_method=``) still
    work for one release, with a ``DeprecationWarning``, as ``SamplerPool``'s do.

    Concurrency: this object is the learner's, used from one thread. Each node's rows come
    through one pool (local, or its host's), so the nodes' seqlocks guard every row as usual.
    """

    def __init__(self, cluster: Any, batch_size: int, *,
                 selection: SelectionSpec | str | None = None, limit: RateLimit | None = None,
                 plan: Plan | None = None, workers: Workers | int | None = None, fields: list[str] | None = None,
                 seed: int | None = None, timeout: float = 60.0, strict: bool = False,
                 rows_per_call: int | None = None, prefetch_calls: int = 3,
                 wait_s: float = WAIT_S, **deprecated: Any) -> None:
        self.batch_size = positive_int("batch_size", batch_size)
        self.timeout = timeout_seconds("timeout", timeout, positive=True)
        spec, limit, plan, workers = _cluster_options(deprecated, selection, limit, plan,
                                                      workers)
        self.selection, self.plan = spec, plan
        self.sampler = _SAMPLER_OF[type(spec)]
        self.min_size = limit.min_size if limit is not None else 1
        self.limit, self.fields, self.rows_per_call, pool_kwargs = _settings(
            cluster.spec, self.batch_size, spec, rows_per_call, fields, limit)
        pool_kwargs.update(workers=workers, timeout=self.timeout, plan=plan)
        self._beta = spec.beta_at  # weights are the learner's: the pools' beta is unused
        self.strict = bool(strict)
        self._cluster = cluster
        self._rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])
        self.pool_id = secrets.token_hex(4)
        self.node_ids, n = list(cluster.node_ids), len(cluster.node_ids)
        self.rows_from = np.zeros(n, np.int64)  # rows delivered, per node
        self._closed = False
        self._held: ClusterBatch | None = None
        self._pending: ClusterBatch | None = None  # taken by epoch(), handed out by next()
        self._sources: list[Any] = []  # None once a node is dropped
        self._shares = RoomShares(self.limit, n) if self.limit is not None else None
        self._opening = (pool_kwargs, seed, positive_int("prefetch_calls", prefetch_calls),
                         wait_s)  # for a node added later (add_node)
        try:
            open_sources(cluster, self._sources, self.pool_id, pool_kwargs, seed,
                         self._opening[2], wait_s, self.timeout, self.limit, self._report)
        except BaseException:
            self.close()
            raise
        self._current: list[Chunk | None] = [None] * n
        self._out = BatchBuffer(self.batch_size)
        self._epochs = (ClusterEpochs(spec.remainder, self._out, self._rng, self.node_ids,
                                      self.min_size, lambda: self._counts()[:, 0],
                                      self._poll_all, self._epoch_chunk)
                        if isinstance(spec, Epoch) else None)
        self._queue = QueueCursors(n, int(getattr(cluster, "lanes_per_node", 1)))
        self._priorities = PriorityRouter(self._sources)
        self.batches = 0
        self.dropped: list[str] = []
        self._turn, self._polled = 0, 0.0  # the queue's next node; when counts were polled
        self._wait_s = 0.0  # blocked in admission (min_size, rate limit) and the queue's polls
        self._next_s = 0.0  # all of next(): the waits plus drawing and copying rows
        self._started = time.monotonic()

    # -- the learner's loop ------------------------------------------------------------------------
    def __iter__(self) -> ClusterSampler:
        return self

    def __next__(self) -> ClusterBatch:
        return self.next()

    def next(self, timeout: float | None = None) -> ClusterBatch:
        """The next batch (the previous one is released). A node found lost on the way (in a
        poll of the nodes' counts, or taking rows) is dropped with a ``NodeLostWarning``.

        Raises:
            Timeout: no batch within ``timeout``; ``RateLimitTimeout`` if the cluster-wide
                rate limit held it back.
            NodeLostError: a node was lost and the sampler is strict.
            ClosedError: the sampler is closed.
        """
        if self._closed:
            raise ClosedError("the ClusterSampler is closed")
        wait = self.timeout if timeout is None else timeout_seconds("timeout", timeout,
                                                                     positive=True)
        if self._pending is not None:  # taken by epoch(), which ended its epoch before it
            batch, self._pending = self._pending, None
            return batch
        if self._held is not None:
            self._held.release()
        t0 = time.perf_counter()
        deadline = time.monotonic() + wait
        if time.monotonic() - self._polled > POLL_EVERY_S:  # counts of nodes not drawn lately
            self._polled = time.monotonic()
            self._poll_all(pause=0.0)
        info = None
        while True:
            try:
                if self.sampler == "queue":
                    self._fill_queue(deadline, wait)
                elif self._epochs is not None:
                    info = self._epochs.fill(deadline, wait)
                    self.rows_from += np.bincount(self._out.nodes[:info[0] or self.batch_size],
                                                  minlength=self.rows_from.size)
                else:
                    self._fill(self._admit(deadline, wait), deadline)
                break
            except NodeLost as e:
                self._drop(self.node_ids.index(e.node_id), str(e))
        if self.sampler == "prioritized":
            self._out.weigh(min(s.counts()["vmin"] for s in self._sources if s is not None),
                            self._beta(self.batches))
        self._next_s += time.perf_counter() - t0
        self.batches += 1
        self._held = self._out.batch(None, info)
        return self._held

    def epoch(self, timeout: float | None = None) -> Iterator[ClusterBatch]:
        """The batches of one epoch (``selection=Epoch(...)``), as ``SamplerPool.epoch``: from
        the next batch to the one that ends its epoch, each valid until the next is taken.

        Raises:
            ShmbufError: the selection is not ``Epoch(...)`` (raised here, not when iterating).
        """
        if self._epochs is None:
            raise ShmbufError(f"epoch() needs cluster.sampler(..., selection=Epoch(...)); this "
                              f"sampler's selection is {self.selection!r}")
        return one_epoch(lambda: self.next(timeout), self._hold)

    def _hold(self, batch: ClusterBatch) -> None:
        self._pending = batch

    def _admit(self, deadline: float, wait: float) -> np.ndarray:
        """Wait until the cluster holds ``min_size`` rows (and the rate limit allows a batch),
        then split the batch: rows per node."""
        while True:
            counts = self._counts()
            sizes, weights = counts[:, 0], counts[:, 2]
            total, inserts = int(sizes.sum()), int(counts[:, 1].sum())
            ok = total >= self.min_size and weights.sum() > 0
            if ok and self.limit is not None and self._shares is not None:
                ok = self.limit.can_sample(inserts, int(self.rows_from.sum()), self.batch_size)
                if ok:
                    self._shares.sampled()
                else:
                    self._shares.held_back(inserts)
            if ok:
                return self._rng.multinomial(self.batch_size, weights / weights.sum())
            if time.monotonic() >= deadline:
                err = RateLimitTimeout if total >= self.min_size else Timeout
                raise err(f"no batch after {wait}s: the cluster holds {total} rows "
                          f"(min_size {self.min_size}), {inserts} inserted, "
                          f"{int(self.rows_from.sum())} sampled; limit {self.limit}")
            self._poll_all()

    def _report(self, k: int) -> Report | None:
        """What node k's writers are held to, sent with every call to it (``rate``): its share
        of the cluster's room (``RoomShares``). Sources not opened yet count no rows."""
        if self._shares is None:
            return None
        committed: list[int | None] = [None if src is None else src.committed()
                                       for src in self._sources]
        samples = int(self.rows_from.sum())
        n = max(len(self.node_ids), k + 1)
        if len(committed) < n or not all(src is None or src.known for src in self._sources):
            # A node whose rows are not known yet (its pool is opening): the plain report,
            # every node may use all of the room; the split starts once every count is in.
            rows = [c or 0 for c in committed] + [0] * (n - len(committed))
            return cluster_report(rows, k, samples)
        self._shares.update(committed, samples)
        return self._shares.report(committed, k, samples)

    def _poll_all(self, pause: float = 0.005) -> None:
        """Take in every node's replies and counts, then sleep ``pause`` s (counted as waiting).
        A node found lost is dropped here (``_drop``), as where rows are taken: ``NodeLost``
        never leaves the sampler."""
        t0 = time.perf_counter()
        for k, src in enumerate(self._sources):
            try:
                if src is not None:
                    src.poll()
            except NodeLost as e:
                self._drop(k, str(e))
        if pause:
            time.sleep(pause)
            self._wait_s += time.perf_counter() - t0

    def _counts(self) -> np.ndarray:
        """``[node, (size, committed, split weight)]``; zeros for dropped nodes."""
        out = np.zeros((len(self._sources), 3))
        for k, src in enumerate(self._sources):
            if src is not None:
                c = src.counts()
                out[k] = c["size"], c["committed"], c["weight"]
        return out

    def _fill(self, counts: np.ndarray, deadline: float) -> None:
        """Copy ``counts[k]`` rows of node k into random positions of the output batch."""
        order = self._rng.permutation(self.batch_size)
        start = 0
        for k in np.flatnonzero(counts):
            n = int(counts[k])
            pos = order[start:start + n]
            start += n
            self._out.nodes[pos] = k
            self._take(int(k), n, pos, deadline)
            self.rows_from[k] += n

    def _chunk(self, k: int, wait: float) -> Chunk | None:
        """Node k's current chunk if it has rows left, else its next one (None: none yet)."""
        chunk = self._current[k]
        if chunk is not None and chunk.offset < chunk.rows:
            return chunk
        self._current[k] = None  # copied out before a local pool reuses its slot
        chunk = self._sources[k].next_chunk(wait)
        if chunk is not None and self.sampler == "queue":
            self._queue.admit(k, chunk)
        self._current[k] = chunk
        return chunk

    def _epoch_chunk(self, k: int, wait: float) -> Chunk | None:
        """For ``ClusterEpochs``: node k's chunk with rows left, or its next (None: none in
        ``wait`` s, or the node is dropped; one found lost here is dropped here)."""
        if self._sources[k] is None:
            return None
        try:
            return self._chunk(k, wait)
        except NodeLost as e:  # dropped where found: the rows already in the batch stay
            self._drop(k, str(e))
            return None

    def _take(self, k: int, n: int, pos: np.ndarray, deadline: float) -> None:
        done = 0
        while done < n:
            chunk = self._chunk(k, min(WAIT_S, deadline - time.monotonic()))
            if chunk is None or not chunk.rows:
                if time.monotonic() >= deadline:
                    raise Timeout(
                        f"node {self.node_ids[k][:12]} holds {self._sources[k].counts()['size']}"
                        f" rows but sent none in time (its host or pool is slow, or stuck)")
                continue
            done += self._out.copy_rows(chunk, pos[done:], n - done)

    # -- the queue -----------------------------------------------------------------------------------
    def _fill_queue(self, deadline: float, wait: float) -> None:
        """Fill the batch with rows as they come, taking nodes in turn. A node lost on the way
        is dropped where it is found: the rows already in the batch stay (each row once)."""
        filled, n = 0, len(self._sources)
        while filled < self.batch_size:
            got = 0
            for k in [(self._turn + j) % n for j in range(n)]:
                if self._sources[k] is None or filled == self.batch_size:
                    continue
                try:
                    chunk = self._chunk(k, 0.0)
                except NodeLost as e:
                    self._drop(k, str(e))
                    continue
                if chunk is not None and chunk.offset < chunk.rows:
                    m = self._out.copy_rows(chunk, np.arange(filled, self.batch_size),
                                            self.batch_size - filled)
                    self._out.nodes[filled:filled + m] = k
                    self.rows_from[k] += m
                    filled, got = filled + m, got + m
            self._turn = (self._turn + 1) % n
            if not got and time.monotonic() >= deadline:
                raise Timeout(f"Queue(): {filled} of {self.batch_size} rows came in "
                              f"{wait}s (rows are delivered once; writers are slower)")
            if not got:
                self._poll_all()

    # -- priorities ----------------------------------------------------------------------------------
    def update_priorities(self, indices: Any, priorities: Any, lanes: Any = None,
                          nodes: Any = None, mask: Any = None) -> int:
        """Set new priorities for rows of a prioritized batch; each goes to its node's pool.

        ``indices``, ``lanes`` and ``nodes`` as in the batch (``lanes`` and ``nodes`` may be
        left out for the current batch's ``indices``). Sequences (``plan=Plan(sequence_length=
        T)``) take a priority per window (``[B]``) or per step (``[B, T]``, reduced here to
        ``eta * max + (1 - eta) * mean`` over the steps ``mask`` keeps, as on one machine).
        Remote nodes apply them after the fetches already in flight; one that refused an
        earlier update raises here. Returns how many were sent.

        Raises:
            InvalidPriorityError: a priority is NaN, infinite or negative (nothing sent).
        """
        if self.sampler != "prioritized":
            raise ValueError("update_priorities() needs selection=Prioritized(...)")
        if lanes is None or nodes is None:
            if indices is not self._out.indices or self._held is None or self._held.released:
                raise ValueError("pass lanes=batch.lanes and nodes=batch.nodes (or the current "
                                 "batch's own indices array)")
            lanes, nodes = self._out.lanes, self._out.nodes
        assert isinstance(self.selection, Prioritized)
        indices, priorities = window_updates(indices, priorities, mask, self.selection.eta)
        return self._priorities.send(indices, priorities, lanes, nodes)

    # -- nodes joining -------------------------------------------------------------------------------
    def add_node(self, node_id: str) -> int:
        """Draw from ``node_id`` too (its host must run: ``ReplayCluster.add_node`` calls this
        for every open sampler); its rows count from the next batch on, on both sides of the
        limit. Returns the node's index in ``node_ids`` (and ``batch.nodes``)."""
        if self._closed:
            raise ClosedError("the ClusterSampler is closed")
        if node_id in self.node_ids and self._sources[self.node_ids.index(node_id)] is not None:
            raise ValueError(f"node {node_id[:12]} is sampled already")
        k = len(self.node_ids)
        pool_kwargs, seed, depth, wait_s = self._opening
        src = make_source(self._cluster, node_id, self.pool_id, pool_kwargs, node_seed(seed, k),
                          depth, wait_s, self.limit, functools.partial(self._report, k))
        try:
            if src.remote:
                src.started(ray.get(src.opened, timeout=self.timeout))
        except BaseException:
            src.close()
            raise
        self.node_ids.append(node_id)
        self._sources.append(src)
        self._current.append(None)
        self.rows_from = np.append(self.rows_from, 0)
        self._queue.add_node()
        if self._epochs is not None:
            self._epochs.add_node()
        return k

    @property
    def closed(self) -> bool:
        return self._closed

    # -- dropping nodes, releasing -------------------------------------------------------------------
    def _drop(self, k: int, why: str) -> None:
        """Stop sampling node k (``node_ids`` keep their order: ``batch.nodes`` stay valid)."""
        node, src = self.node_ids[k], self._sources[k]
        if self.strict:
            raise NodeLostError(f"{why}; the sampler is strict (strict=True), so it stops. "
                                f"Fix: strict=False drops a lost node with a warning")
        warnings.warn(NodeLostWarning(f"{why}: its rows are no longer sampled"), stacklevel=3)
        self._sources[k] = self._current[k] = None
        if self._epochs is not None:
            self._epochs.drop(k)
        if src is not None:
            src.close()
        self.dropped.append(node)
        self._cluster.drop_node(node)
        if all(s is None for s in self._sources):
            raise NodeLostError(f"{why}, and it was the last node of the cluster")

    # -- reporting -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Batches/s, rows per node, node counts, learner wait, remote calls, host restarts
        (from what the nodes last reported: no remote call)."""
        return _stats(self)

    # -- teardown ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the local pool and the hosts' pools of this sampler. Idempotent."""
        if self._closed:
            return
        self._closed = True
        held = self._held
        if held is not None:
            held.release()
        self._current = [None] * len(self._sources)
        for src in self._sources:
            if src is None:
                continue
            try:
                src.close()
            except Exception as e:  # noqa: BLE001 - closing the rest matters more
                warnings.warn(f"closing a node source: {e}", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> ClusterSampler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _stats(s: ClusterSampler) -> dict[str, Any]:
    """``ClusterSampler.stats()``."""
    elapsed = max(time.monotonic() - s._started, 1e-9)
    wait = s._wait_s + sum(src.blocked_s for src in s._sources if src is not None)
    nodes = [{"node_id": node, "local": src is not None and not src.remote,
              "dropped": src is None, "size": int(c[0]), "committed": int(c[1]),
              "weight": float(c[2]), "rows_sampled": int(r),
              "calls": getattr(src, "calls", 0), "bytes_received": getattr(src, "bytes", 0),
              "host_restarts": getattr(src, "restarts", 0)}
             for node, src, c, r in zip(s.node_ids, s._sources, s._counts(), s.rows_from)]
    return {"batches": s.batches, "batches_per_s": s.batches / elapsed,
            "learner_wait_s": wait, "learner_next_s": s._next_s,
            "learner_wait_per_batch_s": wait / max(s.batches, 1),
            "nodes": nodes, "dropped": list(s.dropped), "elapsed_s": elapsed,
            "priority_updates_sent": s._priorities.sent,
            "queue_gaps": s._queue.gaps, "queue_repeats": s._queue.repeats,
            "epoch": s._epochs.epoch if s._epochs is not None else None,
            "epoch_sizes": list(s._epochs.sizes) if s._epochs is not None else [],
            "epoch_rows_dropped": s._epochs.dropped_rows if s._epochs is not None else 0,
            "room_pooled": s._shares.pooled if s._shares is not None else 0}


_SAMPLER_OF = {Uniform: "uniform", Prioritized: "prioritized", Queue: "queue", Epoch: "epoch"}
_CLUSTER_LEGACY = {"sampler", "alpha", "beta", "eps", "min_size", "samples_per_insert",
                   "workers_per_node", "start_method"}


def _cluster_options(given: dict[str, Any], selection: Any, limit: RateLimit | None,
                     plan: Plan | None, workers: Workers | int | None
                     ) -> tuple[SelectionSpec, RateLimit | None, Plan | None, Workers]:
    """The sampler's strategy, limit and per-node workers, from the new arguments and the
    earlier releases' keywords (as ``SamplerPool``'s, ``legacy_options``)."""
    unknown = sorted(set(given) - _CLUSTER_LEGACY)
    if unknown:
        raise TypeError(f"ClusterSampler() got an unexpected keyword argument {unknown[0]!r}")
    legacy = dict(given)
    renamed = {}
    if "workers_per_node" in legacy:
        legacy["n_workers"] = legacy.pop("workers_per_node")
        renamed["n_workers"] = "workers_per_node"  # (the messages say what the caller wrote)
    chosen = legacy_options(legacy, dict(selection=selection, limit=limit, plan=plan,
                                          workers=workers, output="numpy", device=None,
                                          transform=None), who="ClusterSampler",
                            spelled_as=renamed)
    spec = selection_spec(chosen["selection"])
    if type(spec) not in _SAMPLER_OF:
        raise ValueError(f"selection={spec!r}: a cluster samples with Uniform(), "
                         f"Prioritized(...), Queue() or Epoch(...)")
    plan = chosen["plan"]
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan={plan!r}: pass a shmbuf.sampling.Plan (e.g. "
                        f"Plan(sequence_length=80))")
    if isinstance(spec, Queue) and plan is not None and not plan.is_plain:
        raise ValueError(f"plan={plan!r}: Queue() delivers single stored transitions; "
                         f"sequence, frame-stack and n-step plans sample with Uniform(), "
                         f"Prioritized(...) or Epoch(...)")
    workers = chosen["workers"]
    if not isinstance(workers, Workers):  # (one per node by default, not the cores')
        workers = Workers(1 if workers is None else workers)
    if workers.n is None or workers.start_method is None:  # Ray's processes run threads
        workers = dataclasses.replace(workers, n=1 if workers.n is None else workers.n,
                                      start_method=workers.start_method or "forkserver")
    return spec, chosen["limit"], plan, workers


def _settings(spec: Any, batch_size: int, selection: SelectionSpec, rows_per_call: int | None,
              fields: list[str] | None, limit: RateLimit | None
              ) -> tuple[RateLimit | None, list[str], int, dict[str, Any]]:
    """Checked settings: the ratio limit (None without a ratio), the fields, rows per call, and
    the pools' arguments."""
    queue = isinstance(selection, Queue)
    ratio = limit if limit is not None and limit.samples_per_insert is not None else None
    if ratio is not None and queue:
        raise ValueError("Queue() is its own rate limiter: pass limit=RateLimit(min_size=...) "
                         "without samples_per_insert")
    if ratio is not None and isinstance(selection, Epoch):
        raise ValueError("Epoch() on a cluster paces itself by its epochs: pass "
                         "limit=RateLimit(min_size=...) without samples_per_insert")
    if isinstance(selection, Epoch):  # nodes give whole node epochs; the remainder is ours
        selection = Epoch(drop_last=False)
    fields = list(spec) if fields is None else list(fields)
    unknown = [f for f in fields if f not in spec]
    if unknown:
        raise ValueError(f"fields {unknown} are not in the spec ({list(spec)})")
    if rows_per_call is None:
        row_bytes = sum(spec[f].row_nbytes for f in fields)
        rows_per_call = batch_size if queue else max(
            batch_size, min(CALL_BATCHES * batch_size, CALL_BYTES // max(row_bytes, 1)))
    rows_per_call = positive_int("rows_per_call", rows_per_call)
    return ratio, fields, rows_per_call, dict(batch_size=rows_per_call, selection=selection,
                                              fields=fields)
