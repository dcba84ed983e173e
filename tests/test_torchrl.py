"""``shmbuf.integrations.torchrl.Storage`` under TorchRL's own ReplayBuffer, writer and samplers:
the same samples as TorchRL's ``LazyTensorStorage`` fed the same data, priorities that change
draw frequencies, state dicts, and writers in other processes, also copies made before the first
write (TorchRL's ``rb.share()`` pattern): the same rows in every copy, one segment, owned and
unlinked by the process that made the storage. Skipped without torchrl.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import signal
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
_start_method = multiprocessing.get_start_method(allow_none=True)
pytest.importorskip("torchrl")
# Importing torchrl sets the process-wide start method to "spawn"; the rest of the suite runs
# in this process (collection imports every test module), so put back what was there.
multiprocessing.set_start_method(_start_method, force=True)
from tensordict import TensorDict  # noqa: E402
from torchrl.data import (  # noqa: E402
    LazyTensorStorage,
    PrioritizedSampler,
    RandomSampler,
    ReplayBuffer,
    SamplerWithoutReplacement,
)

import shmbuf  # noqa: E402
from shmbuf import SegmentExistsError, SpecMismatchError  # noqa: E402
from shmbuf.integrations.torchrl import CursorMismatchError, Storage  # noqa: E402

CAPACITY = 16
CHILD_TIMEOUT = 60.0


def batch(first: int, n: int) -> TensorDict:
    """Rows ``first .. first+n-1``, every entry derived from the row number (nested keys too)."""
    return rows_of(torch.arange(first, first + n))


def rows_of(i: torch.Tensor) -> TensorDict:
    """The rows numbered ``i`` (int64), as ``batch`` makes them."""
    n = len(i)
    return TensorDict({
        "obs": i[:, None].float() * torch.ones(n, 3),
        "action": i,
        "next": {"obs": i[:, None].float() + 0.5 * torch.ones(n, 3),
                 "done": (i % 5 == 0)[:, None]},
        "reward": i.to(torch.float16) / 4,
    }, batch_size=[n])


def feed(rb: ReplayBuffer) -> None:
    """A partial batch, a wrap, single adds, and one batch longer than the ring."""
    rb.extend(batch(0, 7))
    rb.extend(batch(7, 13))
    rb.add(batch(20, 1)[0])
    rb.add(batch(21, 1)[0])
    rb.extend(batch(22, 3 * CAPACITY + 5))


@pytest.fixture(autouse=True)
def free_torchrl_semaphores():
    """TorchRL's writers and storages hold ``mp.Value`` counters (POSIX semaphores in /dev/shm)
    inside reference cycles: collect them before conftest checks that /dev/shm is as it was."""
    yield
    gc.collect()


def assert_same(a: TensorDict, b: TensorDict) -> None:
    assert a.batch_size == b.batch_size
    assert sorted(map(str, a.keys(True, True))) == sorted(map(str, b.keys(True, True)))
    for key in a.keys(True, True):
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("sampler", [RandomSampler, SamplerWithoutReplacement])
def test_same_samples_as_lazy_tensor_storage(sampler):
    with Storage(CAPACITY) as storage:
        ours = ReplayBuffer(storage=storage, sampler=sampler(), batch_size=8)
        theirs = ReplayBuffer(storage=LazyTensorStorage(CAPACITY), sampler=sampler(), batch_size=8)
        for rb in (ours, theirs):
            feed(rb)
        assert len(ours) == len(theirs) == CAPACITY
        assert_same(storage.get(torch.arange(CAPACITY)), theirs.storage.get(torch.arange(CAPACITY)))
        for seed in range(5):
            torch.manual_seed(seed)
            mine = ours.sample()
            torch.manual_seed(seed)
            assert_same(mine, theirs.sample())


def test_len_grows_to_max_size_and_empties():
    with Storage(CAPACITY) as storage:
        rb = ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=4)
        assert len(rb) == 0
        rb.extend(batch(0, 5))
        assert len(rb) == len(storage) == 5
        rb.extend(batch(5, CAPACITY))
        assert len(rb) == CAPACITY
        rb.empty()
        assert len(rb) == 0
        rb.extend(batch(100, 3))  # after empty(), position 0 again
        assert len(rb) == 3
        assert storage[0]["action"].item() == 100
        assert storage[torch.tensor([2, 1])]["action"].tolist() == [102, 101]


def test_single_rows_and_nested_keys_come_back():
    with Storage(CAPACITY) as storage:
        rb = ReplayBuffer(storage=storage, batch_size=2)
        rb.extend(batch(0, 4))
        row = storage[3]
        assert row.batch_size == torch.Size([])
        assert_same(row, batch(3, 1)[0])
        assert isinstance(row["next", "done"], torch.Tensor) and row["next", "done"].dtype == torch.bool
        assert "next/obs" in storage.buffer.spec  # nested keys are "/"-joined field names


def test_sampled_rows_are_owned_copies():
    with Storage(CAPACITY) as storage:
        rb = ReplayBuffer(storage=storage, sampler=SamplerWithoutReplacement(), batch_size=CAPACITY)
        rb.extend(batch(0, CAPACITY))
        first = rb.sample()
        kept = first["action"].clone()
        rb.extend(batch(CAPACITY, CAPACITY))  # overwrites every row
        assert torch.equal(first["action"], kept)


class NumpySegmentTree:
    """Stand-in for TorchRL's C++ sum/min segment trees (the same methods, flat arrays), used
    only where ``torchrl._torchrl`` does not load: the torchrl 0.14.1 wheel is built against
    another torch ABI than the pinned torch 2.13.0 (undefined symbol on import). The sampler
    logic under test stays TorchRL's own."""

    def __init__(self, size: int, op, identity: float) -> None:
        self.values = np.full(size, identity, np.float64)
        self.op, self.identity = op, identity

    def __len__(self) -> int:
        return self.values.size

    def __getitem__(self, index):
        out = self.values[np.asarray(index)]
        return float(out) if np.ndim(out) == 0 else torch.as_tensor(out)

    def __setitem__(self, index, value) -> None:
        self.values[np.asarray(index)] = np.asarray(value)

    def query(self, left: int, right: int) -> float:
        part = self.values[left:right]
        return float(self.op(part)) if part.size else self.identity

    def scan_lower_bound(self, mass):
        """Smallest i with sum(values[:i+1]) >= mass, or len(self) past the total (as in C++)."""
        return torch.as_tensor(np.searchsorted(np.cumsum(self.values), np.asarray(mass)))


