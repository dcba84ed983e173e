"""What a weight store takes and fills: NumPy arrays, torch tensors (any device) and modules, as
host arrays, each checked against the store's tensors (names, shapes, dtypes) before anything
in shared memory changes. torch is never imported here: a tensor means torch is loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from . import layout as L
from .errors import SpecMismatchError
from .weights_layout import NUMERIC_KINDS

Columns = Sequence[L.Column]


def is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


@lru_cache(maxsize=64)
def numpy_dtype(torch_dtype: Any) -> np.dtype | None:
    """The NumPy dtype of a torch dtype; None where NumPy has none (bfloat16, quantized)."""
    torch = sys.modules["torch"]
    try:
        return np.dtype(torch.empty(0, dtype=torch_dtype).numpy().dtype)
    except (TypeError, RuntimeError):
        return None


def described(value: Any) -> tuple[tuple[int, ...], np.dtype | None, Callable[[], np.ndarray]]:
    """(shape, NumPy dtype or None, a function giving its values as a host array) of a tensor,
    an array or anything ``np.asarray`` takes, without copying anything yet."""
    if is_tensor(value):
        def host() -> np.ndarray:  # a device's tensor is copied to host; a CPU one is viewed
            return np.asarray(value.detach().cpu().resolve_conj().resolve_neg().numpy())

        return tuple(value.shape), numpy_dtype(value.dtype), host
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    return array.shape, array.dtype, lambda: array


def params_of(params: Any, what: str) -> Mapping[str, Any]:
    """``params`` as a mapping of name -> tensor (a torch module gives its ``state_dict()``)."""
    if isinstance(params, Mapping):
        return params
    if callable(getattr(params, "state_dict", None)):
        state: Mapping[str, Any] = params.state_dict()
        return state
    raise TypeError(f"{what} takes a mapping of name -> array or tensor (e.g. a torch "
                    f"state_dict) or a torch module, got a {type(params).__name__}")


def template_tensors(template: Any) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(name, shape, little-endian dtype) of each tensor of a template, checked."""
    values = params_of(template, "WeightStore.create(template=...)")
    if not values:
        raise ValueError("the template holds no tensors: pass the arrays or state_dict to share")
    out = []
    for name, value in values.items():
        if not isinstance(name, str):
            raise TypeError(f"template names must be str, got {name!r}")
        shape, dtype, _ = described(value)
        if dtype is None or dtype.kind not in NUMERIC_KINDS or dtype.fields is not None:
            raise TypeError(
                f"template tensor {name!r} has dtype {getattr(value, 'dtype', dtype)}, which a "
                f"weight store cannot hold (plain bool, int, float or complex numbers only). "
                f"Fix: convert it, e.g. tensor.float() for bfloat16")
        out.append((name, shape, dtype.newbyteorder("<")))
    return out


def _listed(names: Iterable[str], limit: int = 8) -> str:
    shown = sorted(names)
    more = f" and {len(shown) - limit} more" if len(shown) > limit else ""
    return ", ".join(repr(n) for n in shown[:limit]) + more


def check_names(store: str, columns: Columns, names: Iterable[str], what: str) -> None:
    """Refuse ``names`` unless they are exactly the names of weight store ``store``."""
    given, held = set(names), {c.name for c in columns}
    if given == held:
        return
    missing, extra = held - given, given - held
    parts = ([f"lack {_listed(missing)}"] if missing else []) + (
        [f"have {_listed(extra)}, which the store does not hold"] if extra else [])
    raise SpecMismatchError(
        f"{what} do not match weight store {store!r}: they {' and '.join(parts)}. A store's "
        f"names, shapes and dtypes are fixed at creation. Fix: use the same architecture as the "
        f"template, or create a new WeightStore from the new one; nothing was changed")


def check_tensor(store: str, column: L.Column, shape: tuple[int, ...], dtype: np.dtype | None,
                 what: str) -> None:
    """Refuse a tensor of ``what`` unless its shape and dtype (byte order aside) are
    ``column``'s."""
    if tuple(shape) != column.shape:
        raise SpecMismatchError(
            f"tensor {column.name!r} of {what} has shape {tuple(shape)}, but weight store "
            f"{store!r} holds it as {column.shape} (fixed at creation). Fix: the same "
            f"architecture as the template, or create a new WeightStore from the new template; "
            f"nothing was changed")
    if dtype is None or not np.can_cast(dtype, column.dtype, casting="equiv"):
        raise SpecMismatchError(
            f"tensor {column.name!r} of {what} has dtype {dtype or 'without a NumPy dtype'}, "
            f"but weight store {store!r} holds {column.dtype} (fixed at creation). Fix: convert "
            f"it (e.g. .to(torch.float32) or .astype(np.float32)), or create a new WeightStore "
            f"from the new template; nothing was changed")


def host_arrays(store: str, columns: Columns, params: Any) -> list[np.ndarray]:
    """``params`` (a publish's) as host arrays in the store's order, every name, shape and dtype
    checked before any tensor is copied to the host."""
    values = params_of(params, "publish()")
    what = "the published params"
    check_names(store, columns, values.keys(), what)
    hosts = []
    for column in columns:
        shape, dtype, host = described(values[column.name])
        check_tensor(store, column, shape, dtype, what)
        hosts.append(host)
    return [host() for host in hosts]


def array_targets(store: str, columns: Columns, out: Any) -> list[np.ndarray]:
    """The arrays of ``out`` (a ``read_into``'s) in the store's order, checked."""
    if not isinstance(out, Mapping):
        raise TypeError(f"read_into() takes a mapping of name -> array (e.g. new_arrays()), "
                        f"got a {type(out).__name__}")
    what = "the arrays given to read_into()"
    check_names(store, columns, out.keys(), what)
    targets = []
    for column in columns:
        dst = out[column.name]
        if not isinstance(dst, np.ndarray):
            raise SpecMismatchError(
                f"read_into() copies into NumPy arrays; {column.name!r} is a "
                f"{type(dst).__name__}. Fix: new_arrays(), or load_into() for a torch model")
        check_tensor(store, column, dst.shape, dst.dtype, what)
        if not dst.flags.writeable:
            raise SpecMismatchError(f"array {column.name!r} given to read_into() is read-only")
        targets.append(dst)
    return targets


def tensor_targets(store: str, columns: Columns, model: Any) -> list[Any]:
    """The tensors of a module's ``state_dict()`` (or a mapping of tensors; a ``load_into``'s)
    in the store's order, checked. They alias the module's parameters and buffers."""
    state = params_of(model, "load_into()")
    what = "the model's state_dict"
    check_names(store, columns, state.keys(), what)
    targets = []
    for column in columns:
        value = state[column.name]
        if not is_tensor(value):
            raise SpecMismatchError(
                f"load_into() copies into torch tensors; {column.name!r} is a "
                f"{type(value).__name__}. Fix: read_into() for NumPy arrays")
        check_tensor(store, column, tuple(value.shape), numpy_dtype(value.dtype), what)
        targets.append(value)
    return targets
