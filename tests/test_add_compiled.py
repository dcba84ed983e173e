"""A lane's store (``shmbuf.store``): the compiled one (``_add_c.c``) and the NumPy one store the
same bytes for every input (``add``, ``extend``, FINAL rows, a one-env vector writer); bad input
raises the same error through either and changes nothing; the compiled add stores the usual rows
without calling Python and hands everything else (values to convert, room to wait for, a closed
writer) to the Python ``add``; ``add`` names the spec's fields in its signature, whatever the
names; the compiled stores come in ``slots``' order. Tests marked with the ``store_path`` fixture
run twice: with the compiled store, and without it, as where no compiler was at hand.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pathlib
import pydoc
import subprocess
import sys

import numpy as np
import pytest

import shmbuf
from shmbuf import store
from shmbuf.rowcheck import RowChecker
from shmbuf.writer import LaneWriter

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64"]
SHAPES = [(), (1,), (3,), (2, 3)]
PACKAGE = pathlib.Path(shmbuf.__file__).parent
compiled_only = pytest.mark.skipif(store.CompiledStore is None, reason="_add_c was not built")


def use_numpy_store(monkeypatch) -> None:
    """Writers opened from now on get the NumPy store and add, as without ``_add_c``."""
    monkeypatch.setattr(store, "CompiledStore", None)
    monkeypatch.setattr(store, "CompiledAdd", None)


@pytest.fixture(params=["compiled", "numpy"])
def store_path(request, monkeypatch):
    """The compiled store (skipped where ``_add_c`` was not built), or the NumPy one."""
    if request.param == "compiled" and store.CompiledStore is None:
        pytest.skip("_add_c was not built")
    if request.param == "numpy":
        use_numpy_store(monkeypatch)
    return request.param


@contextlib.contextmanager
def twin_buffers(spec, monkeypatch, capacity=64, **kw):
    """Two buffers of ``spec``: the first written through the compiled store and add, the
    second through the NumPy ones."""
    with shmbuf.ReplayBuffer.create(spec, capacity=capacity, **kw) as a, \
            shmbuf.ReplayBuffer.create(spec, capacity=capacity, **kw) as b:
        with a.writer(lane=0) as wa:
            with monkeypatch.context() as m:
                use_numpy_store(m)
                wb = b.writer(lane=0)
            with wb:
                assert wa._store.compiled and not wb._store.compiled
                assert isinstance(type(wa).__dict__["add"], store.CompiledAdd)
                yield a, b, wa, wb


# An x87 long double (63-bit mantissa) holds its value in the first 10 of its 16 bytes; the rest
# is padding that NumPy's conversions leave undefined, so it is not compared.
LONG_DOUBLE_BYTES = 10 if np.finfo(np.longdouble).nmant == 63 else np.dtype(np.longdouble).itemsize


def column_bytes(col: np.ndarray) -> bytes:
    """The bytes of a column that hold its values."""
    if col.dtype.base.type not in (np.longdouble, np.clongdouble):
        return col.tobytes()
    size = np.dtype(np.longdouble).itemsize
    parts = np.ascontiguousarray(col).view(np.uint8).reshape(-1, size)
    return parts[:, :LONG_DOUBLE_BYTES].tobytes()


def segment_bytes(buf):
    st = buf.storage
    return (b"".join(column_bytes(c) for c in st.columns.values()), st.stamps.tobytes(),
            st.meta.tobytes(), st.committed.tobytes(), st.reserved.tobytes())


def same_result(fn_a, fn_b, *args, **kwargs):
    """``fn_a`` and ``fn_b`` called with the same arguments return the same, or raise the same
    error type and message."""
    try:
        want = fn_b(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the NumPy path raises, compare it
        with pytest.raises(type(e)) as got:
            fn_a(*args, **kwargs)
        assert str(got.value) == str(e)
        return None
    got = fn_a(*args, **kwargs)
    assert np.array_equal(got, want) if isinstance(want, np.ndarray) else got == want
    return want


def inputs_for(dtype: np.dtype, shape: tuple, rng: np.random.Generator) -> list:
    """Every kind of value a field of ``dtype`` and ``shape`` can be given."""
    base = (rng.random(shape) * 100).astype(dtype) if dtype.kind != "b" else rng.random(shape) < .5
    out: list = [base, np.ascontiguousarray(base), base.astype(dtype.newbyteorder(">"))]
    wide = np.zeros((*shape[:-1], 2 * shape[-1]) if shape else (2,), dtype)
    if shape:
        wide[..., ::2] = base
        out += [wide[..., ::2], np.asfortranarray(base), base[::-1], np.broadcast_to(base[..., :1], shape)]
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


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_input_stores_the_same_bytes_through_either_store(dtype, monkeypatch):
    rng = np.random.default_rng(DTYPES.index(dtype))
    dt = np.dtype(dtype)
    spec = shmbuf.Spec({f"f{k}": (shape, dtype) for k, shape in enumerate(SHAPES)}
                       | {"tag": ((), "int64")})
    with twin_buffers(spec, monkeypatch) as (a, b, wa, wb):
        for k, shape in enumerate(SHAPES):
            for value in inputs_for(dt, shape, rng):
                row = {f"f{j}": np.zeros(s, dtype) for j, s in enumerate(SHAPES)}
                row[f"f{k}"] = value
                row["tag"] = int(rng.integers(1 << 40))
                same_result(wa.add, wb.add, **row)
                assert segment_bytes(a) == segment_bytes(b), (shape, type(value), value)
        assert wa.committed > 20


@compiled_only
def test_extend_stores_the_same_bytes_through_either_store(monkeypatch):
    """Batches of every layout, crossing the ring's end and longer than the ring, with a cast
    and with a derived buffer's next_obs: the same rows, meta words, stamps and claims."""
    spec = shmbuf.Spec(obs=((2, 3), "float32"), img=((4, 4), "uint8"), action=((), "int64"),
                       reward=((), "float32"))
    rng = np.random.default_rng(3)
    with twin_buffers(spec, monkeypatch, capacity=16, next_obs="derived") as (a, b, wa, wb):
        for n in (3, 5, 15, 16, 17, 40, 1, 0, 9):
            batch = {"obs": rng.random((n, 2, 3), np.float32),
                     "img": rng.integers(0, 255, (n, 4, 4)).astype(np.uint8),
                     "action": rng.integers(0, 9, n), "reward": rng.random(n),  # float64: cast
                     "next_obs": rng.random((n, 2, 3), np.float32)}
            if n % 2:  # other layouts: reversed, Fortran-ordered, transposed rows
                batch["obs"] = batch["obs"][::-1]
                batch["img"] = np.asfortranarray(batch["img"]).transpose(0, 2, 1)
            same_result(wa.extend, wb.extend, batch)
            assert segment_bytes(a) == segment_bytes(b), n
            if n == 5:
                assert wa.end_episode() == wb.end_episode()  # a FINAL row from the pending one
                assert segment_bytes(a) == segment_bytes(b)


