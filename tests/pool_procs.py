"""Self-checking rows, transforms, actor functions and child-process entry points for the tests of
the ``workers`` package (``test_pool``, ``test_pool_faults``, ``test_actors``, ``test_ratelimit``).

Importable as ``tests.pool_procs`` under every start method, so everything here crosses process
boundaries by reference. Rows follow ``tests/_helpers/rows.py``: every field (a payload, an
observation, a check word) is derived from the row's (lane, index), so a learner can verify each
delivered row against ``batch.lanes`` / ``batch.indices`` and tell a whole row from a torn,
stale or misplaced one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import shmbuf

# Process helpers live in tests/_helpers/processes.py; the tests call them as ``procs.X``.
from tests._helpers.processes import descendants as descendants
from tests._helpers.processes import kill_quietly as kill_quietly
from tests._helpers.processes import pid_alive as pid_alive
from tests._helpers.processes import proc_state as proc_state
from tests._helpers.processes import reporting_child as reporting_child
from tests._helpers.processes import wait_dead as wait_dead
from tests._helpers.rows import RowScheme, describe_row

ROWS = RowScheme(payload_words=8, payload_dtype="uint32", obs_shape=(2, 3))
PAYLOAD_WORDS = ROWS.payload_words
SPEC = shmbuf.Spec(ROWS.fields)
FIELDS = list(SPEC)

# --------------------------------------------------------------------------------------------
# Self-checking rows (the scheme's functions, under the names the tests use)
# --------------------------------------------------------------------------------------------
payload_for = ROWS.payload  # uint32 payload rows [n, PAYLOAD_WORDS] of (lane, index) pairs
obs_for = ROWS.obs  # float32 observations [n, 2, 3] (small exact integers)
make_batch = ROWS.batch  # rows for logical indices of a lane (for Writer.extend)
make_row = ROWS.row  # one row (for Writer.add)
bad_rows = ROWS.bad_rows  # mask of rows that are not whole, or not the (lane, index) drawn


def assert_batch_ok(batch: Any, batch_size: int | None = None) -> None:
    """Every row of a ``Batch`` is whole and is the (lane, index) the batch says it is."""
    lanes, indices = np.asarray(batch.lanes), np.asarray(batch.indices)
    if batch_size is not None:
        assert indices.shape == (batch_size,), indices.shape
    bad = bad_rows(batch, lanes, indices)
    if bad.any():
        raise AssertionError(
            f"{int(bad.sum())} of {bad.size} delivered rows are corrupt; e.g. "
            + describe_row(batch, int(np.flatnonzero(bad)[0]), lanes, indices))


def fill(buf: shmbuf.ReplayBuffer, rows_per_lane: int, lanes: Any = None) -> None:
    """Append ``rows_per_lane`` self-checking rows to each lane (or to ``lanes``)."""
    for k in range(buf.lanes) if lanes is None else lanes:
        with buf.writer(lane=k, timeout=5) as w:
            w.extend(make_batch(k, np.arange(w.committed, w.committed + rows_per_lane)))


def new_buffer(capacity: int = 256, lanes: int = 2, rows: int | None = None) -> shmbuf.ReplayBuffer:
    """A buffer of ``SPEC`` with ``rows`` (default: ``capacity``) rows in every lane."""
    buf = shmbuf.ReplayBuffer.create(SPEC, capacity=capacity, lanes=lanes)
    try:
        if rows is None or rows > 0:
            fill(buf, capacity if rows is None else rows)
    except BaseException:
        buf.close()
        raise
    return buf


# --------------------------------------------------------------------------------------------
# Transforms (the dry run calls them in the parent; workers call them in their own process)
# --------------------------------------------------------------------------------------------
def double_index(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An importable transform that changes fields, shapes and dtypes."""
    return {
        "lane": batch["lane"],
        "index": batch["index"],
        "twice": (batch["index"] * 2).astype(np.float64),
        "grid": np.broadcast_to(batch["lane"][:, None, None], (len(batch["lane"]), 2, 2)).astype(
            np.uint8
        ),
    }


class Sleep:
    """Sleeps ``seconds`` in the worker (not in the parent's dry run), then passes rows through:
    a worker is then almost always mid-fill (its slot is FILLING)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.parent = os.getpid()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if os.getpid() != self.parent:
            time.sleep(self.seconds)
        return batch


class DieInWorker:
    """Kills the worker process on its first batch; harmless in the parent's dry run.

    ``how``: "sigkill" (``os.kill(getpid(), SIGKILL)``) or an exit code for ``os._exit``.
    """

    def __init__(self, how: str | int = "sigkill") -> None:
        self.how = how
        self.parent = os.getpid()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if os.getpid() != self.parent:
            if self.how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(int(self.how))
        return batch


class RaiseInWorker:
    """Raises ``ValueError`` in the worker; passes rows through in the parent's dry run."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.parent = os.getpid()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if os.getpid() != self.parent:
            raise ValueError(self.message)
        return batch


