"""Large rows stored streaming past the caches (``shmbuf/_stream_c.c``, used by ``Writer.add``
and ``Writer.extend`` for rows of ``store.STREAM_MIN_ROW_BYTES`` or more).

The rows written come back whole through every path (a wrapping ring, an extend longer than the
ring, rows the extension refuses and NumPy stores); what the extension cannot copy as it is it
refuses before storing a byte; and a reader sampling while a writer process laps a small ring
of large self-checking rows as fast as it can never gets a torn one (the fences around the
non-temporal stores, under every start method). The same extension's ``full_fence`` is the one
the staging ring's handshakes use.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import shmbuf
from shmbuf import store
from tests._helpers.processes import reap
from tests._helpers.rows import RowScheme

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(store.stream_rows is None, reason="_stream_c was not built"),
]

# payload and mirror 8 KB each, obs 16 KB: three streamed fields; lane, index, check are not
ROWS = RowScheme(payload_words=1024, mirror=True, obs_shape=(32, 32, 4))
SPEC = shmbuf.Spec(ROWS.fields)


def test_the_large_fields_stream_and_the_small_ones_do_not():
    assert [store.streams(f) for f in SPEC.values()] == [
        False, False, True, True, True, False]  # lane, index, obs, payload, mirror, check


def test_large_rows_come_back_whole_from_every_store_path():
    capacity = 48
    with shmbuf.ReplayBuffer.create(SPEC, capacity=capacity) as buf, buf.writer() as w:
        for i in range(70):  # add, wrapping the ring
            row = ROWS.row(0, i)
            if i % 7 == 0:  # float64 for float32: refused by the extension, cast by NumPy
                row["obs"] = row["obs"].astype(np.float64)
            w.add(**row)
        w.extend(ROWS.batch(0, range(70, 100)))  # crosses the ring's end
        w.extend(ROWS.batch(0, range(100, 100 + 2 * capacity + 5)))  # longer than the ring
        batch = ROWS.batch(0, range(201, 211))
        batch["obs"] = batch["obs"].astype(np.float64)  # extend's NumPy fallback: a cast
        w.extend(batch)
        end = 211
        rows = buf.get(np.arange(end - capacity, end))
        assert not ROWS.bad_rows(rows, indices=np.arange(end - capacity, end)).any()


def test_a_one_env_vector_writer_streams_its_rows_whole():
    with shmbuf.ReplayBuffer.create(SPEC, capacity=20) as buf, buf.writer(num_envs=1) as w:
        for i in range(30):
            w.add(**{k: v[None] for k, v in ROWS.row(0, i).items()})
        rows = buf.get(np.arange(10, 30))
        assert not ROWS.bad_rows(rows, indices=np.arange(10, 30)).any()


@pytest.mark.parametrize("row_bytes", [1, 15, 63, 64, 65, 4099, 8192])
def test_store_rows_copies_every_byte_at_any_alignment(row_bytes):
    """Rows of odd sizes start anywhere in a line: the unaligned head, the streamed middle and
    the tail of each copy, against NumPy's."""
    rng = np.random.default_rng(row_bytes)
    column = rng.integers(0, 256, (9, row_bytes), dtype=np.uint8)
    expected = column.copy()
    for first, count in [(0, 1), (1, 1), (2, 3), (5, 4)]:
        rows = rng.integers(0, 256, (count, row_bytes), dtype=np.uint8)
        assert store.stream_rows(column, first, rows, count) is True
        expected[first:first + count] = rows
        np.testing.assert_array_equal(column, expected)