@compiled_only
def test_mixed_spec_with_derived_next_obs_stores_the_same_rows_and_final_rows(monkeypatch):
    spec = shmbuf.Spec(obs=((4,), "float32"), action=((), "int64"), reward=((), "float32"),
                       done=((), "bool"))
    with twin_buffers(spec, monkeypatch, next_obs="derived") as (a, b, wa, wb):
        for t in range(30):
            o = np.full(4, t, np.float32)
            row = {"obs": o, "action": t % 3, "reward": 0.5 * t, "done": t % 7 == 6,
                   "next_obs": o[::-1] + 1 if t % 2 else o + 1}
            same_result(wa.add, wb.add, **row)
            if t % 7 == 6:
                assert wa.end_episode() == wb.end_episode()
        assert segment_bytes(a) == segment_bytes(b)


@compiled_only
@pytest.mark.parametrize("next_obs", ["stored", "derived"])
def test_vector_writers_store_the_same_bytes_through_either_store(monkeypatch, next_obs):
    """A step of every env (``put_lanes`` through the lanes' compiled stores, or NumPy's
    ``LanesStore``): rows of every layout, casts, episode ends of some envs (with FINAL rows in a
    derived buffer), across the ring's end; bad steps raise alike and change nothing."""
    spec = shmbuf.Spec(obs=((2, 3), "float32"), img=((4, 4), "uint8"), action=((), "int64"),
                       reward=((), "float32"))
    n, rng = 4, np.random.default_rng(5)
    with shmbuf.ReplayBuffer.create(spec, capacity=16, lanes=n, next_obs=next_obs) as a, \
            shmbuf.ReplayBuffer.create(spec, capacity=16, lanes=n, next_obs=next_obs) as b:
        with a.writer(num_envs=n) as va:
            with monkeypatch.context() as m:
                use_numpy_store(m)
                vb = b.writer(num_envs=n)
            with vb:
                assert isinstance(va._store, store.CompiledLanesStore)
                assert isinstance(vb._store, store.LanesStore)
                for t in range(40):
                    step = {"obs": rng.random((n, 2, 3), np.float32),
                            "img": rng.integers(0, 255, (n, 4, 4)).astype(np.uint8),
                            "action": rng.integers(0, 9, n), "reward": rng.random(n),  # a cast
                            "next_obs": rng.random((n, 2, 3), np.float32)}
                    if next_obs == "stored":  # (not a field of the spec then)
                        del step["next_obs"]
                    if t % 2:  # other layouts: reversed, Fortran-ordered, transposed rows
                        step["obs"] = step["obs"][::-1]
                        step["img"] = np.asfortranarray(step["img"]).transpose(0, 2, 1)
                    if t % 5 == 4:  # one row too many, a cast NumPy refuses: nothing stored
                        bad = dict(step, action=rng.random(n) + 0.5)
                        same_result(va.add, vb.add, **bad)
                        same_result(va.add, vb.add, **{k: np.concatenate([v, v[:1]])
                                                       for k, v in step.items()})
                        assert segment_bytes(a) == segment_bytes(b), t
                    same_result(va.add, vb.add, **step)
                    if t % 3 == 2:  # some envs end: derived buffers store their FINAL rows
                        ends = rng.random(n) < 0.5
                        np.testing.assert_array_equal(va.end_episode(ends), vb.end_episode(ends))
                    assert segment_bytes(a) == segment_bytes(b), t
                assert (a.committed() > 16).all()  # round the ring


