"""``WeightStore``: the learner's parameters shared with its actors (issue 29, item 2).

What is proved: readers in other processes never see a mix of two versions while the learner
publishes as fast as it can (every element of every array says its version, and every read is
checked); a publisher SIGKILLed at random moments never gets its half-written copy delivered
(readers keep the last complete version, the next publisher goes on from it); killing readers
leaves nothing behind; version skipping, a template mismatch that changes nothing, attach by
name, adoption after the creator died, ``load_into`` a torch module, ``ls``/``gc``/``top``,
a pool's reclaim leaving the store alone, and tampered layouts refused at attach. Process tests
run under fork, forkserver and spawn, talk over pipes only (no semaphores in /dev/shm) and kill
what they started.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pickle
import random
import secrets
import signal
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import shmbuf
from shmbuf import cli, reclaim, top, weights
from shmbuf import layout as L
from shmbuf.errors import (
    ClosedError,
    SegmentExistsError,
    SegmentFormatError,
    SegmentNotFoundError,
    SpecMismatchError,
    Timeout,
)
from shmbuf.scan import scan
from shmbuf.segment import Segment
from shmbuf.shmdir import SHM_DIR
from shmbuf.weights import TornReadError, WeightStore
from shmbuf.weights_layout import COPIES, weights_doc, weights_layout

# About 550 KB a copy: big enough that a copy takes a while, so a torn read would be caught.
TEMPLATE = {
    "conv.weight": np.zeros((32, 4, 8, 8), np.float32),
    "conv.bias": np.zeros(32, np.float32),
    "fc.weight": np.zeros((512, 256), np.float32),
    "fc.bias": np.zeros(512, np.float64),
    "steps": np.zeros((), np.int64),
    "mask": np.zeros(1000, np.uint8),
}
READ_SECONDS = 2.5  # of publishing as fast as possible, per start method (CI has two cores)
KILL_ROUNDS = 12  # publishers SIGKILLed at a random moment, per start method


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def _name(tag: str) -> str:
    return f"shmbuf-test-weights-{tag}-{os.getpid()}-{secrets.token_hex(3)}"


def _value(version: int, dtype: np.dtype) -> int:
    """What every element of every array holds in ``version`` (the arrays' checksum)."""
    return version % 251 if np.dtype(dtype).itemsize == 1 else version


def _fill(arrays: dict[str, np.ndarray], version: int) -> dict[str, np.ndarray]:
    for a in arrays.values():
        a[...] = _value(version, a.dtype)
    return arrays


def _holds(arrays: dict[str, np.ndarray], version: int) -> bool:
    """Whether every element of every array says ``version`` (a torn copy does not)."""
    return all(bool(np.all(a == _value(version, a.dtype))) for a in arrays.values())


def _stamps(name: str) -> list[int]:
    """Each copy's stamp, read from the file (``weights_layout``), nothing mapped."""
    doc = weights_doc([(n, a.shape, a.dtype) for n, a in TEMPLATE.items()])
    lay = weights_layout([(n, a.shape, a.dtype) for n, a in TEMPLATE.items()],
                         len(L.encode_layout(doc)))
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    try:
        return [struct.unpack("<q", os.pread(fd, 8, lay.stamp_word(c) * 8))[0]
                for c in range(COPIES)]
    finally:
        os.close(fd)


def _file_bytes(name: str) -> bytes:
    with open(os.path.join(SHM_DIR, name), "rb") as f:
        return f.read()


def _ls(capsys: Any) -> dict[str, dict[str, Any]]:
    assert cli.main(["ls", "--json"]) == 0
    return {s["name"]: s for s in json.loads(capsys.readouterr().out)}


# --------------------------------------------------------------------------------------------
# Child processes (module level: spawn and forkserver children import them by name)
# --------------------------------------------------------------------------------------------
def _reader_main(conn: Any, name: str, how: str) -> None:
    """Read until the parent says stop, checking every read: all arrays say the version
    returned, versions never go back, ``if_newer_than`` only returns newer ones. ``how``:
    "numpy" (``read_into``) or "torch" (``load_into`` tensors that view NumPy arrays)."""
    report: dict[str, Any] = {"reads": 0, "changes": 0, "skips": 0, "torn": 0, "backwards": 0,
                              "errors": [], "examples": []}
    store = WeightStore.attach(name)
    try:
        out = store.new_arrays()
        if how == "torch":
            import torch

            # a forked child of a parent whose OpenMP pool ran hangs in its first parallel
            # region (libgomp is not fork-safe): one thread keeps torch out of them
            torch.set_num_threads(1)
            tensors = {n: torch.from_numpy(a) for n, a in out.items()}

            def read(newer: int | None) -> int | None:
                return store.load_into(tensors, if_newer_than=newer, timeout=30)
        else:
            def read(newer: int | None) -> int | None:
                return store.read_into(out, if_newer_than=newer, timeout=30)
        conn.send("ready")
        last = 0
        while not conn.poll():
            newer = last if report["reads"] % 2 else None
            got = read(newer)
            report["reads"] += 1
            if got is None:
                report["skips"] += 1
                continue
            if got < last or (newer is not None and got <= newer):
                report["backwards"] += 1
            if not _holds(out, got):
                report["torn"] += 1
                if len(report["examples"]) < 3:
                    report["examples"].append(
                        (got, {n: np.unique(a).tolist()[:4] for n, a in out.items()}))
            report["changes"] += got != last
            last = got
    except Exception as e:  # reported, not raised: the parent says what went wrong
        report["errors"].append(repr(e))
    finally:
        store.close()
    conn.send(report)


def _publisher_main(conn: Any, name: str) -> None:
    """Attach and publish versions back to back until killed; report the first one."""
    store = WeightStore.attach(name)
    arrays = {n: np.empty_like(a) for n, a in TEMPLATE.items()}
    first = True
    while True:
        version = store.version + 1
        assert store.publish(_fill(arrays, version), timeout=30) == version
        if first:
            conn.send(version)
            first = False


def _creator_main(conn: Any, name: str, versions: int, doc_extra: dict[str, Any]) -> None:
    """Create store ``name``, publish ``versions`` versions, report, and wait to be killed.
    ``doc_extra``: entries forged into its layout document (made through ``Segment``)."""
    if doc_extra:
        tensors = [(n, a.shape, a.dtype) for n, a in TEMPLATE.items()]
        doc = {**weights_doc(tensors), **doc_extra}
        store = WeightStore(Segment.create(name, L.KIND_WEIGHTS, doc,
                                           lambda n: weights_layout(tensors, n).total_size))
    else:
        store = WeightStore.create(name, template=TEMPLATE)
    arrays = {n: np.empty_like(a) for n, a in TEMPLATE.items()}
    for version in range(1, versions + 1):
        store.publish(_fill(arrays, version))
    conn.send(store.name)
    conn.poll(120)


@contextmanager
def _children(mp: Any) -> Iterator[Callable[..., tuple[Any, Any]]]:
    """``start(target, *args)`` -> (process, parent end of its pipe); everything started is
    SIGKILLed (if still alive) and joined, and every pipe closed, on the way out."""
    started: list[tuple[Any, Any]] = []

    def start(target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
        parent, child = mp.Pipe()
        proc = mp.Process(target=target, args=(child, *args), daemon=True)
        proc.start()
        child.close()
        started.append((proc, parent))
        return proc, parent

    try:
        yield start
    finally:
        for proc, parent in started:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
            parent.close()


def _recv(conn: Any, what: str, timeout: float = 60) -> Any:
    assert conn.poll(timeout), f"{what} never reported"
    return conn.recv()


def _stop(conn: Any) -> None:
    """Tell a reader to stop and report (one that failed has reported and gone already)."""
    with contextlib.suppress(BrokenPipeError):
        conn.send("stop")


def _sigkill(proc: Any) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL


def _dead_creator(start: Callable[..., tuple[Any, Any]], versions: int = 3,
                  **doc_extra: Any) -> str:
    """A store made by a child that published ``versions`` versions and was then SIGKILLed."""
    proc, conn = start(_creator_main, _name("dead"), versions, doc_extra)
    name = _recv(conn, "the creator")
    _sigkill(proc)
    return str(name)


# --------------------------------------------------------------------------------------------
# Processes: torn reads, SIGKILL, adoption, gc and reclaim
# --------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_readers_never_see_a_mix_of_versions_while_the_learner_publishes_flat_out(mp):
    """Three reader processes (two ``read_into``, one ``load_into`` when torch is installed)
    check every read while this process publishes as fast as it can for a few seconds: zero
    torn reads, versions only go forward, and the readers saw many versions."""
    hows = ["numpy", "numpy", "torch"] if _has_torch() else ["numpy", "numpy"]
    with WeightStore.create(template=TEMPLATE) as store, _children(mp) as start:
        readers = [start(_reader_main, store.name, how) for how in hows]
        for _, conn in readers:
            assert _recv(conn, "a reader") == "ready"
        arrays = {n: np.empty_like(a) for n, a in TEMPLATE.items()}
        deadline = time.monotonic() + READ_SECONDS
        while time.monotonic() < deadline:
            version = store.version + 1
            assert store.publish(_fill(arrays, version)) == version
        for _, conn in readers:
            _stop(conn)
        reports = [_recv(conn, "a reader") for _, conn in readers]
        published = store.version
    for how, rep in zip(hows, reports):
        assert rep["errors"] == [], (how, rep["errors"])
        assert rep["torn"] == 0, f"{how} reader got {rep['torn']} torn sets: {rep['examples']}"
        assert rep["backwards"] == 0
        assert rep["changes"] >= 20, (how, rep, published)
    assert published >= 100


@pytest.mark.timeout(180)
def test_a_publisher_killed_mid_publish_never_gets_its_half_written_copy_delivered(mp):
    """Publishers SIGKILLed at random moments, many times: after each kill the store reads
    whole at the last complete version (the other copy often half-written, stamped odd), a
    reader running throughout never gets a torn set, and each new publisher takes the dead
    one's lease and goes on from the last version."""
    rng = random.Random(29)
    killed_mid_copy, last = 0, 0
    with WeightStore.create(template=TEMPLATE) as store, _children(mp) as start:
        _, reader = start(_reader_main, store.name, "numpy")
        assert _recv(reader, "the reader") == "ready"
        out = store.new_arrays()
        for _ in range(KILL_ROUNDS):
            proc, conn = start(_publisher_main, store.name)
            assert _recv(conn, "a publisher") == last + 1  # on from the last whole version
            time.sleep(rng.uniform(0.0, 0.03))
            _sigkill(proc)
            version = store.version
            stamps = _stamps(store.name)
            assert stamps[version % COPIES] == L.stamp_held(version)
            other = stamps[(version + 1) % COPIES]
            assert other in (L.stamp_writing(version + 1), L.stamp_held(version + 1),
                             L.stamp_held(version - 1), 0), (version, stamps)
            killed_mid_copy += other == L.stamp_writing(version + 1)
            assert store.read_into(out, timeout=5) == version and _holds(out, version)
            last = version
        _stop(reader)
        rep = _recv(reader, "the reader")
        assert store.publish(_fill(out, last + 1), timeout=5) == last + 1  # the lease is free
    assert rep["errors"] == [] and rep["torn"] == 0 and rep["backwards"] == 0, rep
    assert killed_mid_copy >= 1, "no kill landed inside a copy: the test proved nothing"


@pytest.mark.timeout(120)
def test_killing_readers_leaves_nothing_and_the_publisher_goes_on(mp, own_shm_entries):
    """Readers SIGKILLed mid-read hold no lease and made nothing: /dev/shm holds only the
    store, the publisher keeps publishing, and a new reader reads the newest version."""
    rng = random.Random(7)
    with WeightStore.create(template=TEMPLATE) as store, _children(mp) as start:
        arrays = _fill({n: np.empty_like(a) for n, a in TEMPLATE.items()}, 1)
        store.publish(arrays)
        for _ in range(5):
            proc, conn = start(_reader_main, store.name, "numpy")
            assert _recv(conn, "a reader") == "ready"
            for _ in range(rng.randrange(1, 20)):
                store.publish(_fill(arrays, store.version + 1))
            _sigkill(proc)
            assert own_shm_entries() == {store.name}
        version = store.publish(_fill(arrays, store.version + 1), timeout=1)
        with WeightStore.attach(store.name) as fresh:
            out = fresh.new_arrays()
            assert fresh.read_into(out) == version and _holds(out, version)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["adopt", "create_adopt"])
def test_a_restarted_learner_adopts_the_store_its_dead_predecessor_created(mp, how, capsys):
    """The creator (the learner) is SIGKILLed: the store stays, listed as leaked, and an actor
    attached before goes on reading it. The new learner adopts it (``adopt``, or ``create``
    with ``adopt=True``, which refuses another template first), owns it, goes on from its
    last version, and the actor reads the new one."""
    with _children(mp) as start:
        name = _dead_creator(start, versions=3)
        actor = WeightStore.attach(name)
        try:
            assert _ls(capsys)[name]["state"] == "leaked"
            if how == "adopt":
                learner = WeightStore.adopt(name)
            else:
                with pytest.raises(SpecMismatchError, match="other tensors"):
                    WeightStore.create(name, template={"x": np.zeros(3)}, adopt=True)
                assert _ls(capsys)[name]["state"] == "leaked"  # refused: nothing changed
                learner = WeightStore.create(name, template=TEMPLATE, adopt=True)
            with learner:
                listed = _ls(capsys)[name]
                assert (listed["state"], listed["owner_pid"]) == ("alive", os.getpid())
                assert learner.version == 3
                arrays = _fill({n: np.empty_like(a) for n, a in TEMPLATE.items()}, 4)
                assert learner.publish(arrays) == 4
                out = actor.new_arrays()
                assert actor.read_into(out, if_newer_than=3) == 4 and _holds(out, 4)
            assert not os.path.exists(os.path.join(SHM_DIR, name))  # the adopter unlinked it
        finally:
            actor.close()


@pytest.mark.timeout(120)
def test_ls_shows_kind_and_version_and_gc_removes_only_a_dead_owners_store(mp, capsys):
    with _children(mp) as start, WeightStore.create(template=TEMPLATE) as live:
        dead = _dead_creator(start, versions=3)
        listed = _ls(capsys)
        assert (listed[dead]["kind"], listed[dead]["state"], listed[dead]["version"]) == (
            "weight store", "leaked", 3)
        assert (listed[live.name]["state"], listed[live.name]["version"]) == ("alive", 0)
        assert cli.main(["ls"]) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0].split()[-1] == "VERSION"
        (row,) = [r for r in table if r.startswith(dead)]
        assert row.split()[1:3] == ["weight", "store"] and row.split()[-1] == "3"
        assert cli.main(["gc", live.name, dead]) == 0
        out = capsys.readouterr().out
        assert f"kept {live.name}: alive" in out and f"removed {dead} (weight store" in out
        assert not os.path.exists(os.path.join(SHM_DIR, dead))
        assert live.version == 0 and os.path.exists(os.path.join(SHM_DIR, live.name))


