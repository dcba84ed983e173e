"""``ActorGroup``: supervised actor processes, each writing its own lane of a replay buffer.

The user's ``actor_fn(ctx)`` runs in N processes; ``ctx.writer`` holds the actor's lane. An
exception comes back to the parent with its traceback; a crashed or killed actor is restarted
within a rate budget, and the restarted process takes its lane over where the dead one stopped.

Stopping and parent death travel over each actor's own pipe (no shared lock that a killed
process could leave held): ``ctx.stopping`` turns true when the parent asks, or when the parent
is gone (end-of-file), so orphaned actors end by themselves.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import cloudpickle
import multiprocess
import numpy as np

from shmbuf import ReplayBuffer, Writer
from shmbuf._util import _timeout
from shmbuf.errors import ActorError, ClosedError

from .supervise import RestartBudget, describe_exit, stop_process

RESTART_POLICIES = ("on-failure", "never")
STOP_CHECK_EVERY = 0.01  # seconds between pipe polls in ctx.stopping


class ActorContext:
    """What an actor function receives.

    Attributes:
        writer: the actor's ``Writer`` (its own lane).
        actor_id: 0 .. n_actors-1 (stable across restarts).
        lane: the lane it writes.
        incarnation: 0 for the first process of this actor, then 1, 2, ... after restarts.
        rng: a ``numpy.random.Generator`` seeded per actor and incarnation.
        buffer: the attached ``ReplayBuffer``.
    """

    def __init__(self, writer: Writer, buffer: ReplayBuffer, actor_id: int, lane: int,
                 incarnation: int, seed: np.random.SeedSequence, conn: Any) -> None:
        self.writer = writer
        self.buffer = buffer
        self.actor_id = actor_id
        self.lane = lane
        self.incarnation = incarnation
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._conn = conn
        self._stop = False
        self._next_check = 0.0

    @property
    def stopping(self) -> bool:
        """True once the group is stopping or the parent process is gone. Cheap to call often."""
        if self._stop:
            return True
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + STOP_CHECK_EVERY
        try:
            if self._conn.poll(0):
                self._conn.recv()  # the only message the parent sends is "stop"
                self._stop = True
        except (EOFError, OSError):
            self._stop = True  # the parent died
        return self._stop


def actor_main(fn_bytes: bytes, buffer_name: str, actor_id: int, lane: int, incarnation: int,
               seed: np.random.SeedSequence, conn: Any, lane_timeout: float) -> None:
    """Entry point of an actor process (any start method)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us on Ctrl-C
    buf = ctx = None
    try:
        fn = cloudpickle.loads(fn_bytes)
        buf = ReplayBuffer.attach(buffer_name)
        with buf.writer(lane=lane, timeout=lane_timeout) as writer:
            ctx = ActorContext(writer, buf, actor_id, lane, incarnation, seed, conn)
            writer.stop_when = lambda: ctx.stopping  # a stop also ends a rate-limiter wait
            try:
                fn(ctx)
            except ClosedError:
                if not ctx._stop:
                    raise
        conn.send(("done", None))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass
        os._exit(1)
    finally:
        if buf is not None:
            buf.close()


@dataclass
class _Actor:
    actor_id: int
    lane: int
    proc: Any = None
    conn: Any = None
    incarnation: int = -1
    finished: bool = False
    error: str | None = None

    def _close_in_child(self) -> None:
        if self.conn is not None:
            self.conn.close()


_PARENT_ONLY: weakref.WeakSet[Any] = weakref.WeakSet()


def _close_parent_only_in_child() -> None:
    for group in list(_PARENT_ONLY):
        for actor in group._actors:
            try:
                actor._close_in_child()
            except Exception:
                pass


os.register_at_fork(after_in_child=_close_parent_only_in_child)