@compiled_only
def test_wide_scalar_fields_store_the_same_bytes_through_either_store(monkeypatch):
    """Scalars wider than the compiled store's scratch (complex of two long doubles), long
    doubles and a byte-swapped field: converted by NumPy before the stores, in either store."""
    spec = shmbuf.Spec(z=((), "clongdouble"), x=((), "longdouble"), c=((), "complex64"),
                       v=((2,), "clongdouble"), be=((3,), ">f4"))
    with twin_buffers(spec, monkeypatch) as (a, b, wa, wb):
        for t in range(12):
            row = {"z": np.clongdouble(t + 0.5j) if t % 2 else complex(t, -t),
                   "x": np.longdouble(t) / 3 if t % 3 else float(t), "c": complex(t, 1),
                   "v": np.full(2, t - 1j, np.clongdouble),
                   "be": np.arange(3, dtype=">f4") * t if t % 2 else np.arange(3.0) * t}
            same_result(wa.add, wb.add, **row)
        assert segment_bytes(a) == segment_bytes(b)


BAD_ROWS = [
    {},  # nothing
    {"x": 1},  # missing fields
    {"obs": np.zeros(3, np.float32), "action": 1},  # missing reward
    {"obs": np.zeros(3, np.float32), "action": 1, "reward": 0.0, "extra": 1},
    {"obs": np.zeros(3, np.float32), "action": 1, "rewrd": 0.0},  # misspelt
    {"obs": np.zeros(4, np.float32), "action": 1, "reward": 0.0},  # wrong shape
    {"obs": np.zeros((1, 3), np.float32), "action": 1, "reward": 0.0},
    {"obs": np.zeros(1, np.float32), "action": 1, "reward": 0.0},  # would broadcast
    {"obs": np.zeros(3, np.complex64), "action": 1, "reward": 0.0},  # unsafe dtype
    {"obs": np.zeros(3, np.float32), "action": 1.5, "reward": 0.0},  # float into int
    {"obs": np.zeros(3, np.float32), "action": 2**63, "reward": 0.0},  # out of range
    {"obs": np.zeros(3, np.float32), "action": "1", "reward": 0.0},
    {"obs": np.zeros(3, np.float32), "action": None, "reward": 0.0},
    {"obs": [0.0, 1.0], "action": 1, "reward": 0.0},
    {"obs": np.zeros(3, np.float32), "action": 1, "reward": np.zeros(2, np.float32)},
    {"obs": np.zeros(3, np.float32), "action": 1, "reward": 1e39},  # inf in float32
]