def test_store_rows_refuses_what_it_cannot_copy_as_it_is_and_stores_nothing():
    column = np.zeros((8, 1024), np.uint32)
    row = np.arange(1024, dtype=np.uint32)
    for refused in (row.astype(np.int32), row.astype(np.float32), row.astype(np.uint64)[:512],
                    np.repeat(row, 2)[::2], row[:1000], [1, 2, 3]):
        assert store.stream_rows(column, 3, refused, 1) is False
    assert store.stream_rows(column, 3, np.stack([row, row]), 1) is False  # 2 rows, not 1
    with pytest.raises(IndexError):
        store.stream_rows(column, 8, row, 1)
    with pytest.raises(IndexError):
        store.stream_rows(column, 7, np.stack([row, row]), 2)
    assert not column.any()
    assert store.stream_rows(column, 6, np.stack([row, row + 1]), 2) is True
    assert (column[6] == row).all() and (column[7] == row + 1).all() and not column[:6].any()
    frozen = np.zeros((8, 1024), np.uint32)
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        store.stream_rows(frozen, 0, row, 1)


def lap_the_ring(name: str, stop, use_extend: bool) -> None:
    """A writer process: self-checking large rows into lane 0 as fast as it can."""
    buf = shmbuf.ReplayBuffer.attach(name)
    with buf, buf.writer(0) as w:
        i = 0
        while not stop.is_set():
            if use_extend:
                w.extend(ROWS.batch(0, range(i, i + 5)))
                i += 5
            else:
                w.add(**ROWS.row(0, i))
                i += 1


@pytest.mark.parametrize("use_extend", [False, True], ids=["add", "extend"])
def test_no_torn_large_row_is_delivered_while_a_writer_laps_the_ring(mp, use_extend):
    capacity = 16
    with shmbuf.ReplayBuffer.create(SPEC, capacity=capacity) as buf:
        stop = mp.Event()
        writer = mp.Process(target=lap_the_ring, args=(buf.name, stop, use_extend), daemon=True)
        writer.start()
        try:
            deadline = time.monotonic() + 60
            while buf.committed(0) < 2 * capacity and time.monotonic() < deadline:
                time.sleep(0.01)
            start, samples, t0 = buf.committed(0), 0, time.monotonic()
            while time.monotonic() - t0 < 1.5:
                batch = buf.sample(8)
                bad = ROWS.bad_rows(batch)
                assert not bad.any(), f"torn rows delivered at {np.flatnonzero(bad)}"
                samples += 1
            lapped = (buf.committed(0) - start) / capacity
        finally:
            stop.set()
            reap([writer])
    assert lapped > 20, f"the writer lapped the ring only {lapped:.0f} times"
    assert samples > 50


def test_the_handshakes_fence_with_the_compiled_mfence():
    """``slots.full_fence`` (the StoreLoad barrier of the staging ring's sleep/wake-up
    handshake) is the extension's ``mfence`` where it was built, not the lock, which costs a
    learner waking from its train step several microseconds more; the staging ring took it."""
    from shmbuf import _stream_c, slots
    from workers import staging

    assert slots.full_fence is _stream_c.full_fence
    assert staging.full_fence is _stream_c.full_fence


@pytest.mark.parametrize("env", [{"SHMBUF_STREAM": "off"}, {"SHMBUF_STREAM": "off", "SHMBUF_STORE": "numpy"}])
def test_shmbuf_stream_off_stores_every_row_through_the_caches(env):
    """``SHMBUF_STREAM=off`` (for measuring what streaming buys) leaves large rows to plain
    stores in the compiled store and in NumPy's, and the rows still come back whole."""
    code = ("import numpy as np, shmbuf\n"
            "from shmbuf import store\n"
            "spec = shmbuf.Spec(obs=((4, 84, 84), 'uint8'))\n"
            "rows = np.arange(5 * 4 * 84 * 84, dtype=np.int64).reshape(5, 4, 84, 84).astype(np.uint8)\n"
            "with shmbuf.ReplayBuffer.create(spec, 4) as b, b.writer() as w:\n"
            "    w.add(obs=rows[0])\n"
            "    w.extend({'obs': rows[1:]})\n"
            "    got = b.get(np.arange(1, 5))['obs']\n"
            "    print(store.stream_rows is None, [store.large_rows(f) for f in spec.values()],\n"
            "          bool((got == rows[1:]).all()))\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "[False]", "True"]
