"""``Writer.add`` compiled for one spec: the method's own source with a keyword parameter per
field, and in front of it one call that checks and stores the whole row in C (``_add_c.RowPut``,
where it was built); the method's own path, with the row checker's fast check per field inline,
takes what that call leaves (values to convert, room to wait for) and runs where it was not built.
"""

from __future__ import annotations

import inspect
import keyword
import textwrap
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .rowcheck import _MISSING, RowChecker, fast_scalars

stream_rows: Callable[[np.ndarray, int, Any, int], bool] | None
try:  # optional, built where a compiler was at hand (setup.py): else NumPy stores every row
    from ._stream_c import store_rows as stream_rows
except ImportError:
    stream_rows = None

RowPut: Any
try:  # optional, built against NumPy's headers where a compiler was at hand (setup.py)
    from ._add_c import MAX_FIELDS as PUT_MAX_FIELDS
    from ._add_c import RowPut
except ImportError:  # (a NumPy older than the one it was built against raises ImportError)
    RowPut, PUT_MAX_FIELDS = None, 0

_compiled: weakref.WeakKeyDictionary[RowChecker, dict[Any, Any]] = weakref.WeakKeyDictionary()
# Rows of at least this many bytes are stored streaming past the caches (``_stream_c.c``): an
# Atari frame stack (28 KB) in about half the time of NumPy's copy, which first reads every
# cache line it writes. Below a few KB a row is better left in the cache it is written to.
STREAM_MIN_ROW_BYTES = 4096
_INT64 = (-(1 << 63), (1 << 63) - 1)


def fast_check(checker: RowChecker, k: int, var: str, one_env: bool = False
               ) -> tuple[str, dict[str, Any]]:
    """``RowChecker.check_row``'s fast path for field ``k`` as Python source: an expression
    that is true when the value held in variable ``var`` stores as it is, and the names it
    uses. It may raise (``AttributeError``: not an array) where it is false; false says
    nothing: the caller then runs the full checker, which decides and explains.

    Arrays (any field, and every field with ``one_env``: one row of a batch, ``[1, *shape]``)
    pass as NumPy arrays or scalars of exactly the field's dtype and shape, C-contiguous;
    scalars also as Python numbers that fit the field (``rowcheck.fast_scalars``).
    """
    field = checker.fields[k]
    dtype = field.dtype
    shape = (1, *field.shape) if one_env else field.shape
    strides = np.empty(shape, dtype).strides
    names = {f"_dtype{k}": dtype, f"_shape{k}": shape, f"_strides{k}": strides}
    # Exact dtype: a NumPy object. C-contiguous strides of the field's shape say how many
    # dimensions it has: with one, its size says its shape, and an int compares faster.
    size = f"{var}.size == {shape[0]}" if len(shape) == 1 else f"{var}.shape == _shape{k}"
    array = f"({var}.dtype is _dtype{k} and {var}.strides == _strides{k} and {size})"
    if one_env:  # a row given as ``x[None]`` has stride 0 on its first axis: any stride is fine
        array = f"({var}.dtype is _dtype{k} and {var}.shape == _shape{k} and {var}.flags.c_contiguous)"
    if shape != ():
        return array, names
    scalar_types, int_lo, int_hi, f_lo, f_hi = fast_scalars(field)
    parts = []  # Python numbers first, the commonest way to give a scalar
    if dtype.kind == "b":
        parts.append(f"type({var}) is bool")
    if f_lo <= f_hi:
        parts.append(f"(type({var}) is float and {f_lo!r} <= {var} <= {f_hi!r})")
    if int_lo <= int_hi:
        parts.append(f"(type({var}) is int and {int_lo!r} <= {var} <= {int_hi!r})")
    names[f"_scalars{k}"] = scalar_types
    parts.append(f"type({var}) in _scalars{k}")
    return "(" + " or ".join(parts) + ")", names


