"""Learner <-> worker messages: fixed-size records over an AF_UNIX SOCK_SEQPACKET socketpair.

One ``send`` is one record and one ``recv`` returns exactly one, so there is no framing to get
torn; a dead peer reads as end-of-file, so a worker notices its learner's death (and the learner
its worker's) without any shared lock. Each hop costs one syscall on each side (~2 us), where a
``multiprocess`` Connection builds a new selector on every poll (~20-50 us).
"""

from __future__ import annotations

import select
import socket
import struct
from typing import Any

MSG = struct.Struct("<qqq")  # op, a, b
# Records every supervised child understands (each child kind adds its own ops, all distinct):
# child -> parent HELLO (set up), ERROR (traceback text), DONE (returned normally);
# parent -> child STOP.
OP_HELLO, OP_ERROR, OP_DONE, OP_STOP = 1, 3, 5, 11
MAX_TEXT = 48 * 1024  # tracebacks longer than this keep their tail


class Channel:
    """One end of a learner-worker socketpair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()

    @classmethod
    def pair(cls) -> tuple[Channel, socket.socket]:
        """(this process's end, the socket to hand to the child process)."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        return cls(a), b

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def send(self, op: int, a: int = 0, b: int = 0) -> None:
        """Send one record. Raises OSError if the peer is gone."""
        self.sock.send(MSG.pack(op, a, b))

    def send_text(self, op: int, text: str) -> None:
        data = text.encode("utf-8", "replace")[-MAX_TEXT:]
        self.sock.send(MSG.pack(op, 0, 0) + data)

    def receive(self) -> tuple[list[tuple[int, int, int, bytes]], bool]:
        """Every record waiting now, without blocking, and whether the peer has hung up."""
        out: list[tuple[int, int, int, bytes]] = []
        recv = self.sock.recv
        while True:
            try:
                data = recv(MSG.size + MAX_TEXT, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return out, False
            except OSError:
                return out, True
            if not data:
                return out, True
            op, a, b = MSG.unpack_from(data)
            out.append((op, a, b, data[MSG.size :]))

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until a record (or end-of-file) can be read."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000))))

    def close(self) -> None:
        if self.fd >= 0:
            self.fd = -1
            self.sock.close()

    def __getstate__(self) -> Any:
        raise TypeError("a Channel stays in the process that made it; pass its child socket")
