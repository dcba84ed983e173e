# A lane's store and a writer's add, compiled (_add_c.c): see that file and store.py.
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

MAX_FIELDS: int

class LaneStore:
    compiled: bool
    next: int
    step: int
    episode_bits: int
    room_until: int
    lim_gen: int
    def __init__(self, words: Any, at: tuple[int, ...], names: tuple[str, ...],
                 columns: Sequence[tuple[Any, ...]], pending: tuple[Any, ...] | None = None,
                 /) -> None: ...
    def append(self, values: Sequence[Any], /) -> int | None: ...
    def put(self, index: int, meta: int, values: Sequence[Any], /) -> None: ...
    def put_many(self, first: int, meta: int, arrays: Sequence[np.ndarray], /) -> None: ...
    def release(self) -> None: ...

def put_lanes(stores: Sequence[LaneStore], index: np.ndarray, meta: np.ndarray,
              values: Sequence[Any], /) -> None: ...

class AddMethod:
    def __init__(self, fallback: Callable[..., Any], one_env: bool = False) -> None: ...
    def __call__(self, writer: Any, /, **fields: Any) -> Any: ...
    def __get__(self, obj: Any, owner: Any = None) -> Any: ...
