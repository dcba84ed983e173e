"""``scripts/stress.py --chaos``: every sampling mode, a few seconds each, under SIGKILLs of actors
and sampler workers, SIGSTOPs of any process and a learner SIGKILL forced early (the harness then
starts another learner on the same buffer), must PASS: no torn row, no window or stack across an
episode's end or a writer's death, the queue exactly once across the restart, no hang, nothing
left in /dev/shm after ``shmbuf gc``.

The harness's own checks are tested first, on batches and ledgers made to be wrong: a check that
cannot fail would make every PASS above worthless.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmbuf
from workers import SamplerPool

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))  # the harness's modules (scripts/ is not a package)

from chaos_actor import episode_rows, new_episode_id  # noqa: E402
from chaos_checks import BatchChecker  # noqa: E402
from chaos_ledger import Ledger  # noqa: E402
from chaos_modes import MODES, row_scheme, spec_fields  # noqa: E402

from tests._helpers.rows import FRAME_INDEX, episode_frames, frame_steps  # noqa: E402

PAYLOAD = 16


# -- the checks fail where they must ------------------------------------------------------------------
class _Batch(dict):
    """A delivered batch's copy, to tamper with: fields plus ``lanes``, ``indices``, ``weights``."""

    def __init__(self, batch: Any) -> None:
        super().__init__({k: np.array(batch[k]) for k in batch})
        self.lanes = np.array(batch.lanes)
        self.indices = np.array(batch.indices)
        self.weights = np.array(batch.weights)


def _sampled(mode: str, episode_length: int = 12) -> tuple[BatchChecker, _Batch]:
    """A batch of ``mode`` from 20 episodes (alternately truncated) written as the actors do."""
    m = MODES[mode]
    rows = row_scheme(PAYLOAD)
    with shmbuf.ReplayBuffer.create(shmbuf.Spec(spec_fields(PAYLOAD)), capacity=512,
                                    next_obs="derived" if m.derived else "stored") as buf:
        with buf.writer() as w:
            for e in range(20):
                truncated = e % 2 == 0
                w.extend(episode_rows(rows, 0, w.committed, episode_length, new_episode_id(), 0,
                                      episode_length, truncated, m.derived))
                w.end_episode(truncated=truncated)
        with SamplerPool(buf, batch_size=16, workers=0, seed=1, **m.pool) as pool:
            return BatchChecker(m, rows), _Batch(pool.next(timeout=10))


def _other_episode(frames: np.ndarray, at: tuple[int, ...]) -> None:
    """Make the frame at ``at`` a whole frame of the same row in another episode."""
    frame = frames[at]
    frames[at] = episode_frames(0, int(frame[FRAME_INDEX]), 77, int(frame_steps(frame)))[0]


@pytest.mark.parametrize("mode", list(MODES))
def test_checks_pass_batches_written_as_the_actors_write(mode: str) -> None:
    checker, batch = _sampled(mode)
    verdict = checker.check(batch)
    assert verdict.bad == 0, verdict.problems


def test_checks_catch_a_torn_row() -> None:
    checker, batch = _sampled("uniform")
    batch["payload"][3, 5] ^= 1
    verdict = checker.check(batch)
    assert verdict.bad == 1 and "torn" in verdict.problems[0], verdict.problems


def test_checks_catch_a_window_across_two_episodes() -> None:
    checker, batch = _sampled("prioritized-sequences")
    _other_episode(batch["obs"], (0, 3))
    verdict = checker.check(batch)
    assert verdict.bad == 1 and "two episodes" in " ".join(verdict.problems), verdict.problems


def test_checks_catch_a_padded_step_that_is_not_zeros() -> None:
    checker, batch = _sampled("sequences", episode_length=5)  # windows of 8 pass episode ends
    padded = np.flatnonzero(~batch["mask"].all(axis=1))
    assert padded.size, "no window ran past its episode's end"
    batch["payload"][padded[0], -1, 0] = 1
    verdict = checker.check(batch)
    assert verdict.bad == 1 and "not zeros" in verdict.problems[0], verdict.problems


