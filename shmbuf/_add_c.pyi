# Writer.add's check and seqlock stores for one row, compiled (_add_c.c): see that file.
from collections.abc import Sequence
from typing import Any

MAX_FIELDS: int

class RowPut:
    def __init__(self, words: Any, at: tuple[int, ...], fields: Sequence[tuple[Any, ...]],
                 one_env: bool = False) -> None: ...
    def put(self, index: int, room_until: int, lim_gen: int, episode_bits: int, step: int,
            *values: Any) -> Any: ...
