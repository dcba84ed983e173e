"""Finalizers at interpreter shutdown: a script that raises while it owns a buffer (and a
prioritized pool) prints its own traceback and nothing else, and leaves nothing in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from shmbuf import shmdir

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import shmbuf
    from workers import SamplerPool

    buf = shmbuf.ReplayBuffer.create({"x": ((3,), "float32")}, capacity=16)
    with buf.writer() as w:
        w.extend({"x": np.zeros((16, 3), np.float32)})

    class Holder:
        pass

    holder = Holder()
    holder.buf, holder.cycle = buf, holder  # a cycle: freed by the last collections only
    del buf
    if sys.argv[1] != "none":
        pool = SamplerPool(holder.buf, 4, workers=int(sys.argv[1]), selection="prioritized")
        pool.next()
    print(holder.buf.name, flush=True)
    raise RuntimeError("boom while owning a buffer")
""")


@pytest.mark.parametrize("workers", ["none", "0", "1"])
def test_a_script_that_raises_while_owning_a_buffer_exits_cleanly(tmp_path, workers):
    script = tmp_path / "raises.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(shmdir.__file__))),
         os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(script), workers], capture_output=True,
                          text=True, timeout=90, env=env)
    assert done.returncode == 1
    name = done.stdout.strip().splitlines()[-1]
    assert "RuntimeError: boom while owning a buffer" in done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
    assert done.stderr.rstrip().endswith("RuntimeError: boom while owning a buffer"), done.stderr
    assert not os.path.exists(os.path.join(shmdir.SHM_DIR, name))


def test_unlink_works_after_posix_ipc_was_torn_down(monkeypatch):
    """At shutdown a module's globals can be cleared before a finalizer runs: ``unlink`` of a
    name already gone still answers False instead of raising TypeError."""
    import posix_ipc

    monkeypatch.setattr(posix_ipc, "ExistentialError", None)
    monkeypatch.setattr(posix_ipc, "unlink_shared_memory", None)
    assert shmdir.unlink("shmbuf-never-created-0-00000000") is False
