"""Index math for every sampling strategy: pure functions over per-lane windows, no shared memory.

Each strategy takes the lanes' readable windows ``[lo, hi)`` (logical indices) and an RNG and
returns which (lane, logical index) pairs to read. The buffer does the reading and the seqlock
checks; strategies never touch memory, so they are tested on plain arrays.
"""

from .base import Draw, Sampler, Windows, every_index
from .plan import Plan
from .uniform import draw_uniform

__all__ = ["Draw", "Plan", "Sampler", "Windows", "draw_uniform", "every_index"]
