"""Many processes on one buffer at once: writers on their own lanes (``add`` through its
compiled store where ``_add_c`` was built), readers sampling, under fork, forkserver and spawn.
Every row checks itself, so any torn or misplaced row a reader accepts is counted; the test
demands zero."""

from __future__ import annotations

import numpy as np

import shmbuf
from shmbuf import store
from tests import storage_procs as procs

WRITERS = 4
READERS = 2
CAPACITY = 512  # small, so writers lap readers many times a second
DURATION = 2.5  # seconds of concurrent sampling per start method (CI has two cores)


def test_four_writers_two_readers_never_deliver_a_torn_row(mp):
    """Four writer processes (add and extend, wrapping constantly) and two readers (sample_into,
    sample, get of the newest rows) for a few seconds: zero corrupt rows among many checked, each
    row comes from the lane and index it was drawn at, and every lane ends intact."""
    buf = shmbuf.ReplayBuffer.create(procs.SPEC, capacity=CAPACITY, lanes=WRITERS)
    children = []
    try:
        barrier = mp.Barrier(WRITERS + READERS)
        stop = mp.Event()
        first_commits = [mp.Event() for _ in range(WRITERS)]
        results = mp.Queue()
        writers = [
            mp.Process(target=procs.writer_main, name=f"writer-{k}",
                       args=(buf, k, barrier, first_commits[k], stop, results, 100 + k))
            for k in range(WRITERS)
        ]
        readers = [
            mp.Process(target=procs.reader_main, name=f"reader-{r}",
                       args=(buf, r, barrier, first_commits, DURATION, results, 200 + r))
            for r in range(READERS)
        ]
        children = writers + readers
        for p in children:
            p.start()
        reports = procs.collect(results, READERS, children, timeout=90)
        stop.set()
        reports += procs.collect(results, WRITERS, children, timeout=30)
        procs.reap(children, timeout=30)
        assert [p.exitcode for p in children] == [0] * len(children)

        by_kind: dict[str, dict[int, dict]] = {"reader": {}, "writer": {}}
        for kind, who, rep in reports:
            by_kind[kind][who] = rep
        for r, rep in sorted(by_kind["reader"].items()):
            assert rep["errors"] == [], f"reader {r}: {rep['errors']}"
            assert rep["corrupt"] == 0, (
                f"reader {r} accepted {rep['corrupt']} corrupt row(s) of {rep['checked']}: "
                f"{rep['examples']}"
            )
            assert rep["checked"] >= 5_000, f"reader {r} checked only {rep['checked']} rows"
            assert rep["max_call_s"] < 2.0, f"reader {r}: a read took {rep['max_call_s']:.2f}s"
        # Each writer's lane holds exactly what it wrote, and every readable row is whole.
        committed = buf.committed()
        for k in range(WRITERS):
            rep = by_kind["writer"][k]
            assert rep["extends"] > 0 and rep["adds"] > 0
            assert rep["compiled_add"] == (store.CompiledStore is not None)
            assert committed[k] == rep["committed"]
        win = buf.windows()
        assert (win.sizes == CAPACITY).all()
        for k in range(WRITERS):
            idx = np.arange(win.lo[k], win.hi[k])
            rows = buf.get(idx, k)
            assert not procs.bad_rows(rows, k, idx).any()
        raw_torn = sum(rep["raw_torn"] for rep in by_kind["reader"].values())
        checked = sum(rep["checked"] for rep in by_kind["reader"].values())
        empty = sum(rep["empty"] for rep in by_kind["reader"].values())
        print(f"checked {checked} rows, 0 corrupt; unchecked gathers saw {raw_torn} torn rows; "
              f"{empty} transient EmptyBufferError(s); "
              f"committed {committed.tolist()}")
        # The unchecked control gathers really saw torn rows: readers and writers did race.
        assert raw_torn > 0
    finally:
        procs.reap(children, timeout=5)
        buf.close()
        # spawn/forkserver semaphores live in /dev/shm until their objects are finalized.
        children = barrier = stop = first_commits = results = None  # noqa: F841
        procs.release_sync()


def test_buffer_pickles_to_children_by_name(mp):
    """A buffer handed to a child (pickled under spawn/forkserver, inherited under fork) reaches
    the same segment: the child's rows are visible to the parent, and the child's exit neither
    unlinks the segment nor closes the parent's handle."""
    buf = shmbuf.ReplayBuffer.create(procs.SPEC, capacity=64, lanes=2)
    children = []
    try:
        with buf.writer(lane=0) as w:
            w.extend(procs.make_batch(0, np.arange(10)))
        results = mp.Queue()
        p = mp.Process(target=procs.write_rows, args=(buf, 1, 21, results))
        children = [p]
        p.start()
        [(pid, name, child_is_owner, child_committed)] = procs.collect(results, 1, children, 60)
        procs.reap(children, timeout=30)
        assert p.exitcode == 0
        assert (pid, name, child_is_owner, child_committed) == (p.pid, buf.name, False, 21)
        assert buf.committed(0) == 10 and buf.committed(1) == 21
        for lane, n in ((0, 10), (1, 21)):
            idx = np.arange(n)
            assert not procs.bad_rows(buf.get(idx, lane), lane, idx).any()
        assert not buf.closed and buf.stats()["owner_alive"]
        assert buf.writer_alive(1) is False
    finally:
        procs.reap(children, timeout=5)
        buf.close()