@pytest.fixture
def segment_trees(monkeypatch):
    """TorchRL's segment trees, or the stand-in where its C++ extension does not load."""
    from torchrl.data.replay_buffers.samplers import prioritized

    if prioritized.SumSegmentTreeFp32 is None:
        for bits in ("32", "64"):
            monkeypatch.setattr(prioritized, f"SumSegmentTreeFp{bits}",
                                lambda n: NumpySegmentTree(n, np.sum, 0.0))
            monkeypatch.setattr(prioritized, f"MinSegmentTreeFp{bits}",
                                lambda n: NumpySegmentTree(n, np.min, np.inf))


def test_prioritized_sampler_follows_updated_priorities(segment_trees):
    from scipy.stats import chisquare

    with Storage(CAPACITY) as storage:
        alpha, n_draws = 0.8, 40_000
        rb = ReplayBuffer(storage=storage, sampler=PrioritizedSampler(CAPACITY, alpha=alpha, beta=0.4),
                          batch_size=1000)
        rb.extend(batch(0, CAPACITY))
        priority = torch.arange(1, CAPACITY + 1, dtype=torch.float64) ** 2
        rb.update_priority(torch.arange(CAPACITY), priority)
        torch.manual_seed(0)
        counts = torch.zeros(CAPACITY)
        for _ in range(n_draws // 1000):
            sample, info = rb.sample(return_info=True)
            assert torch.equal(sample["action"], info["index"])  # rows are the drawn positions
            counts += torch.bincount(info["index"], minlength=CAPACITY)
        expected = priority ** alpha / (priority ** alpha).sum() * n_draws
        assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3
        assert chisquare(counts.numpy()).pvalue < 1e-6  # and far from uniform


def test_state_dict_round_trip():
    with Storage(CAPACITY) as storage:
        rb = ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=8)
        feed(rb)
        state = pickle.loads(pickle.dumps(rb.state_dict()))
        restored = Storage(CAPACITY)
        try:
            rb2 = ReplayBuffer(storage=restored, sampler=RandomSampler(), batch_size=8)
            rb2.load_state_dict(state)
            assert len(rb2) == len(rb)
            assert_same(restored.get(torch.arange(CAPACITY)), storage.get(torch.arange(CAPACITY)))
            for rbuf in (rb, rb2):  # the writer's cursor and the ring agree after the load
                rbuf.extend(batch(500, 3))
            torch.manual_seed(1)
            mine = rb2.sample()
            torch.manual_seed(1)
            assert_same(mine, rb.sample())
        finally:
            restored.close()


