"""The compiled ``Writer.add`` (``shmbuf.addcompile``): what a normal writer runs; specs whose
field names would shadow the method's names fall back to the plain method; every input stores
byte-identical rows to the plain ``Writer.add`` and every bad input raises the same error and
changes nothing; a one-env ``VectorWriter`` stores what ``Writer.add`` stores.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import shmbuf
from shmbuf.writer import Writer

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64"]
SHAPES = [(), (1,), (3,), (2, 3)]


@contextlib.contextmanager
def twin_buffers(spec, **kw):
    """Two buffers of ``spec``: rows go to the first through the compiled add, to the second
    through the plain ``Writer.add``."""
    with shmbuf.ReplayBuffer.create(spec, capacity=64, **kw) as a, \
            shmbuf.ReplayBuffer.create(spec, capacity=64, **kw) as b:
        with a.writer(lane=0) as wa, b.writer(lane=0) as wb:
            assert type(wa).add is not Writer.add and hasattr(type(wa).add, "__source__")
            yield a, b, wa, wb


def segment_bytes(buf):
    st = buf.storage
    return (b"".join(c.tobytes() for c in st.columns.values()), st.stamps.tobytes(),
            st.meta.tobytes(), st.committed.tobytes(), st.reserved.tobytes())


def add_both(wa, wb, row):
    """The same row through both paths: equal results, or the same error type and message."""
    try:
        want = Writer.add(wb, **row)
    except Exception as e:  # noqa: BLE001 - whatever the plain path raises, compare it
        with pytest.raises(type(e)) as got:
            wa.add(**row)
        assert str(got.value) == str(e)
        return None
    assert wa.add(**row) == want
    return want


def inputs_for(dtype: np.dtype, shape: tuple, rng: np.random.Generator) -> list:
    """Every kind of value a field of ``dtype`` and ``shape`` can be given."""
    base = (rng.random(shape) * 100).astype(dtype) if dtype.kind != "b" else rng.random(shape) < .5
    out: list = [base, np.ascontiguousarray(base), base.astype(dtype.newbyteorder(">"))]
    wide = np.zeros((*shape[:-1], 2 * shape[-1]) if shape else (2,), dtype)
    if shape:
        wide[..., ::2] = base
        out.append(wide[..., ::2])  # not contiguous
    else:
        out += [base[()], np.asarray(base), wide[::2][:1].reshape(())]  # scalar, 0-d arrays
    for other in ("int8", "uint8", "int16", "float32", "float64", "int64", "bool"):
        out.append(base.astype(other))  # casts: safe ones store, unsafe ones raise alike
    if shape == ():
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            out += [int(info.min), int(info.max), int(info.min) - 1, int(info.max) + 1, 0, True]
        elif dtype.kind == "f":
            fi = np.finfo(dtype)
            out += [float(fi.max), -float(fi.max), float(fi.max) * 2, 1.5, 7, 2**60, True,
                    float("nan"), float("inf")]
        else:
            out += [True, False, 0, 1, 2, 0.5]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_input_stores_byte_identical_rows_to_the_plain_add(dtype):
    rng = np.random.default_rng(DTYPES.index(dtype))
    dt = np.dtype(dtype)
    spec = shmbuf.Spec({f"f{k}": (shape, dtype) for k, shape in enumerate(SHAPES)}
                       | {"tag": ((), "int64")})
    with twin_buffers(spec) as (a, b, wa, wb):
        for k, shape in enumerate(SHAPES):
            for value in inputs_for(dt, shape, rng):
                row = {f"f{j}": np.zeros(s, dtype) for j, s in enumerate(SHAPES)}
                row[f"f{k}"] = value
                row["tag"] = int(rng.integers(1 << 40))
                add_both(wa, wb, row)
                assert segment_bytes(a) == segment_bytes(b), (shape, type(value), value)
        assert wa.committed > 20


def test_mixed_spec_with_derived_next_obs_stores_the_same_rows_and_final_rows():
    spec = shmbuf.Spec(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                       done=((), "bool"))
    with twin_buffers(spec, next_obs="derived") as (a, b, wa, wb):
        for t in range(30):
            o = np.full(4, t, np.float32)
            row = {"obs": o, "action": t % 3, "reward": 0.5 * t, "done": t % 7 == 6,
                   "next_obs": o + 1}
            add_both(wa, wb, row)
            if t % 7 == 6:
                assert wa.end_episode() == wb.end_episode()
        assert segment_bytes(a) == segment_bytes(b)


BAD_ROWS = [
    {},  # nothing
    {"x": 1},  # missing fields
    {"obs": np.zeros(3, np.float32), "action": 1},  # missing reward
    {"obs": np.zeros(3, np.float32), "action": 1, "reward": 0.0, "extra": 1},
    {"obs": np.zeros(4, np.float32), "action": 1, "reward": 0.0},  # wrong shape
    {"obs": np.zeros((1, 3), np.float32), "action": 1, "reward": 0.0},
    {"obs": np.zeros(3, np.complex64), "action": 1, "reward": 0.0},  # unsafe dtype
    {"obs": np.zeros(3, np.float32), "action": 1.5, "reward": 0.0},  # float into int
    {"obs": np.zeros(3, np.float32), "action": 2**63, "reward": 0.0},  # out of range
    {"obs": np.zeros(3, np.float32), "action": "1", "reward": 0.0},
    {"obs": np.zeros(3, np.float32), "action": None, "reward": 0.0},
    {"obs": [0.0, 1.0], "action": 1, "reward": 0.0},
    {"obs": np.zeros(3, np.float32), "action": 1, "reward": np.zeros(2, np.float32)},
]


@pytest.mark.parametrize("k", range(len(BAD_ROWS)))
def test_bad_input_raises_the_same_typed_error_and_changes_nothing(k):
    spec = shmbuf.Spec(obs=((3,), "float32"), action=((), "int64"), reward=((), "float32"))
    with twin_buffers(spec) as (a, b, wa, wb):
        good = {"obs": np.ones(3, np.float32), "action": 2, "reward": 1.0}
        add_both(wa, wb, good)
        before = segment_bytes(a)
        with pytest.raises(Exception) as plain:
            Writer.add(wb, **BAD_ROWS[k])
        assert isinstance(plain.value, (shmbuf.ShmbufError, ValueError, TypeError))
        with pytest.raises(type(plain.value)) as compiled:
            wa.add(**BAD_ROWS[k])
        assert str(compiled.value) == str(plain.value)
        assert segment_bytes(a) == before
        assert add_both(wa, wb, good) == 1  # and the writer goes on


@pytest.mark.parametrize("name", ["lane", "i", "q", "s", "stamp", "np", "values", "fields"])
def test_a_field_named_like_a_name_of_the_method_falls_back_to_the_plain_add(name):
    spec = shmbuf.Spec({name: ((), "int64"), "x": ((2,), "float32")})
    with shmbuf.ReplayBuffer.create(spec, capacity=8) as buf:
        with buf.writer(lane=0) as w:
            assert type(w).add is Writer.add
            for j in range(10):
                assert w.add(**{name: j, "x": np.full(2, j, np.float32)}) == j
        rows = buf.get(np.arange(2, 10))
        assert rows[name].tolist() == list(range(2, 10))
        assert rows["x"][:, 1].tolist() == list(range(2, 10))
        with buf.writer(num_envs=1) as v:  # the one-env vector writer falls back too
            assert v.add(**{name: np.array([10]), "x": np.full((1, 2), 10, np.float32)}) == [10]


def test_one_env_vector_writer_stores_what_writer_add_stores_and_rejects_two_rows():
    spec = shmbuf.Spec(obs=((3,), "float32"), action=((), "int64"), reward=((), "float32"),
                       img=((2, 2), "uint8"))
    with shmbuf.ReplayBuffer.create(spec, capacity=16) as a, \
            shmbuf.ReplayBuffer.create(spec, capacity=16) as b:
        rng = np.random.default_rng(1)
        with a.writer(num_envs=1) as v, b.writer(lane=0) as w:
            assert type(v).add is not Writer.add and hasattr(type(v).add, "__source__")
            for t in range(40):
                row = {"obs": rng.random(3, dtype=np.float32), "action": int(rng.integers(9)),
                       "reward": float(rng.random()),
                       "img": rng.integers(0, 255, (2, 2)).astype(np.uint8)}
                got = v.add(**{k: np.asarray(x, spec[k].dtype)[None] for k, x in row.items()})
                assert got.tolist() == [Writer.add(w, **row)]
                if t % 9 == 8:
                    v.end_episode(np.array([True]))
                    w.end_episode()
            before = segment_bytes(a)
            assert before == segment_bytes(b)
            two = {k: np.zeros((2, *f.shape), f.dtype) for k, f in spec.items()}
            with pytest.raises((shmbuf.SpecMismatchError, ValueError)):
                v.add(**two)
            assert segment_bytes(a) == before


@pytest.mark.parametrize("make_row", [lambda x: x[None], lambda x: x.reshape(1, *x.shape),
                                      lambda x: np.expand_dims(x, 0)],
                         ids=["x[None]", "reshape", "expand_dims"])
def test_one_env_rows_of_each_usual_making_take_the_fast_path(make_row, monkeypatch):
    """``obs[None]`` has stride 0 on its first axis, ``reshape`` does not: both are one
    C-contiguous row, so both skip the full checker (``_add_checked``)."""
    spec = shmbuf.Spec(obs=((3,), "float32"), img=((2, 2), "uint8"), reward=((), "float32"))
    with shmbuf.ReplayBuffer.create(spec, capacity=16) as buf, buf.writer(num_envs=1) as v:
        slow = []
        monkeypatch.setattr(v, "_add_checked", lambda *a: slow.append(a))
        row = {"obs": np.arange(3, dtype=np.float32), "img": np.ones((2, 2), np.uint8),
               "reward": np.float32(0.5)}
        v.add(**{k: make_row(np.asarray(x)) for k, x in row.items()})
        assert slow == []
        got = buf.get(np.array([0]), 0)
        for k, x in row.items():
            np.testing.assert_array_equal(got[k][0], x)
