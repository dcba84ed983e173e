"""A learner SIGKILLed and restarted on the same buffer cleans up after the one that died.

What is proved here (under fork, forkserver and spawn where a process is involved):
- a new pool removes the staging rings and priority tables that SIGKILLed learners of its buffer
  left, before it sizes its own: over N kills and restarts, in uniform, prioritized and queue
  modes, /dev/shm holds one staging ring (and one table) of the buffer at any time, without
  ``shmbuf gc``, and the pool's stats say what it reclaimed;
- a restarted prioritized learner adopts its predecessor's table and draws by the priorities
  the predecessor set (chi-square); a table that does not fit (another alpha) or a counted
  pool's (``Counted(k, ...)``, whose counts died with its learner) is removed instead; of two
  pools opening at once, exactly one adopts it;
- a live second pool on the same buffer keeps its segments; a dead pool of another buffer is
  left for ``gc``;
- in a /dev/shm just large enough for one buffer and one pool's segments (a private tmpfs in a
  mount namespace, as root; skipped where it cannot be made), ten crash and restart rounds
  succeed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import multiprocess
import numpy as np
import pytest

import shmbuf
from shmbuf import layout as L
from shmbuf.reclaim import remove_dead_segments, serves_buffer
from shmbuf.scan import scan
from tests import pool_procs as procs
from tests._helpers.processes import reap, reporting_child
from workers import SamplerPool
from workers.config import Workers
from workers.selection import Counted, Prioritized, Queue

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def learner(buf: shmbuf.ReplayBuffer | str, start_method: str, **kwargs: Any
            ) -> Iterator[dict[str, Any]]:
    """A learner process (``pool_procs.pool_process_main``) over ``buf``: yields its report;
    SIGKILLed on the way out, with its workers (whatever it leaves in /dev/shm stays)."""
    name = buf if isinstance(buf, str) else buf.name
    take, priorities = kwargs.pop("take", 1), kwargs.pop("priorities", None)
    info = None
    try:
        with reporting_child(multiprocess.get_context("spawn"), procs.pool_process_main, name,
                             start_method, False, kwargs, take, priorities,
                             what="the learner") as (proc, _, info):
            yield info
            os.kill(info["pid"], signal.SIGKILL)
            proc.join(10)
    finally:
        if info is not None:
            procs.kill_quietly(info["workers"])
            procs.wait_dead(info["workers"], 5)


def pool_segments(buffer: str) -> dict[int, list[str]]:
    """The staging rings and priority tables of pools over ``buffer`` in /dev/shm, by kind."""
    out: dict[int, list[str]] = {L.KIND_STAGING: [], L.KIND_PRIORITY: []}
    for info in scan():
        if info.header is not None and serves_buffer(info, buffer):
            out[info.header.kind].append(info.name)
    return out


@pytest.fixture
def buf():
    """One lane of 64 rows; what the test's dead learners left of it is removed at the end."""
    with procs.new_buffer(capacity=64, lanes=1) as b:
        try:
            yield b
        finally:
            remove_dead_segments(lambda info: serves_buffer(info, b.name))


MODES = {"uniform": {}, "prioritized": {"selection": Prioritized()},
         "queue": {"selection": Queue()}}


@pytest.mark.parametrize("mode", list(MODES))
def test_restarted_learners_leave_one_ring_and_one_table(buf, mode, start_method):
    """Three learners in a row, each SIGKILLed after its first batch: each new one removed its
    predecessor's ring (and adopted its table), so one of each is there at any time."""
    kwargs = dict(batch_size=8, workers=Workers(1, staging=2), seed=0, **MODES[mode])
    tables_seen = set()
    for round_ in range(3):
        with learner(buf, start_method, **kwargs) as info:
            segments = pool_segments(buf.name)
            assert segments[L.KIND_STAGING] == [info["staging"]], (round_, segments)
            expected_tables = [info["table"]] if mode == "prioritized" else []
            assert segments[L.KIND_PRIORITY] == expected_tables, (round_, segments)
            stats = info["stats"]
            assert stats["reclaimed_segments"] == (1 if round_ else 0), stats
            assert (stats["reclaimed_bytes"] > 0) == bool(round_)
            assert stats["adopted_priorities"] == (mode == "prioritized" and round_ > 0)
            tables_seen.add(info["table"])
    assert len(tables_seen) == 1  # the one table, adopted by each successor


def test_a_restarted_prioritized_learner_draws_by_its_predecessors_priorities(buf, start_method):
    """Learner A sets a priority for each of the 64 rows and is SIGKILLed. Learner B adopts its
    table: its draws follow A's priorities ** alpha (chi-square), not the fresh table's
    uniform maximum, and its importance weights are those of A's priorities."""
    from scipy import stats as st

    priorities = np.linspace(0.1, 6.4, 64)
    with learner(buf, start_method, batch_size=8, workers=Workers(1, staging=2),
                 selection=Prioritized(alpha=0.7), priorities=priorities.tolist()):
        pass
    with SamplerPool(buf, batch_size=256, selection=Prioritized(alpha=0.7, beta=1.0), workers=0,
                     seed=1) as pool:
        assert pool.stats()["adopted_priorities"]
        counts = np.zeros(64)
        for _ in range(200):
            batch = pool.next(timeout=5)
            np.add.at(counts, np.asarray(batch.indices), 1)
        probs = (priorities + 1e-6) ** 0.7
        probs /= probs.sum()
        p = st.chisquare(counts, counts.sum() * probs).pvalue
        assert p > 1e-4, (p, counts)
        # and it is not the uniform draw a fresh table would give
        assert st.chisquare(counts).pvalue < 1e-12
        w = np.asarray(batch.weights)
        expected = (probs[np.asarray(batch.indices)] / probs.min()) ** -1.0
        np.testing.assert_allclose(w, expected, rtol=1e-6)