def test_dumps_loads_round_trip(tmp_path):
    with Storage(CAPACITY) as storage, Storage(CAPACITY) as restored:
        rb = ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=8)
        feed(rb)
        rb.dumps(tmp_path / "rb")
        rb2 = ReplayBuffer(storage=restored, sampler=RandomSampler(), batch_size=8)
        rb2.loads(tmp_path / "rb")
        for rbuf in (rb, rb2):
            rbuf.extend(batch(700, 5))
        assert len(rb2) == CAPACITY
        assert_same(restored.get(torch.arange(CAPACITY)), storage.get(torch.arange(CAPACITY)))


def test_writes_at_held_positions_rewrite_and_new_positions_must_come_next():
    """A writer whose cursor another process moved rewrites the rows at its positions (as
    ``LazyTensorStorage`` would); a new position past the next one raises before any store."""
    with Storage(CAPACITY) as storage:
        rb = ReplayBuffer(storage=storage, batch_size=2)
        rb.extend(batch(0, 3))
        other = Storage.from_name(storage.name)
        try:
            storage.close_writer()
            other.extend(batch(3, 2))  # appended behind TorchRL's writer (cursor 3)
            other.close_writer()
            rb.extend(batch(10, 2))  # positions 3, 4: held, rewritten in place
            assert len(rb) == 5
            assert storage[torch.arange(5)]["action"].tolist() == [0, 1, 2, 10, 11]
            rb.storage[0] = batch(20, 1)[0]
            assert storage[0]["action"].item() == 20
            with pytest.raises(CursorMismatchError, match=r"positions \[7\]"):
                storage.set(torch.tensor([1, 7]), batch(30, 2))
            assert storage[torch.arange(5)]["action"].tolist() == [20, 1, 2, 10, 11]
        finally:
            other.close()


def test_bad_input_is_refused_and_changes_nothing():
    with Storage(CAPACITY) as storage:
        rb = ReplayBuffer(storage=storage, batch_size=2)
        rb.extend(batch(0, 3))
        with pytest.raises(SpecMismatchError, match="'action'"):
            storage.extend(batch(3, 2).exclude("action"))
        with pytest.raises(SpecMismatchError, match="rows are a tensor"):
            storage.extend(torch.zeros(3))  # the storage holds TensorDicts
        with pytest.raises(SpecMismatchError, match="bfloat16"):
            Storage(4).extend(TensorDict({"x": torch.zeros(2, dtype=torch.bfloat16)}, [2]))
        assert len(rb) == 3
        assert storage[torch.arange(3)]["action"].tolist() == [0, 1, 2]


