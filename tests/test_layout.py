"""Byte layout math (pure, no I/O) checked with hypothesis, plus a check that a real segment puts
its header and lane words where layout.py says."""

from __future__ import annotations

import os
import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf import layout as L

DTYPES = ["bool", "int8", "uint8", "int16", "float16", "int32", "float32", "int64", "uint64",
          "float64", "complex64", "complex128"]
HOT_WORDS = [L.LANE_COMMITTED, L.LANE_RESERVED, L.LANE_EPISODE, L.LANE_EPOCH, L.LANE_HEARTBEAT,
             L.LANE_WRITER_PID, L.LANE_EPISODE_START]

field_lists = st.lists(
    st.tuples(
        st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple),
        st.sampled_from(DTYPES).map(np.dtype),
    ),
    min_size=1,
    max_size=12,
).map(lambda fs: [(f"f{k}", shape, dt) for k, (shape, dt) in enumerate(fs)])


def _regions(lay: L.BufferLayout) -> list[tuple[str, int, int]]:
    """(name, start, end) of every region of a buffer segment."""
    out = [
        ("header", 0, lay.header_size),
        ("lanes", lay.lane_offset, lay.lane_offset + lay.lanes * L.LANE_LINES * L.LINE),
        ("limiter", lay.limiter_offset,
         lay.limiter_offset + (L.LIMITER_CONFIG_LINES + L.MAX_SAMPLERS) * L.LINE),
        ("stamps", lay.stamps_offset, lay.stamps_offset + lay.slots * L.WORD),
        ("_meta", lay.meta.offset, lay.meta.offset + lay.meta.nbytes),
    ]
    out += [(c.name, c.offset, c.offset + c.nbytes) for c in lay.columns]
    return out


@settings(max_examples=300, deadline=None)
@given(fields=field_lists, capacity=st.integers(1, 100_000), lanes=st.integers(1, 64),
       json_len=st.integers(0, 20_000))
def test_buffer_layout_alignment_and_disjoint_regions(fields, capacity, lanes, json_len):
    lay = L.buffer_layout(fields, capacity, lanes, json_len)
    assert lay.slots == capacity * lanes
    # The header holds the fixed prefix and the JSON, page-aligned.
    assert lay.header_size % L.PAGE == 0 and lay.header_size >= L.H_JSON + json_len
    regions = _regions(lay)
    # Every region and every column starts on a 64-byte line.
    for name, start, _ in regions:
        assert start % L.LINE == 0, (name, start)
    # Columns are in spec order, with the spec's shapes and dtypes, one row per slot.
    assert [c.name for c in lay.columns] == [f[0] for f in fields]
    for c, (_, shape, dt) in zip(lay.columns, fields):
        assert c.shape == (lay.slots, *shape) and c.dtype == dt
        assert c.nbytes == lay.slots * int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    assert lay.meta.shape == (lay.slots,) and lay.meta.dtype == np.dtype("<u8")
    # Regions do not overlap (empty ones take no room), and the segment covers them all.
    spans = sorted((s, e, n) for n, s, e in regions if e > s)
    for (s1, e1, n1), (s2, e2, n2) in zip(spans, spans[1:]):
        assert e1 <= s2, f"{n1} [{s1}, {e1}) overlaps {n2} [{s2}, {e2})"
    assert lay.total_size % L.PAGE == 0
    assert lay.total_size >= max(e for _, _, e in regions)
    assert lay.total_size - max(e for _, _, e in regions) < L.PAGE  # no page wasted at the end
    # The layout is a pure function of its inputs.
    assert L.buffer_layout(fields, capacity, lanes, json_len) == lay


