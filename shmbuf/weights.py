"""``WeightStore``: a learner's parameters in shared memory, for every actor to copy.

The learner publishes NumPy arrays or a torch ``state_dict`` whose names, shapes and dtypes were
fixed at creation; each actor copies the newest complete version into its own arrays or model,
checked by a seqlock stamp as rows are (``slots.py``), and never holds a view of shared memory.
Byte layout: ``weights_layout.py``; what may be published or filled: ``weights_params.py``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import layout as L
from .checks import timeout_seconds
from .errors import (
    ClosedError,
    SegmentNotFoundError,
    ShmbufError,
    SpecMismatchError,
    Timeout,
)
from .lease import Lease
from .segment import Segment
from .slots import load_fence, mark_held, mark_writing, store_fence
from .weights_layout import (
    COPIES,
    CURRENT,
    PUBLISHED_NS,
    PUBLISHER_PID,
    WeightsLayout,
    tampered,
    tensors_of,
    weights_doc,
    weights_layout,
)
from .weights_params import array_targets, host_arrays, template_tensors, tensor_targets

MAX_READ_TRIES = 64  # copies one read may spend before TornReadError (each failed try costs one)
FIRST_PAUSE_S = 0.001  # polling for the first version, doubling up to MAX_PAUSE_S
MAX_PAUSE_S = 0.02


class TornReadError(ShmbufError, RuntimeError):
    """Every copy a read made of a weight store was overwritten while it was being made, past
    ``MAX_READ_TRIES`` or the read's timeout: the publisher publishes faster than the reader
    copies. Nothing whole was delivered."""


# --------------------------------------------------------------------------------------------
# The protocol: the publisher's stores and the readers' checked copies
# --------------------------------------------------------------------------------------------
def publish_version(words: memoryview, lay: WeightsLayout, copies: list[list[np.ndarray]],
                    arrays: list[np.ndarray]) -> int:
    """Store ``arrays`` as version ``CURRENT + 1``; returns it. The publisher lease's holder
    only: into the copy ``CURRENT`` does not name, stamped ``2v+1`` before its bytes and
    ``2v+2`` after them, each store fenced from the next; ``CURRENT = v`` last."""
    version = int(words[lay.control_word(CURRENT)]) + 1
    copy = version % COPIES
    stamp = lay.stamp_word(copy)
    mark_writing(words, stamp, version)  # the slots' seqlock, one stamp per copy
    for dst, src in zip(copies[copy], arrays):
        np.copyto(dst, src, casting="equiv")
    mark_held(words, stamp, version)
    store_fence()
    words[lay.control_word(CURRENT)] = version
    return version


def read_version(words: memoryview, lay: WeightsLayout, copy: Callable[[int], None],
                 if_newer_than: int | None, wait: float, name: str) -> int | None:
    """The newest version, ``copy(c)``-ed whole out of copy c; None if it is not newer than
    ``if_newer_than``. Anyone: loads ``CURRENT`` = v, then copy ``v % COPIES``'s stamp, which
    must say "holds v" before and after the copy (fenced); otherwise the publisher moved on
    and the read starts again, at most ``MAX_READ_TRIES`` times within ``wait`` seconds. Waits
    (polling, up to ``wait``) only while nothing was ever published.

    Raises:
        Timeout: nothing was published within ``wait``.
        TornReadError: every try was overwritten while being copied.
    """
    current = lay.control_word(CURRENT)
    deadline = time.monotonic() + wait
    pause, tries = FIRST_PAUSE_S, 0
    while True:
        version = words[current]
        if if_newer_than is not None and version <= if_newer_than:
            return None
        if version == 0:  # nothing published yet: the one wait of a reader
            if time.monotonic() >= deadline:
                raise Timeout(f"weight store {name!r} has no published version after {wait}s. "
                              f"Fix: publish() in the learner first, or wait longer (timeout=)")
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)
            continue
        stamp, held = lay.stamp_word(version % COPIES), L.stamp_held(version)
        load_fence()
        if words[stamp] == held:  # else the publisher moved on: CURRENT is newer now
            load_fence()
            copy(version % COPIES)
            load_fence()
            if words[stamp] == held:
                return int(version)
        tries += 1
        if tries >= MAX_READ_TRIES or time.monotonic() >= deadline:
            raise TornReadError(
                f"weight store {name!r}: {tries} reads in a row were overwritten while being "
                f"copied (the last at version {version}): the publisher publishes faster than "
                f"this process copies. Fix: publish less often, or retry; nothing whole was "
                f"delivered")


# --------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------
def _adopt_matching(name: str, doc: dict[str, Any]) -> Segment | None:
    """Adopt the dead-owner store ``name`` if it holds ``doc``'s tensors; None if absent."""
    try:
        seg = Segment.attach(name, L.KIND_WEIGHTS)
    except SegmentNotFoundError:
        return None
    held = seg.header.doc.get("tensors")
    seg.close()
    if held != doc["tensors"]:
        raise SpecMismatchError(
            f"weight store {name!r} holds other tensors than the template (names, shapes or "
            f"dtypes differ), so it cannot be adopted for it. Fix: pass the template it was "
            f"created with, or another name")
    try:
        return Segment.adopt(name, L.KIND_WEIGHTS)
    except SegmentNotFoundError:  # removed meanwhile: create a new one
        return None