@pytest.mark.parametrize("dead_one, new_one", [
    (Prioritized(alpha=0.3), Prioritized()),
    (Counted(100, Prioritized()), Counted(100, Prioritized())),
], ids=["alpha", "counted"])
def test_a_table_that_does_not_fit_is_removed_not_adopted(buf, dead_one, new_one, start_method):
    """A dead learner's table of another alpha, or a counted pool's (its counts died with it),
    is removed by the next pool, which builds its own."""
    kwargs = dict(batch_size=8, workers=Workers(1, staging=2))
    with learner(buf, start_method, selection=dead_one, **kwargs) as dead:
        pass
    with learner(buf, start_method, selection=new_one, **kwargs) as new:
        assert not new["stats"]["adopted_priorities"]
        assert new["table"] != dead["table"]
        assert pool_segments(buf.name)[L.KIND_PRIORITY] == [new["table"]]
        assert new["stats"]["reclaimed_segments"] == 2  # the dead ring and the dead table


def _adopt_when_told(conn: Any, buffer: str, barrier: Any) -> None:
    """Open a prioritized in-process pool on ``buffer`` at the barrier; report its table."""
    with SamplerPool(buffer, batch_size=8, selection=Prioritized(), workers=0) as pool:
        barrier.wait(30)
        conn.send((pool._table.name, pool.stats()["adopted_priorities"]))
        conn.recv()  # keep the pool open until the test has looked


def test_of_two_pools_opening_at_once_one_adopts(buf):
    """A dead learner's table and two new prioritized pools opening at the same moment (five
    rounds): exactly one adopts it, the other builds its own; neither fails."""
    ctx = multiprocess.get_context("fork")
    for _ in range(5):
        with learner(buf, "fork", batch_size=8, workers=Workers(1, staging=2),
                     selection=Prioritized()) as dead:
            pass
        barrier = ctx.Barrier(2)
        pipes, kids = [], []
        for _ in range(2):
            parent, child = ctx.Pipe()
            kids.append(ctx.Process(target=_adopt_when_told, args=(child, buf.name, barrier)))
            pipes.append(parent)
        for k in kids:
            k.start()
        try:
            got = [p.recv() if p.poll(30) else None for p in pipes]
            assert None not in got, got
            assert sorted(adopted for _, adopted in got) == [False, True], got
            adopter = next(name for name, adopted in got if adopted)
            assert adopter == dead["table"]
            assert len({name for name, _ in got}) == 2
        finally:
            for p in pipes:
                with contextlib.suppress(OSError):
                    p.send(None)
            reap(kids)
        remove_dead_segments(lambda info: serves_buffer(info, buf.name))


def test_a_live_pool_keeps_its_segments_and_another_buffers_dead_pool_is_left_for_gc(
        buf, start_method):
    """A new pool removes only dead learners' segments of its own buffer: a live second pool
    on the same buffer keeps its ring and table, and a dead pool of another buffer stays
    for ``gc``."""
    with procs.new_buffer(capacity=64, lanes=1) as other:
        try:
            with learner(other, start_method, batch_size=8, workers=Workers(1, staging=2),
                         selection=Prioritized()) as dead:
                pass
            with learner(buf, start_method, batch_size=8, workers=Workers(1, staging=2),
                         selection=Prioritized()) as live:
                with SamplerPool(buf, batch_size=8, selection=Prioritized(),
                                 workers=Workers(1, start_method=start_method)) as pool:
                    assert pool.stats()["reclaimed_segments"] == 0
                    assert not pool.stats()["adopted_priorities"]  # the live table is not free
                    names = {i.name for i in scan()}
                    assert {live["staging"], live["table"]} <= names
                    assert {dead["staging"], dead["table"]} <= names
            removed = remove_dead_segments(lambda info: serves_buffer(info, other.name))
            assert set(removed.names) == {dead["staging"], dead["table"]}
        finally:
            remove_dead_segments(lambda info: serves_buffer(info, other.name))


def _can_make_a_private_shm() -> str | None:
    """Why a private /dev/shm cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root to mount a private tmpfs on /dev/shm"
    if shutil.which("unshare") is None:
        return "needs unshare(1) (util-linux)"
    try:
        subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        "mount -t tmpfs -o size=1m tmpfs /dev/shm"], check=True,
                       capture_output=True, timeout=20)
    except (subprocess.SubprocessError, OSError) as e:
        return f"cannot make a mount namespace here: {e}"
    return None


@pytest.mark.parametrize("mode", ["uniform", "prioritized"])
def test_ten_restarts_in_a_shm_that_fits_one_pool(mode, start_method):
    """In a private /dev/shm sized for one buffer and one pool's segments (plus less than
    another ring), a learner SIGKILLed and restarted ten times opens every time: each new one
    reclaims its predecessor's ring (and adopts its table) before sizing its own. Every
    process of the test runs inside that mount namespace."""
    why = _can_make_a_private_shm()
    if why is not None:
        pytest.skip(why)
    script = ROOT / "tests" / "_helpers" / "restart_rounds.py"
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           "mount -t tmpfs -o size=256m tmpfs /dev/shm && exec \"$0\" \"$@\"",
           sys.executable, str(script), "--rounds", "10", "--mode", mode,
           "--start-method", start_method]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "10 rounds" in out.stdout, out.stdout