@compiled_only
@pytest.mark.parametrize("k", range(len(BAD_ROWS)))
def test_bad_input_raises_the_same_typed_error_through_either_store_and_changes_nothing(
        k, monkeypatch):
    spec = shmbuf.Spec(obs=((3,), "float32"), action=((), "int64"), reward=((), "float32"))
    with twin_buffers(spec, monkeypatch) as (a, b, wa, wb):
        good = {"obs": np.ones(3, np.float32), "action": 2, "reward": 1.0}
        same_result(wa.add, wb.add, **good)
        before = segment_bytes(a)
        with pytest.raises(Exception) as numpy_error:
            wb.add(**BAD_ROWS[k])
        assert isinstance(numpy_error.value, (shmbuf.SpecMismatchError, TypeError))
        with pytest.raises(type(numpy_error.value)) as compiled_error:
            wa.add(**BAD_ROWS[k])
        assert str(compiled_error.value) == str(numpy_error.value)
        assert segment_bytes(a) == before
        assert same_result(wa.add, wb.add, **good) == 1  # it goes on


def test_positional_arguments_are_a_type_error_and_change_nothing(store_path):
    spec = shmbuf.Spec(x=((), "int64"))
    with shmbuf.ReplayBuffer.create(spec, capacity=4) as buf, buf.writer() as w:
        with pytest.raises(TypeError, match="positional"):
            w.add(1)
        assert w.committed == 0 and w.add(x=1) == 0


# --------------------------------------------------------------------------------------------
# The signature of add, and field names
# --------------------------------------------------------------------------------------------
def test_add_names_the_fields_in_its_signature_and_help(store_path):
    spec = shmbuf.Spec(obs=((3,), "float32"), action=((), "int64"), reward=((), "float32"))
    with shmbuf.ReplayBuffer.create(spec, capacity=4, lanes=2) as buf, \
            buf.writer(lane=0) as w, buf.writer(num_envs=1) as v:
        for writer, annotation, returns in ((w, "float32 (3,)", "int"),
                                            (v, "float32 (1, 3)", "np.ndarray")):
            sig = inspect.signature(writer.add)
            assert list(sig.parameters) == ["obs", "action", "reward"]
            assert all(p.kind is p.KEYWORD_ONLY for p in sig.parameters.values())
            assert sig.parameters["obs"].annotation == annotation
            assert sig.return_annotation == returns
            assert list(inspect.signature(type(writer).add).parameters)[0] == "self"
            text = pydoc.render_doc(writer.add, renderer=pydoc.plaintext)
            assert "obs:" in text and "reward:" in text and "Append one transition" in text
        with pytest.raises(shmbuf.SpecMismatchError, match="did you mean 'action'"):
            w.add(obs=np.zeros(3, np.float32), actoin=1, reward=0.0)
        with pytest.raises(shmbuf.SpecMismatchError, match="did you mean 'action'"):
            v.add(obs=np.zeros((1, 3), np.float32), actoin=np.ones(1, np.int64),
                  reward=np.ones(1, np.float32))


@pytest.mark.parametrize("name", ["lane", "i", "q", "s", "slots", "L", "np", "values", "fields",
                                  "self", "store", "obs/joint", "class", "2x"])
def test_any_field_name_works_and_the_signature_says_what_it_can(name, store_path):
    """No source is generated, so a field may be named like anything in the writer's code,
    or be no identifier at all (SB3's Dict spaces give ``obs/<key>``); such a name's
    signature is ``(**fields)``."""
    spec = shmbuf.Spec({name: ((), "int64"), "x": ((2,), "float32")})
    with shmbuf.ReplayBuffer.create(spec, capacity=8, lanes=2) as buf:
        with buf.writer(lane=0) as w:
            for j in range(10):
                assert w.add(**{name: j, "x": np.full(2, j, np.float32)}) == j
            params = list(inspect.signature(w.add).parameters)
            ok = name.isidentifier() and name not in ("class", "self")
            assert params == ([name, "x"] if ok else ["fields"])
        rows = buf.get(np.arange(2, 10))
        assert rows[name].tolist() == list(range(2, 10))
        assert rows["x"][:, 1].tolist() == list(range(2, 10))
        with buf.writer(num_envs=1) as v:
            got = v.add(**{name: np.array([10]), "x": np.full((1, 2), 10, np.float32)})
            assert got.tolist() == [v.committed[0] - 1]


