"""Crash-and-restart rounds of a learner in a /dev/shm that fits one buffer and one pool.

Run by ``tests/test_learner_restart.py`` as root inside a private mount namespace whose
/dev/shm is a tmpfs of its own (``unshare --mount``): it sizes one pool's segments, remounts
/dev/shm just large enough for the buffer, one pool and less than another staging ring, then
starts a learner, lets it take a batch and SIGKILLs it, ``--rounds`` times. Without the pool's
reclaim of its dead predecessors' segments the second round fails with ``CapacityError``.

    unshare --mount --propagation private sh -c \\
        'mount -t tmpfs -o size=256m tmpfs /dev/shm && python tests/_helpers/restart_rounds.py'
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import multiprocess

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.*

from shmbuf.layout import PAGE  # noqa: E402
from shmbuf.scan import scan  # noqa: E402
from tests import pool_procs as procs  # noqa: E402
from tests._helpers.processes import reporting_child  # noqa: E402
from workers import SamplerPool  # noqa: E402
from workers.config import Workers  # noqa: E402

SHM = "/dev/shm"


def used_bytes() -> int:
    st = os.statvfs(SHM)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--mode", choices=["uniform", "prioritized", "queue"], default="uniform")
    p.add_argument("--start-method", default="spawn")
    args = p.parse_args()
    if os.listdir(SHM):
        print(f"FAIL: {SHM} is not a fresh private tmpfs: {os.listdir(SHM)}")
        return 2
    workers = Workers(1, staging=2, start_method=args.start_method)
    kwargs = dict(batch_size=64, selection=args.mode, workers=workers)  # (a shorthand name)
    with procs.new_buffer(capacity=4096, lanes=1) as buf:
        with SamplerPool(buf, **kwargs) as pool:
            pool.next(timeout=30)
            sizes = {i.name: i.size for i in scan()}
            ring = sizes[pool.staging_name]
        pool_bytes = sum(sizes.values()) - sizes[buf.name]
        room = used_bytes() + pool_bytes + ring // 2
        room = -(-room // PAGE) * PAGE
        subprocess.run(["mount", "-o", f"remount,size={room}", SHM], check=True)
        print(f"/dev/shm: {room} bytes for a {sizes[buf.name]}-byte buffer and {pool_bytes} "
              f"bytes of pool segments (ring {ring})", flush=True)
        spawn = multiprocess.get_context("spawn")
        for k in range(args.rounds):
            with reporting_child(spawn, procs.pool_process_main, buf.name, args.start_method,
                                 False, kwargs, 1, None, what=f"learner {k}") as (proc, _, info):
                os.kill(info["pid"], signal.SIGKILL)
                proc.join(10)
            procs.kill_quietly(info["workers"])
            procs.wait_dead(info["workers"], 5)
            stats = info["stats"]
            print(f"round {k}: reclaimed {stats['reclaimed_segments']} segment(s), "
                  f"{stats['reclaimed_bytes']} bytes; adopted priorities "
                  f"{stats['adopted_priorities']}; /dev/shm used {used_bytes()}", flush=True)
    print(f"{args.rounds} rounds", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
