# The learner's common case of next(), compiled (_take_c.c): see that file.
import collections
from typing import Any, Callable, Iterator, Sequence

class Taker:
    def __init__(self, state_at: Sequence[int], generation_at: Sequence[int],
                 owner_at: Sequence[int], waiter_at: Sequence[int], stats_at: tuple[int, int],
                 states: tuple[int, int, int, int], assigned: dict[int, None],
                 ready: collections.deque[int], generations: list[int], filled: list[int],
                 tickets: Iterator[int], wake: Callable[[int, int, int], Any]) -> None: ...
    def take(self, words: memoryview, release: int, t0: int) -> int | None: ...
