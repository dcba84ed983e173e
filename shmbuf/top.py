"""``shmbuf top``: a live view of every buffer and sampler pool of this user, from shared counters.

Buffers are read through ``ReplayBuffer.attach`` (lane words, limiter block); staging rings by
``pread`` of their stats line and slot states, placed by their layout JSON (``pool_stats``,
``slot_control``: this module imports nothing of ``workers``, which lays the ring out);
weight stores by ``pread`` of their control line (``shmbuf.weights_layout``).
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import termios
import time
import tty
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from . import layout as L
from .buffer import ReplayBuffer
from .errors import SegmentFormatError, ShmbufError
from .lease import is_locked
from .limiter import RateLimit
from .scan import SegmentInfo, open_regular, scan
from .segment import fmt_bytes
from .shmdir import SHM_DIR
from .weights_layout import CURRENT, PUBLISHED_NS, PUBLISHER_PID, tensors_of, weights_layout

MAX_LANES_SHOWN = 16  # per buffer; the rest are summed up in one line
MAX_CONTROL_LINES = 64  # per staging slot: a document claiming more is not read
MAX_STATS_LINES = 64  # a staging ring's pool stats: a document claiming more is not read
WRITING_WITHIN_S = 2.0  # a lane whose writer published this recently is "writing", else "idle"


@dataclass
class PoolCounters:
    """What a staging ring's shared memory says about its pool (its ``pool_stats`` words)."""

    name: str
    owner_pid: int
    alive: bool
    buffer: str
    batch_size: int
    n_slots: int
    slots: dict[str, int]  # slot state name -> slots in it
    batches: int
    wait_ns: int
    restarts: int
    workers: int
    reclaimed: int = 0  # segments of dead learners it removed at its start
    reclaimed_bytes: int = 0
    adopted: bool = False  # it took over a dead learner's priorities


def read_pool(info: SegmentInfo) -> PoolCounters | None:
    """The counters of the staging ring ``info``; None where its layout cannot be understood
    (an older ring without a ``pool_stats`` entry, or a malformed document).

    The layout document places everything read here: ``pool_stats`` (the stats lines right
    after the header, and the counters' names by word) and ``slot_control`` (lines per slot,
    the state word, the states' names by value). A counter it does not name reads as 0."""
    header = info.header
    if header is None or header.kind != L.KIND_STAGING:
        return None
    doc = header.doc
    stats_doc: Any = doc.get("pool_stats")
    control: Any = doc.get("slot_control")
    try:
        n_slots = int(doc["n_slots"])
        stats_lines, stat_names = int(stats_doc["lines"]), [str(n) for n in stats_doc["words"]]
        lines, state_word = int(control["lines"]), int(control["state"])
        states = [str(s) for s in control["states"]]
        base = L.header_size(len(L.encode_layout(doc)))
    except (KeyError, TypeError, ValueError):
        return None
    if not (0 < lines <= MAX_CONTROL_LINES and 0 <= state_word < lines
            and 0 < stats_lines <= MAX_STATS_LINES
            and len(stat_names) <= stats_lines * L.WORDS_PER_LINE):
        return None  # not a layout this version can read
    control_at = base + stats_lines * L.LINE
    fd = open_regular(os.path.join(SHM_DIR, info.name))
    if fd is None:
        return None
    try:
        stats_raw = os.pread(fd, stats_lines * L.LINE, base)
        control_raw = os.pread(fd, n_slots * lines * L.LINE, control_at)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(stats_raw) != stats_lines * L.LINE or len(control_raw) != n_slots * lines * L.LINE:
        return None
    words = np.frombuffer(control_raw, "<i8").reshape(n_slots, lines, L.WORDS_PER_LINE)
    values = words[:, state_word, 0]
    counts = {name: int((values == v).sum()) for v, name in enumerate(states)}
    stats = np.frombuffer(stats_raw, "<i8")
    stat = {name: int(stats[i]) for i, name in enumerate(stat_names)}
    return PoolCounters(
        name=info.name, owner_pid=header.owner_pid, alive=info.alive,
        buffer=str(doc.get("buffer", "?")), batch_size=int(doc.get("batch_size", 0)),
        n_slots=n_slots, slots=counts, batches=stat.get("batches", 0),
        wait_ns=stat.get("wait_ns", 0), restarts=stat.get("restarts", 0),
        workers=stat.get("workers", 0), reclaimed=stat.get("reclaimed", 0),
        reclaimed_bytes=stat.get("reclaimed_bytes", 0), adopted=bool(stat.get("adopted", 0)),
    )


