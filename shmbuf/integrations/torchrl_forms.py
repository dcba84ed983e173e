"""What TorchRL hands a storage (TensorDicts, plain tensors, pytrees of tensors, lists of items)
as a shmbuf spec's fields and back: each leaf is a field named by its place in the data, and a
one-byte marker field says how to rebuild the data from the fields (``Form``), so every process
attaching the segment by name reads the rows back as the process that wrote them gave them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, is_tensor_collection

from ..errors import SpecMismatchError
from ..spec import Spec

KEY_SEPARATOR = "/"  # nested key ("next", "obs") <-> field "next/obs"; tree paths alike
MARK_PREFIX = "torchrl."  # the marker field: "torchrl.<kind>.<batch dims>"
TENSOR_FIELD = "data"  # a plain tensor's one field
TREE_ROOT = "tree"  # a pytree leaf's field: "tree/d.obs/t.0" (dict key "obs", tuple item 0)
_MARK = re.compile(r"^torchrl\.(td|tensor|tree)\.(\d+)$")
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*$")  # a dict key that can be a path segment
_KINDS: dict[type, str] = {dict: "d", tuple: "t", list: "l"}


@dataclass(frozen=True)
class Form:
    """How a row's fields make the data back: ``kind`` ("td": a TensorDict, "tensor": a plain
    tensor, "tree": dicts, tuples and lists of tensors) and ``batch_dims``, the dimensions after
    the storage's first that every field starts with and that are batch dimensions (a
    TensorDict ``[n, T]``'s ``T``; a storage with ``ndim=2``'s second dimension)."""

    kind: str
    batch_dims: int

    @property
    def marker(self) -> str | None:
        """The marker field's name; None for a TensorDict of one batch dimension (no marker:
        its fields are the keys, as before markers existed)."""
        if self.kind == "td" and self.batch_dims == 0:
            return None
        return f"{MARK_PREFIX}{self.kind}.{self.batch_dims}"

    @classmethod
    def of_spec(cls, spec: Spec) -> Form:
        for name in spec:
            found = _MARK.match(name)
            if found:
                return cls(found.group(1), int(found.group(2)))
        return cls("td", 0)


def data_fields(spec: Spec) -> list[str]:
    """The spec's fields that hold the data (all but the marker)."""
    return [name for name in spec if not name.startswith(MARK_PREFIX)]


def stack_items(items: list[Any]) -> Any:
    """A list of items (TensorDicts, tensors or pytrees of one structure) as one batch."""
    if not items:
        raise SpecMismatchError("an empty list has no rows to write; pass at least one item")
    first = items[0]
    try:
        if is_tensor_collection(first) or isinstance(first, torch.Tensor):
            return torch.stack(items)
        return torch.utils._pytree.tree_map(lambda *leaves: torch.stack(leaves), first, *items[1:])
    except (RuntimeError, ValueError, TypeError) as e:
        raise SpecMismatchError(
            f"the {len(items)} items of this list do not stack into one batch ({e}). Fix: give "
            f"every item the same structure, shapes and dtypes, or pass a batch (a TensorDict, "
            f"a tensor, or a tuple/dict of tensors with the rows along dimension 0)") from None


def with_batch_dim(data: Any) -> Any:
    """One item as a batch of one."""
    if is_tensor_collection(data) or isinstance(data, torch.Tensor):
        return data.unsqueeze(0)
    return torch.utils._pytree.tree_map(lambda leaf: _as_tensor("item", leaf).unsqueeze(0), data)


def _as_tensor(where: str, leaf: Any) -> torch.Tensor:
    if isinstance(leaf, torch.Tensor):
        return leaf
    if isinstance(leaf, np.ndarray):
        return torch.from_numpy(leaf)
    raise SpecMismatchError(f"{where} is a {type(leaf).__name__}, not a tensor: this storage "
                            f"keeps tensors (and TensorDicts, tuples, lists, dicts of them) only")


