"""``LazyTensorStorage``'s contract, as TorchRL documents and tests it, run against TorchRL's own
``LazyTensorStorage`` and shmbuf's ``Storage`` alike (every test is parametrized over both), so
they must agree: what goes in (TensorDicts with batch dims, plain tensors, pytrees, lists of
items, ``ndim=2``), ``set``/``get`` at positions, ``len``, ``rb.extend``/``sample``/``rb[i]``,
writes at held positions (``rb[i] = td``, ``rb[1:2] = td``, ``TensorDictMaxValueWriter``),
state dicts, pickling, TorchRL's samplers over the storage, and writers in other processes
through a shared ReplayBuffer (``rb.share()``, ``shared_init``), every row delivered once.

Each payload checks itself: every entry of row ``i`` is derived from ``i``. Written from
TorchRL's documentation and the semantics of its tests (``test/rb/test_storages.py``), not its
code. Skipped without torchrl.
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
multiprocessing.set_start_method(_start_method, force=True)  # importing torchrl sets "spawn"
from tensordict import TensorDict  # noqa: E402
from torchrl.data import (  # noqa: E402
    LazyTensorStorage,
    PrioritizedSampler,
    RandomSampler,
    ReplayBuffer,
    SliceSampler,
    TensorDictMaxValueWriter,
    TensorDictReplayBuffer,
)

from shmbuf import ShmbufError, SpecMismatchError  # noqa: E402
from shmbuf.integrations.torchrl import CursorMismatchError, Storage  # noqa: E402
from tests.test_torchrl import segment_trees  # noqa: E402, F401 (a fixture)

N = 12
CHILD_TIMEOUT = 90.0
STORAGES = {"lazy": LazyTensorStorage, "shmbuf": Storage}


@pytest.fixture(params=list(STORAGES))
def make(request):
    """Makes storages of the parametrized kind; closes shmbuf's at the end."""
    made = []

    def build(max_size: int, **kw):
        storage = STORAGES[request.param](max_size, **kw)
        made.append(storage)
        return storage

    yield build
    for storage in made:
        if isinstance(storage, Storage):
            storage.close()
    made.clear()
    gc.collect()  # TorchRL's mp.Value counters live in /dev/shm: free them before the check


def rows(first: int, n: int, time: int | None = None) -> TensorDict:
    """Rows ``first ..``, each entry derived from the row number (nested keys, a bool, a
    float16); with ``time``, batch ``[n, time]`` numbered ``first + i*time + t``."""
    shape = (n,) if time is None else (n, time)
    i = torch.arange(first, first + int(np.prod(shape))).reshape(shape)
    return TensorDict({
        "obs": i[..., None].float() * torch.ones(*shape, 3),
        "action": i,
        "next": {"obs": i[..., None].float() + 0.5, "done": (i % 4 == 3)[..., None]},
        "reward": i.to(torch.float16) / 4,
    }, batch_size=shape)


def assert_same(a, b) -> None:
    """Equal data: TensorDicts (keys, batch size, dtypes, values), tensors, or pytrees."""
    if isinstance(a, TensorDict) or hasattr(a, "batch_size"):
        assert a.batch_size == b.batch_size
        assert sorted(map(str, a.keys(True, True))) == sorted(map(str, b.keys(True, True)))
        for key in a.keys(True, True):
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)


# --------------------------------------------------------------------------------------------
# What goes in
# --------------------------------------------------------------------------------------------
def test_tensordicts_with_batch_dims_come_back_as_written(make):
    rb = ReplayBuffer(storage=make(N), batch_size=4)
    data = rows(0, 5, time=3)  # batch [5, 3]: the second dim stays a batch dim
    rb.extend(data)
    assert len(rb) == 5
    assert_same(rb[:], data)
    assert_same(rb[2], data[2])
    assert rb.sample().batch_size == torch.Size([4, 3])


