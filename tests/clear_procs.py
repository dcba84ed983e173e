"""Child-process entry points for tests/test_clear_live.py: writers that hold a lane of a buffer
(attached by name) while the test clears it. Importable as ``tests.clear_procs`` under every
start method.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import shmbuf
from tests.pool_procs import make_batch, make_row


def streaming_writer(conn: Any, name: str, lane: int, ready_after: int) -> None:
    """Add self-checking rows to ``lane`` one at a time (the compiled ``add``), plus an
    ``extend`` of 7 now and then, ending an episode every 50 rows, until the parent sends
    anything; report ``"ready"`` once ``ready_after`` rows are in, and the rows written at the
    end."""
    buf = shmbuf.ReplayBuffer.attach(name)
    try:
        with buf.writer(lane=lane) as w:
            i = w.committed
            reported = False
            while True:
                if i % 64 == 0:
                    w.extend(make_batch(lane, np.arange(i, i + 7)))
                    i += 7
                w.add(**make_row(lane, i))
                i += 1
                if i % 50 == 0:
                    w.end_episode()
                if not reported and i >= ready_after:
                    conn.send("ready")
                    reported = True
                if i % 16 == 0 and conn.poll():
                    break
            conn.send(i)
    finally:
        buf.close()


def commanded_writer(conn: Any, name: str, lane: int) -> None:
    """Hold ``lane`` and do what the parent says: ``("add", n)`` appends n self-checking rows,
    ``("end",)`` ends the episode, ``("stop",)`` closes; each command is answered with the
    writer's ``committed`` (or the episode id ``end_episode`` returned)."""
    buf = shmbuf.ReplayBuffer.attach(name)
    try:
        with buf.writer(lane=lane) as w:
            conn.send(w.committed)
            while True:
                cmd = conn.recv()
                if cmd[0] == "add":
                    for _ in range(cmd[1]):
                        w.add(**make_row(lane, w.committed))
                    conn.send(w.committed)
                elif cmd[0] == "end":
                    conn.send(w.end_episode())
                else:
                    conn.send(w.committed)
                    return
    finally:
        buf.close()
