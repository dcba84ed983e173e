"""Readers must not slow writers (issue 13): the lines one ``add`` stores to, taken from a real
segment before and after the call, are the lane's own; a sample stores nothing in the buffer;
and no word that samplers or pools store per batch shares a 128-byte pair of lines (the unit of
x86's adjacent-line prefetch) with a word the writer stores or loads on every add."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf import layout as L

PAIR = 2 * L.LINE  # adjacent-line prefetchers move 128-byte aligned pairs of lines

MUJOCO = shmbuf.Spec(obs=((17,), "float32"), next_obs=((17,), "float32"),
                     action=((6,), "float32"), reward=((), "float32"), done=((), "bool"))


def _snapshot(buf: shmbuf.ReplayBuffer) -> np.ndarray:
    with open(f"/dev/shm/{buf.name}", "rb") as f:
        return np.frombuffer(f.read(), np.uint8)


def _changed_lines(before: np.ndarray, after: np.ndarray) -> set[int]:
    return {int(off) // L.LINE for off in np.flatnonzero(before != after)}


def _row(i: int) -> dict[str, object]:
    return dict(obs=np.full(17, i, np.float32), next_obs=np.full(17, i + 1, np.float32),
                action=np.full(6, i, np.float32), reward=float(i), done=i % 7 == 0)


def _lines_of(offset: int, nbytes: int) -> set[int]:
    return set(range(offset // L.LINE, (offset + nbytes - 1) // L.LINE + 1))


@pytest.mark.parametrize("capacity", [8, 1000])
def test_an_add_stores_only_its_lane_words_its_slot_and_its_row(capacity):
    """Between two room checks, ``add`` (the compiled one) stores to exactly these lines: its
    lane's ``committed`` and ``reserved``, its slot's stamp and ``_meta`` word, and its row in
    each column. No limiter word, no heartbeat, nothing of another lane."""
    with shmbuf.ReplayBuffer.create(MUJOCO, capacity=capacity, lanes=3) as buf, \
            buf.writer(lane=1) as w:
        lay = buf._layout
        for i in range(2 * capacity + 3):  # past the first room check, and around the ring
            w.add(**_row(i))
        for i in range(2 * capacity + 3, 2 * capacity + 13):
            before = _snapshot(buf)
            w.add(**_row(i))
            slot = 1 * capacity + i % capacity
            allowed = {lay.lane_word(1, L.LANE_COMMITTED) // L.LINE,
                       lay.lane_word(1, L.LANE_RESERVED) // L.LINE,
                       lay.stamp(slot) // L.LINE, (lay.meta.offset + slot * L.WORD) // L.LINE}
            for col in lay.columns:
                row_bytes = col.nbytes // col.shape[0]
                allowed |= _lines_of(col.offset + slot * row_bytes, row_bytes)
            changed = _changed_lines(before, _snapshot(buf))
            assert changed <= allowed, sorted(changed - allowed)
            words = {lay.lane_word(1, L.LANE_COMMITTED) // L.LINE,
                     lay.lane_word(1, L.LANE_RESERVED) // L.LINE, lay.stamp(slot) // L.LINE,
                     (lay.meta.offset + slot * L.WORD) // L.LINE}
            assert words <= changed  # the protocol's four words were all stored


def test_sampling_stores_nothing_in_the_buffer():
    """``sample``, ``sample_into`` and ``get`` only load: a sampler never makes the writer's
    lines (or any other) dirty in its cache."""
    with shmbuf.ReplayBuffer.create(MUJOCO, capacity=64, lanes=2) as buf:
        for lane in (0, 1):
            with buf.writer(lane=lane) as w:
                for i in range(100):
                    w.add(**_row(i))
        before = _snapshot(buf)
        rng = np.random.default_rng(0)
        buf.sample(32, rng)
        out = {n: np.zeros((16, *f.shape), f.dtype) for n, f in MUJOCO.items()}
        buf.sample_into(out, rng)
        buf.get(np.array([90, 99]), np.array([0, 1]))
        assert not _changed_lines(before, _snapshot(buf))


@settings(max_examples=100, deadline=None)
@given(lanes=st.integers(1, 300), capacity=st.integers(1, 5000), json_len=st.integers(0, 9000))
def test_per_batch_stores_never_share_a_line_pair_with_per_add_words(lanes, capacity, json_len):
    """Words stored once per batch by samplers and pools (each sampler's limiter counter, each
    lane's ``LANE_CONSUMED`` in queue mode) and the words every ``add`` stores or loads (each
    lane's ``committed`` and ``reserved``, the limiter's generation) lie in different 128-byte
    pairs of lines, and no two lanes' per-add words share a pair."""
    lay = L.buffer_layout([("x", (3,), np.dtype("f4"))], capacity, lanes, json_len)
    per_batch = {lay.sampler_counter(j) // PAIR for j in range(L.MAX_SAMPLERS)}
    per_batch |= {lay.lane_word(k, L.LANE_CONSUMED) // PAIR for k in range(lanes)}
    per_add_by_lane = [{lay.lane_word(k, L.LANE_COMMITTED) // PAIR,
                        lay.lane_word(k, L.LANE_RESERVED) // PAIR} for k in range(lanes)]
    per_add = set().union(*per_add_by_lane) | {lay.limiter_word(L.LIM_GENERATION) // PAIR}
    assert not per_add & per_batch
    seen: set[int] = set()
    for pairs in per_add_by_lane:
        assert not pairs & seen, "two lanes' writers store to one pair of lines"
        seen |= pairs