def test_checks_catch_a_stack_across_two_episodes_and_a_wrong_return() -> None:
    checker, batch = _sampled("framestack-nstep")
    whole = np.flatnonzero(batch["obs_mask"].all(axis=1))
    assert whole.size, "no stack without padding"
    _other_episode(batch["obs"], (int(whole[0]), 0))
    batch["reward"][int(whole[-1])] += 0.25
    problems = " ".join(checker.check(batch).problems)
    assert "another episode" in problems and "n-step return" in problems, problems


def test_ledger_finds_a_lane_delivered_again_after_a_restart_and_a_gap() -> None:
    """Issue 27's queue bug: a new pool starts again at the oldest row held. Only the batch the
    killed learner held may come again; rows a learner could have taken must not be missing."""
    ledger = Ledger("queue", lanes=1, batch_size=10)
    ledger.begin_life([0], [0])
    for i in range(0, 100, 10):
        ledger.record(np.zeros(10), np.arange(i, i + 10), None)
    ledger.end_life(killed=True)
    ledger.begin_life([60], [60])  # the new pool starts at the oldest row held: 60
    for i in range(60, 150, 10):
        ledger.record(np.zeros(10), np.arange(i, i + 10), None)
    ledger.record(np.zeros(10), np.arange(160, 170), None)  # 150..159 skipped
    ledger.end_life(killed=False)
    v = ledger.verdict(np.array([175]), drained=True)
    assert (v.duplicates, v.excused_duplicates, v.gaps, v.tail) == (30, 10, 10, 5), v


@pytest.mark.parametrize("lost_ok", [False, True])
def test_ledger_counts_rows_overwritten_while_no_learner_lived_apart(lost_ok: bool) -> None:
    """Not gaps (no pool skipped a row it could read); failures unless ``lost_ok``."""
    ledger = Ledger("queue", lanes=1, batch_size=10, lost_ok=lost_ok)
    ledger.begin_life([0], [0])
    ledger.record(np.zeros(10), np.arange(0, 10), None)
    ledger.end_life(killed=True)
    ledger.begin_life([40], [50])  # rows 10..49 were overwritten before the pool opened
    ledger.record(np.zeros(10), np.arange(50, 60), None)
    ledger.end_life(killed=False)
    v = ledger.verdict(np.array([60]), drained=True)
    assert (v.duplicates, v.gaps, v.lost) == (0, 0, 40), v
    assert len(v.failures) == (0 if lost_ok else 1), v.failures


def test_ledger_finds_repeats_within_an_epoch_and_past_max_times_sampled() -> None:
    epochs = Ledger("epoch", lanes=1, batch_size=4)
    epochs.begin_life([0], [0])
    epochs.record(np.zeros(3), np.array([1, 2, 3]), 0)
    epochs.record(np.zeros(3), np.array([1, 4, 5]), 1)  # row 1 again, in the next epoch: fine
    epochs.record(np.zeros(2), np.array([4, 6]), 1)  # row 4 twice in epoch 1
    assert epochs.verdict(np.array([7]), drained=True).duplicates == 1
    counted = Ledger("max_times", lanes=1, batch_size=4, max_times=2)
    counted.begin_life([0], [0])
    counted.record(np.zeros(4), np.array([1, 1, 2, 1]), None)
    assert counted.verdict(np.array([3]), drained=True).duplicates == 1


# -- the harness passes ------------------------------------------------------------------------------
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", list(MODES))
def test_chaos_mode_passes_with_a_learner_killed_early(mode: str) -> None:
    cmd = [sys.executable, str(SCRIPTS / "stress.py"), "--chaos", "--mode", mode,
           "--seconds", "4", "--actors", "2", "--workers", "2", "--capacity", "1024",
           "--payload", "64", "--kill-every", "0.4", "--stop-every", "0.5", "--stop-for",
           "0.05,0.4", "--learner-kill-every", "1,1.5", "--hang-timeout", "20",
           "--train-step", "0.001",  # (a killed learner then mostly holds a reported batch)
           "--max-segments", "3"]  # a ring and a table: a restarted learner reclaims the rest
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=75)
    finally:
        try:  # the harness, its actors, learners and their workers: one process group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
    assert proc.returncode == 0 and f"PASS [{mode}]" in out, out[-6000:]
    restarts = re.search(r"learner restarts (\d+);", out)
    assert restarts and int(restarts.group(1)) >= 1, f"no learner was restarted:\n{out[-3000:]}"
