"""``len(buf)``, ``size()`` and ``stats()["size"]`` count transitions, never internal rows: with
``next_obs="derived"`` each episode's final-observation row is left out (issue 12, item 10).
"""

from __future__ import annotations

import numpy as np
import pytest

import shmbuf


@pytest.mark.parametrize("next_obs", ["stored", "derived"])
def test_thirty_transitions_in_three_episodes_count_thirty(next_obs):
    fields = {"obs": ((2,), "float32"), "reward": ((), "float32")}
    if next_obs == "stored":
        fields["next_obs"] = ((2,), "float32")
    with shmbuf.ReplayBuffer.create(fields, capacity=100, lanes=2, next_obs=next_obs) as buf:
        with buf.writer(lane=0) as w:
            for _ in range(3):
                for t in range(10):
                    o = np.full(2, t, np.float32)
                    w.add(obs=o, next_obs=o + 1, reward=1.0)
                w.end_episode()
            assert len(buf) == buf.size() == buf.stats()["size"] == 30
            w.add(obs=np.zeros(2, np.float32), next_obs=np.ones(2, np.float32), reward=0.0)
            assert len(buf) == 31  # an open episode's steps count
        rows = buf.stats()["rows"]
        assert rows == (34 if next_obs == "derived" else 31)
        buf.clear()
        assert len(buf) == 0


def test_derived_count_after_the_ring_wraps():
    """Overwritten rows (FINAL ones included) leave the count; held FINAL rows never enter it."""
    with shmbuf.ReplayBuffer.create({"obs": ((1,), "int64")}, capacity=16,
                                    next_obs="derived") as buf:
        with buf.writer() as w:
            for e in range(7):
                for t in range(4):
                    w.add(obs=[10 * e + t], next_obs=[10 * e + t + 1])
                w.end_episode()
            win = buf.windows()
            finals = buf.get(np.arange(win.lo[0], win.hi[0]), with_episode=True)["_final"]
            assert 0 < finals.sum() < 16 and win.total == 16
            assert len(buf) == 16 - int(finals.sum())