# --------------------------------------------------------------------------------------------
# The one-env vector writer
# --------------------------------------------------------------------------------------------
def test_one_env_vector_writer_stores_what_writer_add_stores_and_rejects_two_rows(store_path):
    spec = shmbuf.Spec(obs=((3,), "float32"), action=((), "int64"), reward=((), "float32"),
                       img=((2, 2), "uint8"))
    with shmbuf.ReplayBuffer.create(spec, capacity=16) as a, \
            shmbuf.ReplayBuffer.create(spec, capacity=16) as b:
        rng = np.random.default_rng(1)
        with a.writer(num_envs=1) as v, b.writer(lane=0) as w:
            assert v._store is v._lane._store and v._store.compiled == (store_path == "compiled")
            for t in range(40):
                row = {"obs": rng.random(3, dtype=np.float32), "action": int(rng.integers(9)),
                       "reward": float(rng.random()),
                       "img": rng.integers(0, 255, (2, 2)).astype(np.uint8)}
                env = {k: np.asarray(x, spec[k].dtype)[None] for k, x in row.items()}
                if t % 3 == 1:  # other layouts and a list
                    env["img"] = np.asfortranarray(env["img"])[:, ::-1, :][:, ::-1, :]
                    env["reward"] = [row["reward"]]
                got = v.add(**env)
                assert got.tolist() == [w.add(**row)]
                assert got.dtype == np.int64 and got.shape == (1,) and got.flags.writeable
                if t % 9 == 8:
                    v.end_episode(np.array([True]))
                    w.end_episode()
            before = segment_bytes(a)
            assert before == segment_bytes(b)
            two = {k: np.zeros((2, *f.shape), f.dtype) for k, f in spec.items()}
            with pytest.raises(shmbuf.SpecMismatchError, match="num_envs=1"):
                v.add(**two)
            assert segment_bytes(a) == before


@pytest.mark.parametrize("make_row", [lambda x: x[None], lambda x: x.reshape(1, *x.shape),
                                      lambda x: np.expand_dims(x, 0)],
                         ids=["x[None]", "reshape", "expand_dims"])
def test_one_env_rows_of_each_usual_making_take_the_fast_path(make_row, store_path,
                                                              monkeypatch):
    """``obs[None]`` has stride 0 on its first axis, ``reshape`` does not: both are one row
    that stores as it is. The compiled add stores it without calling Python at all; the
    NumPy one takes the checker's fast path, not ``check_batch``."""
    calls = count_checker_calls(monkeypatch)
    spec = shmbuf.Spec(obs=((3,), "float32"), img=((2, 2), "uint8"), reward=((), "float32"))
    with shmbuf.ReplayBuffer.create(spec, capacity=16) as buf, buf.writer(num_envs=1) as v:
        row = {"obs": np.arange(3, dtype=np.float32), "img": np.ones((2, 2), np.uint8),
               "reward": np.float32(0.5)}
        v.add(**{k: make_row(np.asarray(x)) for k, x in row.items()})  # (room: the first add)
        calls.clear()
        v.add(**{k: make_row(np.asarray(x)) for k, x in row.items()})
        assert calls == ([] if store_path == "compiled" else ["fast_row"])
        got = buf.get(np.array([1]), 0)
        for k, x in row.items():
            np.testing.assert_array_equal(got[k][0], x)


# --------------------------------------------------------------------------------------------
# What the compiled add stores by itself
# --------------------------------------------------------------------------------------------
USUAL = shmbuf.Spec(obs=((5,), "float32"), img=((2, 3), "uint8"), action=((), "int64"),
                    reward=((), "float32"), done=((), "bool"), value=((), "float64"))


def usual_row(t: int) -> dict:
    return {"obs": np.full(5, t, np.float32), "img": np.full((2, 3), t % 256, np.uint8),
            "action": t, "reward": 0.5 * t, "done": t % 3 == 0, "value": -1.5 * t}


