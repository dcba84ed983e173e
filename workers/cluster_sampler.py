"""``ClusterSampler``: the learner's batches, drawn uniformly over the union of every node's rows.

Each batch is split across nodes by a multinomial draw on the nodes' row counts; each node
supplies its share from a stream of rows drawn uniformly from its own buffer: the learner's own
node through a local ``SamplerPool`` (shared memory), the others gathered on their node by its
host's pool and shipped as Ray objects, many batches' worth per call, several calls in flight.
"""

from __future__ import annotations

import secrets
import time
import warnings
from collections import deque
from typing import Any

import numpy as np
import ray

from shmbuf.checks import positive_int, timeout_seconds
from shmbuf.errors import ClosedError, RateLimitTimeout, Timeout
from shmbuf.limiter import RateLimit

from .batch import Batch
from .cluster_nodes import (
    HostRestartedWarning,
    NodeLostError,
    NodeLostWarning,
    call_actor,
    current_node_id,
    node_alive,
)
from .pool import SamplerPool

CALL_BYTES = 4 << 20  # default rows per remote call: about this many bytes,
CALL_BATCHES = 64  # and at most this many batches' rows
WAIT_S = 0.2  # how long a host waits for rows before answering "none yet"


class ClusterBatch(Batch):
    """A ``Batch`` assembled from several nodes; ``nodes[i]`` is the index (into
    ``sampler.node_ids``) of the node row i came from. Valid until the next batch."""

    __slots__ = ("_nodes",)

    def __init__(self, data: dict[str, Any], indices: Any, lanes: Any, weights: Any,
                 nodes: np.ndarray, release_fn: Any) -> None:
        super().__init__(data, indices, lanes, weights, release_fn)
        self._nodes = nodes

    @property
    def nodes(self) -> np.ndarray:
        self._check()
        return self._nodes

    def copy(self) -> dict[str, Any]:
        out = super().copy()
        out["nodes"] = self._nodes.copy()
        return out


class Chunk:
    """Rows of one node not yet delivered: field arrays plus indices, lanes, weights."""

    __slots__ = ("fields", "indices", "lanes", "weights", "offset", "rows")

    def __init__(self, reply: dict[str, Any]) -> None:
        self.fields = reply["fields"]
        self.indices, self.lanes, self.weights = reply["indices"], reply["lanes"], reply["weights"]
        self.rows = int(reply["rows"])
        self.offset = 0


class NodeLost(Exception):
    """Internal: a remote node cannot supply rows any more."""

    def __init__(self, node_id: str, why: str) -> None:
        super().__init__(why)
        self.node_id = node_id


class LocalSource:
    """The learner's own node: a ``SamplerPool`` over the node's buffer, in this process."""

    remote = False

    def __init__(self, buffer_name: str, pool_kwargs: dict[str, Any]) -> None:
        self.pool = SamplerPool(buffer_name, **pool_kwargs)
        self.buffer = self.pool.buffer
        self.calls = 0

    def counts(self) -> tuple[int, int]:
        return len(self.buffer), int(np.sum(self.buffer.committed()))

    def next_chunk(self, wait: float) -> Chunk | None:
        """The next batch of the local pool (views, valid until the next call), or None."""
        try:
            batch = self.pool.next(timeout=max(wait, 1e-3))
        except Timeout:
            return None
        self.calls += 1
        return Chunk({"fields": {k: batch[k] for k in batch}, "indices": batch.indices,
                      "lanes": batch.lanes, "weights": batch.weights, "rows": batch.batch_size})

    def poll(self) -> None:
        pass

    def close(self) -> None:
        self.pool.close()


