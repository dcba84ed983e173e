"""Child-process entry points and self-checking rows for the storage tests.

Importable as ``tests.storage_procs`` under every start method. Rows follow
``tests/_helpers/rows.py``: two wide columns (a payload and its mirror) and a check word, all
derived from the row's (lane, index), so any reader can tell a whole row from a torn or
misplaced one.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import shmbuf

# Process helpers live in tests/_helpers/processes.py; the tests call them as ``procs.X``.
from tests._helpers.processes import collect as collect
from tests._helpers.processes import reap as reap
from tests._helpers.processes import release_sync as release_sync
from tests._helpers.rows import RowScheme, ShiftedBatches, describe_row

PAYLOAD_WORDS = 32  # u64 words per payload column: 256 bytes, two columns per row
ROWS = RowScheme(payload_words=PAYLOAD_WORDS, mirror=True)
SPEC = shmbuf.Spec(ROWS.fields)

make_batch = ROWS.batch  # rows for logical indices of a lane (for extend)
make_row = ROWS.row  # one row (for add)
bad_rows = ROWS.bad_rows  # mask of rows that are not whole, or not the (lane, index) drawn


def empty_batch(batch: int) -> dict[str, np.ndarray]:
    return {n: np.empty((batch, *f.shape), f.dtype) for n, f in SPEC.items()}


def _count_call(report: dict[str, Any], rows: dict[str, np.ndarray], lanes: Any,
                indices: Any) -> None:
    """Count a read call in ``report`` and check the ``rows`` it returned (drawn as
    ``lanes``/``indices``, if given)."""
    report["calls"] += 1
    bad = bad_rows(rows, lanes, indices)
    report["checked"] += int(bad.size)
    if bad.any():
        report["corrupt"] += int(bad.sum())
        for b in np.flatnonzero(bad)[:3]:
            if len(report["examples"]) < 10:
                report["examples"].append(describe_row(rows, int(b), lanes, indices))


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
        compiled = w._store.compiled  # the lane's store is _add_c.c's, where it was built
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
    results.put(("writer", lane, {"committed": committed, "adds": adds, "extends": extends,
                                  "compiled_add": compiled}))


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
        _count_call(report, rows, lanes, indices)
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
    maker = ShiftedBatches(ROWS, lane, max_rows)
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
        _count_call(report, out, draw.lanes, draw.indices)


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
