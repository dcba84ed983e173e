"""``ClusterSampler``: the learner's batches over the union of every node's rows: uniform or
prioritized (each batch split across nodes by a multinomial draw on the nodes' row counts or
total priorities), or a queue that delivers every row of every node exactly once.

Each node supplies rows from a pool over its own buffer (``cluster_sources``): the learner's own
node through shared memory, the others gathered on their node and shipped as Ray objects, many
batches' worth per call, several calls in flight.
"""

from __future__ import annotations

import secrets
import time
import warnings
from typing import Any

import numpy as np
import ray

from shmbuf.checks import positive_int, timeout_seconds
from shmbuf.errors import ClosedError, InvalidPriorityError, RateLimitTimeout, Timeout
from shmbuf.limiter import RateLimit

from .batch import Batch
from .cluster_nodes import NodeLostError, NodeLostWarning, current_node_id
from .cluster_sources import Chunk, LocalSource, NodeLost, RemoteSource
from .config import _beta_schedule

CALL_BYTES = 4 << 20  # default rows per remote call: about this many bytes,
CALL_BATCHES = 64  # and at most this many batches' rows
WAIT_S = 0.2  # how long a host waits for rows before answering "none yet"
SAMPLERS = ("uniform", "prioritized", "queue")
POLL_EVERY_S = 0.01  # how often next() takes in every node's replies and counts


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