def _actor(name: str, first: int, n: int) -> None:
    """A writer process: appends rows ``first..first+n-1`` to the storage named ``name``."""
    st = Storage.from_name(name)
    try:
        for i in range(first, first + n, 4):
            st.extend(batch(i, 4))
    finally:
        st.close()


def test_actor_in_another_process_writes_learner_samples(mp):
    storage = Storage(CAPACITY, example=batch(0, 1))  # the segment exists before any write
    try:
        rb = ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=64)
        p = mp.Process(target=_actor, args=(storage.name, 0, 40))
        p.start()
        p.join(CHILD_TIMEOUT)
        assert p.exitcode == 0, p.exitcode
        assert len(rb) == CAPACITY
        sample = rb.sample()
        assert set(sample["action"].tolist()) <= set(range(40 - CAPACITY, 40))
        assert_same(sample, batch(0, 40)[sample["action"]])
        pickled = pickle.loads(pickle.dumps(storage))  # re-attaches by name
        try:
            assert_same(pickled.get(torch.arange(CAPACITY)), storage.get(torch.arange(CAPACITY)))
        finally:
            pickled.close()
    finally:
        if "p" in locals() and p.is_alive():
            p.kill()
            p.join(5)
        storage.close()


def test_segment_is_unlinked_on_close():
    storage = Storage(4, example=batch(0, 1))
    name = storage.name
    storage.close()
    with pytest.raises(Exception, match=name):
        Storage.from_name(name, timeout=0.1)


# -- copies made before the first write (the segment's name is fixed when the storage is made) ----
def _segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_copy_pickled_before_the_first_write_holds_the_same_rows():
    """The issue's case: ``c = pickle.loads(pickle.dumps(s)); c.extend(td)`` wrote to a buffer
    of its own; now both write and read one segment, which the original unlinks at close."""
    with Storage(CAPACITY) as storage:
        copy = pickle.loads(pickle.dumps(storage))
        try:
            copy.extend(batch(0, 3))  # the copy's first write creates the segment
            assert len(storage) == 3
            assert_same(storage.get(torch.arange(3)), batch(0, 3))
            copy.close_writer()
            storage.extend(batch(3, 2))  # and the original's rows reach the copy
            assert len(copy) == 5
            assert_same(copy.get(torch.arange(5)), batch(0, 5))
        finally:
            copy.close()
        assert _segment_exists(storage.name)  # a copy's close leaves it to the original
        assert len(storage) == 5 and storage.buffer.is_owner  # adopted once the copy let go
        name = storage.name
    assert not _segment_exists(name)


def test_first_batch_of_a_copy_must_fit_the_spec_another_copy_created():
    with Storage(CAPACITY) as storage:
        first, second = (pickle.loads(pickle.dumps(storage)) for _ in range(2))
        try:
            first.extend(batch(0, 2))
            wider = batch(0, 2).set("obs", torch.zeros(2, 4))
            with pytest.raises(SpecMismatchError, match=r"'obs': shape \(4,\) float32 here, "
                                                        r"shape \(3,\) float32 in the segment"):
                second.extend(wider)
            with pytest.raises(SpecMismatchError, match="'extra': shape"):
                second.extend(batch(0, 2).set("extra", torch.zeros(2)))
            assert len(storage) == 2  # nothing was written
            first.close_writer()
            second.extend(batch(2, 2))  # a batch that fits goes in
            assert len(storage) == 4
        finally:
            first.close()
            second.close()


def test_named_storage_never_takes_over_an_older_segment():
    """A name given to ``Storage`` that an unrelated, older segment holds is refused at the
    first write, as before (the created-after check tells it from a copy's segment)."""
    with shmbuf.ReplayBuffer.create({"action": ((), "int64")}, 4) as other:
        time.sleep(1.5)  # older than the storage by more than the clock slack
        storage = Storage(CAPACITY, name=other.name)
        with pytest.raises(SegmentExistsError, match="exists from before this Storage"):
            storage.extend(batch(0, 2))
        storage.close()
        assert _segment_exists(other.name)  # left alone


