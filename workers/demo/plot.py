"""Throughput over time as a picture (``shmbuf demo --plot out.png``): inserts/s, batches/s and
learner wait, sampled from shared memory by a thread while the demo runs, drawn when it ends.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmbuf import ReplayBuffer, layout
from shmbuf.scan import scan
from shmbuf.top import read_pool

SAMPLE_EVERY_S = 0.5


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` (headless), or SystemExit saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'shmbuf[plot]'") from None
    return plt


@dataclass
class ThroughputRecorder:
    """Samples the buffer and pool this process owns every ``every`` seconds, in a thread:
    (seconds since start, inserts/s, batches/s, learner wait fraction)."""

    every: float = SAMPLE_EVERY_S
    samples: list[tuple[float, float, float, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="shmbuf-plot", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:  # it wakes from its wait on the event at once
            self._thread.join(timeout=max(5.0, 4 * self.every))

    def _counters(self, buffers: dict[str, ReplayBuffer]) -> tuple[int, int, int]:
        """(rows committed, batches delivered, learner wait ns) of this process's segments."""
        me, inserts, batches, wait_ns = os.getpid(), 0, 0, 0
        for info in scan():
            if info.header is None or info.header.owner_pid != me:
                continue
            if info.header.kind == layout.KIND_BUFFER:
                if info.name not in buffers:
                    buffers[info.name] = ReplayBuffer.attach(info.name, timeout=0.0)
                inserts += int(np.sum(buffers[info.name].committed()))
            elif (pool := read_pool(info)) is not None:
                batches, wait_ns = batches + pool.batches, wait_ns + pool.wait_ns
        return inserts, batches, wait_ns

    def _run(self) -> None:
        buffers: dict[str, ReplayBuffer] = {}
        start = last_t = time.monotonic()
        try:
            last = self._counters(buffers)
            while not self._stop.wait(self.every):
                now, counts = time.monotonic(), self._counters(buffers)
                dt = now - last_t
                self.samples.append((now - start, (counts[0] - last[0]) / dt,
                                     (counts[1] - last[1]) / dt,
                                     min(1.0, (counts[2] - last[2]) / 1e9 / dt)))
                last_t, last = now, counts
        finally:
            for buf in buffers.values():
                buf.close()

    def draw(self, path: str, title: str = "shmbuf demo") -> None:
        """Three panels over time: inserts/s, batches/s, learner wait %."""
        plt = require_matplotlib()
        t = [s[0] for s in self.samples]
        fig, axes = plt.subplots(3, 1, sharex=True, figsize=(8, 7))
        panels = [("inserts/s", 1, 1.0), ("batches/s", 2, 1.0), ("learner wait %", 3, 100.0)]
        for ax, (label, column, scale) in zip(axes, panels):
            ax.plot(t, [s[column] * scale for s in self.samples])
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].set_title(title)
        axes[-1].set_xlabel("seconds")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def plots_throughput(run: Callable[[Any], int]) -> Callable[[Any], int]:
    """Decorates the demo's ``run(args)``: with ``args.plot`` set, throughput is recorded while
    it runs and drawn to that file at the end (matplotlib is checked before anything starts)."""

    @functools.wraps(run)
    def plotted(args: Any) -> int:
        path = getattr(args, "plot", None)
        if not path:
            return run(args)
        require_matplotlib()
        recorder = ThroughputRecorder()
        recorder.start()
        try:
            code = run(args)
        finally:
            recorder.stop()
        recorder.draw(path)
        print(f"throughput plot: {path} ({len(recorder.samples)} samples)")
        return code

    return plotted