@pytest.mark.timeout(120)
def test_a_pools_reclaim_of_dead_learners_segments_leaves_weight_stores_alone(mp):
    """``serves_buffer`` (what a ``SamplerPool`` removes when it opens) matches only staging
    rings and priority tables: a dead learner's weight store stays for the next learner to
    adopt, even one whose layout document names the buffer."""
    from workers import SamplerPool

    spec = shmbuf.Spec(x=((2,), "float32"))
    with shmbuf.ReplayBuffer.create(spec, capacity=8) as buf, _children(mp) as start:
        plain = _dead_creator(start)
        named = _dead_creator(start, buffer=buf.name)  # forged: a "buffer" key in its document
        infos = {i.name: i for i in scan()}
        assert not reclaim.serves_buffer(infos[named], buf.name)
        assert len(reclaim.remove_dead_segments(lambda i: reclaim.serves_buffer(i, buf.name))) == 0
        with buf.writer() as w:
            w.add(x=np.zeros(2, np.float32))
        with SamplerPool(buf, batch_size=1, workers=0) as pool:
            pool.next(timeout=30)
            assert pool.stats()["reclaimed_segments"] == 0
        for name in (plain, named):
            assert os.path.exists(os.path.join(SHM_DIR, name))
            WeightStore.adopt(name).close()  # the next learner's: it unlinks at close


