"""Hardening of persistence (issue 8, items 1, 3, 5 and 15): a full disk, an interrupted save,
tampered state dicts and manifests, and checkpoint files that are not regular files.

A failed ``save`` leaves no directory that ``load`` would half-read and keeps the previous
checkpoint; a rejected ``load`` leaves nothing in /dev/shm; a rejected ``load_state_dict`` leaves
every byte of the segment as it was.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf import persist
from shmbuf._progress import Progress
from shmbuf.errors import CapacityError, CheckpointError, ShmbufError, SpecMismatchError

REPO = Path(__file__).resolve().parent.parent
SPEC = shmbuf.Spec(idx=((), "int64"), obs=((4,), "float32"))
EP_SPEC = shmbuf.Spec(ret=((), "float32"))


def rows(start: int, n: int) -> dict[str, np.ndarray]:
    i = np.arange(start, start + n, dtype=np.int64)
    return {"idx": i, "obs": (i[:, None] * 10 + np.arange(4)).astype(np.float32)}


def snapshot(buf: shmbuf.ReplayBuffer) -> bytes:
    """Every byte of the segment (header, lane words, stamps, meta, columns, episode table)."""
    with open(os.path.join("/dev/shm", buf.name), "rb") as f:
        return f.read()


def shm() -> set[str]:
    """This process's entries in /dev/shm (segment names carry the creator's pid; other
    processes may be creating segments of their own meanwhile)."""
    return {n for n in os.listdir("/dev/shm") if f"-{os.getpid()}-" in n}


@pytest.fixture
def five():
    """Lane 0 holds 5 rows (an episode of 3 ended, one of 2 open), lane 1 is empty."""
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=2, episode_spec=EP_SPEC,
                                    episode_capacity=4) as b:
        with b.writer(lane=0) as w:
            w.extend(rows(0, 3))
            w.end_episode(ret=1.5)
            w.extend(rows(3, 2))
        assert len(b) == 5
        yield b


def contents(buf: shmbuf.ReplayBuffer) -> dict[str, list]:
    return {k: v.tolist() for k, v in buf.get(np.arange(5), 0, with_episode=True).items()}


# --------------------------------------------------------------------------------------------
# Item 1: a full disk is a CapacityError; a failed or interrupted save leaves nothing half-made
# --------------------------------------------------------------------------------------------
def _can_mount_private_tmpfs(where: Path) -> str | None:
    """None if ``unshare -m`` + a tmpfs mount works here, else why not."""
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    try:
        r = subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {where}"],
            capture_output=True, text=True, timeout=20, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare -m failed: {e}"
    if r.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace: {r.stderr.strip()}"
    return None


FULL_DISK_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import shmbuf
    mnt = sys.argv[1]
    spec = shmbuf.Spec(x=((1024,), "uint8"))
    out = {}
    with shmbuf.ReplayBuffer.create(spec, capacity=64) as small, \\
            shmbuf.ReplayBuffer.create(spec, capacity=4096) as big:
        with small.writer() as w:
            w.extend({"x": np.full((64, 1024), 1, np.uint8)})
        with big.writer() as w:
            w.extend({"x": np.full((4096, 1024), 2, np.uint8)})  # 4 MiB: no room in 1 MiB
        small.save(os.path.join(mnt, "ck"))  # 64 KiB: fits
        for overwrite, target in ((True, "ck"), (False, "new")):
            try:
                big.save(os.path.join(mnt, target), overwrite=overwrite)
                out[target] = "saved"
            except Exception as e:
                out[target] = [type(e).__name__, isinstance(e, OSError), str(e)]
        out["listing"] = sorted(os.listdir(mnt))
        with shmbuf.ReplayBuffer.load(os.path.join(mnt, "ck")) as old:
            out["old"] = [len(old), int(old.get(np.arange(64), 0)["x"].min())]
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.timeout(90)
def test_save_onto_a_full_tmpfs_is_a_capacity_error_and_keeps_the_old_checkpoint(tmp_path):
    """A real 1 MiB tmpfs in a private mount namespace: the 4 MiB save raised SIGBUS before
    (the process died); now it is a CapacityError and the 64 KiB checkpoint there survives."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    why = _can_mount_private_tmpfs(mnt)
    if why is not None:
        pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c",
