"""What the chaos learner checks in every batch, before it reports the batch to the harness.

Every row of a batch, and for sequences and frame stacks every row of every window or stack,
must be whole (``tests/_helpers/rows.py``: lane, index, payload and check words; ``obs`` frames
that hash their own words) and the row drawn. Episode rules, from the episode ids the actors
write into the frames:

- every step a sequence's ``mask`` keeps, and every frame of a stack that is not padding, has
  the anchor's episode id (never across an episode's end or a writer's death); padding is all
  zeros, and exactly the frames before the episode's first step are padding;
- an n-step return sums the rewards of exactly ``steps`` rows of the anchor's episode (its
  bootstrap observation is of that episode too), and ``discount``, ``terminated`` and
  ``truncated`` agree with the final observation's flags.

Pure functions of a batch (NumPy arrays), no I/O: ``BatchChecker.check`` returns how many rows
are bad and a description of the first few problems.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests._helpers
from chaos_modes import FRAME_STACK, GAMMA, N_STEP, Mode  # noqa: E402

from tests._helpers.rows import (  # noqa: E402
    FRAME_EPISODE,
    FRAME_INDEX,
    FRAME_LANE,
    FRAME_TERMINATED,
    FRAME_TRUNCATED,
    RowScheme,
    bad_frames,
    frame_flags,
    frame_steps,
    step_rewards,
)

MAX_PROBLEMS = 4  # problems described per batch (all are counted)
SCHEME_FIELDS = ("lane", "index", "payload", "check")


@dataclass
class Verdict:
    """A batch's check: which of its ``rows`` failed, and what failed, in words."""

    rows: int
    failed: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.failed = np.zeros(self.rows, bool)

    @property
    def bad(self) -> int:
        """Rows that failed any check."""
        return int(self.failed.sum())

    def fail(self, mask: np.ndarray, what: str, where: Any = None) -> None:
        """Mark the rows ``mask`` selects (bool [B]) as failing ``what``; describe the first."""
        mask = np.asarray(mask, bool)
        if not mask.any():
            return
        self.failed |= mask
        if len(self.problems) < MAX_PROBLEMS:
            b = int(np.flatnonzero(mask)[0])
            at = f" ({where(b)})" if where is not None else ""
            self.problems.append(f"{int(mask.sum())} of {self.rows} rows: {what}; first: row {b}{at}")


