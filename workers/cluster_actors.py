"""``ClusterActors``: the user's actor function in Ray actors placed on a ``ReplayCluster``'s nodes,
each writing its own lane of its node's buffer, supervised as ``ActorGroup`` supervises local
ones: a killed actor is restarted by Ray, an exception or a death past the budget is reported.
"""

from __future__ import annotations

import traceback
import warnings
from typing import Any, Callable

import cloudpickle  # type: ignore[import-untyped]
import numpy as np
import ray

from shmbuf.checks import timeout_seconds
from shmbuf.errors import ActorError, ClosedError

from .actors import ActorContext
from .cluster_nodes import NodeLostError, NodeLostWarning, node_alive, on_node


class ClusterActorContext(ActorContext):
    """An ``ActorContext`` (``writer``, ``buffer``, ``actor_id``, ``lane``, ``incarnation``,
    ``rng``, ``stopping``) plus ``node_id``; ``stopping`` turns true when the group stops."""

    def __init__(self, runner: ActorRunner, writer: Any, buffer: Any, incarnation: int,
                 seed: np.random.SeedSequence) -> None:
        super().__init__(writer, buffer, runner.actor_id, runner.lane, incarnation, seed,
                         None)  # type: ignore[arg-type]  # no channel: stop comes from Ray
        self.node_id = runner.node_id
        self._runner = runner

    @property
    def stopping(self) -> bool:
        return self._runner.stop_requested


class ActorRunner:
    """The Ray actor around one user actor (two threads: ``run`` and ``stop`` may overlap)."""

    def __init__(self, client: Any, fn_bytes: bytes, actor_id: int, node_id: str, lane: int,
                 entropy: int, lane_timeout: float) -> None:
        self.client, self.fn_bytes = client, fn_bytes
        self.actor_id, self.node_id, self.lane = actor_id, node_id, lane
        self.entropy, self.lane_timeout = entropy, lane_timeout
        self.stop_requested = False

    def pid(self) -> int:
        import os

        return os.getpid()

    def run(self, incarnation: int) -> str:
        """Run the actor function on this node's buffer until it returns; "" or a traceback."""
        try:
            fn = cloudpickle.loads(self.fn_bytes)
            buf = self.client.buffer()
            seed = np.random.SeedSequence(self.entropy, spawn_key=(self.actor_id, incarnation))
            with buf.writer(lane=self.lane, timeout=self.lane_timeout) as writer:
                ctx = ClusterActorContext(self, writer, buf, incarnation, seed)
                writer.stop_when = lambda: ctx.stopping  # a stop also ends a limiter wait
                try:
                    fn(ctx)
                except ClosedError:
                    if not self.stop_requested:
                        raise
        except BaseException:  # noqa: BLE001 - the supervisor reports it
            return traceback.format_exc()
        return ""

    def stop(self) -> None:
        self.stop_requested = True


class _Slot:
    """The supervisor's record of one actor (id, node and lane survive restarts).

    While ``run_ref`` is set the actor runs; after its process died, ``pid_ref`` asks the
    actor for its pid until Ray has restarted it (a new pid: one restart), then it runs again.
    """

    def __init__(self, actor_id: int, node_id: str, lane: int, handle: Any) -> None:
        self.actor_id, self.node_id, self.lane, self.handle = actor_id, node_id, lane, handle
        self.incarnation = 0
        self.run_ref: Any = None
        self.pid_ref: Any = handle.pid.remote()
        self.pid: int | None = None
        self.restarts = 0
        self.finished = False
        self.lost = False

    @property
    def where(self) -> str:
        return f"actor {self.actor_id} (node {self.node_id[:12]}, lane {self.lane})"

    def start(self) -> None:
        self.run_ref = self.handle.run.remote(self.incarnation)


