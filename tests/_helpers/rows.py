"""The one self-checking row scheme: every field of a row is a pure function of its (lane,
index), so whoever reads a row can tell a whole one from a torn, stale or misplaced one.

Used by ``tests/pool_procs.py``, ``tests/storage_procs.py`` and ``scripts/stress.py``; each picks
a shape (payload width and dtype, an ``obs`` block, a ``mirror`` column) to suit what it races.
``episode_frames`` adds frames that also name their episode (the chaos harness's windows, frame
stacks and n-step returns, ``scripts/chaos_*.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# key(lane, i) = i*KEY_INDEX + (lane+1)*KEY_LANE mod 2**64: a bijection of i for every lane
# (KEY_INDEX is odd), and affine in i, so a batch can be shifted along the index with one add.
KEY_INDEX = 0x9E3779B97F4A7C15
KEY_LANE = 0xD6E8FEB86659FD93
WORD_STEP = 0xBF58476D1CE4E5B9  # payload word k: key + k*WORD_STEP (in a narrower dtype's bits)
CHECK_MUL = 0xC2B2AE3D27D4EB4F  # check = key * CHECK_MUL (odd: still a bijection of the key)
_MASK = (1 << 64) - 1


def row_keys(lanes: Any, indices: Any) -> np.ndarray:
    """The uint64 key of each (lane, index) pair; every field is derived from it."""
    idx = np.atleast_1d(np.asarray(indices, dtype=np.int64)).astype(np.uint64)
    ln = np.broadcast_to(np.asarray(lanes, dtype=np.int64), idx.shape).astype(np.uint64)
    return idx * np.uint64(KEY_INDEX) + (ln + np.uint64(1)) * np.uint64(KEY_LANE)


@dataclass(frozen=True)
class RowScheme:
    """A shape of self-checking row. Fields, in layout order (``fields`` gives them as a Spec
    mapping: ``shmbuf.Spec(scheme.fields)``):

    - ``lane`` (``lane_dtype``) and ``index`` (int64): which row this is;
    - ``obs`` (float32 ``obs_shape``, only if given): small exact integers, so a transform that
      negates or copies them stays checkable;
    - ``payload`` (``payload_words`` of ``payload_dtype``): word k is ``top(key) +
      top(k*WORD_STEP)``, wrapping, where ``top`` keeps the bits the dtype holds (all 64 for
      uint64: then the payload is affine in the key);
    - ``mirror`` (only if ``mirror``): ``~payload``, a second wide column to tear across;
    - ``check`` (uint64): ``key * CHECK_MUL``.

    Example::

        rows = RowScheme(payload_words=8, payload_dtype="uint32", obs_shape=(2, 3))
        buf = shmbuf.ReplayBuffer.create(shmbuf.Spec(rows.fields), capacity=64)
        with buf.writer() as w:
            w.extend(rows.batch(0, range(64)))
        assert not rows.bad_rows(buf.get(range(64))).any()
    """

    payload_words: int = 8
    payload_dtype: str = "uint64"
    obs_shape: tuple[int, ...] | None = None
    mirror: bool = False
    lane_dtype: str = "int64"

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Field name -> (shape, dtype), in layout order."""
        out: dict[str, tuple[tuple[int, ...], str]] = {"lane": ((), self.lane_dtype),
                                                       "index": ((), "int64")}
        if self.obs_shape is not None:
            out["obs"] = (tuple(self.obs_shape), "float32")
        out["payload"] = ((self.payload_words,), self.payload_dtype)
        if self.mirror:
            out["mirror"] = ((self.payload_words,), self.payload_dtype)
        out["check"] = ((), "uint64")
        return out

    def payload(self, lanes: Any, indices: Any) -> np.ndarray:
        """The payload rows ``[n, payload_words]`` that (lane, index) pairs must hold."""
        dtype = np.dtype(self.payload_dtype)
        top = np.uint64(64 - 8 * dtype.itemsize)
        per_row = (row_keys(lanes, indices) >> top).astype(dtype)
        per_word = ((np.arange(self.payload_words, dtype=np.uint64) * np.uint64(WORD_STEP))
                    >> top).astype(dtype)
        return per_row[:, None] + per_word[None, :]  # wraps around in ``dtype``

    def obs(self, lanes: Any, indices: Any) -> np.ndarray:
        """The float32 observations ``[n, *obs_shape]`` of (lane, index) pairs."""
        assert self.obs_shape is not None, "this scheme has no obs field"
        size = int(np.prod(self.obs_shape))
        top = (row_keys(lanes, indices) >> np.uint64(48)).astype(np.int64)  # < 2**16: exact
        return (top[:, None] + np.arange(size)).astype(np.float32).reshape(-1, *self.obs_shape)

    def check(self, lanes: Any, indices: Any) -> np.ndarray:
        """The uint64 check word of (lane, index) pairs."""
        return row_keys(lanes, indices) * np.uint64(CHECK_MUL)

    def batch(self, lane: int, indices: Any) -> dict[str, np.ndarray]:
        """Self-checking rows for logical ``indices`` of ``lane`` (for ``Writer.extend``)."""
        idx = np.atleast_1d(np.asarray(indices, dtype=np.int64))
        out = {"lane": np.full(idx.shape, lane, self.lane_dtype), "index": idx.copy()}
        if self.obs_shape is not None:
            out["obs"] = self.obs(lane, idx)
        out["payload"] = self.payload(lane, idx)
        if self.mirror:
            out["mirror"] = ~out["payload"]
        out["check"] = self.check(lane, idx)
        return out

    def row(self, lane: int, index: int) -> dict[str, Any]:
        """One self-checking transition (for ``Writer.add``)."""
        return {k: v[0] for k, v in self.batch(lane, [index]).items()}

    def bad_rows(self, rows: Mapping[str, Any], lanes: Any = None,
                 indices: Any = None) -> np.ndarray:
        """Mask of the rows that are not whole, or (when given) not the (lane, index) drawn.

        ``rows`` maps field -> array (a dict, a ``Batch``, torch tensors): ``lane`` and
        ``index`` must be there; each other field of the scheme is checked where present.
        """
        fields = self.fields
        r = {k: np.asarray(rows[k]) for k in rows if k in fields}
        lane, index = r["lane"], r["index"]
        bad = np.zeros(lane.shape, bool)
        if "payload" in r:
            bad |= (r["payload"] != self.payload(lane, index)).any(axis=1)
        if "mirror" in r:
            bad |= (r["mirror"] != ~self.payload(lane, index)).any(axis=1)
        if "obs" in r:
            bad |= (r["obs"] != self.obs(lane, index)).reshape(len(lane), -1).any(axis=1)
        if "check" in r:
            bad |= r["check"] != self.check(lane, index)
        if lanes is not None:
            bad |= lane != np.asarray(lanes)
        if indices is not None:
            bad |= index != np.asarray(indices)
        return bad