class BatchChecker:
    """Checks the batches of one mode's pool (see the module docstring for what)."""

    def __init__(self, mode: Mode, rows: RowScheme) -> None:
        self.mode, self.rows = mode, rows

    def check(self, batch: Any) -> Verdict:
        lanes = np.asarray(batch.lanes, np.int64)
        indices = np.asarray(batch.indices, np.int64)
        data = {k: np.asarray(batch[k]) for k in batch}
        verdict = Verdict(rows=int(lanes.shape[0]))
        if self.mode.shape == "sequences":
            self._sequences(data, lanes, indices, verdict)
        elif self.mode.shape == "stacks":
            self._stacks(data, lanes, indices, verdict)
        else:
            self._rows(data, lanes, indices, verdict)
        if self.mode.prioritized:
            w = np.asarray(batch.weights, np.float64)
            verdict.fail(~(np.isfinite(w) & (w > 0) & (w <= 1 + 1e-5)),
                         "importance weight not in (0, 1]", lambda b: f"weight {w[b]!r}")
        return verdict

    # -- single transitions -----------------------------------------------------------------------
    def _whole(self, data: dict[str, np.ndarray], lanes: np.ndarray, indices: np.ndarray
               ) -> np.ndarray:
        """bool [n]: rows (flattened) that are not whole or not (lanes, indices)."""
        frames = data["obs"]
        bad = self.rows.bad_rows({k: data[k] for k in SCHEME_FIELDS}, lanes, indices)
        bad |= bad_frames(frames)
        bad |= frames[:, FRAME_LANE].astype(np.int64) != lanes + 1
        bad |= frames[:, FRAME_INDEX].astype(np.int64) != indices
        bad |= frame_flags(frames) != 0  # a final observation is never a step's own frame
        bad |= data["reward"] != step_rewards(lanes, indices)
        return bad

    def _rows(self, data: dict[str, np.ndarray], lanes: np.ndarray, indices: np.ndarray,
              v: Verdict) -> None:
        v.fail(self._whole(data, lanes, indices), "torn, stale or foreign row",
               lambda b: _describe(data, b, lanes, indices))

    # -- sequences --------------------------------------------------------------------------------
    def _sequences(self, data: dict[str, np.ndarray], lanes: np.ndarray, indices: np.ndarray,
                   v: Verdict) -> None:
        B, T = indices.shape
        mask = data["mask"].astype(bool)
        anchors = indices[:, 0]
        v.fail((indices != anchors[:, None] + np.arange(T)).any(axis=1),
               "batch.indices of a window are not consecutive")
        v.fail(~mask[:, 0], "a window's first step is masked out")
        v.fail((mask[:, 1:] & ~mask[:, :-1]).any(axis=1), "a window's mask is not a prefix")
        if not self.mode.cross_episodes:
            v.fail(~mask.all(axis=1), "a strict window (cross_episodes=False) has a masked step")
        # kept steps: whole rows of the anchor's episode, consecutive steps
        flat = {k: data[k].reshape(B * T, *data[k].shape[2:]) for k in data if k != "mask"}
        bad = self._whole(flat, np.repeat(lanes, T), indices.reshape(-1)).reshape(B, T)
        v.fail((bad & mask).any(axis=1), "a kept step of a window is torn, stale or foreign",
               lambda b: f"lane {lanes[b]} anchor {anchors[b]}")
        frames = data["obs"]
        episode = frames[:, :, FRAME_EPISODE]
        steps = frame_steps(frames)
        other = (episode != episode[:, :1]) & mask
        v.fail(other.any(axis=1), "a window's kept steps span two episodes (an episode's end or "
               "a writer's death)", lambda b: f"lane {lanes[b]} anchor {anchors[b]}, episodes "
               f"{[hex(int(e)) for e in episode[b]]}, mask {mask[b].astype(int).tolist()}")
        v.fail(((steps != steps[:, :1] + np.arange(T)) & mask).any(axis=1),
               "a window's kept steps are not consecutive steps of one episode")
        self._padding(data, ~mask, v, "a masked-out step of a window is not zeros")
        if "next_obs" not in data:
            return
        nxt = data["next_obs"]
        flags = frame_flags(nxt)
        nbad = bad_frames(nxt) | (nxt[:, :, FRAME_INDEX].astype(np.int64) != indices + 1)
        nbad |= nxt[:, :, FRAME_EPISODE] != episode[:, :1]
        nbad |= frame_steps(nxt) != steps + 1
        v.fail((nbad & mask).any(axis=1), "a kept step's next_obs is not the next frame of its "
               "episode", lambda b: f"lane {lanes[b]} anchor {anchors[b]}")
        ended = (flags != 0) & mask  # the episode ended after this step ...
        v.fail((ended[:, :-1] & mask[:, 1:]).any(axis=1),
               "a window keeps steps after its episode's end")  # ... so nothing after it is kept
        term = data["terminated"].astype(bool)
        trunc = data["truncated"].astype(bool)
        v.fail(((term != ((flags & FRAME_TERMINATED) != 0)) & mask).any(axis=1),
               "terminated disagrees with the final observation")
        v.fail(((trunc != ((flags & FRAME_TRUNCATED) != 0)) & mask).any(axis=1),
               "truncated disagrees with the final observation")

    # -- frame stacks and n-step returns ------------------------------------------------------------
    def _stacks(self, data: dict[str, np.ndarray], lanes: np.ndarray, indices: np.ndarray,
                v: Verdict) -> None:
        k, n = FRAME_STACK, N_STEP
        B = lanes.shape[0]
        bad = self.rows.bad_rows({f: data[f] for f in SCHEME_FIELDS}, lanes, indices)
        v.fail(bad, "torn, stale or foreign row at the anchor",
               lambda b: _describe(data, b, lanes, indices))
        obs, obs_mask = data["obs"], data["obs_mask"].astype(bool)
        anchor = obs[:, -1]
        episode = anchor[:, FRAME_EPISODE]
        step0 = frame_steps(anchor)
        v.fail(~obs_mask[:, -1], "the anchor's own frame is masked out")
        offsets = np.arange(-(k - 1), 1)
        self._stack(obs, obs_mask, lanes, indices[:, None] + offsets, episode,
                    step0[:, None] + offsets, v, "obs")
        m = data["steps"].astype(np.int64)
        v.fail((m < 1) | (m > n), f"steps outside [1, {n}]", lambda b: f"steps {m[b]}")
        m = np.clip(m, 1, n)
        nxt, nxt_mask = data["next_obs"], data["next_obs_mask"].astype(bool)
        offsets = np.arange(-(k - 2), 2)  # around the transition's last step, then one on
        last = (indices + m - 1)[:, None]
        self._stack(nxt[:, :-1], nxt_mask[:, :-1], lanes, last + offsets[:-1], episode,
                    (step0 + m - 1)[:, None] + offsets[:-1], v, "next_obs")
        final = nxt[:, -1]
        flags = frame_flags(final)
        fbad = bad_frames(final) | ~nxt_mask[:, -1]
        fbad |= final[:, FRAME_LANE].astype(np.int64) != lanes + 1
        fbad |= final[:, FRAME_INDEX].astype(np.int64) != indices + m
        fbad |= final[:, FRAME_EPISODE] != episode
        fbad |= frame_steps(final) != step0 + m
        v.fail(fbad, "the bootstrap observation is not the frame `steps` on in the anchor's "
               "episode (an n-step return across an episode's end or a writer's death?)",
               lambda b: f"lane {lanes[b]} anchor {indices[b]} steps {m[b]}")
        # the return sums exactly the rewards of rows t .. t+m-1 (all of the anchor's episode,
        # since its bootstrap frame t+m is)
        weights = GAMMA ** np.arange(n, dtype=np.float64)
        rewards = step_rewards(np.repeat(lanes, n), (indices[:, None] + np.arange(n)).reshape(-1))
        keep = np.arange(n)[None, :] < m[:, None]
        want = (rewards.reshape(B, n).astype(np.float64) * weights * keep).sum(axis=1)
        got = data["reward"].astype(np.float64)
        v.fail(np.abs(got - want) > 1e-6, "the n-step return is not the sum of its episode's "
               "`steps` rewards", lambda b: f"got {got[b]!r}, want {want[b]!r} (steps {m[b]})")
        term = (flags & FRAME_TERMINATED) != 0
        discount = np.where(term, 0.0, GAMMA ** m)
        v.fail(np.abs(data["discount"].astype(np.float64) - discount) > 1e-6,
               "discount disagrees with steps and termination")
        v.fail(data["terminated"].astype(bool) != term,
               "terminated disagrees with the final observation")
        v.fail(data["truncated"].astype(bool) != ((flags & FRAME_TRUNCATED) != 0),
               "truncated disagrees with the final observation")

    def _stack(self, frames: np.ndarray, mask: np.ndarray, lanes: np.ndarray,
               indices: np.ndarray, episode: np.ndarray, steps: np.ndarray, v: Verdict,
               name: str) -> None:
        """Frames [B, W] of a stack: those the mask keeps are whole rows of the anchor's episode
        at ``indices``/``steps``; exactly the frames before the episode's first step are
        padding (zeros)."""
        bad = bad_frames(frames)
        bad |= frames[..., FRAME_LANE].astype(np.int64) != lanes[:, None] + 1
        bad |= frames[..., FRAME_INDEX].astype(np.int64) != indices
        bad |= frame_flags(frames) != 0
        bad |= frame_steps(frames) != steps
        v.fail((bad & mask).any(axis=1), f"a kept frame of {name} is torn, stale or not the "
               f"step it stands for", lambda b: f"lane {lanes[b]} frames at {indices[b].tolist()}")
        other = (frames[..., FRAME_EPISODE] != episode[:, None]) & mask
        v.fail(other.any(axis=1), f"a kept frame of {name} is of another episode (a stack across "
               f"an episode's end or a writer's death)",
               lambda b: f"lane {lanes[b]} frames at {indices[b].tolist()}")
        v.fail((mask != (steps >= 0)).any(axis=1), f"{name}'s padding is not exactly the frames "
               f"before the episode's first step", lambda b: f"steps {steps[b].tolist()}, mask "
               f"{mask[b].astype(int).tolist()}")
        v.fail(_pad_not_zero(frames, mask), f"a padded frame of {name} is not zeros")

    def _padding(self, data: dict[str, np.ndarray], pad: np.ndarray, v: Verdict, what: str
                 ) -> None:
        """Every field of the ``pad`` [B, T] steps is zeros."""
        bad = np.zeros(pad.shape[0], bool)
        for name, arr in data.items():
            if name == "mask":
                continue
            nonzero = (arr.reshape(*pad.shape, -1) != 0).any(axis=-1)
            bad |= (nonzero & pad).any(axis=1)
        v.fail(bad, what)


def _pad_not_zero(frames: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """bool [B]: a frame the mask pads out holds something other than zeros."""
    nonzero = (frames.reshape(*mask.shape, -1) != 0).any(axis=-1)
    return (nonzero & ~mask).any(axis=1)


def _describe(data: dict[str, np.ndarray], b: int, lanes: np.ndarray, indices: np.ndarray) -> str:
    return (f"holds lane={int(data['lane'][b])} index={int(data['index'][b])}, drawn as "
            f"lane={int(lanes[b])} index={int(indices[b])}")