def count_checker_calls(monkeypatch) -> list[str]:
    """Records each call of the row checker's ``fast_row``, ``check_row`` and ``check_batch``
    and each wait for room (``_make_room``) by writers opened from now on."""
    calls: list[str] = []

    def counted(cls, name):
        fn = getattr(cls, name)

        def call(*args, **kw):
            calls.append(name)
            return fn(*args, **kw)
        monkeypatch.setattr(cls, name, call)

    for name in ("fast_row", "check_row", "check_batch"):
        counted(RowChecker, name)
    counted(LaneWriter, "_make_room")
    return calls


def test_the_usual_inputs_take_the_compiled_add_and_the_rest_the_python_one(store_path,
                                                                           monkeypatch):
    """Arrays of the field's dtype and shape (any strides), Python numbers that fit and the
    field's own NumPy scalars are stored by the compiled add with no Python call; a value to
    convert takes the checker, then the store's ``append`` (which converts it as NumPy
    does); either way the row holds the value."""
    calls = count_checker_calls(monkeypatch)
    own = {"obs": np.zeros(10, np.float32)[::2], "img": np.zeros((3, 2), np.uint8).T,
           "action": np.int64(7), "reward": np.float32(2.5), "done": np.bool_(True),
           "value": np.float64(3.0)}
    converted = [("obs", np.arange(5.0)), ("action", np.int32(3)), ("reward", np.float64(1.0)),
                 ("img", np.eye(2, 3, dtype=bool)), ("value", 2**70), ("obs", [1, 2, 3, 4, 5])]
    with shmbuf.ReplayBuffer.create(USUAL, capacity=64) as buf, buf.writer() as w:
        for t in range(10):
            w.add(**usual_row(t))
        w.add(**own)
        python = ["fast_row", "_make_room"]  # the first add: no room was granted yet
        assert calls == (python if store_path == "compiled" else python + ["fast_row"] * 10)
        for k, (name, value) in enumerate(converted):
            calls.clear()
            w.add(**{**usual_row(20 + k), name: value})
            assert calls == ["fast_row", "check_row", "fast_row"], name
        rows = buf.get(np.arange(11, 11 + len(converted)))
        for k, (name, value) in enumerate(converted):
            np.testing.assert_array_equal(rows[name][k], np.asarray(value, USUAL[name].dtype))
        np.testing.assert_array_equal(buf.get(np.array([10]))["img"][0], own["img"])


def test_room_from_the_rate_limiter_is_the_python_adds_business(store_path, monkeypatch):
    """The compiled add stores nothing once the room granted is used up or void (a new
    limiter generation); the Python add waits for room, then stores the row."""
    calls = count_checker_calls(monkeypatch)
    with shmbuf.ReplayBuffer.create(USUAL, capacity=64) as buf, buf.writer() as w:
        w.add(**usual_row(0))
        w.add(**usual_row(1))
        assert calls.count("_make_room") == 1
        w._room_until = w.committed  # used up
        w.add(**usual_row(2))
        w._lim_gen = -1  # void: the pool changed the limit
        w.add(**usual_row(3))
        w.add(**usual_row(4))
        assert calls.count("_make_room") == 3
        assert calls.count("fast_row") == (3 if store_path == "compiled" else 5)
        assert buf.get(np.arange(5))["action"].tolist() == [0, 1, 2, 3, 4]


def test_a_closed_writer_raises_and_lets_the_buffer_unmap_its_segment(store_path, recwarn):
    """The store holds the segment's memory: closing the writer lets it go, so the buffer
    unmaps without its "stays mapped" warning, and the writer's add raises ClosedError."""
    buf = shmbuf.ReplayBuffer.create(USUAL, capacity=8)
    w = buf.writer()
    w.add(**usual_row(0))
    w.close()
    with pytest.raises(shmbuf.ClosedError):
        w.add(**usual_row(1))
    with pytest.raises(shmbuf.ClosedError):
        w.extend({k: np.asarray(x)[None] for k, x in usual_row(1).items()})
    assert w.committed == 1
    buf.close()
    assert not [str(x.message) for x in recwarn if "stays mapped" in str(x.message)]