def _mapped(segment: Segment) -> tuple[WeightsLayout, list[list[np.ndarray]], list[np.ndarray]]:
    """A store segment's layout, checked against its size, and private views of each copy's
    tensors and bytes (never handed out: no caller holds memory that changes under it)."""
    doc, memory = segment.header.doc, segment.buf
    if memory is None:
        raise ClosedError(f"weight store {segment.name!r} is closed")
    tensors = tensors_of(segment.name, doc)
    lay = weights_layout(tensors, len(L.encode_layout(doc)))
    if lay.total_size != segment.header.total_size:
        raise tampered(segment.name, f"its {len(tensors)} tensors need {lay.total_size} bytes, "
                                     f"its header says {segment.header.total_size}")
    copies = [[np.frombuffer(memory, t.dtype, int(np.prod(t.shape, dtype=np.int64)),
                             lay.offset(c, t)).reshape(t.shape) for t in lay.tensors]
              for c in range(COPIES)]
    regions = [np.frombuffer(memory, np.uint8, lay.copy_bytes, lay.data + c * lay.copy_bytes)
               for c in range(COPIES)]
    return lay, copies, regions


def _staging(lay: WeightsLayout) -> tuple[np.ndarray, list[np.ndarray]]:
    """Private bytes for one copy and views of its tensors in them (``load_into``)."""
    region = np.empty(lay.copy_bytes, np.uint8)
    views = [region[t.offset - lay.data:t.offset - lay.data + t.nbytes].view(t.dtype)
             .reshape(t.shape) for t in lay.tensors]
    return region, views