# --------------------------------------------------------------------------------------------
# One process: versions, mismatches, attach, torch, top, tampering, timeouts
# --------------------------------------------------------------------------------------------
def test_version_skipping_copies_nothing_until_a_newer_version():
    with WeightStore.create(template=TEMPLATE) as store:
        assert store.version == 0
        with pytest.raises(Timeout, match="no published version"):
            store.read_into(store.new_arrays(), timeout=0.05)
        arrays = {n: np.empty_like(a) for n, a in TEMPLATE.items()}
        assert store.publish(_fill(arrays, 1)) == 1 and store.version == 1
        out = store.new_arrays()
        assert store.read_into(out) == 1 and _holds(out, 1)
        _fill(out, 99)
        assert store.read_into(out, if_newer_than=1) is None and _holds(out, 99)  # untouched
        assert store.read_into(out, if_newer_than=5) is None  # (a newer one than exists)
        assert store.publish(_fill(arrays, 2)) == 2
        assert store.read_into(out, if_newer_than=1) == 2 and _holds(out, 2)


def test_a_publish_that_does_not_fit_names_the_tensor_and_changes_nothing():
    with WeightStore.create(template=TEMPLATE) as store:
        good = _fill({n: np.empty_like(a) for n, a in TEMPLATE.items()}, 1)
        store.publish(good)
        before = _file_bytes(store.name)
        cases = {
            "shape": ({**good, "fc.weight": np.zeros((256, 512), np.float32)},
                      r"'fc.weight' .* shape \(256, 512\), but .* holds it as \(512, 256\)"),
            "dtype": ({**good, "fc.bias": np.zeros(512, np.float32)},
                      r"'fc.bias' .* dtype float32, but .* holds float64.*Fix: convert"),
            "missing": ({n: a for n, a in good.items() if n != "steps"}, r"lack 'steps'"),
            "extra": ({**good, "head.weight": np.zeros(3)}, r"have 'head.weight'"),
        }
        for params, message in cases.values():
            with pytest.raises(SpecMismatchError, match=message):
                store.publish(params)
        with pytest.raises(TypeError, match="mapping of name"):
            store.publish([1, 2, 3])
        assert _file_bytes(store.name) == before and store.version == 1
        with pytest.raises(SpecMismatchError, match="'conv.bias' .* shape"):
            store.read_into({**store.new_arrays(), "conv.bias": np.zeros(3, np.float32)})
        with pytest.raises(TypeError, match="cannot hold"):
            WeightStore.create(template={"x": np.array(["a"])})
        with pytest.raises(ValueError, match="no tensors"):
            WeightStore.create(template={})


