"""What a transition holds: named fields, each with a shape and a dtype.

``Spec`` describes rows (built directly, from JSON, from an example or from gymnasium spaces);
``rowcheck.RowChecker`` validates values against it before anything is written.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from .errors import SpecMismatchError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]*$")
_KINDS = "biufc"  # bool, signed, unsigned, float, complex


class Field(NamedTuple):
    """One named array of a transition: ``shape`` excludes the batch axis."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def row_nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # np.prod costs 3 us; this 0.1

    def describe(self) -> str:
        return f"shape {self.shape} {self.dtype}"


def _as_dtype(name: str, dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise SpecMismatchError(f"field {name!r}: {dtype!r} is not a NumPy dtype ({e})") from None
    if dt.kind not in _KINDS or dt.fields is not None or dt.subdtype is not None:
        raise SpecMismatchError(
            f"field {name!r}: dtype {dt} is not supported; use a bool, integer, float or complex "
            f"dtype (store strings or objects as fixed-size integer codes)"
        )
    return dt.newbyteorder("=") if dt.byteorder == ">" else dt


def _as_shape(name: str, shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        shape = tuple(operator.index(d) for d in shape)  # ints only, as NumPy: no 2.5, no "2"
    except TypeError:
        raise SpecMismatchError(
            f"field {name!r}: shape must be a tuple of ints, got {shape!r}"
        ) from None
    if any(d < 0 for d in shape):
        raise SpecMismatchError(f"field {name!r}: shape {shape} has a negative dimension")
    return shape


class Spec(Mapping[str, Field]):
    """The fields of a transition, in order.

    Example:
        >>> spec = Spec(obs=((4, 84, 84), "uint8"), action=((), "int64"), reward=((), "float32"))
        >>> spec["obs"].shape
        (4, 84, 84)
    """

    def __init__(self, fields: Mapping[str, Any] | None = None, /, **kwargs: Any) -> None:
        items = dict(fields or {})
        overlap = set(items) & set(kwargs)
        if overlap:
            raise SpecMismatchError(f"field(s) {sorted(overlap)} given twice")
        items.update(kwargs)
        if not items:
            raise SpecMismatchError("a Spec needs at least one field, e.g. Spec(obs=((4,), 'float32'))")
        self._fields: dict[str, Field] = {}
        for name, value in items.items():
            if not isinstance(name, str) or not _NAME.match(name):
                raise SpecMismatchError(
                    f"field name {name!r} is not allowed: use letters, digits, '_', '.', '-', '/' "
                    f"and do not start with '_' (reserved for shmbuf's own columns)"
                )
            if isinstance(value, Field):
                shape, dtype = value.shape, value.dtype
            else:
                try:
                    shape, dtype = value
                except (TypeError, ValueError):
                    raise SpecMismatchError(
                        f"field {name!r}: expected (shape, dtype), e.g. ((17,), 'float32'), "
                        f"got {value!r}"
                    ) from None
            self._fields[name] = Field(name, _as_shape(name, shape), _as_dtype(name, dtype))

    # Mapping protocol
    def __getitem__(self, name: str) -> Field:
        return self._fields[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Spec):
            return NotImplemented
        return self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(tuple((f["name"], tuple(f["shape"]), f["dtype"]) for f in self.to_json()))

    def __repr__(self) -> str:
        inner = ", ".join(f"{f.name}=({f.shape}, '{f.dtype}')" for f in self._fields.values())
        return f"Spec({inner})"

    @property
    def row_nbytes(self) -> int:
        """Bytes of one transition over all fields."""
        return sum(f.row_nbytes for f in self._fields.values())

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {"name": f.name, "shape": list(f.shape), "dtype": f.dtype.str}
            for f in self._fields.values()
        ]

    @classmethod
    def from_json(cls, doc: list[dict[str, Any]]) -> Spec:
        return cls({d["name"]: (tuple(d["shape"]), d["dtype"]) for d in doc})

    @classmethod
    def from_example(cls, transition: Mapping[str, Any]) -> Spec:
        """Infer a spec from one transition.

        Python ``float`` becomes float32, ``int`` int64 and ``bool`` bool (the usual RL choices);
        arrays keep their dtype.
        """
        fields: dict[str, tuple[tuple[int, ...], Any]] = {}
        for name, value in transition.items():
            if isinstance(value, bool):
                fields[name] = ((), np.bool_)
            elif isinstance(value, int):
                fields[name] = ((), np.int64)
            elif isinstance(value, float):
                fields[name] = ((), np.float32)
            else:
                arr = np.asarray(value)
                if arr.dtype == object:
                    raise SpecMismatchError(
                        f"field {name!r}: cannot infer a dtype from {type(value).__name__} "
                        f"(object array); pass a numeric array"
                    )
                fields[name] = (arr.shape, arr.dtype)
        return cls(fields)

    @classmethod
    def from_spaces(
        cls,
        observation_space: Any,
        action_space: Any,
        *,
        next_obs: bool = True,
        reward_dtype: Any = "float32",
        layout: str = "gymnasium",
    ) -> Spec:
        """Build the usual transition spec from gymnasium spaces.

        ``layout="gymnasium"`` (default): fields ``obs``, ``next_obs`` (unless
        ``next_obs=False``), ``action``, ``reward``, ``terminated`` and ``truncated``, shaped as
        the spaces are (a Discrete action is ``()``; reward and the flags are scalars, the flags
        bool). Box, Discrete, MultiDiscrete, MultiBinary, Dict and Tuple spaces are supported;
        nested keys are flattened to ``"obs/camera"`` names.

        ``layout="sb3"``: Stable-Baselines3's replay buffer shapes: observations as SB3's
        ``get_obs_shape`` (a Discrete one is ``(1,)``; Dict spaces one level deep), ``action``
        flat ``(action_dim,)`` (a Discrete action is ``(1,)``; float64 cast to float32),
        ``reward`` ``(1,)`` and float32 ``done`` / ``truncated`` flags of shape ``(1,)``:
        ``done`` is SB3's (terminated or truncated), ``truncated`` its
        ``info["TimeLimit.truncated"]``; ``done * (1 - truncated)`` is "terminated".
        """
        import gymnasium  # noqa: F401  (imported only here: gymnasium is an optional extra)

        if layout not in ("gymnasium", "sb3"):
            raise ValueError(f"layout must be 'gymnasium' or 'sb3', got {layout!r}")
        fields: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        if layout == "sb3":
            _sb3_fields(observation_space, action_space, fields)
        else:
            _flatten_space("obs", observation_space, fields)
        if next_obs:
            for name, value in [(n, v) for n, v in fields.items() if n.split("/")[0] == "obs"]:
                fields["next_obs" + name[3:]] = value
        flag = ((1,), np.dtype(np.float32)) if layout == "sb3" else ((), np.dtype(np.bool_))
        if layout == "sb3":
            fields["action"] = fields.pop("action")  # after next_obs, as in the gymnasium layout
        else:
            _flatten_space("action", action_space, fields)
        fields["reward"] = ((1,) if layout == "sb3" else (), np.dtype(reward_dtype))
        fields["done" if layout == "sb3" else "terminated"] = flag
        fields["truncated"] = flag
        return cls(fields)


def _sb3_fields(observation_space: Any, action_space: Any, out: dict[str, Any]) -> None:
    """``obs`` (or ``obs/<key>``) and ``action`` as SB3's ReplayBuffer stores them."""
    from gymnasium import spaces

    def obs_shape(space: Any) -> tuple[int, ...]:
        if isinstance(space, spaces.Discrete):
            return (1,)
        if isinstance(space, spaces.MultiDiscrete):
            return (len(space.nvec),)
        if isinstance(space, (spaces.Box, spaces.MultiBinary)):
            return tuple(space.shape)
        raise SpecMismatchError(
            f"observation space {type(space).__name__} is not supported by the sb3 layout "
            f"(SB3 supports Box, Discrete, MultiDiscrete, MultiBinary and a Dict of those)")

    if isinstance(observation_space, spaces.Dict):
        for key, sub in observation_space.spaces.items():
            out[f"obs/{key}"] = (obs_shape(sub), np.dtype(sub.dtype))
    else:
        out["obs"] = (obs_shape(observation_space), np.dtype(observation_space.dtype))
    if not isinstance(action_space, (spaces.Box, spaces.Discrete, spaces.MultiDiscrete,
                                     spaces.MultiBinary)):
        raise SpecMismatchError(
            f"action space {type(action_space).__name__} is not supported by the sb3 layout "
            f"(SB3 supports Box, Discrete, MultiDiscrete and MultiBinary actions)")
    dim = 1 if isinstance(action_space, spaces.Discrete) else math.prod(action_space.shape)
    dtype = np.dtype(action_space.dtype)
    out["action"] = ((dim,), np.dtype(np.float32) if dtype == np.float64 else dtype)


def _flatten_space(prefix: str, space: Any, out: dict[str, Any]) -> None:
    from gymnasium import spaces

    if isinstance(space, spaces.Dict):
        for key, sub in space.spaces.items():
            _flatten_space(f"{prefix}/{key}", sub, out)
    elif isinstance(space, spaces.Tuple):
        for i, sub in enumerate(space.spaces):
            _flatten_space(f"{prefix}/{i}", sub, out)
    elif isinstance(space, spaces.Box):
        out[prefix] = (tuple(space.shape), np.dtype(space.dtype))
    elif isinstance(space, spaces.Discrete):
        out[prefix] = ((), np.dtype(space.dtype or np.int64))
    elif isinstance(space, spaces.MultiDiscrete):
        out[prefix] = (tuple(space.nvec.shape), np.dtype(space.dtype))
    elif isinstance(space, spaces.MultiBinary):
        out[prefix] = (tuple(space.shape), np.dtype(space.dtype))
    else:
        raise SpecMismatchError(
            f"{prefix}: gymnasium space {type(space).__name__} is not supported by "
            f"Spec.from_spaces; describe it with Spec(...) directly"
        )
