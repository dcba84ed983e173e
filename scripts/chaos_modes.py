"""The sampling modes the chaos harness runs (``scripts/stress.py --chaos --mode``): for each, how
the buffer is made, how the learner opens its ``SamplerPool``, and what the harness must count
across batches (exactly once for the queue, once per epoch, at most k times).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests._helpers
from shmbuf.sampling import Plan  # noqa: E402
from tests._helpers.rows import FRAME_WORDS, RowScheme  # noqa: E402
from workers.selection import Counted, Epoch, Prioritized, Queue, Uniform  # noqa: E402

SEQUENCE_LENGTH = 8
FRAME_STACK = 4
N_STEP = 3
GAMMA = 0.5  # with step_rewards' quarter units, n-step returns are exact in float32
MAX_TIMES = 2

# What the harness counts per delivered row (``Mode.ledger``).
LEDGER_NONE, LEDGER_QUEUE, LEDGER_EPOCH, LEDGER_MAX_TIMES = "", "queue", "epoch", "max_times"


@dataclass(frozen=True)
class Mode:
    """One mode: the buffer (``derived``: ``next_obs="derived"``), the pool's keyword arguments
    (``selection`` and ``plan``), the batch shape the checks expect (``shape``: "rows",
    "sequences" or "stacks"), and the ledger the harness keeps of the rows delivered."""

    name: str
    pool: dict[str, Any] = field(default_factory=dict)
    derived: bool = False
    shape: str = "rows"
    ledger: str = LEDGER_NONE

    @property
    def prioritized(self) -> bool:
        return isinstance(self.pool.get("selection"), Prioritized)

    @property
    def cross_episodes(self) -> bool:
        plan = self.pool.get("plan")
        return plan is not None and plan.cross_episodes


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("uniform", {"selection": Uniform()}),
    Mode("prioritized", {"selection": Prioritized()}),
    Mode("queue", {"selection": Queue()}, ledger=LEDGER_QUEUE),
    # windows that may run past an episode's end, masked (uniform draws) ...
    Mode("sequences", {"selection": Uniform(),
                       "plan": Plan(sequence_length=SEQUENCE_LENGTH, cross_episodes=True)},
         derived=True, shape="sequences"),
    # ... and strict ones (R2D2): never across an episode's end
    Mode("prioritized-sequences", {"selection": Prioritized(),
                                   "plan": Plan(sequence_length=SEQUENCE_LENGTH)},
         derived=True, shape="sequences"),
    Mode("framestack-nstep", {"selection": Uniform(),
                              "plan": Plan(frame_stack=FRAME_STACK, n_step=N_STEP, gamma=GAMMA)},
         derived=True, shape="stacks"),
    Mode("epoch", {"selection": Epoch(drop_last=False)}, ledger=LEDGER_EPOCH),
    Mode("max-times", {"selection": Counted(MAX_TIMES)}, ledger=LEDGER_MAX_TIMES),
)}


def row_scheme(payload: int) -> RowScheme:
    """The self-checking part of every row: lane, index, ``payload`` bytes and a check word."""
    return RowScheme(payload_words=payload, payload_dtype="uint8", lane_dtype="int32")


def spec_fields(payload: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The buffer's fields: the row scheme's, plus ``obs`` frames that name their episode
    (``tests/_helpers/rows.episode_frames``) and what n-step returns read."""
    return {**row_scheme(payload).fields, "obs": ((FRAME_WORDS,), "uint64"),
            "reward": ((), "float32"), "terminated": ((), "bool"), "truncated": ((), "bool")}