@pytest.mark.timeout(60)
def test_a_forked_childs_writer_is_closed_in_the_compiled_add_too(store_path):
    """After fork the child's copy of the writer is closed: its add raises ClosedError and
    stores nothing (the parent still writes the lane)."""
    with shmbuf.ReplayBuffer.create(USUAL, capacity=8) as buf, buf.writer() as w:
        w.add(**usual_row(0))
        pid = os.fork()
        if pid == 0:  # the child: report by exit status only
            code = 1
            try:
                w.add(**usual_row(1))
            except shmbuf.ClosedError:
                code = 0 if buf.committed(0) == 1 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert w.add(**usual_row(1)) == 1


# --------------------------------------------------------------------------------------------
# The stores themselves
# --------------------------------------------------------------------------------------------
def test_put_append_and_put_many_publish_rows_by_the_protocol(store_path):
    """``put`` at an explicit index (FINAL rows; a writer at an index later), ``append`` at
    the cursor only while room is left, ``put_many`` keeping the last ``capacity`` rows: the
    windows, stamps and meta words a reader checks."""
    spec = shmbuf.Spec(x=((), "int64"), obs=((2,), "float32"))
    with shmbuf.ReplayBuffer.create(spec, capacity=4) as buf, buf.writer() as w:
        st = w._store
        assert st.append([1, np.zeros(2, np.float32)]) is None  # no room granted yet
        assert buf.committed(0) == 0 and not buf.storage.stamps.any()
        st.room_until, st.lim_gen = 3, buf.storage.words[buf.storage.limiter.generation_index]
        assert [st.append([i, np.full(2, i, np.float32)]) for i in range(4)] == [0, 1, 2, None]
        assert (st.next, st.step) == (3, 3)
        st.put(3, shmbuf.layout.pack_meta(0, 3), [3, [3.0, 3.0]])  # converted as NumPy does
        st.put_many(4, shmbuf.layout.pack_meta(0, 4),
                    [np.arange(4, 10), np.repeat(np.arange(4.0, 10.0), 2).reshape(6, 2)])
        assert buf.committed(0) == 10 and buf.windows().lo[0] == 6
        rows = buf.get(np.arange(6, 10))
        assert rows["x"].tolist() == [6, 7, 8, 9] and rows["obs"][:, 1].tolist() == [6, 7, 8, 9]
        assert sorted(buf.storage.stamps.tolist()) == [14, 16, 18, 20]
        assert sorted(buf.storage.meta.tolist()) == [6, 7, 8, 9]
        st.next = 10  # (the writer's count, so that its close() is ordinary)


@compiled_only
def test_the_compiled_store_refuses_what_does_not_fit_its_lane():
    words = memoryview(bytearray(8 * 64)).cast("q")
    at = (0, 1, 2, 8, 16, 8, (1 << 31) - 1)  # committed, reserved, lim_gen, stamps, meta, C
    f32 = np.dtype(np.float32)

    def field(dest, shape=(3,), numbers=False):
        return (f32, shape, dest, False, numbers, False, False, 1, 0, 1.0, 0.0)

    store.CompiledStore(words, at, ("a",), [field(np.zeros((8, 3), f32))])  # fits
    with pytest.raises(ValueError, match="destination"):
        store.CompiledStore(words, at, ("a",), [field(np.zeros((7, 3), f32))])
    with pytest.raises(ValueError, match="destination"):  # the pending row holds one row
        store.CompiledStore(words, at, ("a", "b"), [field(np.zeros((8, 3), f32))],
                            field(np.zeros((2, 3), f32)))
    with pytest.raises(ValueError, match="outside the segment"):
        store.CompiledStore(words, (0, 1, 2, 8, 60, 8, 1), ("a",), [field(np.zeros((8, 3), f32))])
    with pytest.raises(ValueError, match="scalar"):
        store.CompiledStore(words, at, ("a",), [field(np.zeros((8, 3), f32), numbers=True)])
    with pytest.raises(ValueError, match="fields"):
        n = store.COMPILED_MAX_FIELDS + 1
        store.CompiledStore(words, at, tuple(map(str, range(n))),
                            [field(np.zeros((8, 3), f32))] * n)
    lane = store.CompiledStore(words, at, ("a",), [field(np.zeros((8, 3), f32))])
    with pytest.raises(ValueError, match=r"shape \(4,\) for a row of shape \(3,\)"):
        lane.put(0, 0, [np.ones(4, f32)])  # a row of the wrong shape: nothing stored
    with pytest.raises(ValueError, match=r"shape \(2, 4\) for rows of shape \('n', 3\)"):
        lane.put_many(0, 0, [np.ones((2, 4), f32)])
    with pytest.raises(ValueError, match="2 values for 1 fields"):
        lane.put(0, 0, [np.ones(3, f32)] * 2)
    with pytest.raises(ValueError, match="< 0"):
        lane.put(-1, 0, [np.ones(3, f32)])
    assert lane.append([np.ones(3, f32)]) is None  # no room: nothing stored
    assert not any(words.tolist())
    lane.release()
    lane.release()  # idempotent
    with pytest.raises(ValueError, match="released"):
        lane.put(0, 0, [np.ones(3, f32)])


