"""Hardening of segments, the CLI scan, timeouts and owner signal handling (issue 8).

Items 5-9 and part of 15: a FIFO in /dev/shm never hangs ``ls``/``gc``; every malformed
segment is a ``SegmentFormatError`` naming it (fd and mapping closed), ``ls`` lists it as
unreadable and ``gc`` never deletes a file it has not validated; every public timeout goes
through one validator; a user's SIGTERM handler that goes on keeps the buffer; an owner made in
a thread unlinks on SIGTERM; one table of kind names; names are matched whole; a /dev/shm out of
inodes is a ``CapacityError``; the seqlock refuses to run on a machine without x86-64 ordering.

Malformed segments are built byte by byte from the header format documented in
``shmbuf/layout.py``, so these tests also pin that format down.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import shmbuf
from shmbuf import cleanup, cli, shmdir
from shmbuf import layout as L
from shmbuf import segment as S
from shmbuf.segment import Segment
from shmbuf.shmdir import SHM_DIR
from tests._helpers.processes import reporting_child

SPEC = shmbuf.Spec(x=((4,), "float32"))
# magic, version, kind, total size, owner pid, owner start, created, owner uid, JSON length
HEADER = struct.Struct("<8sIIQQQdII")
CLI = [sys.executable, "-m", "shmbuf.cli"]


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _name(tag: str) -> str:
    return f"shmbuf-test-{tag}-{uuid.uuid4().hex[:12]}"


def _remove(*names: str) -> None:
    for name in names:
        try:
            os.unlink(_path(name))
        except FileNotFoundError:
            pass


def _row() -> dict[str, np.ndarray]:
    return {"x": np.arange(4, dtype=np.float32)}


# --------------------------------------------------------------------------------------------
# Building segments byte by byte
# --------------------------------------------------------------------------------------------
def _buffer_doc(capacity: int = 8, lanes: int = 1) -> dict[str, Any]:
    """The layout document ReplayBuffer.create writes for SPEC."""
    return {"kind": "buffer", "spec": SPEC.to_json(), "capacity": capacity, "lanes": lanes,
            "next_obs": "stored", "episode_capacity": 64, "episode_spec": []}


def _buffer_size(doc: dict[str, Any], payload: bytes) -> int:
    fields = [(f.name, f.shape, f.dtype) for f in SPEC.values()]
    return L.buffer_layout(fields, doc["capacity"], doc["lanes"], len(payload), [],
                           doc["episode_capacity"]).total_size


def _segment_bytes(*, doc: Any = None, payload: bytes | None = None, magic: bytes = L.MAGIC,
                   version: int = L.FORMAT_VERSION, kind: int = L.KIND_BUFFER,
                   size: int | None = None, created: float | None = None,
                   json_len: int | None = None, file_size: int | None = None) -> bytes:
    """A whole segment file: header (as layout.py documents it), layout JSON, zeroed body;
    ``size`` is what the header says, ``file_size`` what is written (default: the same)."""
    if payload is None:
        payload = L.encode_layout(_buffer_doc() if doc is None else doc)
    if size is None:
        try:
            size = _buffer_size(json.loads(payload), payload)
        except Exception:  # not a buffer document: a header page is enough
            size = L.header_size(len(payload))
    created = time.time() if created is None else created
    head = HEADER.pack(magic, version, kind, size, os.getpid(), 0, created, os.getuid(),
                       len(payload) if json_len is None else json_len)
    data = head + bytes(L.H_JSON - len(head)) + payload
    return data + bytes(max(0, (size if file_size is None else file_size) - len(data)))


def _write(name: str, data: bytes, mode: int = 0o600, age: float = 60.0) -> None:
    """Write ``data`` as /dev/shm/``name``, last changed ``age`` seconds ago."""
    fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    old = time.time() - age
    os.utime(_path(name), (old, old))


def _nested(depth: int) -> bytes:
    return b'{"kind":"buffer","x":' + b"[" * depth + b"]" * depth + b"}"


MALFORMED: dict[str, Callable[[], bytes]] = {
    "json_length_0xFFFFFFFF": lambda: _segment_bytes(json_len=0xFFFFFFFF),
    "json_nested_100000_deep": lambda: _segment_bytes(payload=_nested(100_000)),
    "json_nested_500_deep": lambda: _segment_bytes(payload=_nested(500)),
    "json_not_utf8": lambda: _segment_bytes(payload=b'{"kind": "\xff\xfe"}'),
    "json_not_an_object": lambda: _segment_bytes(payload=b"[1, 2, 3]"),
    "json_cut_short": lambda: _segment_bytes(payload=b'{"kind": "buf', json_len=200),
    "capacity_2**63": lambda: _segment_bytes(doc=_buffer_doc(capacity=2**63), size=1 << 16),
    "lanes_2**40": lambda: _segment_bytes(doc=_buffer_doc(lanes=2**40), size=1 << 16),
    "capacity_negative": lambda: _segment_bytes(doc=_buffer_doc(capacity=-5), size=1 << 16),
    "capacity_a_string": lambda: _segment_bytes(doc={**_buffer_doc(), "capacity": "8"},
                                                size=1 << 16),
    "capacity_true": lambda: _segment_bytes(doc={**_buffer_doc(), "capacity": True},
                                            size=1 << 16),
    "spec_shape_2**70": lambda: _segment_bytes(
        doc={**_buffer_doc(), "spec": [{"name": "x", "shape": [2**70], "dtype": "<f4"}]},
        size=1 << 16),
    "spec_garbage": lambda: _segment_bytes(doc={**_buffer_doc(), "spec": {"x": 1}},
                                           size=1 << 16),
    "created_1e308": lambda: _segment_bytes(created=1e308),
    "created_nan": lambda: _segment_bytes(created=math.nan),
    "unknown_kind": lambda: _segment_bytes(kind=99),
    "other_format_version": lambda: _segment_bytes(version=L.FORMAT_VERSION + 1),
    "size_field_lies": lambda: _segment_bytes(size=1 << 40, file_size=1 << 16),
    "truncated_body": lambda: _segment_bytes()[: L.PAGE],
    "wrong_magic": lambda: _segment_bytes(magic=b"NOTSHMBF"),
    "text_file": lambda: b"hello, I merely start with shmbuf-\n",
    "zeros_mode_0644": lambda: bytes(L.PAGE),
}


def _written(case: str) -> str:
    name = _name("bad")
    _write(name, MALFORMED[case](), mode=0o644 if case == "zeros_mode_0644" else 0o600)
    return name


def _open_on(name: str) -> tuple[list[str], list[str]]:
    """This process's descriptors and mappings of /dev/shm/``name``."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(_path(name)):
                fds.append(fd)
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = [line for line in f if _path(name) in line]
    return fds, maps