@settings(max_examples=200, deadline=None)
@given(lanes=st.integers(1, 300), capacity=st.integers(1, 5000), json_len=st.integers(0, 9000))
def test_each_hot_word_is_aligned_and_alone_in_its_line(lanes, capacity, json_len):
    """Every hot word (lane words, limiter words, sampler counters) is 8-aligned, inside its
    region, and the only hot word in its 64-byte line: no false sharing between writers."""
    lay = L.buffer_layout([("x", (3,), np.dtype("f4"))], capacity, lanes, json_len)
    regions = {n: (s, e) for n, s, e in _regions(lay)}
    words = []
    for k in range(lanes):
        for w in HOT_WORDS:
            off = lay.lane_word(k, w)
            lo, hi = regions["lanes"]
            assert lo <= off and off + 8 <= hi
            words.append(off)
    for w in range(L.LIMITER_CONFIG_LINES):
        words.append(lay.limiter_word(w))
    for j in range(L.MAX_SAMPLERS):
        off = lay.sampler_counter(j)
        lo, hi = regions["limiter"]
        assert lo <= off and off + 8 <= hi
        words.append(off)
    assert all(off % L.WORD == 0 for off in words)
    lines = [off // L.LINE for off in words]
    assert len(set(lines)) == len(lines), "two hot words share a 64-byte line"
    assert len(set(words)) == len(words)
    # Lane k's words lie in lane k's own lines, in order.
    for k in range(lanes):
        first = lay.lane_offset + k * L.LANE_LINES * L.LINE
        assert all(first <= lay.lane_word(k, w) < first + L.LANE_LINES * L.LINE
                   for w in HOT_WORDS)
    # Stamps: one u64 per slot, 8-aligned, lane k's slots contiguous.
    assert lay.stamp(0) == lay.stamps_offset
    assert lay.stamp(lay.slots - 1) + 8 == regions["stamps"][1]


def test_hot_word_indices_fit_their_lines():
    assert len(set(HOT_WORDS)) == len(HOT_WORDS) and max(HOT_WORDS) < L.LANE_LINES
    limiter = [L.LIM_GENERATION, L.LIM_ACTIVE, L.LIM_SPI, L.LIM_MIN_DIFF, L.LIM_MAX_DIFF,
               L.LIM_MIN_SIZE, L.LIM_INSERTS_BASE, L.LIM_N_SAMPLERS]
    assert len(set(limiter)) == len(limiter) and max(limiter) < L.LIMITER_CONFIG_LINES


def test_buffer_layout_rejects_empty_rings():
    for capacity, lanes in ((0, 1), (1, 0), (-1, 2)):
        with pytest.raises(ValueError):
            L.buffer_layout([("x", (), np.dtype("f4"))], capacity, lanes, 10)


@given(n=st.integers(0, 1 << 40), to=st.sampled_from([8, 64, 4096]))
def test_align(n, to):
    a = L.align(n, to)
    assert a % to == 0 and n <= a < n + to


@given(json_len=st.integers(0, 100_000))
def test_header_size(json_len):
    h = L.header_size(json_len)
    assert h % L.PAGE == 0 and L.H_JSON + json_len <= h < L.H_JSON + json_len + L.PAGE


# --------------------------------------------------------------------------------------------
# Stamps and meta
# --------------------------------------------------------------------------------------------
@given(i=st.integers(0, (1 << 61)), j=st.integers(0, (1 << 61)))
def test_stamps_tell_every_index_and_state_apart(i, j):
    """writing(i) is odd, held(i) even and never 0 (never written); both are injective and never
    collide, so a reader can never mistake one index or state for another."""
    assert L.stamp_writing(i) % 2 == 1
    assert L.stamp_held(i) % 2 == 0 and L.stamp_held(i) != 0
    assert L.stamp_held(i) == L.stamp_writing(i) + 1
    assert L.stamp_held(i) != L.stamp_writing(j)
    assert (L.stamp_held(i) == L.stamp_held(j)) == (i == j)
    assert (L.stamp_writing(i) == L.stamp_writing(j)) == (i == j)
    assert L.stamp_held(i) < 1 << 63  # fits the signed 64-bit word readers compare


@given(episode=st.integers(0, (1 << 31) - 1), step=st.integers(0, L.STEP_MASK))
def test_pack_meta_round_trips(episode, step):
    m = L.pack_meta(episode, step)
    assert m >> L.STEP_BITS == episode and m & L.STEP_MASK == step
    assert 0 <= m < 1 << 63


def test_pack_meta_masks_steps_past_32_bits():
    assert L.pack_meta(3, (1 << 32) + 5) == L.pack_meta(3, 5)


def test_lock_offsets_are_distinct_and_beyond_any_data():
    offs = [L.LOCK_OWNER, L.LOCK_LIMITER] + [L.lock_sampler(j) for j in range(L.MAX_SAMPLERS)]
    offs += [L.lock_lane(k) for k in range(L.MAX_LANES)]
    assert len(set(offs)) == len(offs)
    assert min(offs) >= 1 << 40  # far past the end of any segment's bytes


def test_encode_layout_is_canonical():
    a = L.encode_layout({"b": 1, "a": [1, 2], "c": {"y": 1, "x": 2}})
    b = L.encode_layout({"c": {"x": 2, "y": 1}, "a": [1, 2], "b": 1})
    assert a == b and b" " not in a


# --------------------------------------------------------------------------------------------
# A real segment matches the documented layout
# --------------------------------------------------------------------------------------------
def test_header_struct_matches_the_documented_offsets():
    fmt = L.HEADER.format
    assert fmt.startswith("<")
    codes = re.findall(r"\d*[a-zA-Z?]", fmt[1:])  # "8s", "I", ...
    offsets = [struct.calcsize("<" + "".join(codes[:k])) for k in range(len(codes))]
    # magic, version, kind, total size, owner pid, owner start, created, uid, json length
    assert offsets == [L.H_MAGIC, L.H_VERSION, L.H_KIND, L.H_TOTAL_SIZE, L.H_OWNER_PID,
                       L.H_OWNER_START, L.H_CREATED, L.H_OWNER_UID, L.H_JSON_LEN]
    assert L.HEADER.size <= L.H_JSON


def test_a_real_segment_puts_header_and_lane_words_where_layout_says():
    spec = shmbuf.Spec(obs=((5,), "float32"), action=((), "int64"))
    with shmbuf.ReplayBuffer.create(spec, capacity=16, lanes=3) as buf:
        with buf.writer(lane=2) as w:
            for i in range(21):
                w.add(obs=np.full(5, i, np.float32), action=i)
        with open(os.path.join("/dev/shm", buf.name), "rb") as f:
            raw = f.read()
        lay = buf._layout
        assert len(raw) == lay.total_size == buf.nbytes
        assert raw[L.H_MAGIC:L.H_MAGIC + 8] == L.MAGIC
        u32 = lambda off: struct.unpack_from("<I", raw, off)[0]  # noqa: E731
        u64 = lambda off: struct.unpack_from("<Q", raw, off)[0]  # noqa: E731
        assert u32(L.H_VERSION) == L.FORMAT_VERSION and u32(L.H_KIND) == L.KIND_BUFFER
        assert u64(L.H_TOTAL_SIZE) == lay.total_size
        assert u64(L.H_OWNER_PID) == os.getpid() and u32(L.H_OWNER_UID) == os.getuid()
        doc = raw[L.H_JSON:L.H_JSON + u32(L.H_JSON_LEN)]
        assert doc == L.encode_layout({"kind": "buffer", "spec": spec.to_json(), "capacity": 16,
                                       "lanes": 3, "next_obs": "stored", "episode_capacity": 64,
                                       "episode_spec": []})
        assert u64(lay.lane_word(2, L.LANE_COMMITTED)) == 21
        assert u64(lay.lane_word(2, L.LANE_RESERVED)) == 21
        assert u64(lay.lane_word(2, L.LANE_WRITER_PID)) == os.getpid()
        assert u64(lay.lane_word(0, L.LANE_COMMITTED)) == 0
        for i in range(5, 21):  # lane 2's ring holds indices 5..20
            slot = 2 * 16 + i % 16
            assert u64(lay.stamp(slot)) == L.stamp_held(i)
            assert u64(lay.meta.offset + slot * 8) == L.pack_meta(0, i)
            obs, action = lay.columns
            assert struct.unpack_from("<5f", raw, obs.offset + slot * 20) == (float(i),) * 5
            assert struct.unpack_from("<q", raw, action.offset + slot * 8)[0] == i