def _collector(rb: ReplayBuffer, first: int, n: int, go: object) -> None:
    """A worker of TorchRL's share() pattern: appends rows ``first..first+n-1``, 4 at a time,
    through its copy of the shared ReplayBuffer, then stays until ``go``."""
    for i in range(first, first + n, 4):
        rb.extend(batch(i, 4))
    go.wait(CHILD_TIMEOUT)  # type: ignore[attr-defined]


def _count_later(storage: Storage, go: object, out: object) -> None:
    """A copy given before any write (not attached) reads what was written since, by name."""
    go.wait(CHILD_TIMEOUT)  # type: ignore[attr-defined]
    actions = storage.get(torch.arange(len(storage)))["action"].tolist()
    out.put((len(storage), actions))  # type: ignore[attr-defined]


def _kill_all(procs) -> None:
    for p in procs:
        if p.pid is None:  # never started
            continue
        if p.is_alive():
            p.kill()
        p.join(5)


@pytest.fixture
def default_start_method(start_method):
    """``start_method`` as the process-wide default while the test runs: TorchRL makes its
    shared counters and locks (``rb.share()``) in the default context, and the stdlib refuses
    to send them to a process of another one."""
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(start_method, force=True)
    yield start_method
    multiprocessing.set_start_method(before, force=True)


@pytest.mark.timeout(240)
def test_shared_replay_buffer_collectors_write_first_the_learner_samples_all(
        default_start_method):
    """TorchRL's multiprocess pattern: ``rb.share()``, the buffer sent to collector processes
    before anything was written, ``rb.extend`` there. Every row lands in the one segment (none
    in a buffer of a worker's own), the learner writes after them, a reader made before the
    first write sees it all, and the learner, which made the storage, owns and unlinks it."""
    ctx = multiprocessing.get_context()  # TorchRL shares its counters and locks the stdlib's way
    storage = Storage(64)
    procs = []
    try:
        rb = ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=16).share()
        go, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_collector, args=(rb, 100 * k, 16, go)) for k in (1, 2)]
        procs.append(ctx.Process(target=_count_later, args=(storage, go, out)))
        for p in procs:
            p.start()
        deadline = time.monotonic() + CHILD_TIMEOUT
        while len(rb) < 32:
            assert time.monotonic() < deadline and all(p.exitcode is None for p in procs)
            time.sleep(0.05)
        # The learner's own rows, while the collectors live (the creator holds the segment).
        rb.extend(batch(0, 8))
        assert not storage.buffer.is_owner
        expected = set(range(8)) | set(range(100, 116)) | set(range(200, 216))
        assert len(rb) == 40
        held = storage.get(torch.arange(40))
        assert set(held["action"].tolist()) == expected
        assert_same(held, rows_of(held["action"]))  # every row whole
        sample = rb.sample()
        assert_same(sample, rows_of(sample["action"]))
        go.set()
        seen, actions = out.get(timeout=CHILD_TIMEOUT)
        for p in procs:
            p.join(CHILD_TIMEOUT)
        assert [p.exitcode for p in procs] == [0, 0, 0]
        assert seen == 40 and set(actions) == expected
        assert storage.buffer.is_owner  # adopted once the collector that created it exited
        name = storage.name
    finally:
        _kill_all(procs)
        storage.close()
    assert not _segment_exists(name)


def _first_write(storage: Storage, first: int, barrier: object) -> None:
    barrier.wait(CHILD_TIMEOUT)  # type: ignore[attr-defined]
    storage.extend(batch(first, 4))
    storage.close_writer()


