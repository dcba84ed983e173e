"""``BatchReader``: every read of one buffer's rows behind the ``ReplayBuffer`` façade: uniform
and custom draws, compiled plans, rows by logical index or chosen anchors, and the caches those
reads keep.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from . import layout as L
from . import slots
from ._recycle import Recycler
from .errors import SamplingError, SpecMismatchError, StaleIndexError
from .sampling import Draw, Sampler, Windows, draw_uniform, every_index
from .sampling.plan import Compiled, Plan, compile_plan

if TYPE_CHECKING:
    from .reader import PlanReader
    from .storage import BufferStorage

ANCHOR_CELLS = 1 << 20  # plan starts x probe rows ``anchors`` judges at once (bounds memory)
RECYCLE_MIN_BYTES = 64 * 1024  # sample() recycles output arrays at least this large ...
RECYCLE_KEEP = 4  # ... keeping up to this many per (field, batch size)
MAX_RETRIES = 64  # redraw rounds for rows that fail their seqlock check before SamplingError

RngLike = np.random.Generator | int | None


class BatchReader:
    """Reads batches from one ``BufferStorage``; ``ReplayBuffer``'s reading methods are its
    checked-open, documented face.

    Concurrency: loads only. Every row is copied between two loads of its stamp (``storage.
    gather``, ``PlanReader``), and rows whose stamp changed are redrawn, so a read never waits
    for a writer and never returns a torn row. The caches (compiled plans, plan readers,
    recycled output arrays, the default generator) are this handle's own.
    """

    def __init__(self, storage: BufferStorage) -> None:
        self._storage = storage
        self._spec = storage.spec
        self._capacity = storage.capacity
        self._lanes = storage.lanes
        self._gather = storage.gather  # bound once: sample() calls it per batch
        self._words = storage.words
        self._lane0_committed = storage.word_index(0, L.LANE_COMMITTED)
        self._lane0_reserved = storage.word_index(0, L.LANE_RESERVED)
        self._lane0_floor = storage.layout.cleared_below(0) // 8
        self._default_rng = np.random.default_rng()
        self._compiled: dict[Any, Compiled] = {}
        self._readers: dict[int, PlanReader] = {}
        self._recycled: dict[tuple[str, tuple[int, ...], str], Recycler] = {}
        self._zero_lanes: dict[int, np.ndarray] = {}

    def close(self) -> None:
        """Drop every reference into the segment (the buffer is closing)."""
        self._readers = {}
        self._gather = self._words = None  # type: ignore[assignment]
        self._recycled.clear()

    # -- plans -----------------------------------------------------------------------------------
    def compile(self, plan: Plan | None, fields: list[str] | None, **plan_kwargs: Any) -> Compiled:
        """``plan`` (or ``Plan(**plan_kwargs)``) checked against the buffer, cached."""
        plan = Plan(**plan_kwargs) if plan is None else plan
        key = (plan, None if fields is None else tuple(fields))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = compile_plan(
                plan, self._spec, self._storage.derived_next_obs, fields)
        return compiled

    def _reader(self, compiled: Compiled) -> PlanReader:
        from .reader import PlanReader

        reader = self._readers.get(id(compiled))
        if reader is None or reader.compiled is not compiled:
            reader = self._readers[id(compiled)] = PlanReader(self._storage, compiled)
        return reader

    def check_fields(self, fields: list[str]) -> list[str]:
        unknown = [f for f in fields if f not in self._spec]
        if unknown:
            raise SpecMismatchError(
                f"unknown field(s) {unknown}; the spec has {', '.join(self._spec)}"
            )
        return list(fields)

    # -- sampling --------------------------------------------------------------------------------
    def _draw_uniform_one_lane(self, batch: int, rng: np.random.Generator) -> Draw:
        """``draw_uniform`` for a one-lane buffer without the per-lane array arithmetic (the
        same draw, about 10 us cheaper: it matters for small rows)."""
        lo, hi = slots.read_window(self._words, self._lane0_reserved, self._lane0_committed,
                                   self._capacity, self._lane0_floor)
        if hi <= lo:
            return draw_uniform(Windows(np.array([lo]), np.array([hi])), batch, rng)  # raises
        zeros = self._zero_lanes.get(batch)
        if zeros is None:
            zeros = self._zero_lanes[batch] = np.zeros(batch, np.int64)
            zeros.flags.writeable = False
        return Draw(zeros, rng.integers(lo, hi, size=batch, dtype=np.int64))

    def sample_into(self, out: Mapping[str, np.ndarray], rng: RngLike, plan: Compiled | None,
                    sampler: Sampler, max_retries: int) -> Draw:
        """``ReplayBuffer.sample_into``: draw, gather, redraw the rows that changed."""
        if not out:
            raise ValueError("sample_into() needs at least one output array")
        rng = self._default_rng if rng is None else (
            rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng))
        if plan is not None and not (plan.plan.is_plain and not plan.derived_next_obs):
            # (read_into writes into out's arrays; it never adds or replaces an entry)
            return self._reader(plan).read_into(cast("dict[str, np.ndarray]", out), rng,
                                                max_retries,
                                                None if sampler is draw_uniform else sampler)
        batch = next(iter(out.values())).shape[0]
        if sampler is draw_uniform and self._lanes == 1:
            draw = self._draw_uniform_one_lane(batch, rng)
        else:
            draw = sampler(self._storage.windows(), batch, rng)
        ok = self._gather(draw.lanes, draw.indices, out)
        if ok.all():
            return draw
        lanes, indices = draw.lanes.copy(), draw.indices.copy()
        probs, pmin = (None if draw.probs is None else draw.probs.copy()), draw.pmin
        for _ in range(max_retries):
            bad = np.flatnonzero(~ok)
            redraw = sampler(self._storage.windows(), bad.size, rng)
            tmp = {k: np.empty((bad.size, *v.shape[1:]), v.dtype) for k, v in out.items()}
            ok_bad = self._gather(redraw.lanes, redraw.indices, tmp)
            for k, v in out.items():
                v[bad] = tmp[k]
            lanes[bad], indices[bad], ok[bad] = redraw.lanes, redraw.indices, ok_bad
            if probs is not None:
                probs[bad] = redraw.probs
                pmin = min(pmin, redraw.pmin)
            if ok.all():
                return Draw(lanes, indices, probs, pmin)
        raise SamplingError(
            f"{int((~ok).sum())} of {batch} rows were overwritten while being read, "
            f"{max_retries} times in a row: writers lap the readers. Fix: a larger capacity "
            f"(now {self._capacity} per lane) or slower writers"
        )

    # -- rows chosen by the caller (epochs) ------------------------------------------------------
    @staticmethod
    def _reads_plain(plan: Compiled | None) -> bool:
        return plan is None or (plan.plan.is_plain and not plan.derived_next_obs)

    def anchors(self, plan: Compiled | None, among: Draw | None) -> Draw:
        """``ReplayBuffer.anchors``: where batches of ``plan`` may start now."""
        if not self._reads_plain(plan):
            assert plan is not None
            reader = self._reader(plan)
            if among is None:
                among = every_index(reader.anchor_windows(self._storage.windows()))
            chunk = max(1, ANCHOR_CELLS // reader.offsets.size)  # a probe is [chunk, rows]
            keep = np.concatenate([np.zeros(0, bool)] + [
                reader.can_read_at(among.lanes[at : at + chunk], among.indices[at : at + chunk])
                for at in range(0, among.lanes.size, chunk)])
            return Draw(among.lanes[keep], among.indices[keep])
        win = self._storage.windows()
        if among is None:
            return every_index(win)
        held = (among.indices >= win.lo[among.lanes]) & (among.indices < win.hi[among.lanes])
        return Draw(among.lanes[held], among.indices[held])

    def gather_at(self, out: Mapping[str, np.ndarray], lanes: np.ndarray, indices: np.ndarray,
                  plan: Compiled | None) -> bool:
        """``ReplayBuffer.gather_at``: read the batch at given anchors; False if stale."""
        if not self._reads_plain(plan):
            assert plan is not None
            anchors = indices[:, 0] if indices.ndim > 1 else indices  # a sequence's first step
            return self._reader(plan).read_at(cast("dict[str, np.ndarray]", out), lanes, anchors)
        return bool(self._gather(lanes, indices, out).all())

    def sample(self, batch_size: int, rng: RngLike, fields: list[str] | None,
               plan: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """``ReplayBuffer.sample``: ``sample_into`` arrays nobody else references."""
        spec = self._spec
        if plan or self._storage.derived_next_obs:
            compiled = self.compile(Plan(**plan), fields)
            out = {n: self._output_array(n, (batch_size, *s), d) for n, s, d in compiled.outputs}
            self.sample_into(out, rng, compiled, draw_uniform, MAX_RETRIES)
            return out
        names = list(spec) if fields is None else self.check_fields(fields)
        out = {n: self._output_array(n, (batch_size, *spec[n].shape), spec[n].dtype)
               for n in names}
        self.sample_into(out, rng, None, draw_uniform, MAX_RETRIES)
        return out

    def _output_array(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An array nobody else references: in the memory of a dropped one if there is one
        (``Recycler``: decided by a weakref, never by reference counts), else new."""
        if math.prod(shape) * dtype.itemsize < RECYCLE_MIN_BYTES:
            return np.empty(shape, dtype)
        key = (name, shape, dtype.str)
        recycler = self._recycled.get(key)
        if recycler is None:
            recycler = self._recycled[key] = Recycler(shape, dtype, RECYCLE_KEEP)
        return recycler.take()

    # -- rows by index ---------------------------------------------------------------------------
    def get(self, indices: Any, lanes: Any, with_episode: bool) -> dict[str, np.ndarray]:
        """``ReplayBuffer.get``: rows ``indices`` of ``lanes``, or StaleIndexError."""
        idx = np.atleast_1d(np.asarray(indices, dtype=np.int64))
        ln = np.broadcast_to(np.asarray(lanes, dtype=np.int64), idx.shape).copy()
        if ((ln < 0) | (ln >= self._lanes)).any():
            raise ValueError(f"lanes must be in [0, {self._lanes}), got {np.unique(ln)}")
        win = self._storage.windows()
        held = (idx >= win.lo[ln]) & (idx < win.hi[ln])
        out = {n: np.empty((idx.size, *f.shape), f.dtype) for n, f in self._spec.items()}
        meta = np.empty(idx.size, np.int64)
        if held.all():
            held = self._gather(ln, idx, out, meta_out=meta)
        if not held.all():
            b = int(np.flatnonzero(~held)[0])
            k = int(ln[b])
            raise StaleIndexError(
                f"index {int(idx[b])} of lane {k} is not held: the lane holds "
                f"[{int(win.lo[k])}, {int(win.hi[k])}) now"
            )
        if with_episode:
            out["_episode"] = meta >> L.STEP_BITS
            out["_step"] = meta & L.STEP_MASK
            out["_final"] = (meta & L.FLAG_FINAL) != 0
        return out

