"""The examples run from a clone: each is started as a script in a fresh interpreter (with a
timeout, its process group killed if it hangs) and must exit 0 with the output it promises."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)


def _run(script: str, *args: str, timeout: float = 200) -> str:
    """Run ``examples/<script>`` with ``args``; its stdout (and stderr, on failure)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the processes it started
        out, err = proc.communicate()
        pytest.fail(f"{script} did not finish in {timeout}s:\n{out}\n{err}")
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{out}\n{err}"
    return out


def test_actor_learner_dqn_trains_from_actor_processes():
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    out = _run("actor_learner_dqn.py", "--seconds", "6", "--learning-starts", "300",
               "--actors", "2")
    progress = re.findall(r"env steps +(\d+) +updates +(\d+)", out)
    assert progress and int(progress[-1][1]) > 0, out  # the learner trained
    final = re.search(r"result: recent return ([\d.]+) \(at the start ([\d.]+)\) after (\d+) "
                      r"env steps, (\d+) updates", out)
    assert final is not None, out
    assert int(final.group(3)) >= 300 and int(final.group(4)) > 0


def test_cleanrl_dqn_runs():
    pytest.importorskip("torch")
    pytest.importorskip("stable_baselines3")
    out = _run("cleanrl_dqn.py", "--total-timesteps", "1500", "--learning-starts", "500")
    assert re.search(r"1500 steps in [\d.]+s, \d+ episodes", out), out
