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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from . import layout
from .errors import SamplingError
from .sampling import Draw, Sampler, Windows, draw_uniform
from .sampling.framestack import stack_mask, stack_offsets
from .sampling.nstep import nstep_discount, nstep_extent, nstep_return
from .sampling.plan import DISCOUNT, MASK, STEPS, Compiled, Plan
from .sampling.sequence import sequence_masks, strict_tail
from .slots import holds, load_stamps, overwritten_since, reload_stamps

if TYPE_CHECKING:
    from .storage import BufferStorage

STRIDE_DRAWS_MAX = 1 << 16  # positions a strided uniform round draws at most (then filters)


@dataclass
class _NStepRead:
    """What the probe of an n-step plan read for each anchor."""

    extent: np.ndarray  # [n] m: steps in the transition (``nstep_extent``)
    rewards: np.ndarray  # [n, n_step]
    terminated_last: np.ndarray  # [n] the terminated flag of the transition's last step

    def take(self, keep: np.ndarray) -> _NStepRead:
        return _NStepRead(self.extent[keep], self.rewards[keep], self.terminated_last[keep])

    @staticmethod
    def concat(parts: list[_NStepRead]) -> _NStepRead:
        return _NStepRead(np.concatenate([p.extent for p in parts]),
                          np.concatenate([p.rewards for p in parts]),
                          np.concatenate([p.terminated_last for p in parts]))


@dataclass
class _Selection:
    """Anchors judged usable from their first stamp/meta read, with what was read."""

    lanes: np.ndarray  # [n]
    anchors: np.ndarray  # [n]
    slots: np.ndarray  # [n, P] slots of the probe rows (out-of-window positions: the anchor's)
    held: np.ndarray  # [n, P] readable at the first read
    before: np.ndarray  # [n, P] stamps at the first read
    masks: dict[str, np.ndarray]  # output masks
    end: np.ndarray  # [n] offset of the transition's last step (n-step), else 0
    nstep: _NStepRead | None = None  # n-step plans only
    probs: np.ndarray | None = None  # [n] draw probabilities (prioritized anchors only)
    # fill's per-batch slot matrices (by offsets) and padding positions (by mask name)
    slot_cache: dict[tuple[tuple[int, ...], bytes, bool], np.ndarray] = field(default_factory=dict)
    pad_cache: dict[str, np.ndarray | None] = field(default_factory=dict)

    def take(self, keep: np.ndarray) -> _Selection:
        return _Selection(
            self.lanes[keep], self.anchors[keep], self.slots[keep], self.held[keep],
            self.before[keep], {k: v[keep] for k, v in self.masks.items()}, self.end[keep],
            None if self.nstep is None else self.nstep.take(keep),
            None if self.probs is None else self.probs[keep],
        )

    @staticmethod
    def concat(parts: list[_Selection]) -> _Selection:
        def cat(name: str) -> np.ndarray:
            return np.concatenate([getattr(p, name) for p in parts])

        first = parts[0]
        masks = {k: np.concatenate([p.masks[k] for p in parts]) for k in first.masks}
        nstep = None
        if first.nstep is not None:
            nstep = _NStepRead.concat([p.nstep for p in parts if p.nstep is not None])
        return _Selection(cat("lanes"), cat("anchors"), cat("slots"), cat("held"), cat("before"),
                          masks, cat("end"), nstep,
                          None if first.probs is None else cat("probs"))