def test_plain_tensors(make):
    rb = ReplayBuffer(storage=make(N), batch_size=4)
    data = torch.arange(7)[:, None] * torch.ones(7, 2, dtype=torch.int64)
    rb.extend(data)
    assert len(rb) == 7
    assert_same(rb[:], data)
    assert_same(rb[3], data[3])
    sample = rb.sample()
    assert sample.shape == (4, 2) and bool((sample[:, 0] == sample[:, 1]).all())


def test_pytrees_of_tensors(make):
    rb = ReplayBuffer(storage=make(N), batch_size=5)
    i = torch.arange(9)
    data = {"obs": i[:, None] * torch.ones(9, 2), "pair": (i, i.double() / 2)}
    rb.extend(data)
    assert len(rb) == 9
    assert_same(rb[:], data)
    got = rb[torch.tensor([8, 1])]
    assert got["pair"][0].tolist() == [8, 1] and got["pair"][1].tolist() == [4.0, 0.5]
    sample = rb.sample()
    assert torch.equal(sample["obs"][:, 0].long(), sample["pair"][0])


def test_lists_are_items_one_row_each(make):
    rb = ReplayBuffer(storage=make(N), batch_size=2)
    rb.extend([torch.full((3,), k) for k in range(4)])
    assert len(rb) == 4
    assert rb[:].tolist() == [[k] * 3 for k in range(4)]


def test_ndim_2_envs_by_time(make):
    """``ndim=2``: TorchRL's ReplayBuffer extends along time (``dim_extend=1``): a row of the
    storage is one step of every env; ``len`` counts elements; samples are elements."""
    storage = make(N * 4, ndim=2)
    rb = ReplayBuffer(storage=storage, batch_size=6)
    data = rows(0, 4, time=5)  # 4 envs x 5 steps
    rb.extend(data)
    assert len(rb) == 20
    assert storage.shape == torch.Size([5, 4])
    assert_same(rb[:], data)  # back in the layout given (envs first)
    sample = rb.sample()
    assert sample.batch_size == torch.Size([6])
    assert torch.equal(sample["obs"][:, 0].long(), sample["action"])
    rb.extend(rows(100, 4, time=10))  # 15 steps > 12 rows: wraps
    assert len(rb) == N * 4


# --------------------------------------------------------------------------------------------
# Positions
# --------------------------------------------------------------------------------------------
def test_set_and_get_at_positions(make):
    storage = make(N)
    storage.set(torch.arange(6), rows(0, 6))
    assert len(storage) == 6
    assert storage.get(torch.tensor([5, 0, 2]))["action"].tolist() == [5, 0, 2]
    assert storage.get(-1)["action"].item() == 5
    assert storage.get(slice(1, 3))["action"].tolist() == [1, 2]
    storage.set(2, rows(50, 1)[0], set_cursor=False)  # rewrite a held position
    assert len(storage) == 6
    assert storage[torch.arange(6)]["action"].tolist() == [0, 1, 50, 3, 4, 5]
    assert_same(storage[2], rows(50, 1)[0])
    assert storage.contains(3) and not storage.contains(6)


def test_rb_setitem_rewrites_in_place(make):
    rb = ReplayBuffer(storage=make(N), batch_size=2)
    rb.extend(rows(0, 5))
    rb[3] = rows(30, 1)[0]
    rb[1:2] = rows(10, 1)  # was "Could not infer dtype of slice"
    rb[torch.tensor([0, 4])] = rows(40, 2)
    assert len(rb) == 5
    assert rb[:]["action"].tolist() == [40, 10, 2, 30, 41]
    assert_same(rb[:], torch.stack([rows(i, 1)[0] for i in (40, 10, 2, 30, 41)]))


def test_rewrites_after_the_ring_wrapped(make):
    rb = ReplayBuffer(storage=make(N), batch_size=2)
    rb.extend(rows(0, N + 5))  # position p holds row 12 + p for p < 5, else p
    rb[torch.tensor([0, 7])] = rows(100, 2)
    got = rb[:]["action"].tolist()
    want = [N + p if p < 5 else p for p in range(N)]
    want[0], want[7] = 100, 101
    assert got == want


