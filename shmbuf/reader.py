"""Reads planned batches (sequences, frame stacks, n-step returns, derived next_obs) from a buffer.

Each batch row has an anchor (lane, logical index) and a *probe*: the rows at offsets
``P = [p_lo, p_hi]`` around it that any of its arrays may read. Per round the reader

1. draws anchors uniformly over the lanes' windows;
2. loads the probe rows' stamps, then their ``_meta`` words (and, for n-step, rewards and
   terminated flags), and decides which anchors are usable and what their masks are;
3. gathers every output array for the usable anchors;
4. loads the stamps again: a probe row inside the window whose stamp changed was being
   overwritten, so its anchor is redrawn.

Rows outside the window are never read (their positions are masked), so nothing uncommitted,
being written or overwritten can reach a batch, and the work per batch does not depend on the
buffer's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import layout as L
from .errors import SamplingError
from .sampling import Draw, Windows, draw_uniform
from .sampling.framestack import stack_mask, stack_offsets
from .sampling.nstep import nstep_discount, nstep_extent, nstep_return
from .sampling.plan import DISCOUNT, MASK, STEPS, Compiled
from .sampling.sequence import sequence_masks, strict_tail
from .slots import held_stamps, load_stamps, overwritten_since, reload_stamps

if TYPE_CHECKING:
    from .storage import BufferStorage


@dataclass
class _Selection:
    """Anchors judged usable from their first stamp/meta read, with what was read."""

    lanes: np.ndarray  # [n]
    anchors: np.ndarray  # [n]
    rows: np.ndarray  # [n, P] logical indices (out-of-window positions hold the anchor)
    slots: np.ndarray  # [n, P]
    held: np.ndarray  # [n, P] readable at the first read
    before: np.ndarray  # [n, P] stamps at the first read
    same: np.ndarray  # [n, P] readable and in the anchor's episode (FINAL rows included)
    step0: np.ndarray  # [n] the anchor's step in its episode
    masks: dict[str, np.ndarray]  # output masks
    end: np.ndarray  # [n] offset of the transition's last step (n-step), else 0
    m: np.ndarray | None = None  # n-step extents
    rewards: np.ndarray | None = None  # [n, n_step]
    term_last: np.ndarray | None = None  # [n]
    cache: dict | None = None  # fill's per-batch slot matrices and padding

    def take(self, keep: np.ndarray) -> _Selection:
        pick = {k: (v[keep] if isinstance(v, np.ndarray) else v) for k, v in self.__dict__.items()
                if k not in ("masks", "cache")}
        return _Selection(masks={k: v[keep] for k, v in self.masks.items()}, **pick)

    @staticmethod
    def concat(parts: list[_Selection]) -> _Selection:
        first = parts[0]
        fields = {}
        for k, v in first.__dict__.items():
            if k in ("masks", "cache"):
                continue
            fields[k] = None if v is None else np.concatenate([getattr(p, k) for p in parts])
        masks = {k: np.concatenate([p.masks[k] for p in parts]) for k in first.masks}
        return _Selection(masks=masks, **fields)


class PlanReader:
    """Reads batches of one compiled plan from one buffer."""

    def __init__(self, storage: BufferStorage, compiled: Compiled) -> None:
        self.storage = storage
        self.c = c = compiled
        plan = c.plan
        self.T = plan.sequence_length
        self.n = plan.n_step
        self.k = plan.frame_stack
        self.needs_next = c.want_next_obs and c.derived_next_obs
        if self.T > 1:
            p_lo, p_hi = 0, self.T - 1 + int(self.needs_next)
        else:
            p_lo = -(self.k - 1) if plan.stacks else 0
            p_hi = max(plan.frame_lookahead, self.n - 1 + int(self.needs_next))
        self.offsets = np.arange(p_lo, p_hi + 1, dtype=np.int64)
        self.j0 = -p_lo  # column of offset 0
        self.tail = strict_tail(self.T, self.needs_next) if (self.T > 1 and not plan.cross_episodes) else 0
        spec = storage.spec
        self.stack_offs = stack_offsets(self.k, plan.frame_lookahead) if plan.stacks else None
        self._seq_offs = [np.arange(self.T) + s for s in (0, 1)]
        self.next_stack = (plan.stacks and c.want_next_obs and plan.obs_field in plan.stack_fields)
        self.term_field = plan.terminated_field if self.n > 1 else None
        self.trunc_field = "truncated" if (self.n > 1 and "truncated" in spec) else None

    # -- selection ---------------------------------------------------------------------------------
    def _probe(self, draw: Draw, win: Windows, want: int) -> _Selection | None:
        storage, C = self.storage, self.storage.capacity
        anchors = draw.indices
        rows = anchors[:, None] + self.offsets[None, :]
        lo = win.lo[draw.lanes][:, None]
        hi = win.hi[draw.lanes][:, None]
        inwin = (rows >= lo) & (rows < hi)
        rows = np.where(inwin, rows, anchors[:, None])
        slots = rows % C
        if storage.lanes > 1:
            slots += (draw.lanes * C)[:, None]
        before = load_stamps(storage.stamps, slots)  # stamps first ...
        meta = storage.meta[slots]  # ... then what they guard
        held = inwin & (before == held_stamps(rows))
        ep = meta >> L.STEP_BITS
        final = (meta & L.FLAG_FINAL) != 0
        j0 = self.j0
        same = held & (ep == ep[:, j0 : j0 + 1])
        trans = same & ~final
        ok = trans[:, j0].copy()
        step0 = meta[:, j0] & L.STEP_MASK
        masks: dict[str, np.ndarray] = {}
        n = len(anchors)
        end = np.zeros(n, np.int64)
        sel = _Selection(draw.lanes, anchors, None, slots, held, before, None, None, masks, end)
        if self.T > 1:
            valid = trans[:, j0 : j0 + self.T].copy()
            if self.needs_next:
                valid &= same[:, j0 + 1 : j0 + 1 + self.T]
            ok2, masks[MASK] = sequence_masks(valid, self.c.plan.cross_episodes)
            return sel.take(np.flatnonzero(ok & ok2)[:want])
        if self.n > 1:
            cols = self.storage.columns
            win_slots = slots[:, j0 : j0 + self.n]
            term = cols[self.term_field][win_slots].astype(bool)
            rewards = cols[self.c.plan.reward_field][win_slots]
            if self.needs_next:
                next_known = same[:, j0 + 1 : j0 + 1 + self.n]
            else:
                next_known = np.ones((n, self.n), bool)
            m = nstep_extent(trans[:, j0 : j0 + self.n], term, next_known)
            ok &= m > 0
            end = np.maximum(m - 1, 0)
            sel.end, sel.m, sel.rewards = end, m, rewards
            sel.term_last = term[np.arange(n), end]
        elif self.needs_next:
            ok &= same[:, j0 + 1]
        if self.stack_offs is not None:
            cols_idx = j0 + self.stack_offs
            # Frames are steps: an episode's FINAL row (derived next_obs) is not a look-ahead
            # frame, so both next_obs modes stack the same frames, and fields other than obs
            # (zero in a FINAL row) are never marked valid there.
            ok_s, smask = stack_mask(step0, self.stack_offs, trans[:, cols_idx])
            ok &= ok_s
            for f in self.c.plan.stack_fields:
                masks[f"{f}_mask"] = smask
            if self.next_stack:
                offs = self.stack_offs[self.stack_offs <= 0][1:]  # -(k-2) .. 0
                cols_e = j0 + end[:, None] + offs[None, :]
                ok_n, nmask = stack_mask(step0 + end, offs, np.take_along_axis(same, cols_e, 1))
                ok &= ok_n
                masks[f"{self.c.plan.next_obs_field}_mask"] = np.concatenate(
                    [nmask, np.ones((n, 1), bool)], axis=1)
        return sel.take(np.flatnonzero(ok)[:want])

    def _select(self, count: int, rng: np.random.Generator, max_rounds: int) -> _Selection:
        parts: list[_Selection] = []
        have = 0
        for _ in range(max_rounds):
            win = self.storage.windows()
            want = count - have
            # Some anchors get rejected (episode ends, FINAL rows): draw a few extra per round.
            lo, hi = int(win.lo[0]), int(win.hi[0]) - self.tail
            if self.storage.lanes == 1 and hi > lo:
                u = rng.integers(0, hi - lo, size=want + want // 4 + 4, dtype=np.int64)
                u += lo
                draw = Draw(np.zeros(u.size, np.int64), u)
            else:
                draw = draw_uniform(Windows(win.lo, np.maximum(win.hi - self.tail, win.lo)),
                                    want + want // 4 + 4, rng)
            sel = self._probe(draw, win, want)
            if len(sel.anchors):
                parts.append(sel)
                have += len(sel.anchors)
            if have >= count:
                sel = _Selection.concat(parts) if len(parts) > 1 else parts[0]
                return sel  # every part holds at most the rows still wanted
        raise SamplingError(
            f"found only {have} of {count} usable rows in {max_rounds} rounds of draws: "
            f"{self._why()}"
        )

    def _why(self) -> str:
        plan = self.c.plan
        if self.T > 1 and not plan.cross_episodes:
            return (f"few windows of {self.T} steps lie inside one episode (episodes shorter "
                    f"than sequence_length?). Fix: cross_episodes=True, or a shorter sequence")
        if self.needs_next:
            return ("next_obs is derived, so only steps whose next observation is written can "
                    "be drawn: call writer.end_episode() at episode ends")
        return "the rows needed keep being overwritten or are not written yet"

    # -- gathering -------------------------------------------------------------------------------------
    def _rows_at(self, sel: _Selection, offs: np.ndarray, base: np.ndarray | None = None
                 ) -> np.ndarray:
        """Probe columns for offsets (per anchor if 2-D) -> slots [n, len(offs)], computed once
        per batch (``sel.cache``)."""
        key = (offs.tobytes(), base is not None)
        got = sel.cache.get(key)
        if got is None:
            got = sel.cache[key] = self._rows_at_uncached(sel, offs, base)
        return got

    def _rows_at_uncached(self, sel: _Selection, offs: np.ndarray, base: np.ndarray | None
                          ) -> np.ndarray:
        if base is None and offs.size > 1 and offs[-1] - offs[0] == offs.size - 1:
            return np.ascontiguousarray(sel.slots[:, self.j0 + offs[0] : self.j0 + offs[-1] + 1])
        cols = self.j0 + (offs if base is None else base[:, None] + offs[None, :])
        if cols.ndim == 1:
            return sel.slots[:, cols]
        return np.take_along_axis(sel.slots, cols, 1)

    def _pad(self, sel: _Selection, name: str) -> np.ndarray | None:
        key = ("pad", name)
        if key not in sel.cache:
            sel.cache[key] = _pad_of(sel.masks[name])
        return sel.cache[key]

    def _gather(self, col: np.ndarray, slots: np.ndarray, dst: np.ndarray,
                pad: np.ndarray | None) -> None:
        """``dst[...] = col[slots]`` (dst shaped like slots + the row shape), zeros where
        ``mask`` is false. Contiguous destinations are gathered into directly."""
        if dst.flags.c_contiguous:
            flat = dst.reshape(slots.size, *col.shape[1:])
            np.take(col, slots.reshape(-1), axis=0, out=flat, mode="clip")
            if pad is not None:
                flat[pad] = 0
        else:
            dst[...] = np.take(col, slots.reshape(-1), axis=0, mode="clip").reshape(dst.shape)
            if pad is not None:
                dst[np.unravel_index(pad, slots.shape)] = 0

    def fill(self, sel: _Selection, out: dict[str, np.ndarray]) -> None:
        """Gather every output array of ``sel`` into ``out`` (arrays of len(sel) rows)."""
        plan, c, cols = self.c.plan, self.c, self.storage.columns
        obs, nxt = plan.obs_field, plan.next_obs_field
        n = len(sel.anchors)
        j = np.zeros(n, np.int64)
        sel.cache = {}
        for name, _, _ in c.outputs:
            dst = out[name]
            if name == MASK or name.endswith("_mask"):
                dst[...] = sel.masks[name]
            elif self.T > 1:
                src, shift = (obs, 1) if (name == nxt and c.derived_next_obs) else (name, 0)
                slots = self._rows_at(sel, self._seq_offs[shift])
                self._gather(cols[src], slots, dst, self._pad(sel, MASK))
            elif name == DISCOUNT:
                dst[...] = nstep_discount(sel.term_last, sel.m, plan.gamma)
            elif name == STEPS:
                dst[...] = sel.m
            elif self.n > 1 and name == plan.reward_field:
                dst[...] = nstep_return(sel.rewards, sel.m, plan.gamma)
            elif name == nxt:
                self._fill_next(sel, dst, out)
            elif self.stack_offs is not None and name in plan.stack_fields:
                slots = self._rows_at(sel, self.stack_offs)
                self._gather(cols[name], slots, dst, self._pad(sel, f"{name}_mask"))
            elif name in (self.term_field, self.trunc_field):
                self._gather(cols[name], self._rows_at(sel, j[:1], self._end(sel)), dst[:, None], None)
            else:
                self._gather(cols[name], self._rows_at(sel, self._seq_offs[0][:1]), dst[:, None], None)

    def _fill_next(self, sel: _Selection, dst: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """next_obs of each transition's last step, stacked if the plan stacks obs."""
        c, cols = self.c, self.storage.columns
        one = np.zeros(1, np.int64)
        if c.derived_next_obs:
            last_src, last_slots = cols[c.plan.obs_field], self._rows_at(sel, one + 1, self._end(sel))
        else:
            last_src, last_slots = cols[c.plan.next_obs_field], self._rows_at(sel, one, self._end(sel))
        if not self.next_stack:
            self._gather(last_src, last_slots, dst[:, None], None)
            return
        offs = self.stack_offs[self.stack_offs <= 0][1:]
        frames = np.empty((len(sel.anchors), len(offs), *dst.shape[2:]), dst.dtype)
        mask = sel.masks[f"{c.plan.next_obs_field}_mask"]
        self._gather(cols[c.plan.obs_field], self._rows_at(sel, offs, self._end(sel)), frames,
                     _pad_of(mask[:, :-1]))
        dst[:, :-1] = frames
        self._gather(last_src, last_slots, dst[:, -1:], None)

    def _end(self, sel: _Selection) -> np.ndarray | None:
        return sel.end if self.n > 1 else None

    def _stable(self, sel: _Selection) -> np.ndarray:
        after = reload_stamps(self.storage.stamps, sel.slots)
        return np.logical_not(overwritten_since(sel.before, after, sel.held).any(axis=1))

    # -- entry point ---------------------------------------------------------------------------------------
    def read_into(self, out: dict[str, np.ndarray], rng: np.random.Generator,
                  max_retries: int) -> Draw:
        """Fill ``out`` (every output of the plan, ``B`` rows); return the rows delivered."""
        B = next(iter(out.values())).shape[0]
        lanes = np.empty(B, np.int64)
        anchors = np.empty(B, np.int64)
        todo = np.arange(B)
        target = out
        for _ in range(max_retries):
            sel = self._select(todo.size, rng, max_retries)
            self.fill(sel, target)
            stable = self._stable(sel)
            if target is not out:
                for name, arr in target.items():
                    out[name][todo[stable]] = arr[stable]
            lanes[todo[stable]] = sel.lanes[stable]
            anchors[todo[stable]] = sel.anchors[stable]
            todo = todo[~stable]
            if not todo.size:
                if self.T > 1:
                    return Draw(lanes, anchors[:, None] + np.arange(self.T))
                return Draw(lanes, anchors)
            target = self.c.allocate(todo.size)
        raise SamplingError(
            f"{todo.size} of {B} rows kept being overwritten while read, {max_retries} times "
            f"in a row: writers lap the readers. Fix: a larger capacity (now "
            f"{self.storage.capacity} per lane) or slower writers"
        )


def _pad_of(mask: np.ndarray) -> np.ndarray | None:
    """Flat positions where ``mask`` is false (None if there are none)."""
    pad = np.flatnonzero(~mask)
    return pad if pad.size else None
