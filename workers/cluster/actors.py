"""``ClusterActors``: the user's actor function in Ray actors placed on a ``ReplayCluster``'s nodes,
each writing its own lane of its node's buffer, supervised as ``ActorGroup`` supervises local
ones: a killed actor is restarted by Ray, an exception or a death past the budget is reported.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
import warnings
from typing import Any, Callable

import cloudpickle  # type: ignore[import-untyped]
import numpy as np
import ray

from shmbuf.checks import timeout_seconds
from shmbuf.errors import ClosedError

from ..actors import ActorContext
from ..errors import ActorError, NodeLostError, NodeLostWarning
from .nodes import node_alive, on_node

PID_ASK_S = 2.0  # a restarting actor's pid is asked for again after this long


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
    """The Ray actor around one user actor. Its constructor starts the actor function in a
    thread, so a process that Ray restarts (it runs the constructor again) goes back to work
    at once, supervised or not; ``wait``, ``pid`` and ``stop`` are its calls (two may run at
    a time)."""

    def __init__(self, client: Any, fn_bytes: bytes, actor_id: int, node_id: str, lane: int,
                 entropy: int, lane_timeout: float) -> None:
        self.client, self.fn_bytes = client, fn_bytes
        self.actor_id, self.node_id, self.lane = actor_id, node_id, lane
        self.entropy, self.lane_timeout = entropy, lane_timeout
        self.stop_requested = False
        self.result: str | None = None  # None while the function runs
        self.rerun(1 if ray.get_runtime_context().was_current_actor_reconstructed else 0)

    def pid(self) -> tuple[int, bool]:
        """This process's id, and whether Ray restarted the actor into it."""
        return os.getpid(), ray.get_runtime_context().was_current_actor_reconstructed

    def rerun(self, incarnation: int) -> None:
        """Run the actor function (again) in a new thread."""
        self.result = None
        self.thread = threading.Thread(target=self._main, args=(incarnation,), daemon=True,
                                       name=f"shmbuf-actor-{self.actor_id}")
        self.thread.start()

    def wait(self, rerun: int | None = None) -> str:
        """Wait for the actor function to end: "" when it returned, else its traceback. With
        ``rerun`` (an incarnation), first run it again if it has ended."""
        if rerun is not None and not self.thread.is_alive():
            self.rerun(rerun)
        self.thread.join()
        return self.result or ""

    def _main(self, incarnation: int) -> None:
        try:
            fn = cloudpickle.loads(self.fn_bytes)
            buf = self.client.buffer()
            seed = np.random.SeedSequence(self.entropy,
                                          spawn_key=(self.actor_id, incarnation, os.getpid()))
            with buf.writer(lane=self.lane, timeout=self.lane_timeout) as writer:
                ctx = ClusterActorContext(self, writer, buf, incarnation, seed)
                writer.stop_when = lambda: ctx.stopping  # a stop also ends a limiter wait
                try:
                    fn(ctx)
                except ClosedError:
                    if not self.stop_requested:
                        raise
        except BaseException:  # noqa: BLE001 - the supervisor reports it
            self.result = traceback.format_exc()
            return
        self.result = ""

    def stop(self) -> None:
        self.stop_requested = True


class _Slot:
    """The supervisor's record of one actor (id, node and lane survive restarts).

    ``wait_ref`` waits for the actor function to end. When the process died instead, Ray
    restarts it (and it goes back to work by itself); ``pid_ref`` asks for its pid until the
    restarted process answers (a new pid: one restart), then a new wait is sent.
    """

    def __init__(self, actor_id: int, node_id: str, lane: int, handle: Any) -> None:
        self.actor_id, self.node_id, self.lane, self.handle = actor_id, node_id, lane, handle
        self.incarnation = 0
        self.wait_ref: Any = None
        self.pid_ref: Any = None
        self.asked = 0.0  # when pid_ref was sent
        self.ask_pid()
        self.pid: int | None = None
        self.restarts = 0
        self.finished = False
        self.lost = False

    @property
    def where(self) -> str:
        return f"actor {self.actor_id} (node {self.node_id[:12]}, lane {self.lane})"

    def ask_pid(self) -> None:
        self.pid_ref, self.asked = self.handle.pid.remote(), time.monotonic()


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

    A killed actor process is restarted by Ray, and goes back to work by itself (its lane is
    free again: the dead writer's lease died with it). ``poll()`` (never blocks; call it now
    and then) counts those restarts, runs an actor that raised again, and reports what is past
    ``max_restarts`` or lost.
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
            if (slot.pid_ref is not None and not slot.finished
                    and time.monotonic() - slot.asked > PID_ASK_S):
                slot.ask_pid()  # a call sent while Ray restarted the actor can stay unanswered
            for ref in (slot.wait_ref, slot.pid_ref):
                if ref is not None and not slot.finished:
                    pending[ref] = slot
        if not pending:
            return
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        for ref in done:
            slot = pending[ref]
            if ref is slot.pid_ref:
                self._on_pid(slot)
            elif ref is slot.wait_ref:
                self._on_end(slot)

    def _on_pid(self, slot: _Slot) -> None:
        try:
            pid = ray.get(slot.pid_ref, timeout=10.0)
        except ray.exceptions.ActorUnavailableError:  # still restarting: ask again
            slot.ask_pid()
            return
        except ray.exceptions.RayError as e:
            slot.pid_ref = None
            self._dead(slot, e)
            return
        slot.pid_ref = None
        self._seen(slot, *pid)
        if slot.wait_ref is None:
            slot.wait_ref = slot.handle.wait.remote()

    @staticmethod
    def _seen(slot: _Slot, pid: int, reconstructed: bool) -> None:
        """The actor answered from ``pid``: a new process (or a first answer from a restarted
        one) is a restart."""
        if (pid != slot.pid and slot.pid is not None) or (slot.pid is None and reconstructed):
            slot.restarts += 1
            slot.incarnation += 1
        slot.pid = pid

    def _on_end(self, slot: _Slot) -> None:
        try:
            tb = ray.get(slot.wait_ref, timeout=10.0)
        except ray.exceptions.ActorUnavailableError:
            tb = None  # the process died (Ray restarts it), or was restarting when called
        except ray.exceptions.RayError as e:
            slot.wait_ref = None
            self._dead(slot, e)
            return
        slot.wait_ref = None
        if tb is None:
            if slot.pid_ref is None:
                slot.ask_pid()  # waits again once the restarted process answers
            return
        if tb == "" or self._stopped:
            slot.finished = True
            return
        if slot.restarts >= self.max_restarts:
            slot.finished = True
            raise ActorError(f"{slot.where} raised after {slot.restarts} restarts: {tb}")
        slot.restarts += 1
        slot.incarnation += 1
        slot.wait_ref = slot.handle.wait.remote(slot.incarnation)  # again, in this process

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
                pid, reconstructed = ray.get(s.handle.pid.remote(), timeout=timeout)
            except ray.exceptions.RayError:
                out.append(None)
                continue
            if s.pid is None:  # what poll() has not heard yet
                self._seen(s, pid, reconstructed)
            out.append(pid)
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
        refs = [s.wait_ref for s in self._slots if not s.lost and s.wait_ref is not None]
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