class _Bomb:
    """A value the worker converts with ``np.asarray`` while copying fields into the slot; the
    conversion SIGKILLs the worker, so the slot's earlier fields are new and the later ones
    stale: a torn slot, if it were ever delivered."""

    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # not reached
        return self.value


class DieMidCopy:
    """Passes rows through, but on about one batch in ``every`` (per worker process) the worker
    SIGKILLs itself halfway through copying the batch into its staging slot."""

    def __init__(self, every: int = 3, field: str = "payload") -> None:
        self.every = every
        self.field = field
        self.parent = os.getpid()
        self.calls = 0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        if os.getpid() == self.parent:
            return batch
        self.calls += 1
        if self.calls >= 2 and np.random.default_rng().integers(self.every) == 0:
            out: dict[str, Any] = dict(batch)
            out[self.field] = _Bomb(batch[self.field])
            return out
        return batch


class ShrinkInWorker:
    """Returns the batch in the parent's dry run but only half of it in the worker: a transform
    whose output shape changes after the first call."""

    def __init__(self) -> None:
        self.parent = os.getpid()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if os.getpid() == self.parent:
            return batch
        return {k: v[: len(v) // 2] for k, v in batch.items()}


def negate_obs_in_place(batch: dict[str, np.ndarray]) -> None:
    """A transform that edits the batch in place and returns None."""
    np.negative(batch["obs"], out=batch["obs"])


class ExitOnUnpickle:
    """A transform that works in the parent but ends any process that unpickles it with exit
    code ``code``: the worker dies during start-up, every time."""

    def __init__(self, code: int = 7) -> None:
        self.code = code

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return batch

    def __reduce__(self) -> tuple[Any, ...]:
        return (os._exit, (self.code,))


# --------------------------------------------------------------------------------------------
# Actor functions (ActorGroup)
# --------------------------------------------------------------------------------------------
def lane_writer(ctx: Any, chunk: int = 16, pause: float = 0.0) -> None:
    """Extend self-checking rows into the actor's lane until asked to stop."""
    w, lane = ctx.writer, ctx.lane
    while not ctx.stopping:
        w.extend(make_batch(lane, np.arange(w.committed, w.committed + chunk)))
        if pause:
            time.sleep(pause)


def bounded_writer(ctx: Any, n: int = 100) -> None:
    """Add ``n`` self-checking rows one at a time, end the episode, return."""
    w, lane = ctx.writer, ctx.lane
    for _ in range(n):
        w.add(**make_row(lane, w.committed))
    w.end_episode()


def raising_actor(ctx: Any) -> None:
    """Writes a few rows, then raises."""
    w = ctx.writer
    w.extend(make_batch(ctx.lane, np.arange(w.committed, w.committed + 4)))
    raise ValueError(f"actor-boom from actor {ctx.actor_id}")


def stubborn_actor(ctx: Any, ignore_sigterm: bool = False) -> None:
    """Never looks at ``ctx.stopping``; optionally ignores SIGTERM too (only SIGKILL ends it)."""
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    w, lane = ctx.writer, ctx.lane
    while True:
        w.add(**make_row(lane, w.committed))
        time.sleep(0.005)


# --------------------------------------------------------------------------------------------
# Child-process entry points
# --------------------------------------------------------------------------------------------
def learner_main(conn: Any, start_method: str, n_workers: int, starved: bool = False) -> None:
    """A learner that owns a buffer and a pool, reports its pids and segments, then waits to be
    killed (SIGKILL: no cleanup of any kind runs). ``starved``: the buffer stays below
    ``min_size``, so the workers are waiting to sample when the learner dies."""
    from workers import SamplerPool
    from workers.config import Workers

    buf = new_buffer(capacity=128, lanes=2)
    pool = SamplerPool(buf, batch_size=8, limit=shmbuf.RateLimit(10_000 if starved else 1),
                       workers=Workers(n_workers, start_method=start_method), seed=1)
    if starved:
        deadline = time.monotonic() + 30
        while not all(w.hello for w in pool._delivery.workers()):  # every worker set up and waiting
            try:
                pool.next(timeout=0.1)
            except shmbuf.Timeout:
                pass
            assert time.monotonic() < deadline
    else:
        assert_batch_ok(pool.next(timeout=30), 8)
    conn.send({"pid": os.getpid(), "buffer": buf.name, "staging": pool.staging_name,
               "workers": pool.worker_pids})
    while True:
        time.sleep(1)
        if not starved:
            pool.next(timeout=30)  # keep the pool busy, like a learner would


def pool_process_main(conn: Any, buffer_name: str, start_method: str, hold_a_batch: bool,
                      pool_kwargs: dict[str, Any], take: int = 0,
                      priorities: list[float] | None = None) -> None:
    """A process that runs a pool over ``buffer_name`` (``hold_a_batch``: and keeps one batch,
    so that its worker fills the other slot and then samples no more; ``take``: takes that
    many batches, keeping the last; ``priorities``: sets them for rows 0.. of lane 0), reports
    its pid, staging ring, priority table, workers, the ``(lanes, indices)`` of the batches it
    took and its stats, then waits to be killed (no cleanup of any kind runs)."""
    import dataclasses

    from workers import SamplerPool
    from workers.config import Workers

    pool_kwargs = dict(pool_kwargs)
    workers = pool_kwargs.pop("workers", None)  # a number, or Workers(...) without the method
    if not isinstance(workers, Workers):
        workers = Workers(workers)
    pool = SamplerPool(buffer_name, workers=dataclasses.replace(workers, start_method=start_method),
                       **pool_kwargs)
    taken = []
    for _ in range(max(take, int(hold_a_batch))):
        batch = pool.next(timeout=30)
        assert_batch_ok(batch, pool_kwargs["batch_size"])
        taken.append((np.asarray(batch.lanes).tolist(), np.asarray(batch.indices).tolist()))
    if priorities is not None:
        applied = pool.update_priorities(np.arange(len(priorities)), np.asarray(priorities),
                                         lanes=0)
        assert applied == len(priorities), applied
    table = pool._table
    conn.send({"pid": os.getpid(), "staging": pool.staging_name, "workers": pool.worker_pids,
               "table": table.name if table is not None else None, "taken": taken,
               "stats": pool.stats()})
    while True:
        time.sleep(1)


@contextlib.contextmanager
def pool_process(buf: shmbuf.ReplayBuffer | str, start_method: str, hold_a_batch: bool = False,
                 take: int = 0, priorities: list[float] | None = None, **pool_kwargs: Any
                 ) -> Iterator[tuple[Any, dict]]:
    """A spawned ``pool_process_main`` over ``buf`` (``SamplerPool(**pool_kwargs)``, its
    ``workers`` a number or ``Workers(...)``, run under ``start_method``), started
    and reported; yields (process, its report). On the way out the process, then its workers
    and the staging ring and priority table it leaks when killed, are cleaned up."""
    import multiprocess

    from shmbuf.shmdir import unlink

    spawn = multiprocess.get_context("spawn")
    info = None
    try:
        name = buf if isinstance(buf, str) else buf.name
        with reporting_child(spawn, pool_process_main, name, start_method, hold_a_batch,
                             pool_kwargs, take, priorities, what="the pool process"
                             ) as (owner, _, info):
            yield owner, info
    finally:
        if info is not None:
            kill_quietly(info["workers"])
            wait_dead(info["workers"], 5)
            for name in (info["staging"], info["table"]):  # a dead process's leaks, if any
                if name is not None:
                    unlink(name)


def limiting_pool_process(buf: shmbuf.ReplayBuffer, start_method: str
                          ) -> contextlib.AbstractContextManager[tuple[Any, dict]]:
    """A ``pool_process`` whose pool rate-limits ``buf`` (batch 8, ratio 8, tolerance 32,
    min_size 32) and holds a batch."""
    from workers.config import Workers

    return pool_process(buf, start_method, hold_a_batch=True, batch_size=8,
                        workers=Workers(1, staging=2), limit=shmbuf.RateLimit(32, 8.0, 32),
                        seed=0)


def actor_parent_main(conn: Any, start_method: str, n_actors: int) -> None:
    """A process that owns a buffer and an ActorGroup, reports pids, then waits to be killed."""
    import functools

    from workers import ActorGroup

    buf = shmbuf.ReplayBuffer.create(SPEC, capacity=256, lanes=n_actors)
    group = ActorGroup(functools.partial(lane_writer, chunk=8, pause=0.001), n_actors, buf,
                       start_method=start_method, seed=0)
    deadline = time.monotonic() + 30
    while (buf.committed() == 0).any() and time.monotonic() < deadline:
        group.poll()
        time.sleep(0.01)
    conn.send({"pid": os.getpid(), "buffer": buf.name, "actors": group.pids,
               "committed": buf.committed().tolist()})
    while True:
        group.poll()
        time.sleep(0.05)