@dataclass(frozen=True)
class WeightCounters:
    """What a weight store's control line says (``shmbuf.weights_layout``), read by ``pread``."""

    name: str
    owner_pid: int
    alive: bool  # owner lease held
    version: int  # newest complete version, 0 before the first publish
    publisher_pid: int  # 0: never published
    publisher_alive: bool  # publisher lease held
    published_ns: int  # time.time_ns() of the last publish
    tensors: int
    parameters: int


def read_weights(info: SegmentInfo) -> WeightCounters | None:
    """The counters of the weight store ``info`` (nothing mapped); None for another kind or a
    layout that cannot be understood (it is only shown, never acted on)."""
    header = info.header
    if header is None or header.kind != L.KIND_WEIGHTS:
        return None
    try:
        lay = weights_layout(tensors_of(info.name, header.doc),
                             len(L.encode_layout(header.doc)))
    except (SegmentFormatError, KeyError, TypeError, ValueError):
        return None
    fd = open_regular(os.path.join(SHM_DIR, info.name)) if lay.total_size == info.size else None
    if fd is None:
        return None
    try:
        raw = os.pread(fd, L.LINE, lay.control)
        publisher_alive = is_locked(fd, L.LOCK_PUBLISHER)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) != L.LINE:
        return None
    words = np.frombuffer(raw, "<i8")
    return WeightCounters(
        name=info.name, owner_pid=header.owner_pid, alive=info.alive,
        version=int(words[CURRENT]), publisher_pid=int(words[PUBLISHER_PID]),
        publisher_alive=publisher_alive, published_ns=int(words[PUBLISHED_NS]),
        tensors=len(lay.tensors),
        parameters=sum(int(np.prod(t.shape, dtype=np.int64)) for t in lay.tensors))


def limiter_state(limiter: dict[str, Any], batch_size: int = 1) -> str:
    """The rate limiter of a buffer in a few words, from ``Limiter.stats()``: ``off``, ``queue``,
    ``filling``, ``ok`` or who is blocked and by how much."""
    if not limiter["active"]:
        return "queue" if limiter["queue"] else "off"
    inserts, samples = int(limiter["inserts"]), int(limiter["samples"])
    spi = limiter["samples_per_insert"]
    limit = RateLimit(int(limiter["min_size"]), spi, float(limiter["tolerance"]))
    if inserts < limit.min_size:
        return f"filling: {inserts}/{limit.min_size} inserts (min_size)"
    if spi is None:
        return "ok"
    ratio = samples / max(inserts * spi, 1e-9)
    if not limit.can_sample(inserts, samples, max(batch_size, 1)):
        return f"blocked: samples ahead by {ratio:.2f}x"
    if not limit.can_insert(inserts, samples, 1):
        return f"writers blocked: inserts ahead by {1 / max(ratio, 1e-9):.2f}x"
    return f"ok: samples at {ratio:.2f}x of samples_per_insert={spi:g}"


def lane_state(lane: dict[str, Any], advanced: bool = False) -> str:
    """``writing`` or ``idle`` (a writer holds the lane), ``gone`` (its last writer left) or
    ``free`` (never written), from a lane of ``ReplayBuffer.stats()``; ``advanced``: its
    committed count grew since the last look (heartbeats are refreshed only now and then)."""
    age = lane["last_write_age_s"]
    if lane["writer_alive"]:
        recent = age is not None and age < WRITING_WITHIN_S
        return "writing" if advanced or recent else "idle"
    return "gone" if lane["writer_pid"] else "free"