class RemoteSource:
    """Another node: its host's pool, ``depth`` calls of ``rows_per_call`` rows in flight."""

    remote = True

    def __init__(self, node_id: str, host: Any, pool_id: str, pool_kwargs: dict[str, Any],
                 depth: int, wait: float) -> None:
        self.node_id, self.host, self.pool_id = node_id, host, pool_id
        self.pool_kwargs, self.depth, self.wait = pool_kwargs, depth, wait
        self.inflight: deque[Any] = deque()
        self.ready: deque[Chunk] = deque()
        self.size = self.committed = 0
        self.calls = self.bytes = self.restarts = 0
        self.pid: int | None = None
        self.opened = host.open_pool.remote(pool_id, pool_kwargs)  # the sampler waits for it

    def refill(self) -> None:
        while len(self.inflight) < self.depth:
            self.inflight.append(self.host.fetch.remote(self.pool_id, self.wait))

    def counts(self) -> tuple[int, int]:
        return self.size, self.committed

    def poll(self) -> None:
        """Take in whatever replies have arrived, without waiting."""
        if self.inflight:
            done, _ = ray.wait(list(self.inflight), num_returns=len(self.inflight), timeout=0)
            for ref in done:
                self.inflight.remove(ref)
                self.take_reply(ref, 0.0)
        self.refill()

    def next_chunk(self, wait: float) -> Chunk | None:
        if not self.ready:
            self.refill()
            done, _ = ray.wait(list(self.inflight), num_returns=1, timeout=max(wait, 0.0))
            for ref in done:
                self.inflight.remove(ref)
                self.take_reply(ref, 0.0)
            self.refill()
        return self.ready.popleft() if self.ready else None

    def take_reply(self, ref: Any, wait: float) -> None:
        try:
            reply = ray.get(ref, timeout=max(wait, 1.0))
        except ray.exceptions.RayError:  # the host died, or the node with its objects
            self.recover()
            return
        self.size, self.committed = reply["size"], reply["committed"]
        if self.pid is not None and reply["pid"] != self.pid:
            self.restarted()
        self.pid = reply["pid"]
        if reply.get("missing"):
            self.host.open_pool.remote(self.pool_id, self.pool_kwargs)
        if reply["rows"]:
            self.calls += 1
            self.bytes += sum(a.nbytes for a in reply["fields"].values())
            self.ready.append(Chunk(reply))

    def recover(self, timeout: float = 30.0) -> None:
        """The host died while calls were in flight: if Ray restarts it, reopen the pool; if
        the node or the host is gone for good, raise ``NodeLost``."""
        self.inflight.clear()
        if not node_alive(self.node_id):
            raise NodeLost(self.node_id, f"node {self.node_id[:12]} is gone")
        try:
            info = call_actor(self.host.open_pool, self.pool_id, self.pool_kwargs,
                              timeout=timeout)
        except ray.exceptions.RayError as e:  # dead for good, unschedulable, timed out
            raise NodeLost(self.node_id, f"the host of node {self.node_id[:12]} is gone "
                           f"({type(e).__name__})") from None
        self.pid = info["pid"]
        self.size, self.committed = info["size"], info["committed"]
        self.restarted()

    def restarted(self) -> None:
        self.restarts += 1
        warnings.warn(HostRestartedWarning(
            f"the host of node {self.node_id[:12]} was restarted by Ray (pid {self.pid}); "
            f"it re-adopted the node's buffer ({self.size} rows)"), stacklevel=4)

    def close(self) -> None:
        self.inflight.clear()
        self.ready.clear()
        try:
            self.host.close_pool.remote(self.pool_id)
        except Exception:  # noqa: BLE001 - the host is gone
            pass


