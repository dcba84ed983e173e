"""A plain-Python model of what episode-aware sampling must return, built only from the episodes a
test generated (never from shmbuf's index math), plus the code that writes those episodes.

Every transition names itself: ``obs = [lane+1, episode+1, step+1]`` (never all zero, so padding
shows), ``action`` is a tag encoding (lane, episode, step), the reward is a function of the three.
A delivered row therefore says where it came from, and the model says what must be there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import shmbuf

TERMINATED, TRUNCATED, OPEN, ABANDONED = "terminated", "truncated", "open", "abandoned"
OBS_DIM = 3


@dataclass(frozen=True)
class Episode:
    """One episode as written: ``length`` transitions, then how it ended.

    TERMINATED / TRUNCATED: ``end_episode(truncated=...)`` was called (in derived-next_obs
    buffers that writes one FINAL row). OPEN: still running (the lane's last episode);
    ``last_terminated`` says its newest step already carries ``terminated=True`` although
    ``end_episode`` has not been called yet. ABANDONED: the writer was closed mid-episode and a
    new writer took the lane (no ``end_episode``, no FINAL row, no record).
    """

    length: int
    end: str
    last_terminated: bool = False

    @property
    def ended(self) -> bool:
        return self.end in (TERMINATED, TRUNCATED)

    def terminated_at(self, step: int) -> bool:
        last = step == self.length - 1
        return last and (self.end == TERMINATED or (self.end == OPEN and self.last_terminated))

    def truncated_at(self, step: int) -> bool:
        return step == self.length - 1 and self.end == TRUNCATED


# -- what each transition holds -------------------------------------------------------------------
def obs_value(lane: int, episode: int, step: int) -> np.ndarray:
    """Observation ``step`` of an episode (``step == length`` is its final observation)."""
    return np.array([lane + 1, episode + 1, step + 1], np.float32)


def tag(lane: int, episode: int, step: int) -> int:
    """(lane, episode, step) in one int64: lane << 48 | episode << 16 | step."""
    return (lane << 48) | (episode << 16) | step


def untag(value: int) -> tuple[int, int, int]:
    value = int(value)
    return value >> 48, (value >> 16) & 0xFFFFFFFF, value & 0xFFFF


def reward_value(lane: int, episode: int, step: int) -> float:
    return 0.25 * (1 + (3 * lane + 5 * episode + 7 * step) % 9)  # exact in float32


def make_spec(derived: bool) -> shmbuf.Spec:
    fields: dict[str, Any] = {
        "obs": ((OBS_DIM,), "float32"),
        "action": ((), "int64"),
        "reward": ((), "float32"),
        "terminated": ((), "bool"),
        "truncated": ((), "bool"),
    }
    if not derived:
        fields["next_obs"] = ((OBS_DIM,), "float32")
    return shmbuf.Spec(fields)


def transition(lane: int, episode: int, ep: Episode, step: int) -> dict[str, Any]:
    """The row ``add`` is given for ``step`` (derived buffers take ``next_obs`` too)."""
    return {
        "obs": obs_value(lane, episode, step),
        "action": tag(lane, episode, step),
        "reward": np.float32(reward_value(lane, episode, step)),
        "terminated": ep.terminated_at(step),
        "truncated": ep.truncated_at(step),
        "next_obs": obs_value(lane, episode, step + 1),
    }


def episode_rows(lane: int, episode: int, ep: Episode) -> dict[str, np.ndarray]:
    rows = [transition(lane, episode, ep, s) for s in range(ep.length)]
    return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}


# -- writing -------------------------------------------------------------------------------------
def write_lane(buf: shmbuf.ReplayBuffer, lane: int, episodes: Sequence[Episode],
               use_extend: bool = False,
               episode_data: Callable[[int, int], dict[str, Any]] | None = None) -> None:
    """Write ``episodes`` to ``lane`` with one ``Writer`` (a new one after an ABANDONED episode);
    ``episode_data(lane, episode)`` gives what ``end_episode`` stores.

    Also checks the episode-id rule: a lane's episodes are numbered 0, 1, 2, ... in order,
    abandoned ones included."""
    w = buf.writer(lane=lane)
    try:
        for e, ep in enumerate(episodes):
            assert w.episode == e, (lane, e, w.episode)
            if use_extend:
                w.extend(episode_rows(lane, e, ep))
            else:
                for s in range(ep.length):
                    w.add(**transition(lane, e, ep, s))
            if ep.ended:
                data = episode_data(lane, e) if episode_data else {}
                assert w.end_episode(truncated=ep.end == TRUNCATED, **data) == e
            elif ep.end == ABANDONED:
                w.close()
                w = buf.writer(lane=lane)
            else:
                assert ep.end == OPEN and e == len(episodes) - 1, "only the last episode is open"
    finally:
        w.close()


def write_vector(buf: shmbuf.ReplayBuffer, per_env: Sequence[Sequence[Episode]]) -> None:
    """Write with one ``VectorWriter`` over every lane: env k -> lane k, all envs stepping
    together (each env's episodes add up to the same number of steps)."""
    n = len(per_env)
    schedule = [[(e, ep, s) for e, ep in enumerate(eps) for s in range(ep.length)]
                for eps in per_env]
    steps = {len(s) for s in schedule}
    assert len(steps) == 1, "every env must take the same number of steps"
    with buf.writer(num_envs=n) as vw:
        assert vw.lanes.tolist() == list(range(n))
        for t in range(steps.pop()):
            now = [schedule[k][t] for k in range(n)]
            rows = [transition(k, e, ep, s) for k, (e, ep, s) in enumerate(now)]
            index = vw.add(**{f: np.stack([np.asarray(r[f]) for r in rows]) for f in rows[0]})
            assert index.shape == (n,)
            done = np.array([ep.ended and s == ep.length - 1 for e, ep, s in now])
            trunc = np.array([ep.end == TRUNCATED for e, ep, s in now])
            ended = vw.end_episode(done, truncated=trunc)
            assert ended.tolist() == [e if d else -1 for (e, _, _), d in zip(now, done)]


def write(buf: shmbuf.ReplayBuffer, episodes: Sequence[Sequence[Episode]], vector: bool = False,
          extend: Sequence[bool] = (),
          episode_data: Callable[[int, int], dict[str, Any]] | None = None) -> None:
    if vector:
        write_vector(buf, episodes)
        return
    for lane, eps in enumerate(episodes):
        write_lane(buf, lane, eps, use_extend=bool(extend[lane]) if extend else False,
                   episode_data=episode_data)


# -- the model ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    episode: int
    step: int
    final: bool  # derived buffers: the row after an ended episode's last step


class LaneModel:
    """Logical rows of one lane and its readable window ``[lo, hi)``."""

    def __init__(self, episodes: Sequence[Episode], derived: bool, capacity: int) -> None:
        self.episodes = list(episodes)
        self.rows: list[Row] = []
        for e, ep in enumerate(self.episodes):
            self.rows += [Row(e, s, False) for s in range(ep.length)]
            if derived and ep.ended:
                self.rows.append(Row(e, ep.length, True))
        self.hi = len(self.rows)
        self.lo = max(0, self.hi - capacity)


class Model:
    """What every plan must return for an anchor ``(lane, logical index)``, or that the anchor is
    not drawable (``None``).

    Semantics (from the issue and ``Plan``'s docstring, restated on episodes, not on rows):

    - an anchor is a readable transition (never a FINAL row, an overwritten or unwritten index);
    - its next observation is known in stored buffers always, in derived ones if a later step of
      the episode is written or the episode was ended (its FINAL row holds the true final obs);
    - sequences: steps t..t+T-1 of the anchor's episode (strict: all must be usable; crossing:
      the mask is the usable prefix, the rest zero);
    - frame stacks: look-back frames inside the episode are required (an overwritten one makes
      the anchor undrawable), before the episode start they are masked and zero; look-ahead
      frames are the episode's later *steps* that are written, nothing past its last step;
    - n-step: m = steps up to n, stopping at the episode's last written step (where termination
      happens) and, in derived buffers, before a step whose next observation is not known yet.
    """

    def __init__(self, episodes: Sequence[Sequence[Episode]], derived: bool, capacity: int) -> None:
        self.derived = derived
        self.lanes = [LaneModel(eps, derived, capacity) for eps in episodes]

    # -- primitives ---------------------------------------------------------------------------
    def candidates(self) -> list[tuple[int, int]]:
        """Every (lane, index) in a lane's window."""
        return [(k, i) for k, lm in enumerate(self.lanes) for i in range(lm.lo, lm.hi)]

    def window_total(self) -> int:
        return sum(lm.hi - lm.lo for lm in self.lanes)

    def transition_at(self, lane: int, index: int) -> tuple[int, int] | None:
        """(episode, step) of the readable transition at ``index``, else None."""
        lm = self.lanes[lane]
        if not lm.lo <= index < lm.hi:
            return None
        row = lm.rows[index]
        return None if row.final else (row.episode, row.step)

    def next_known(self, lane: int, episode: int, step: int) -> bool:
        ep = self.lanes[lane].episodes[episode]
        return (not self.derived) or step + 1 < ep.length or ep.ended

    def value(self, name: str, lane: int, episode: int, step: int) -> np.ndarray:
        ep = self.lanes[lane].episodes[episode]
        return np.asarray(transition(lane, episode, ep, step)[name])

    # -- plans ----------------------------------------------------------------------------------
    def expected(self, lane: int, index: int, outputs: Mapping[str, tuple[Any, np.dtype]],
                 plan: Any, want_next: bool) -> dict[str, np.ndarray] | None:
        """What ``plan`` (a ``shmbuf.sampling.plan.Plan``) delivers for this anchor, as
        ``outputs`` (name -> (shape, dtype)) names it; None if it is not drawable."""
        if plan.sequence_length > 1:
            return self._sequence(lane, index, outputs, plan, want_next)
        return self._step(lane, index, outputs, plan, want_next)

    def _sequence(self, lane, index, outputs, plan, want_next):
        first = self.transition_at(lane, index)
        if first is None:
            return None
        e, s0 = first
        valid = []
        for j in range(plan.sequence_length):
            tr = self.transition_at(lane, index + j)
            ok = tr is not None and tr[0] == e
            if ok and want_next:
                ok = self.next_known(lane, e, tr[1])
            valid.append(ok)
        if plan.cross_episodes:
            mask = np.logical_and.accumulate(valid)
        else:
            if not all(valid):
                return None
            mask = np.ones(len(valid), bool)
        if not mask[0]:
            return None
        out: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in outputs.items():
            if name == "mask":
                out[name] = mask
                continue
            arr = np.zeros(shape, dtype)
            for j in np.flatnonzero(mask):
                if name == "next_obs":
                    arr[j] = obs_value(lane, e, s0 + j + 1)
                else:
                    arr[j] = self.value(name, lane, e, s0 + j)
            out[name] = arr
        return out

    def _step(self, lane, index, outputs, plan, want_next):
        first = self.transition_at(lane, index)
        if first is None:
            return None
        e, s = first
        ep = self.lanes[lane].episodes[e]
        L = ep.length  # every step of the episode is written
        # n-step extent (m = 1 for one-step plans)
        if plan.n_step > 1:
            m = min(plan.n_step, L - s)
            if not self.next_known(lane, e, s + m - 1):
                m -= 1
        else:
            m = 1 if (not want_next or self.next_known(lane, e, s)) else 0
        if m == 0:
            return None
        k, la = plan.frame_stack, plan.frame_lookahead
        stacks = k > 1 or la > 0
        if stacks:  # look-back frames inside the episode must still be held
            lo = self.lanes[lane].lo
            for o in range(-(k - 1), 1):
                if s + o >= 0 and index + o < lo:
                    return None
        last = s + m - 1
        out: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in outputs.items():
            if name.endswith("_mask"):
                continue
            if stacks and name in plan.stack_fields:
                offsets = range(-(k - 1), la + 1)
                mask = np.array([(s + o >= 0) if o <= 0 else (s + o < L) for o in offsets])
                arr = np.zeros(shape, dtype)
                for w, o in enumerate(offsets):
                    if mask[w]:
                        arr[w] = self.value(name, lane, e, s + o)
                out[name], out[f"{name}_mask"] = arr, mask
            elif name == "next_obs" and stacks and plan.obs_field in plan.stack_fields:
                # the obs stack of the step after the transition's last step (look-back only)
                positions = [s + m + o for o in range(-(k - 1), 1)]
                mask = np.array([p >= 0 for p in positions])
                arr = np.zeros(shape, dtype)
                for w, p in enumerate(positions):
                    if mask[w]:
                        arr[w] = obs_value(lane, e, p)
                out[name], out[f"{name}_mask"] = arr, mask
            elif name == "next_obs":
                out[name] = obs_value(lane, e, s + m)
            elif name == "reward" and plan.n_step > 1:
                out[name] = np.asarray(
                    sum(plan.gamma ** j * reward_value(lane, e, s + j) for j in range(m)), dtype)
            elif name in ("terminated", "truncated"):
                out[name] = self.value(name, lane, e, last)
            elif name == "discount":
                out[name] = np.asarray(0.0 if ep.terminated_at(last) else plan.gamma ** m, dtype)
            elif name == "steps":
                out[name] = np.asarray(m, dtype)
            else:
                out[name] = self.value(name, lane, e, s).astype(dtype)
        return out

    def drawable(self, compiled: Any) -> dict[tuple[int, int], dict[str, np.ndarray]]:
        """(lane, anchor) -> expected arrays, for every anchor the plan may deliver."""
        outputs = {n: (s, np.dtype(d)) for n, s, d in compiled.outputs}
        want_next = "next_obs" in outputs
        out = {}
        for lane, index in self.candidates():
            exp = self.expected(lane, index, outputs, compiled.plan, want_next)
            if exp is not None:
                out[(lane, index)] = exp
        return out