def test_attach_by_name_refuses_a_missing_name_and_another_kind():
    with WeightStore.create(_name("attach"), template=TEMPLATE) as store:
        store.publish(_fill({n: np.empty_like(a) for n, a in TEMPLATE.items()}, 1))
        for reader in (WeightStore.attach(store.name), pickle.loads(pickle.dumps(store))):
            with reader:
                assert reader.tensors == {n: (a.shape, a.dtype) for n, a in TEMPLATE.items()}
                out = reader.new_arrays()
                assert reader.read_into(out) == 1 and _holds(out, 1)
        with pytest.raises(SegmentExistsError):
            WeightStore.create(store.name, template=TEMPLATE)
        with pytest.raises(SegmentExistsError, match="live owner"):
            WeightStore.adopt(store.name)
    with pytest.raises(SegmentNotFoundError):
        WeightStore.attach(_name("missing"))
    with shmbuf.ReplayBuffer.create(shmbuf.Spec(x=((2,), "float32")), capacity=4) as buf:
        with pytest.raises(SegmentFormatError, match="not a weight store"):
            WeightStore.attach(buf.name)


def test_one_publisher_at_a_time_and_closed_stores_refuse_everything():
    with WeightStore.create(template=TEMPLATE) as store:
        arrays = _fill({n: np.empty_like(a) for n, a in TEMPLATE.items()}, 1)
        store.publish(arrays)
        second = WeightStore.attach(store.name)
        with pytest.raises(Timeout, match=f"another live publisher \\(pid {os.getpid()}\\)"):
            second.publish(_fill(arrays, 2), timeout=0.05)
        assert store.version == 1
        store.close()  # the owner: unlinks, lets go of the lease; the second keeps its mapping
        assert second.publish(arrays, timeout=1) == 2
        second.close()
        second.close()  # idempotent
        for call in (lambda: store.version, lambda: store.publish(arrays),
                     lambda: store.read_into(arrays), lambda: pickle.dumps(store)):
            with pytest.raises(ClosedError):
                call()


