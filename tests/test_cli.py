"""The ``shmbuf`` command: ``ls`` tells live from leaked, ``gc`` removes only leaked segments,
``inspect`` shows a buffer's spec and lanes, and a broken plugin never breaks the CLI.

Most tests call ``main([...])``; one runs the installed console script. ``gc`` is always given
the names it may touch, so it never removes segments that other tests running now leaked on
purpose.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import shmbuf
from shmbuf import cli, layout
from shmbuf.segment import Segment, fmt_bytes
from shmbuf.shmdir import SHM_DIR, unlink

SPEC = shmbuf.Spec({"obs/camera": ((3, 4), "uint8"), "reward": ((), "float32")})
SCRIPT = Path(sys.executable).with_name("shmbuf")

# A child that creates a buffer, writes 5 rows to lane 0, says so, and waits to be killed.
_CREATE_AND_WAIT = """
import sys, time
import numpy as np
import shmbuf
spec = shmbuf.Spec({"obs/camera": ((3, 4), "uint8"), "reward": ((), "float32")})
buf = shmbuf.ReplayBuffer.create(spec, capacity=10, lanes=2, name=sys.argv[1])
with buf.writer(lane=0) as w:
    w.extend({"obs/camera": np.zeros((5, 3, 4), np.uint8), "reward": np.zeros(5, np.float32)})
print("ready", flush=True)
time.sleep(120)
"""


def _name(tag: str) -> str:
    return f"shmbuf-test-cli-{tag}-{os.getpid()}-{secrets.token_hex(3)}"


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


@pytest.fixture
def live():
    """A live buffer owned by this process, 7 of 2 x 10 rows filled."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=10, lanes=2, name=_name("live")) as buf:
        with buf.writer(lane=1) as w:
            w.extend({"obs/camera": np.ones((7, 3, 4), np.uint8), "reward": np.ones(7, np.float32)})
        yield buf


