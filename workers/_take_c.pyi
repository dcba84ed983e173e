# LearnerRing.take compiled (_take_c.c): see that file, and workers/learner_ring.py for the
# records it works on.
from typing import Any, Callable

RECORD_FIELDS: tuple[str, ...]
STATUSES: tuple[str, ...]

class Taker:
    def __init__(self, words: memoryview, records: Any, templates: list[Any],
                 wake: Callable[[int], Any]) -> None: ...
    def take(self, held: BatchCore | None, t0: int) -> Any: ...

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
