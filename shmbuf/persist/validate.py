"""The one validator of both checkpoint forms: a manifest and a state dict describe the same
buffer, so both loads check every entry (type, range, shape, agreement) with these functions
before anything is created or changed; a ``Form`` says how each holds its columns.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from .. import layout as L
from ..errors import CheckpointError
from ..slots import MAX_ROW_INDEX
from ..spec import Spec
from .snapshot import PRIORITY_COLUMNS, RECORD_COLUMNS, LaneRows, Records

# One past the largest logical index a checkpoint may restore (and the largest capacity): a
# row's stamp 2i+2 must stay below the rewrite version's bits (``slots.MAX_ROW_INDEX``).
MAX_INDEX = MAX_ROW_INDEX + 1
MAX_EPISODE = (1 << 31) - 1  # episode ids sit above STEP_BITS in the int64 meta word (the
# record table alone would allow more: episodes.MAX_EPISODE; a lane's rows would not)
MAX_SEGMENT_BYTES = 1 << 62  # a buffer larger than this cannot exist; a checkpoint saying so is bad
WORD_DTYPE = np.dtype("<i8")  # the meta column's and the episode records' (int64 words)


# --------------------------------------------------------------------------------------------
# Entries
# --------------------------------------------------------------------------------------------
def show(value: Any) -> str:
    """A short repr of an untrusted value (bounded in length and depth)."""
    try:
        return reprlib.repr(value)
    except Exception:  # noqa: BLE001 - a user object whose __repr__ fails
        return f"<{type(value).__name__}>"


def bad(where: str, text: str) -> CheckpointError:
    return CheckpointError(f"{where}: {text}. The checkpoint is corrupt or was edited. Fix: save "
                           f"the buffer again")


def entry(doc: Mapping[str, Any], key: str, where: str) -> Any:
    """``doc[key]``; CheckpointError if it is missing."""
    try:
        return doc[key]
    except KeyError:
        raise bad(where, f"the required entry {key!r} is missing") from None


def check_int(value: Any, what: str, lo: int, hi: int, where: str) -> int:
    """``value`` as an int in ``[lo, hi]``: a bool, float or numeric string is refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise bad(where, f"{what} should be an int, found {show(value)} ({type(value).__name__})")
    v = int(value)
    if not lo <= v <= hi:
        expected = str(lo) if lo == hi else f"an int in [{lo}, {hi}]"
        raise bad(where, f"{what} is {v}; expected {expected}")
    return v


def _spec_from_json(value: Any, key: str, where: str) -> Spec:
    if not isinstance(value, list):
        raise bad(where, f"{key!r} should be a list of fields (name, shape, dtype), found "
                         f"{show(value)}")
    try:
        return Spec.from_json(value)
    except Exception as e:  # noqa: BLE001 - whatever a malformed field list makes Spec raise
        raise bad(where, f"{key!r} is malformed ({type(e).__name__}: {show(str(e))})") from None


def as_array(value: Any, what: str, where: str) -> np.ndarray:
    try:
        return np.asarray(value)
    except Exception as e:  # noqa: BLE001 - ragged nested lists and the like
        raise bad(where, f"{what} is not an array ({type(e).__name__}: {show(str(e))})") from None


def check_format(doc: Any, fmt: str, version: int, what: str, where: str) -> None:
    """``doc`` is a mapping whose ``format`` is ``fmt`` and ``version`` is ``version``."""
    found = doc.get("format") if isinstance(doc, Mapping) else None
    if not isinstance(found, str) or found != fmt:
        shown = show(found) if isinstance(doc, Mapping) else f"a {type(doc).__name__}"
        raise CheckpointError(f"{where}: expected {what} (format {fmt!r}), found {shown}: not a "
                              f"shmbuf checkpoint")
    v = doc.get("version")
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v != version:
        raise CheckpointError(f"{where}: expected {fmt!r} version {version}, found {show(v)}. "
                              f"Fix: load it with the shmbuf version that made it")


