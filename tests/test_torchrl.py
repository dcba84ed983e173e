"""``shmbuf.integrations.torchrl.Storage`` under TorchRL's own ReplayBuffer, writer and samplers:
the same samples as TorchRL's ``LazyTensorStorage`` fed the same data, priorities that change
draw frequencies, state dicts, and writers in other processes. Skipped without torchrl.
"""

from __future__ import annotations

import gc
import multiprocessing
import pickle

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

from shmbuf import SpecMismatchError  # noqa: E402
from shmbuf.integrations.torchrl import CursorMismatchError, Storage  # noqa: E402

CAPACITY = 16
CHILD_TIMEOUT = 60.0


def batch(first: int, n: int) -> TensorDict:
    """Rows ``first .. first+n-1``, every entry derived from the row number (nested keys too)."""
    i = torch.arange(first, first + n)
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


def test_cursor_mismatch_and_in_place_writes_raise():
    with Storage(CAPACITY) as storage:
        rb = ReplayBuffer(storage=storage, batch_size=2)
        rb.extend(batch(0, 3))
        other = Storage.from_name(storage.name)
        try:
            storage.close_writer()
            other.extend(batch(3, 2))  # appended behind TorchRL's writer
            other.close_writer()
            with pytest.raises(CursorMismatchError, match="next position is 5"):
                rb.extend(batch(10, 2))
            assert len(rb) == 5
            with pytest.raises(CursorMismatchError):
                rb.storage[0] = batch(0, 1)[0]
        finally:
            other.close()


def test_bad_input_is_refused_and_changes_nothing():
    with Storage(CAPACITY) as storage:
        rb = ReplayBuffer(storage=storage, batch_size=2)
        rb.extend(batch(0, 3))
        with pytest.raises(SpecMismatchError, match="'action'"):
            storage.extend(batch(3, 2).exclude("action"))
        with pytest.raises(TypeError, match="TensorDict"):
            storage.extend(torch.zeros(3))  # type: ignore[arg-type]
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