def test_a_read_overwritten_every_time_is_a_torn_read_error_after_the_bound():
    """A read whose copy is overwritten during every try (the publisher publishing twice per
    copy) gives up after ``MAX_READ_TRIES`` copies with a TornReadError, never a torn set."""
    with WeightStore.create(template=TEMPLATE) as store:
        arrays = _fill({n: np.empty_like(a) for n, a in TEMPLATE.items()}, 1)
        store.publish(arrays)
        tries = []

        def copy_while_publishing(copy: int) -> None:
            tries.append(copy)
            store.publish(_fill(arrays, store.version + 1))
            store.publish(_fill(arrays, store.version + 1))

        words = store._words  # (the protocol, driven directly)
        with pytest.raises(TornReadError, match="overwritten"):
            weights.read_version(words, store._layout, copy_while_publishing, None, 10.0,
                                 store.name)
        assert len(tries) == weights.MAX_READ_TRIES


def test_load_into_a_torch_module_copies_parameters_and_buffers():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    def net() -> Any:
        return nn.Sequential(nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.Flatten(),
                             nn.Linear(8 * 6 * 6, 3))

    torch.manual_seed(0)
    learner, actor = net(), net()
    learner(torch.randn(2, 4, 8, 8))  # BatchNorm running stats and its counter move
    with WeightStore.create(template=learner.state_dict()) as store:
        assert store.publish(learner) == 1  # a module: its state_dict
        assert store.load_into(actor) == 1
        for (name, a), b in zip(learner.state_dict().items(), actor.state_dict().values()):
            assert torch.equal(a, b), name
        assert store.load_into(actor, if_newer_than=1) is None
        with torch.no_grad():
            learner[3].weight.add_(1.0)
        sd = learner.state_dict()
        sd["3.weight"] = sd["3.weight"].t().contiguous().t()  # any strides
        assert store.publish(sd) == 2 and store.load_into(actor, if_newer_than=1) == 2
        assert torch.equal(actor[3].weight, learner[3].weight)
        assert actor[3].weight.requires_grad and actor[3].weight.is_leaf
        before = {n: t.clone() for n, t in actor.state_dict().items()}
        with pytest.raises(SpecMismatchError, match="lack"):
            store.load_into(nn.Linear(3, 3))
        with pytest.raises(SpecMismatchError, match="bfloat16|dtype"):
            store.publish({**sd, "3.bias": sd["3.bias"].to(torch.bfloat16)})
        assert all(torch.equal(before[n], t) for n, t in actor.state_dict().items())