class WeightStore:
    """A fixed set of named arrays in shared memory: one publisher, any number of readers.

    ``create`` from a template (a torch ``state_dict`` or NumPy arrays: their names, shapes and
    dtypes are fixed then), ``attach`` by name in every actor, ``publish`` in the learner. A
    reader copies the newest complete version into its own arrays (``read_into``) or model
    (``load_into``); ``version`` (and ``if_newer_than=``) lets it skip an unchanged set for
    the price of one load. A learner restarted after the creator died ``adopt``s the store (or
    ``create(..., adopt=True)``); readers attached to it go on reading without noticing.

    Concurrency: one process publishes at a time, the holder of the publisher lease
    (``layout.LOCK_PUBLISHER``, taken by its first ``publish``, held until ``close``, released
    by its death, even by SIGKILL). Only it stores the copies' bytes, their stamps and the
    control words: version v+1 goes into the copy ``CURRENT`` = v does not name, stamped odd
    before and even after its bytes (fenced), then ``CURRENT`` = v+1. Readers only load:
    ``CURRENT``, that copy's stamp, the bytes, a fence, the stamp again; a copy whose stamp did
    not say "holds v" both times is retried, at most ``MAX_READ_TRIES`` times. Readers never
    wait on a publish in progress (it writes the other copy); they wait only for the first
    version ever, up to ``timeout``. A publisher killed mid-publish leaves its copy odd and
    ``CURRENT`` at the last complete version, which readers go on reading. The owner (creator
    or adopter) writes the header only, as for every segment, and unlinks it on ``close``.

    Example:
        >>> params = {"w": np.zeros((4, 2), np.float32), "b": np.zeros(2, np.float32)}
        >>> with WeightStore.create(template=params) as store:   # the learner
        ...     published = store.publish(params)                 # version 1
        ...     with WeightStore.attach(store.name) as actor:     # any process
        ...         mine = actor.new_arrays()
        ...         got = actor.read_into(mine)                   # 1: mine holds version 1
        ...         again = actor.read_into(mine, if_newer_than=got)  # None: no copy made
    """

    def __init__(self, segment: Segment) -> None:
        """Internal: use ``create``, ``attach`` or ``adopt``. Closes ``segment`` on error.

        Raises:
            SegmentFormatError: the layout does not describe the segment (tampered).
        """
        self._segment = segment
        self._publisher: Lease | None = None
        self._staging: tuple[np.ndarray, list[np.ndarray]] | None = None
        try:
            self._layout, self._copies, self._regions = _mapped(segment)
        except BaseException:
            segment.close()
            raise
        assert segment.buf is not None  # (_mapped checked)
        self._words: memoryview | None = memoryview(segment.buf).cast("q")
        self._current = self._layout.control_word(CURRENT)
        self._closed = False

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str | None = None, *, template: Any, adopt: bool = False
               ) -> WeightStore:
        """A new store shaped like ``template``; this process owns it. Nothing is published yet.

        Args:
            name: segment name (``/dev/shm/<name>``); a unique ``shmbuf-weights-...`` by default.
            template: a mapping of name -> NumPy array or torch tensor (on any device), e.g.
                ``model.state_dict()``, or a torch module. Only names, shapes and dtypes are
                taken; every later ``publish`` must match them.
            adopt: if a store named ``name`` exists and its owner died, take it over instead
                (``adopt``): a restarted learner goes on from its predecessor's versions.

        Raises:
            SpecMismatchError: ``adopt`` found a store of that name holding other tensors.
            SegmentExistsError: ``name`` is taken (with ``adopt``: by a store whose owner lives).
            CapacityError: /dev/shm has too little room.
            TypeError, ValueError: a template that is empty, or holds something not numeric.
        """
        tensors = template_tensors(template)
        doc = weights_doc(tensors)
        if adopt:
            if name is None:
                raise ValueError("create(adopt=True) needs the name of the store to adopt")
            adopted = _adopt_matching(name, doc)
            if adopted is not None:
                return cls(adopted)
        return cls(Segment.create(name, L.KIND_WEIGHTS, doc,
                                  lambda json_len: weights_layout(tensors, json_len).total_size))

    @classmethod
    def attach(cls, name: str, timeout: float = 5.0) -> WeightStore:
        """Map an existing store by name, from any process, to read it (or publish into it).

        Raises:
            SegmentNotFoundError: no segment of that name.
            SegmentFormatError: not a weight store, or a tampered one.
        """
        return cls(Segment.attach(name, L.KIND_WEIGHTS, timeout=timeout))

    @classmethod
    def adopt(cls, name: str, timeout: float = 5.0) -> WeightStore:
        """Become the owner of a store whose owner died (``Segment.adopt``); its versions and
        bytes are untouched, and readers attached to it go on reading.

        Raises:
            SegmentExistsError: its owner is alive (attach instead); nothing changed.
            SegmentNotFoundError: no segment of that name.
        """
        return cls(Segment.adopt(name, L.KIND_WEIGHTS, timeout=timeout))

    def __reduce__(self) -> tuple[Any, ...]:
        self._live_words()
        return (WeightStore.attach, (self.name,))

    # -- properties ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nbytes(self) -> int:
        """Bytes of the segment (both copies, the header and the control lines)."""
        return self._segment.header.total_size

    @property
    def tensors(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Name -> (shape, dtype) of every tensor, in the store's order."""
        return {t.name: (t.shape, t.dtype) for t in self._layout.tensors}

    @property
    def version(self) -> int:
        """The newest complete version (0 before the first publish); one load, no copy."""
        return int(self._live_words()[self._current])

    def new_arrays(self) -> dict[str, np.ndarray]:
        """New zeroed arrays shaped like the store's tensors, this process's own (``read_into``)."""
        return {t.name: np.zeros(t.shape, t.dtype) for t in self._layout.tensors}

    # -- the publisher -----------------------------------------------------------------------------
    def publish(self, params: Any, *, timeout: float = 5.0) -> int:
        """Publish ``params`` as the next version; returns it.

        ``params`` holds exactly the store's names, each of its shape and dtype (byte order
        aside): NumPy arrays, torch tensors on any device (copied to host first) or a torch
        module (its ``state_dict()``). Everything is checked and on the host before the first
        byte of shared memory changes.

        Args:
            timeout: seconds to wait for the publisher lease on the first publish (another
                process may hold it; one that died has released it).

        Raises:
            SpecMismatchError: a name missing or extra, a shape or a dtype that differs; it
                names the tensor, both shapes or dtypes and the fix. Nothing changed.
            Timeout: another live process holds the publisher lease; nothing changed.
            ClosedError: the store was closed.
        """
        wait = timeout_seconds("timeout", timeout)
        words = self._live_words()
        arrays = host_arrays(self.name, self._layout.tensors, params)
        self._take_publisher(words, wait)
        version = publish_version(words, self._layout, self._copies, arrays)
        words[self._layout.control_word(PUBLISHED_NS)] = time.time_ns()
        return version

    def _take_publisher(self, words: memoryview, wait: float) -> None:
        """Hold the publisher lease (once per process; a forked child takes its own)."""
        lease = self._publisher
        if lease is not None and lease.fd is not None and lease.pid == os.getpid():
            return
        lease = self._segment.lease()
        deadline = time.monotonic() + wait
        while not lease.try_lock(L.LOCK_PUBLISHER):
            if time.monotonic() >= deadline:
                lease.close()
                raise Timeout(
                    f"weight store {self.name!r} has another live publisher (pid "
                    f"{words[self._layout.control_word(PUBLISHER_PID)]}) after {wait}s: one "
                    f"process publishes at a time. Fix: publish from that process, or close() "
                    f"its store first; nothing was published")
            time.sleep(0.01)
        self._publisher = lease
        words[self._layout.control_word(PUBLISHER_PID)] = os.getpid()

    # -- readers ---------------------------------------------------------------------------------
    def read_into(self, out: Mapping[str, np.ndarray], *, if_newer_than: int | None = None,
                  timeout: float = 5.0) -> int | None:
        """Copy the newest complete version into ``out``'s arrays; returns its version, or None
        if it is not newer than ``if_newer_than`` (nothing copied).

        ``out`` maps every name of the store to a writeable array of its shape and dtype (e.g.
        from ``new_arrays``), checked whenever a version is to be copied (an unchanged one
        costs one load). Only a returned version says ``out`` holds a whole version: after an
        error it may hold a mix.

        Args:
            if_newer_than: a version this reader already has (None: read whatever is newest).
            timeout: seconds to wait for the first version ever published, and at most for the
                retries of one read.

        Raises:
            SpecMismatchError: ``out`` lacks a name, has an extra one, or an array of another
                shape or dtype (or read-only); nothing was copied.
            Timeout: nothing was published within ``timeout``.
            TornReadError: every copy was overwritten while being made (``MAX_READ_TRIES``).
        """
        wait = timeout_seconds("timeout", timeout)
        words = self._live_words()
        if if_newer_than is not None and words[self._current] <= if_newer_than:
            return None  # unchanged: one load, before ``out`` is even looked at
        targets = array_targets(self.name, self._layout.tensors, out)

        def copy(k: int) -> None:
            for dst, src in zip(targets, self._copies[k]):
                np.copyto(dst, src)

        return read_version(words, self._layout, copy, if_newer_than, wait, self.name)

    def load_into(self, model: Any, *, if_newer_than: int | None = None,
                  timeout: float = 5.0) -> int | None:
        """Copy the newest complete version into a torch module's parameters and buffers (or a
        mapping of name -> tensor, on any device); returns its version, or None if it is not
        newer than ``if_newer_than`` (nothing copied).

        The version is copied and checked in this process's own host memory first, so the
        model only ever holds whole versions, even when the read fails.

        Raises:
            SpecMismatchError: the model's state_dict names, shapes or dtypes differ from the
                store's; nothing was copied.
            Timeout, TornReadError: as for ``read_into``; the model is unchanged.
        """
        wait = timeout_seconds("timeout", timeout)
        words = self._live_words()
        if if_newer_than is not None and words[self._current] <= if_newer_than:
            return None  # unchanged: one load, before the model is even looked at
        targets = tensor_targets(self.name, self._layout.tensors, model)
        if self._staging is None:
            self._staging = _staging(self._layout)
        region, views = self._staging
        version = read_version(words, self._layout,
                               lambda k: np.copyto(region, self._regions[k]), if_newer_than,
                               wait, self.name)
        if version is None:
            return None
        torch = sys.modules["torch"]
        with torch.no_grad():
            for dst, src in zip(targets, views):
                dst.copy_(torch.from_numpy(src))
        return version

    # -- teardown ----------------------------------------------------------------------------------
    def _live_words(self) -> memoryview:
        if self._closed or self._words is None:
            raise ClosedError(f"weight store {self.name!r} is closed")
        return self._words

    def _drop_views(self) -> None:
        self._copies, self._regions = [], []
        words, self._words = self._words, None
        if words is not None:
            words.release()

    def close(self) -> None:
        """Let go of the publisher lease, unmap, and (owner) unlink the store. Idempotent.

        Readers attached elsewhere keep their mapping until they close; a new ``attach`` by
        name fails once the owner has closed.
        """
        if self._closed:
            return
        self._closed = True
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        self._staging = None
        self._drop_views()
        self._segment.close()

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"version {self.version}"
        return f"WeightStore({self.name!r}, {len(self._layout.tensors)} tensors, {state})"
