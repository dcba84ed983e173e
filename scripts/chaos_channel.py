"""The chaos learner's channel to the harness: one AF_UNIX SOCK_SEQPACKET socketpair per learner
incarnation. Each record is one message (a pickled ``(kind, fields)``), so a learner killed
mid-send has sent a whole record or none, and the harness's end outlives the learner.

Records, learner to harness:

- READY: the pool is open: ``pid``, ``workers`` (their pids), ``lo_before`` / ``lo_after`` (each
  lane's oldest held row just before and just after the pool was made), ``segments`` (names
  of the pool's own segments);
- BATCH: one per batch, sent after it was checked: ``seq``, ``rows``, ``bad``, ``problems``,
  ``epoch`` and, where the harness keeps a ledger, ``lanes`` and ``anchors``;
- WORKERS: the worker pids changed (a worker was restarted);
- ERROR: the learner raised (``what``: "hang" for ``Timeout``, else the exception's type;
  ``text``: the traceback); it exits non-zero;
- DONE: it stopped or drained as asked, and closes its pool.

Harness to learner: STOP (close the pool and exit) and DRAIN (take batches until none comes
within the drain wait, then as STOP).
"""

from __future__ import annotations

import pickle
import socket
from typing import Any

READY, BATCH, WORKERS, ERROR, DONE = "ready", "batch", "workers", "error", "done"
STOP, DRAIN = "stop", "drain"
MAX_RECORD = 1 << 22  # bytes; a batch record of 1,024 anchors is about 13 KB


def pair() -> tuple[socket.socket, socket.socket]:
    """(harness end, learner end); the learner's end is inheritable (``pass_fds``)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.set_inheritable(True)
    ours.setblocking(False)
    return ours, theirs


def send(sock: socket.socket, kind: str, **fields: Any) -> None:
    """One record; blocks while the harness's receive queue is full (it drains it often)."""
    sock.send(pickle.dumps((kind, fields), protocol=pickle.HIGHEST_PROTOCOL))


def receive(sock: socket.socket) -> tuple[list[tuple[str, dict[str, Any]]], bool]:
    """Every record waiting on a non-blocking ``sock``, and whether the other side is gone
    (end-of-file: every copy of its end is closed)."""
    out: list[tuple[str, dict[str, Any]]] = []
    while True:
        try:
            data = sock.recv(MAX_RECORD)
        except (BlockingIOError, InterruptedError):
            return out, False
        except ConnectionResetError:
            return out, True
        if not data:
            return out, True
        out.append(decode(data))


def decode(data: bytes) -> tuple[str, dict[str, Any]]:
    """A record from its bytes."""
    kind, fields = pickle.loads(data)
    return str(kind), fields
