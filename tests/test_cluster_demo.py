"""``shmbuf demo --ray-nodes N`` runs end to end in a fresh process (it starts its own local Ray
cluster), prints the live line with a column per node and its summary, and leaves nothing behind
in /dev/shm or as a process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")

from shmbuf import scan as segment_scan  # noqa: E402
from tests._helpers.processes import descendants  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_runs_across_two_local_ray_nodes():
    before = {i.name for i in segment_scan.scan()}
    mine = set(descendants(os.getpid()))  # e.g. a forkserver an earlier test started
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "workers.demo", "--ray-nodes", "2", "--seconds", "3",
         "--capacity", "1024", "--batch-size", "64", "--min-size", "256", "--train-ms", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:] + out[-2000:]
    assert "shmbuf demo on Ray: 2 local nodes" in out
    assert "here" in out and "summary:" in out  # the learner's node column, then the summary
    assert "GB/s of it through Ray" in out
    assert not set(descendants(os.getpid())) - mine
    left = [i.name for i in segment_scan.scan() if i.name not in before and (
        i.name.startswith("shmbuf-ray-")
        or str((i.header.doc if i.header else {}).get("buffer", "")).startswith("shmbuf-ray-"))]
    assert not left, left


def test_demo_runs_on_isolated_nodes():
    """``--isolated``: the same demo on nodes with a network namespace and /dev/shm each, the
    learner in the head's; every namespace, link and process it made is gone afterwards."""
    from tests._helpers import netns_cluster

    reason = netns_cluster.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = set(descendants(os.getpid()))
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "workers.demo", "--ray-nodes", "2", "--isolated", "--seconds",
         "3", "--capacity", "1024", "--batch-size", "64", "--min-size", "256", "--train-ms",
         "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:] + out[-2000:]
    assert "shmbuf demo on Ray: 2 isolated nodes" in out
    assert "here" in out and "summary:" in out and "GB/s of it through Ray" in out
    assert subprocess.run(["ip", "netns", "list"], capture_output=True,
                          text=True).stdout == before
    assert not set(descendants(os.getpid())) - mine


def test_isolated_without_ray_nodes_is_refused_before_anything_starts():
    before = {i.name for i in segment_scan.scan()}
    proc = subprocess.run([sys.executable, "-m", "workers.demo", "--isolated", "--seconds", "1"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "--ray-nodes 3 --isolated" in proc.stderr
    assert "shmbuf demo" not in proc.stdout  # nothing ran
    assert {i.name for i in segment_scan.scan()} <= before