@pytest.fixture
def leaked():
    """The name of a buffer whose owner was SIGKILLed (so nothing unlinked it)."""
    name = _name("leaked")
    proc = subprocess.Popen(
        [sys.executable, "-c", _CREATE_AND_WAIT, name], stdout=subprocess.PIPE, text=True
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline().strip() == "ready", "the child did not start"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert _exists(name)
        yield name
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        unlink(name)


def _ls_json(capsys) -> dict[str, dict]:
    assert cli.main(["ls", "--json"]) == 0
    return {s["name"]: s for s in json.loads(capsys.readouterr().out)}


def test_ls_shows_a_live_buffer_with_its_fill(live, capsys):
    assert cli.main(["ls"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(live.name)]
    size = fmt_bytes(live.nbytes).split()
    assert line.split()[1:] == ["replay", "buffer", str(os.getpid()), "alive", *size, "10", "2",
                                "35.0%"]
    entry = _ls_json(capsys)[live.name]
    assert entry["state"] == "alive" and entry["alive"] is True
    assert (entry["owner_pid"], entry["capacity"], entry["lanes"]) == (os.getpid(), 10, 2)
    assert entry["fill"] == pytest.approx(7 / 20)
    assert entry["size"] == live.nbytes


def test_ls_marks_a_buffer_whose_owner_was_killed_as_leaked(leaked, live, capsys):
    listed = _ls_json(capsys)
    assert listed[leaked]["state"] == "leaked" and listed[leaked]["alive"] is False
    assert listed[leaked]["fill"] == pytest.approx(5 / 20)
    assert listed[live.name]["state"] == "alive"
    assert cli.main(["ls"]) == 0
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith(leaked)]
    assert "leaked" in line and "`shmbuf gc` removes them" in out


def test_gc_dry_run_lists_but_keeps_then_gc_removes_only_the_leaked(leaked, live, capsys):
    assert cli.main(["gc", "--dry-run"]) == 0  # every segment considered, nothing removed
    out = capsys.readouterr().out
    assert f"would remove {leaked}" in out and live.name not in out
    assert _exists(leaked)

    assert cli.main(["gc", leaked, live.name]) == 0
    out = capsys.readouterr().out
    assert f"removed {leaked} (replay buffer" in out
    assert f"kept {live.name}: alive" in out
    assert not _exists(leaked) and _exists(live.name)
    assert live.sample(4)["reward"].shape == (4,)  # the live buffer still works

    assert cli.main(["gc", leaked]) == 0
    captured = capsys.readouterr()
    assert "no leaked segments" in captured.out and "no shmbuf segment named" in captured.err


def test_gc_spares_an_uninitialised_segment_until_it_is_old(capsys):
    """A segment with no header yet may be being created right now: gc waits ~10 s for it."""
    name = _name("uninit")
    path = os.path.join(SHM_DIR, name)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        assert cli.main(["gc", name]) == 0
        assert f"kept {name}: creating" in capsys.readouterr().out and _exists(name)
        old = time.time() - 60
        os.utime(path, (old, old))
        assert cli.main(["gc", name]) == 0
        assert f"removed {name} (uninitialised, never initialised" in capsys.readouterr().out
        assert not _exists(name)
    finally:
        unlink(name)


def test_inspect_prints_header_spec_and_lanes(live, capsys):
    assert cli.main(["inspect", live.name]) == 0
    out = capsys.readouterr().out
    assert f"pid {os.getpid()}" in out and "alive" in out
    assert "10 per lane x 2 lane(s); holds 7 (35.0%)" in out
    spec_lines = [ln.split() for ln in out.splitlines() if ln.lstrip().startswith(("obs/", "rew"))]
    assert spec_lines == [["obs/camera", "(3,", "4)", "uint8"], ["reward", "()", "float32"]]
    assert cli.main(["inspect", "--json", live.name]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["spec"] == SPEC.to_json()
    assert [ln["committed"] for ln in doc["stats"]["per_lane"]] == [0, 7]


def test_other_segment_kinds_show_their_header(capsys):
    """A staging ring (or any other kind) has no buffer stats: ls and inspect show its header."""
    doc = {"kind": "staging", "slots": 3}
    seg = Segment.create(_name("staging"), layout.KIND_STAGING, doc, layout.header_size)
    try:
        entry = _ls_json(capsys)[seg.name]
        assert (entry["kind"], entry["state"], entry["capacity"], entry["fill"]) == (
            "staging ring", "alive", None, None)
        assert cli.main(["inspect", seg.name]) == 0
        out = capsys.readouterr().out
        assert f"kind:     staging ring (format {layout.FORMAT_VERSION})" in out and '"slots": 3' in out
    finally:
        seg.close()


def test_inspect_works_on_a_leaked_buffer(leaked, capsys):
    assert cli.main(["inspect", leaked]) == 0
    assert "dead (leaked" in capsys.readouterr().out
    assert _exists(leaked)  # inspecting never unlinks


def test_inspect_of_a_missing_name_is_exit_1_without_traceback(capsys):
    assert cli.main(["inspect", _name("missing")]) == 1
    captured = capsys.readouterr()
    assert "shmbuf inspect: error: no shared-memory segment named" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert cli.main(["inspect", "bad/name"]) == 1
    assert "is not valid" in capsys.readouterr().err


def test_usage_errors_return_2(capsys):
    assert cli.main([]) == 2
    assert cli.main(["no-such-command"]) == 2
    assert "invalid choice" in capsys.readouterr().err


class _EntryPoint:
    def __init__(self, name: str, load) -> None:
        self.name, self.load = name, load


def test_plugins_register_commands_and_broken_ones_are_skipped(monkeypatch, capsys):
    def register(subparsers) -> None:
        p = subparsers.add_parser("hello", help="say hello")
        p.add_argument("--who", default="world")
        p.set_defaults(func=lambda args: print(f"hello {args.who}") or 0)

    def broken():
        raise ImportError("No module named 'workers.nope'")

    monkeypatch.setattr(
        cli, "_entry_points",
        lambda: [_EntryPoint("hello", lambda: register), _EntryPoint("nope", broken)],
    )
    assert cli.main(["hello", "--who", "shmbuf"]) == 0
    assert capsys.readouterr().out == "hello shmbuf\n"
    assert cli.main(["ls", "--json"]) == 0  # built-ins unaffected
    capsys.readouterr()
    assert cli.main(["nope"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "shmbuf: command 'nope' is unavailable: ImportError: No module named 'workers.nope'\n"
    )


def test_console_script(live):
    """The installed ``shmbuf`` script: ``ls --json`` lists the buffer, ``inspect`` of a missing
    name exits 1 with a one-line error."""
    run = dict(capture_output=True, text=True, timeout=60)
    res = subprocess.run([str(SCRIPT), "ls", "--json"], **run)
    assert res.returncode == 0, res.stderr
    assert {s["name"]: s["state"] for s in json.loads(res.stdout)}[live.name] == "alive"
    res = subprocess.run([str(SCRIPT), "inspect", _name("missing")], **run)
    assert res.returncode == 1
    assert res.stderr.startswith("shmbuf inspect: error:") and "Traceback" not in res.stderr