def test_shmbuf_store_numpy_leaves_the_compiled_store_out():
    """``SHMBUF_STORE=numpy`` (as ``SHMBUF_SUMTREE=numpy``) gives a process the NumPy store."""
    code = ("import shmbuf, numpy as np\n"
            "with shmbuf.ReplayBuffer.create(shmbuf.Spec(x=((), 'int64')), 4) as b, "
            "b.writer() as w:\n"
            "    w.add(x=1)\n"
            "    print(w._store.compiled, type(type(w).add).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SHMBUF_STORE": "numpy"},
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "function"]


def test_ci_builds_the_compiled_store():
    """Where ``SHMBUF_REQUIRE_COMPILED`` is set (``.ci/run``), ``_add_c`` must have been built."""
    if not os.environ.get("SHMBUF_REQUIRE_COMPILED"):
        pytest.skip("SHMBUF_REQUIRE_COMPILED is not set")
    assert store.CompiledStore is not None
    with shmbuf.ReplayBuffer.create(USUAL, capacity=4) as buf, buf.writer() as w:
        assert w._store.compiled


def _in_order(body: str, steps: list[str], where: str) -> None:
    at = 0
    for step in steps:
        found = body.find(step, at)
        assert found >= 0, f"_add_c.c's {where}: {step!r} missing or out of order"
        at = found + len(step)


def test_the_compiled_stores_come_in_slots_order():
    """``store_row`` (one row: add, append, put) and ``put_many`` are the only write paths
    outside ``slots.py``. Their stores, read from the source, come in ``write_row``'s and the
    ring steps' order, with a store barrier after the odd stamps, before the even ones and
    before ``committed``, and sfences around the rows' bytes. The byte-identity tests show
    what they store, not when: this pins the when."""
    source = (PACKAGE / "_add_c.c").read_text()
    row = source[source.index("static int store_row("):]
    row = row[:row.index("\n}\n")]
    _in_order(row, [
        "store_word(w + st->w_reserved, i + 1)",  # claim
        "store_word(w + st->stamp0 + s, 2 * i + 1)",  # odd stamp
        "store_order()",
        "_mm_sfence()",
        "copy_block(",  # the row
        "_mm_sfence()",
        "store_word(w + st->meta0 + s, meta)",  # meta
        "store_order()",
        "store_word(w + st->stamp0 + s, 2 * i + 2)",  # even stamp
        "store_order()",
        "store_word(w + st->w_committed, i + 1)",  # committed
    ], "store_row")
    assert row.count("store_word(") == 5, "a store to a seqlock word this test does not place"
    many = source[source.index("static PyObject *store_put_many("):]
    many = many[:many.index("\n}\n")]
    _in_order(many, [
        "store_word(w + st->w_reserved, end)",  # claim
        "store_word(w + st->stamp0 + (a0 + j) % C, 2 * (lo + j) + 1)",  # odd stamps
        "store_order()",
        "_mm_sfence()",
        "copy_block(",  # the rows
        "_mm_sfence()",
        "store_word(w + st->meta0 + seg_slot[g] + j, k0 + j)",  # meta
        "store_order()",
        "store_word(w + st->stamp0 + (a0 + j) % C, 2 * (lo + j) + 2)",  # even stamps
        "store_order()",
        "store_word(w + st->w_committed, end)",  # committed
    ], "put_many")
    assert many.count("store_word(") == 5, "a store to a seqlock word this test does not place"