class ClusterSampler:
    """Batches drawn uniformly over the union of all nodes' rows, for a learner on any node.

    Args:
        cluster: the ``ReplayCluster``.
        batch_size: rows per batch.
        rows_per_call: rows a remote node ships per Ray call (default: about 4 MiB of rows,
            at least one batch and at most 64); also the batch size of every node's pool.
        prefetch_calls: calls kept in flight per remote node.
        workers_per_node: sampler processes of each node's pool (0: in the host's process).
        min_size: sampling waits until the cluster holds this many rows in all.
        samples_per_insert: ``(ratio, tolerance)`` over the whole cluster: the learner waits
            while rows delivered exceed ``ratio`` times rows inserted on all nodes (plus
            ``min_size * ratio + tolerance``).
        seed: seeds the split and every node's pool.
        timeout: default seconds ``next()`` waits.
        strict: a lost node raises ``NodeLostError`` (default: dropped, ``NodeLostWarning``).
        start_method: of the pools' workers ("forkserver" by default: Ray processes run
            threads, which ``fork`` must not copy).

    Rows of one node are drawn uniformly from it, and each row of a batch comes from node k with
    probability ``size_k / total``: every row held is equally likely. The split uses the row
    counts last reported; rows prefetched from a node were drawn up to
    ``prefetch_calls * rows_per_call`` rows earlier.

    Concurrency: this object is the learner's, used from one thread. Each node's rows come
    through one pool (local, or its host's), so the nodes' seqlocks guard every row as usual.
    """

    def __init__(self, cluster: Any, batch_size: int, *, rows_per_call: int | None = None,
                 prefetch_calls: int = 3, workers_per_node: int = 1, min_size: int = 1,
                 samples_per_insert: tuple[float, float] | None = None, seed: int | None = None,
                 timeout: float = 60.0, strict: bool = False, start_method: str = "forkserver",
                 fields: list[str] | None = None, wait_s: float = WAIT_S) -> None:
        self.batch_size = positive_int("batch_size", batch_size)
        self.timeout = timeout_seconds("timeout", timeout, positive=True)
        self.min_size = positive_int("min_size", min_size)
        prefetch_calls = positive_int("prefetch_calls", prefetch_calls)
        self.limit = None
        if samples_per_insert is not None:
            ratio, tol = samples_per_insert
            self.limit = RateLimit(self.min_size, float(ratio), float(tol))
        spec = cluster.spec
        self.fields = list(spec) if fields is None else list(fields)
        unknown = [f for f in self.fields if f not in spec]
        if unknown:
            raise ValueError(f"fields {unknown} are not in the spec ({list(spec)})")
        if rows_per_call is None:
            row_bytes = sum(spec[f].row_nbytes for f in self.fields)
            rows_per_call = max(self.batch_size, min(CALL_BATCHES * self.batch_size,
                                                     CALL_BYTES // max(row_bytes, 1)))
        self.rows_per_call = positive_int("rows_per_call", rows_per_call)
        self.strict = bool(strict)
        self._cluster = cluster
        self._rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])
        seeds = np.random.SeedSequence(seed).spawn(len(cluster.node_ids) + 1)[1:]
        pool_kwargs = dict(batch_size=self.rows_per_call, n_workers=workers_per_node,
                           start_method=start_method, fields=self.fields, timeout=self.timeout)
        self.pool_id = secrets.token_hex(4)
        here = current_node_id()
        self.node_ids: list[str] = []
        self._sources: list[Any] = []  # None once a node is dropped
        self._closed = False
        try:
            for node, seed_k in zip(cluster.node_ids, seeds):
                kw = dict(pool_kwargs, seed=seed_k)
                if node == here:
                    src: Any = LocalSource(cluster.buffer_names[node], kw)
                else:
                    src = RemoteSource(node, cluster.hosts[node], self.pool_id, kw,
                                       prefetch_calls, wait_s)
                self.node_ids.append(node)
                self._sources.append(src)
            remote = [s for s in self._sources if s is not None and s.remote]
            infos = ray.get([s.opened for s in remote], timeout=self.timeout)
            for src, info in zip(remote, infos):
                src.pid, src.size, src.committed = info["pid"], info["size"], info["committed"]
                src.refill()
        except BaseException:
            self.close()
            raise
        self._current: list[Chunk | None] = [None] * len(self._sources)
        self._out = {f: np.empty((self.batch_size, *spec[f].shape), spec[f].dtype)
                     for f in self.fields}
        self._indices = np.empty(self.batch_size, np.int64)
        self._lanes = np.empty(self.batch_size, np.int64)
        self._weights = np.ones(self.batch_size, np.float32)
        self._held: ClusterBatch | None = None
        self.rows_from = np.zeros(len(self._sources), np.int64)
        self.batches = 0
        self.dropped: list[str] = []
        self._wait_s = 0.0  # blocked for rows: pool waits, Ray waits and gets, admission
        self._next_s = 0.0  # all of next(): the waits plus drawing and copying rows
        self._started = time.monotonic()

    # -- the learner's loop ------------------------------------------------------------------------
    def __iter__(self) -> ClusterSampler:
        return self

    def __next__(self) -> ClusterBatch:
        return self.next()

    def next(self, timeout: float | None = None) -> ClusterBatch:
        """The next batch (the previous one is released).

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
        if self._held is not None:
            self._held.release()
        t0 = time.perf_counter()
        deadline = time.monotonic() + wait
        while True:
            try:
                counts = self._admit(deadline, wait)
                nodes = self._fill(counts, deadline)
                break
            except NodeLost as e:
                self._drop(self.node_ids.index(e.node_id), str(e))
        self._next_s += time.perf_counter() - t0
        self.batches += 1
        batch = ClusterBatch(dict(self._out), self._indices, self._lanes, self._weights, nodes,
                             self._release)
        self._held = batch
        return batch

    def _admit(self, deadline: float, wait: float) -> np.ndarray:
        """Wait until the cluster holds ``min_size`` rows (and the rate limit allows a batch),
        then split the batch: rows per node."""
        while True:
            sizes, committed = self._counts()
            total = int(sizes.sum())
            inserts = int(committed.sum())
            ok = total >= self.min_size and total > 0
            if ok and self.limit is not None:
                ok = self.limit.can_sample(inserts, int(self.rows_from.sum()), self.batch_size)
            if ok:
                return self._rng.multinomial(self.batch_size, sizes / total)
            if time.monotonic() >= deadline:
                err = RateLimitTimeout if total >= self.min_size else Timeout
                raise err(f"no batch after {wait}s: the cluster holds {total} rows "
                          f"(min_size {self.min_size}), {inserts} inserted, "
                          f"{int(self.rows_from.sum())} sampled; limit {self.limit}")
            for src in self._sources:
                if src is not None:
                    src.poll()
            t0 = time.perf_counter()
            time.sleep(0.005)
            self._wait_s += time.perf_counter() - t0

    def _counts(self) -> tuple[np.ndarray, np.ndarray]:
        c = np.array([(0, 0) if src is None else src.counts() for src in self._sources],
                     np.int64).reshape(-1, 2)
        return c[:, 0], c[:, 1]

    def _fill(self, counts: np.ndarray, deadline: float) -> np.ndarray:
        """Copy ``counts[k]`` rows of node k into random positions of the output batch."""
        order = self._rng.permutation(self.batch_size)
        nodes = np.empty(self.batch_size, np.int16)
        start = 0
        for k in np.flatnonzero(counts):
            n = int(counts[k])
            pos = order[start:start + n]
            start += n
            nodes[pos] = k
            self._take(int(k), n, pos, deadline)
            self.rows_from[k] += n
        return nodes

    def _take(self, k: int, n: int, pos: np.ndarray, deadline: float) -> None:
        src, out = self._sources[k], self._out
        assert src is not None  # a dropped node has no rows to draw
        done = 0
        while done < n:
            chunk = self._current[k]
            if chunk is None or chunk.offset >= chunk.rows:
                self._current[k] = None  # copied out before a local pool reuses its slot
                t0 = time.perf_counter()
                chunk = src.next_chunk(min(WAIT_S, deadline - time.monotonic()))
                self._wait_s += time.perf_counter() - t0
                if chunk is None:
                    if time.monotonic() >= deadline:
                        raise Timeout(
                            f"node {self.node_ids[k][:12]} holds {src.counts()[0]} rows but "
                            f"sent none in time (its host or pool is slow, or stuck)")
                    continue
                self._current[k] = chunk
            m = min(n - done, chunk.rows - chunk.offset)
            a, p = chunk.offset, pos[done:done + m]
            for f in self.fields:
                out[f][p] = chunk.fields[f][a:a + m]
            self._indices[p] = chunk.indices[a:a + m]
            self._lanes[p] = chunk.lanes[a:a + m]
            chunk.offset += m
            done += m

    def _release(self, batch: Batch) -> None:
        if self._held is batch:
            self._held = None

    def _drop(self, k: int, why: str) -> None:
        """Stop sampling node k (``node_ids`` keep their order: ``batch.nodes`` stay valid)."""
        node, src = self.node_ids[k], self._sources[k]
        if self.strict:
            raise NodeLostError(f"{why}; the sampler is strict (strict=True), so it stops. "
                                f"Fix: strict=False drops a lost node with a warning")
        warnings.warn(NodeLostWarning(f"{why}: its rows are no longer sampled"), stacklevel=3)
        self._sources[k] = self._current[k] = None
        if src is not None:
            src.close()
        self.dropped.append(node)
        self._cluster.drop_node(node)
        if all(s is None for s in self._sources):
            raise NodeLostError(f"{why}, and it was the last node of the cluster")

    # -- reporting -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Batches/s, rows per node, node sizes, learner wait, remote calls, host restarts."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        sizes, committed = self._counts()
        return {
            "batches": self.batches,
            "batches_per_s": self.batches / elapsed,
            "learner_wait_s": self._wait_s,
            "learner_wait_per_batch_s": self._wait_s / max(self.batches, 1),
            "learner_next_s": self._next_s,
            "nodes": [
                {"node_id": node, "local": src is not None and not src.remote,
                 "dropped": src is None, "size": int(s), "committed": int(c),
                 "rows_sampled": int(r), "calls": getattr(src, "calls", 0),
                 "bytes_received": getattr(src, "bytes", 0),
                 "host_restarts": getattr(src, "restarts", 0)}
                for node, src, s, c, r in zip(self.node_ids, self._sources, sizes, committed,
                                              self.rows_from)
            ],
            "dropped": list(self.dropped),
            "elapsed_s": elapsed,
        }

    # -- teardown ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the local pool and the hosts' pools of this sampler. Idempotent."""
        if self._closed:
            return
        self._closed = True
        held = getattr(self, "_held", None)
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
