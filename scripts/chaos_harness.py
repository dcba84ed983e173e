"""The chaos harness behind ``scripts/stress.py --chaos``: one mode's run.

The harness owns the buffer and the actors (an ``ActorGroup``); the learner runs in its own
process (``chaos_learner.py``), attaches the buffer by name and opens a ``SamplerPool`` on it,
so the harness can SIGKILL it and start another on the same buffer. Meanwhile actors and sampler
workers are SIGKILLed at random, and any of them, the learner included, is paused with SIGSTOP
for a while (``chaos_signals``). Each learner checks every batch and reports it over a socket
that outlives it (``chaos_channel``); the harness keeps the ledger (``chaos_ledger``), watches
for hangs, counts the buffer's segments in /dev/shm after every learner start, and at the end
runs ``shmbuf gc`` and checks that nothing of the buffer is left (``chaos_report``).
"""

from __future__ import annotations

import functools
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import chaos_channel as ch
import numpy as np
from chaos_actor import ActorErrors, chaos_actor
from chaos_ledger import Ledger
from chaos_modes import LEDGER_NONE, LEDGER_QUEUE, MAX_TIMES, MODES, Mode, row_scheme, spec_fields
from chaos_report import SHM_DIR, ChaosConfig, Summary, gc_and_check, segments_of
from chaos_signals import Chaos, Target, open_child, signal_fd

from shmbuf import ReplayBuffer, Spec
from shmbuf.errors import ActorError
from workers import ActorGroup

LEARNER = str(Path(__file__).resolve().parent / "chaos_learner.py")
MAX_CRASHES = 5  # learner lives that ended on their own before the mode gives up
REPORT_EVERY = 5.0  # seconds between progress lines
NEVER = float("inf")