def large_rows(field: Any) -> bool:
    """Whether rows of ``field`` (a ``Spec`` field) are large enough to store streaming past
    the caches (``STREAM_MIN_ROW_BYTES``): by ``stream_rows`` and by ``_add_c``."""
    return field.dtype.itemsize * int(np.prod(field.shape)) >= STREAM_MIN_ROW_BYTES


def streams(field: Any) -> bool:
    """Whether rows of ``field`` (a ``Spec`` field) are stored with ``stream_rows``: large
    rows of plain numeric dtypes, where the streaming extension was built. A row it cannot
    take as it is (another dtype, not contiguous) it refuses, and NumPy stores it."""
    return (stream_rows is not None and field.dtype.kind in "biuf" and field.dtype.isnative
            and large_rows(field))


def puts_rows(checker: RowChecker) -> bool:
    """Whether ``Writer.add`` of ``checker``'s spec stores through ``_add_c.RowPut``: where it
    was built, for specs of up to ``PUT_MAX_FIELDS`` fields of plain numeric dtypes."""
    return RowPut is not None and len(checker.fields) <= PUT_MAX_FIELDS and all(
        f.dtype.kind in "biufc" and f.dtype.isnative and not f.dtype.hasobject
        for f in checker.fields)


def row_put(checker: RowChecker, words: Any, at: tuple[int, ...], columns: Sequence[np.ndarray],
            pending: np.ndarray | None, one_env: bool) -> Callable[..., Any]:
    """``RowPut(...).put`` for one lane: ``words`` the segment's words; ``at`` the lane's
    (committed, reserved, limiter generation, first stamp, first meta word) word offsets, its
    capacity and the step mask; ``columns`` the lane's column per stored field; ``pending`` the
    row a derived buffer keeps of the last next_obs (its last field, not stored), else None.
    The field checks are ``fast_check``'s (``one_env``: rows of ``[1, *shape]``, and the index
    returned as an int64 array of one, as a one-env ``add`` returns it)."""
    dests = [(col, 1) for col in columns] + ([(pending, 0)] if pending is not None else [])
    fields = []
    for f, (dest, per_slot) in zip(checker.fields, dests, strict=True):
        numbers = f.shape == () and not one_env and f.dtype.itemsize <= 16  # (_add_c's scratch)
        types, int_lo, int_hi, f_lo, f_hi = fast_scalars(f)
        plain = f.dtype.kind in "biu" or f.dtype.kind == "f" and f.dtype.itemsize in (4, 8)
        if not numbers or not plain:  # _add_c converts Python numbers only into these
            types, int_lo, int_hi, f_lo, f_hi = frozenset(), 1, 0, 1.0, 0.0
        nbytes = f.dtype.itemsize * int(np.prod(f.shape))
        fields.append((f.dtype, (1, *f.shape) if one_env else f.shape, dest, nbytes * per_slot,
                       large_rows(f), numbers, bool in types, float in types,
                       max(int_lo, _INT64[0]), min(int_hi, _INT64[1]), f_lo, f_hi))
    return RowPut(words, at, fields, one_env).put  # type: ignore[no-any-return]


