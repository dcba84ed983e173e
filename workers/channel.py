"""Learner <-> worker messages: fixed-size records over an AF_UNIX SOCK_SEQPACKET socketpair,
and a wake-up eventfd from parent to child.

One ``send`` is one record and one ``recv`` returns exactly one, so there is no framing to get
torn; a dead peer reads as end-of-file, so a worker notices its learner's death (and the learner
its worker's) without any shared lock. Each hop costs one syscall on each side (~2 us), where a
``multiprocess`` Connection builds a new selector on every poll (~20-50 us).

The parent wakes a child blocked in ``wait`` by writing the channel's eventfd (``wake``), not by
a record: the write allocates no socket buffer and is a plain wake-up, where a socket's carries
the kernel's "sync" hint, which can place the child on the waker's CPU. Measured on a 2-core
VM, a record cost the learner 30-35 us and the eventfd 12-15 us (docs/design.md, "Where measurement moved us").
"""

from __future__ import annotations

import os
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


class ChildEnd:
    """The child's end of a channel: its socket and its own descriptor of the wake-up eventfd.
    Passed to the child process as an argument: inherited under fork; under spawn and
    forkserver, multiprocess duplicates both into the child (the socket by its own reducer, the
    eventfd by ``DupFd``). The parent closes its copy once the child has started."""

    def __init__(self, sock: socket.socket, wake_fd: int) -> None:
        self.sock, self.wake_fd = sock, wake_fd

    def __reduce__(self) -> Any:
        from multiprocess.reduction import DupFd

        return _rebuild_child_end, (self.sock, DupFd(self.wake_fd))

    def channel(self) -> Channel:
        """In the child: the channel this end opens."""
        return Channel(self.sock, self.wake_fd)

    def close(self) -> None:
        """In the parent, after the child started."""
        self.sock.close()
        if self.wake_fd >= 0:
            os.close(self.wake_fd)
            self.wake_fd = -1


def _rebuild_child_end(sock: socket.socket, wake: Any) -> ChildEnd:
    return ChildEnd(sock, wake.detach())


class Channel:
    """One end of a learner-worker socketpair, with the wake-up eventfd (written by the parent's
    end, waited on and drained by the child's)."""

    def __init__(self, sock: socket.socket, wake_fd: int = -1) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.wake_fd = wake_fd

    @classmethod
    def pair(cls) -> tuple[Channel, ChildEnd]:
        """(this process's end, the end to hand to the child process)."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            try:
                # The child's own descriptor: a fork's at-fork hook closes the parent's in it
                return cls(a, wake), ChildEnd(b, os.dup(wake))
            except BaseException:
                os.close(wake)
                raise
        except BaseException:
            a.close()
            b.close()
            raise

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def send(self, op: int, a: int = 0, b: int = 0) -> None:
        """Send one record. Raises OSError if the peer is gone."""
        self.sock.send(MSG.pack(op, a, b))

    def send_text(self, op: int, text: str) -> None:
        data = text.encode("utf-8", "replace")[-MAX_TEXT:]
        self.sock.send(MSG.pack(op, 0, 0) + data)

    def wake(self) -> None:
        """End the child's ``wait`` (or its next one). Nothing once this end is closed."""
        if self.wake_fd >= 0:
            os.eventfd_write(self.wake_fd, 1)

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
        """Block up to ``timeout`` seconds until a record (or end-of-file) can be read, or the
        parent's ``wake``; a wake-up is consumed here."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        if self.wake_fd >= 0:
            poller.register(self.wake_fd, select.POLLIN)
        ready = bool(poller.poll(max(0, int(timeout * 1000))))
        if self.wake_fd >= 0:
            try:
                os.eventfd_read(self.wake_fd)
            except BlockingIOError:
                pass
        return ready

    def close(self) -> None:
        if self.fd >= 0:
            self.fd = -1
            self.sock.close()
        if self.wake_fd >= 0:
            os.close(self.wake_fd)
            self.wake_fd = -1

    def __getstate__(self) -> Any:
        raise TypeError("a Channel stays in the process that made it; pass its child end")
