#!/usr/bin/env python
"""The chaos harness's learner, in its own process so that the harness can SIGKILL and restart it
on the same buffer: it attaches the buffer by name, opens a ``SamplerPool`` on it, checks every
batch (``chaos_checks``) and reports each one to the harness (``chaos_channel``) once checked.

    python scripts/chaos_learner.py '{"buffer": "shmbuf-buf-...", "mode": "queue", "fd": 5, ...}'

SIGUSR1 dumps every thread's stack to stderr (``faulthandler``): the harness sends it to a
learner that makes no progress, before it fails the run.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import socket
import sys
import time
import traceback
from typing import Any

import chaos_channel as ch
import numpy as np
from chaos_checks import BatchChecker
from chaos_modes import LEDGER_EPOCH, LEDGER_NONE, MODES, Mode, row_scheme

from shmbuf import RateLimit, ReplayBuffer
from shmbuf.errors import Timeout
from workers import SamplerPool
from workers.config import Workers

WORKERS_EVERY = 0.2  # seconds between looks at the worker pids
WAIT_SLICE = 0.25  # seconds next() waits before the learner looks for the harness's orders


class EpochBounds:
    """An epoch holds only rows present when it began: each lane's ``committed`` read when its
    first batch arrived bounds the anchors of all its batches (within one learner's life)."""

    def __init__(self, buf: ReplayBuffer) -> None:
        self.buf = buf
        self.epoch = -1
        self.bound = np.zeros(buf.lanes, np.int64)

    def problems(self, epoch: int | None, lanes: np.ndarray, anchors: np.ndarray) -> list[str]:
        if epoch is None:
            return ["an epoch pool delivered a batch without batch.epoch"]
        out = []
        if epoch < self.epoch:
            out.append(f"a batch of epoch {epoch} came after epoch {self.epoch} had begun "
                       f"(batch.epoch went back; pool.epoch() would mix the two epochs)")
        elif epoch > self.epoch:
            self.epoch = epoch
            self.bound = np.asarray(self.buf.committed(), np.int64).copy()
        late = anchors >= self.bound[lanes]
        if late.any():
            b = int(np.flatnonzero(late)[0])
            out.append(f"epoch {epoch} delivered lane {lanes[b]} row {anchors[b]}, written after "
                       f"the epoch began (lane committed {self.bound[lanes[b]]} at its first batch)")
        return out


class Orders:
    """What the harness asked for (STOP, DRAIN), read without waiting."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.stop = self.drain = False

    def read(self) -> None:
        while not self.stop:
            try:
                data = self.sock.recv(ch.MAX_RECORD, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            kind = ch.decode(data)[0] if data else ch.STOP  # end-of-file: the harness is gone
            self.stop |= kind == ch.STOP
            self.drain |= kind == ch.DRAIN


def take(pool: SamplerPool, orders: Orders, cfg: dict[str, Any]) -> Any:
    """The next batch, or None once stopped or drained (no batch for ``drain_wait`` seconds
    after DRAIN). Waits in slices of ``WAIT_SLICE``, so that an order is seen within one.

    Raises:
        Timeout: no batch for ``hang_timeout`` seconds (a hang).
    """
    start = time.monotonic()
    while True:
        orders.read()
        if orders.stop:
            return None
        try:
            return pool.next(timeout=WAIT_SLICE)
        except Timeout as e:
            waited = time.monotonic() - start
            if orders.drain and waited >= cfg["drain_wait"]:
                return None  # drained: fewer than a batch's rows are left
            if waited >= cfg["hang_timeout"]:
                raise Timeout(f"no batch within {waited:.0f} s: {e}") from None


def run(cfg: dict[str, Any], sock: socket.socket) -> None:
    mode: Mode = MODES[cfg["mode"]]
    checker = BatchChecker(mode, row_scheme(cfg["payload"]))
    rng = np.random.default_rng(cfg["seed"])
    ledger = mode.ledger != LEDGER_NONE
    orders = Orders(sock)
    seq = 0
    with ReplayBuffer.attach(cfg["buffer"]) as buf:
        lo_before = buf.windows().lo.tolist()
        with SamplerPool(buf, batch_size=cfg["batch_size"], limit=RateLimit(cfg["batch_size"]),
                         workers=Workers(cfg["workers"], start_method=cfg["start_method"],
                                         max_restarts_per_minute=10_000),
                         seed=cfg["seed"], **mode.pool) as pool:
            workers = pool.worker_pids
            ch.send(sock, ch.READY, workers=workers, lo_before=lo_before,
                    lo_after=buf.windows().lo.tolist())
            epochs = EpochBounds(buf) if mode.ledger == LEDGER_EPOCH else None
            next_look = time.monotonic() + WORKERS_EVERY
            while (batch := take(pool, orders, cfg)) is not None:
                verdict = checker.check(batch)
                lanes = np.asarray(batch.lanes, np.int64)
                indices = np.asarray(batch.indices, np.int64)
                anchors = indices[:, 0] if indices.ndim == 2 else indices
                if epochs is not None:
                    verdict.problems += epochs.problems(batch.epoch, lanes, anchors)
                if mode.prioritized:
                    pool.update_priorities(batch.indices, rng.random(indices.shape) + 0.01,
                                           batch.lanes)
                ch.send(sock, ch.BATCH, seq=seq, rows=verdict.rows, bad=verdict.bad,
                        problems=verdict.problems, epoch=batch.epoch,
                        lanes=lanes.astype(np.int32) if ledger else None,
                        anchors=anchors if ledger else None)
                seq += 1
                if cfg["train_step"] > 0:  # a kill then mostly finds a batch held and reported
                    time.sleep(cfg["train_step"])
                now = time.monotonic()
                if now >= next_look:
                    next_look = now + WORKERS_EVERY
                    if pool.worker_pids != workers:
                        workers = pool.worker_pids
                        ch.send(sock, ch.WORKERS, workers=workers)
    ch.send(sock, ch.DONE, batches=seq)


def main(argv: list[str]) -> int:
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    cfg = json.loads(argv[1])
    sock = socket.socket(fileno=cfg["fd"])
    sock.setblocking(True)
    try:
        run(cfg, sock)
    except BaseException as e:
        what = "hang" if isinstance(e, Timeout) else type(e).__name__
        try:
            ch.send(sock, ch.ERROR, what=what, text=traceback.format_exc())
        except OSError:
            pass
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
