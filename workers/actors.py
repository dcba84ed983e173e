"""``ActorGroup``: supervised actor processes, each writing its own lane of a replay buffer.

The user's ``actor_fn(ctx)`` runs in N processes; ``ctx.writer`` holds the actor's lane. An
exception comes back to the parent with its traceback; a crashed or killed actor is restarted
within a rate budget, and the restarted process takes its lane over where the dead one stopped.

Stopping and parent death travel over each actor's own channel (``supervise.ChildSet``; no
shared lock that a killed process could leave held): ``ctx.stopping`` turns true when the parent asks, or when the parent
is gone (end-of-file), so orphaned actors end by themselves.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from typing import Any, Callable

import cloudpickle
import multiprocess
import numpy as np

from shmbuf import ReplayBuffer, Writer
from shmbuf.checks import timeout_seconds
from shmbuf.errors import ClosedError

from .channel import OP_DONE, OP_ERROR, Channel, ChildEnd
from .errors import ActorError
from .supervise import Child, ChildSet, refuse_main_reimport

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
                 incarnation: int, seed: np.random.SeedSequence, chan: Channel) -> None:
        self.writer = writer
        self.buffer = buffer
        self.actor_id = actor_id
        self.lane = lane
        self.incarnation = incarnation
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._chan = chan
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
        messages, parent_gone = self._chan.receive()
        if messages or parent_gone:  # the only record the parent sends is STOP
            self._stop = True
        return self._stop


def actor_main(end: ChildEnd, fn_bytes: bytes, buffer_name: str, actor_id: int, lane: int,
               incarnation: int, seed: np.random.SeedSequence, lane_timeout: float) -> None:
    """Entry point of an actor process (any start method)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us on Ctrl-C
    chan = end.channel()
    buf = ctx = None
    try:
        fn = cloudpickle.loads(fn_bytes)
        buf = ReplayBuffer.attach(buffer_name)
        with buf.writer(lane=lane, timeout=lane_timeout) as writer:
            ctx = ActorContext(writer, buf, actor_id, lane, incarnation, seed, chan)
            writer.stop_when = lambda: ctx.stopping  # a stop also ends a rate-limiter wait
            try:
                fn(ctx)
            except ClosedError:
                if not ctx._stop:
                    raise
        chan.send(OP_DONE)
    except BaseException:
        try:
            chan.send_text(OP_ERROR, traceback.format_exc())
        except (OSError, ValueError):
            pass
        os._exit(1)
    finally:
        if buf is not None:
            buf.close()


class _Actor(Child):
    """The parent's record of one actor (its id and lane survive restarts)."""

    def __init__(self, actor_id: int, lane: int) -> None:
        super().__init__(actor_id)
        self.actor_id = actor_id
        self.lane = lane
        self.incarnation = -1
        self.finished = False
        self.error: str | None = None


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
        refuse_main_reimport("ActorGroup")  # before the buffer is attached: nothing to undo
        if isinstance(n_actors, bool) or not isinstance(n_actors, int) or n_actors < 1:
            raise ValueError(f"n_actors must be a positive int, got {n_actors!r}")
        if restart not in RESTART_POLICIES:
            raise ValueError(f"restart must be one of {RESTART_POLICIES}, got {restart!r}")
        lane_timeout = timeout_seconds("lane_timeout", lane_timeout)
        self._own_buffer = not isinstance(buffer, ReplayBuffer)
        self._buf = buffer if isinstance(buffer, ReplayBuffer) else ReplayBuffer.attach(buffer)
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
        self.restart = restart
        self._children: ChildSet[_Actor] = ChildSet(multiprocess.get_context(start_method), actor_main,
                                  "shmbuf-actor", max_restarts_per_minute)
        self._seed = np.random.SeedSequence(seed)
        self._lane_timeout = lane_timeout
        self._actors = [_Actor(i, lane) for i, lane in enumerate(lanes)]
        self._stopped = False
        try:
            for actor in self._actors:
                self._start(actor)
        except BaseException:
            self.stop(timeout=1.0)
            raise

    def _start(self, actor: _Actor) -> None:
        actor.incarnation += 1
        seed = np.random.SeedSequence(self._seed.entropy,
                                      spawn_key=(actor.actor_id, actor.incarnation))
        self._children.start(actor, self._fn_bytes, self._buf.name, actor.actor_id, actor.lane,
                             actor.incarnation, seed, self._lane_timeout)
        actor.error = None

    # -- supervision ------------------------------------------------------------------------------
    def poll(self) -> None:
        """Reap finished or dead actors and restart them per the policy. Never blocks.

        Raises:
            ActorError: an actor failed and will not be restarted (policy "never", or the
                restart budget is exhausted); the message carries its traceback or exit status.
        """
        if self._stopped:
            return
        for actor in self._children.exited():
            last_op, text = self._last_message(actor)
            self._children.retire(actor)
            if last_op == OP_DONE and actor.proc.exitcode == 0:
                actor.finished = True
                continue
            detail = f"; its traceback:\n{text}" if last_op == OP_ERROR else ""
            actor.error = (f"actor {actor.actor_id} (pid {actor.proc.pid}, lane {actor.lane}) "
                           f"{actor.describe_exit()}{detail}")
            if self.restart == "never":
                actor.finished = True
                raise ActorError(actor.error)
            if not self._children.may_restart():
                actor.finished = True
                raise ActorError(f"{actor.error}\n{self._children.budget.exhausted()}")
            self._start(actor)

    @staticmethod
    def _last_message(actor: _Actor) -> tuple[int | None, str]:
        """The last record the actor sent (DONE, or ERROR with its traceback)."""
        messages = actor.receive()
        if not messages:
            return None, ""
        op, _, _, text = messages[-1]
        return op, text.decode("utf-8", "replace")

    @property
    def restarts(self) -> int:
        return self._children.restarts

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
        deadline = time.monotonic() + timeout_seconds("timeout", timeout)
        while time.monotonic() < deadline:
            self.poll()
            if all(a.finished for a in self._actors):
                return True
            time.sleep(0.02)
        return False

    def stop(self, timeout: float = 5.0) -> None:
        """Ask every actor to stop; after ``timeout`` terminate, then kill. Idempotent."""
        timeout = timeout_seconds("timeout", timeout)
        if self._stopped:
            return
        self._stopped = True
        self._children.stop(timeout)
        self._children.close()
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