def compiled_add(method: Callable[..., Any], checker: RowChecker, derived: bool,
                 one_env: bool) -> Callable[..., Any] | None:
    """``method`` (``Writer.add``) for the fields of ``checker`` (``derived``: its last field,
    next_obs, is kept for the FINAL row instead of stored), compiled once per checker from the
    source of ``method``, whose COMPILED(...) lines it replaces: a keyword parameter per field
    (no dict of keyword arguments); first, where ``puts_rows``, one call of ``self._put`` (a
    ``row_put``) that checks and stores the row; else, or where that call stored nothing,
    ``fast_check`` per field with the full checker (``_add_checked``, which also converts each
    value to its field's dtype where the call exists) only where one is false, room from the
    rate limiter, the call again with the checked values (not ``one_env``), and else
    ``slots.write_row``. With ``one_env``, the ``add`` of a one-env ``VectorWriter`` (every
    field ``[1, ...]``, the index returned as an array of one), on its lane's ``Writer``. None
    where field names cannot be parameters (not identifiers, keywords, or names of the
    method's locals)."""
    cache = _compiled.setdefault(checker, {})
    if (method, one_env) in cache:
        return cache[method, one_env]
    names = checker.names
    code = method.__code__  # a field may not shadow a local or a global it uses
    taken = {*code.co_varnames, *code.co_names, "np"}
    try:
        source = textwrap.dedent(inspect.getsource(method))
    except (OSError, TypeError):  # no source (frozen): the plain method
        source = ""
    if not source or any(not n.isidentifier() or keyword.iskeyword(n) or n in taken
                         for n in names):
        cache[method, one_env] = None
        return None
    one_index = np.zeros(1, np.int64)  # copied for the index a one-env add returns (faster
    one_index.flags.writeable = False  # than np.empty: about 0.15 us of a 2 us add)
    scope: dict[str, Any] = {**method.__globals__, "_MISSING": _MISSING, "_ONE_INDEX": one_index}
    checks = []
    for k, name in enumerate(names):
        expr, used = fast_check(checker, k, name, one_env)
        checks.append(expr)
        scope.update(used)
    given = ", ".join(names) + ","
    ret = ["_r = _ONE_INDEX.copy()", "_r[0] = i", "return _r"] if one_env else ["return i"]
    put = [] if not puts_rows(checker) else [
        "if lane._closed_reason is None and not fields:",
        "    i = lane._next",
        "    _r = self._put(i, lane._room_until, lane._lim_gen, lane._episode_bits, "
        f"lane._step, {given})",
        "    if _r is not None:",  # i, or for one_env the index array
        "        lane._next = i + 1",
        "        lane._step += 1",
        "        return _r"]
    put_checked = [] if not put or one_env else [
        "_i = self._put(i, lane._room_until, lane._lim_gen, lane._episode_bits, lane._step, "
        "*values)",
        "if _i is not None:",
        "    lane._next = i + 1",
        "    lane._step += 1",
        "    return i"]
    rows = "".join(f"{n}[0], " for n in names) if one_env else given  # one_env: [1, ...] each
    replace = {
        "lane": ["lane = self._lane" if one_env else "lane = self"],
        "put": put,
        "put_checked": put_checked,
        "check": ["try:",
                  "    _fast = lane._closed_reason is None and not fields and (",
                  *(f"        {c}{' and' if k < len(checks) - 1 else ''}"
                    for k, c in enumerate(checks)),
                  "    )",
                  "except Exception:  # e.g. AttributeError: not an array",
                  "    _fast = False",
                  f"values = ({rows}) if _fast else self._add_checked(fields, ({given}), "
                  f"{one_env})"],
        "room": ["self._make_lane_room(i)" if one_env else "lane._make_room(1, i)"],
        "derived": ["lane._last_next_obs[...] = values[-1]"] if derived else [],
        "return": ret,
    }
    lines, skip_body, body_indent = [], False, 0
    for line in source.splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        if skip_body:
            if len(indent) > body_indent:
                continue
            skip_body = False
        if line.lstrip().startswith("def add("):
            params = "".join(f"{n}=_MISSING, " for n in names)
            lines.append(f"def add(self, *, {params}**fields):")
            continue
        if "# COMPILED(" in line:
            key = line.split("# COMPILED(")[1].split(")")[0]
            lines += [indent + r for r in replace[key]]
            if line.split("#")[0].rstrip().endswith(":"):  # a compound statement: its body too
                skip_body, body_indent = True, len(indent)
            continue
        lines.append(line)
    code = compile("\n".join(lines) + "\n", "<Writer.add compiled for a spec>", "exec")
    exec(code, scope)  # noqa: S102 - Writer.add's own source, field names checked above
    fn = cache[method, one_env] = scope["add"]
    fn.__doc__ = method.__doc__
    fn.__source__ = "\n".join(lines)  # for reading: print(type(w).add.__source__)
    return fn