class ClusterSampler:
    """Batches over the union of all nodes' rows, for a learner on any node.

    Args:
        cluster: the ``ReplayCluster``.
        batch_size: rows per batch.
        sampler: "uniform" (every row held equally likely), "prioritized" (in proportion to
            priorities: per-node sum trees, ``alpha``/``beta``/``eps`` as ``SamplerPool``,
            ``update_priorities`` routed to each row's node) or "queue" (every row of every
            node delivered exactly once, oldest first per lane, nodes in turn).
        rows_per_call: rows a remote node ships per Ray call (default: about 4 MiB of rows,
            at least one batch and at most 64; one batch for the queue); also the batch size
            of every node's pool.
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

    Each row of a uniform batch comes from node k with probability ``size_k / total`` and is
    then drawn uniformly from node k: every row held is equally likely (prioritized: node k
    with probability ``T_k / T``, then row i with ``p_i / T_k``: ``p_i / T`` in all, and the
    importance weights use the smallest priority of all nodes). The split uses the counts last
    reported; rows prefetched from a node were drawn up to ``prefetch_calls * rows_per_call``
    rows earlier. A batch's rows sit at random positions.

    Concurrency: this object is the learner's, used from one thread. Each node's rows come
    through one pool (local, or its host's), so the nodes' seqlocks guard every row as usual.
    """

    def __init__(self, cluster: Any, batch_size: int, *, sampler: str = "uniform",
                 rows_per_call: int | None = None, prefetch_calls: int = 3,
                 workers_per_node: int = 1, min_size: int = 1,
                 samples_per_insert: tuple[float, float] | None = None, seed: int | None = None,
                 timeout: float = 60.0, strict: bool = False, start_method: str = "forkserver",
                 fields: list[str] | None = None, alpha: float = 0.6, beta: Any = 0.4,
                 eps: float = 1e-6, wait_s: float = WAIT_S) -> None:
        self.batch_size = positive_int("batch_size", batch_size)
        self.timeout = timeout_seconds("timeout", timeout, positive=True)
        self.min_size = positive_int("min_size", min_size)
        prefetch_calls = positive_int("prefetch_calls", prefetch_calls)
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        self.sampler = sampler
        self.limit = None
        if samples_per_insert is not None:
            if sampler == "queue":
                raise ValueError("sampler='queue' is its own rate limiter: drop "
                                 "samples_per_insert")
            ratio, tol = samples_per_insert
            self.limit = RateLimit(self.min_size, float(ratio), float(tol))
        self._beta = _beta_schedule(beta)
        spec = cluster.spec
        self.fields = list(spec) if fields is None else list(fields)
        unknown = [f for f in self.fields if f not in spec]
        if unknown:
            raise ValueError(f"fields {unknown} are not in the spec ({list(spec)})")
        if rows_per_call is None:
            row_bytes = sum(spec[f].row_nbytes for f in self.fields)
            rows_per_call = self.batch_size if sampler == "queue" else max(
                self.batch_size, min(CALL_BATCHES * self.batch_size,
                                     CALL_BYTES // max(row_bytes, 1)))
        self.rows_per_call = positive_int("rows_per_call", rows_per_call)
        self.strict = bool(strict)
        self._cluster = cluster
        self._rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])
        seeds = np.random.SeedSequence(seed).spawn(len(cluster.node_ids) + 1)[1:]
        pool_kwargs: dict[str, Any] = dict(
            batch_size=self.rows_per_call, n_workers=workers_per_node, sampler=sampler,
            start_method=start_method, fields=self.fields, timeout=self.timeout)
        if sampler == "prioritized":  # weights are the learner's: the pools' beta is unused
            pool_kwargs.update(alpha=alpha, eps=eps)
        self.pool_id = secrets.token_hex(4)
        here = current_node_id()
        self.node_ids: list[str] = []
        self._sources: list[Any] = []  # None once a node is dropped
        self._closed = False
        self._held: ClusterBatch | None = None
        try:
            for node, seed_k in zip(cluster.node_ids, seeds):
                kw = dict(pool_kwargs, seed=seed_k)
                if node == here:
                    src: Any = LocalSource(node, cluster.buffer_names[node], kw)
                else:
                    src = RemoteSource(node, cluster.hosts[node], self.pool_id, kw,
                                       prefetch_calls, wait_s)
                self.node_ids.append(node)
                self._sources.append(src)
            remote = [s for s in self._sources if s is not None and s.remote]
            for src, info in zip(remote, ray.get([s.opened for s in remote],
                                                 timeout=self.timeout)):
                src.started(info)
        except BaseException:
            self.close()
            raise
        n = len(self._sources)
        self._current: list[Chunk | None] = [None] * n
        self._out = {f: np.empty((self.batch_size, *spec[f].shape), spec[f].dtype)
                     for f in self.fields}
        self._indices = np.empty(self.batch_size, np.int64)
        self._lanes = np.empty(self.batch_size, np.int64)
        self._values = np.ones(self.batch_size, np.float64)
        self._weights = np.ones(self.batch_size, np.float32)
        self._nodes = np.zeros(self.batch_size, np.int16)
        self._next_index = np.zeros((n, cluster_lanes(cluster)), np.int64)  # queue: per lane
        self.queue_gaps = 0  # queue rows never seen (written over while a host was down)
        self.queue_repeats = 0  # queue rows seen again (resent by a restarted host), dropped
        self.rows_from = np.zeros(n, np.int64)
        self.batches = 0
        self.dropped: list[str] = []
        self._turn = 0
        self._polled = 0.0
        self._prio_refs: list[Any] = []
        self._prio_sent = 0
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
        if time.monotonic() - self._polled > POLL_EVERY_S:  # counts of nodes not drawn lately
            self._polled = time.monotonic()
            for src in self._sources:
                if src is not None:
                    src.poll()
        while True:
            try:
                if self.sampler == "queue":
                    self._fill_queue(deadline, wait)
                else:
                    self._fill(self._admit(deadline, wait), deadline)
                break
            except NodeLost as e:
                self._drop(self.node_ids.index(e.node_id), str(e))
        if self.sampler == "prioritized":
            vmin = min(s.counts()["vmin"] for s in self._sources if s is not None)
            beta = self._beta(self.batches)
            np.power(self._values / vmin, -beta, out=self._values)
            self._weights[...] = self._values
        self._next_s += time.perf_counter() - t0
        self.batches += 1
        batch = ClusterBatch(dict(self._out), self._indices, self._lanes, self._weights,
                             self._nodes, self._release)
        self._held = batch
        return batch

    def _admit(self, deadline: float, wait: float) -> np.ndarray:
        """Wait until the cluster holds ``min_size`` rows (and the rate limit allows a batch),
        then split the batch: rows per node."""
        while True:
            counts = self._counts()
            sizes, weights = counts[:, 0], counts[:, 2]
            total, inserts = int(sizes.sum()), int(counts[:, 1].sum())
            ok = total >= self.min_size and weights.sum() > 0
            if ok and self.limit is not None:
                ok = self.limit.can_sample(inserts, int(self.rows_from.sum()), self.batch_size)
            if ok:
                return self._rng.multinomial(self.batch_size, weights / weights.sum())
            if time.monotonic() >= deadline:
                err = RateLimitTimeout if total >= self.min_size else Timeout
                raise err(f"no batch after {wait}s: the cluster holds {total} rows "
                          f"(min_size {self.min_size}), {inserts} inserted, "
                          f"{int(self.rows_from.sum())} sampled; limit {self.limit}")
            self._poll_all()

    def _poll_all(self) -> None:
        t0 = time.perf_counter()
        for src in self._sources:
            if src is not None:
                src.poll()
        time.sleep(0.005)
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
            self._nodes[pos] = k
            self._take(int(k), n, pos, deadline)
            self.rows_from[k] += n

    def _chunk(self, k: int, wait: float) -> Chunk | None:
        """Node k's current chunk if it has rows left, else its next one (None: none yet)."""
        chunk = self._current[k]
        if chunk is not None and chunk.offset < chunk.rows:
            return chunk
        self._current[k] = None  # copied out before a local pool reuses its slot
        t0 = time.perf_counter()
        chunk = self._sources[k].next_chunk(wait)
        self._wait_s += time.perf_counter() - t0
        if chunk is not None and self.sampler == "queue":
            self._seen_once(k, chunk)
        self._current[k] = chunk
        return chunk

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
            done += self._copy(chunk, pos[done:], n - done)

    def _copy(self, chunk: Chunk, pos: Any, want: int) -> int:
        """Copy up to ``want`` rows of ``chunk`` to output positions ``pos``; how many."""
        m = min(want, chunk.rows - chunk.offset)
        a, p = chunk.offset, pos[:m]
        for f, out in self._out.items():
            out[p] = chunk.fields[f][a:a + m]
        self._indices[p] = chunk.indices[a:a + m]
        self._lanes[p] = chunk.lanes[a:a + m]
        if chunk.values is not None:
            self._values[p] = chunk.values[a:a + m]
        chunk.offset += m
        return m

    # -- the queue -----------------------------------------------------------------------------------
    def _fill_queue(self, deadline: float, wait: float) -> None:
        """Fill the batch with rows as they come, taking nodes in turn."""
        filled, n = 0, len(self._sources)
        while filled < self.batch_size:
            progress = False
            for j in range(n):
                k = (self._turn + j) % n
                if self._sources[k] is None:
                    continue
                chunk = self._chunk(k, 0.0)
                if chunk is None or chunk.offset >= chunk.rows:
                    continue
                m = self._copy(chunk, np.arange(filled, self.batch_size), self.batch_size - filled)
                self._nodes[filled:filled + m] = k
                self.rows_from[k] += m
                filled += m
                progress = True
                if filled == self.batch_size:
                    break
            self._turn = (self._turn + 1) % n
            if not progress:
                if time.monotonic() >= deadline:
                    raise Timeout(f"sampler='queue': {filled} of {self.batch_size} rows came "
                                  f"in {wait}s (rows are delivered once; writers are slower)")
                self._poll_all()

    def _seen_once(self, k: int, chunk: Chunk) -> None:
        """Drop rows of node k seen before (a restarted host starts its queue again at the
        oldest rows held); count rows skipped over (written over while it was down)."""
        nxt = self._next_index[k]
        keep = chunk.indices >= nxt[chunk.lanes]
        if not keep.all():
            self.queue_repeats += int((~keep).sum())
            chunk.keep(keep)
        for lane in np.unique(chunk.lanes):
            idx = chunk.indices[chunk.lanes == lane]
            self.queue_gaps += int(idx.min() - nxt[lane]) if nxt[lane] else 0
            nxt[lane] = idx.max() + 1

    # -- priorities ----------------------------------------------------------------------------------
    def update_priorities(self, indices: Any, priorities: Any, lanes: Any = None,
                          nodes: Any = None) -> int:
        """Set new priorities for rows of a prioritized batch; each goes to its node's pool.

        ``indices``, ``lanes`` and ``nodes`` as in the batch (``lanes`` and ``nodes`` may be
        left out for the current batch's ``indices``). Remote nodes apply them after the
        fetches already in flight. Returns how many were sent.

        Raises:
            InvalidPriorityError: a priority is NaN, infinite or negative (nothing sent).
        """
        if self.sampler != "prioritized":
            raise ValueError("update_priorities() needs sampler='prioritized'")
        if lanes is None or nodes is None:
            if indices is not self._indices or self._held is None:
                raise ValueError("pass lanes=batch.lanes and nodes=batch.nodes (or the current "
                                 "batch's own indices array)")
            lanes, nodes = self._lanes, self._nodes
        idx = np.asarray(_host(indices), np.int64).reshape(-1)
        prio = np.asarray(_host(priorities), np.float64).reshape(-1)
        ln = np.asarray(_host(lanes), np.int64).reshape(-1)
        nd = np.asarray(_host(nodes), np.int64).reshape(-1)
        if not (idx.size == prio.size == ln.size == nd.size):
            raise ValueError(f"indices, priorities, lanes and nodes differ in length: "
                             f"{idx.size}, {prio.size}, {ln.size}, {nd.size}")
        if not np.isfinite(prio).all() or (prio < 0).any():
            raise InvalidPriorityError("priorities must be finite and >= 0; nothing was sent")
        self._collect_updates()
        for k in np.unique(nd):
            src = self._sources[int(k)]
            if src is None:
                continue
            m = nd == k
            out = src.update_priorities(ln[m], idx[m], prio[m])
            if src.remote:
                self._prio_refs.append(out)
            self._prio_sent += int(m.sum())
        return int(idx.size)

    def _collect_updates(self) -> None:
        """Raise a remote node's refusal of an earlier update here (and forget done ones)."""
        if not self._prio_refs:
            return
        done, self._prio_refs = ray.wait(self._prio_refs, num_returns=len(self._prio_refs),
                                         timeout=0)
        for ref in done:
            try:
                ray.get(ref, timeout=10.0)
            except ray.exceptions.RayTaskError as e:
                raise e.as_instanceof_cause() from None
            except ray.exceptions.RayError:
                pass  # the host died: its node's priorities are gone with it

    # -- dropping nodes, releasing -------------------------------------------------------------------
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
        """Batches/s, rows per node, node counts, learner wait, remote calls, host restarts."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        counts = self._counts()
        nodes = []
        for k, (node, src) in enumerate(zip(self.node_ids, self._sources)):
            nodes.append({"node_id": node, "local": src is not None and not src.remote,
                          "dropped": src is None, "size": int(counts[k, 0]),
                          "committed": int(counts[k, 1]), "weight": float(counts[k, 2]),
                          "rows_sampled": int(self.rows_from[k]),
                          "calls": getattr(src, "calls", 0),
                          "bytes_received": getattr(src, "bytes", 0),
                          "host_restarts": getattr(src, "restarts", 0)})
        return {"batches": self.batches, "batches_per_s": self.batches / elapsed,
                "learner_wait_s": self._wait_s, "learner_next_s": self._next_s,
                "learner_wait_per_batch_s": self._wait_s / max(self.batches, 1),
                "nodes": nodes, "dropped": list(self.dropped), "elapsed_s": elapsed,
                "priority_updates_sent": self._prio_sent, "queue_gaps": self.queue_gaps,
                "queue_repeats": self.queue_repeats}

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


def cluster_lanes(cluster: Any) -> int:
    return int(getattr(cluster, "lanes_per_node", 1))


def _host(value: Any) -> Any:
    """NumPy for priority updates: torch tensors (also on a device) come to the host."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu().numpy()
    return value
