"""Frame stacking: ``[k + lookahead]`` frames around a step rebuilt from frames stored once.

Offsets run from ``-(k-1)`` (look-back) to ``+lookahead``. A frame before the step's episode began
is zero-padded and masked; one after the episode's end (or not yet written) likewise. A frame that
belongs to the episode but was already overwritten cannot be rebuilt, so the step is not drawn.
"""

from __future__ import annotations

import numpy as np


def stack_offsets(frame_stack: int, lookahead: int) -> np.ndarray:
    """The frames' offsets from the step: ``-(frame_stack-1) .. lookahead``."""
    return np.arange(-(frame_stack - 1), lookahead + 1, dtype=np.int64)


def stack_mask(
    end_step: np.ndarray, offsets: np.ndarray, same: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(ok [B], mask [B, W]) for frames at ``offsets`` around rows whose step in their episode
    is ``end_step``; ``same[b, w]`` says the row at that offset is readable and in the episode.

    Backward frames are the episode's iff ``end_step + offset >= 0``; if such a frame is not
    readable, the stack cannot be rebuilt (ok False). Forward frames count only if readable
    (``same`` must then exclude an episode's FINAL row: it holds no step).
    """
    back = offsets[None, :] <= 0
    in_episode = (end_step[:, None] + offsets[None, :]) >= 0
    mask = np.where(back, in_episode, same)
    ok = ~(back & in_episode & ~same).any(axis=1)
    return ok, mask