@pytest.mark.gpu
def test_tensors_on_a_gpu_are_published_and_loaded():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    learner = torch.nn.Linear(16, 4).cuda()
    actor = torch.nn.Linear(16, 4).cuda()
    with WeightStore.create(template=learner.state_dict()) as store:
        assert store.publish(learner) == 1 and store.load_into(actor) == 1
        assert torch.equal(actor.weight, learner.weight) and actor.weight.is_cuda


def test_top_shows_each_store_with_its_version_and_publishes_per_second():
    with WeightStore.create(template=TEMPLATE) as store:
        arrays = {n: np.empty_like(a) for n, a in TEMPLATE.items()}
        view = top.Top()
        try:
            view.frame()
            for version in range(1, 11):
                store.publish(_fill(arrays, version))
            time.sleep(0.2)
            frame = view.frame()
        finally:
            view.close()
        assert "WEIGHTS" in " ".join(frame)
        (line,) = [ln for ln in frame if ln.startswith(store.name)]
        cells = line.split()
        assert int(cells[1]) == 10 and float(cells[2]) > 0
        assert f"{os.getpid()} alive" in line and f"{len(TEMPLATE)} (" in line


def _rewrite_doc(name: str, doc: dict[str, Any]) -> None:
    """Put ``doc`` in segment ``name``'s header in place of its layout document."""
    payload = L.encode_layout(doc)
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        (old,) = struct.unpack("<I", os.pread(fd, 4, L.H_JSON_LEN))
        os.pwrite(fd, payload + b"\0" * max(0, old - len(payload)), L.H_JSON)
        os.pwrite(fd, struct.pack("<I", len(payload)), L.H_JSON_LEN)
    finally:
        os.close(fd)


