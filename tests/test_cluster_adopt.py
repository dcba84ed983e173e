"""``BufferStorage.adopt``: a restarted host takes over the segment its dead predecessor owned
(rows, lanes and writers untouched), and only then: a live owner's segment is refused with
nothing changed. No Ray needed; runs under fork, forkserver and spawn.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest

import shmbuf
from shmbuf import scan as segment_scan
from shmbuf import segment, shmdir
from shmbuf.storage import BufferStorage
from tests._helpers.processes import wait_dead
from tests._helpers.rows import RowScheme

ROWS = RowScheme(payload_words=4)
pytestmark = pytest.mark.timeout(90)


def _owner(conn: Any, rows: int) -> None:
    """Create a buffer with ``rows`` self-checking rows on lane 1, report its name, wait."""
    buf = shmbuf.ReplayBuffer.create(ROWS.fields, capacity=64, lanes=2)
    with buf.writer(lane=1) as w:
        w.extend(ROWS.batch(1, np.arange(rows)))
    conn.send(buf.name)
    conn.poll(60)


def _adopt_and_exit(conn: Any, name: str) -> None:
    """Adopt ``name`` and return without closing it (exit must unlink it, as for a creator)."""
    buf = shmbuf.ReplayBuffer(BufferStorage.adopt(name))
    conn.send(len(buf))


def _start_owner(mp: Any, rows: int) -> tuple[Any, Any, str]:
    parent, child = mp.Pipe()
    proc = mp.Process(target=_owner, args=(child, rows))
    proc.start()
    child.close()
    assert parent.poll(60), "the owner never reported"
    return proc, parent, parent.recv()


def test_adopt_takes_over_a_dead_owners_segment_with_its_rows(mp):
    proc, parent, name = _start_owner(mp, 40)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert not {i.name: i.alive for i in segment_scan.scan()}[name]  # leaked, for now
        buf = shmbuf.ReplayBuffer(BufferStorage.adopt(name))
        try:
            assert buf.is_owner and len(buf) == 40 and int(buf.committed(1)) == 40
            assert not ROWS.bad_rows(buf.get(np.arange(40), 1)).any()
            info = {i.name: i for i in segment_scan.scan()}[name]
            assert info.alive and info.header.owner_pid == os.getpid()
            with buf.writer(lane=1) as w:  # the lane goes on where it stopped
                w.extend(ROWS.batch(1, np.arange(40, 50)))
            assert int(buf.committed(1)) == 50
        finally:
            buf.close()
        assert name not in {i.name for i in segment_scan.scan()}  # the adopter unlinks it
    finally:
        parent.close()
        shmdir.unlink(name)


def test_adopt_refuses_a_live_owners_segment_and_changes_nothing(mp):
    proc, parent, name = _start_owner(mp, 10)
    try:
        seg = segment.Segment.attach(name)
        before = bytes(seg.buf)
        with pytest.raises(shmbuf.SegmentExistsError, match="live owner"):
            BufferStorage.adopt(name)
        assert bytes(seg.buf) == before
        seg.close()
        assert {i.name: i.alive for i in segment_scan.scan()}[name]
    finally:
        parent.send("done")
        proc.join(30)
        parent.close()
        shmdir.unlink(name)


def test_adopt_of_a_missing_segment_is_a_typed_error():
    with pytest.raises(shmbuf.SegmentNotFoundError):
        BufferStorage.adopt("shmbuf-no-such-segment-for-adopt")


def test_an_adopter_that_exits_unlinks_like_a_creator(mp):
    proc, parent, name = _start_owner(mp, 5)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        p2, c2 = mp.Pipe()
        adopter = mp.Process(target=_adopt_and_exit, args=(c2, name))
        adopter.start()
        c2.close()
        assert p2.poll(60) and p2.recv() == 5
        adopter.join(30)
        assert not wait_dead([adopter.pid], 10)
        assert name not in {i.name for i in segment_scan.scan()}
        p2.close()
    finally:
        parent.close()
        shmdir.unlink(name)
