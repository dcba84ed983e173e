"""``shmbuf top``: one frame (``--once``) and the live view under tmux, both watching a training
run in another process (a buffer with a writing lane and a sampler pool taking batches)."""

from __future__ import annotations

import os
import secrets
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shmbuf import cli
from shmbuf.top import lane_state, limiter_state

# A child that trains: lane 1 of a buffer is written while a pool of 2 workers delivers batches,
# until a line (or end-of-file) arrives on its stdin. It prints its pid once the pool runs.
_TRAIN = """
import os, select, sys
import numpy as np
import shmbuf
from workers import SamplerPool
from workers.config import Workers
spec = shmbuf.Spec({"obs": ((4,), "float32"), "reward": ((), "float32")})
rows = {"obs": np.ones((16, 4), np.float32), "reward": np.ones(16, np.float32)}
with shmbuf.ReplayBuffer.create(spec, capacity=1000, lanes=2, name=sys.argv[1]) as buf:
    with buf.writer(lane=1) as w:
        w.extend(rows)
        with SamplerPool(buf, batch_size=8, workers=Workers(2, staging=4, start_method=sys.argv[2]),
                         seed=0) as pool:
            pool.next(timeout=60)
            print("ready", os.getpid(), flush=True)
            while not select.select([sys.stdin], [], [], 0.005)[0]:
                w.extend(rows)
                pool.next(timeout=60)
"""
TIMEOUT = 60


@pytest.fixture
def training(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    """(buffer name, pid) of a training child; stopped cleanly through its stdin."""
    name = f"shmbuf-test-top-{os.getpid()}-{secrets.token_hex(3)}"
    method = getattr(request, "param", "forkserver")
    proc = subprocess.Popen([sys.executable, "-c", _TRAIN, name, method], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT)
        line = proc.stdout.readline().split() if ready else []
        assert line[:1] == ["ready"], "the training child did not start"
        yield name, int(line[1])
    finally:
        try:
            proc.stdin.write("stop\n")
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()


def _lines_of(frame: str, name: str) -> list[str]:
    """The buffer line of ``name`` and its lane lines."""
    lines = frame.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(name))
    out = [lines[at]]
    out += [line for line in lines[at + 1:at + 3] if line.startswith("  lane")]
    return out


def _check_frame(frame: str, name: str, pid: int) -> None:
    buffer_line, lane0, lane1 = _lines_of(frame, name)
    fill = float(buffer_line.split()[1].rstrip("%"))
    assert 0 < fill <= 50  # lane 1 of 2 fills, lane 0 stays empty
    assert float(buffer_line.split()[3]) > 0  # inserts/s
    assert f"{pid} alive" in buffer_line
    assert lane0.split()[1:5] == ["0", "pid", "-", "free"]
    assert lane1.split()[1:5] == ["1", "pid", str(pid), "writing"]
    pool = next(line for line in frame.splitlines()
                if line.startswith("shmbuf-staging") and f" {name} " in line)
    cells = pool.split()
    batches, per_s, wait = int(cells[2]), float(cells[3]), float(cells[4].rstrip("%"))
    workers, restarts = int(cells[5]), int(cells[6])
    assert batches > 0 and per_s > 0 and 0 <= wait <= 100
    assert (workers, restarts) == (2, 0)
    staging = " ".join(cells[7:])
    assert staging.endswith("(of 4)")
    counts = dict(zip(cells[7:-2:2], map(int, cells[8:-2:2])))
    assert sum(counts.values()) == 4 and set(counts) <= {"free", "assigned", "filling",
                                                         "ready", "held"}


@pytest.mark.parametrize("training", ["fork", "forkserver", "spawn"], indirect=True)
def test_once_shows_fill_lanes_and_the_pool(training, capsys):
    name, pid = training
    assert cli.main(["top", "--once", "--interval", "0.3"]) == 0
    _check_frame(capsys.readouterr().out, name, pid)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_live_view_under_tmux_redraws_and_quits_on_q(training, tmp_path):
    name, pid = training
    session = f"shmbuf-top-{os.getpid()}-{secrets.token_hex(3)}"
    tmux = ["tmux", "-L", session]  # a private server, so the user's sessions are untouched
    cmd = (f"cd {Path(__file__).parents[1]} && PYTHONPATH=. {sys.executable} -m shmbuf.cli top "
           f"--interval 0.3; echo exited $? > {tmp_path / 'rc'}; sleep 30")
    subprocess.run([*tmux, "new-session", "-d", "-s", session, "-x", "200", "-y", "50", cmd],
                   check=True, timeout=TIMEOUT)
    try:
        screen, deadline = "", time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            time.sleep(0.5)
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", session],
                                    capture_output=True, text=True, timeout=TIMEOUT).stdout
            if name in screen and "shmbuf-staging" in screen and " 0.0%" not in screen:
                break
        time.sleep(1.0)  # a frame with rates over a whole interval
        screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", session],
                                capture_output=True, text=True, timeout=TIMEOUT).stdout
        assert screen.startswith("shmbuf top"), screen
        _check_frame(screen, name, pid)
        subprocess.run([*tmux, "send-keys", "-t", session, "q"], check=True, timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while not (tmp_path / "rc").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "rc").read_text().split() == ["exited", "0"]
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=TIMEOUT)