@dataclass
class Top:
    """Frames of ``shmbuf top``: keeps buffers attached between frames and the counters of the
    last frame, for rates (inserts/s, batches/s, learner wait)."""

    buffers: dict[str, ReplayBuffer] = field(default_factory=dict)
    last: dict[str, tuple[float, int, int]] = field(default_factory=dict)  # name -> t, n, ns

    def _rate(self, key: str, now: float, count: int, wait_ns: int = 0) -> tuple[float, float]:
        """(count per second, waiting fraction) since the last frame (0 on the first)."""
        prev = self.last.get(key)
        self.last[key] = (now, count, wait_ns)
        if prev is None or now <= prev[0]:
            return 0.0, 0.0
        dt = now - prev[0]
        return (count - prev[1]) / dt, min(1.0, (wait_ns - prev[2]) / 1e9 / dt)

    def _buffer(self, name: str) -> ReplayBuffer:
        buf = self.buffers.get(name)
        if buf is None:
            buf = self.buffers[name] = ReplayBuffer.attach(name, timeout=0.0)
        return buf

    def frame(self) -> list[str]:
        """One screen: every buffer with its lanes, then every pool."""
        now = time.monotonic()
        infos = [i for i in scan() if i.header is not None]
        names = {i.name for i in infos}
        for gone in [n for n in self.buffers if n not in names]:
            self.buffers.pop(gone).close()
        pools = [p for i in infos if (p := read_pool(i)) is not None]
        batch_of = {p.buffer: p.batch_size for p in pools}
        out = [f"shmbuf top  {time.strftime('%H:%M:%S')}  "
               f"{sum(i.header.kind == L.KIND_BUFFER for i in infos if i.header)} buffer(s), "
               f"{len(pools)} pool(s)   q quits", ""]
        out.append(f"{'BUFFER':<28} {'FILL':>6} {'SIZE':>21} {'INSERTS/S':>10}  "
                   f"{'OWNER':<13} LIMITER")
        for info in infos:
            if info.header is not None and info.header.kind == L.KIND_BUFFER:
                out.extend(self._buffer_lines(info, now, batch_of.get(info.name, 1)))
        out += ["", f"{'POOL':<28} {'BUFFER':<28} {'BATCHES':>8} {'BATCH/S':>8} {'WAIT':>6}  "
                    f"{'WORKERS':>7} {'RESTARTS':>8}  STAGING"]
        for p in pools:
            rate, wait = self._rate(p.name, now, p.batches, p.wait_ns)
            owner = "" if p.alive else "  (owner dead)"
            slots = " ".join(f"{k} {v}" for k, v in p.slots.items() if v)
            out.append(f"{p.name:<28} {p.buffer:<28} {p.batches:>8} {rate:>8.1f} "
                       f"{wait:>6.1%}  {p.workers:>7} {p.restarts:>8}  "
                       f"{slots} (of {p.n_slots}){owner}")
            if p.reclaimed or p.adopted:
                took = "; took over a dead learner's priorities" if p.adopted else ""
                out.append(f"  reclaimed {p.reclaimed} segment(s) of dead learners "
                           f"({fmt_bytes(p.reclaimed_bytes)}){took}")
        out.extend(self._weights_lines(infos, now))
        return out

    def _weights_lines(self, infos: list[SegmentInfo], now: float) -> list[str]:
        """The weight stores, if any: version, publishes/s since the last frame, last publish."""
        stores = [w for i in infos if (w := read_weights(i)) is not None]
        if not stores:
            return []
        out = ["", f"{'WEIGHTS':<28} {'VERSION':>10} {'PUBLISH/S':>10} {'LAST':>10}  "
                   f"{'PUBLISHER':<16} {'OWNER':<13} TENSORS"]
        for w in stores:
            rate, _ = self._rate(w.name, now, w.version)
            last = (f"{max(0, time.time_ns() - w.published_ns) / 1e9:.1f}s ago"
                    if w.published_ns else "never")
            publisher = (f"{w.publisher_pid} {'alive' if w.publisher_alive else 'gone'}"
                         if w.publisher_pid else "-")
            owner = f"{w.owner_pid} {'alive' if w.alive else 'dead'}"
            out.append(f"{w.name:<28} {w.version:>10} {rate:>10.1f} {last:>10}  "
                       f"{publisher:<16} {owner:<13} {w.tensors} ({w.parameters} parameters)")
        return out

    def _buffer_lines(self, info: SegmentInfo, now: float, batch_size: int) -> list[str]:
        try:
            buf = self._buffer(info.name)
            stats = buf.stats()
            limiter = limiter_state(buf.storage.limiter.stats(), batch_size)
        except (ShmbufError, OSError, ValueError) as e:
            return [f"{info.name:<28} unreadable: {e}"]
        capacity = stats["capacity"] * stats["lanes"]
        rate, _ = self._rate(info.name, now, stats["committed"])
        owner = f"{stats['owner_pid']} {'alive' if stats['owner_alive'] else 'dead'}"
        out = [f"{info.name:<28} {stats['size'] / capacity:>6.1%} "
               f"{stats['size']:>10}/{capacity:<10} {rate:>10.1f}  {owner:<13} {limiter}"]
        for lane in stats["per_lane"][:MAX_LANES_SHOWN]:
            age = lane["last_write_age_s"]
            last = "" if age is None else f"  last write {age:.1f}s ago"
            pid = lane["writer_pid"] or "-"
            lane_rate, _ = self._rate(f"{info.name}/{lane['lane']}", now, lane["committed"])
            state = lane_state(lane, lane_rate > 0)
            out.append(f"  lane {lane['lane']:<4} pid {pid!s:<8} {state:<8} "
                       f"committed {lane['committed']}{last}")
        hidden = len(stats["per_lane"]) - MAX_LANES_SHOWN
        if hidden > 0:
            out.append(f"  ... {hidden} more lanes")
        return out

    def close(self) -> None:
        for buf in self.buffers.values():
            buf.close()
        self.buffers.clear()