class ActorGroup:
    """Runs ``actor_fn(ctx)`` in ``n_actors`` processes, each with a writer on its own lane.

    Args:
        actor_fn: the actor; serialised with cloudpickle here (a lambda or closure works under
            every start method; an unpicklable one fails here). It should return when
            ``ctx.stopping`` becomes true.
        n_actors: processes to run; the buffer needs at least this many lanes.
        buffer: a ``ReplayBuffer`` or its name.
        start_method: "fork", "forkserver" or "spawn".
        restart: "on-failure" restarts an actor that raised or was killed (within
            ``max_restarts_per_minute``); "never" reports it from ``poll()``.
        seed: seeds per-actor RNG streams (``ctx.rng``).
        lanes: which lane each actor writes (default ``0 .. n_actors-1``).

    Supervision is explicit and never blocks: call ``poll()`` now and then (a ``SamplerPool``
    does nothing of the sort on its own). ``stop(timeout)`` asks every actor to stop, then
    terminates, then kills.

    Example:
        >>> def actor(ctx):
        ...     while not ctx.stopping:
        ...         ctx.writer.add(obs=..., action=..., reward=...)
        >>> with ActorGroup(actor, 4, buf) as group:
        ...     ...; group.poll()
    """

    def __init__(self, actor_fn: Callable[[ActorContext], Any], n_actors: int,
                 buffer: ReplayBuffer | str, *, start_method: str | None = None,
                 restart: str = "on-failure", max_restarts_per_minute: float = 10.0,
                 seed: int | None = None, lanes: list[int] | None = None,
                 lane_timeout: float = 10.0) -> None:
        if not callable(actor_fn):
            raise TypeError(f"actor_fn must be callable, got {type(actor_fn).__name__}")
        if isinstance(n_actors, bool) or not isinstance(n_actors, int) or n_actors < 1:
            raise ValueError(f"n_actors must be a positive int, got {n_actors!r}")
        if restart not in RESTART_POLICIES:
            raise ValueError(f"restart must be one of {RESTART_POLICIES}, got {restart!r}")
        lane_timeout = _timeout("lane_timeout", lane_timeout)
        self._own_buffer = not isinstance(buffer, ReplayBuffer)
        self._buf = ReplayBuffer.attach(buffer) if self._own_buffer else buffer
        lanes = list(range(n_actors)) if lanes is None else list(lanes)
        if len(lanes) != n_actors or len(set(lanes)) != n_actors or not all(
            isinstance(k, int) and 0 <= k < self._buf.lanes for k in lanes
        ):
            if self._own_buffer:
                self._buf.close()
            raise ValueError(
                f"{n_actors} actors need {n_actors} distinct lanes in [0, {self._buf.lanes}); "
                f"got lanes={lanes}. Fix: create the buffer with lanes >= n_actors"
            )
        try:
            self._fn_bytes = cloudpickle.dumps(actor_fn)
        except Exception as e:
            if self._own_buffer:
                self._buf.close()
            name = getattr(actor_fn, "__qualname__", repr(actor_fn))
            raise TypeError(
                f"actor_fn {name} cannot be serialised for the actor processes "
                f"({type(e).__name__}: {e}); create unpicklable objects inside it instead"
            ) from e
        self._ctx = multiprocess.get_context(start_method)
        self.restart = restart
        self._budget = RestartBudget(max_restarts_per_minute)
        self._seed = np.random.SeedSequence(seed)
        self._lane_timeout = lane_timeout
        self._actors = [_Actor(i, lane) for i, lane in enumerate(lanes)]
        self._stopped = False
        _PARENT_ONLY.add(self)
        try:
            for actor in self._actors:
                self._start(actor)
        except BaseException:
            self.stop(timeout=1.0)
            raise

    def _start(self, actor: _Actor) -> None:
        actor.incarnation += 1
        parent_end, child_end = self._ctx.Pipe(duplex=True)
        seed = np.random.SeedSequence(self._seed.entropy,
                                      spawn_key=(actor.actor_id, actor.incarnation))
        proc = self._ctx.Process(
            target=actor_main,
            args=(self._fn_bytes, self._buf.name, actor.actor_id, actor.lane, actor.incarnation,
                  seed, child_end, self._lane_timeout),
            name=f"shmbuf-actor-{actor.actor_id}", daemon=True,
        )
        # Known before the fork, so the at-fork hook closes the parent's end in the child: a
        # forked actor holding it would never see end-of-file when the parent dies.
        actor.conn = parent_end
        proc.start()
        child_end.close()
        actor.proc, actor.error = proc, None

    # -- supervision ------------------------------------------------------------------------------
    def poll(self) -> None:
        """Reap finished or dead actors and restart them per the policy. Never blocks.

        Raises:
            ActorError: an actor failed and will not be restarted (policy "never", or the
                restart budget is exhausted); the message carries its traceback or exit status.
        """
        if self._stopped:
            return
        for actor in self._actors:
            if actor.finished or actor.proc is None or actor.proc.is_alive():
                continue
            actor.proc.join(1.0)
            status, payload = self._last_message(actor)
            actor.conn.close()
            if status == "done" and actor.proc.exitcode == 0:
                actor.finished = True
                continue
            how = describe_exit(actor.proc.exitcode)
            detail = f"; its traceback:\n{payload}" if status == "error" else ""
            actor.error = f"actor {actor.actor_id} (pid {actor.proc.pid}, lane {actor.lane}) {how}{detail}"
            if self.restart == "never":
                actor.finished = True
                raise ActorError(actor.error)
            if not self._budget.try_spend():
                actor.finished = True
                raise ActorError(
                    f"{actor.error}\nrestart budget exhausted ({self._budget.recent()} restarts "
                    f"in the last minute, max {self._budget.per_minute:g}/min)"
                )
            self._start(actor)

    @staticmethod
    def _last_message(actor: _Actor) -> tuple[str | None, Any]:
        status, payload = None, None
        try:
            while actor.conn.poll(0):
                status, payload = actor.conn.recv()
        except (EOFError, OSError):
            pass
        return status, payload

    @property
    def restarts(self) -> int:
        return self._budget.total

    @property
    def pids(self) -> list[int | None]:
        return [a.proc.pid if a.proc is not None else None for a in self._actors]

    @property
    def alive(self) -> int:
        return sum(1 for a in self._actors if a.proc is not None and a.proc.is_alive())

    @property
    def n_actors(self) -> int:
        return len(self._actors)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every actor to finish (polling); True if all did."""
        deadline = time.monotonic() + _timeout("timeout", timeout)
        while time.monotonic() < deadline:
            self.poll()
            if all(a.finished for a in self._actors):
                return True
            time.sleep(0.02)
        return False

    def stop(self, timeout: float = 5.0) -> None:
        """Ask every actor to stop; after ``timeout`` terminate, then kill. Idempotent."""
        timeout = _timeout("timeout", timeout)
        if self._stopped:
            return
        self._stopped = True
        for actor in self._actors:
            if actor.conn is not None and not actor.conn.closed:
                try:
                    actor.conn.send("stop")
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for actor in self._actors:
            if actor.proc is not None:
                stop_process(actor.proc, max(0.1, deadline - time.monotonic()))
            if actor.conn is not None:
                actor.conn.close()
        _PARENT_ONLY.discard(self)
        if self._own_buffer:
            self._buf.close()

    def __enter__(self) -> ActorGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __del__(self) -> None:
        if not getattr(self, "_stopped", True):
            try:
                self.stop(timeout=1.0)
            except Exception:
                pass