class Learner:
    """One learner incarnation ("life"): its process, its channel, what it has reported."""

    def __init__(self, cfg: ChaosConfig, buffer: str, life: int) -> None:
        self.life = life
        self.sock, theirs = ch.pair()
        args = {"buffer": buffer, "mode": cfg.mode, "fd": theirs.fileno(),
                "payload": cfg.payload, "batch_size": cfg.batch_size, "workers": cfg.workers,
                "seed": cfg.seed * 100_003 + life, "start_method": cfg.start_method,
                "hang_timeout": cfg.hang_timeout, "drain_wait": cfg.drain_wait,
                "train_step": cfg.train_step}
        self.proc = subprocess.Popen([sys.executable, LEARNER, json.dumps(args)],
                                     pass_fds=[theirs.fileno()])
        theirs.close()
        self.pidfd = open_child(self.proc.pid, os.getpid())
        self.last_progress = time.monotonic()  # its start, READY, or its last batch
        self.ready = self.done = False
        self.workers: list[int] = []
        self.error: str | None = None
        self.batches = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.pidfd is not None:
            signal_fd(self.pidfd, sig)

    def reap(self, timeout: float) -> int | None:
        """Its exit code, waiting up to ``timeout``; None if it still runs."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """Kill it if it still runs, reap it, close its pidfd and channel. Idempotent."""
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.reap(10)
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self.sock.close()


class ChaosRun:
    """Runs one mode for ``cfg.seconds`` under chaos and checks it (``run()`` -> ``Summary``)."""

    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.mode: Mode = MODES[cfg.mode]
        self.summary = s = Summary(cfg.mode)
        self.chaos = Chaos(random.Random(cfg.seed), cfg.stop_for, s.kills, s.stops, self.event)
        self.rng = random.Random(cfg.seed + 1)
        self.ledger = Ledger(self.mode.ledger, cfg.actors, cfg.batch_size, MAX_TIMES)
        self.buf: ReplayBuffer | None = None
        self.group: ActorGroup | None = None
        self.learner: Learner | None = None
        self.lives = self.crashes = 0
        self.drained = False
        self.actor_errors = ActorErrors()
        self.t0 = time.monotonic()

    def event(self, what: str) -> None:
        if self.cfg.log_events:
            print(f"  event [{self.cfg.mode}] {time.monotonic() - self.t0:8.3f} s: {what}",
                  flush=True)

    # -- the run -------------------------------------------------------------------------------------
    def run(self) -> Summary:
        cfg, mode = self.cfg, self.mode
        shm_before = set(os.listdir(SHM_DIR))
        actor = functools.partial(chaos_actor, rows=row_scheme(cfg.payload), derived=mode.derived,
                                  max_extend=cfg.max_extend, longest_episode=cfg.longest_episode,
                                  errors=self.actor_errors.path)
        print(f"chaos [{cfg.mode}]: {cfg.actors} actors x {cfg.workers} workers, "
              f"{cfg.seconds:g} s, SIGKILL every {cfg.kill_every:g} s"
              + (f", SIGSTOP every {cfg.stop_every:g} s for {cfg.stop_for} s, learner SIGKILL "
                 f"every {cfg.learner_kill_every} s" if cfg.chaos else "")
              + f", pool {mode.pool}, next_obs {'derived' if mode.derived else 'stored'}",
              flush=True)
        self.t0 = time.monotonic()
        name, committed = None, None
        try:
            with ReplayBuffer.create(Spec(spec_fields(cfg.payload)), capacity=cfg.capacity,
                                     lanes=cfg.actors,
                                     next_obs="derived" if mode.derived else "stored") as buf:
                self.buf, name = buf, buf.name
                self.start_learner()
                if self.wait_ready():
                    committed = self.run_actors(actor)
            if committed is not None and mode.ledger != LEDGER_NONE:
                self.judge_ledger(committed)
        finally:
            self.chaos.resume_due(everything=True)
            if self.learner is not None:
                self.learner.close()
            self.actor_errors.cleanup()
        return self.finish(shm_before, name)

    def run_actors(self, actor: Any) -> np.ndarray:
        """The run proper, once the first learner's pool is open; returns each lane's committed
        rows once the actors stopped."""
        cfg, buf = self.cfg, self.buf
        assert buf is not None
        with ActorGroup(actor, cfg.actors, buf, start_method=cfg.start_method,
                        seed=cfg.seed, max_restarts_per_minute=10_000) as group:
            self.group = group
            self.loop()
            self.chaos.resume_due(everything=True)
            self.wind_down()
        self.check_actor_errors()
        committed = np.asarray(buf.committed(), np.int64).copy()
        self.summary.rows_written = int(committed.sum())
        return committed

    def loop(self) -> None:
        """Chaos for ``cfg.seconds``: take the learner's records, restart what dies."""
        cfg, chaos = self.cfg, self.chaos
        t0 = now = time.monotonic()
        next_kill = now + cfg.kill_every if cfg.kill_every > 0 else NEVER
        next_stop = now + cfg.stop_every if cfg.chaos and cfg.stop_every > 0 else NEVER
        learner_kill, next_report = self.learner_kill_at(now), now + REPORT_EVERY
        while now - t0 < cfg.seconds:
            lr = self.learner
            assert lr is not None and self.group is not None
            select.select([lr.sock], [], [], 0.01)
            self.take_records(lr)
            try:
                self.group.poll()
            except ActorError as e:
                self.summary.fail(f"an actor failed past its restarts: {e}")
                return
            now = time.monotonic()
            for resumed in chaos.resume_due():  # a learner's silence while paused was ours
                resumed.last_progress = max(resumed.last_progress, now)
            if lr.proc.poll() is not None or self.check_hang(lr):  # died (or hung) by itself
                self.event(f"learner life {lr.life} pid {lr.pid} ended or hung on its own "
                           f"(exit {lr.proc.poll()})")
                self.end_learner(killed=False)
                self.crashes += 1
                if self.crashes >= MAX_CRASHES:
                    self.summary.fail(f"{self.crashes} learner lives ended on their own: "
                                      f"giving up")
                    return
                self.start_learner()
                learner_kill = NEVER
            elif lr.ready and learner_kill == NEVER:
                learner_kill = self.learner_kill_at(now)
            elif now >= learner_kill:
                self.event(f"SIGKILL learner life {lr.life} pid {lr.pid} after {lr.batches} "
                           f"batches")
                lr.signal(signal.SIGKILL)
                self.summary.kills["learner"] += 1
                self.end_learner(killed=True)
                self.start_learner()
                learner_kill = NEVER
            if now >= next_kill:
                next_kill = now + cfg.kill_every
                chaos.kill_one(self.targets(with_learner=False))
            if now >= next_stop:
                next_stop = now + cfg.stop_every
                chaos.stop_one(self.targets(with_learner=True), self.learner)
            if now >= next_report:
                next_report = now + REPORT_EVERY
                self.check_actor_errors()
                self.report(now - t0)

    def targets(self, with_learner: bool) -> list[Target]:
        """(kind, pid, parent) of every process chaos may hit now."""
        assert self.group is not None
        me = os.getpid()
        out = [("actor", pid, me) for pid in self.group.pids if pid]
        lr = self.learner
        if lr is not None and lr.ready:
            out += [("worker", pid, lr.pid) for pid in lr.workers]
            if with_learner:
                out.append(("learner", lr.pid, me))
        return out

    def learner_kill_at(self, now: float) -> float:
        span, lr = self.cfg.learner_kill_every, self.learner
        if not self.cfg.chaos or span is None or lr is None or not lr.ready:
            return NEVER
        return now + self.rng.uniform(*span)

    def report(self, elapsed: float) -> None:
        s, buf = self.summary, self.buf
        assert buf is not None
        print(f"  [{s.mode}] {elapsed:5.1f} s: {s.batches:,} batches, {s.rows_verified:,} rows "
              f"verified, {int(buf.committed().sum()):,} written, kills {dict(s.kills)}, "
              f"SIGSTOPs {dict(s.stops)}, learner restarts {s.learner_restarts}, segments "
              f"{s.segments[-1:]}", flush=True)

    # -- learner lives -------------------------------------------------------------------------------
    def start_learner(self) -> None:
        assert self.buf is not None
        if self.lives:
            self.summary.learner_restarts += 1
        self.learner = Learner(self.cfg, self.buf.name, self.lives)
        self.event(f"learner life {self.lives} started, pid {self.learner.pid}")
        self.lives += 1

    def wait_ready(self) -> bool:
        lr = self.learner
        assert lr is not None
        deadline = time.monotonic() + self.cfg.hang_timeout
        while not lr.ready and time.monotonic() < deadline and lr.proc.poll() is None:
            select.select([lr.sock], [], [], 0.05)
            self.take_records(lr)
        self.take_records(lr)
        if not lr.ready:
            self.summary.fail(f"the first learner never opened its pool (exit code "
                              f"{lr.proc.poll()})")
        return lr.ready

    def end_learner(self, killed: bool) -> None:
        """Reap the current learner (SIGKILLed if it still runs), take its last records and
        close its life in the ledger; ``killed``: the harness SIGKILLed it."""
        lr = self.learner
        assert lr is not None
        if lr.proc.poll() is None:
            lr.signal(signal.SIGKILL)
        code = lr.reap(10.0)
        self.take_records(lr)  # a dead learner has sent all it ever will
        if lr.ready:
            self.ledger.end_life(killed)
        if not killed and code != 0 and not lr.error:
            self.summary.fail(f"learner life {lr.life} (pid {lr.pid}) exited with {code} "
                              f"without reporting an error")
        self.chaos.forget(lr)
        lr.close()
        self.learner = None

    def take_records(self, lr: Learner) -> None:
        records, _ = ch.receive(lr.sock)
        for kind, f in records:
            if kind == ch.READY:
                self.on_ready(lr, f)
            elif kind == ch.BATCH:
                self.on_batch(lr, f)
            elif kind == ch.WORKERS:
                lr.workers = list(f["workers"])
                self.event(f"learner life {lr.life}: workers now {lr.workers}")
            elif kind == ch.ERROR:
                lr.error = f["text"]
                self.summary.hangs += f["what"] == "hang"
                if not self.summary.quiet:
                    print(f["text"], file=sys.stderr, flush=True)
                self.summary.fail(f"learner life {lr.life} raised {f['what']}: "
                                  f"{f['text'].strip().splitlines()[-1]}")
            elif kind == ch.DONE:
                lr.done = True

    def on_ready(self, lr: Learner, f: dict[str, Any]) -> None:
        assert self.buf is not None
        lr.ready, lr.workers = True, list(f["workers"])
        lr.last_progress = time.monotonic()
        self.event(f"learner life {lr.life} ready: workers {lr.workers}, oldest rows "
                   f"{f['lo_before']} -> {f['lo_after']}")
        if self.mode.ledger != LEDGER_NONE:
            self.ledger.begin_life(f["lo_before"], f["lo_after"])
        segments = segments_of(self.buf.name)
        self.summary.segments.append(len(segments))
        limit = self.cfg.max_segments
        if limit is not None and len(segments) > limit:
            self.summary.fail(f"{len(segments)} segments of the buffer in {SHM_DIR} once learner "
                              f"life {lr.life} was ready (--max-segments {limit}): {segments}")

    def on_batch(self, lr: Learner, f: dict[str, Any]) -> None:
        s = self.summary
        lr.batches += 1
        lr.last_progress = time.monotonic()
        s.batches += 1
        s.rows_verified += f["rows"]
        s.bad_rows += f["bad"]
        for problem in f["problems"]:
            s.fail(f"learner life {lr.life} batch {f['seq']}: {problem}")
        if f["lanes"] is not None:
            self.ledger.record(f["lanes"], f["anchors"], f["epoch"])

    def check_hang(self, lr: Learner) -> bool:
        """True (and the run fails) if ``lr`` made no progress for ``hang_timeout`` seconds
        while not paused: its stack is dumped first (SIGUSR1: its ``faulthandler``)."""
        silent = time.monotonic() - lr.last_progress
        if silent < self.cfg.hang_timeout or self.chaos.holds(lr) or lr.error is not None:
            return False  # (a learner that reported its own Timeout was counted then)
        print(f"--- learner life {lr.life} (pid {lr.pid}) made no progress for {silent:.0f} s; "
              f"its stack:", file=sys.stderr, flush=True)
        lr.signal(signal.SIGUSR1)
        time.sleep(1.0)
        lr.error = "hang"  # (then SIGKILLed: no second failure for its exit)
        self.summary.hangs += 1
        self.summary.fail(f"hang: learner life {lr.life} made no progress for {silent:.0f} s "
                          f"(ready: {lr.ready}, batches: {lr.batches}; stack dumped above)")
        return True

    def check_actor_errors(self) -> None:
        """FAIL on every traceback an actor wrote before it died of an exception."""
        for text in self.actor_errors.new():
            if not self.summary.quiet:
                print(text, file=sys.stderr, flush=True)
            lines = text.strip().splitlines()
            self.summary.fail(f"{lines[0].rstrip(':')} raised {lines[-1]}")

    # -- the end -------------------------------------------------------------------------------------
    def wind_down(self) -> None:
        """After the chaos: the queue's last learner drains it once the actors stopped; any
        other learner stops. Either must then report DONE and exit by itself."""
        assert self.group is not None
        queue = self.mode.ledger == LEDGER_QUEUE
        if queue:
            self.group.stop(timeout=10.0)
        lr = self.learner
        if lr is None or lr.proc.poll() is not None:
            if lr is not None:
                self.end_learner(killed=False)
            self.start_learner()
            lr = self.learner
            assert lr is not None
        ch.send(lr.sock, ch.DRAIN if queue else ch.STOP)
        deadline = time.monotonic() + self.cfg.hang_timeout + self.cfg.drain_wait + 10
        while not lr.done and time.monotonic() < deadline and lr.proc.poll() is None:
            select.select([lr.sock], [], [], 0.05)
            self.take_records(lr)
            if self.check_hang(lr):
                break
        self.take_records(lr)
        self.drained = lr.done
        what = "drain" if queue else "stop"
        if not lr.done:
            self.summary.fail(f"the last learner (life {lr.life}) did not finish its {what}")
        elif lr.reap(15.0) is None:
            self.summary.fail(f"the last learner (life {lr.life}) did not exit after its {what}")
        self.end_learner(killed=False)
        self.group.stop(timeout=10.0)

    def judge_ledger(self, committed: np.ndarray) -> None:
        s = self.summary
        v = self.ledger.verdict(committed, self.drained)
        s.duplicates, s.excused_duplicates = v.duplicates, v.excused_duplicates
        s.gaps, s.lost, s.tail = v.gaps, v.lost, v.tail
        for line in v.failures:
            s.fail(line)

    def finish(self, shm_before: set[str], name: str | None) -> Summary:
        s = self.summary
        if name is not None:
            gc_and_check(name, shm_before, s)
        if s.batches == 0:
            s.fail("no batch was delivered")
        print(s.line(), flush=True)
        print(("PASS" if s.passed else f"FAIL ({len(s.failures)} failures)") + f" [{s.mode}]",
              flush=True)
        return s