def _wait_for_key(timeout: float) -> str:
    """A key typed within ``timeout`` seconds ('' if none, or stdin is not a terminal)."""
    if not sys.stdin.isatty():
        time.sleep(timeout)
        return ""
    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    return os.read(sys.stdin.fileno(), 32).decode(errors="replace") if ready else ""


def run(once: bool, interval: float, out: TextIO | None = None) -> int:
    """Draw frames every ``interval`` seconds until ``q`` (or Ctrl-C); ``once``: two samples
    ``interval`` apart (for the rates), one frame printed, no screen control."""
    out = sys.stdout if out is None else out
    top = Top()
    try:
        top.frame()
        if once:
            time.sleep(interval)
            print("\n".join(top.frame()), file=out, flush=True)
            return 0
        saved = termios.tcgetattr(sys.stdin) if sys.stdin.isatty() else None
        if saved is not None:
            tty.setcbreak(sys.stdin)
        try:
            while True:
                out.write("\x1b[H\x1b[2J" + "\n".join(top.frame()) + "\n")
                out.flush()
                if "q" in _wait_for_key(interval).lower():
                    return 0
        finally:
            if saved is not None:
                termios.tcsetattr(sys.stdin, termios.TCSADRAIN, saved)
    finally:
        top.close()


def cmd_top(args: argparse.Namespace) -> int:
    """``shmbuf top [--once] [--interval S]``."""
    return run(args.once, args.interval)


def register(sub: Any, interval_arg: Any) -> None:
    """Add ``top`` to the CLI's subcommands (``interval_arg`` parses the seconds)."""
    p = sub.add_parser("top", help="live view of every buffer and pool (q quits)")
    p.add_argument("--once", action="store_true",
                   help="print one frame (rates over one interval) and exit, for scripts")
    p.add_argument("--interval", type=interval_arg, default=1.0,
                   help="seconds between frames (default 1)")
    p.set_defaults(func=cmd_top)
