"""Child-process entry points and self-checking rows for the storage tests.

Importable as ``tests.storage_procs`` under every start method. Every row written by these
helpers carries its writer's lane, its logical index, a payload derived from (lane, index) and a
checksum of that payload, so any reader can tell a whole row from a torn or misplaced one.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import shmbuf

PAYLOAD_WORDS = 32  # u64 words per payload column: 256 bytes, two columns per row

SPEC = shmbuf.Spec(
    lane=((), "int64"),
    index=((), "int64"),
    payload=((PAYLOAD_WORDS,), "uint64"),
    mirror=((PAYLOAD_WORDS,), "uint64"),
    check=((), "uint64"),
)

_MASK = (1 << 64) - 1
_MUL_INDEX = 0x9E3779B97F4A7C15
_MUL_LANE = 0xD6E8FEB86659FD93
_RAMP = np.arange(PAYLOAD_WORDS, dtype=np.uint64) * np.uint64(0xBF58476D1CE4E5B9)


def payload_for(lanes: Any, indices: Any) -> np.ndarray:
    """The payload rows [n, PAYLOAD_WORDS] that (lane, index) pairs must hold: word k of row
    (lane, i) is ``i*A + (lane+1)*B + k*D`` mod 2**64, distinct for every lane, index and word
    (and affine in i, so a writer can shift a precomputed batch with one add)."""
    idx = np.atleast_1d(np.asarray(indices, dtype=np.int64)).astype(np.uint64)
    ln = np.broadcast_to(np.asarray(lanes, dtype=np.int64), idx.shape).astype(np.uint64)
    base = idx * np.uint64(_MUL_INDEX) + (ln + np.uint64(1)) * np.uint64(_MUL_LANE)
    return base[:, None] + _RAMP[None, :]


def checksum(payload: np.ndarray) -> np.ndarray:
    """Per-row checksum of a payload block: the wrapping sum of its words."""
    return payload.sum(axis=1, dtype=np.uint64)


def make_batch(lane: int, indices: Any) -> dict[str, np.ndarray]:
    """Self-checking rows for logical ``indices`` of ``lane`` (for ``extend``)."""
    idx = np.asarray(indices, dtype=np.int64)
    payload = payload_for(lane, idx)
    return {
        "lane": np.full(idx.shape, lane, np.int64),
        "index": idx.copy(),
        "payload": payload,
        "mirror": ~payload,
        "check": checksum(payload),
    }


class BatchMaker:
    """Makes ``make_batch(lane, range(i0, i0+n))`` into reused arrays, cheaply: rows are an
    affine function of the index, so a batch is a precomputed one shifted by ``i0``. Only the last
    ``keep`` rows are filled (``extend`` drops the rows before the last ``capacity``)."""

    def __init__(self, lane: int, max_rows: int) -> None:
        self.lane = lane
        self._base = make_batch(lane, np.arange(max_rows))
        self._out = {k: v.copy() for k, v in self._base.items()}

    def make(self, i0: int, n: int, keep: int | None = None) -> dict[str, np.ndarray]:
        lo = 0 if keep is None else max(0, n - keep)
        shift = np.uint64((i0 * _MUL_INDEX) & _MASK)
        b, o = self._base, self._out
        np.add(b["index"][lo:n], i0, out=o["index"][lo:n])
        np.add(b["payload"][lo:n], shift, out=o["payload"][lo:n])
        np.invert(o["payload"][lo:n], out=o["mirror"][lo:n])
        np.add(b["check"][lo:n], np.uint64((PAYLOAD_WORDS * int(shift)) & _MASK),
               out=o["check"][lo:n])
        return {k: v[:n] for k, v in o.items()}


def make_row(lane: int, index: int) -> dict[str, Any]:
    """One self-checking transition (for ``add``)."""
    b = make_batch(lane, [index])
    return {"lane": lane, "index": index, "payload": b["payload"][0], "mirror": b["mirror"][0],
            "check": b["check"][0]}


def bad_rows(rows: dict[str, np.ndarray], lanes: Any = None, indices: Any = None) -> np.ndarray:
    """Mask of rows that are not whole: payload, mirror or checksum disagree with (lane, index),
    or (if given) the row is not the one that was asked for."""
    lane, index = rows["lane"], rows["index"]
    want = payload_for(lane, index)
    bad = (rows["payload"] != want).any(axis=1)
    bad |= (rows["mirror"] != ~want).any(axis=1)
    bad |= rows["check"] != checksum(want)
    if lanes is not None:
        bad |= lane != np.asarray(lanes)
    if indices is not None:
        bad |= index != np.asarray(indices)
    return bad


def empty_batch(batch: int) -> dict[str, np.ndarray]:
    return {n: np.empty((batch, *f.shape), f.dtype) for n, f in SPEC.items()}


def _describe(rows: dict[str, np.ndarray], b: int, lanes: Any, indices: Any) -> str:
    got = f"row lane={int(rows['lane'][b])} index={int(rows['index'][b])}"
    if lanes is not None:
        got += f", drawn from lane {int(np.asarray(lanes)[b])} index {int(np.asarray(indices)[b])}"
    return got


# --------------------------------------------------------------------------------------------
# Four writers, two readers
# --------------------------------------------------------------------------------------------
def writer_main(buf: shmbuf.ReplayBuffer, lane: int, barrier: Any, first_commit: Any,
                stop: Any, results: Any, seed: int) -> None:
    """Write self-checking rows to ``lane`` with a mix of add and extend until ``stop``."""
    rng = np.random.default_rng(seed)
    barrier.wait(60)
    adds = extends = 0
    with buf.writer(lane=lane, timeout=10) as w:
        while not stop.is_set():
            if rng.random() < 0.3:
                for _ in range(int(rng.integers(1, 16))):
                    w.add(**make_row(lane, w.committed))
                    adds += 1
            else:
                n = int(rng.integers(1, buf.capacity + buf.capacity // 2))
                r = w.extend(make_batch(lane, np.arange(w.committed, w.committed + n)))
                assert r.stop == w.committed
                extends += 1
            if rng.random() < 0.05:
                w.end_episode()
            if not first_commit.is_set():
                first_commit.set()
        committed = w.committed
    results.put(("writer", lane, {"committed": committed, "adds": adds, "extends": extends}))


def reader_main(buf: shmbuf.ReplayBuffer, reader: int, barrier: Any, first_commits: list,
                duration: float, results: Any, seed: int) -> None:
    """Sample and verify rows for ``duration`` seconds; report what was checked."""
    rng = np.random.default_rng(seed)
    out = empty_batch(64)
    report: dict[str, Any] = {"checked": 0, "corrupt": 0, "examples": [], "calls": 0,
                              "stale": 0, "empty": 0, "errors": [], "max_call_s": 0.0,
                              "raw_torn": 0}
    barrier.wait(60)
    for ev in first_commits:
        if not ev.wait(60):
            report["errors"].append("a writer never committed")
            results.put(("reader", reader, report))
            return
    raw_cols = {n: buf.column(n) for n in ("lane", "index", "payload", "mirror", "check")}
    deadline = time.monotonic() + duration
    k = 0
    while time.monotonic() < deadline:
        k += 1
        t0 = time.monotonic()
        try:
            mode = k % 4
            if mode in (0, 1):
                draw = buf.sample_into(out, rng)
                rows, lanes, indices = out, draw.lanes, draw.indices
            elif mode == 2:
                rows, lanes, indices = buf.sample(32, rng), None, None
            else:
                # get() of the newest rows of a random lane: they may be overwritten
                # meanwhile (StaleIndexError), but whatever is returned must be whole.
                lane = int(rng.integers(0, buf.lanes))
                hi = int(buf.committed(lane))
                indices = np.arange(max(0, hi - 16), hi)
                lanes = np.full(indices.shape, lane)
                try:
                    rows = buf.get(indices, lanes)
                except shmbuf.StaleIndexError:
                    report["stale"] += 1
                    continue
        except shmbuf.EmptyBufferError:
            # Legitimate but transient: every lane is inside an extend() of >= capacity rows,
            # so each lane's whole ring is being rewritten and nothing is readable right now.
            report["empty"] += 1
            continue
        except Exception as e:  # noqa: BLE001 - reported to the parent
            report["errors"].append(f"{type(e).__name__}: {e}")
            break
        finally:
            report["max_call_s"] = max(report["max_call_s"], time.monotonic() - t0)
        report["calls"] += 1
        bad = bad_rows(rows, lanes, indices)
        report["checked"] += int(bad.size)
        if bad.any():
            report["corrupt"] += int(bad.sum())
            for b in np.flatnonzero(bad)[:3]:
                if len(report["examples"]) < 10:
                    report["examples"].append(_describe(rows, int(b), lanes, indices))
        if k % 16 == 0 and (buf.committed() >= buf.capacity).all():
            # Negative control: the same kind of gather with no seqlock check. Torn rows seen
            # here show that the test really races readers against writers.
            slots = rng.integers(0, buf.capacity * buf.lanes, size=64)
            raw = {n: c[slots] for n, c in raw_cols.items()}
            report["raw_torn"] += int(bad_rows(raw).sum())
    del raw_cols
    results.put(("reader", reader, report))


# --------------------------------------------------------------------------------------------
# SIGKILL mid-extend
# --------------------------------------------------------------------------------------------
def extend_forever(buf: shmbuf.ReplayBuffer, lane: int, conn: Any, max_rows: int,
                   seed: int) -> None:
    """Take ``lane`` and extend big self-checking batches until killed. Batches are shifted
    copies of a precomputed one, so most of the time is spent inside ``extend``."""
    rng = np.random.default_rng(seed)
    maker = BatchMaker(lane, max_rows)
    sizes = rng.integers(max_rows // 2, max_rows + 1, size=1024)
    w = buf.writer(lane=lane, timeout=10)
    conn.send(("started", os.getpid(), w.committed))
    conn.close()
    k = 0
    while True:
        n = int(sizes[k % sizes.size])
        k += 1
        w.extend(maker.make(w.committed, n, keep=buf.capacity))


def checking_reader(buf: shmbuf.ReplayBuffer, conn: Any, seed: int) -> None:
    """Sample and verify until told to stop; answer every ping with the counts so far.

    The parent bounds each ping's answer with a timeout, so a reader that hangs fails the test.
    """
    rng = np.random.default_rng(seed)
    out = empty_batch(64)
    report: dict[str, Any] = {"checked": 0, "corrupt": 0, "examples": [], "errors": [],
                              "max_call_s": 0.0, "calls": 0}
    while True:
        if conn.poll():
            msg = conn.recv()
            conn.send(report)
            if msg == "stop":
                return
        t0 = time.monotonic()
        try:
            draw = buf.sample_into(out, rng)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            report["errors"].append(f"{type(e).__name__}: {e}")
            continue
        finally:
            report["max_call_s"] = max(report["max_call_s"], time.monotonic() - t0)
        report["calls"] += 1
        bad = bad_rows(out, draw.lanes, draw.indices)
        report["checked"] += int(bad.size)
        if bad.any():
            report["corrupt"] += int(bad.sum())
            for b in np.flatnonzero(bad)[:3]:
                if len(report["examples"]) < 10:
                    report["examples"].append(_describe(out, int(b), draw.lanes, draw.indices))


def write_rows(buf: shmbuf.ReplayBuffer, lane: int, n: int, results: Any) -> None:
    """Append ``n`` self-checking rows to ``lane`` (half add, half extend) and report."""
    with buf.writer(lane=lane, timeout=10) as w:
        for _ in range(n // 2):
            w.add(**make_row(lane, w.committed))
        w.extend(make_batch(lane, np.arange(w.committed, w.committed + n - n // 2)))
        results.put((os.getpid(), buf.name, buf.is_owner, w.committed))


# --------------------------------------------------------------------------------------------
# Inherited writers
# --------------------------------------------------------------------------------------------
def use_inherited_writer(buf: shmbuf.ReplayBuffer, w: shmbuf.Writer, results: Any) -> None:
    """In a forked child: try the parent's writer, the parent's lane and a free lane."""
    report: dict[str, Any] = {}
    for op, call in (
        ("add", lambda: w.add(**make_row(w.lane, 0))),
        ("extend", lambda: w.extend(make_batch(w.lane, [0]))),
        ("end_episode", w.end_episode),
    ):
        try:
            call()
            report[op] = "no error"
        except shmbuf.ClosedError as e:
            report[op] = f"ClosedError: {e}"
        except Exception as e:  # noqa: BLE001
            report[op] = f"{type(e).__name__}: {e}"
    try:
        buf.writer(lane=w.lane, timeout=0.1).close()
        report["steal"] = "took the parent's lane"
    except shmbuf.LaneBusyError:
        report["steal"] = "LaneBusyError"
    other = 1 - w.lane
    with buf.writer(lane=other, timeout=5) as w2:
        report["other_lane_index"] = w2.add(**make_row(other, w2.committed))
    results.put(report)


# --------------------------------------------------------------------------------------------
# Parent-side helpers
# --------------------------------------------------------------------------------------------
def collect(queue: Any, n: int, procs: list, timeout: float) -> list:
    """Take ``n`` results from ``queue``; fail fast if a process died without reporting."""
    import queue as _queue

    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        try:
            got.append(queue.get(timeout=0.2))
            continue
        except _queue.Empty:
            pass
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead:
            raise AssertionError(
                "child process(es) died before reporting: "
                + ", ".join(f"{p.name} pid {p.pid} exitcode {p.exitcode}" for p in dead)
            )
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {n - len(got)} result(s)")
    return got


def reap(procs: list, timeout: float = 10.0) -> None:
    """Join each process within ``timeout``; SIGKILL and join whatever is still running."""
    deadline = time.monotonic() + timeout
    for p in procs:
        if p.pid is None:
            continue
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join(5)


def release_sync() -> None:
    """Finalize dropped multiprocessing primitives now: under spawn/forkserver their named
    semaphores stay in /dev/shm until then, and reference cycles delay it past the test."""
    import gc

    gc.collect()