def test_new_positions_out_of_order_are_refused_by_shmbuf(make):
    """``LazyTensorStorage`` lets a write skip positions (holes hold garbage); shmbuf's ring
    refuses it before storing anything, naming the calls that work."""
    storage = make(N)
    storage.set(torch.arange(3), rows(0, 3))
    if isinstance(storage, Storage):
        with pytest.raises(CursorMismatchError, match="next positions in order") as info:
            storage.set(torch.tensor([1, 6]), rows(10, 2))
        assert isinstance(info.value, ShmbufError)
        assert storage[:]["action"].tolist() == [0, 1, 2]


def test_max_value_writer_keeps_the_best_rows(make):
    rb = TensorDictReplayBuffer(storage=make(6), batch_size=3,
                                writer=TensorDictMaxValueWriter(rank_key="score"))
    gen = torch.Generator().manual_seed(0)
    score = torch.randperm(30, generator=gen).float()
    for k in range(0, 30, 5):
        rb.extend(TensorDict({"score": score[k:k + 5], "id": torch.arange(k, k + 5)}, [5]))
    kept = rb[:]
    assert sorted(kept["score"].tolist()) == sorted(score.tolist())[-6:]
    assert torch.equal(score[kept["id"]], kept["score"])  # every row whole


def test_max_value_writer_add(make):
    rb = TensorDictReplayBuffer(storage=make(3), batch_size=1,
                                writer=TensorDictMaxValueWriter(rank_key="score"))
    for s in (5.0, 1.0, 7.0, 3.0, 9.0, 0.0):
        rb.add(TensorDict({"score": torch.tensor(s), "tag": torch.tensor(int(s) * 10)}, []))
    kept = rb[:]
    assert sorted(kept["score"].tolist()) == [5.0, 7.0, 9.0]
    assert torch.equal(kept["tag"], (kept["score"] * 10).long())


# --------------------------------------------------------------------------------------------
# State, pickling
# --------------------------------------------------------------------------------------------
def test_state_dict_round_trip(make):
    rb = ReplayBuffer(storage=make(N), batch_size=2)
    rb.extend(rows(0, N + 3))
    rb[4] = rows(99, 1)[0]
    state = rb.state_dict()
    again = ReplayBuffer(storage=make(N), batch_size=2)
    again.load_state_dict(state)
    assert len(again) == len(rb) == N
    assert_same(again[:], rb[:])
    again.extend(rows(200, 2))  # the writer's cursor came back too: the oldest go
    assert again[:]["action"].tolist() == rb[:]["action"].tolist()[:3] + [200, 201] + \
        rb[:]["action"].tolist()[5:]


def test_pickled_storage_holds_the_same_rows(make):
    storage = make(N)
    storage.set(torch.arange(5), rows(0, 5))
    copy = pickle.loads(pickle.dumps(storage))
    try:
        assert len(copy) == 5
        assert_same(copy.get(torch.arange(5)), rows(0, 5))
    finally:
        if isinstance(copy, Storage):
            copy.close()


# --------------------------------------------------------------------------------------------
# Samplers over the storage: the same draws from the same seed
# --------------------------------------------------------------------------------------------
def _draws(make, sampler, n_batches: int = 4, **rb_kw):
    rb = ReplayBuffer(storage=make(N * 2), sampler=sampler, batch_size=6, **rb_kw)
    rb.extend(rows(0, N * 2 + 4))
    torch.manual_seed(0)
    return [rb.sample(return_info=True) for _ in range(n_batches)]


