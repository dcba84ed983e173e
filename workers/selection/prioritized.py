"""``Prioritized(...)``: draws in proportion to priorities (Schaul et al.), from a sum tree in
shared memory that the learner keeps and workers read; ``update_priorities`` sets new ones."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from shmbuf import ReplayBuffer
from shmbuf.priority import PriorityTable, table_doc
from shmbuf.window_priority import R2D2_ETA, WindowPriorityTable, checked_eta

from .base import Selection, SelectionSpec, windowed

Beta = Union[float, tuple[float, float, int], Callable[[int], float]]


@dataclass(frozen=True)
class Prioritized(SelectionSpec):
    """Rows (or window starts of the plan) drawn in proportion to ``(p + eps) ** alpha``; batches
    carry importance weights ``batch.weights`` with exponent ``beta``.

    Args:
        alpha: how much priorities count (0: uniform).
        beta: importance-weight exponent: a number in [0, 1], ``(start, end, n_batches)`` for a
            linear schedule over the batches delivered, or a callable ``f(batches) -> beta``.
        eps: added to every priority, so none is zero.
        eta: sequences' ``[B, T]`` priorities become ``eta * max + (1 - eta) * mean`` per
            window (R2D2).

    New rows enter at the largest priority seen so far, or, in a buffer created with
    ``actor_priorities=True``, at the priority their writer gave with them
    (``extend(rows, priorities=ps)``: Ape-X), clipped to what the tree can sum
    (``stats()["actor_priorities_clipped"]``). A learner restarted on the same buffer takes
    over the priority table its dead predecessor left, if it was made with the same alpha,
    eps, eta and plan.

    Example:
        >>> SamplerPool(buf, 256, selection=Prioritized(alpha=0.6, beta=(0.4, 1.0, 100_000)))
    """

    alpha: float = 0.6
    beta: Beta = 0.4
    eps: float = 1e-6
    eta: float = R2D2_ETA

    def __post_init__(self) -> None:
        for name in ("alpha", "eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"Prioritized({name}={value!r}): {name} must be a finite "
                                 f"number >= 0")
        try:
            checked_eta(self.eta)
        except (TypeError, ValueError):
            raise ValueError(f"Prioritized(eta={self.eta!r}): eta must be in [0, 1] (R2D2 uses "
                             f"{R2D2_ETA})") from None
        self.beta_at(0)  # a bad beta fails here, not at the first batch

    def beta_at(self, step: int) -> float:
        """beta after ``step`` batches (see ``beta``)."""
        beta = self.beta
        if callable(beta):
            return float(beta(step))
        if isinstance(beta, (tuple, list)):
            try:
                start, end, n_batches = beta
            except ValueError:
                raise ValueError(f"Prioritized(beta={beta!r}): a schedule is (start, end, "
                                 f"n_batches)") from None
            if n_batches <= 0:
                raise ValueError(f"Prioritized(beta={beta!r}): n_batches must be > 0")
            return start + (end - start) * min(1.0, step / n_batches)
        value = float(beta)
        if not 0 <= value <= 1:
            raise ValueError(f"Prioritized(beta={beta!r}): beta must be in [0, 1] (or a "
                             f"schedule)")
        return value

    def table_to_adopt(self, buf: ReplayBuffer, compiled: Any) -> dict[str, Any] | None:
        plan = WindowPriorityTable.plan_doc(compiled, self.eta) if windowed(compiled) else None
        return table_doc(buf, self.alpha, self.eps, plan=plan)

    def open(self, buf: ReplayBuffer, compiled: Any) -> Selection:
        return PrioritizedSelection(buf, self.open_table(buf, compiled, adopt=True))

    def open_table(self, buf: ReplayBuffer, compiled: Any, adopt: bool = False,
                   counted: bool = False) -> PriorityTable:
        """A priority table for this strategy's pool: one priority per window start where
        the plan reads windows, else per row; ``adopt``: a dead learner's, if one fits."""
        if windowed(compiled) and not counted:
            return WindowPriorityTable.create_for(buf, compiled, self.alpha, self.eps, self.eta,
                                                  adopt=adopt)
        return PriorityTable.create(buf, self.alpha, self.eps, adopt=adopt, counted=counted)


class PrioritizedSelection(Selection):
    """Workers draw in proportion to priorities kept by the learner in a shared ``table``."""

    table: PriorityTable
    prioritized = True
    enters_rows = True

    def __init__(self, buf: ReplayBuffer, table: PriorityTable) -> None:
        self.buf, self.table = buf, table

    @property
    def draws_from(self) -> PriorityTable | None:
        return self.table

    def enter_new_rows(self) -> None:
        self.table.sync(self.buf)  # at their actor priorities, or else the maximum priority

    def update(self, lanes: Any, indices: Any, priorities: Any) -> int:
        # An update for a row overwritten since it was sampled is dropped (told by the window);
        # rows committed since the last batch are entered first only if one of the updated
        # rows is among them.
        held = self.table.sync_before_update(self.buf, lanes, indices)
        return self.table.update(lanes, indices, priorities, held=held)


