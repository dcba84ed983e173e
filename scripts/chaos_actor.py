"""The chaos harness's actor: episodes of random length, ended at random (terminated or
truncated), written with ``add`` and ``extend`` in self-checking rows whose ``obs`` frames name
their episode. A process killed mid-episode leaves it open; the next incarnation starts another.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests._helpers
from tests._helpers.rows import (  # noqa: E402
    FRAME_TERMINATED,
    FRAME_TRUNCATED,
    RowScheme,
    episode_frames,
    step_rewards,
)


def new_episode_id() -> int:
    """A random 63-bit id: unique to one episode of one writer incarnation (w.h.p.)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def episode_rows(rows: RowScheme, lane: int, i0: int, n: int, episode: int, step0: int,
                 length: int, truncated: bool, derived: bool) -> dict[str, np.ndarray]:
    """Rows ``i0 .. i0+n-1`` of ``lane``: steps ``step0 ..`` of an episode of ``length`` steps.

    Its last step is ``terminated`` unless ``truncated``; with ``derived`` next_obs, each row's
    ``next_obs`` is the frame of the next row, and the last step's is the true final
    observation (flagged), which ``end_episode`` stores as the episode's FINAL row.
    """
    idx = np.arange(i0, i0 + n, dtype=np.int64)
    steps = np.arange(step0, step0 + n, dtype=np.int64)
    last = steps == length - 1
    out: dict[str, Any] = rows.batch(lane, idx)
    out["obs"] = episode_frames(lane, idx, episode, steps)
    out["reward"] = step_rewards(lane, idx)
    out["terminated"] = last & (not truncated)
    out["truncated"] = last & truncated
    if derived:
        flag = FRAME_TRUNCATED if truncated else FRAME_TERMINATED
        out["next_obs"] = episode_frames(lane, idx + 1, episode, steps + 1, np.where(last, flag, 0))
    return out


def episode_length(rng: np.random.Generator, longest: int) -> int:
    """Short episodes half the time (frame stacks and windows meet their edges), else long."""
    top = max(1, longest // 8) if rng.random() < 0.5 else longest
    return int(rng.integers(1, top + 1))


class ActorErrors:
    """The file actors append their tracebacks to (``chaos_actor``), and the harness's reader of
    it: ``ActorGroup`` restarts an actor that raised as it restarts a killed one, so this is how
    the harness tells them apart. Each record is one ``write`` ending in a NUL byte."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="shmbuf-chaos-")
        self.path = os.path.join(self._dir, "actor-errors")
        self._seen = 0  # bytes read so far

    def new(self) -> list[str]:
        """The tracebacks written since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._seen)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\0") + 1  # whole records only
        self._seen += end
        return data[:end].decode("utf-8", "replace").split("\0")[:-1]

    def cleanup(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def chaos_actor(ctx: Any, rows: RowScheme, derived: bool, max_extend: int,
                longest_episode: int, errors: str) -> None:
    """``ActorGroup``'s function: episodes until ``ctx.stopping``, in adds and extends.

    An exception's traceback is appended to the file ``errors`` (``ActorErrors``) before it
    propagates."""
    try:
        write_episodes(ctx, rows, derived, max_extend, longest_episode)
    except BaseException:
        if not ctx.stopping:
            text = f"actor {ctx.actor_id} (pid {os.getpid()}, lane {ctx.lane}, incarnation " \
                   f"{ctx.incarnation}):\n{traceback.format_exc()}\0"
            fd = os.open(errors, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
        raise


def write_episodes(ctx: Any, rows: RowScheme, derived: bool, max_extend: int,
                   longest_episode: int) -> None:
    w, rng = ctx.writer, ctx.rng
    while not ctx.stopping:
        episode, length = new_episode_id(), episode_length(rng, longest_episode)
        truncated = bool(rng.random() < 0.5)
        step = 0
        while step < length and not ctx.stopping:
            n = 1 if rng.random() < 0.2 else int(rng.integers(1, min(max_extend, length - step) + 1))
            data = episode_rows(rows, ctx.lane, w.committed, n, episode, step, length, truncated,
                                derived)
            if n == 1:
                w.add(**{k: v[0] for k, v in data.items()})
            else:
                w.extend(data)
            step += n
        if step == length:
            w.end_episode(truncated=truncated)