def describe_row(rows: Mapping[str, Any], b: int, lanes: Any = None, indices: Any = None) -> str:
    """What row ``b`` of ``rows`` holds, and (when given) what was drawn there."""
    got = f"row {b} holds lane={int(np.asarray(rows['lane'])[b])} " \
          f"index={int(np.asarray(rows['index'])[b])}"
    if lanes is not None and indices is not None:
        got += f", drawn as lane={int(np.asarray(lanes)[b])} index={int(np.asarray(indices)[b])}"
    return got


class ShiftedBatches:
    """Makes ``scheme.batch(lane, range(i0, i0 + n))`` into reused arrays, cheaply: with uint64
    payloads and no ``obs`` every field is affine in the key, so a batch is a precomputed one
    shifted by ``i0``. Only the last ``keep`` rows are filled (``extend`` drops the rows before
    the last ``capacity``)."""

    def __init__(self, scheme: RowScheme, lane: int, max_rows: int) -> None:
        assert scheme.payload_dtype == "uint64" and scheme.obs_shape is None, scheme
        self.scheme = scheme
        self._base = scheme.batch(lane, np.arange(max_rows))
        self._out = {k: v.copy() for k, v in self._base.items()}

    def make(self, i0: int, n: int, keep: int | None = None) -> dict[str, np.ndarray]:
        lo = 0 if keep is None else max(0, n - keep)
        shift = (i0 * KEY_INDEX) & _MASK  # key(lane, i0 + j) - key(lane, j)
        base, out = self._base, self._out
        np.add(base["index"][lo:n], i0, out=out["index"][lo:n])
        np.add(base["payload"][lo:n], np.uint64(shift), out=out["payload"][lo:n])
        if "mirror" in out:
            np.invert(out["payload"][lo:n], out=out["mirror"][lo:n])
        np.add(base["check"][lo:n], np.uint64((shift * CHECK_MUL) & _MASK),
               out=out["check"][lo:n])
        return {k: v[:n] for k, v in out.items()}


