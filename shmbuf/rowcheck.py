"""The checks that guard writes: one transition (``add``) or a batch (``extend``) against a spec.

``RowChecker`` validates values completely before anything is written, with errors that name the
field, what was expected, what was given and the fix. Its docstring states the narrowing rule,
the one rule for which values a field takes; ``_cast_rule`` is that rule as dtype logic.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any, NoReturn

import numpy as np

from .errors import SpecMismatchError
from .spec import Field, Spec


def _unknown_names(given: set[str], names: tuple[str, ...]) -> str:
    parts = []
    for name in sorted(given, key=str):
        close = difflib.get_close_matches(str(name), names, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(parts)


# How a value of one dtype goes into a field of another (``RowChecker``'s cached decision).
_REFUSE = 0  # not a same_kind cast: refused whatever the value
_SAFE = 1  # every value of the source dtype fits: stored without a look at the values
_INT_RANGE = 2  # an integer field narrower than the source: bound = (lo, hi)
_FLOAT_RANGE = 3  # a float/complex field narrower than the source: bound = overflow limit
_FLOAT64 = np.dtype(np.float64)  # what a Python float (or complex part) is converted through


def _part(dtype: np.dtype) -> np.dtype:
    """The real dtype of each component (complex64 -> float32); itself for real dtypes."""
    return np.dtype(f"f{dtype.itemsize // 2}") if dtype.kind == "c" else dtype


def _float_max(dtype: np.dtype) -> float | None:
    """Largest finite value of a float (or complex part) dtype narrower than float64."""
    if dtype.kind not in "fc":
        return None
    part = _part(dtype)
    return float(np.finfo(part).max) if part.itemsize < 8 else None


def _overflow_limit(dtype: np.dtype) -> int:
    """The smallest magnitude that a cast into float/complex ``dtype`` rounds to inf, as an
    exact Python int: the largest finite value plus half a unit in its last place (the tie
    rounds to even, which is inf). float16: 65520, float32: 2**128 - 2**103."""
    info = np.finfo(_part(dtype))
    return int(info.max) + 2 ** (info.maxexp - 2 - info.nmant)


def _largest(dtype: np.dtype) -> int:
    """The largest finite magnitude a value (or component) of ``dtype`` can have."""
    if dtype.kind == "b":
        return 1
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return max(-int(info.min), int(info.max))
    return int(np.finfo(_part(dtype)).max)


def _cast_rule(src: np.dtype, dst: np.dtype) -> tuple[int, Any]:
    """(decision, bound) for values of dtype ``src`` going into a field of dtype ``dst``;
    see ``RowChecker`` for the rule. Pure dtype logic, cached per (field, source dtype)."""
    if not np.can_cast(src, dst, "same_kind"):
        return _REFUSE, None
    if dst.kind in "iu":
        if np.can_cast(src, dst, "safe"):
            return _SAFE, None
        info = np.iinfo(dst)
        return _INT_RANGE, (int(info.min), int(info.max))
    if dst.kind in "fc":
        limit = _overflow_limit(dst)
        if _largest(src) < limit:
            return _SAFE, None
        if src.kind in "iu":
            return _FLOAT_RANGE, limit
        return _FLOAT_RANGE, _part(src).type(limit)  # exact: src is the wider float
    return _SAFE, None  # bool into bool


def _show(value: Any) -> str:
    """A value for an error message: Python's repr, not NumPy's (``300``, not ``np.int64(300)``)."""
    item = value.item() if isinstance(value, (np.generic, np.ndarray)) else value
    return repr(item)


def fast_scalars(field: Field) -> tuple[frozenset[type], int, int, float, float]:
    """What stores into scalar ``field`` with no further check: the scalar types that cannot be
    out of kind or range (the field's own NumPy scalar type, Python float/bool where safe), and
    the ranges [lo, hi] in which a Python int, and a Python float, are safe (empty: lo > hi).
    A value outside takes the slow path, which refuses what would overflow in the store."""
    if field.shape != ():
        return frozenset(), 1, 0, 1.0, 0.0
    own = field.dtype.type
    kind = field.dtype.kind
    if kind in "fc":
        fmax = _float_max(field.dtype)
        if fmax is None:  # float64 / complex128 hold every Python float
            return frozenset({own, float, bool}), -(1 << 63), 1 << 63, 1.0, 0.0
        imax = min(1 << 63, int(fmax))
        return frozenset({own, bool}), -imax, imax, -fmax, fmax
    if kind == "b":
        return frozenset({own, bool}), 1, 0, 1.0, 0.0
    info = np.iinfo(field.dtype)
    return frozenset({own, bool}), int(info.min), int(info.max), 1.0, 0.0


class RowChecker:
    """Validates transitions against a spec, whole, before any write.

    ``check_row`` is on the ``add`` hot path: per field it costs a type check, a shape compare and
    a dict lookup of a cached cast decision; no NumPy call unless the value needs converting.

    The narrowing rule. One rule decides which values a field takes, the same for NumPy arrays,
    NumPy scalars and Python numbers (``bool``, ``int``, ``float``, ``complex``), in ``add``,
    ``extend``, vector writers and episode data. It is applied to the whole transition before
    anything is stored, so a refused value raises ``SpecMismatchError`` (naming the field, its
    dtype, the value and the fix) and changes nothing; a value it lets through stores without a
    warning, even under ``python -W error``:

    1. Kind: the value's dtype must cast to the field's under NumPy's ``"same_kind"`` rule
       (bool -> anything; int -> int, float, complex; float -> float, complex; complex ->
       complex). A Python number counts as bool, int64 (any size), float64 or complex128.
    2. Integer fields: every value must lie in the field dtype's range, e.g. [-128, 127] for
       int8 (``np.int64(300)``, ``-1`` into uint8 and ``np.uint64(2**63)`` into int64 are
       refused; nothing wraps).
    3. Float and complex fields: a finite value (each part of a complex one) must stay finite
       after the cast (``70000`` into float16, ``2**200`` into float32 and ``1e300`` into
       complex64 are refused); values that round to the largest finite value are stored
       rounded (``65519.0`` into float16 stores 65504). Non-finite values (``nan``, ``+inf``,
       ``-inf``) are stored as given, ``+inf`` and ``-inf`` alike.

    An array's values count, not its memory layout: non-contiguous, reversed, transposed,
    Fortran-ordered and broadcast arrays are stored as their values, at the speed of a copy.
    """

    def __init__(self, spec: Spec, row_op: str = "add", batch_op: str = "extend") -> None:
        self._row_op, self._batch_op = row_op, batch_op  # named in error messages
        self.names = tuple(spec)
        self._name_set = frozenset(self.names)
        self.fields = self._fields = tuple(spec.values())
        # Per field: source dtype -> (decision, bound) of ``_cast_rule``, filled on first use.
        self._cast_rules: list[dict[np.dtype, tuple[int, Any]]] = [
            {f.dtype: (_SAFE, None)} for f in self._fields
        ]
        self._int_bounds = [
            (int(np.iinfo(f.dtype).min), int(np.iinfo(f.dtype).max)) if f.dtype.kind in "iu" else None
            for f in self._fields
        ]
        self._n = len(self._fields)
        # check_row's fast path: the values in spec order (KeyError: one is missing), then
        # (index, shape, dtype) of each array field and (index, Python and NumPy scalar types
        # that need no check, int range, float range) of each scalar field.
        names = self.names
        self._values_of: Callable[[Mapping[str, Any]], tuple[Any, ...]] = (
            itemgetter(*names) if len(names) > 1 else lambda values: (values[names[0]],))
        self._array_plan = tuple((k, f.shape, f.dtype) for k, f in enumerate(self._fields)
                                 if f.shape != ())
        self._scalar_plan = tuple((k, *fast_scalars(f)) for k, f in enumerate(self._fields)
                                  if f.shape == ())
        self._batch_plan = tuple(
            (k, f.shape, f.dtype, len(f.shape) + 1) for k, f in enumerate(self._fields)
        )

    # -- error helpers -------------------------------------------------------------------------
    def _key_error(self, op: str, given: Mapping[str, Any]) -> SpecMismatchError:
        keys = set(given)
        missing = [n for n in self.names if n not in keys]
        extra = keys - self._name_set
        parts = []
        if missing:
            parts.append(f"missing field(s) {', '.join(map(repr, missing))}")
        if extra:
            parts.append(f"unknown field(s) {_unknown_names(extra, self.names)}")
        return SpecMismatchError(
            f"{op}(): {'; '.join(parts)}. The spec has {', '.join(self.names)}; pass each exactly once."
        )

    def _check_cast(self, op: str, k: int, value: np.ndarray | np.generic) -> None:
        """Apply the narrowing rule (class docstring) to an array or NumPy scalar whose dtype
        differs from field ``k``'s: a cached decision per source dtype, then, only where the
        source can hold values the field cannot, a vectorised look at the values."""
        how, bound = self._cast_rules[k].get(value.dtype) or self._rule(k, value.dtype)
        if how == _SAFE:
            return
        field = self._fields[k]
        if how == _REFUSE:
            raise self._dtype_error(op, field, value.dtype)
        if value.size == 0:
            return
        if how == _INT_RANGE:
            lo, hi = bound
            vmin, vmax = int(value.min()), int(value.max())  # Python ints: no wrap, no warning
            if vmin < lo or vmax > hi:
                raise self._int_range_error(op, field, vmin if vmin < lo else vmax)
            return
        # _FLOAT_RANGE: a finite value at or beyond the overflow limit would become inf.
        for part in ((value.real, value.imag) if value.dtype.kind == "c" else (value,)):
            if part.dtype.kind in "iu":
                over = part >= bound
                if part.dtype.kind == "i":
                    over |= part <= -bound
            else:  # abs and comparisons never warn; nan and inf compare False or are not finite
                over = np.isfinite(part) & (np.abs(part) >= bound)
            if over.any():
                bad = value.reshape(-1)[int(np.flatnonzero(np.reshape(over, -1))[0])]
                raise self._float_range_error(op, field, bad)

    def _int_range_error(self, op: str, field: Field, bad: Any) -> SpecMismatchError:
        info = np.iinfo(field.dtype)
        return SpecMismatchError(
            f"{op}(): field {field.name!r} ({field.dtype}) cannot hold {_show(bad)}: outside "
            f"[{info.min}, {info.max}]. Fix: clip the value into that range, or give the field "
            f"a wider dtype"
        )

    def _float_range_error(self, op: str, field: Field, bad: Any) -> SpecMismatchError:
        largest = np.finfo(_part(field.dtype)).max
        return SpecMismatchError(
            f"{op}(): field {field.name!r} ({field.dtype}) cannot hold {_show(bad)}: outside "
            f"its finite range (largest {float(largest):.6g}), it would be stored as inf. "
            f"Fix: clip or rescale the value, or give the field a wider dtype"
        )

    def _dtype_error(self, op: str, field: Field, got: np.dtype) -> SpecMismatchError:
        if got.kind == "O":
            return SpecMismatchError(
                f"{op}(): field {field.name!r} expects {field.describe()}; got an object array. "
                f"Fix: pass a numeric NumPy array"
            )
        return SpecMismatchError(
            f"{op}(): field {field.name!r} expects dtype {field.dtype}; got {got}, which does not "
            f"cast to it safely (same_kind). Fix: convert it, e.g. x.astype({str(field.dtype)!r})"
        )

    def _as_array(self, op: str, field: Field, value: Any) -> np.ndarray:
        try:
            arr = np.asarray(value)
        except Exception as e:  # ragged lists and the like
            raise SpecMismatchError(
                f"{op}(): field {field.name!r} expects {field.describe()}; "
                f"could not convert {type(value).__name__} to an array ({e})"
            ) from None
        if arr.dtype == object:
            raise SpecMismatchError(
                f"{op}(): field {field.name!r} expects {field.describe()}; got an object array "
                f"(from {type(value).__name__}). Fix: pass a numeric NumPy array"
            )
        return arr  # its values are checked by _check_cast, as any array's

    # -- add -------------------------------------------------------------------------------------
    def check_row(self, values: Mapping[str, Any]) -> list[Any]:
        """Validate one transition; return the values in spec order, ready to store: those
        ``fast_row`` gives where every value takes the fast path, else each value as
        ``_check_value`` takes it (raising for the first that breaks the rule)."""
        row = self.fast_row(values)
        if row is not None:
            return list(row)
        if len(values) != self._n:
            raise self._key_error(self._row_op, values)
        try:
            given = self._values_of(values)
        except KeyError:
            raise self._key_error(self._row_op, values) from None
        return [self._check_value(k, v) for k, v in enumerate(given)]

    def fast_row(self, values: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """The values of one transition in spec order if each stores as it is (an array of
        exactly the field's shape and dtype, any strides; a scalar of the field's own NumPy
        type, or a Python float/bool/int that fits the field), else None. (The compiled add,
        ``_add_c.c``, stores these without calling it.)"""
        if len(values) != self._n:
            return None
        try:
            row = self._values_of(values)
        except KeyError:
            return None
        try:  # (any object with this shape and dtype stores as NumPy assigns it)
            for k, shape, dtype in self._array_plan:
                v = row[k]
                if v.shape != shape or v.dtype is not dtype:
                    return None
        except AttributeError:  # not an array
            return None
        for k, fast_scalar, int_lo, int_hi, f_lo, f_hi in self._scalar_plan:
            v = row[k]
            tv = type(v)
            if not (tv in fast_scalar or (tv is int and int_lo <= v <= int_hi)
                    or (tv is float and f_lo <= v <= f_hi)):
                return None
        return row

    def _check_value(self, k: int, v: Any) -> Any:
        field = self._fields[k]
        if type(v) is np.ndarray:
            if v.shape != field.shape:
                raise SpecMismatchError(
                    f"{self._row_op}(): field {field.name!r} expects one transition of shape "
                    f"{field.shape}; got shape {v.shape}. Fix: pass a single row (for a batch "
                    f"of rows use extend())"
                )
            if v.dtype is not field.dtype:
                self._check_cast(self._row_op, k, v)
            return v  # any strides: stores copy it as its bytes lie
        return self._check_scalar(k, field, v)

    def _check_scalar(self, k: int, field: Field, v: Any) -> Any:
        """A Python number or NumPy scalar (or anything array-like) for field ``k``."""
        kind = field.dtype.kind
        op = self._row_op
        if isinstance(v, (bool, np.bool_)):
            ok = True
        elif isinstance(v, int):  # Python int (bool was handled above); NumPy ints go below
            ok = kind in "iufc"
            bounds = self._int_bounds[k]
            if bounds is not None and not bounds[0] <= v <= bounds[1]:
                raise self._int_range_error(op, field, v)
            if ok and kind in "fc":
                try:
                    f = float(v)  # as NumPy converts it: to float64 first
                except OverflowError:
                    raise self._float_range_error(op, field, v) from None
                self._check_python_float(op, k, field, f, v)
        elif isinstance(v, float):
            ok = kind in "fc"
            if ok:
                self._check_python_float(op, k, field, v, v)
        elif isinstance(v, complex):
            ok = kind == "c"
            if ok:
                self._check_python_float(op, k, field, v.real, v)
                self._check_python_float(op, k, field, v.imag, v)
        else:
            arr = v if isinstance(v, np.generic) else self._as_array(op, field, v)
            if arr.shape != field.shape:
                raise SpecMismatchError(
                    f"{op}(): field {field.name!r} expects one transition of shape {field.shape}; "
                    f"got shape {arr.shape} ({type(v).__name__})"
                )
            if arr.dtype is not field.dtype:
                self._check_cast(op, k, arr)
            return arr
        if field.shape != ():
            raise SpecMismatchError(
                f"{op}(): field {field.name!r} expects shape {field.shape}; got the scalar {v!r}"
            )
        if not ok:
            raise SpecMismatchError(
                f"{op}(): field {field.name!r} expects dtype {field.dtype}; got the Python "
                f"{type(v).__name__} {v!r}, which does not cast to it safely (same_kind)"
            )
        return v

    def _check_python_float(self, op: str, k: int, field: Field, f: float, given: Any) -> None:
        """Rule 3 for one float64 value (or complex part) ``f`` going into float field ``k``."""
        how, limit = self._cast_rules[k].get(_FLOAT64) or self._rule(k, _FLOAT64)
        if how == _FLOAT_RANGE and math.isfinite(f) and abs(f) >= limit:
            raise self._float_range_error(op, field, given)

    def _rule(self, k: int, src: np.dtype) -> tuple[int, Any]:
        """Decide (and cache) how values of dtype ``src`` go into field ``k``."""
        rule = self._cast_rules[k][src] = _cast_rule(src, self._fields[k].dtype)
        return rule

    # -- extend ----------------------------------------------------------------------------------
    def check_batch(self, data: Mapping[str, Any]) -> tuple[int, Sequence[np.ndarray]]:
        """Validate a batch of transitions; return (rows, arrays in spec order)."""
        if type(data) is not dict and not isinstance(data, Mapping):
            raise SpecMismatchError(
                f"{self._batch_op}(): expects a mapping of field name -> array, got {type(data).__name__}"
            )
        if len(data) != self._n:
            raise self._key_error(self._batch_op, data)
        try:
            given = self._values_of(data)
        except KeyError:
            raise self._key_error(self._batch_op, data) from None
        arrays: list[Any] | None = None  # made where a value is not an array yet
        n = -1
        ndarray = np.ndarray
        for k, shape, dtype, ndim in self._batch_plan:
            v = given[k]
            if type(v) is not ndarray:
                v = self._as_array(self._batch_op, self._fields[k], v)
                arrays = list(given) if arrays is None else arrays
                arrays[k] = v
            s = v.shape
            if len(s) != ndim or s[1:] != shape or (n >= 0 and s[0] != n):
                self._batch_shape_error(k, v, n)
            n = s[0]
            if v.dtype is not dtype:
                self._check_cast(self._batch_op, k, v)
        return n, given if arrays is None else arrays  # any strides: stores copy them as they lie

    def _batch_shape_error(self, k: int, arr: np.ndarray, n: int) -> NoReturn:
        field = self._fields[k]
        if arr.ndim != len(field.shape) + 1 or arr.shape[1:] != field.shape:
            want = ", ".join(["n", *map(str, field.shape)])
            raise SpecMismatchError(
                f"{self._batch_op}(): field {field.name!r} expects shape ({want}), rows of {field.shape}; "
                f"got {arr.shape}. Fix: stack rows on a new leading axis (for one row use add())"
            )
        first = self._fields[0].name
        raise SpecMismatchError(
            f"{self._batch_op}(): fields disagree on the number of rows: {first!r} has {n}, "
            f"{field.name!r} has {arr.shape[0]}. Fix: pass the same n for every field"
        )