# --------------------------------------------------------------------------------------------
# The buffer a checkpoint describes
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Header:
    """What ``ReplayBuffer.create`` needs to make a buffer the checkpoint fits."""

    spec: Spec
    capacity: int
    lanes: int
    next_obs: str
    episode_spec: Spec | None
    episode_capacity: int | None  # None: the default for the capacity
    actor_priorities: bool = False

    def options(self) -> dict[str, Any]:
        """``create``'s keyword arguments besides spec, capacity and lanes."""
        return {"next_obs": self.next_obs, "episode_spec": self.episode_spec,
                "episode_capacity": self.episode_capacity,
                "actor_priorities": self.actor_priorities}


def check_header(doc: Mapping[str, Any], where: str) -> Header:
    """Spec, capacity, lanes and options; absent options (older versions) are the defaults."""
    spec = _spec_from_json(entry(doc, "spec", where), "spec", where)
    capacity = check_int(entry(doc, "capacity", where), "'capacity'", 1, MAX_INDEX, where)
    lanes = check_int(entry(doc, "lanes", where), "'lanes'", 1, L.MAX_LANES, where)
    next_obs = doc.get("next_obs", "stored")
    if not isinstance(next_obs, str) or next_obs not in ("stored", "derived"):
        raise bad(where, f"'next_obs' should be 'stored' or 'derived', found {show(next_obs)}")
    ep_json = doc.get("episode_spec")
    episode_spec = None
    if not (ep_json is None or (isinstance(ep_json, list) and not ep_json)):  # None, []: none
        episode_spec = _spec_from_json(ep_json, "episode_spec", where)
    episode_capacity = doc.get("episode_capacity")
    if episode_capacity is not None:
        episode_capacity = check_int(episode_capacity, "'episode_capacity'", 1, MAX_INDEX, where)
    actor_priorities = doc.get("actor_priorities", False)
    if not isinstance(actor_priorities, (bool, np.bool_)):
        raise bad(where, f"'actor_priorities' should be true or false, found "
                         f"{show(actor_priorities)}")
    return Header(spec, capacity, lanes, next_obs, episode_spec, episode_capacity,
                  bool(actor_priorities))