class PlanReader:
    """Reads batches of one compiled plan from one buffer."""

    def __init__(self, storage: BufferStorage, compiled: Compiled) -> None:
        self.storage = storage
        self.compiled = compiled
        plan = compiled.plan
        self.sequence_length = plan.sequence_length
        self.n_step = plan.n_step
        self.needs_next = compiled.want_next_obs and compiled.derived_next_obs
        self.stride = plan.stride
        if self.sequence_length > 1:  # (and the look-back frames of its first step's stack)
            p_lo = -(plan.frame_stack - 1) if plan.stacks else 0
            p_hi = self.sequence_length - 1 + int(self.needs_next)
        else:
            p_lo = -(plan.frame_stack - 1) if plan.stacks else 0
            p_hi = max(plan.frame_lookahead, self.n_step - 1 + int(self.needs_next))
        self.offsets = np.arange(p_lo, p_hi + 1, dtype=np.int64)
        self.anchor_column = -p_lo  # the probe column of offset 0
        strict = self.sequence_length > 1 and not plan.cross_episodes
        # newest rows a strict window's anchor must leave after it
        self.tail_rows = strict_tail(self.sequence_length, self.needs_next) if strict else 0
        self.stack_offsets = (stack_offsets(plan.frame_stack, plan.frame_lookahead)
                              if plan.stacks else None)
        # The frames of a stacked next_obs before its newest one: -(k-2) .. 0 around the
        # transition's last step (None unless the plan stacks obs and the batch has next_obs).
        self.next_stack_offsets: np.ndarray | None = None
        if (self.stack_offsets is not None and compiled.want_next_obs
                and plan.obs_field in plan.stack_fields):
            self.next_stack_offsets = self.stack_offsets[self.stack_offsets <= 0][1:]
        # Sequences with stacks: the frames of step t's stack are offsets t - (k-1) .. t
        # ([T, k]) from the window's start; its next_obs stack's first k-1 frames likewise.
        self.window_stack_offsets: np.ndarray | None = None
        if self.sequence_length > 1 and self.stack_offsets is not None:
            self.window_stack_offsets = (np.arange(self.sequence_length, dtype=np.int64)[:, None]
                                         + self.stack_offsets[None, :])
        self._sequence_offsets = [np.arange(self.sequence_length) + s for s in (0, 1)]
        # fields read at the transition's last step rather than at the anchor (n-step)
        self.end_fields: tuple[str, ...] = ()
        if self.n_step > 1:
            self.end_fields = (plan.terminated_field,) + (
                ("truncated",) if "truncated" in storage.spec else ())

    # -- selection ---------------------------------------------------------------------------------
    def can_read_at(self, lanes: np.ndarray, anchors: np.ndarray) -> np.ndarray:
        """bool [n]: which anchors a batch could be read at now, by the very checks a draw's
        anchors pass (``WindowPriorityTable`` enters a start's priority by this)."""
        return self._judge(Draw(lanes, anchors), self.storage.windows())[1]

    def _judge(self, draw: Draw, windows: Windows) -> tuple[_Selection, np.ndarray]:
        """Probe every anchor of ``draw``: (what was read for each, which are usable)."""
        storage, capacity = self.storage, self.storage.capacity
        plan = self.compiled.plan
        anchors = draw.indices
        rows = anchors[:, None] + self.offsets[None, :]
        lo = windows.lo[draw.lanes][:, None]
        hi = windows.hi[draw.lanes][:, None]
        in_window = (rows >= lo) & (rows < hi)
        rows = np.where(in_window, rows, anchors[:, None])
        slots = rows % capacity
        if storage.lanes > 1:
            slots += (draw.lanes * capacity)[:, None]
        before = load_stamps(storage.stamps, slots)  # stamps first ...
        meta = storage.meta[slots]  # ... then what they guard
        held = in_window & holds(before, rows)  # any rewrite version: _stable compares
        episode = meta >> layout.STEP_BITS
        final = (meta & layout.FLAG_FINAL) != 0
        j0 = self.anchor_column
        same = held & (episode == episode[:, j0 : j0 + 1])  # readable, in the anchor's episode
        transition = same & ~final
        usable = transition[:, j0].copy()
        step0 = meta[:, j0] & layout.STEP_MASK  # the anchor's step in its episode
        masks: dict[str, np.ndarray] = {}
        n = len(anchors)
        end = np.zeros(n, np.int64)
        if self.sequence_length > 1:
            length = self.sequence_length
            valid = transition[:, j0 : j0 + length].copy()
            if self.needs_next:
                valid &= same[:, j0 + 1 : j0 + 1 + length]
            window_ok, masks[MASK] = sequence_masks(valid, plan.cross_episodes)
            usable &= window_ok
            if self.stride > 1:  # windows start at steps 0, s, 2s... of their episode
                usable &= step0 % self.stride == 0
            if self.window_stack_offsets is not None:
                usable &= self._judge_window_stacks(step0, transition, masks)
            sel = _Selection(draw.lanes, anchors, slots, held, before, masks, end,
                             probs=draw.probs)
            return sel, usable
        nstep = None
        if self.n_step > 1:
            columns = storage.columns
            step_slots = slots[:, j0 : j0 + self.n_step]
            terminated = columns[plan.terminated_field][step_slots].astype(bool)
            rewards = columns[plan.reward_field][step_slots]
            if self.needs_next:
                next_known = same[:, j0 + 1 : j0 + 1 + self.n_step]
            else:
                next_known = np.ones((n, self.n_step), bool)
            extent = nstep_extent(transition[:, j0 : j0 + self.n_step], terminated, next_known)
            usable &= extent > 0
            end = np.maximum(extent - 1, 0)
            nstep = _NStepRead(extent, rewards, terminated[np.arange(n), end])
        elif self.needs_next:
            usable &= same[:, j0 + 1]
        if self.stack_offsets is not None:
            # Frames are steps: an episode's FINAL row (derived next_obs) is not a look-ahead
            # frame, so both next_obs modes stack the same frames, and fields other than obs
            # (zero in a FINAL row) are never marked valid there.
            stack_ok, stack_valid = stack_mask(step0, self.stack_offsets,
                                               transition[:, j0 + self.stack_offsets])
            usable &= stack_ok
            for f in plan.stack_fields:
                masks[f"{f}_mask"] = stack_valid
            offsets = self.next_stack_offsets
            if offsets is not None:
                columns_at_end = j0 + end[:, None] + offsets[None, :]
                next_ok, next_valid = stack_mask(step0 + end, offsets,
                                                 np.take_along_axis(same, columns_at_end, 1))
                usable &= next_ok
                masks[f"{plan.next_obs_field}_mask"] = np.concatenate(
                    [next_valid, np.ones((n, 1), bool)], axis=1)
        sel = _Selection(draw.lanes, anchors, slots, held, before, masks, end, nstep, draw.probs)
        return sel, usable

    def _judge_window_stacks(self, step0: np.ndarray, transition: np.ndarray,
                             masks: dict[str, np.ndarray]) -> np.ndarray:
        """Stack masks ``[n, T, k]`` of a sequence plan's windows into ``masks``; bool [n]:
        every stack the window's ``mask`` keeps can be rebuilt (``stack_mask`` per step)."""
        plan, offsets = self.compiled.plan, self.window_stack_offsets
        assert offsets is not None and self.stack_offsets is not None
        n, (length, k) = step0.size, offsets.shape
        kept = masks[MASK]  # [n, T]: the steps of the window's first episode
        steps = step0[:, None] + np.arange(length)  # each step's step in that episode
        frames = transition[:, self.anchor_column + offsets]  # [n, T, k]
        ok, valid = stack_mask(steps.reshape(-1), self.stack_offsets, frames.reshape(-1, k))
        valid = valid.reshape(n, length, k) & kept[:, :, None]  # zero at steps mask leaves out
        for f in plan.stack_fields:
            masks[f"{f}_mask"] = valid
        if self.next_stack_offsets is not None:
            masks[f"{plan.next_obs_field}_mask"] = np.concatenate(
                [valid[:, :, 1:], kept[:, :, None]], axis=2)
        return (ok.reshape(n, length) | ~kept).all(axis=1)

    def start_share(self, rng: np.random.Generator, draws: int) -> tuple[int, float]:
        """``(anchor rows, the share of them a batch could start at now)``: how many starts
        uniform draws choose among is their product (a cluster splits uniform batches of
        sequences by it). Where the lanes hold ``draws`` anchor rows or fewer, every one is
        judged and the share is exact; else it is estimated from ``draws`` of them drawn as
        ``_select`` draws them (with a stride: ``stride`` times as many, pre-filtered on
        their step, up to ``STRIDE_DRAWS_MAX``)."""
        windows = self.storage.windows()
        anchors = self.anchor_windows(windows)
        rows = anchors.total
        if rows <= 0:
            return 0, 0.0
        if rows <= draws:
            sizes = anchors.sizes
            lanes = np.repeat(np.arange(sizes.size, dtype=np.int64), sizes)
            first = np.repeat(anchors.lo - np.cumsum(sizes) + sizes, sizes)
            draw, size = Draw(lanes, first + np.arange(rows, dtype=np.int64)), rows
        else:
            size = min(draws * self.stride, max(draws, STRIDE_DRAWS_MAX))
            draw = draw_uniform(anchors, size, rng)
            if self.stride > 1:
                draw = self._on_stride(draw)
        usable = self._judge(draw, windows)[1]
        return rows, float(np.count_nonzero(usable)) / size

    def anchor_windows(self, windows: Windows) -> Windows:
        """Each lane's window less the ``tail_rows`` a strict window must leave after its start."""
        return Windows(windows.lo, np.maximum(windows.hi - self.tail_rows, windows.lo))

    def read_at(self, out: dict[str, np.ndarray], lanes: np.ndarray, anchors: np.ndarray
                ) -> bool:
        """Fill ``out`` with the batch whose rows start at ``anchors``; False if one of them is
        no longer usable or was overwritten while read (``out`` is then partly written)."""
        sel, usable = self._judge(Draw(lanes, anchors), self.storage.windows())
        if not usable.all():
            return False
        self.fill(sel, out)
        return bool(self._stable(sel).all())

    def _select(self, count: int, rng: np.random.Generator, max_rounds: int,
                sampler: Sampler | None = None) -> tuple[_Selection, float]:
        """``count`` usable anchors drawn uniformly or by ``sampler``; and the smallest
        probability its draws reported (inf for uniform draws)."""
        parts: list[_Selection] = []
        have = 0
        pmin = np.inf
        for _ in range(max_rounds):
            windows = self.storage.windows()
            want = count - have
            # Some anchors get rejected (episode ends, FINAL rows): draw a few extra per round.
            lo, hi = int(windows.lo[0]), int(windows.hi[0]) - self.tail_rows
            if sampler is not None:  # (its own rejects are rare: no extra draws)
                draw = sampler(self.anchor_windows(windows), want, rng)
                pmin = min(pmin, draw.pmin)
            else:
                # (with a stride, one position in ``stride`` is a start: draw that many more
                # and keep those whose step says so before probing them)
                size = want + want // 4 + 4
                if self.stride > 1:
                    size = min(size * self.stride, max(size, STRIDE_DRAWS_MAX))
                if self.storage.lanes == 1 and hi > lo:
                    positions = rng.integers(0, hi - lo, size=size, dtype=np.int64)
                    positions += lo
                    draw = Draw(np.zeros(positions.size, np.int64), positions)
                else:
                    draw = draw_uniform(self.anchor_windows(windows), size, rng)
                if self.stride > 1:
                    draw = self._on_stride(draw)
            sel, usable = self._judge(draw, windows)
            sel = sel.take(np.flatnonzero(usable)[:want])  # the first usable anchors
            if len(sel.anchors):
                parts.append(sel)
                have += len(sel.anchors)
            if have >= count:
                sel = _Selection.concat(parts) if len(parts) > 1 else parts[0]
                return sel, pmin  # every part holds at most the rows still wanted
        raise SamplingError(
            f"found only {have} of {count} usable rows in {max_rounds} rounds of draws: "
            f"{_shortfall(self.compiled.plan, self.sequence_length, self.needs_next)}"
        )

    def _on_stride(self, draw: Draw) -> Draw:
        """The positions of ``draw`` whose step in their episode is a multiple of the stride.

        A pre-filter on ``_meta`` words loaded without their stamps: ``_judge`` checks each
        start again under them, so a row being rewritten only costs a draw, never a wrong one.
        """
        storage = self.storage
        slots = draw.indices % storage.capacity
        if storage.lanes > 1:
            slots += draw.lanes * storage.capacity
        keep = np.flatnonzero((storage.meta[slots] & layout.STEP_MASK) % self.stride == 0)
        return Draw(draw.lanes[keep], draw.indices[keep])

    # -- gathering ---------------------------------------------------------------------------------
    def _rows_at(self, sel: _Selection, offsets: np.ndarray, base: np.ndarray | None = None
                 ) -> np.ndarray:
        """Probe columns for offsets (per anchor if ``base`` is given) -> slots [n,
        *offsets.shape], computed once per batch (``sel.slot_cache``)."""
        key = (offsets.shape, offsets.tobytes(), base is not None)
        got = sel.slot_cache.get(key)
        if got is None:
            got = sel.slot_cache[key] = self._rows_at_uncached(sel, offsets, base)
        return got

    def _rows_at_uncached(self, sel: _Selection, offsets: np.ndarray, base: np.ndarray | None
                          ) -> np.ndarray:
        j0 = self.anchor_column
        if base is None and offsets.ndim > 1:  # (a window's stacks: [T, k])
            return sel.slots[:, j0 + offsets]
        if base is None and offsets.size > 1 and offsets[-1] - offsets[0] == offsets.size - 1:
            return np.ascontiguousarray(sel.slots[:, j0 + offsets[0] : j0 + offsets[-1] + 1])
        columns = j0 + (offsets if base is None else base[:, None] + offsets[None, :])
        if columns.ndim == 1:
            return sel.slots[:, columns]
        return np.take_along_axis(sel.slots, columns, 1)

    def _pad(self, sel: _Selection, name: str) -> np.ndarray | None:
        if name not in sel.pad_cache:
            sel.pad_cache[name] = _pad_of(sel.masks[name])
        return sel.pad_cache[name]

    def _gather(self, column: np.ndarray, slots: np.ndarray, dst: np.ndarray,
                pad: np.ndarray | None) -> None:
        """``dst[...] = column[slots]`` (dst shaped like slots + the row shape), zeros at the
        flat positions ``pad``. Contiguous destinations are gathered into directly."""
        if dst.flags.c_contiguous:
            flat = dst.reshape(slots.size, *column.shape[1:])
            np.take(column, slots.reshape(-1), axis=0, out=flat, mode="clip")
            if pad is not None:
                flat[pad] = 0
        else:
            dst[...] = np.take(column, slots.reshape(-1), axis=0, mode="clip").reshape(dst.shape)
            if pad is not None:
                dst[np.unravel_index(pad, slots.shape)] = 0

    def fill(self, sel: _Selection, out: dict[str, np.ndarray]) -> None:
        """Gather every output array of ``sel`` into ``out`` (arrays of len(sel) rows)."""
        compiled, columns = self.compiled, self.storage.columns
        plan = compiled.plan
        obs, next_obs = plan.obs_field, plan.next_obs_field
        at_anchor = self._sequence_offsets[0][:1]  # offset 0
        nstep = sel.nstep
        for name, _, _ in compiled.outputs:
            dst = out[name]
            if name == MASK or name.endswith("_mask"):
                dst[...] = sel.masks[name]
            elif self.window_stack_offsets is not None and name in plan.stack_fields:
                slots = self._rows_at(sel, self.window_stack_offsets)
                self._gather(columns[name], slots, dst, self._pad(sel, f"{name}_mask"))
            elif (self.window_stack_offsets is not None and name == next_obs
                  and self.next_stack_offsets is not None):
                self._fill_window_next(sel, dst)
            elif self.sequence_length > 1:
                derived = name == next_obs and compiled.derived_next_obs
                src, shift = (obs, 1) if derived else (name, 0)
                slots = self._rows_at(sel, self._sequence_offsets[shift])
                self._gather(columns[src], slots, dst, self._pad(sel, MASK))
            elif nstep is not None and name == DISCOUNT:
                dst[...] = nstep_discount(nstep.terminated_last, nstep.extent, plan.gamma)
            elif nstep is not None and name == STEPS:
                dst[...] = nstep.extent
            elif nstep is not None and name == plan.reward_field:
                dst[...] = nstep_return(nstep.rewards, nstep.extent, plan.gamma)
            elif name == next_obs:
                self._fill_next(sel, dst)
            elif self.stack_offsets is not None and name in plan.stack_fields:
                slots = self._rows_at(sel, self.stack_offsets)
                self._gather(columns[name], slots, dst, self._pad(sel, f"{name}_mask"))
            elif name in self.end_fields:
                slots = self._rows_at(sel, at_anchor, self._end(sel))
                self._gather(columns[name], slots, dst[:, None], None)
            else:
                self._gather(columns[name], self._rows_at(sel, at_anchor), dst[:, None], None)

    def _fill_next(self, sel: _Selection, dst: np.ndarray) -> None:
        """next_obs of each transition's last step, stacked if the plan stacks obs."""
        compiled, columns = self.compiled, self.storage.columns
        plan = compiled.plan
        zero = np.zeros(1, np.int64)
        if compiled.derived_next_obs:
            last_src = columns[plan.obs_field]
            last_slots = self._rows_at(sel, zero + 1, self._end(sel))
        else:
            last_src = columns[plan.next_obs_field]
            last_slots = self._rows_at(sel, zero, self._end(sel))
        offsets = self.next_stack_offsets
        if offsets is None:
            self._gather(last_src, last_slots, dst[:, None], None)
            return
        frames = np.empty((len(sel.anchors), len(offsets), *dst.shape[2:]), dst.dtype)
        mask = sel.masks[f"{plan.next_obs_field}_mask"]
        self._gather(columns[plan.obs_field], self._rows_at(sel, offsets, self._end(sel)), frames,
                     _pad_of(mask[:, :-1]))
        dst[:, :-1] = frames
        self._gather(last_src, last_slots, dst[:, -1:], None)

    def _fill_window_next(self, sel: _Selection, dst: np.ndarray) -> None:
        """Stacked next_obs ``[n, T, k, ...]`` of a sequence plan: step t's obs stack one step
        on (frames t-(k-2) .. t, then the step's next observation)."""
        compiled, columns = self.compiled, self.storage.columns
        plan = compiled.plan
        assert self.window_stack_offsets is not None
        mask = sel.masks[f"{plan.next_obs_field}_mask"]
        frames = np.empty((*mask.shape[:2], mask.shape[2] - 1, *dst.shape[3:]), dst.dtype)
        self._gather(columns[plan.obs_field], self._rows_at(sel, self.window_stack_offsets[:, 1:]),
                     frames, _pad_of(mask[:, :, :-1]))
        dst[:, :, :-1] = frames
        shift = 1 if compiled.derived_next_obs else 0
        last_src = columns[plan.obs_field if shift else plan.next_obs_field]
        newest = np.empty((*mask.shape[:2], *dst.shape[3:]), dst.dtype)
        self._gather(last_src, self._rows_at(sel, self._sequence_offsets[shift]), newest,
                     self._pad(sel, MASK))
        dst[:, :, -1] = newest

    def _end(self, sel: _Selection) -> np.ndarray | None:
        return sel.end if self.n_step > 1 else None

    def _stable(self, sel: _Selection) -> np.ndarray:
        after = reload_stamps(self.storage.stamps, sel.slots)
        return np.logical_not(overwritten_since(sel.before, after, sel.held).any(axis=1))

    # -- entry point -------------------------------------------------------------------------------
    def read_into(self, out: dict[str, np.ndarray], rng: np.random.Generator,
                  max_retries: int, sampler: Sampler | None = None) -> Draw:
        """Fill ``out`` (every output of the plan, ``batch_size`` rows); return the rows
        delivered. Anchors are drawn uniformly, or by ``sampler`` (e.g. ``PriorityTable.draw``:
        the Draw returned then carries their probabilities)."""
        batch_size = next(iter(out.values())).shape[0]
        lanes = np.empty(batch_size, np.int64)
        anchors = np.empty(batch_size, np.int64)
        probs = np.empty(batch_size, np.float64) if sampler is not None else None
        pmin = np.inf
        todo = np.arange(batch_size)
        target = out
        for _ in range(max_retries):
            sel, drawn_pmin = self._select(todo.size, rng, max_retries, sampler)
            self.fill(sel, target)
            stable = self._stable(sel)
            if target is not out:
                for name, arr in target.items():
                    out[name][todo[stable]] = arr[stable]
            lanes[todo[stable]] = sel.lanes[stable]
            anchors[todo[stable]] = sel.anchors[stable]
            if probs is not None and sel.probs is not None:
                probs[todo[stable]] = sel.probs[stable]
                pmin = min(pmin, drawn_pmin)
            todo = todo[~stable]
            if not todo.size:
                if self.sequence_length > 1:
                    return Draw(lanes, anchors[:, None] + np.arange(self.sequence_length), probs,
                                0.0 if probs is None else pmin)
                return Draw(lanes, anchors, probs, 0.0 if probs is None else pmin)
            target = self.compiled.allocate(todo.size)
        raise SamplingError(
            f"{todo.size} of {batch_size} rows kept being overwritten while read, {max_retries} "
            f"times in a row: writers lap the readers. Fix: a larger capacity (now "
            f"{self.storage.capacity} per lane) or slower writers"
        )


def _shortfall(plan: Plan, sequence_length: int, needs_next: bool) -> str:
    """Why draws found too few usable anchors, and the fix."""
    if plan.stride > 1 and not plan.cross_episodes:
        return (f"few windows of {sequence_length} steps starting at a multiple of stride "
                f"{plan.stride} lie inside one episode (episodes shorter than sequence_length?). "
                f"Fix: cross_episodes=True, or a shorter sequence")
    if sequence_length > 1 and not plan.cross_episodes:
        return (f"few windows of {sequence_length} steps lie inside one episode (episodes "
                f"shorter than sequence_length?). Fix: cross_episodes=True, or a shorter sequence")
    if needs_next:
        return ("next_obs is derived, so only steps whose next observation is written can "
                "be drawn: call writer.end_episode() at episode ends")
    return "the rows needed keep being overwritten or are not written yet"


def _pad_of(mask: np.ndarray) -> np.ndarray | None:
    """Flat positions where ``mask`` is false (None if there are none)."""
    pad = np.flatnonzero(~mask)
    return pad if pad.size else None