# -- frames that name their episode ----------------------------------------------------------------
# An ``obs`` column of FRAME_WORDS uint64 words per row, for races where a row must say which
# episode it belongs to (windows, frame stacks, n-step returns): its episode id is written by
# the actor (a random 63-bit number per episode and writer incarnation), so two episodes, or
# the two sides of a writer's death, can never look alike. The words of one frame:
#
# - FRAME_LANE: lane + 1 (never 0: an all-zero frame is padding, never a row);
# - FRAME_INDEX: the row's logical index in its lane;
# - FRAME_EPISODE: the episode id;
# - FRAME_STEP: step << 8 | flags (the step in the episode; FRAME_TERMINATED / FRAME_TRUNCATED
#   only in the observation after an episode's last step, the true final observation);
# - FRAME_CHECK: a hash of the other four, so a torn or half-padded frame shows.
FRAME_WORDS = 5
FRAME_LANE, FRAME_INDEX, FRAME_EPISODE, FRAME_STEP, FRAME_CHECK = range(FRAME_WORDS)
FRAME_TERMINATED, FRAME_TRUNCATED = 1, 2  # flags of a final observation
EPISODE_MUL = 0x94D049BB133111EB  # odd multipliers of the check's terms
STEP_MUL = 0xFF51AFD7ED558CCD
FRAME_SALT = 0x2545F4914F6CDD1D  # so that the check of an all-zero frame is not zero


def frame_check(lanes: Any, indices: Any, episodes: Any, step_words: Any) -> np.ndarray:
    """The FRAME_CHECK word of frames with these (lane, index, episode, step << 8 | flags)."""
    key = row_keys(lanes, indices) * np.uint64(CHECK_MUL)
    episode = np.asarray(episodes, np.uint64) * np.uint64(EPISODE_MUL)
    step = np.asarray(step_words, np.uint64) * np.uint64(STEP_MUL)
    return key ^ episode ^ step ^ np.uint64(FRAME_SALT)


def episode_frames(lane: int, indices: Any, episode: int, steps: Any, flags: Any = 0
                   ) -> np.ndarray:
    """Frames ``[n, FRAME_WORDS]`` (uint64) of rows ``indices`` of ``lane``, steps ``steps`` of
    episode ``episode``; ``flags`` only for final observations."""
    idx = np.atleast_1d(np.asarray(indices, np.int64))
    step_words = (np.broadcast_to(np.asarray(steps, np.uint64), idx.shape) << np.uint64(8)) \
        | np.asarray(flags, np.uint64)
    out = np.empty((idx.size, FRAME_WORDS), np.uint64)
    out[:, FRAME_LANE] = lane + 1
    out[:, FRAME_INDEX] = idx.astype(np.uint64)
    out[:, FRAME_EPISODE] = episode
    out[:, FRAME_STEP] = step_words
    out[:, FRAME_CHECK] = frame_check(lane, idx, episode, step_words)
    return out


def bad_frames(frames: Any) -> np.ndarray:
    """Mask (the shape of ``frames`` without its last axis) of frames whose check word does not
    match their other words: torn, foreign or padding (zeros)."""
    f = np.asarray(frames, np.uint64)
    lanes = f[..., FRAME_LANE].astype(np.int64) - 1
    want = frame_check(lanes.reshape(-1), f[..., FRAME_INDEX].astype(np.int64).reshape(-1),
                       f[..., FRAME_EPISODE].reshape(-1), f[..., FRAME_STEP].reshape(-1))
    return want.reshape(f.shape[:-1]) != f[..., FRAME_CHECK]


def frame_steps(frames: Any) -> np.ndarray:
    """The step in its episode of each frame (int64)."""
    return (np.asarray(frames, np.uint64)[..., FRAME_STEP] >> np.uint64(8)).astype(np.int64)


def frame_flags(frames: Any) -> np.ndarray:
    """The flags of each frame (FRAME_TERMINATED, FRAME_TRUNCATED; 0 for a step's own frame)."""
    return (np.asarray(frames, np.uint64)[..., FRAME_STEP] & np.uint64(0xFF)).astype(np.int64)


def step_rewards(lanes: Any, indices: Any) -> np.ndarray:
    """The float32 reward of rows (lane, index): a multiple of 1/4 in [0, 4), so sums of a few
    of them weighted by powers of 1/2 (n-step returns with gamma = 0.5) are exact."""
    return ((row_keys(lanes, indices) >> np.uint64(60)).astype(np.float32) / np.float32(4.0))
