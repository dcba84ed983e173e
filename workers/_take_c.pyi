# The learner's common case of next(), compiled (_take_c.c): see that file.
import collections
from typing import Any, Callable, Iterator, Sequence

class Taker:
    def __init__(self, state_at: Sequence[int], generation_at: Sequence[int],
                 owner_at: Sequence[int], waiter_at: Sequence[int], stats_at: tuple[int, int],
                 states: tuple[int, int, int, int], assigned: dict[int, None],
                 ready: collections.deque[int], generations: list[int], filled: list[int],
                 tickets: Iterator[int], wake: Callable[[int, int, int], Any],
                 batch_type: type[BatchCore], batch_views: dict[int, tuple[Any, ...]],
                 cache_views: Callable[[int], tuple[Any, ...]], release_fn: Callable[..., Any],
                 to_fn: Callable[..., Any] | None) -> None: ...
    def take(self, words: memoryview, held: BatchCore | None, t0: int) -> Any: ...

class BatchCore:
    """A Batch's fields and _invalidate() (workers.batch.BatchFields in Python)."""
    _data: dict[str, Any]
    _indices: Any
    _lanes: Any
    _weights: Any
    _release_fn: Any
    _to_fn: Any
    _released: bool
    slot: int
    generation: int
    epoch: int | None
    ends_epoch: bool
    def _invalidate(self) -> None: ...