def flatten(data: Any, ndim: int) -> tuple[Form, dict[str, torch.Tensor]]:
    """``data`` (a batch: rows along dimension 0) as its form and its leaves by field name."""
    fields: dict[str, torch.Tensor] = {}
    if is_tensor_collection(data):
        if data.batch_dims < ndim:
            raise SpecMismatchError(
                f"a TensorDict batch of batch_size {tuple(data.batch_size)} has fewer than "
                f"ndim={ndim} batch dimensions: give it batch_size [n, ...] with {ndim}")
        for key, value in data.items(include_nested=True, leaves_only=True):
            parts = (key,) if isinstance(key, str) else key
            if any(KEY_SEPARATOR in p for p in parts):
                raise SpecMismatchError(
                    f"TensorDict key {key!r} contains {KEY_SEPARATOR!r}, which this storage uses "
                    f"to join nested keys; rename the entry")
            if not isinstance(value, torch.Tensor):
                raise SpecMismatchError(
                    f"TensorDict entry {key!r} is a {type(value).__name__}, not a tensor: this "
                    f"storage keeps tensors only")
            fields[KEY_SEPARATOR.join(parts)] = value
        form = Form("td", data.batch_dims - 1)
    elif isinstance(data, torch.Tensor):
        fields[TENSOR_FIELD] = data
        form = Form("tensor", ndim - 1)
    elif isinstance(data, (dict, tuple, list)):
        _tree_leaves(data, TREE_ROOT, fields)
        form = Form("tree", ndim - 1)
    else:
        _as_tensor("the data", data)  # raises, naming the type
        raise AssertionError("unreachable")
    if not fields:
        raise SpecMismatchError("the data has no tensors: nothing to store")
    lead = next(iter(fields.values())).shape[: 1 + form.batch_dims]
    for name, value in fields.items():
        if value.ndim <= form.batch_dims or value.shape[: 1 + form.batch_dims] != lead:
            raise SpecMismatchError(
                f"entry {name!r} has shape {tuple(value.shape)}, but the batch is "
                f"{tuple(lead)}: every entry must start with the batch dimensions")
    return form, fields


def _tree_leaves(node: Any, path: str, out: dict[str, torch.Tensor]) -> None:
    kind = _KINDS.get(type(node))
    if kind is None:
        out[path] = _as_tensor(f"pytree leaf {path!r}", node)
        return
    if kind == "d":
        items = list(node.items())
        for key, _ in items:
            if not isinstance(key, str) or not _KEY.match(key):
                raise SpecMismatchError(
                    f"pytree dict key {key!r} at {path!r} cannot name a field: use keys of "
                    f"letters, digits, '_' and '-' (or a TensorDict)")
    else:
        items = [(str(i), v) for i, v in enumerate(node)]
    if not items:
        raise SpecMismatchError(f"pytree node {path!r} is empty: nothing to store there")
    for key, value in items:
        _tree_leaves(value, f"{path}{KEY_SEPARATOR}{kind}.{key}", out)


def spec_of(form: Form, fields: dict[str, torch.Tensor]) -> Spec:
    """The shmbuf spec rows of ``fields`` are stored under (the marker last)."""
    out: dict[str, Any] = {name: (tuple(t.shape[1:]), numpy_dtype(name, t.dtype))
                           for name, t in fields.items()}
    if form.marker is not None:
        out[form.marker] = ((), np.uint8)
    return Spec(out)


def numpy_dtype(key: str, dtype: torch.dtype) -> np.dtype:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        raise SpecMismatchError(
            f"entry {key!r}: dtype {dtype} has no NumPy equivalent; cast it (e.g. bfloat16 -> "
            f"float32) before writing it to the storage"
        ) from None


def rebuild(form: Form, spec: Spec, rows: dict[str, np.ndarray], lead: tuple[int, ...]) -> Any:
    """The data of ``rows`` (field -> ``[m, *shape]``, copies this call may keep) with the batch
    shape ``lead + form.batch_dims`` of them."""
    tensors = {name: torch.from_numpy(rows[name]).reshape((*lead, *spec[name].shape))
               for name in data_fields(spec)}
    if form.kind == "tensor":
        return tensors[TENSOR_FIELD]
    if form.kind == "tree":
        return _tree_of([(name.split(KEY_SEPARATOR)[1:], t) for name, t in tensors.items()])
    first = next(iter(tensors))
    batch = (*lead, *spec[first].shape[: form.batch_dims])
    out = TensorDict({}, batch_size=batch)
    for name, value in tensors.items():
        out.set(tuple(name.split(KEY_SEPARATOR)), value)
    return out


def _tree_of(entries: list[tuple[list[str], torch.Tensor]]) -> Any:
    if len(entries) == 1 and not entries[0][0]:
        return entries[0][1]
    groups: dict[str, list[tuple[list[str], torch.Tensor]]] = {}
    for parts, value in entries:
        groups.setdefault(parts[0], []).append((parts[1:], value))
    kind = next(iter(groups))[0]
    built = {segment[2:]: _tree_of(sub) for segment, sub in groups.items()}
    if kind == "d":
        return built
    items = [built[k] for k in sorted(built, key=int)]
    return tuple(items) if kind == "t" else items


def index_data(data: Any, index: Any) -> Any:
    """``data[index]`` for a TensorDict, a tensor or a pytree of tensors."""
    if is_tensor_collection(data) or isinstance(data, torch.Tensor):
        return data[index]
    return torch.utils._pytree.tree_map(lambda leaf: leaf[index], data)


def to_device(data: Any, device: torch.device) -> Any:
    if is_tensor_collection(data) or isinstance(data, torch.Tensor):
        return data.to(device)
    return torch.utils._pytree.tree_map(lambda leaf: leaf.to(device), data)


__all__ = ["Form", "data_fields", "flatten", "index_data", "rebuild",
           "spec_of", "stack_items", "to_device", "with_batch_dim"]