class ClusterActors:
    """Runs ``actor_fn(ctx)`` in ``per_node`` Ray actors on each node of ``cluster``; actor i of
    a node writes lane i of that node's buffer.

    Args:
        cluster: the ``ReplayCluster`` (or its ``ClusterClient``).
        actor_fn: the actor, serialised with cloudpickle; it should return when
            ``ctx.stopping`` turns true.
        per_node: actors per node (at most the cluster's lanes per node).
        nodes: the nodes to run on (default: every node of the cluster).
        max_restarts: per actor: Ray restarts a dead actor process, and an actor that raised
            is run again, up to this many times; past it, ``poll()`` raises ``ActorError``.
        strict: actors on a lost node raise ``NodeLostError`` from ``poll()`` (default: they
            are dropped with a ``NodeLostWarning``).

    Supervision is explicit and never blocks: call ``poll()`` now and then.
    """

    def __init__(self, cluster: Any, actor_fn: Callable[[ClusterActorContext], Any],
                 per_node: int = 1, *, nodes: list[str] | None = None, max_restarts: int = 3,
                 seed: int | None = None, strict: bool = False, lane_timeout: float = 10.0,
                 num_cpus: float = 0) -> None:
        if not callable(actor_fn):
            raise TypeError(f"actor_fn must be callable, got {type(actor_fn).__name__}")
        nodes = list(cluster.node_ids) if nodes is None else list(nodes)
        lanes = getattr(cluster, "lanes_per_node", per_node)
        if isinstance(per_node, bool) or not isinstance(per_node, int) or not 1 <= per_node <= lanes:
            raise ValueError(f"per_node must be an int in [1, {lanes}] (the lanes per node), "
                             f"got {per_node!r}")
        try:
            fn_bytes = cloudpickle.dumps(actor_fn)
        except Exception as e:
            raise TypeError(f"actor_fn cannot be serialised ({type(e).__name__}: {e})") from e
        self.max_restarts, self.strict = max_restarts, strict
        self._stopped = False
        entropy = int(np.random.SeedSequence(seed).entropy)  # type: ignore[arg-type]
        runner = ray.remote(ActorRunner)
        client = cluster.client()
        self._slots: list[_Slot] = []
        for node in nodes:
            for lane in range(per_node):
                actor_id = len(self._slots)
                handle = runner.options(num_cpus=num_cpus, max_restarts=max_restarts,
                                        max_task_retries=0, max_concurrency=2,
                                        **on_node(node)).remote(
                    client, fn_bytes, actor_id, node, lane, entropy, lane_timeout)
                self._slots.append(_Slot(actor_id, node, lane, handle))
        for slot in self._slots:
            slot.start()

    # -- supervision ------------------------------------------------------------------------------
    def poll(self) -> None:
        """Restart actors that died or raised, within their budget. Never blocks.

        Raises:
            ActorError: an actor failed past ``max_restarts`` (with its traceback or cause).
            NodeLostError: a node of actors is gone and the group is strict.
        """
        if self._stopped:
            return
        pending = {}
        for slot in self._slots:
            for ref in (slot.run_ref, slot.pid_ref):
                if ref is not None and not slot.finished:
                    pending[ref] = slot
        if not pending:
            return
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        for ref in done:
            slot = pending[ref]
            if ref is slot.pid_ref:
                self._on_pid(slot)
            elif ref is slot.run_ref:
                self._on_run_end(slot)

    def _on_pid(self, slot: _Slot) -> None:
        try:
            pid = ray.get(slot.pid_ref, timeout=10.0)
        except ray.exceptions.ActorUnavailableError:  # still restarting: ask again
            slot.pid_ref = slot.handle.pid.remote()
            return
        except ray.exceptions.RayError as e:
            slot.pid_ref = None
            self._dead(slot, e)
            return
        slot.pid_ref = None
        if slot.pid is not None and pid != slot.pid:  # Ray restarted the process
            slot.restarts += 1
            slot.incarnation += 1
        slot.pid = pid
        if slot.run_ref is None:
            slot.start()

    def _on_run_end(self, slot: _Slot) -> None:
        try:
            tb = ray.get(slot.run_ref, timeout=10.0)
        except ray.exceptions.ActorUnavailableError:
            tb = None  # the process died (Ray restarts it), or was restarting when called
        except ray.exceptions.RayError as e:
            slot.run_ref = None
            self._dead(slot, e)
            return
        slot.run_ref = None
        if tb is None:
            if slot.pid_ref is None:
                slot.pid_ref = slot.handle.pid.remote()  # runs again once a pid answers
            return
        if tb == "" or self._stopped:
            slot.finished = True
            return
        if slot.restarts >= self.max_restarts:
            slot.finished = True
            raise ActorError(f"{slot.where} raised after {slot.restarts} restarts: {tb}")
        slot.restarts += 1
        slot.incarnation += 1
        slot.start()

    def _dead(self, slot: _Slot, e: Exception) -> None:
        """The actor is dead for good (restarts used up, or its node is gone)."""
        slot.finished = True
        if not node_alive(slot.node_id):
            self._lose(slot, f"{slot.where}: its node is gone")
            return
        raise ActorError(f"{slot.where} died after {slot.restarts} restarts, its last "
                         f"({type(e).__name__}: {str(e)[:300]})")

    def _lose(self, slot: _Slot, why: str) -> None:
        slot.finished = slot.lost = True
        if self.strict:
            raise NodeLostError(f"{why}; strict=True. Fix: strict=False drops it with a warning")
        warnings.warn(NodeLostWarning(f"{why}: it is dropped"), stacklevel=3)

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self._slots)

    @property
    def n_actors(self) -> int:
        return len(self._slots)

    @property
    def lost(self) -> int:
        return sum(s.lost for s in self._slots)

    def pids(self, timeout: float = 10.0) -> list[int | None]:
        """Each actor's current process id (None if unreachable)."""
        out: list[int | None] = []
        for s in self._slots:
            try:
                out.append(ray.get(s.handle.pid.remote(), timeout=timeout))
            except ray.exceptions.RayError:
                out.append(None)
        return out

    def node_of(self, actor_id: int) -> str:
        return self._slots[actor_id].node_id

    def stop(self, timeout: float = 10.0) -> None:
        """Ask every actor to stop, wait up to ``timeout`` for them, then kill them. Idempotent."""
        timeout = timeout_seconds("timeout", timeout)
        if self._stopped:
            return
        self._stopped = True
        for s in self._slots:
            if not s.lost:
                s.handle.stop.remote()
        refs = [s.run_ref for s in self._slots if not s.lost and s.run_ref is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for s in self._slots:
            try:
                ray.kill(s.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def __enter__(self) -> ClusterActors:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
