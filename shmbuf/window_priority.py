"""``WindowPriorityTable``: prioritized replay over planned batches (R2D2 sequences, frame stacks,
n-step): one priority per window start, and the R2D2 reduction ``eta * max + (1 - eta) * mean``
of a window's per-step priorities.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InvalidPriorityError
from .priority import PriorityTable
from .sampling import sumtree

if TYPE_CHECKING:
    from .buffer import ReplayBuffer
    from .reader import PlanReader
    from .sampling.plan import Compiled

R2D2_ETA = 0.9  # R2D2's mix of a window's largest and mean priority
JUDGE_CELLS = 1 << 20  # starts judged together x probe rows per start: bounds sync's memory


def checked_eta(eta: Any) -> float:
    """``eta`` as a float in [0, 1], else ``ValueError`` naming it."""
    value = float(eta)
    if not 0.0 <= value <= 1.0:  # (NaN fails too)
        raise ValueError(f"eta must be in [0, 1] (R2D2 uses {R2D2_ETA}), got {eta!r}")
    return value


def reduce_windows(priorities: np.ndarray, eta: float, mask: np.ndarray | None = None
                   ) -> np.ndarray:
    """R2D2's priority of each window from its steps' ``[B, T]`` priorities (e.g. |TD errors|):
    ``eta * max_t + (1 - eta) * mean_t``, over the steps where ``mask`` is true if given (every
    window keeps one; priorities are >= 0, so masked steps count as 0 in the max)."""
    if mask is None:
        return eta * priorities.max(axis=1) + (1.0 - eta) * priorities.mean(axis=1)
    kept = np.where(mask, priorities, 0.0)
    return eta * kept.max(axis=1) + (1.0 - eta) * kept.sum(axis=1) / mask.sum(axis=1)


class WindowPriorityTable(PriorityTable):
    """A ``PriorityTable`` whose rows are the anchors (window starts) of a compiled plan.

    A start enters once every row its window may read is committed (its newest ``lag`` rows
    later than a plain table's), at the maximum priority if a batch could be read at it then
    (``PlanReader.can_read_at``: the checks uniform draws pass, so with ``cross_episodes``
    False a window crossing an episode end, or starting at an episode's FINAL row, enters at
    zero and is never drawn), else at zero; a usable start whose row a writer gave a priority
    (actor priorities) enters at that priority instead. Draws (``draw``, in any process) are
    unchanged; the plan reader probes each drawn window again under the rows' stamps, so a
    window is never torn and never holds a row that moved on. ``update`` takes
    ``batch.indices`` (``[B, T]`` for sequences: the start is column 0) with priorities
    ``[B]``, or ``[B, T]`` reduced per window by ``reduce_windows`` with ``eta``.

    Concurrency: as ``PriorityTable``: the learner that creates the table is the only writer;
    its ``sync`` enters new starts at zero (generations first) and then gives the judged ones
    their values, so a reader never draws a start before it was judged.

    Example:
        >>> plan = buf.compile(sequence_length=16)
        >>> table = WindowPriorityTable.create_for(buf, plan, alpha=0.6, eps=1e-6, eta=0.9)
    """

    reader: PlanReader
    lag = 0  # newest rows a start's window may read after it
    eta = R2D2_ETA
    # (learner side, in the segment: ``judged`` per lane, every start below it has its value;
    # ``usable`` per slot, the start there was judged usable: updates keep others at 0)

    @classmethod
    def create_for(cls, buf: ReplayBuffer, compiled: Compiled, alpha: float = 0.6,
                   eps: float = 1e-6, eta: float = R2D2_ETA, adopt: bool = False
                   ) -> WindowPriorityTable:
        """A table of ``compiled``'s window starts of ``buf``, for its learner (the writer);
        ``adopt``: a dead learner's table of the same plan, if there is one (``create``)."""
        eta = checked_eta(eta)
        from .reader import PlanReader  # (as BatchReader does: only where plans are read)

        table = cls.create(buf, alpha, eps, plan=cls.plan_doc(compiled, eta), adopt=adopt)
        assert isinstance(table, cls)  # ``create`` makes a ``cls``
        table.reader = PlanReader(buf.storage, compiled)
        table.lag = max(0, int(table.reader.offsets[-1]))
        table.eta = eta
        return table

    @staticmethod
    def plan_doc(compiled: Compiled, eta: float) -> dict[str, Any]:
        """What a table's layout document says of its plan (a dead learner's table is adopted
        only by a pool of the same plan and eta)."""
        return {"plan": dataclasses.asdict(compiled.plan), "eta": checked_eta(eta)}

    def sync(self, buf: ReplayBuffer, initial: float | None = None) -> int:
        """Enter new rows as starts at zero, then value every start whose window is written:
        where a batch can be read at it, the priority its writer gave with the start's row
        (actor priorities) or else the maximum priority (``initial`` if given, for every
        start); else 0."""
        before = self.synced.copy()
        entered = super().sync(buf, 0.0)
        for lane in np.flatnonzero(self.synced > before):  # new starts: not judged yet
            first = max(int(before[lane]), int(self.synced[lane]) - self.capacity)
            self.usable[lane * self.capacity
                        + np.arange(first, int(self.synced[lane])) % self.capacity] = False
        ready = self.synced - self.lag  # starts whose every probe row is committed
        lanes = np.flatnonzero(ready > self.judged)
        if not lanes.size:
            return entered
        value = self._value(self.max_priority) if initial is None else initial
        chunk = max(1, JUDGE_CELLS // self.reader.offsets.size)
        for lane in lanes:
            first = max(int(self.judged[lane]), int(self.synced[lane]) - self.capacity)
            for at in range(first, int(ready[lane]), chunk):
                starts = np.arange(at, min(at + chunk, int(ready[lane])), dtype=np.int64)
                usable = self.reader.can_read_at(np.full(starts.size, lane), starts)
                self.usable[lane * self.capacity + starts % self.capacity] = usable
                values = np.where(usable, value, 0.0)
                if initial is None:
                    self._enter_actor_priorities(values, buf, int(lane), at,
                                                 at + starts.size, usable)
                self._fill_starts(int(lane), at, values)
        self.judged[lanes] = ready[lanes]
        return entered

    def _fill_starts(self, lane: int, first: int, values: np.ndarray) -> None:
        """Set the values of starts ``first ..`` of ``lane`` (contiguous slots, wrapping once)."""
        at = 0
        while at < values.size:
            slot = (first + at) % self.capacity
            n = min(values.size - at, self.capacity - slot)
            sumtree.fill(self.sums, self.mins, lane, slot, values[at:at + n])
            at += n

    def update(self, lanes: np.ndarray, indices: np.ndarray, priorities: Any,
               mask: Any = None, *, held: np.ndarray | None = None) -> int:
        """New priorities for the windows of ``indices`` (``batch.indices``: ``[B, T]`` for
        sequences, or their starts ``[B]``): ``[B]`` as they are, or ``[B, T]`` per step,
        reduced by ``reduce_windows`` (over the steps where ``mask``, ``[B, T]`` bool, is true:
        ``batch["mask"]`` with ``cross_episodes=True``). Windows whose start was overwritten
        since are skipped.

        Raises:
            InvalidPriorityError: a step's priority (one the mask keeps) is NaN, infinite or
                negative (nothing is applied).
            ValueError: shapes that do not match ``indices``, or a mask that keeps no step of a
                window.
        """
        index, values = self._starts(indices), self.window_priorities(lanes, indices,
                                                                        priorities, mask)
        applied = super().update(lanes, index, values, held=held)
        # A start no batch can be read at (e.g. its window crosses an episode end) stays at 0.
        lane = np.broadcast_to(np.asarray(lanes, np.int64), index.shape)
        slots = lane * self.capacity + index % self.capacity
        unusable = ~self.usable[slots] & (self.gen[slots] == index)
        if held is not None:  # (starts overwritten since: dropped above, left alone here)
            unusable &= held.reshape(-1)
        if unusable.any():
            self.retire(lane[unusable], index[unusable])
        return applied - int(unusable.sum())

    def _starts(self, indices: Any) -> np.ndarray:
        """The window starts of ``indices`` (``[B, T]``: column 0, or ``[B]``)."""
        index = np.asarray(indices, np.int64)
        length = self.reader.sequence_length
        if index.ndim == 2:
            if index.shape[1] != length:
                raise ValueError(f"indices of shape {index.shape} for windows of {length} steps: "
                                 f"pass batch.indices ([B, {length}]) or its column 0")
            index = index[:, 0]
        return index

    def window_priorities(self, lanes: Any, indices: Any, priorities: Any,
                          mask: Any = None) -> np.ndarray:
        """The priority of each window of ``indices`` from ``priorities`` (``[B]`` as they
        are; ``[B, T]`` checked per step and reduced by ``reduce_windows``, over the steps
        ``mask`` keeps if given). Raises as ``update`` does; changes nothing."""
        index = self._starts(indices)
        values = np.asarray(priorities, np.float64)
        length = self.reader.sequence_length
        if values.ndim == 2 and length > 1:
            if values.shape != (index.size, length):
                raise ValueError(
                    f"priorities of shape {values.shape} for {index.size} windows of {length} "
                    f"steps: pass one per window ([{index.size}]) or per step "
                    f"([{index.size}, {length}])")
            steps = None if mask is None else self._checked_mask(mask, values.shape)
            self._check_steps(lanes, index, values if steps is None
                              else np.where(steps, values, 0.0))
            return reduce_windows(values, self.eta, steps)
        if mask is not None:
            raise ValueError(f"mask= selects steps of [B, T] priorities; these are of shape "
                             f"{values.shape}: pass per-step priorities with it, or no mask")
        return values

    @staticmethod
    def _checked_mask(mask: Any, shape: tuple[int, ...]) -> np.ndarray:
        """``mask`` as a bool array of ``shape`` keeping a step of every window, else
        ``ValueError`` naming what is wrong."""
        steps = np.asarray(mask)
        if steps.dtype != np.bool_ or steps.shape != shape:
            raise ValueError(f"mask must be a bool array of shape {shape} like the priorities "
                             f"(batch['mask']), got {steps.dtype} {steps.shape}")
        empty = ~steps.any(axis=1)
        if empty.any():
            window = int(np.flatnonzero(empty)[0])
            raise ValueError(f"mask keeps no step of window {window} ({int(empty.sum())} such): "
                             f"a window's first step is always in its episode (batch['mask'])")
        return steps

    def _update_rows(self, indices: Any) -> np.ndarray | None:
        if isinstance(indices, np.ndarray) and indices.ndim == 2:  # [B, T]: the starts
            return indices[:, 0] if indices.shape[1] == self.reader.sequence_length else None
        return super()._update_rows(indices)

    def _entered_below(self) -> np.ndarray:
        return self.judged  # starts below it have their values (their windows are written)

    def _check_steps(self, lanes: Any, starts: np.ndarray, values: np.ndarray) -> None:
        """Per-step priorities must be finite and >= 0 (a negative one could hide in a max)."""
        bad = ~np.isfinite(values) | (values < 0)
        if bad.any():
            window, step = (int(i) for i in np.argwhere(bad)[0])
            lane = int(np.broadcast_to(np.asarray(lanes, np.int64), starts.shape)[window])
            raise InvalidPriorityError(
                f"priority {float(values[window, step])!r} at step {step} of window {window} "
                f"(start {int(starts[window])} of lane {lane}) is not allowed: priorities must "
                f"be finite and >= 0 ({int(bad.sum())} bad of {values.size}; pass |TD errors|); "
                f"nothing was updated")