'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$2" -c "$3" "$1"', "sh",
         str(mnt), sys.executable, FULL_DISK_CHILD],
        capture_output=True, text=True, timeout=60, env=env, cwd=str(REPO), check=False,
    )
    assert r.returncode == 0, f"child died (rc {r.returncode}): {r.stderr[-2000:]}"
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    for target in ("ck", "new"):
        kind, is_oserror, msg = out[target]
        assert kind == "CapacityError" and is_oserror, out[target]
        assert os.path.join(str(mnt), target) in msg and "needs" in msg and "free" in msg
    assert out["listing"] == ["ck"]  # no temp dirs, no partial "new"
    assert out["old"] == [64, 1]  # the previous checkpoint, whole


def _fake_statvfs(monkeypatch, under: Path, free: int) -> None:
    """os.statvfs reports ``free`` bytes for paths under ``under``."""
    real = os.statvfs

    class Fake:
        def __init__(self, st):
            self._st = st

        def __getattr__(self, name):
            return getattr(self._st, name)

        f_frsize = 1
        f_bavail = free
        f_bfree = free

    def statvfs(path):
        st = real(path)
        return Fake(st) if str(os.fspath(path)).startswith(str(under)) else st

    monkeypatch.setattr(os, "statvfs", statvfs)


def test_save_checks_free_space_up_front(five, tmp_path, monkeypatch):
    five.save(tmp_path / "ck")
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    _fake_statvfs(monkeypatch, tmp_path, free=100)
    for target, overwrite in (("new", False), ("ck", True)):
        with pytest.raises(CapacityError) as info:
            five.save(tmp_path / target, overwrite=overwrite)
        msg = str(info.value)
        assert str(tmp_path / target) in msg and "100 B free" in msg and "needs" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before
    with shmbuf.ReplayBuffer.load(tmp_path / "ck") as old:
        assert contents(old) == contents(five)


def test_save_when_fallocate_reports_enospc_is_a_capacity_error(five, tmp_path, monkeypatch):
    five.save(tmp_path / "ck")
    calls = []

    def no_room(fd, offset, length):
        calls.append(length)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    for target, overwrite in (("new", False), ("ck", True)):
        with pytest.raises(CapacityError, match="needs") as info:
            five.save(tmp_path / target, overwrite=overwrite)
        assert str(tmp_path / target) in str(info.value)
    assert calls, "save did not reserve its files' space"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    monkeypatch.undo()  # create() reserves shared memory with posix_fallocate too
    with shmbuf.ReplayBuffer.load(tmp_path / "ck") as old:
        assert contents(old) == contents(five)