@pytest.mark.parametrize("kind", ["random", "slice"])
def test_samplers_draw_the_same_rows(kind):
    def sampler():
        if kind == "random":
            return RandomSampler()
        return SliceSampler(num_slices=2, end_key=("next", "done"), strict_length=False)

    got = {}
    for name, cls in STORAGES.items():
        made = []

        def build(max_size, cls=cls, made=made, **kw):
            made.append(cls(max_size, **kw))
            return made[-1]

        try:
            got[name] = _draws(build, sampler())
        finally:
            for s in made:
                if isinstance(s, Storage):
                    s.close()
    for (a, ia), (b, ib) in zip(got["lazy"], got["shmbuf"]):
        assert_same(a, b)
        index_a, index_b = ia["index"], ib["index"]
        if not isinstance(index_a, tuple):
            index_a, index_b = (index_a,), (index_b,)
        assert all(torch.equal(torch.as_tensor(x), torch.as_tensor(y))
                   for x, y in zip(index_a, index_b, strict=True))
        assert torch.equal(a["obs"][:, 0].long(), a["action"])
    gc.collect()


@pytest.mark.usefixtures("segment_trees")
def test_prioritized_sampler_over_the_storage(make):
    rb = ReplayBuffer(storage=make(N), sampler=PrioritizedSampler(N, alpha=1.0, beta=0.5),
                      batch_size=400)
    rb.extend(rows(0, N))
    priority = torch.zeros(N, dtype=torch.float64)
    priority[[2, 9]] = torch.tensor([1.0, 3.0], dtype=torch.float64)
    rb.update_priority(torch.arange(N), priority + 1e-9)
    torch.manual_seed(0)
    sample, info = rb.sample(return_info=True)
    assert torch.equal(sample["action"], torch.as_tensor(info["index"]))
    counts = torch.bincount(sample["action"], minlength=N)
    assert counts[[2, 9]].sum() >= 395 and counts[9] > counts[2]


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------
def test_shmbuf_refuses_mismatched_rows_and_changes_nothing(make):
    storage = make(N)
    storage.set(torch.arange(3), rows(0, 3))
    if not isinstance(storage, Storage):
        return
    with pytest.raises(SpecMismatchError, match="'obs'"):
        storage.set(torch.arange(3, 5), rows(3, 2).exclude("obs"))
    with pytest.raises(SpecMismatchError, match="rows are a tensor"):
        storage.set(torch.arange(3, 5), torch.zeros(2, 3))
    with pytest.raises(CursorMismatchError, match="one position per row"):
        storage.set(torch.arange(3, 6), rows(3, 2))
    with pytest.raises(SpecMismatchError, match="bfloat16"):
        storage.set(0, TensorDict({"x": torch.zeros((), dtype=torch.bfloat16)}, []))
    assert storage[:]["action"].tolist() == [0, 1, 2]


# --------------------------------------------------------------------------------------------
# Writers in other processes (TorchRL's rb.share() pattern)
# --------------------------------------------------------------------------------------------
def _extend_rows(rb, first: int, n: int) -> None:
    for k in range(first, first + n, 3):
        rb.extend(rows(k, min(3, first + n - k)))
    if isinstance(rb.storage, Storage):
        rb.storage.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(STORAGES))
def test_writers_in_other_processes_deliver_every_row(kind, start_method):
    """A shared ReplayBuffer, its storage not yet written (``shared_init``): three worker
    processes extend it; the parent then holds every row exactly once, each whole. (The
    standard library's, under the start method TorchRL's own locks and counters are made
    with: they pickle only through the spawning Popen of their own context.)"""
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(start_method, force=True)
    try:
        storage = STORAGES[kind](60, shared_init=True)
        rb = ReplayBuffer(storage=storage, batch_size=4).share()
        procs = [multiprocessing.Process(target=_extend_rows, args=(rb, 20 * w, 20))
                 for w in range(3)]
    finally:
        multiprocessing.set_start_method(before, force=True)
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(CHILD_TIMEOUT)
        assert [p.exitcode for p in procs] == [0, 0, 0]
        assert len(rb) == 60
        got = rb[:]
        assert sorted(got["action"].tolist()) == list(range(60))
        assert_same(got, rows(0, 60)[got["action"]])
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if isinstance(storage, Storage):
            storage.close()
        del rb, procs, p, storage  # TorchRL's semaphores (named in /dev/shm) go now
        gc.collect()