def test_limiter_and_lane_states_in_words():
    base = {"active": True, "queue": False, "min_size": 100, "samples_per_insert": 2.0,
            "tolerance": 10.0}
    assert limiter_state({"active": False, "queue": False}) == "off"
    assert limiter_state({"active": False, "queue": True}) == "queue"
    assert limiter_state({**base, "inserts": 50, "samples": 0}).startswith("filling: 50/100")
    assert limiter_state({**base, "inserts": 100, "samples": 360}, 8) == \
        "blocked: samples ahead by 1.80x"
    assert limiter_state({**base, "inserts": 1000, "samples": 100}).startswith(
        "writers blocked: inserts ahead by 20.00x")
    assert limiter_state({**base, "inserts": 1000, "samples": 1800}).startswith("ok: samples at 0.90x")
    lane = {"writer_alive": True, "writer_pid": 7, "last_write_age_s": 0.1}
    assert lane_state(lane) == "writing"
    assert lane_state({**lane, "last_write_age_s": 60.0}) == "idle"
    assert lane_state({**lane, "last_write_age_s": 60.0}, advanced=True) == "writing"
    assert lane_state({**lane, "writer_alive": False}) == "gone"
    assert lane_state({**lane, "writer_alive": False, "writer_pid": 0}) == "free"


def test_demo_plot_draws_throughput_over_time(tmp_path, capsys):
    from workers import demo

    out = tmp_path / "throughput.png"
    assert demo.main(["--seconds", "2", "--actors", "1", "--workers", "1", "--capacity", "600",
                      "--min-size", "100", "--batch-size", "32", "--train-ms", "0",
                      "--plot", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"throughput plot: {out}" in printed
    samples = int(printed.rsplit("(", 1)[1].split()[0])
    assert samples >= 2
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_plot_without_matplotlib_says_how_to_install_before_starting(
        tmp_path, monkeypatch, capsys):
    from workers import demo

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit, match=r"pip install 'shmbuf\[plot\]'"):
        demo.main(["--seconds", "1", "--plot", str(tmp_path / "x.png")])
    assert "shmbuf demo:" not in capsys.readouterr().out  # nothing was started


GOOD_CONTROL = {"lines": 4, "state": 0, "owner": 1, "states": ["free", "ready"]}
GOOD_STATS = {"lines": 1, "words": ["batches", "wait_ns"]}


@pytest.mark.parametrize(("control", "stats"), [
    (None, GOOD_STATS), ({"lines": 1 << 40, "state": 0, "states": []}, GOOD_STATS),
    ({"lines": 4, "state": 9, "states": ["free"]}, GOOD_STATS), ("junk", GOOD_STATS),
    (GOOD_CONTROL, None),  # an older ring: its stats words are not in its document
    (GOOD_CONTROL, {"lines": 1 << 40, "words": []}), (GOOD_CONTROL, {"lines": 1}),
    (GOOD_CONTROL, {"lines": 1, "words": ["w"] * 9}),  # more words than its line holds
    (GOOD_CONTROL, "junk"),
])
def test_a_staging_ring_top_cannot_read_is_left_out(control, stats, capsys):
    from shmbuf import layout
    from shmbuf.scan import scan
    from shmbuf.segment import Segment
    from shmbuf.top import read_pool

    doc = {"kind": "staging", "n_slots": 2, "arrays": [], "buffer": "b", "batch_size": 1}
    for key, value in (("slot_control", control), ("pool_stats", stats)):
        if value is not None:
            doc[key] = value
    seg = Segment.create(None, layout.KIND_STAGING, doc, lambda n: layout.header_size(n) + 4096)
    try:
        info = next(i for i in scan() if i.name == seg.name)
        assert read_pool(info) is None
        assert cli.main(["top", "--once", "--interval", "0.01"]) == 0
        assert seg.name not in capsys.readouterr().out
    finally:
        seg.close()


def test_top_reads_the_pool_counters_where_the_rings_document_places_them():
    """``shmbuf top`` imports nothing of ``workers``: it finds the stats words by the names the
    ring's layout document lists (``pool_stats``), here in an order of the test's own, and a
    word it does not list reads as 0."""
    from shmbuf import layout
    from shmbuf.scan import scan
    from shmbuf.segment import Segment
    from shmbuf.top import read_pool

    doc = {"kind": "staging", "n_slots": 2, "arrays": [], "buffer": "b", "batch_size": 1,
           "slot_control": GOOD_CONTROL, "pool_stats": {"lines": 1, "words": [
               "workers", "batches", "unknown", "restarts", "wait_ns"]}}
    seg = Segment.create(None, layout.KIND_STAGING, doc, lambda n: layout.header_size(n) + 4096)
    try:
        words = memoryview(seg.buf).cast("q")
        base = layout.header_size(len(layout.encode_layout(doc))) // 8
        for i, value in enumerate([3, 70, 99, 2, 5_000]):
            words[base + i] = value
        words[base + 8 + 4 * 8 * 1] = 1  # slot 1's state (control line 0 of 4): "ready"
        pool = read_pool(next(i for i in scan() if i.name == seg.name))
        words.release()
        assert pool is not None
        assert (pool.workers, pool.batches, pool.restarts, pool.wait_ns) == (3, 70, 2, 5_000)
        assert (pool.reclaimed, pool.reclaimed_bytes, pool.adopted) == (0, 0, False)
        assert pool.slots == {"free": 1, "ready": 1}
    finally:
        seg.close()