def _leaked_staging() -> str:
    """A valid segment whose owner is gone: made here, then abandoned without unlinking."""
    seg = Segment.create(_name("leaked"), L.KIND_STAGING, {"kind": "staging"}, L.header_size)
    cleanup.forget_owned(seg.name)
    seg.owner = False  # close() now drops the owner lease and unmaps, but leaves the name
    seg.close()
    return seg.name


def test_the_byte_builder_makes_segments_that_attach():
    """Control: the builder writes what ReplayBuffer.create writes, so every failure below is
    due to its one malformation."""
    name = _name("good")
    try:
        _write(name, _segment_bytes())
        with shmbuf.ReplayBuffer.attach(name, timeout=0.5) as buf:
            assert (buf.capacity, buf.lanes, len(buf)) == (8, 1, 0)
        _remove(name)
        with shmbuf.ReplayBuffer.create(SPEC, capacity=8, name=name) as buf:
            with open(_path(name), "rb") as f:
                real = f.read()
        built = _segment_bytes()
        # Same bytes but for the owner's pid, start time and creation time.
        assert real[:24] == built[:24] and real[48:] == built[48:]
    finally:
        _remove(name)


# --------------------------------------------------------------------------------------------
# Item 6: malformed segments
# --------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_segment_is_a_format_error_naming_it(case, capsys):
    name = _written(case)
    try:
        for attach in (lambda: Segment.attach(name, timeout=0.2),
                       lambda: shmbuf.ReplayBuffer.attach(name, timeout=0.2)):
            t0 = time.monotonic()
            with pytest.raises(shmbuf.SegmentFormatError, match=name):
                attach()
            assert time.monotonic() - t0 < 5
            assert _open_on(name) == ([], []), "the refused segment is still open or mapped"
        assert cli.main(["inspect", name, "--timeout", "0.2"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("shmbuf inspect: error:") and name in err
        assert "Traceback" not in err
        assert os.path.exists(_path(name))  # nothing deleted it
    finally:
        _remove(name)


# Headers that are well formed, but whose buffer layout this shmbuf cannot use.
BAD_BUFFER_LAYOUTS: dict[str, Callable[[], bytes]] = {
    "dtype_not_a_dtype": lambda: _segment_bytes(
        doc={**_buffer_doc(), "spec": [{"name": "x", "shape": [4], "dtype": "not-a-dtype"}]},
        size=1 << 16),
    "dtype_object": lambda: _segment_bytes(
        doc={**_buffer_doc(), "spec": [{"name": "x", "shape": [4], "dtype": "|O"}]},
        size=1 << 16),
    "episode_spec_garbage": lambda: _segment_bytes(
        doc={**_buffer_doc(), "episode_spec": [{"name": "r", "shape": [], "dtype": 7}]},
        size=1 << 16),
    "size_of_another_layout": lambda: _segment_bytes(
        doc=_buffer_doc(capacity=600), size=_buffer_size(_buffer_doc(), L.encode_layout(
            _buffer_doc()))),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(BAD_BUFFER_LAYOUTS))
def test_a_buffer_layout_this_shmbuf_cannot_use_is_a_format_error(case, capsys):
    name = _name("badlayout")
    _write(name, BAD_BUFFER_LAYOUTS[case]())
    try:
        with pytest.raises(shmbuf.SegmentFormatError, match=name):
            shmbuf.ReplayBuffer.attach(name, timeout=0.2)
        assert _open_on(name) == ([], []), "the refused segment is still open or mapped"
        assert cli.main(["inspect", name]) == 1
        err = capsys.readouterr().err
        assert name in err and "Traceback" not in err
        assert cli.main(["ls", "--json"]) == 0
        assert name in {s["name"] for s in json.loads(capsys.readouterr().out)}
    finally:
        _remove(name)


# Shapes whose element count overflows 64 bits: 2**64, which int64 arithmetic wraps to 0, and
# 2**64 - 1 (3*5*17*257*65537 = 2**32 - 1 and 641*6700417 = 2**32 + 1), which wraps to -1.
OVERFLOWING_SHAPES = {"2**32 x 2**32": [2**32, 2**32],
                      "fermat factors": [3, 5, 17, 257, 641, 65537, 6700417]}
SANE_SHAPE = [2, 3]


def _shaped_segment(where: str, shape: list[int]) -> bytes:
    """A segment of the kind whose layout holds a field of ``shape`` at ``where``, sized as this
    shmbuf's own layout math sizes that document: a tamperer who writes that size passes every
    size comparison made after the layout is computed."""
    field = [{"name": "x", "shape": shape, "dtype": "<f4"}]
    if where == "staging arrays":
        from workers.staging import staging_layout

        doc = {"kind": "staging", "n_slots": 2, "n_waiters": 1, "arrays": field}
        size = staging_layout([("x", tuple(shape), "<f4")], 2,
                              len(L.encode_layout(doc)), 1).total_size
        return _segment_bytes(doc=doc, kind=L.KIND_STAGING, size=size)
    key = {"buffer spec": "spec", "buffer episode_spec": "episode_spec"}[where]
    doc = {**_buffer_doc(), key: field}
    spec = shmbuf.Spec.from_json(doc["spec"])
    episode = shmbuf.Spec.from_json(doc["episode_spec"]) if doc["episode_spec"] else None
    size = L.buffer_layout(
        [(f.name, f.shape, f.dtype) for f in spec.values()], doc["capacity"], doc["lanes"],
        len(L.encode_layout(doc)),
        [(f.name, f.shape, f.dtype) for f in episode.values()] if episode else [],
        doc["episode_capacity"]).total_size
    return _segment_bytes(doc=doc, size=size)


def _attach_as_its_kind(where: str, name: str) -> Any:
    if where == "staging arrays":
        from workers.staging import StagingRing

        return StagingRing.attach(name)
    return shmbuf.ReplayBuffer.attach(name, timeout=0.2)


# Every layout that carries shapes: a buffer's spec and episode spec, a staging ring's slot
# arrays. A priority table's layout has none (capacity and lanes only, bounded on their own).
SHAPED_KINDS = ["buffer spec", "buffer episode_spec", "staging arrays"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("capacity", [8, 512, 1024])
def test_a_priority_table_smaller_than_its_layout_is_a_format_error(capacity):
    """A priority table whose header size is smaller than its trees need (a capacity tampered
    to one that still passes the header's own bound, capacity x lanes bytes) is refused as a
    SegmentFormatError naming it, not an untyped ValueError from a view; a sane one of the same
    document attaches (the control: capacity 8 at its true size)."""
    from shmbuf.priority import PriorityTable, _table_layout

    doc = {"kind": "priorities", "buffer": "shmbuf-x", "lanes": 1, "capacity": capacity,
           "alpha": 0.6, "eps": 1e-6, "final_rows": False, "counted": False, "plan": None}
    payload = L.encode_layout(doc)
    true_size = _table_layout(1, capacity, len(payload), False).total
    name = _name("prio-size")
    tampered = capacity != 8
    _write(name, _segment_bytes(doc=doc, kind=L.KIND_PRIORITY,
                                size=L.header_size(len(payload)) + L.PAGE if tampered
                                else true_size))
    try:
        if tampered:
            with pytest.raises(shmbuf.SegmentFormatError,
                               match=f"priority table {name!r}.*needs {true_size}"):
                PriorityTable.attach(name)
        else:
            table = PriorityTable.attach(name)
            assert table.capacity == 8
            table.close()
    finally:
        _remove(name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", SHAPED_KINDS)
def test_the_shaped_segment_builder_makes_segments_that_attach(where):
    """Control for the overflow test below: the same documents with a sane shape attach."""
    name = _name("shaped")
    _write(name, _shaped_segment(where, SANE_SHAPE))
    try:
        attached = _attach_as_its_kind(where, name)
        if where == "staging arrays":
            assert attached.slot(0)["x"].shape == tuple(SANE_SHAPE)
            attached.close()
        else:
            with attached as buf:
                assert buf.capacity == 8
    finally:
        _remove(name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", sorted(OVERFLOWING_SHAPES))
@pytest.mark.parametrize("where", SHAPED_KINDS)
def test_a_shape_whose_size_overflows_64_bits_is_a_format_error_at_attach(where, shape, capsys):
    """A layout's sizes are checked in exact integers against the segment's real size: a shape
    of 2**64 elements (which int64 products wrap to 0 or -1) is refused when the header is
    read, naming the segment and the field, not an untyped ValueError from a reshape."""
    name = _name("overflow")
    _write(name, _shaped_segment(where, OVERFLOWING_SHAPES[shape]))
    try:
        for attach in (lambda: Segment.attach(name, timeout=0.2),
                       lambda: _attach_as_its_kind(where, name)):
            with pytest.raises(shmbuf.SegmentFormatError, match=name) as e:
                attach()
            assert "field 'x'" in str(e.value) and "needs more than" in str(e.value)
            assert _open_on(name) == ([], []), "the refused segment is still open or mapped"
        assert cli.main(["inspect", name]) == 1
        err = capsys.readouterr().err
        assert name in err and "Traceback" not in err
        assert os.path.exists(_path(name))  # nothing deleted it
    finally:
        _remove(name)


def test_fields_that_fit_alone_but_not_together_are_a_format_error():
    """The exact sum over every field list counts too, not only each field on its own."""
    half = [{"name": n, "shape": [1000], "dtype": "<f8"} for n in ("a", "b")]  # 8000 B a row
    doc = {"kind": "staging", "n_slots": 1, "arrays": half}
    L.check_layout_doc(L.KIND_STAGING, doc, 16000)
    with pytest.raises(ValueError, match="fields need at least 16000 bytes"):
        L.check_layout_doc(L.KIND_STAGING, doc, 15999)


@pytest.mark.timeout(120)
def test_ls_lists_malformed_segments_as_unreadable_and_gc_collects_only_the_leaked(capsys):
    """One malformed file must not break ls or gc for the others; gc removes the leaked
    segment and keeps every file it could not validate, however old."""
    bad = {case: _written(case) for case in MALFORMED}
    leaked = _leaked_staging()
    names = [*bad.values(), leaked]
    try:
        with shmbuf.ReplayBuffer.create(SPEC, capacity=8, name=_name("live")) as live:
            assert cli.main(["ls", "--json"]) == 0
            listed = {s["name"]: s for s in json.loads(capsys.readouterr().out)}
            assert listed[leaked]["state"] == "leaked"
            assert listed[live.name]["state"] == "alive"
            for case, name in bad.items():
                assert listed[name]["state"] == "unreadable", case
                assert listed[name]["error"], case
            assert cli.main(["ls"]) == 0
            out = capsys.readouterr().out
            for name in names:
                assert name in out
            assert cli.main(["gc", *names, live.name]) == 0
            out = capsys.readouterr().out
            assert f"removed {leaked}" in out
            assert not os.path.exists(_path(leaked))
            for case, name in bad.items():
                assert os.path.exists(_path(name)), f"gc deleted the unvalidated {case} file"
                assert f"kept {name}: unreadable" in out
    finally:
        _remove(*names)


def test_gc_still_removes_an_old_empty_segment_file(capsys):
    """A creator that died between creating the name and sizing it leaves an empty file:
    that one is ours (shmbuf creates it mode 0600) and gc removes it once old."""
    name = _name("empty")
    _write(name, b"")
    try:
        assert cli.main(["gc", name]) == 0
        assert f"removed {name}" in capsys.readouterr().out
        assert not os.path.exists(_path(name))
    finally:
        _remove(name)


# --------------------------------------------------------------------------------------------
# Item 5: FIFOs and other non-regular files
# --------------------------------------------------------------------------------------------
def _unblock_and_remove(path: str) -> None:
    """Give a reader blocked opening the FIFO its writer (so a hung scan anywhere returns),
    then remove it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        pass  # ENXIO: nobody is blocked on it
    else:
        os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@pytest.mark.timeout(90)
def test_a_fifo_in_dev_shm_never_hangs_ls_or_gc():
    fifos = [_path(f"shmbuf-fifo-{uuid.uuid4().hex[:12]}"), _path(f"fifo-{uuid.uuid4().hex[:12]}")]
    try:
        for p in fifos:
            os.mkfifo(p, 0o666)
        prefixed = os.path.basename(fifos[0])
        for args in (["ls"], ["ls", "--json"], ["gc", "--dry-run"], ["gc", prefixed]):
            try:
                res = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=20)
            except subprocess.TimeoutExpired:
                pytest.fail(f"`shmbuf {' '.join(args)}` hung on a FIFO in {SHM_DIR}")
            assert res.returncode == 0, res.stderr
            assert "Traceback" not in res.stderr
        assert all(os.path.exists(p) for p in fifos), "gc removed a FIFO"
        with pytest.raises(shmbuf.SegmentFormatError, match="not a regular file"):
            Segment.attach(prefixed, timeout=0.1)
    finally:
        for p in fifos:
            _unblock_and_remove(p)


# --------------------------------------------------------------------------------------------
# Item 7: one timeout validator for every public timeout
# --------------------------------------------------------------------------------------------
def _actor_returns(ctx: Any) -> None:
    return None


Call = Callable[[Any], Any]  # takes the bad timeout


def _plain(fn: Callable[[shmbuf.ReplayBuffer, Any], Any]) -> Callable[..., Any]:
    @contextmanager
    def setup(buf: shmbuf.ReplayBuffer) -> Iterator[Call]:
        yield lambda t: fn(buf, t)
    return setup


def _pool(buf: shmbuf.ReplayBuffer, **kw: Any) -> Any:
    from workers import SamplerPool

    return SamplerPool(buf, batch_size=1, workers=0, **kw)


@contextmanager
def _pool_made(buf: shmbuf.ReplayBuffer) -> Iterator[Any]:
    pool = _pool(buf)
    try:
        yield pool
    finally:
        pool.close()


@contextmanager
def _writer_made(buf: shmbuf.ReplayBuffer) -> Iterator[Call]:
    with buf.writer() as w:
        yield lambda t: w.extend({"x": np.zeros((2, 4), np.float32)}, timeout=t)


def _actors(buf: shmbuf.ReplayBuffer, **kw: Any) -> Any:
    from workers import ActorGroup

    return ActorGroup(_actor_returns, 1, buf, start_method="fork", restart="never", **kw)


def _actors_made(method: str) -> Callable[..., Any]:
    @contextmanager
    def setup(buf: shmbuf.ReplayBuffer) -> Iterator[Call]:
        group = _actors(buf)
        try:
            assert group.join(30), "the actor did not finish"  # its lane writes are over
            yield getattr(group, method)
        finally:
            group.stop()
    return setup


def _with_actor_group(buf: shmbuf.ReplayBuffer, t: Any) -> None:
    with _actors(buf, lane_timeout=t):
        pass


@contextmanager
def _pool_method(buf: shmbuf.ReplayBuffer, method: str) -> Iterator[Call]:
    with _pool_made(buf) as pool:
        yield getattr(pool, method)


# name -> (the argument's name, setup: buffer -> context yielding the call to make)
TIMEOUT_CALLS: dict[str, tuple[str, Callable[..., Any]]] = {
    "ReplayBuffer.attach": ("timeout", _plain(
        lambda b, t: shmbuf.ReplayBuffer.attach(b.name, timeout=t))),
    "Segment.attach": ("timeout", _plain(lambda b, t: Segment.attach(b.name, timeout=t))),
    "ReplayBuffer.writer": ("timeout", _plain(lambda b, t: b.writer(timeout=t))),
    "ReplayBuffer.writer(insert_timeout)": ("insert_timeout", _plain(
        lambda b, t: b.writer(insert_timeout=t))),
    "ReplayBuffer.clear": ("timeout", _plain(lambda b, t: b.clear(timeout=t))),
    "Writer.extend": ("timeout", _writer_made),
    "SamplerPool": ("timeout", _plain(lambda b, t: _pool(b, timeout=t))),
    "SamplerPool.next": ("timeout", lambda b: _pool_method(b, "next")),
    "SamplerPool.close": ("timeout", lambda b: _pool_method(b, "close")),
    "ActorGroup(lane_timeout)": ("lane_timeout", _plain(_with_actor_group)),
    "ActorGroup.join": ("timeout", _actors_made("join")),
    "ActorGroup.stop": ("timeout", _actors_made("stop")),
}
BAD_TIMEOUTS = [math.nan, math.inf, "5", -1.0, True, None, [1]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=repr)
@pytest.mark.parametrize("call", sorted(TIMEOUT_CALLS))
def test_every_public_timeout_refuses_nan_inf_strings_and_negatives(call, bad):
    """The one validator's ValueError, naming the argument and the value, at once; the buffer's
    bytes do not change (clear() with a NaN timeout used to empty the buffer)."""
    arg, setup = TIMEOUT_CALLS[call]
    if bad is None and call in ("Writer.extend", "SamplerPool.next"):
        pytest.skip("None means the object's default timeout here")
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=2, name=_name("timeout")) as buf:
        with buf.writer(lane=1) as w:
            w.add(**_row())
        with setup(buf) as call_it:
            with open(_path(buf.name), "rb") as f:
                before = f.read()
            t0 = time.monotonic()
            with pytest.raises(ValueError, match=f"{arg} must be") as info:
                call_it(bad)
            assert time.monotonic() - t0 < 10
            assert repr(bad) in str(info.value)
            with open(_path(buf.name), "rb") as f:
                assert f.read() == before
        assert buf.committed(1) == 1 and len(buf) >= 1


@pytest.mark.timeout(30)
def test_attach_with_a_nan_timeout_to_a_segment_being_created_does_not_spin():
    name = _name("uninit")
    _write(name, bytes(L.PAGE), age=0.0)  # zeroed, no magic yet: looks like one being created
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="timeout must be"):
            shmbuf.ReplayBuffer.attach(name, timeout=math.nan)
        assert time.monotonic() - t0 < 5
        with pytest.raises(shmbuf.SegmentFormatError, match="not an initialised"):
            shmbuf.ReplayBuffer.attach(name, timeout=0.05)
    finally:
        _remove(name)


def test_timeout_validator_accepts_numbers_and_says_how_to_wait_long():
    from shmbuf.checks import timeout_seconds

    assert timeout_seconds("t", 0) == 0.0 and timeout_seconds("t", np.float32(0.5)) == 0.5
    assert timeout_seconds("t", 7) == 7.0 and type(timeout_seconds("t", np.int64(7))) is float
    with pytest.raises(ValueError, match="e.g. 86400"):
        timeout_seconds("t", math.inf)
    with pytest.raises(ValueError, match="> 0"):
        timeout_seconds("t", 0, positive=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "five"])
def test_cli_inspect_refuses_a_bad_timeout_at_once(value, capsys):
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, name=_name("cli")) as buf:
        t0 = time.monotonic()
        assert cli.main(["inspect", buf.name, "--timeout", value]) == 2
        assert time.monotonic() - t0 < 10
        err = capsys.readouterr().err
        assert "--timeout must be" in err and repr(value) in err
    res = subprocess.run([*CLI, "inspect", "shmbuf-x", "--timeout", value],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "--timeout must be" in res.stderr


# --------------------------------------------------------------------------------------------
# Item 8: a SIGTERM handler that goes on keeps the buffer
# --------------------------------------------------------------------------------------------
def _owner_child_main(conn: Any, how: str) -> None:
    """Create a buffer under the SIGTERM disposition ``how``, report its name, and, once a
    SIGTERM was handled, say so; then wait for "done" and close the buffer."""
    seen = []

    def checkpoint_and_go_on(signum: int, frame: Any) -> None:
        seen.append(signum)

    if how == "handler-before-create":
        signal.signal(signal.SIGTERM, checkpoint_and_go_on)
    elif how == "ignored":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif how == "handler-exits":
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(3))
    buf = shmbuf.ReplayBuffer.create(SPEC, capacity=8)
    with buf.writer() as w:
        w.add(**_row())
    if how == "handler-after-create":
        signal.signal(signal.SIGTERM, checkpoint_and_go_on)
    conn.send(buf.name)
    reported = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if conn.poll(0.02):
            assert conn.recv() == "done"
            break
        if seen and not reported:
            conn.send("handled")
            reported = True
    buf.close()


@contextmanager
def _owner_child(mp: Any, target: Callable[..., None], *args: Any) -> Iterator[tuple[Any, Any, str]]:
    """Start ``target(conn, *args)`` in a child that creates a buffer and sends its name; yields
    (process, parent end, name). On the way out: the child is killed if still alive and the
    name is unlinked if it is still there."""
    name = None
    try:
        with reporting_child(mp, target, *args, what="the owner child") as (proc, parent, name):
            yield proc, parent, name
    finally:
        if name is not None:
            shmdir.unlink(name)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["handler-before-create", "handler-after-create", "ignored"])
def test_a_sigterm_that_does_not_end_the_owner_keeps_its_buffer(how, mp):
    """The owner checkpoints on SIGTERM (or ignores it) and goes on: restarted workers must
    still attach by name."""
    with _owner_child(mp, _owner_child_main, how) as (proc, parent, name):
        os.kill(proc.pid, signal.SIGTERM)
        if how == "ignored":
            time.sleep(0.2)
        else:
            assert parent.poll(30) and parent.recv() == "handled"
        assert proc.is_alive()
        assert os.path.exists(_path(name)), f"SIGTERM ({how}) unlinked a buffer still in use"
        with shmbuf.ReplayBuffer.attach(name) as again:
            assert len(again) == 1
        parent.send("done")
        proc.join(30)
        assert proc.exitcode == 0
        assert not os.path.exists(_path(name))  # and close() still unlinks it


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["default", "handler-exits"])
def test_a_sigterm_that_ends_the_owner_unlinks_its_buffer(how, mp):
    with _owner_child(mp, _owner_child_main, how) as (proc, parent, name):
        assert os.path.exists(_path(name))
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(30)
        assert proc.exitcode == (-signal.SIGTERM if how == "default" else 3)
        assert not os.path.exists(_path(name)), f"the owner ended by SIGTERM ({how}) leaked"


_KEEP: list[Any] = []  # keeps the child's buffer referenced until its interpreter ends


def _owner_returns_without_close(conn: Any) -> None:
    _KEEP.append(shmbuf.ReplayBuffer.create(SPEC, capacity=8))
    conn.send(_KEEP[-1].name)


@pytest.mark.timeout(60)
def test_an_owner_child_that_ends_without_close_unlinks(mp):
    """A multiprocessing child ends with os._exit, which skips atexit: the cleanup also runs
    from multiprocessing's exit finalizers (the path a handler's sys.exit takes, too)."""
    with _owner_child(mp, _owner_returns_without_close) as (proc, parent, name):
        proc.join(30)
        assert proc.exitcode == 0
        assert not os.path.exists(_path(name)), "the owner child ended and left its segment"


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(60)
def test_import_installs_cleanup_only_where_the_default_action_would_terminate():
    """``import shmbuf`` on the main thread gives SIGTERM/SIGHUP (and SIGINT where it is at
    SIG_DFL) the cleanup handler; it leaves handlers installed before it alone, and never
    overrides one installed after it, not even SIG_DFL set on purpose."""
    res = _python("""
        import signal
        def mine(signum, frame): pass
        signal.signal(signal.SIGHUP, mine)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import shmbuf, shmbuf.cleanup as S
        print(signal.getsignal(signal.SIGTERM) is S._on_signal,
              signal.getsignal(signal.SIGHUP) is mine,
              signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the user's choice, after import
        b = shmbuf.ReplayBuffer.create({"x": ((4,), "float32")}, capacity=16)
        print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        b.close()
    """)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "True", "True", "True"]


# --------------------------------------------------------------------------------------------
# Item 15 (part): kind names, names, inodes
# --------------------------------------------------------------------------------------------
def test_every_kind_has_one_name_used_by_ls_and_inspect(capsys):
    assert set(L.KIND_NAMES) == {L.KIND_BUFFER, L.KIND_STAGING, L.KIND_PRIORITY, L.KIND_WEIGHTS}
    doc = {"kind": "priorities", "buffer": "shmbuf-x", "lanes": 1, "capacity": 8, "alpha": 0.6,
           "eps": 1e-6}
    seg = Segment.create(_name("prio"), L.KIND_PRIORITY, doc, L.header_size)
    try:
        assert cli.main(["inspect", seg.name]) == 0
        assert (f"kind:     priority table (format {L.FORMAT_VERSION})"
                in capsys.readouterr().out)
        assert cli.main(["ls", "--json"]) == 0
        listed = {s["name"]: s for s in json.loads(capsys.readouterr().out)}
        assert listed[seg.name]["kind"] == "priority table"
    finally:
        seg.close()


@pytest.mark.parametrize("bad", ["ok\n", ".", "..", "/..", "/.", "a/b", "", "x" * 201, "\n"])
def test_names_are_matched_whole_and_dot_names_refused(bad):
    with pytest.raises(ValueError, match="not valid"):
        shmdir.normalize_name(bad)
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(ValueError, match="not valid"):
        shmbuf.ReplayBuffer.create(SPEC, capacity=8, name=bad)
    assert set(os.listdir(SHM_DIR)) == before


def test_valid_names_still_pass():
    for good in ("shmbuf-x", "/shmbuf-x", "a.b_c-D9", "...", "x" * 200):
        assert shmdir.normalize_name(good) == good.lstrip("/")


def test_no_room_for_a_new_file_is_a_capacity_error(monkeypatch):
    """ENOSPC from shm_open (a /dev/shm out of inodes) is a CapacityError with the fix;
    other errors stay what they are."""
    def full(*args: Any, **kw: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(S.posix_ipc, "SharedMemory", full)
    with pytest.raises(shmbuf.CapacityError, match="--shm-size") as info:
        shmbuf.ReplayBuffer.create(SPEC, capacity=8)
    assert "inode" in str(info.value)

    def too_many(*args: Any, **kw: Any) -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(S.posix_ipc, "SharedMemory", too_many)
    with pytest.raises(OSError) as info:
        shmbuf.ReplayBuffer.create(SPEC, capacity=8)
    assert not isinstance(info.value, shmbuf.CapacityError)


@pytest.mark.timeout(60)
def test_a_dev_shm_out_of_inodes_is_a_capacity_error_for_real():
    """In a private mount namespace, a tmpfs with no free inode over /dev/shm."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    code = textwrap.dedent("""
        import shmbuf
        try:
            shmbuf.ReplayBuffer.create({"x": ((4,), "float32")}, capacity=16)
        except Exception as e:
            print(type(e).__name__, e)
    """)
    probe = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs",
                            SHM_DIR], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here (needs CAP_SYS_ADMIN): "
                    f"{probe.stderr.decode().strip()}")
    res = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         'mount -t tmpfs -o size=64m,nr_inodes=1 tmpfs /dev/shm && exec "$0" -c "$1"',
         sys.executable, code],
        capture_output=True, text=True, timeout=50)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("CapacityError") and "--shm-size" in res.stdout, res.stdout


# --------------------------------------------------------------------------------------------
# Platforms: the seqlock needs x86-64 ordering
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("machine,bits,ok", [
    ("x86_64", 64, True), ("AMD64", 64, True), ("amd64", 64, True), ("x86_64", 32, False),
    ("i686", 32, False), ("aarch64", 64, False), ("arm64", 64, False), ("ppc64le", 64, False),
    ("riscv64", 64, False), ("", 64, False),
])
def test_only_64_bit_x86_is_supported(machine, bits, ok):
    assert shmbuf.slots.platform_supported(machine, bits) is ok


def test_create_and_attach_refuse_another_architecture(monkeypatch):
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8) as buf:
        monkeypatch.setattr(shmbuf.slots.platform, "machine", lambda: "aarch64")
        monkeypatch.delenv("SHMBUF_UNSAFE_ALLOW_ARCH", raising=False)
        before = set(os.listdir(SHM_DIR))
        with pytest.raises(shmbuf.ShmbufError, match="aarch64") as info:
            shmbuf.ReplayBuffer.create(SPEC, capacity=8)
        assert "SHMBUF_UNSAFE_ALLOW_ARCH" in str(info.value)
        assert set(os.listdir(SHM_DIR)) == before
        with pytest.raises(shmbuf.ShmbufError, match="aarch64"):
            shmbuf.ReplayBuffer.attach(buf.name)
        monkeypatch.setenv("SHMBUF_UNSAFE_ALLOW_ARCH", "1")  # for experiments, at one's risk
        with shmbuf.ReplayBuffer.attach(buf.name) as again:
            assert len(again) == 0
