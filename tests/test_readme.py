"""The README's code runs as printed: the quickstart as a script (actors in their own processes,
a pool with workers), and the pool-construction example on a filled buffer. A README edit that
breaks either fails here, not in a new user's first minute."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def run_script(path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


def test_the_readme_has_the_blocks_these_tests_run():
    blocks = python_blocks()
    assert len(blocks) >= 2, "the README lost its quickstart or its pool example"
    assert "ActorGroup" in blocks[0] and "SamplerPool" in blocks[0]
    assert "selection=" in blocks[1] and "update_priorities" in blocks[1]


@pytest.mark.timeout(180)
def test_the_quickstart_runs_as_a_script(tmp_path: Path, own_shm_entries):
    """Two actor processes, two sampler workers, 1,000 batches: it exits 0 and leaves nothing
    in /dev/shm (the ``own_shm_entries`` guard)."""
    script = tmp_path / "quickstart.py"
    script.write_text(python_blocks()[0] + "\n        assert step == 999\n")
    done = run_script(script, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.timeout(120)
def test_the_pool_example_runs_on_a_filled_buffer(tmp_path: Path, own_shm_entries):
    """The selection/limit/plan example, with the ``buf`` and ``td_errors`` it assumes: a buffer
    of episodes (fields the plan needs) filled past the rate limit's ``min_size``. The example
    asks for ``output="torch"``: without the torch extra it is skipped."""
    pytest.importorskip("torch")
    prelude = textwrap.dedent("""
        import numpy as np
        import shmbuf
        spec = shmbuf.Spec(obs=((84, 84), "uint8"), action=((), "int64"),
                           reward=((), "float32"), terminated=((), "bool"))
        buf = shmbuf.ReplayBuffer.create(spec, capacity=12_000, next_obs="derived")
        with buf.writer() as w:
            n = 11_000
            frames = np.zeros((n, 84, 84), np.uint8)
            w.extend({"obs": frames, "next_obs": frames, "action": np.zeros(n, np.int64),
                      "reward": np.ones(n, np.float32),
                      "terminated": (np.arange(n) % 100) == 99})
        td_errors = np.ones(64)
    """)
    body = python_blocks()[1].replace("workers=4", "workers=1")  # 2 cores here
    script = tmp_path / "pool_example.py"
    script.write_text(prelude + body + textwrap.dedent("""
        assert batch["obs"].shape[:2] == (64, 4), batch["obs"].shape
        assert batch.weights is not None
        pool.close()
        buf.close()
        print("ok")
    """))
    done = run_script(script, timeout=100)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
