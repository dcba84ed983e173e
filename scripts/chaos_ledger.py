"""The harness's ledger of the rows each learner incarnation ("life") reported, and what must hold
across them: exactly once for the queue (across learner restarts too), at most once per epoch
and at most k times within one life. Pure bookkeeping on NumPy arrays, no I/O.

The queue's rules, per lane, from the records the learners sent after checking each batch:

- duplicates: a row delivered twice is excused only if its first delivery was in the last
  batch a SIGKILLed learner reported (the batch it held when it died: at least once for that
  one batch) and its second in a later life; every other repeat is a failure;
- gaps: every row from the first learner's oldest row to the lane's last committed row must be
  delivered, except, after the final drain, fewer than one batch's rows in all (the queue hands
  out whole batches only);
- lost: rows overwritten while no learner could take them (past what the lives before learner
  j delivered, and below the oldest row held once learner j's pool was open). Writers wait on
  the queue's consumed cursors, also while no learner lives (issue 27.1), so these are failures
  too unless ``Ledger(lost_ok=True)``: counted apart because the cause differs (writers not held
  back, rather than a pool that skipped rows it could read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from chaos_modes import LEDGER_EPOCH, LEDGER_MAX_TIMES, LEDGER_QUEUE

LANE_SHIFT = 44  # key = lane << LANE_SHIFT | index
MAX_LISTED = 5  # intervals or rows named per failure line


@dataclass
class Life:
    """One learner incarnation: where its pool began and what it delivered."""

    lo_before: np.ndarray
    lo_after: np.ndarray
    killed: bool = False  # SIGKILLed by the harness (its last batch may come again)
    keys: list[np.ndarray] = field(default_factory=list)  # one array per batch, in order
    epochs: list[int] = field(default_factory=list)


@dataclass
class LedgerVerdict:
    """What the ledger found: counts for the summary and FAIL lines."""

    duplicates: int = 0  # repeats that are failures
    excused_duplicates: int = 0  # the held batch of a killed learner, delivered again
    gaps: int = 0  # rows never delivered that should have been
    lost: int = 0  # rows overwritten while no learner could take them
    tail: int = 0  # rows left after the final drain (fewer than a batch: excused)
    failures: list[str] = field(default_factory=list)


class Ledger:
    """Rows delivered per life, for one mode's ``ledger`` kind ("queue", "epoch", "max_times")."""

    def __init__(self, kind: str, lanes: int, batch_size: int, max_times: int = 0,
                 lost_ok: bool = False) -> None:
        self.kind, self.lanes, self.batch_size, self.max_times = kind, lanes, batch_size, max_times
        self.lost_ok = lost_ok
        self.lives: list[Life] = []

    def begin_life(self, lo_before: list[int], lo_after: list[int]) -> None:
        self.lives.append(Life(np.asarray(lo_before, np.int64), np.asarray(lo_after, np.int64)))

    def record(self, lanes: np.ndarray, anchors: np.ndarray, epoch: int | None) -> None:
        """A batch of the current life."""
        keys = (np.asarray(lanes, np.int64) << LANE_SHIFT) | np.asarray(anchors, np.int64)
        life = self.lives[-1]
        life.keys.append(keys)
        life.epochs.append(-1 if epoch is None else int(epoch))

    def end_life(self, killed: bool) -> None:
        if self.lives:
            self.lives[-1].killed = killed

    def verdict(self, committed: np.ndarray, drained: bool) -> LedgerVerdict:
        """Check the whole run; ``committed``: each lane's rows at the end (after the actors
        stopped); ``drained``: the last learner took batches until none was left."""
        v = LedgerVerdict()
        if self.kind == LEDGER_QUEUE:
            self._order(v)
            self._duplicates(v)
            self._gaps(v, np.asarray(committed, np.int64), drained)
        elif self.kind == LEDGER_EPOCH:
            self._per_epoch(v)
        elif self.kind == LEDGER_MAX_TIMES:
            self._max_times(v)
        return v

    # -- the queue ---------------------------------------------------------------------------------
    def _deliveries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, life of each, whether it is in the last batch of a killed life), in time order."""
        keys, lives, held = [], [], []
        for j, life in enumerate(self.lives):
            for b, k in enumerate(life.keys):
                keys.append(k)
                lives.append(np.full(k.size, j))
                held.append(np.full(k.size, life.killed and b == len(life.keys) - 1))
        if not keys:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool)
        return np.concatenate(keys), np.concatenate(lives), np.concatenate(held)

    def _order(self, v: LedgerVerdict) -> None:
        """Oldest first: within one life, each lane's rows come in increasing order."""
        for j, life in enumerate(self.lives):
            if not life.keys:
                continue
            keys = np.concatenate(life.keys)
            for lane in np.unique(keys >> LANE_SHIFT):
                index = keys[(keys >> LANE_SHIFT) == lane] & ((1 << LANE_SHIFT) - 1)
                back = np.flatnonzero(np.diff(index) <= 0)
                if back.size:
                    i = int(back[0])
                    v.failures.append(f"queue delivered lane {lane} out of order in learner "
                                      f"life {j}: row {index[i + 1]} after row {index[i]} "
                                      f"({back.size} time(s))")

    def _duplicates(self, v: LedgerVerdict) -> None:
        keys, lives, held = self._deliveries()
        order = np.argsort(keys, kind="stable")  # each key's deliveries stay in time order
        k, life, h = keys[order], lives[order], held[order]
        first = np.r_[True, k[1:] != k[:-1]] if k.size else np.zeros(0, bool)
        starts = np.flatnonzero(first)
        counts = np.diff(np.r_[starts, k.size])
        repeated = counts > 1
        twice = counts == 2
        s = starts[twice]
        excused = h[s] & (life[s + 1] > life[s])
        v.excused_duplicates = int(excused.sum())
        v.duplicates = int((counts[repeated] - 1).sum()) - v.excused_duplicates
        if v.duplicates:
            bad = repeated.copy()
            bad[np.flatnonzero(twice)[excused]] = False
            first, times = starts[bad], counts[bad]
            runs = _runs(k[first])
            listed = "; ".join(
                f"lane {lane} rows {a}..{b} ({b - a + 1}), the first of them in learner lives "
                f"{life[first[at] : first[at] + times[at]].tolist()}"
                for lane, a, b, at in runs[:MAX_LISTED])
            v.failures.append(f"queue delivered {v.duplicates} row(s) more than once (beyond the "
                              f"batch a killed learner held) in {len(runs)} run(s): {listed}")

    def _gaps(self, v: LedgerVerdict, committed: np.ndarray, drained: bool) -> None:
        keys, lives, _ = self._deliveries()
        if not self.lives:
            return
        lanes = keys >> LANE_SHIFT
        index = keys & ((1 << LANE_SHIFT) - 1)
        gaps: list[tuple[int, int, int]] = []  # (lane, a, b): rows a..b-1 never delivered
        tails: list[tuple[int, int, int]] = []  # the same, after the lane's last delivered row
        for lane in range(self.lanes):
            mine = lanes == lane
            first = int(self.lives[0].lo_before[lane])
            excuse = self._excused_intervals(lane, index[mine], lives[mine], first)
            got = np.unique(index[mine])
            starts = np.r_[first, got + 1]  # the rows missing: [starts, ends)
            ends = np.r_[got, max(first, int(committed[lane]))]
            keep = ends > starts
            starts, ends = starts[keep], ends[keep]
            for a, b in excuse:
                v.lost += int(np.clip(np.minimum(ends, b) - np.maximum(starts, a), 0, None).sum())
            last = int(got[-1]) if got.size else first - 1
            for a, b in _subtract(list(zip(starts.tolist(), ends.tolist())), excuse):
                (tails if a > last else gaps).append((lane, a, b))
        if v.lost and not self.lost_ok:
            v.failures.append(f"queue lost {v.lost} row(s): writers overwrote them while no "
                              f"learner lived, before any learner consumed them")
        tail = sum(b - a for _, a, b in tails)
        if drained and tail < self.batch_size:
            v.tail = tail  # fewer than a batch in all: the queue could not hand them out
        elif tail:
            gaps += tails
            why = "the final drain did not finish" if not drained else \
                f"{tail} rows, at least a batch ({self.batch_size})"
            v.failures.append(f"queue left rows undelivered at the end: {why}")
        v.gaps = sum(b - a for _, a, b in gaps)
        if v.gaps:
            named = "; ".join(f"lane {k} rows {a}..{b - 1} ({b - a})"
                              for k, a, b in gaps[:MAX_LISTED])
            v.failures.append(f"queue never delivered {v.gaps} row(s) it could have delivered "
                              f"({len(gaps)} gap(s)), e.g. {named}")

    def _excused_intervals(self, lane: int, index: np.ndarray, lives: np.ndarray, first: int
                           ) -> list[tuple[int, int]]:
        """Rows of ``lane`` overwritten while no learner could take them: for each life j, from
        past the last row the lives before it delivered to the oldest row held once its pool
        was open. Merged, sorted intervals [a, b)."""
        out = []
        frontier = first - 1
        for j, life in enumerate(self.lives):
            out.append((frontier + 1, int(life.lo_after[lane])))
            mine = index[lives == j]
            if mine.size:
                frontier = max(frontier, int(mine.max()))
        return _merge([(a, b) for a, b in out if b > a])

    # -- epochs and max_times_sampled, within one life ----------------------------------------------
    def _per_epoch(self, v: LedgerVerdict) -> None:
        for j, life in enumerate(self.lives):
            if not life.keys:
                continue
            keys = np.concatenate(life.keys)
            epochs = np.concatenate([np.full(k.size, e) for k, e in zip(life.keys, life.epochs)])
            pairs = np.unique(np.stack([epochs, keys]), axis=1)
            repeats = keys.size - pairs.shape[1]
            if repeats:
                v.duplicates += repeats
                v.failures.append(f"learner life {j}: {repeats} row(s) delivered twice within "
                                  f"one epoch")

    def _max_times(self, v: LedgerVerdict) -> None:
        for j, life in enumerate(self.lives):
            if not life.keys:
                continue
            keys, counts = np.unique(np.concatenate(life.keys), return_counts=True)
            over = counts > self.max_times
            if over.any():
                v.duplicates += int((counts[over] - self.max_times).sum())
                i = int(np.flatnonzero(over)[0])
                v.failures.append(
                    f"learner life {j}: {int(over.sum())} row(s) delivered more than "
                    f"max_times_sampled={self.max_times} times, e.g. lane "
                    f"{int(keys[i]) >> LANE_SHIFT} row {int(keys[i]) & ((1 << LANE_SHIFT) - 1)} "
                    f"{int(counts[i])} times")


def _runs(keys: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Sorted ``keys`` as runs of consecutive rows of one lane: (lane, first, last, position of
    the first in ``keys``)."""
    if not keys.size:
        return []
    cut = np.flatnonzero(np.diff(keys) != 1) + 1
    out = []
    for at, end in zip(np.r_[0, cut], np.r_[cut, keys.size]):
        first, last = int(keys[at]), int(keys[end - 1])
        mask = (1 << LANE_SHIFT) - 1
        out.append((first >> LANE_SHIFT, first & mask, last & mask, int(at)))
    return out


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _subtract(intervals: list[tuple[int, int]], holes: list[tuple[int, int]]
              ) -> list[tuple[int, int]]:
    """``intervals`` less the merged ``holes`` (both [a, b), sorted)."""
    out = []
    for a, b in intervals:
        for c, d in holes:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out
