"""``Plan``: what a batch holds beyond plain transitions, and what arrays that makes.

A plan picks *anchors* (one logical index per batch row) and, for each output array, rows at
offsets from the anchor. Everything episode-aware is decided from each row's ``_meta`` word
(episode id, step in episode, FINAL flag), read under the same seqlock as the data, so a batch
never mixes episodes where it must not and never contains a row that was torn, uncommitted or
overwritten. The index math lives in ``sequence``, ``framestack`` and ``nstep``; ``shmbuf.reader``
does the reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SpecMismatchError

MASK = "mask"
DISCOUNT = "discount"
STEPS = "steps"


@dataclass(frozen=True)
class Plan:
    """How to read a batch.

    Args:
        sequence_length: T > 1 reads windows of T consecutive steps of one lane: every field
            becomes ``[B, T, ...]``.
        cross_episodes: with sequences, let windows run past an episode's end (burn-in style):
            ``mask [B, T]`` marks the steps of the window's first episode, others are zero.
            Without it, windows never cross an episode boundary (and ``mask`` is all true).
        stride: s > 1 (sequences only) lets a window start only at steps of its episode that
            are multiples of s: steps 0, s, 2s, ... counted from the episode's first step (as
            R2D2's actors cut episodes into overlapping sequences: ``sequence_length=120,
            stride=40``). Uniform draws, priorities (one per start) and epochs hold only
            those starts.
        frame_stack: k > 1 rebuilds ``[k + frame_lookahead, ...]`` stacks of ``stack_fields``
            from frames stored once: offsets ``-(k-1) .. frame_lookahead`` around each step,
            zero-padded with a ``<field>_mask`` where they fall outside the step's episode.
            ``next_obs`` (stored or derived) is stacked to ``[k, ...]`` as the stack one step on.
            With sequences, every step of a window gets its stack: ``[B, T, k, ...]`` and
            ``<field>_mask [B, T, k]`` (``frame_lookahead`` is then 0), zero at the steps
            ``mask`` leaves out.
        frame_lookahead: frames after the step to include (unienv's postfetch horizon).
        stack_fields: the frame fields to stack (default ``obs``).
        n_step: n > 1 turns ``reward`` into the n-step discounted return (stopping at the
            episode's end), ``next_obs`` into the bootstrap observation n steps on, and adds
            ``discount`` (gamma^m, or 0 if the episode terminated within the m steps) and
            ``steps`` (m).
        gamma: discount factor for n-step returns.
    """

    sequence_length: int = 1
    cross_episodes: bool = False
    frame_stack: int = 1
    frame_lookahead: int = 0
    stack_fields: tuple[str, ...] = ("obs",)
    n_step: int = 1
    gamma: float = 0.99
    stride: int = 1
    reward_field: str = "reward"
    terminated_field: str = "terminated"
    obs_field: str = "obs"
    next_obs_field: str = "next_obs"

    def __post_init__(self) -> None:
        for name in ("sequence_length", "frame_stack", "n_step", "stride"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if (isinstance(self.frame_lookahead, bool)
                or not isinstance(self.frame_lookahead, (int, np.integer))
                or self.frame_lookahead < 0):
            raise ValueError(f"frame_lookahead must be an int >= 0, got {self.frame_lookahead!r}")
        if not 0.0 <= float(self.gamma) <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma!r}")
        if self.sequence_length > 1 and (self.frame_lookahead or self.n_step > 1):
            raise ValueError(
                f"sequence_length cannot be combined with n_step or frame_lookahead (got "
                f"n_step={self.n_step!r}, frame_lookahead={self.frame_lookahead!r}): sequences "
                f"already hold consecutive steps. Accumulate returns in the learner; frame_stack "
                f"does combine with sequences"
            )
        if self.stride > 1 and self.sequence_length == 1:
            raise ValueError(
                f"stride={self.stride!r} spaces the starts of sequence windows, and "
                f"sequence_length is 1. Fix: pass sequence_length=T > 1 with it, or drop stride"
            )
        if isinstance(self.stack_fields, str):
            raise ValueError(f"stack_fields must be a tuple of field names, got "
                             f"{self.stack_fields!r}. Fix: stack_fields=({self.stack_fields!r},)")
        object.__setattr__(self, "stack_fields", tuple(self.stack_fields))

    @property
    def is_plain(self) -> bool:
        """Uniform single transitions: the buffer's fast path."""
        return (self.sequence_length == 1 and self.frame_stack == 1 and
                self.frame_lookahead == 0 and self.n_step == 1 and self.stride == 1)

    @property
    def stacks(self) -> bool:
        return self.frame_stack > 1 or self.frame_lookahead > 0


@dataclass(frozen=True)
class Compiled:
    """A plan checked against a buffer: the arrays a batch holds and how to fill them."""

    plan: Plan
    fields: tuple[str, ...]  # stored fields read at the anchor (or every step of a sequence)
    derived_next_obs: bool  # next_obs comes from the next row's obs
    want_next_obs: bool  # the batch has a next_obs (stored or derived)
    outputs: tuple[tuple[str, tuple[int, ...], np.dtype], ...]  # (name, shape w/o batch, dtype)
    index_shape: tuple[int, ...]  # () per row, (T,) for sequences

    def allocate(self, batch_size: int) -> dict[str, np.ndarray]:
        return {name: np.empty((batch_size, *shape), dtype) for name, shape, dtype in self.outputs}


def compile_plan(plan: Plan, spec: Any, derived_next_obs: bool,
                 fields: list[str] | None = None) -> Compiled:
    """Check ``plan`` against a buffer's spec; work out the batch's arrays.

    ``spec`` is the stored spec; with ``derived_next_obs`` the buffer stores ``obs`` only and
    ``next_obs`` is read from the following row. ``fields`` limits the stored fields read (and
    ``next_obs`` may be named to ask for it).
    """
    stored = list(spec)
    available = stored + ([plan.next_obs_field] if derived_next_obs else [])
    if fields is None:
        wanted = available
    else:
        unknown = [f for f in fields if f not in available]
        if unknown:
            raise SpecMismatchError(
                f"unknown field(s) {unknown}; the buffer has {', '.join(available)}"
            )
        wanted = list(fields)
    want_next = plan.next_obs_field in wanted
    read = [f for f in wanted if f != plan.next_obs_field or not derived_next_obs]
    obs = plan.obs_field

    def need(name: str, why: str) -> None:
        if name not in stored:
            raise SpecMismatchError(
                f"{why} needs a {name!r} field, and the buffer's fields are {', '.join(stored)}. "
                f"Fix: store it, or name the field to use (e.g. reward_field=...)"
            )

    if derived_next_obs and want_next:
        need(obs, "deriving next_obs")
    length = plan.sequence_length
    outputs: list[tuple[str, tuple[int, ...], np.dtype]] = []
    if plan.stacks:
        for f in plan.stack_fields:
            need(f, "frame_stack")
    if length > 1:  # [T, ...] per field; stacked fields [T, k, ...] (no look-ahead here)
        k = plan.frame_stack
        for name in wanted:
            src = obs if (name == plan.next_obs_field and derived_next_obs) else name
            shape, dtype = spec[src].shape, spec[src].dtype
            stacked = plan.stacks and (name in plan.stack_fields or (
                name == plan.next_obs_field and obs in plan.stack_fields))
            if stacked:
                outputs.append((name, (length, k, *shape), dtype))
                outputs.append((f"{name}_mask", (length, k), np.dtype(np.bool_)))
            else:
                outputs.append((name, (length, *shape), dtype))
        outputs.append((MASK, (length,), np.dtype(np.bool_)))
        return Compiled(plan, tuple(read), derived_next_obs, want_next, tuple(outputs), (length,))

    width = plan.frame_stack + plan.frame_lookahead
    if plan.n_step > 1:
        need(plan.reward_field, "n_step")
        need(plan.terminated_field, "n_step")
        if not want_next:
            raise SpecMismatchError(
                "n_step needs next_obs (the bootstrap observation): store a next_obs field, "
                "create the buffer with next_obs='derived', or ask for fields including next_obs"
            )
    for name in wanted:
        src = obs if (name == plan.next_obs_field and derived_next_obs) else name
        shape, dtype = spec[src].shape, spec[src].dtype
        if plan.stacks and name in plan.stack_fields:
            outputs.append((name, (width, *shape), dtype))
            outputs.append((f"{name}_mask", (width,), np.dtype(np.bool_)))
        elif plan.stacks and name == plan.next_obs_field and obs in plan.stack_fields:
            outputs.append((name, (plan.frame_stack, *shape), dtype))
            outputs.append((f"{name}_mask", (plan.frame_stack,), np.dtype(np.bool_)))
        elif plan.n_step > 1 and name == plan.reward_field:
            return_dtype = dtype if dtype.kind == "f" else np.dtype(np.float32)
            outputs.append((name, shape, return_dtype))
        else:
            outputs.append((name, shape, dtype))
    if plan.n_step > 1:
        outputs.append((DISCOUNT, (), np.dtype(np.float32)))
        outputs.append((STEPS, (), np.dtype(np.int32)))
    return Compiled(plan, tuple(read), derived_next_obs, want_next, tuple(outputs), ())