@pytest.mark.timeout(240)
def test_first_writes_racing_in_two_processes_make_one_segment(mp):
    """Two copies write their first batch at once: one creates the segment, the other attaches
    (``SegmentExistsError`` then attach); the original sees both batches."""
    storage = Storage(CAPACITY)
    procs = []
    try:
        barrier = mp.Barrier(2)
        procs = [mp.Process(target=_first_write, args=(storage, first, barrier))
                 for first in (0, 100)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(CHILD_TIMEOUT)
        assert [p.exitcode for p in procs] == [0, 0]
        assert len(storage) == 8
        held = storage.get(torch.arange(8))["action"].tolist()
        assert sorted(held) == [0, 1, 2, 3, 100, 101, 102, 103]
        name = storage.name
    finally:
        _kill_all(procs)
        storage.close()
    assert not _segment_exists(name)


def _write_then_wait(storage: Storage, written: object) -> None:
    storage.extend(batch(0, 6))
    written.set()  # type: ignore[attr-defined]
    time.sleep(CHILD_TIMEOUT)  # killed here


@pytest.mark.timeout(120)
def test_segment_made_by_a_killed_worker_is_adopted_and_unlinked(mp):
    """A worker creates the segment with its first write and is SIGKILLed: its rows stay, the
    process that made the storage adopts the segment and unlinks it at close."""
    storage = Storage(CAPACITY)
    written = mp.Event()
    p = mp.Process(target=_write_then_wait, args=(storage, written))
    try:
        p.start()
        assert written.wait(CHILD_TIMEOUT)
        assert len(storage) == 6 and not storage.buffer.is_owner  # the live worker holds it
        os.kill(p.pid, signal.SIGKILL)
        p.join(CHILD_TIMEOUT)
        assert len(storage) == 6 and storage.buffer.is_owner
        assert_same(storage.get(torch.arange(6)), batch(0, 6))
        name = storage.name
    finally:
        _kill_all([p])
        storage.close()
    assert not _segment_exists(name)


def test_original_unlinks_at_close_while_a_copy_holds_the_segment():
    storage = Storage(CAPACITY)
    copy = pickle.loads(pickle.dumps(storage))
    try:
        copy.extend(batch(0, 2))  # the copy created it and holds its owner lease
        assert len(storage) == 2 and not storage.buffer.is_owner
        storage.close()
        assert not _segment_exists(storage.name)
        assert len(copy) == 2  # its own mapping stays valid until it closes
    finally:
        copy.close()
        storage.close()


def _home_exits_without_close(names: object, leave: object, start_method: str) -> None:
    """The process that makes a storage, whose child copy creates the segment; it never uses
    the storage again and exits without close(), its child still running."""
    import multiprocess

    storage = Storage(CAPACITY)
    names.put(storage.name)  # type: ignore[attr-defined]
    ctx = multiprocess.get_context(start_method)
    written = ctx.Event()
    child = ctx.Process(target=_write_then_wait, args=(storage, written), daemon=True)
    child.start()
    assert written.wait(CHILD_TIMEOUT)
    names.put(child.pid)  # type: ignore[attr-defined]
    assert leave.wait(CHILD_TIMEOUT)  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_process_that_made_the_storage_unlinks_it_at_exit(mp, start_method):
    """Whoever created the segment, it goes when the process that made the storage exits (its
    daemon child copy, which created it, is ended with it)."""
    names, leave = mp.Queue(), mp.Event()
    home = mp.Process(target=_home_exits_without_close, args=(names, leave, start_method))
    child_pid = None
    try:
        home.start()
        name = names.get(timeout=CHILD_TIMEOUT)
        child_pid = names.get(timeout=CHILD_TIMEOUT)
        assert _segment_exists(name)  # made by the child, while both live
        leave.set()
        home.join(CHILD_TIMEOUT)
        assert home.exitcode == 0
        assert not _segment_exists(name)  # unlinked on the home's way out, before it ended
    finally:
        _kill_all([home])
        if child_pid is not None:
            try:
                os.kill(child_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