def test_save_on_a_filesystem_without_fallocate_still_works(five, tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    five.save(tmp_path / "ck")
    monkeypatch.undo()
    with shmbuf.ReplayBuffer.load(tmp_path / "ck") as loaded:
        assert contents(loaded) == contents(five)


def test_enospc_from_a_write_is_a_capacity_error(five, tmp_path, monkeypatch):
    """Space that vanishes between the check and the write (another process filled the disk)."""
    five.save(tmp_path / "ck")
    real = os.pwrite
    budget = [2]

    def pwrite(fd, data, offset):
        budget[0] -= 1
        if budget[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(CapacityError, match="ck"):
        five.save(tmp_path / "ck", overwrite=True)
    assert budget[0] < 0, "save did not write through os.pwrite"
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    with shmbuf.ReplayBuffer.load(tmp_path / "ck") as old:
        assert contents(old) == contents(five)


@pytest.mark.parametrize("overwrite", [False, True])
def test_interrupted_save_leaves_nothing_and_keeps_the_old_checkpoint(five, tmp_path,
                                                                      monkeypatch, overwrite):
    if overwrite:
        five.save(tmp_path / "ck")
    before = sorted(p.name for p in tmp_path.iterdir())

    class CtrlC(Progress):
        def update(self, nbytes: int) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr(persist.snapshot, "Progress", CtrlC)
    with pytest.raises(KeyboardInterrupt):
        five.save(tmp_path / "ck", overwrite=overwrite)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    monkeypatch.undo()
    if overwrite:
        with shmbuf.ReplayBuffer.load(tmp_path / "ck") as old:
            assert contents(old) == contents(five)


def _save_and_die(name: str, path: str, overwrite: bool) -> None:
    """Child: save the buffer ``name`` and SIGKILL itself after the first chunk is copied."""
    from shmbuf import persist as p

    class Killer(p.snapshot.Progress):
        def update(self, nbytes: int) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

    p.snapshot.Progress = Killer
    shmbuf.ReplayBuffer.attach(name).save(path, overwrite=overwrite)


@pytest.mark.timeout(60)
def test_a_save_killed_midway_leaves_no_checkpoint_to_half_read(five, tmp_path, mp):
    """SIGKILL inside save(): no directory at the target (only a hidden temp one, which the next
    save removes); with overwrite=True the previous checkpoint is there, whole."""
    path = tmp_path / "ck"
    for overwrite in (False, True):
        p = mp.Process(target=_save_and_die, args=(five.name, str(path), overwrite))
        p.start()
        p.join(30)
        assert p.exitcode == -signal.SIGKILL, p.exitcode
        if not overwrite:
            assert not path.exists(), "a killed save left a checkpoint directory"
            with pytest.raises(CheckpointError):
                shmbuf.ReplayBuffer.load(path)
            five.save(path)  # the checkpoint the overwrite below must keep
        else:
            with shmbuf.ReplayBuffer.load(path) as old:
                assert contents(old) == contents(five)
    five.save(path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # dead saves' temp dirs gone


def test_overwrite_without_renameat2_falls_back_and_keeps_the_old_one_on_failure(
        five, tmp_path, monkeypatch):
    """Where the filesystem cannot exchange directories: rename the old one aside, the new one
    in; if the second rename fails, the old one goes back."""
    five.save(tmp_path / "ck")
    monkeypatch.setattr(persist._files, "renameat2", lambda src, dst, flags: False)
    with five.writer(lane=1) as w:
        w.extend(rows(100, 2))
    five.save(tmp_path / "ck", overwrite=True)
    with shmbuf.ReplayBuffer.load(tmp_path / "ck") as loaded:
        assert len(loaded) == 7
    real = os.rename

    def rename(src, dst):
        if ".saving-" in os.fspath(src):
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with five.writer(lane=1) as w:
        w.extend(rows(102, 2))
    with pytest.raises(OSError, match="Input/output"):
        five.save(tmp_path / "ck", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    with shmbuf.ReplayBuffer.load(tmp_path / "ck") as loaded:
        assert len(loaded) == 7  # the previous checkpoint, not the failed one (9 rows)


def test_saved_files_are_plain_npy_files(five, tmp_path):
    five.save(tmp_path / "ck")
    doc = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    for entry in [*doc["fields"], doc["meta"], doc["episodes"]["records"],
                  *doc["episodes"]["fields"]]:
        arr = np.load(tmp_path / "ck" / entry["file"], mmap_mode="r")
        assert list(arr.shape) == entry["shape"] and arr.dtype.str == entry["dtype"]
        del arr
    idx = np.load(tmp_path / "ck" / "000_idx.npy")
    assert idx.tolist() == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------------------------
# Items 3 and 15: tampered state dicts change nothing
# --------------------------------------------------------------------------------------------
DELETE = object()


def tamper(doc: Any, where: str, value: Any) -> None:
    """Set (or with DELETE remove) ``doc[a][b]...`` for ``where = "a.b..."`` (ints index lists)."""
    *parents, last = where.split(".")
    for key in parents:
        doc = doc[int(key)] if isinstance(doc, list) else doc[key]
    key = int(last) if isinstance(doc, list) else last
    if value is DELETE:
        del doc[key]
    else:
        doc[key] = value


def _records(**change: Any):
    """A function of a state or manifest's records array that changes one column of row 0."""
    def apply(table: np.ndarray) -> np.ndarray:
        table = np.array(table, copy=True)
        for col, v in change.items():
            table[0, persist.snapshot.RECORD_COLUMNS.index(col)] = v
        return table
    return apply


STATE_CASES = [
    # (where, value, error, words the message must contain)
    ("per_lane.0.episode", 2**63, CheckpointError, "episode"),
    ("per_lane.0.episode", 2**64, CheckpointError, "episode"),
    ("per_lane.0.episode", -1, CheckpointError, "episode"),
    ("per_lane.0.episode", 2**31, CheckpointError, "episode"),
    ("per_lane.0.episode_start", 2**63, CheckpointError, "episode_start"),
    ("per_lane.0.episode_start", -1, CheckpointError, "episode_start"),
    ("per_lane.0.episode_start", 6, CheckpointError, "episode_start"),  # past the lane's end
    ("per_lane.0.first", 2**62, CheckpointError, "first"),
    ("per_lane.0.first", 2**47, CheckpointError, "first"),  # its stamps would reach the version bits
    ("per_lane.0.first", -3, CheckpointError, "first"),
    ("per_lane.0.first", "0", CheckpointError, "first"),
    ("per_lane.0.first", 0.5, CheckpointError, "first"),
    ("per_lane.0.count", 4, CheckpointError, "offset"),  # lane 1 no longer follows lane 0
    ("per_lane.1.count", 1, CheckpointError, "rows"),  # the counts add up to 6, not 5
    ("per_lane.0.count", True, CheckpointError, "count"),
    ("per_lane.1.lane", 0, CheckpointError, "lane"),
    ("per_lane.0", "junk", CheckpointError, "per_lane"),
    ("per_lane", "junk", CheckpointError, "per_lane"),
    ("per_lane", DELETE, CheckpointError, "per_lane"),
    ("capacity", 2**63, CheckpointError, "capacity"),
    ("capacity", "8", CheckpointError, "capacity"),
    ("capacity", DELETE, CheckpointError, "capacity"),
    ("lanes", 2**64, CheckpointError, "lanes"),
    ("lanes", "2", CheckpointError, "lanes"),
    ("lanes", 3, SpecMismatchError, "lanes"),
    ("meta", np.zeros(5, np.int32), CheckpointError, "meta"),
    ("meta", [[1, 2], [3]], CheckpointError, "meta"),
    ("meta", DELETE, CheckpointError, "meta"),
    ("fields.idx", [[1, 2], [3]], CheckpointError, "idx"),
    ("fields.obs", np.zeros((5, 3), np.float32), CheckpointError, "obs"),
    ("fields", "junk", CheckpointError, "fields"),
    ("spec", 5, CheckpointError, "spec"),
    ("spec", [[["deep"]]], CheckpointError, "spec"),
    ("version", True, CheckpointError, "version"),
    ("version", "1", CheckpointError, "version"),
    ("next_obs", 5, CheckpointError, "next_obs"),
    ("episode_spec", "junk", CheckpointError, "episode_spec"),
    ("episode_capacity", 2**63, CheckpointError, "episode_capacity"),
    ("episode_capacity", "3", CheckpointError, "episode_capacity"),
    ("episodes", 5, CheckpointError, "episodes"),
    ("episodes.records", _records(episode=2**62), CheckpointError, "episode"),
    ("episodes.records", _records(episode=-1), CheckpointError, "episode"),
    ("episodes.records", _records(start=-1), CheckpointError, "start"),
    ("episodes.records", _records(length=-1), CheckpointError, "length"),
    ("episodes.records", _records(flags=8), CheckpointError, "flags"),
    ("episodes.records", _records(lane=2), CheckpointError, "lane"),
    ("episodes.records", np.zeros((1, 5), np.float64), CheckpointError, "records"),
    ("episodes.fields", "junk", CheckpointError, "fields"),
    ("episodes.fields.ret", np.zeros(7, np.float32), CheckpointError, "ret"),
]


def _case_id(case: tuple) -> str:
    where, value = case[0], case[1]
    shown = "DELETE" if value is DELETE else (
        "fn" if callable(value) else repr(value)[:20].replace(" ", ""))
    return f"{where}={shown}"


@pytest.mark.parametrize("case", STATE_CASES, ids=_case_id)
def test_a_rejected_load_state_dict_changes_nothing(five, case):
    """Item 3: a per-lane episode >= 2**63 used to fail after the stamps were zeroed (len 5 ->
    0). Every field is now checked before the first byte changes."""
    where, value, error, word = case
    state = copy.deepcopy(five.state_dict())
    if callable(value):
        *parent, last = where.split(".")
        node = state
        for key in parent:
            node = node[key]
        value = value(node[last])
    tamper(state, where, value)
    before = snapshot(five)
    with pytest.raises(error) as info:
        five.load_state_dict(state)
    assert word in str(info.value), str(info.value)
    assert snapshot(five) == before
    assert len(five) == 5


def test_an_untampered_state_still_loads(five):
    state = copy.deepcopy(five.state_dict())
    with shmbuf.ReplayBuffer.create(SPEC, capacity=8, lanes=2, episode_spec=EP_SPEC,
                                    episode_capacity=4) as other:
        other.load_state_dict(state)
        assert contents(other) == contents(five)
        assert other.episode(0, 0)["ret"] == 1.5


# --------------------------------------------------------------------------------------------
# Item 15: tampered manifests are CheckpointErrors naming the field, and leak nothing
# --------------------------------------------------------------------------------------------
MANIFEST_CASES = [
    ("capacity", 2**63, "capacity"),
    ("capacity", 2**61, "capacity"),
    ("capacity", -1, "capacity"),
    ("capacity", 0, "capacity"),
    ("capacity", "8", "capacity"),
    ("capacity", 8.5, "capacity"),
    ("capacity", True, "capacity"),
    ("capacity", None, "capacity"),
    ("capacity", {"deep": [1, {"x": [2]}]}, "capacity"),
    ("capacity", DELETE, "capacity"),
    ("lanes", 2**40, "lanes"),
    ("lanes", 0, "lanes"),
    ("lanes", "2", "lanes"),
    ("lanes", DELETE, "lanes"),
    ("rows", -1, "rows"),
    ("rows", 2**63, "rows"),
    ("rows", "5", "rows"),
    ("rows", DELETE, "rows"),
    ("per_lane.0.first", 2**63, "first"),
    ("per_lane.0.first", 2**61, "first"),
    ("per_lane.0.first", 2**47 - 2, "first"),  # its stamps would reach the version bits
    ("per_lane.0.first", -1, "first"),
    ("per_lane.0.first", "0", "first"),
    ("per_lane.0.count", 9, "count"),
    ("per_lane.0.episode", 2**63, "episode"),
    ("per_lane.0.episode", -1, "episode"),
    ("per_lane.0.episode", 2**31, "episode"),
    ("per_lane.0.episode_start", 2**64, "episode_start"),
    ("per_lane.0.episode_start", -2, "episode_start"),
    ("per_lane.0.episode_start", 99, "episode_start"),
    ("per_lane.0.offset", 1.0, "offset"),
    ("per_lane.0", [1, 2], "per_lane"),
    ("per_lane.0.lane", DELETE, "lane"),
    ("per_lane", {"0": {}}, "per_lane"),
    ("per_lane", DELETE, "per_lane"),
    ("fields", {"a": 1}, "fields"),
    ("fields", DELETE, "fields"),
    ("fields.0", "idx", "fields"),
    ("fields.0.shape", [2**63], "idx"),
    ("fields.0.shape", "5", "idx"),
    ("fields.0.dtype", "O", "idx"),
    ("fields.0.dtype", 5, "idx"),
    ("fields.0.file", "../escape.npy", "idx"),
    ("fields.0.file", "/etc/passwd", "idx"),
    ("fields.0.file", 5, "idx"),
    ("fields.0.name", ["idx"], "fields"),
    ("meta", "x", "meta"),
    ("meta", DELETE, "meta"),
    ("meta.shape", [-1], "meta"),
    ("meta.file", None, "meta"),
    ("spec", 5, "spec"),
    ("spec", "junk", "spec"),
    ("spec", [{"name": "idx"}], "spec"),
    ("spec.0.shape", [2**63], "spec"),
    ("spec.0.dtype", "object", "spec"),
    ("spec", DELETE, "spec"),
    ("next_obs", 5, "next_obs"),
    ("next_obs", ["derived"], "next_obs"),
    ("episode_spec", 5, "episode_spec"),
    ("episode_spec", "junk", "episode_spec"),
    ("episode_spec", [[1, 2]], "episode_spec"),
    ("episode_capacity", 2**63, "episode_capacity"),
    ("episode_capacity", -1, "episode_capacity"),
    ("episode_capacity", 0, "episode_capacity"),
    ("episode_capacity", "4", "episode_capacity"),
    ("episodes", 5, "episodes"),
    ("episodes.records", 5, "records"),
    ("episodes.records.shape", [2**63, 5], "records"),
    ("episodes.records.shape", [1, 5, 1], "records"),
    ("episodes.fields", "x", "episodes"),
    ("episodes.fields.0.name", 5, "episode"),
    ("episodes.fields.0", DELETE, "episode"),
    ("version", "1", "version"),
    ("version", True, "version"),
    ("version", 2, "version"),
    ("format", 5, "format"),
]


@pytest.fixture
def saved(five, tmp_path) -> Path:
    path = tmp_path / "ck"
    five.save(path)
    return path


def _load_fails(path: Path, word: str, error: type = CheckpointError) -> Exception:
    before = shm()
    with pytest.raises(ShmbufError) as info:
        shmbuf.ReplayBuffer.load(path)
    assert isinstance(info.value, error), repr(info.value)
    assert word in str(info.value), str(info.value)
    assert shm() <= before, "a failed load left a segment in /dev/shm"
    return info.value


@pytest.mark.parametrize("case", MANIFEST_CASES, ids=_case_id)
def test_a_tampered_manifest_is_a_checkpoint_error_naming_the_field(saved, case):
    where, value, word = case
    doc = json.loads((saved / "manifest.json").read_text())
    tamper(doc, where, value)
    (saved / "manifest.json").write_text(json.dumps(doc))
    _load_fails(saved, word)


@pytest.mark.parametrize("document", ["[]", "5", '"x"', "null", "[" * 100_000 + "]" * 100_000,
                                      '{"format": "shmbuf-checkpoint", "version": 1, "x": '
                                      + "[" * 100_000 + "]" * 100_000 + "}"],
                         ids=["list", "int", "str", "null", "deep-list", "deep-value"])
def test_a_manifest_that_is_not_a_checkpoint_document_is_a_checkpoint_error(saved, document):
    (saved / "manifest.json").write_text(document)
    _load_fails(saved, "manifest")


@pytest.mark.parametrize("change", [{"episode": 2**40}, {"episode": -1}, {"start": -1},
                                    {"length": -5}, {"flags": 2}, {"lane": 7}],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_tampered_episode_records_in_the_npy_are_a_checkpoint_error(saved, change):
    table = np.load(saved / "_episodes.npy")
    np.save(saved / "_episodes.npy", _records(**change)(table))
    _load_fails(saved, next(iter(change)))


def test_a_failure_after_the_segment_exists_still_unlinks_it(saved, monkeypatch):
    def boom(*args, **kwargs):
        raise CheckpointError("injected")

    monkeypatch.setattr(persist.snapshot, "_restore_episodes", boom)
    _load_fails(saved, "injected")


# --------------------------------------------------------------------------------------------
# Item 5 (load part): only regular files are opened, without blocking; the manifest is bounded
# --------------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
@pytest.mark.parametrize("file", ["manifest.json", "000_idx.npy", "_meta.npy", "_episodes.npy"])
def test_a_fifo_in_the_checkpoint_is_refused_without_blocking(saved, file):
    (saved / file).unlink()
    os.mkfifo(saved / file)
    t = time.monotonic()
    err = _load_fails(saved, file)
    assert "regular file" in str(err)
    assert time.monotonic() - t < 5


@pytest.mark.timeout(10)
@pytest.mark.parametrize("file", ["manifest.json", "001_obs.npy"])
def test_a_checkpoint_file_linked_to_a_device_is_refused(saved, file):
    (saved / file).unlink()
    os.symlink("/dev/zero", saved / file)
    err = _load_fails(saved, file)
    assert "regular file" in str(err)


@pytest.mark.timeout(10)
def test_a_huge_manifest_is_refused_without_reading_it(saved):
    with open(saved / "manifest.json", "r+b") as f:
        f.truncate(persist.directory.MAX_MANIFEST_BYTES + 1)  # sparse: costs nothing on disk
    _load_fails(saved, "MiB")


# --------------------------------------------------------------------------------------------
# Item 15, fuzzed: any JSON value anywhere in a manifest or a state is a typed error or loads
# --------------------------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.text(max_size=5)
    | st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, -1, 2**31, 2**61, 2**63, 2**64]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                max_size=3),
    max_leaves=8,
)


def paths(doc: Any, prefix: str = "") -> list[str]:
    """Every key and list item of a JSON document, as ``tamper`` paths."""
    out = []
    items = (doc.items() if isinstance(doc, dict)
             else enumerate(doc) if isinstance(doc, list) else [])
    for key, value in items:
        p = f"{prefix}{key}"
        out.append(p)
        out.extend(paths(value, p + "."))
    return out


def _fuzz_load(path: Path, doc: dict) -> None:
    before = shm()
    try:
        with shmbuf.ReplayBuffer.load(path):
            pass  # the change was harmless (e.g. "created")
    except ShmbufError:
        pass
    assert shm() <= before, "a failed load left a segment in /dev/shm"


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_manifests_raise_only_typed_errors(saved, data):
    original = (saved / "manifest.json").read_text()
    doc = json.loads(original)
    where = data.draw(st.sampled_from(paths(doc)))
    value = data.draw(JSON | st.just(DELETE))
    tamper(doc, where, value)
    try:
        (saved / "manifest.json").write_text(json.dumps(doc))
        _fuzz_load(saved, doc)
    finally:
        (saved / "manifest.json").write_text(original)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_states_raise_only_typed_errors_and_change_nothing(five, data):
    state = five.state_dict()
    shape = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in state.items()
             if k not in ("fields", "meta", "episodes")}
    where = data.draw(st.sampled_from(paths(shape) + ["fields", "meta", "episodes",
                                                      "episodes.records", "fields.idx"]))
    value = data.draw(JSON | st.just(DELETE))
    tamper(state, where, value)
    before = snapshot(five)
    try:
        five.load_state_dict(state)
    except ShmbufError:
        assert snapshot(five) == before
        assert len(five) == 5