# Tensor 2 is fc.weight, (512, 256) float32. A shape whose product overflows 64 bits (2**110
# wraps to 0 in int64 arithmetic) must not pass for a small one: sizes are exact integers.
TAMPERED: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    "dimension_out_of_range": lambda t: t[2].update(shape=[2**64]),
    "shape_past_64_bits": lambda t: t[2].update(shape=[2**40, 2**40, 2**30]),
    "shape_bigger_than_the_file": lambda t: t[2].update(shape=[2**20, 512]),
    "shape_that_moves_the_layout": lambda t: t[2].update(shape=[256, 256]),
    "object_dtype": lambda t: t[0].update(dtype="|O"),
    "a_name_twice": lambda t: t[1].update(name=t[0]["name"]),
}


@pytest.mark.parametrize("how", [*TAMPERED, "three_copies", "no_tensors"])
def test_a_tampered_layout_is_a_segment_format_error_at_attach(how):
    with WeightStore.create(_name("tamper"), template=TEMPLATE) as store:
        doc = weights_doc([(n, a.shape, a.dtype) for n, a in TEMPLATE.items()])
        if how == "three_copies":
            doc["copies"] = 3
        elif how == "no_tensors":
            del doc["tensors"]
        else:
            TAMPERED[how](doc["tensors"])
        _rewrite_doc(store.name, doc)
        fds = len(os.listdir("/proc/self/fd"))
        with pytest.raises(SegmentFormatError, match=store.name):
            WeightStore.attach(store.name, timeout=0)
        assert len(os.listdir("/proc/self/fd")) == fds  # nothing left open
        assert top.read_weights(next(i for i in scan() if i.name == store.name)) is None
