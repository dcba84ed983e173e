"""``buffer_stats``: the snapshot ``ReplayBuffer.stats()`` returns, and ``transitions``, what
``len(buf)`` counts; read from a storage's lane words, windows, meta words and segment header
(loads only; a writer is never waited for).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from . import layout as L
from .checks import ring_segments

if TYPE_CHECKING:
    from .sampling import Windows
    from .storage import BufferStorage


def buffer_stats(storage: BufferStorage) -> dict[str, Any]:
    """Per-lane counters and writer liveness (this process's writers too), totals, insert rate
    since the segment was created."""
    hdr = storage.segment.header
    win = storage.windows()
    now = time.time()
    q = storage.words
    per_lane = []
    for k in range(storage.lanes):
        hb = q[storage.word_index(k, L.LANE_HEARTBEAT)]
        per_lane.append(
            {
                "lane": k,
                "committed": int(win.hi[k]),
                "size": int(win.hi[k] - win.lo[k]),
                "writer_alive": storage.segment.probe(L.lock_lane(k)),  # this process's too
                "writer_pid": storage.writer_pid(k),
                "epoch": q[storage.word_index(k, L.LANE_EPOCH)],
                "episode": q[storage.word_index(k, L.LANE_EPISODE)],
                "last_write_age_s": (now - hb / 1e9) if hb else None,
            }
        )
    total = int(win.hi.sum())
    elapsed = max(now - hdr.created, 1e-9)
    return {
        "name": storage.name,
        "owner_pid": hdr.owner_pid,
        "owner_alive": storage.segment.owner_alive(),
        "capacity": storage.capacity,
        "lanes": storage.lanes,
        "size": transitions(storage, win),  # transitions, as len(buf)
        "rows": win.total,  # with derived next_obs, also each episode's final-observation row
        "committed": total,
        "inserts_per_s": total / elapsed,
        "age_s": elapsed,
        "nbytes": storage.layout.total_size,
        "per_lane": per_lane,
    }


def transitions(storage: BufferStorage, windows: Windows | None = None) -> int:
    """Transitions readable now over all lanes: the windows' rows, less the FINAL rows
    (episodes' final observations) of ``next_obs="derived"`` buffers. There that costs a
    pass over the held rows' meta words (a snapshot: loads only, nothing waits)."""
    win = storage.windows() if windows is None else windows
    if not storage.derived_next_obs:
        return win.total
    finals = 0
    for k in range(storage.lanes):
        lo, n = int(win.lo[k]), int(win.hi[k] - win.lo[k])
        base = k * storage.capacity
        for a, b, _ in ring_segments(lo, n, storage.capacity) if n > 0 else ():
            finals += int(np.count_nonzero(storage.meta[base + a : base + b] & L.FLAG_FINAL))
    return win.total - finals
