"""Sequences: windows of ``sequence_length`` (T) consecutive steps of one lane.

Strict windows never cross an episode boundary; crossing windows are masked to the steps of the
episode they start in (a prefix), the rest padded by the reader.
"""

from __future__ import annotations

import numpy as np


def sequence_masks(valid: np.ndarray, cross_episodes: bool) -> tuple[np.ndarray, np.ndarray]:
    """(anchor_ok [B], mask [B, T]) from ``valid[b, t]``: step t of window b is a readable
    transition of the window's first episode (and, if needed, has its next observation)."""
    if cross_episodes:
        mask = np.logical_and.accumulate(valid, axis=1)
        return mask[:, 0].copy(), mask
    return np.all(valid, axis=1), np.ones_like(valid)


def strict_tail(sequence_length: int, needs_next: bool) -> int:
    """How many newest rows a strict window's start must leave after it."""
    return sequence_length - 1 + (1 if needs_next else 0)
