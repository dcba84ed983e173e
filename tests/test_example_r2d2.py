"""``examples/r2d2_atari.py`` runs from a clone on MinAtar: actor processes, stored LSTM state,
strided windows with stacked frames, prioritized per window start, weights published to the
actors. Skipped where ``minatar`` (the ``atari`` extra) or torch is not installed."""

from __future__ import annotations

import re

import pytest

from tests.test_examples import _run

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_r2d2_trains_on_windows_from_actor_processes():
    pytest.importorskip("torch")
    pytest.importorskip("minatar")
    # Windows of 10 + 30 steps every 10 (the paper's are 40 + 80 every 40): a random policy's
    # SpaceInvaders episodes last about 40 steps, so with the paper's burn-in most windows end
    # their first episode before training starts and a few updates may train no step at all.
    out = _run("r2d2_atari.py", "--env", "MinAtar/SpaceInvaders", "--seconds", "5",
               "--min-updates", "3", "--actors", "2", "--learning-starts", "300",
               "--burn-in", "10", "--train-len", "30", "--stride", "10",
               "--publish-every", "1", timeout=280)
    assert "windows of 10 + 30 steps every 10, frame stack 4; each window start at its " \
        "actor's priority" in out, out
    final = re.search(r"result: recent return [-\d.na]+ after (\d+) env steps, (\d+) updates "
                      r"\((\d+) trained steps\), (\d+) episodes, weights version (\d+), "
                      r"(\d+) window starts at their actor's priority", out)
    assert final is not None, out
    steps, updates, trained, episodes, version, prioritized = (int(g) for g in final.groups())
    assert prioritized > 0, out  # window starts entered at the priority actors gave
    assert steps >= 300 and updates >= 3 and episodes > 0, out
    assert trained > 0, out  # some window held steps past its burn-in with a target
    assert version >= 1 + updates, out  # published after every update (and once at the start)