def check_size(header: Header, capacity: int, given: bool, where: str) -> None:
    """Refuse a capacity whose buffer no machine could hold (its index math would overflow);
    ``given``: it is the caller's ``capacity=`` (a ValueError), not the checkpoint's."""
    spec, lanes, ep_spec = header.spec, header.lanes, header.episode_spec
    ep_cap = header.episode_capacity
    ep_cap = ep_cap if ep_cap is not None else max(64, capacity // 8)
    slot_words = 2 + (len(L.PRIORITY_COLUMNS) if header.actor_priorities else 0)
    size = (capacity * lanes * (spec.row_nbytes + slot_words * L.WORD)
            + ep_cap * lanes * (4 * L.WORD + (ep_spec.row_nbytes if ep_spec else 0)))
    if capacity <= MAX_INDEX and size <= MAX_SEGMENT_BYTES:
        return
    text = (f"capacity {capacity} x {lanes} lanes of {spec.row_nbytes}-byte rows would need "
            f"{size} bytes of shared memory (at most {MAX_SEGMENT_BYTES} is possible)")
    if given:
        raise ValueError(f"load(capacity={capacity}): {text}. Fix: pass a smaller capacity")
    raise bad(f"{where}: 'capacity' or 'spec'", text)


# --------------------------------------------------------------------------------------------
# Its contents: per-lane rows, columns and episode records, in either form
# --------------------------------------------------------------------------------------------
class Column(Protocol):
    """What the validator reads of a column before it is opened: its shape and dtype."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...


C = TypeVar("C", bound=Column)


class Form(Protocol[C]):
    """How a checkpoint form holds columns (``directory.ManifestForm``, ``state.ArrayForm``)."""

    def column(self, value: Any, what: str, where: str) -> C:
        """The column entry ``value``, or CheckpointError naming ``what``."""
        ...

    def columns(self, value: Any, names: list[str], key: str, what: str, where: str
                ) -> dict[str, C]:
        """The entry ``key`` holding one column per name in ``names`` (``what`` + name each)."""
        ...

    def array(self, column: C, what: str, where: str) -> np.ndarray:
        """The values of a column whose shape and dtype were checked."""
        ...


@dataclass(frozen=True)
class Contents:
    """A checkpoint's rows (``snapshot``'s layout) and episode records, checked."""

    lanes: list[LaneRows]
    fields: dict[str, np.ndarray]
    meta: np.ndarray
    records: Records | None  # None: the checkpoint predates episode records
    priorities: dict[str, np.ndarray] | None = None  # ``PRIORITY_COLUMNS``; None: none kept


def check_contents(doc: Mapping[str, Any], header: Header, rows: int, form: Form[C],
                   where: str) -> Contents:
    """Check ``doc``'s ``per_lane``, ``fields``, ``meta``, ``priorities`` and ``episodes``
    against ``header`` and the row count; return them as arrays."""
    lanes = _check_lanes(entry(doc, "per_lane", where), header.lanes, header.capacity, rows, where)
    spec = header.spec
    fields = form.columns(entry(doc, "fields", where), list(spec), "'fields'", "field", where)
    for name, f in spec.items():
        _check_column(fields[name], (rows, *f.shape), f.dtype, f"field {name!r}", where)
    what = "'meta' (the _meta column)"
    meta = form.column(entry(doc, "meta", where), what, where)
    _check_column(meta, (rows,), WORD_DTYPE, what, where)
    arrays = {name: form.array(fields[name], f"field {name!r}", where) for name in spec}
    return Contents(lanes, arrays, form.array(meta, what, where),
                    _check_episodes(doc, header, form, where) if "episodes" in doc else None,
                    _check_priorities(doc, header, rows, form, where))


def _check_priorities(doc: Mapping[str, Any], header: Header, rows: int, form: Form[C],
                      where: str) -> dict[str, np.ndarray] | None:
    """The actor priorities (``snapshot.PRIORITY_COLUMNS``) of an ``actor_priorities``
    checkpoint: one entry per column, ``[rows]`` each; every value finite and >= 0 (what a
    writer accepts), every ``given`` 0 or 1. None for a checkpoint without them."""
    if not header.actor_priorities:
        if "priorities" in doc:
            raise bad(where, "'priorities' (the actor priorities) is there but 'actor_priorities' "
                             "is not true; a checkpoint of a buffer without actor priorities has "
                             "none")
        return None
    names = [name for name, _ in PRIORITY_COLUMNS]
    section = entry(doc, "priorities", where)
    if not isinstance(section, Mapping) or sorted(map(str, section)) != sorted(names):
        raise bad(where, f"'priorities' (the actor priorities) should be a dict with "
                         f"{' and '.join(map(repr, names))}, found {show(section)}")
    arrays = {}
    for name, dtype in PRIORITY_COLUMNS:
        what = f"'priorities' {name!r} (the actor priorities)"
        column = form.column(section[name], what, where)
        _check_column(column, (rows,), dtype, what, where)
        arrays[name] = form.array(column, what, where)
    values, given = arrays["values"], arrays["given"]
    wrong = np.flatnonzero(~(np.isfinite(values) & (values >= 0)))
    if wrong.size:
        raise bad(where, f"'priorities' 'values' (the actor priorities) holds "
                         f"{float(values[wrong[0]])!r} at row {int(wrong[0])} ({wrong.size} "
                         f"row(s) in all); every actor priority should be a finite number >= 0")
    wrong = np.flatnonzero(given > 1)
    if wrong.size:
        raise bad(where, f"'priorities' 'given' holds {int(given[wrong[0]])} at row "
                         f"{int(wrong[0])}; every row's should be 1 (a priority was given) or 0")
    return arrays


def _check_episodes(doc: Mapping[str, Any], header: Header, form: Form[C], where: str) -> Records:
    section = doc["episodes"]
    if not isinstance(section, Mapping) or "records" not in section or "fields" not in section:
        raise bad(where, f"'episodes' should be a dict with 'records' and 'fields', found "
                         f"{show(section)}")
    spec = header.episode_spec
    fields = dict(spec.items()) if spec is not None else {}
    what = "'episodes' 'records' (the episode records)"
    table = form.column(section["records"], what, where)
    shape = table.shape
    if (len(shape) != 2 or shape[1] != len(RECORD_COLUMNS) or not 0 <= shape[0] <= MAX_INDEX
            or table.dtype != WORD_DTYPE):
        raise bad(where, f"{what} should be int64 [records, {len(RECORD_COLUMNS)}] "
                         f"({', '.join(RECORD_COLUMNS)}), found shape {show(shape)} {table.dtype}")
    n = shape[0]
    values = form.columns(section["fields"], list(fields), "'episodes' 'fields'",
                          "episode field", where)
    for name, f in fields.items():
        _check_column(values[name], (n, *f.shape), f.dtype, f"episode field {name!r}", where)
    records = Records(form.array(table, what, where),
                      {name: form.array(values[name], f"episode field {name!r}", where)
                       for name in fields})
    _check_record_values(records.table, header.lanes, where)
    return records


def _check_column(column: Column, shape: tuple[int, ...], dtype: np.dtype, what: str,
                  where: str) -> None:
    if column.shape != shape or column.dtype != dtype:
        raise bad(where, f"{what} should be shape {shape} {dtype} by the spec and row count, "
                         f"found shape {show(column.shape)} {column.dtype}")


def _check_lanes(per_lane: Any, n_lanes: int, capacity: int, rows: int,
                 where: str) -> list[LaneRows]:
    """The per-lane entries, each field an int in range, offsets packed, counts adding up."""
    if not isinstance(per_lane, (list, tuple)) or len(per_lane) != n_lanes:
        raise bad(where, f"'per_lane' should list {n_lanes} lane entries, one per lane; found "
                         f"{show(per_lane)}")
    keys = list(LaneRows.__dataclass_fields__)
    lanes, pos = [], 0
    for k, item in enumerate(per_lane):
        if not isinstance(item, Mapping) or any(f not in item for f in keys):
            raise bad(where, f"per_lane[{k}] should be a dict of ints {', '.join(keys)}; found "
                             f"{show(item)}")
        at = f"lane {k}'s entry per_lane[{k}]"
        first = check_int(item["first"], f"{at}['first']", 0, MAX_INDEX, where)
        count = check_int(item["count"], f"{at}['count']", 0, capacity, where)
        if first + count > MAX_INDEX:
            raise bad(where, f"{at}['first'] + ['count'] is {first + count}, past the largest "
                             f"logical index a lane can hold ({MAX_INDEX})")
        r = LaneRows(
            lane=check_int(item["lane"], f"{at}['lane']", k, k, where),
            first=first,
            count=count,
            offset=check_int(item["offset"], f"{at}['offset']", pos, pos, where),
            episode=check_int(item["episode"], f"{at}['episode']", 0, MAX_EPISODE, where),
            # A writer moves episode_start only up to its committed index (first + count).
            episode_start=check_int(item["episode_start"], f"{at}['episode_start']", 0,
                                    first + count, where),
        )
        lanes.append(r)
        pos += r.count
    if pos != rows:
        raise bad(where, f"the lanes' counts add up to {pos} rows but the arrays have {rows} rows")
    return lanes


def _check_record_values(table: np.ndarray, n_lanes: int, where: str) -> None:
    """Every record's columns in range, and no (lane, episode) twice."""
    if not len(table):
        return
    bounds = {"lane": (0, n_lanes - 1), "episode": (0, MAX_EPISODE), "start": (0, MAX_INDEX),
              "length": (0, MAX_INDEX), "flags": (0, L.EPISODE_TRUNCATED)}
    for col, (lo, hi) in bounds.items():
        values = table[:, RECORD_COLUMNS.index(col)]
        wrong = np.flatnonzero((values < lo) | (values > hi))
        if wrong.size:
            raise bad(where, f"episode record {int(wrong[0])} has {col} {int(values[wrong[0]])}; "
                             f"every record's {col} should be in [{lo}, {hi}]")
    if np.unique(table[:, 0] * (MAX_EPISODE + 1) + table[:, 1]).size != len(table):
        raise bad(where, "the episode records hold the same (lane, episode) more than once")
